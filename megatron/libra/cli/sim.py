"""`libra simulate` and `libra recommend-pool`: the offline simulator's command line."""

from __future__ import annotations

import json
import sys

from libra_ext import costmodel
from libra_ext.memory import ATTENTION_MEMORY
from libra_ext.planner import ORDERS
from libra_ext.simulator.config import SimConfig
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.simulator.report import write_report
from libra_ext.simulator.run import pool_sweep, recommend_pool, simulate, source_for
from libra_ext.workload import preset_names
from megatron.libra.cli.args import default_dtype, int_list_arg, positive


def _add_common(p) -> None:
    p.add_argument("config", help="simulator config YAML (e.g. configs/sim/libra_paper.yaml)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload", choices=preset_names(), help="override every scenario's workload"
    )
    src.add_argument("--lengths-file", help="document lengths, one positive integer a line")
    p.add_argument("--steps", type=int, help="sampled steps per number (overrides the config)")
    p.add_argument(
        "--hardware",
        help="hardware profile name or YAML file (e.g. one written by `libra calibrate`); "
        "overrides the config's hardware",
    )
    p.add_argument(
        "--order", choices=ORDERS,
        help="production order of each step's sequences (overrides the config's order; "
        "default megatron: Megatron-LM's pretraining sampler)",
    )
    p.add_argument(
        "--cost-table",
        help="plan libra, distca and wlb balancing a cost table's predicted time instead of pairs: "
        "profile (the hardware profile's) or a JSON / YAML file (a table, or a `libra bench "
        "replay --json` result with an online_table)",
    )
    p.add_argument(
        "--attention-memory", choices=ATTENTION_MEMORY,
        help="system.attention_memory of libra, distca-replica, ulysses and wlb (overrides the "
        "config's; default keep): owner and rebuild are priced with what they send again in "
        "the backward",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_simulate_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="model step time per system; the paper's tables side by side",
        description="Simulate DP scaling, the pool-size sweep, attention latency, "
        "PP ratio and planner time for every system of a config.",
    )
    _add_common(p)
    p.add_argument("--out", default="out/sim", help="report directory (default out/sim)")
    p.set_defaults(func=run_simulate)


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure the attention kernel here and write a hardware profile",
        description="Time the attention kernel this device runs (the runtime's backend ladder) "
        "over whole causal documents of each attended length and over TAP-style query tiles, "
        "forward and backward; write a hardware profile whose attention section is measured "
        "(peak, efficiency curve, backward speed, call floor) and whose compute and network "
        "figures come from --base.",
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--heads", type=int, default=4, help="query heads per call (default 4)")
    p.add_argument("--kv-heads", type=int, default=1, help="KV heads per call (default 1)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--lengths", default="128,512,1024,2048,4096,8192,16384",
                   help="attended lengths of the efficiency curve")
    p.add_argument("--tokens", type=int, default=65536,
                   help="query tokens per measured call (default 65536)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    p.add_argument("--backend", default="auto", help="auto, te, flash, varlen or reference")
    p.add_argument("--threads", type=int,
                   help="intra-op threads on the cpu (default 1: a training rank's share where "
                   "local workers share the cores, timed by the thread's CPU time as training "
                   "and bench replay time kernels)")
    p.add_argument("--base", default="h100-sxm",
                   help="profile whose compute and network figures are kept (default h100-sxm)")
    p.add_argument("--name", default="calibrated", help="profile name (default calibrated)")
    p.add_argument("--out", default="configs/hardware/calibrated.yaml", help="profile to write")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args):
    # deferred: the CLI starts without torch
    from libra_ext.measure.calibrate import calibrate, write_profile

    lengths = tuple(int_list_arg(args.lengths, "lengths"))
    for field in ("tokens", "reps"):
        positive(getattr(args, field), field)
    result = calibrate(
        device=args.device,
        dtype=default_dtype(args),
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        lengths=lengths,
        tokens=args.tokens,
        reps=args.reps,
        backend=None if args.backend == "auto" else args.backend,
        threads=args.threads,
    )
    path = write_profile(result, args.base, args.name, args.out)
    result["profile"] = str(path)
    if args.json:
        return result
    a, m = result["attention"], result["measured"]
    threads = f", {m['threads']} thread(s)" if "threads" in m else ""
    print(f"libra calibrate: {m['device']}{threads}, {m['backend']} kernel, {m['dtype']}, heads "
          f"{m['heads']}/{m['kv_heads']}, head dim {m['head_dim']}: wrote {path}")
    print(f"  peak {a['peak_tflops']:.3g} TFLOP/s forward; backward at "
          f"{a['backward_speed_ratio']:.2f} of forward; call floor {a['call_floor_us']:.1f} us")
    print("  attended length  forward TFLOP/s  efficiency")
    for r, (_, eff) in zip(result["rows"], a["curve"], strict=True):
        print(f"  {r['tokens']:15d}  {r['fwd_tflops']:15.4g}  {eff:10.3f}")
    return None


