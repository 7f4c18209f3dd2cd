"""Device checks of the attention runtime, shared by tests/test_attention_gpu.py and
tools/gpu_check.py (which writes their numbers to one JSON file):

- `kernel_cases`: every usable backend against the dense reference (float64) on segment
  layouts that matter here - whole documents, query tiles against longer prefixes (bottom-right
  causal), one-row tiles, GQA and MQA, several segments per call, and the zero-key and
  zero-query segments the runtime's calls put around their work - output and q/k/v gradients,
  with a keyless row's output overwritten and its output gradient arbitrary before the
  backward, as the runtime writes them (docs/plan_contract.md); where query and key rows are
  the same tokens, also on head slices of one buffer, as a fused QKV projection leaves them;
  max_seqlen rounded up as the runtime passes it (`kernels.rounded_max`);
- `alignment`: which causal alignment a backend implements (must be bottom-right);
- `sync_free`: the single-rank operator, forward and backward, under
  `torch.cuda.set_sync_debug_mode("error")` (any hidden device sync raises);
- `rebuild_storage`: system.attention_memory = rebuild on one kernel call - gradients after
  the release and refill, and on a GPU whether the kernel keeps anything beyond the storages the
  release frees;
- `row_ops`: the exchange's fused row gathers and scatters (`rowops`) against the torch ops
  they replace, at the exchange's shapes, with the path taken (one Triton launch on CUDA) and
  both timed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from libra_ext.attention import kernels, meta, rowops
from libra_ext.attention.comm import GroupCache
from libra_ext.attention.core import Runtime, core_attention
from libra_ext.attention.counters import CallCounts
from libra_ext.attention.exchange import _Call
from libra_ext.attention.kernels import KernelParams, segments_on, why_not
from libra_ext.attention.reference_kernel import reference_attention
from libra_ext.distributed import ensure_single_process_group
from libra_ext.measure.bench import DTYPES, sequence
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import ModelConfig

CASES = (
    # (query rows per segment, key rows per segment, query heads, KV heads)
    ((256,), (256,), 8, 2),
    ((128,), (1024,), 4, 4),
    ((1,), (64,), 2, 1),
    ((3, 100, 17, 64), (10, 300, 17, 64), 8, 1),
    ((512, 7), (512, 900), 4, 2),
    # zero-key segments (rows of moved units, padding: no keys, whatever O and dO hold there)
    # between and after zero-query ones (keys no row of the call reads: dK = dV = 0)
    ((7, 0, 40, 16, 9), (0, 30, 64, 16, 0), 4, 2),
    ((100, 37, 1), (100, 37, 1), 8, 2),  # documents of one packed sequence
    ((6,), (0,), 2, 1),  # no keys at all (per-document CP on a rank whose chunks are padding)
)

TOLERANCE = {torch.bfloat16: (2e-2, 4e-2), torch.float16: (4e-3, 8e-3), torch.float32: (1e-5, 1e-4)}
"""(output, gradient) tolerance per dtype, relative to the largest reference magnitude."""


def usable_backends(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[str]:
    p = KernelParams(device.type, dtype, head_dim)
    return [b for b in kernels.BACKENDS if why_not(b, p) is None]


def _run(backend: str, q, k, v, seg, scale, dout, keyless=None):
    """(output, dq, dk, dv) of one call of `backend`; with `keyless` (the rows of zero-key
    segments) their output is overwritten before the backward, as the runtime writes other
    values there in place (the output returned is the kernel's own)."""
    b = kernels._FACTORIES[backend]()
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = b.attend(q, k, v, seg, scale)
    got = out
    if keyless is not None and keyless.numel():
        got = out.detach().clone()
        out.data[keyless] = torch.randn_like(out.data[keyless])
    return (got, *torch.autograd.grad(out, (q, k, v), dout))


def _reference(q, k, v, ql, kl, scale, dout, top_left=False):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    outs, qs, ks = [], 0, 0
    for a, b in zip(ql, kl):
        qq, kk, vv = q[qs : qs + a], k[ks : ks + b], v[ks : ks + b]
        if top_left:  # query i sees keys j <= i: a tile aligned to the top left
            kk, vv = kk[:a] if b >= a else kk, vv[:a] if b >= a else vv
        outs.append(reference_attention(qq, kk, vv, scale)[0])
        qs, ks = qs + a, ks + b
    out = torch.cat(outs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.double()))


