#!/usr/bin/env python3
"""Time the Libra core-attention operator against plain varlen attention on one packed sequence
(world size 1, tiles executed locally), forward + backward, side by side in one run.

    python tools/gpu_bench_attention.py [--context 262144] [--out out/gpu_check.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from libra_ext.attention import kernels, thd
from libra_ext.attention.comm import GroupCache
from libra_ext.attention.core import AttentionStep, Runtime, core_attention
from libra_ext.attention.verify import free_port
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import LengthSource, ModelConfig


def timed(fn, reps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=262_144)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="out/gpu_check.json")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    docs = LengthSource(preset="libra-256k").step(1, args.context, seed=0, step=0)[0]
    model = ModelConfig(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    layout = LayoutConfig(dp=1, cp=1, pool_size=1, context=args.context)
    plan = Planner(layout, model, PlannerOptions(system="libra")).plan([docs])
    runtime = Runtime(groups=GroupCache(tp=1, cp=1, dp=1), pipelined=False)
    S = sum(docs)
    dev, dt = torch.device("cuda"), torch.bfloat16
    slots = len(thd.zigzag_split(docs, 1, 0).token_index)  # documents padded to even lengths

    def inputs(n):
        q = torch.randn(n, args.heads, args.head_dim, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(n, args.kv_heads, args.head_dim, device=dev, dtype=dt, requires_grad=True)
        return q, k, torch.randn_like(k, requires_grad=True)

    q, k, v = inputs(slots)
    qp, kp, vp = inputs(S)
    backend = kernels.select_backend(dev)

    def op():
        out = core_attention(q, k, v, docs, "libra", runtime, AttentionStep(plan, 0))
        out.float().sum().backward()

    def plain():
        outs, s = [], 0
        for l in docs:
            o, _ = backend(
                q[s : s + l],
                k[s : s + l].repeat_interleave(args.heads // args.kv_heads, 1),
                v[s : s + l].repeat_interleave(args.heads // args.kv_heads, 1),
                args.head_dim**-0.5,
            )
            outs.append(o)
            s += l
        torch.cat(outs).float().sum().backward()

    op()
    plain()
    res = {
        "device": torch.cuda.get_device_name(),
        "backend": backend.name,
        "context": S,
        "documents": len(docs),
        "tiles": plan.n_tiles,
        "operator_ms": timed(op, args.reps),
        "plain_varlen_ms": timed(plain, args.reps),
    }
    res["ratio"] = res["operator_ms"] / res["plain_varlen_ms"]
    print(json.dumps(res))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
