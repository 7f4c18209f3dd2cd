"""`libra bench attention`: the core-attention operator against one plain batched kernel call
over the same packed sequence, forward + backward, side by side in one run, on one device
(world size 1: every tile runs locally, so the difference is the operator's own overhead:
layout copies, gathers, scatters, gradient sums).

The plain call is the backend's varlen kernel over the sequence's documents in natural order,
exactly what a Megatron/TE THD attention layer runs. Times are device-event times on GPU and
wall time on CPU, averaged over `reps` after one warm-up; the counters come from one extra,
untimed call with host-copy counting on. `compile_ms` is the host time to turn the plan into the
rank's metadata (done one step ahead in the sampler's thread during training).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from libra_ext.attention.comm import GroupCache
from libra_ext.attention.core import Runtime, core_attention
from libra_ext.attention.kernels import backend_for, segments_on
from libra_ext.attention.meta import compile_rank
from libra_ext.distributed import ensure_single_process_group
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import LengthSource, ModelConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed_ms(fn, reps: int, device: torch.device) -> float:
    """Mean milliseconds of fn() over reps calls after one warm-up (device events on GPU)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def sequence(context: int, workload: str = "libra-256k", lengths_file=None, seed: int = 0) -> list:
    """One packed sequence of `context` tokens from a preset (or a lengths file)."""
    src = LengthSource(preset=workload, lengths_file=lengths_file)
    return [int(x) for x in src.step(1, context, seed=seed, step=0)[0]]


def quantile_sequences(preset: str, context: int, seeds=range(4), per_seed: int = 16,
                       quantiles=(0.5, 0.1)) -> dict:
    """Packed sequences of a preset at given quantiles of their attention cost over their
    tokens' (sum of squared document lengths / S^2), drawn from `per_seed` sequences of each
    seed: {"p50": docs, "p10": docs, ...} (p10: short documents, where the operator's cost
    weighs most against the kernel's)."""
    src = LengthSource(preset=preset)
    seqs = [[int(x) for x in s] for seed in seeds
            for s in src.step(per_seed, context, seed=seed, step=0) if s]
    cost = np.array([sum(x * x for x in s) / sum(s) ** 2 for s in seqs])
    order = np.argsort(cost, kind="stable")
    return {f"p{round(100 * q)}": seqs[int(order[min(len(seqs) - 1, int(q * len(seqs)))])]
            for q in quantiles}


def run(
    context: int = 262_144,
    heads: int = 32,
    kv_heads: int = 4,
    head_dim: int = 128,
    systems=("libra", "ulysses", "wlb"),
    device: str = "cuda",
    dtype: str = "bf16",
    reps: int = 3,
    workload: str = "libra-256k",
    lengths_file=None,
    seed: int = 0,
    backend: str | None = None,
    docs: list | None = None,
) -> dict:
    """Operator vs plain kernel call per system (on `docs`, or a sequence of `context` tokens
    of the workload); returns the JSON-ready result."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if context <= 0 or reps <= 0:
        raise ValueError(f"context and reps must be positive, got {context} and {reps}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but no GPU is available")
    dt = DTYPES[dtype]
    ensure_single_process_group()
    docs = [int(x) for x in docs] if docs is not None else \
        sequence(context, workload, lengths_file, seed)
    S = sum(docs)
    model = ModelConfig(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    layout = LayoutConfig(dp=1, cp=1, pool_size=1, context=max(context, S))
    groups = GroupCache(tp=1, cp=1, dp=1)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen)

    # plain: one varlen call over the documents in natural order
    bufs = {
        "q": rand(S, heads, head_dim),
        "k": rand(S, kv_heads, head_dim),
        "v": rand(S, kv_heads, head_dim),
        "g": rand(S, heads, head_dim),
    }
    cu = np.r_[0, np.cumsum(docs)]
    seg = segments_on(cu, cu, dev)
    kernel = backend_for(bufs["q"], backend)
    scale = head_dim**-0.5

    def plain():
        q, k, v = (bufs[x].detach().requires_grad_() for x in "qkv")
        out = kernel.attend(q, k, v, seg, scale)
        torch.autograd.grad(out, (q, k, v), bufs["g"])

    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": kernel.name,
        "dtype": dtype,
        "context": S,
        "documents": len(docs),
        "cost_over_tokens_squared": sum(x * x for x in docs) / S**2,
        "longest_document": max(docs),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "plain_ms": timed_ms(plain, reps, dev),
        "systems": {},
    }
    bufs.clear()  # free the plain call's inputs before the operator runs
    for system in systems:
        plan = Planner(layout, model, PlannerOptions(system=system)).plan([docs])
        runtime = Runtime(groups=groups, backend=backend)
        t0 = time.perf_counter()
        host = compile_rank(plan, 0, 0, runtime.chunks)
        compile_ms = (time.perf_counter() - t0) * 1e3
        step = runtime.prepare(plan, dev, host)[0]
        t = step.program.t
        bufs.update(
            q=rand(t, heads, head_dim),
            k=rand(t, kv_heads, head_dim),
            v=rand(t, kv_heads, head_dim),
            g=rand(t, heads * head_dim),
        )

        def op(step=step, system=system, runtime=runtime):
            q, k, v = (bufs[x].detach().requires_grad_() for x in "qkv")
            out = core_attention(q, k, v, docs, system, runtime, step)
            torch.autograd.grad(out, (q, k, v), bufs["g"])

        ms = timed_ms(op, reps, dev)
        runtime.stats.reset()
        runtime.stats.count_host = True
        op()
        counters = runtime.stats.summary()
        result["systems"][system] = {
            "operator_ms": ms,
            "ratio": ms / result["plain_ms"],
            "compile_ms": compile_ms,
            "tiles": int(plan.n_tiles),
            **counters,
        }
        bufs.clear()
        runtime._programs.clear()
    return result
