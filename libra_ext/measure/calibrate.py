"""`libra calibrate`: measure the attention kernel on this device and write a hardware profile.

The simulator's attention term is pairs x 4 d x heads / (peak x efficiency(attended length)),
with backward at `backward_speed_ratio` of the forward speed and a floor per kernel call. This
measures all of them with the kernel the runtime picks here (the same backend ladder):

- for each attended length L of a grid, one batched call over whole causal documents of L
  tokens (as many as fill `tokens`), forward and forward + backward: the forward TFLOP/s at L;
  the efficiency curve is that over the best one (`peak_tflops`);
- query tiles as TAP cuts them (the last q rows of a document against its whole prefix), for the
  record: their TFLOP/s beside a whole document of the same attended length;
- the backward speed ratio at the longest length; the call floor from a one-row call.

The profile keeps the base profile's compute peak, GEMM efficiency and network (not measured
here) and says so; `measured` records device, date, software and shapes.

On the CPU it measures what a training rank's kernel timer and `libra bench replay` measure:
the kernel on `threads` intra-op threads (default 1, a rank's share where several local workers
share the cores, as `libra train` gives them), timed by the calling thread's CPU time when that
is one thread (`counters.cpu_clock`). A profile timed on every core with wall time prices a
rank's attention at a rate no rank runs at (on this project's 2-core host, the `profile` cost
table of a two-thread wall-time profile missed the replay's rank times by 30%; of a one-thread
profile, by 7%).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import torch
import yaml

from libra_ext.attention.counters import cpu_clock, timed_as_a_rank
from libra_ext.attention.kernels import backend_for, segments_on
from libra_ext.simulator.hardware import HARDWARE_DIR, MEASURED_SCHEMA, HardwareProfile

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:  # the thread's CPU time on one intra-op thread, else wall time
            clock = cpu_clock()
            t0 = clock()
            fn()
            times.append(clock() - t0)
    return float(np.median(times))


class _Bench:
    def __init__(self, device, dtype, heads, kv_heads, head_dim, backend):
        self.dev, self.dtype = device, dtype
        self.h, self.hk, self.d = heads, kv_heads, head_dim
        self.kernel = backend_for(torch.zeros(1, 1, head_dim, device=device, dtype=dtype), backend)
        self.gen = torch.Generator(device=device).manual_seed(0)

    def _rand(self, n, h):
        return torch.randn(n, h, self.d, device=self.dev, dtype=self.dtype, generator=self.gen)

    def measure(self, q_lens: list[int], kv_lens: list[int], reps: int) -> dict:
        """Forward and forward + backward seconds of one call over segments whose query rows
        are the last q of a kv-long causal prefix; and its causal pairs per head."""
        cu_q, cu_k = np.r_[0, np.cumsum(q_lens)], np.r_[0, np.cumsum(kv_lens)]
        seg = segments_on(cu_q, cu_k, self.dev)
        q, k = self._rand(int(cu_q[-1]), self.h), self._rand(int(cu_k[-1]), self.hk)
        v = self._rand(int(cu_k[-1]), self.hk)
        grad = self._rand(int(cu_q[-1]), self.h)
        scale = self.d**-0.5

        def fwd():
            with torch.no_grad():
                self.kernel.attend(q, k, v, seg, scale)

        def both():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = self.kernel.attend(qq, kk, vv, seg, scale)
            torch.autograd.grad(out, (qq, kk, vv), grad)

        pairs = sum(
            qi * (kv - qi) + qi * (qi + 1) // 2 for qi, kv in zip(q_lens, kv_lens, strict=True)
        )
        return {"fwd_s": _timed(fwd, self.dev, reps), "both_s": _timed(both, self.dev, reps),
                "pairs": int(pairs)}


def calibrate(
    device: str = "cuda",
    dtype: str = "bf16",
    heads: int = 4,
    kv_heads: int = 1,
    head_dim: int = 128,
    lengths: tuple = (128, 512, 1024, 2048, 4096, 8192, 16384),
    tokens: int = 65536,
    reps: int = 3,
    backend: str | None = None,
    threads: int | None = None,
) -> dict:
    """Measurements and the attention section of a profile (see the module docstring);
    `threads`: intra-op threads on the CPU (None: 1), not allowed on CUDA."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if heads <= 0 or kv_heads <= 0 or head_dim <= 0 or heads % kv_heads:
        raise ValueError(
            f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads}); "
            f"head_dim ({head_dim}) positive"
        )
    if not lengths or any(L <= 0 for L in lengths) or list(lengths) != sorted(set(lengths)):
        raise ValueError(f"lengths must be positive and increasing, got {list(lengths)}")
    if tokens < max(lengths):
        raise ValueError(f"tokens ({tokens}) must hold at least one document of {max(lengths)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but no GPU is available")
    if threads is not None and (dev.type != "cpu" or not 1 <= threads <= 1024):
        raise ValueError(f"threads: intra-op threads on the cpu, 1 to 1024, got {threads} on "
                         f"{dev.type}")
    with timed_as_a_rank(dev, threads or 1):
        return _calibrate(dev, dtype, heads, kv_heads, head_dim, lengths, tokens, reps, backend)


