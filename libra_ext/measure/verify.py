"""Multi-process exactness check of the attention runtime against a single-device reference.

Spawns N gloo processes on 127.0.0.1 (tp = 1, cp = C, dp = N / C). Every rank plans the same
random packed batch, checks the plan hash, runs its slots forward and backward through
`core_attention` as a layer makes them (`traffic.layer_call`), and compares its output and the
gradients of its q, k, v with the reference computed on the whole sequence; it also compares the
bytes it sent in the pool exchange with the plan's promise, and measures per layer call what
the GPU-readiness gate measures on fake CUDA (`LAYER_FIGURES`, the reference kernel's own work
left out).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from libra_ext.attention import DEFAULT_CHUNKS, thd
from libra_ext.attention.comm import GroupCache
from libra_ext.attention.core import Runtime, check_plan_hash, core_attention
from libra_ext.attention.reference_kernel import reference_attention
from libra_ext.distributed import free_port, run_ranks, share_cores
from libra_ext.measure import traffic
from libra_ext.planner import SYSTEMS, LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import ModelConfig

COUNTERS = (
    "kernel_calls_fwd",
    "kernel_calls_bwd",
    "tiles_executed",
    "exec_blocks",
    "host_copies",
    "host_reads",
)
"""Per-call runtime counters reported as the maximum over ranks and calls."""
LAYER_FIGURES = ("device_ops_fwd", "device_ops_bwd", "extra_over_qkv", "kept", "peak")
"""Per layer call (`traffic.layer_call`): device ops forward and backward, extra device bytes,
bytes kept for backward and at the peak over the layer's Q/K/V; the maximum over ranks and
calls."""


@dataclass
class VerifyConfig:
    nproc: int
    cp: int
    pool_size: int
    systems: tuple = SYSTEMS
    pipelined: tuple = (True, False)
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    context: int = 128
    slots: int = 1
    batches: int = 2
    block: int = 16
    head_group: int = 1
    chunks: int = DEFAULT_CHUNKS
    seed: int = 0
    lengths: tuple = ()  # document lengths to draw from; empty: built-in edge cases
    fill: bool = False  # with lengths: fill every sequence to the context (no early stop)
    dtype: str = "float32"
    memory: str = "keep"  # system.attention_memory


def make_batch(cfg: VerifyConfig, dp: int, batch: int) -> list[list[int]]:
    """Packed sequences with edge cases: one document filling the sequence, many tiny ones,
    length-1 documents, and random mixes (or draws from `cfg.lengths`)."""
    rng = np.random.default_rng(cfg.seed * 1000 + batch)
    S = cfg.context
    seqs = []
    for i in range(dp * cfg.slots):
        kind = (i + batch) % 4
        if cfg.lengths:
            docs, room = [], S
            while room > 0:
                l = int(min(room, cfg.lengths[rng.integers(len(cfg.lengths))]))
                docs.append(l)
                room -= l
                if not cfg.fill and rng.random() < 0.2:
                    break
        elif kind == 0:
            docs = [S]
        elif kind == 1:
            docs = [int(x) for x in rng.integers(1, 6, size=12)]
        elif kind == 2:
            docs = [1, int(rng.integers(2, S // 2)), 1]
        else:
            docs = [int(rng.integers(S // 4, S // 2)), int(rng.integers(1, S // 4))]
        seqs.append(docs)
    return seqs


def _tensors(docs, cfg: VerifyConfig, batch: int, seq: int, dtype):
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + batch * 131 + seq)
    S = sum(docs)
    q = torch.randn(S, cfg.heads, cfg.head_dim, generator=gen, dtype=dtype)
    k = torch.randn(S, cfg.kv_heads, cfg.head_dim, generator=gen, dtype=dtype)
    v = torch.randn(S, cfg.kv_heads, cfg.head_dim, generator=gen, dtype=dtype)
    do = torch.randn(S, cfg.heads * cfg.head_dim, generator=gen, dtype=dtype)
    return q, k, v, do


def _reference(docs, q, k, v, do, scale):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    outs, s = [], 0
    for l in docs:
        o, _ = reference_attention(q[s : s + l], k[s : s + l], v[s : s + l], scale)
        outs.append(o)
        s += l
    out = torch.cat(outs).reshape(q.shape[0], -1)
    (out * do).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def worker(rank: int, world: int, port: int, cfg: VerifyConfig, out_dir: str) -> None:
    share_cores(world)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    dtype = getattr(torch, cfg.dtype)
    C = cfg.cp
    D = world // C
    groups = GroupCache(tp=1, cp=C, dp=D)
    r, c = groups.r, groups.c
    model = ModelConfig(
        hidden=cfg.heads * cfg.head_dim,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        ffn=64,
        layers=1,
        moe_topk=0,
        moe_ffn=0,
    )
    layout = LayoutConfig(dp=D, cp=C, pool_size=cfg.pool_size, context=cfg.context)
    scale = 1.0 / cfg.head_dim**0.5
    report = {"rank": rank, "cases": []}
    for system in cfg.systems:
        for pipelined in cfg.pipelined:
            runtime = Runtime(groups=groups, chunks=cfg.chunks, pipelined=pipelined,
                              memory=cfg.memory)
            runtime.stats.count_host = True
            err_out = err_grad = 0.0
            sent = planned = rebuilt = 0
            figures: dict = {}
            for batch in range(cfg.batches):
                seqs = make_batch(cfg, D, batch)
                opts = PlannerOptions(
                    system=system,
                    block=cfg.block,
                    head_group=cfg.head_group,
                    dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
                )
                planner = Planner(layout, model, opts)
                plan = planner.plan(seqs, flush=True)
                check_plan_hash(plan, group=groups.check_group)
                runtime.counter.reset()
                steps = runtime.prepare(plan, "cpu")  # metadata ahead, as the sampler does
                for slot in range(plan.slots):
                    s_idx = plan.sequence_at(r, slot)
                    docs = plan.sequences()[s_idx]
                    if not docs:
                        continue
                    q, k, v, do = _tensors(docs, cfg, batch, s_idx, dtype)
                    ref_out, ref_dq, ref_dk, ref_dv = _reference(docs, q, k, v, do, scale)
                    idx = thd.split(docs, C, c, thd.layout_of(system)).token_index
                    real = torch.as_tensor(idx >= 0)
                    take = torch.as_tensor(np.where(idx >= 0, idx, 0))
                    ql = (q[take] * real[:, None, None]).detach().requires_grad_(True)
                    kl = (k[take] * real[:, None, None]).detach().requires_grad_(True)
                    vl = (v[take] * real[:, None, None]).detach().requires_grad_(True)
                    grad = (do[take] * real[:, None]).contiguous()
                    m = real[:, None]

                    def check(out, want=ref_out[take], m=m):
                        nonlocal err_out
                        err_out = max(err_out, float(((out.detach() - want) * m).abs().max()))

                    with traffic.TrafficProbe("cpu") as probe:
                        measured = traffic.layer_call(
                            probe, lambda q_, k_, v_, s_=steps[slot]: core_attention(
                                q_, k_, v_, docs, system, runtime, s_, scale), ql, kl, vl, grad,
                            inspect=check)
                    for key in LAYER_FIGURES:
                        figures[key] = max(figures.get(key, 0), measured[key])
                    for got, want in ((ql.grad, ref_dq), (kl.grad, ref_dk), (vl.grad, ref_dv)):
                        diff = (got - want[take] * real[:, None, None]).abs().max()
                        err_grad = max(err_grad, float(diff))
                again = sum(n for k, n in runtime.counter.sent.items()
                            if k.startswith("pool") and k.endswith(".rebuild"))
                sent += runtime.counter.total("pool") - again  # (what the plan promises)
                rebuilt += again
                planned += int(plan.rank_bytes_sent[r, c])
            report["cases"].append(
                {
                    "system": system,
                    "pipelined": pipelined,
                    "max_abs_err_out": err_out,
                    "max_abs_err_grad": err_grad,
                    "bytes_sent": sent,
                    "bytes_planned": planned,
                    "bytes_rebuilt": rebuilt,
                    **runtime.stats.summary(),
                    **{k: figures.get(k, 0) for k in LAYER_FIGURES},
                }
            )
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.destroy_process_group()


def run(cfg: VerifyConfig, tol: float = 1e-5) -> dict:
    """Run the check on `nproc` local ranks and gather every rank's numbers into one summary."""
    if cfg.nproc % cfg.cp:
        raise ValueError(f"nproc ({cfg.nproc}) must be a multiple of cp ({cfg.cp})")
    dp = cfg.nproc // cfg.cp
    if dp % cfg.pool_size:
        raise ValueError(f"pool_size (P={cfg.pool_size}) must divide dp (D={dp})")
    if cfg.heads % cfg.cp:
        raise ValueError(f"heads ({cfg.heads}) must be divisible by cp ({cfg.cp})")
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(worker, (cfg.nproc, free_port(), cfg, tmp), cfg.nproc)
        ranks = [json.load(open(os.path.join(tmp, f"rank{i}.json"))) for i in range(cfg.nproc)]
    cases = []
    for i, case in enumerate(ranks[0]["cases"]):
        per = [rk["cases"][i] for rk in ranks]
        cases.append(
            {
                "system": case["system"],
                "pipelined": case["pipelined"],
                "max_abs_err_out": max(p["max_abs_err_out"] for p in per),
                "max_abs_err_grad": max(p["max_abs_err_grad"] for p in per),
                "bytes_sent": [p["bytes_sent"] for p in per],
                "bytes_planned": [p["bytes_planned"] for p in per],
                "bytes_rebuilt": [p["bytes_rebuilt"] for p in per],
                **{k: max(p[k] for p in per) for k in COUNTERS + LAYER_FIGURES},
            }
        )
        cases[-1]["ok"] = (
            cases[-1]["max_abs_err_out"] <= tol
            and cases[-1]["max_abs_err_grad"] <= tol
            and cases[-1]["bytes_sent"] == cases[-1]["bytes_planned"]
        )
    return {"config": asdict(cfg), "cases": cases, "ok": all(c["ok"] for c in cases)}
