"""`libra simulate` and `libra recommend-pool`: the offline simulator's command line."""

from __future__ import annotations

import json

from libra_ext.planner import ORDERS
from libra_ext.simulator.config import SimConfig
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.simulator.report import write_report
from libra_ext.simulator.run import pool_sweep, recommend_pool, simulate, source_for
from libra_ext.workload import preset_names


def _add_common(p) -> None:
    p.add_argument("config", help="simulator config YAML (e.g. configs/sim/libra_paper.yaml)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload", choices=preset_names(), help="override every scenario's workload"
    )
    src.add_argument("--lengths-file", help="document lengths, one positive integer a line")
    p.add_argument("--steps", type=int, help="sampled steps per number (overrides the config)")
    p.add_argument(
        "--order", choices=ORDERS,
        help="production order of each step's sequences (overrides the config's order; "
        "default megatron: Megatron-LM's pretraining sampler)",
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
    return cfg


def run_simulate(args):
    cfg = _config(args)
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