def _calibrate(dev, dtype, heads, kv_heads, head_dim, lengths, tokens, reps, backend) -> dict:
    b = _Bench(dev, DTYPES[dtype], heads, kv_heads, head_dim, backend)
    flop = 4.0 * head_dim * heads  # forward FLOPs per causal pair, all heads
    rows = []
    for L in lengths:
        n = max(1, tokens // L)
        m = b.measure([L] * n, [L] * n, reps)
        rows.append({"tokens": L, "documents": n, **m,
                     "fwd_tflops": flop * m["pairs"] / m["fwd_s"] / 1e12,
                     "bwd_tflops": 2.5 * flop * m["pairs"] / max(m["both_s"] - m["fwd_s"], 1e-12)
                     / 1e12})
    tiles = []
    for L in lengths[1:]:
        for q in sorted({max(1, L // 8), max(1, L // 2)}):
            n = max(1, tokens // L)
            m = b.measure([q] * n, [L] * n, reps)
            tiles.append({"q": q, "kv": L, "documents": n, **m,
                          "fwd_tflops": flop * m["pairs"] / m["fwd_s"] / 1e12})
    floor = b.measure([1], [16], reps)
    peak = max(r["fwd_tflops"] for r in rows)
    longest = rows[-1]
    return {
        "rows": rows,
        "tiles": tiles,
        "attention": {
            "peak_tflops": float(f"{peak:.4g}"),
            "curve": [[r["tokens"], round(max(1e-4, min(1.0, r["fwd_tflops"] / peak)), 4)]
                      for r in rows],
            "backward_speed_ratio": round(longest["bwd_tflops"] / longest["fwd_tflops"], 4),
            "call_floor_us": round(max(0.1, floor["both_s"] / 2 * 1e6), 3),
        },
        "measured": {
            "schema": MEASURED_SCHEMA,
            "source": "libra calibrate",
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "torch": str(torch.__version__),
            "backend": b.kernel.name,
            "dtype": dtype,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "tokens_per_call": tokens,
            **({"threads": torch.get_num_threads()} if dev.type == "cpu" else {}),
        },
    }


def write_profile(result: dict, base: str, name: str, out: str | Path) -> Path:
    """A hardware profile: the base profile's compute, GEMM and network figures with the
    measured attention section."""
    p = Path(base)
    src = p if p.exists() else HARDWARE_DIR / f"{base}.yaml"
    if not src.exists():
        HardwareProfile.load(base)  # raises naming the known profiles
    with open(src, encoding="utf-8") as fh:
        d = yaml.safe_load(fh)
    base_name = str(d.get("name", base))
    d["name"] = name
    d["attention"] = result["attention"]
    d["measured"] = dict(result["measured"], base_profile=base_name,
                         not_measured="bf16_peak_tflops, linear_efficiency, nvlink, internode, "
                         "allreduce (taken from the base profile)")
    HardwareProfile.from_dict(d, str(out))  # the schema the simulator reads
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Measured by `libra calibrate` on {result['measured']['device']} "
        f"({result['measured']['date']}, {result['measured']['backend']} kernel, "
        f"{result['measured']['dtype']}); attention section measured, the rest from "
        f"{src.name}.\n"
    )
    out.write_text(header + yaml.safe_dump(d, sort_keys=False))
    return out
