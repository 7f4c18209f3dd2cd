"""`libra verify attention`: the multi-process exactness check of the attention runtime;
`libra verify gpu-ready`: the GPU-readiness gate on fake CUDA (megatron.libra.gpu_ready)."""

from __future__ import annotations

from libra_ext.memory import ATTENTION_MEMORY
from libra_ext.planner import SYSTEMS
from libra_ext.workload import check_int, read_lengths_file


def add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="check the attention runtime against a reference")
    vsub = p.add_subparsers(dest="verify", required=True, parser_class=type(p))
    a = vsub.add_parser(
        "attention",
        help="multi-process check of outputs, gradients and bytes",
        description="Spawn N gloo processes, run random packed batches through every rank's "
        "core attention forward and backward, and compare with a single-process reference "
        "and with the plan's byte promise.",
    )
    a.add_argument("--nproc", type=int, default=4, help="processes (tp = 1, cp * dp = nproc)")
    a.add_argument("--cp", type=int, help="context-parallel size (default 2 when nproc >= 4)")
    a.add_argument("--pool-size", type=int, help="pool size (default: all replicas)")
    a.add_argument("--system", default="all", choices=("all",) + SYSTEMS)
    a.add_argument("--lengths-file", help="draw document lengths from this file")
    a.add_argument("--context", type=int, default=128, help="tokens per packed sequence")
    a.add_argument("--heads", type=int, default=4)
    a.add_argument("--kv-heads", type=int, default=2)
    a.add_argument("--block", type=int, default=16, help="query tokens per tile")
    a.add_argument("--chunks", type=int, default=2, help="chunks of the pool exchange")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--attention-memory", default="keep", choices=ATTENTION_MEMORY,
                   help="system.attention_memory: owner frees the moved tiles' outputs and "
                   "inputs after the forward and ships them again in the backward, rebuild the "
                   "kernels' outputs too")
    a.add_argument("--tolerance", type=float, default=1e-5)
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=run_verify_attention)
    g = vsub.add_parser(
        "gpu-ready",
        help="the GPU path on fake CUDA: mismatches, host reads, transfers, kernels, memory",
        description="Run every system's operator forward and backward on fake CUDA tensors "
        "(a CPU-only PyTorch), with stand-ins for each kernel entry point and for the "
        "collectives, and report per layer call: device ops, kernel calls, host reads, "
        "blocking transfers, uploads per step, bytes kept for backward and the peak. Exit "
        "status 1 when a bound is not met.",
    )
    g.add_argument("--systems", default=",".join(SYSTEMS))
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=run_verify_gpu_ready)


def run_verify_gpu_ready(args):
    # deferred: the CLI starts without torch
    from megatron.libra.gpu_ready.__main__ import main

    argv = ["--systems", args.systems] + (["--json"] if args.json else [])
    rc = main(argv)
    if rc:
        raise SystemExit(rc)
    return None


def run_verify_attention(args):
    # deferred: the CLI starts without torch
    from libra_ext.measure.verify import COUNTERS, LAYER_FIGURES, VerifyConfig, run

    if args.nproc <= 0:
        raise ValueError(f"nproc must be positive, got {args.nproc}")
    cp = args.cp if args.cp is not None else (2 if args.nproc >= 4 and args.nproc % 2 == 0 else 1)
    if cp <= 0 or args.nproc % cp:
        raise ValueError(f"cp ({cp}) must divide nproc ({args.nproc})")
    dp = args.nproc // cp
    pool = args.pool_size if args.pool_size is not None else dp
    if pool <= 0 or dp % pool:
        raise ValueError(f"pool_size (P={pool}) must divide dp (D={dp})")
    for field in ("context", "block", "chunks", "heads", "kv_heads"):
        if getattr(args, field) <= 0:
            raise ValueError(f"{field} must be positive, got {getattr(args, field)}")
    check_int(args.seed, "seed", 0, 2**31 - 1)  # numpy and torch generators take it
    lengths = tuple(read_lengths_file(args.lengths_file)) if args.lengths_file else ()
    cfg = VerifyConfig(
        nproc=args.nproc,
        cp=cp,
        pool_size=pool,
        systems=SYSTEMS if args.system == "all" else (args.system,),
        heads=args.heads,
        kv_heads=args.kv_heads,
        context=args.context,
        block=args.block,
        chunks=args.chunks,
        seed=args.seed,
        lengths=lengths,
        memory=args.attention_memory,
    )
    result = run(cfg, tol=args.tolerance)
    cases = result["cases"]
    summary = {
        "system": args.system,
        "nproc": args.nproc,
        "cp": cp,
        "dp": dp,
        "pool_size": pool,
        "max_abs_err_out": max(c["max_abs_err_out"] for c in cases),
        "max_abs_err_grad": max(c["max_abs_err_grad"] for c in cases),
        "bytes_sent": sum(sum(c["bytes_sent"]) for c in cases),
        "bytes_planned": sum(sum(c["bytes_planned"]) for c in cases),
        # per core-attention call (one layer), the maximum over ranks, calls and cases
        **{k: max(c[k] for c in cases) for k in COUNTERS + LAYER_FIGURES},
        "ok": result["ok"],
        "cases": cases,
    }
    if args.json:
        return summary
    print(f"libra verify attention: nproc={args.nproc} cp={cp} dp={dp} P={pool}")
    for c in cases:
        print(
            f"  {c['system']:8s} pipeline={'on ' if c['pipelined'] else 'off'} "
            f"out err {c['max_abs_err_out']:.2e} grad err {c['max_abs_err_grad']:.2e} "
            f"bytes sent {sum(c['bytes_sent'])} planned {sum(c['bytes_planned'])} "
            f"kernel calls {c['kernel_calls_fwd']}/{c['kernel_calls_bwd']} for "
            f"{c['tiles_executed']} tiles, host copies {c['host_copies']}, device ops "
            f"{c['device_ops_fwd']}/{c['device_ops_bwd']}, extra {c['extra_over_qkv']:.2f}x "
            f"kept {c['kept']:.2f}x peak {c['peak']:.2f}x Q/K/V "
            f"{'ok' if c['ok'] else 'FAIL'}"
        )
    print(f"  ok: {result['ok']}")
    return {"ok": result["ok"]}  # a failed check exits 1 in every output mode
