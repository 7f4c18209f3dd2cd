"""`libra memory`: the estimated per-GPU memory of a training config (libra_ext.memory), with and
without its activation recompute, against the hardware profile's memory. Needs no torch."""

from __future__ import annotations

from libra_ext.memory import Layout, estimate, exchange_bytes_per_layer
from libra_ext.planner import LayoutConfig, Planner
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.workload import PRESET_CONTEXT, LengthSource, check_seed
from megatron.libra.cli.args import positive
from megatron.libra.config import TrainConfig


def add_memory_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="estimated per-GPU memory of a training config",
        description="Estimate the busiest GPU's memory for a training config (weights, "
        "gradients, optimizer state, activations with and without recompute, the pool exchange "
        "buffers from plans of the config's workload, logits) and say whether it fits the "
        "hardware profile's memory. A model, not a measurement.",
    )
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--world", type=int, required=True, help="GPUs of the run (world size)")
    p.add_argument("--hardware", default="h200-sxm", help="hardware profile (default h200-sxm)")
    p.add_argument(
        "--workload",
        help="length preset of the plans that size the exchange buffers (default: the config's "
        "synthetic workload, else the preset of its context length)",
    )
    p.add_argument("--steps", type=int, default=4, help="planned steps (the largest counts)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    p.set_defaults(func=run_memory)


def _workload(cfg, name: str | None) -> str:
    if name is not None:
        return name
    if cfg.data.source == "synthetic" and cfg.data.lengths_file is None:
        return cfg.data.workload
    return min(PRESET_CONTEXT, key=lambda k: abs(PRESET_CONTEXT[k] - cfg.data.context))


def run_memory(args) -> dict | None:
    positive(args.world, "world")
    positive(args.steps, "steps")
    cfg = TrainConfig.load(args.config, args.overrides)
    dp = cfg.check_layout(args.world)
    hw = HardwareProfile.load(args.hardware)
    p, d = cfg.parallel, cfg.data
    lay = Layout(
        tp=p.tp, cp=p.cp, pp=p.pp, vpp=p.vpp, dp=dp, ep=p.ep, context=d.context,
        micro_batches=d.gbs // dp, sequence_parallel=p.sequence_parallel,
        distributed_optimizer=cfg.optimizer.distributed, dtype=cfg.dtype,
    )
    workload = _workload(cfg, args.workload)
    check_seed(d.seed)
    planner = Planner(
        LayoutConfig(dp=dp, cp=p.cp, tp=p.tp, pool_size=p.pool_size, context=d.context),
        cfg.model,
        cfg.system.planner_options(d.order, 2 if cfg.dtype == "bf16" else 4),
    )
    source = LengthSource(preset=workload)
    exchange = max(
        exchange_bytes_per_layer(planner.plan(source.step(d.gbs, d.context, d.seed, s)))
        for s in range(args.steps)
    )
    m = cfg.model
    rows = {
        mode: estimate(m, lay, mode, m.recompute_num_layers, exchange,
                       cfg.system.attention_memory, cfg.system.name)
        for mode in dict.fromkeys(["none", m.recompute])
    }
    limit = hw.memory_gb * 1e9 if hw.memory_gb is not None else None
    out = {
        "config": args.config,
        "world": args.world,
        "layout": {"tp": p.tp, "cp": p.cp, "pp": p.pp, "vpp": p.vpp, "dp": dp, "ep": p.ep,
                   "sequence_parallel": p.sequence_parallel,
                   "distributed_optimizer": cfg.optimizer.distributed},
        "workload": workload,
        "hardware": hw.name,
        "memory_gb": hw.memory_gb,
        "recompute": m.recompute,
        "attention_memory": cfg.system.attention_memory,
        "estimates": {
            mode: {**r, "fits": None if limit is None else r["total_bytes"] <= limit}
            for mode, r in rows.items()
        },
    }
    if args.json:
        return out
    _print(out)
    return None


def _print(out: dict) -> None:
    lay = out["layout"]
    print(
        f"libra memory: {out['config']} on {out['world']} GPUs (tp {lay['tp']} x cp {lay['cp']} x "
        f"pp {lay['pp']} x dp {lay['dp']}, ep {lay['ep']}, vpp {lay['vpp']}); exchange buffers "
        f"from {out['workload']} plans; per GPU, GB (10^9 B)"
    )
    modes = list(out["estimates"])
    header = "".join(f" {('recompute ' + k):>18s}" for k in modes)
    print(f"  {'':34s}{header}")
    rows = [
        ("weights", "weights_bytes"),
        ("gradients", "grads_bytes"),
        ("optimizer state", "optimizer_bytes"),
        ("activations (incl. exchange buffers)", "activations_bytes"),
        ("logits + softmax", "logits_bytes"),
        ("total", "total_bytes"),
    ]
    for name, key in rows:
        cells = "".join(f" {out['estimates'][k][key] / 1e9:18.1f}" for k in modes)
        print(f"  {name:34s}{cells}")
    first = out["estimates"][modes[0]]
    per_token = first["activation_bytes_per_token_layer"]
    print(f"  {'activations per token and layer':34s} {per_token:.0f} B; pool exchange kept per "
          f"layer {first['exchange_bytes_per_layer'] / 1e9:.3f} GB")
    if out["memory_gb"] is not None:
        for k in modes:
            r = out["estimates"][k]
            verdict = "fits" if r["fits"] else "does NOT fit"
            print(f"  recompute {k}: {r['total_bytes'] / 1e9:.1f} GB {verdict} in "
                  f"{out['memory_gb']:.0f} GB ({out['hardware']})")