def _err(got, want) -> float:
    got, want = got.detach(), want.detach()
    if got.shape != want.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    scale = max(float(want.abs().max()), 1.0)
    return float((got.double() - want).abs().max()) / scale


def keyless_rows(seg) -> torch.Tensor:
    """[n_q] bool, on the segments' device: the query rows of `seg`'s zero-key segments."""
    return torch.as_tensor(np.repeat(np.diff(seg.host_k) == 0, np.diff(seg.host_q)),
                           device=seg.cu_q.device)


def _fused(q, k, v) -> tuple:
    """q, k, v as head slices of one [n, hq + 2 hk, d] buffer (the same values), as a fused QKV
    projection leaves them: at one cp rank the runtime calls the kernel on the layer's own."""
    buf = torch.cat([q, k, v], dim=1)
    hq, hk = q.shape[1], k.shape[1]
    return buf[:, :hq], buf[:, hq:hq + hk], buf[:, hq + hk:]


def kernel_cases(device, dtype=torch.bfloat16, backends=None, head_dim=64, seed=0) -> list[dict]:
    """Every (backend, case, inputs): relative max error of the output (rows with keys) and of
    the q/k/v gradients; `inputs` "contiguous", or "views" (head slices of one buffer, where a
    case's query and key rows are the same tokens)."""
    device = torch.device(device)
    backends = backends or usable_backends(device, dtype, head_dim)
    gen = torch.Generator(device=device).manual_seed(seed)
    out_tol, grad_tol = TOLERANCE[dtype]
    results = []
    for ql, kl, hq, hk in CASES:
        nq, nk = sum(ql), sum(kl)
        q = torch.randn(nq, hq, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(nk, hk, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(nk, hk, head_dim, device=device, dtype=dtype, generator=gen)
        dout = torch.randn(nq, hq, head_dim, device=device, dtype=dtype, generator=gen)
        seg = segments_on(np.r_[0, np.cumsum(ql)], np.r_[0, np.cumsum(kl)], device)
        scale = head_dim**-0.5
        want = _reference(q, k, v, ql, kl, scale, dout)
        keyed = ~keyless_rows(seg)
        keyless = torch.nonzero(~keyed).flatten()
        inputs = [("contiguous", (q, k, v))] + ([("views", _fused(q, k, v))]
                                                if tuple(ql) == tuple(kl) else [])
        for name in backends:
            for layout, qkv in inputs:
                got = _run(name, *qkv, seg, scale, dout, keyless)
                err_out = _err(got[0][keyed], want[0][keyed])  # a keyless row's output is free
                err_grad = max(_err(a, b) for a, b in zip(got[1:], want[1:]))
                results.append(
                    {
                        "backend": name,
                        "dtype": str(dtype).replace("torch.", ""),
                        "q_lens": list(ql),
                        "k_lens": list(kl),
                        "heads": [hq, hk],
                        "inputs": layout,
                        "max_seqlen": [seg.max_q, seg.max_k],
                        "keyless_rows": int(keyless.numel()),
                        "err_out": err_out,
                        "err_grad": err_grad,
                        "ok": err_out <= out_tol and err_grad <= grad_tol,
                    }
                )
    return results


def alignment(device, dtype=torch.bfloat16, backend: str = "reference", head_dim=64) -> dict:
    """Errors of one 5-row tile against a 40-key prefix under both causal alignments."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(1)
    ql, kl = (5,), (40,)
    q = torch.randn(5, 2, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(40, 2, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(40, 2, head_dim, device=device, dtype=dtype, generator=gen)
    dout = torch.randn_like(q)
    seg = segments_on(np.array([0, 5]), np.array([0, 40]), device)
    got = _run(backend, q, k, v, seg, head_dim**-0.5, dout)[0]
    br = _err(got, _reference(q, k, v, ql, kl, head_dim**-0.5, dout)[0])
    tl = _err(got, _reference(q, k, v, ql, kl, head_dim**-0.5, dout, top_left=True)[0])
    return {
        "backend": backend,
        "err_bottom_right": br,
        "err_top_left": tl,
        "aligned": "bottom-right" if br < tl else "top-left",
        "ok": br < tl and br <= TOLERANCE[dtype][0],
    }


def rebuild_storage(device, dtype=torch.bfloat16, backend: str = "reference",
                    head_dim=64) -> dict:
    """system.attention_memory = rebuild on one kernel call of `backend`: its output and inputs
    released after the forward (`_Call.release`), refilled and run backward - gradients against
    the same call kept (equal within the dtype's tolerance: a kernel's backward may add in any
    order), and on a GPU how much of the call's memory the release leaves allocated: beyond its
    softmax statistics that is what the kernel keeps in storages of its own, which the release
    cannot free."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(3)
    ql = kl = np.array([300, 1000, 700])
    hc, hk = 8, 2
    cu = np.r_[0, np.cumsum(ql)]
    q = torch.randn(int(ql.sum()), hc, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(int(kl.sum()), hk, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    seg = segments_on(cu, cu, device)
    env = SimpleNamespace(kernel=kernels._FACTORIES[backend](), scale=head_dim**-0.5, key=None,
                          kernel_timer=None)
    plan = SimpleNamespace(seg=seg)
    counts = CallCounts()
    kept = _Call(plan, q, k, v, env, counts)
    want = kept.backward(dout, counts)
    del kept
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda *_: None)
    mem = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
    inputs = [x.clone() for x in (q, k, v)]
    in_bytes = sum(x.numel() * x.element_size() for x in inputs)
    sync(device)
    m0 = mem()
    call = _Call(plan, *inputs, env, counts)
    values = [call.out.detach().clone()] + [x.clone() for x in inputs]
    del inputs  # the call's leaves (and what the kernel saved) hold them now
    sync(device)
    m1 = mem()
    call.release(inputs=True)
    sync(device)
    m2 = mem()
    for dst, src in zip(call.restore(), values):
        dst.copy_(src.view(-1, src.shape[-1]))
    got = call.backward(dout, counts)
    err = max(_err(g, w.double()) for g, w in zip(got, want))
    stats = q.shape[0] * hc * 4  # fp32 log-sum-exp per query row and head
    # allocated after the release beyond the inputs' and the values' copies: the statistics
    # and whatever the kernel keeps of its own (allocator blocks round up: 2 MiB slack)
    value_bytes = sum(x.numel() * x.element_size() for x in values)
    left = m2 - (m0 - in_bytes) - value_bytes if cuda else None
    return {
        "backend": backend,
        "grad_err": err,
        "bitwise": all(torch.equal(g, w) for g, w in zip(got, want)),
        "forward_allocated": (m1 - m0 - value_bytes) if cuda else None,
        "left_after_release": left,
        "stats_bytes": stats,
        "ok": err <= TOLERANCE[dtype][1] and (left is None or left <= stats + (2 << 20)),
    }


def sync_free(device, systems=("libra", "ulysses", "wlb"), context=32_768, dtype="bf16") -> dict:
    """Each system's single-rank operator (metadata upload, forward, backward) with the CUDA
    sync debug mode set to error: {system: "ok" | the error}."""

    device = torch.device(device)
    if device.type != "cuda":
        return {s: "skipped: the sync debug mode needs CUDA" for s in systems}
    ensure_single_process_group()
    docs = sequence(context)
    model = ModelConfig(heads=16, kv_heads=4, head_dim=128)
    layout = LayoutConfig(dp=1, cp=1, pool_size=1, context=context)
    groups = GroupCache(tp=1, cp=1, dp=1)
    out = {}
    for system in systems:
        plan = Planner(layout, model, PlannerOptions(system=system)).plan([docs])
        runtime = Runtime(groups=groups)
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = runtime.prepare(plan, device)[0]
            t = step.program.t
            dt = DTYPES[dtype]
            q = torch.randn(t, 16, 128, device=device, dtype=dt, requires_grad=True)
            k = torch.randn(t, 4, 128, device=device, dtype=dt, requires_grad=True)
            v = torch.randn(t, 4, 128, device=device, dtype=dt, requires_grad=True)
            o = core_attention(q, k, v, docs, system, runtime, step)
            o.backward(torch.ones_like(o))
            out[system] = "ok"
        except RuntimeError as e:
            out[system] = f"error: {str(e).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize(device)
    return out


def row_ops(device, dtype=torch.bfloat16, rows=1 << 20, d=128, reps=5, seed=4) -> dict:
    """The fused row ops against per-part torch ops on `device`: Q / K / V gathered out of X
    (rows, rows / 8, rows / 8 indices into buffers of 2 rows, rows / 4, rows / 4), then dQ
    written and dK / dV added back with K/V rows repeated (each twice on average), and the K
    gradients summed per distinct row (`sum_rows_`). Equal for gathers and writes; adds and sums
    within the dtype's tolerance of a float64 sum (atomic additions on a GPU take any order; the
    sums take send order, the same bits on every run). Times (ms, median of `reps`) both
    ways."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    src = [torch.randn(n, d, device=device, dtype=dtype, generator=gen)
           for n in (2 * rows, rows // 4, rows // 4)]
    idx = [torch.randint(0, x.shape[0], (n,), device=device, generator=gen, dtype=torch.int32)
           for x, n in zip(src, (rows, rows // 8, rows // 8))]
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def timed(fn) -> float:
        ms = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ms.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(ms))

    fused, views = rowops.gather(src, idx)
    want = [x.index_select(0, i) for x, i in zip(src, idx)]
    gather_ok = all(torch.equal(v, w) for v, w in zip(views, want))
    t_fused = timed(lambda: rowops.gather(src, idx, out=fused))
    t_torch = timed(lambda: [x.index_select(0, i) for x, i in zip(src, idx)])
    # back: dQ written (each row once), dK / dV added (rows repeat)
    wq = torch.randperm(src[0].shape[0], device=device, generator=gen)[:rows].to(torch.int32)
    dst = [torch.zeros_like(x) for x in src]
    parts = [wq, idx[1], idx[2]]
    rowops.scatter(dst, parts, views, [False, True, True])
    write_ok = torch.equal(dst[0][wq], views[0])
    tol = TOLERANCE[dtype][1]
    add_err = 0.0
    for p in (1, 2):
        ref = torch.zeros(src[p].shape, device=device, dtype=torch.float64)
        ref.index_add_(0, idx[p], views[p].double())
        add_err = max(add_err, _err(dst[p], ref))
    t_scatter = timed(lambda: rowops.scatter(dst, parts, views, [False, True, True]))
    t_scatter_torch = timed(lambda: (dst[0].index_put_((wq,), views[0]),
                                     dst[1].index_add_(0, idx[1], views[1]),
                                     dst[2].index_add_(0, idx[2], views[2])))
    # the K/V gradients returned: each vector's returns (idx[1]'s repeats) summed in send order
    # into one buffer of the distinct vectors, then added at them (`sum_rows_`, no atomics)
    distinct = len(torch.unique(idx[1]))  # (a host read, here only: the runtime knows it
    # from the plan's runs)
    rows_u, order, offs = meta.vector_groups(idx[1], distinct)
    summed = views[1].new_empty(distinct, d)
    rowops.sum_into([summed], [None], [views[1]], [order], [offs], [False])
    ref = torch.zeros(distinct, d, device=device, dtype=torch.float64)
    ref.index_add_(0, torch.searchsorted(rows_u, idx[1].to(torch.int32)), views[1].double())
    sum_err = _err(summed, ref)
    dk = torch.zeros_like(src[1])
    rowops.sum_into([dk], [rows_u], [views[1]], [order], [offs], [True])
    again = torch.zeros_like(src[1])
    rowops.sum_into([again], [rows_u], [views[1]], [order], [offs], [True])
    sum_deterministic = torch.equal(dk, again) and torch.equal(dk[rows_u.long()], summed)
    t_sum = timed(lambda: rowops.sum_into([summed], [None], [views[1]], [order], [offs],
                                          [False]))
    moved = sum(v.numel() * v.element_size() for v in views)
    return {
        "dtype": str(dtype).replace("torch.", ""), "rows": rows, "head_dim": d,
        "triton": rowops._use_triton(fused),
        "gather_equal": gather_ok, "write_equal": write_ok, "add_err": add_err,
        "sum_err": sum_err, "sum_deterministic": sum_deterministic,
        "gather_ms": {"fused": t_fused, "torch": t_torch},
        "scatter_ms": {"fused": t_scatter, "torch": t_scatter_torch},
        "sum_ms": t_sum,
        "gather_gb_per_s": 2 * moved / t_fused / 1e6 if t_fused else None,
        "ok": gather_ok and write_ok and add_err <= tol and sum_err <= tol and
        sum_deterministic and (rowops._use_triton(fused) or not cuda),
    }