def add_recommend_parser(sub) -> None:
    p = sub.add_parser(
        "recommend-pool",
        help="pick the pool size with the lowest modeled step time",
        description="Run only the pool-size sweep of every scenario and recommend "
        "the pool size that minimises the modeled step time.",
    )
    _add_common(p)
    p.set_defaults(func=run_recommend)


def _config(args) -> SimConfig:
    cfg = SimConfig.load(args.config)
    if args.steps is not None:
        if args.steps <= 0:
            raise ValueError(f"steps must be positive, got {args.steps}")
        cfg.steps = args.steps
        cfg.dcp_steps = min(cfg.dcp_steps, args.steps)
    if args.order is not None:
        cfg.order = args.order
    if args.attention_memory is not None:
        cfg.attention_memory = args.attention_memory
    if args.hardware is not None:
        HardwareProfile.load(args.hardware)  # refuse a bad profile before any work
        cfg.hardware = args.hardware
    if getattr(args, "cost_table", None):
        cfg.cost_table = costmodel.load_table(args.cost_table, HardwareProfile.load(cfg.hardware),
                                              cfg.model.head_dim)
    return cfg


MIN_STEPS = 24
"""Sampled steps below which heavy-tailed figures move by more than a few percent run to run (at
the paper's 1M layout, 6 steps move Ulysses' DP16 efficiency by +-0.05 from seed to seed)."""


def _note_steps(cfg: SimConfig) -> None:
    if cfg.steps < MIN_STEPS:
        print(
            f"libra simulate: note: {cfg.steps} sampled step(s) per number; long-tail workloads "
            f"need at least {MIN_STEPS} for figures that hold from one seed to the next",
            file=sys.stderr,
        )


def run_simulate(args):
    cfg = _config(args)
    _note_steps(cfg)
    results = simulate(
        cfg, workload=args.workload, lengths_file=args.lengths_file, progress=not args.no_progress
    )
    paths = write_report(results, args.out)
    if args.json:
        return json.loads(json.dumps(results, default=float))
    print(
        f"libra simulate: wrote {paths['report']}, {paths['results']} and "
        f"{len(paths['figures'])} figures"
    )
    for name, s in results["scenarios"].items():
        top = s["scaling_dp"]
        eff = ", ".join(f"{k} {v:.1%}" for k, v in s["scaling_efficiency_dp16"].items())
        print(f"  {name} ({s['workload']}): DP{top} scaling efficiency: {eff}")
        print(f"  {name}: recommended pool size {s['recommended_pool_size']}")
    return None


def run_recommend(args):
    cfg = _config(args)
    _note_steps(cfg)
    hw = HardwareProfile.load(cfg.hardware)
    out = {"hardware": hw.name, "scenarios": {}}
    for sc in cfg.scenarios:
        src = source_for(sc, args.workload, args.lengths_file)
        steps = [src.step(sc.gbs, sc.context, cfg.seed, s) for s in range(cfg.steps)]
        sweep = pool_sweep(sc, steps, cfg, hw)
        best, reason = recommend_pool(sweep)
        out["scenarios"][sc.name] = {
            "workload": src.name,
            "dp": sc.sweep_dp,
            "recommended_pool_size": best,
            "reason": reason,
            "pool_sweep": sweep,
        }
    if args.json:
        return out
    for name, r in out["scenarios"].items():
        print(
            f"{name} ({r['workload']}, DP{r['dp']}): pool size {r['recommended_pool_size']} — "
            f"{r['reason']}"
        )
    return None
