"""Run a simulator configuration: DP scaling, pool-size sweep, attention latency, PP ratio and
planner time per system, the paper's numbers beside ours, and a recommended pool size."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from libra_ext.pipeline import order_slots
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.simulator import dcp, distca_gpu
from libra_ext.simulator.config import Scenario, SimConfig
from libra_ext.simulator.cost import StepTimes, dp_reduction, simulate_plan
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.workload import (
    ATTN_BWD_FACTOR,
    LINEAR_BWD_FACTOR,
    LengthSource,
    linear_fwd_flops_per_token,
)

# Planner options and whether the TAP pipeline hides exchange, per simulated system.
SYSTEM_SPECS = {
    "ulysses": (dict(system="ulysses"), False),
    "wlb": (dict(system="wlb"), False),
    # the planner's DistCA: one attention server per replica (the stronger variant; `distca`
    # is DistCA as deployed, every GPU a server: distca_gpu)
    "distca-replica": (dict(system="distca"), True),
    "libra-tap": (dict(system="libra", vrsp=False), False),
    "libra-tap-vrsp": (dict(system="libra"), False),
    "libra": (dict(system="libra"), True),
}


@dataclass
class PointResult:
    """One (system, DP, pool size) point averaged over the sampled steps."""

    step_time: float
    tokens_per_step: float
    attn_mean: float
    attn_max: float
    attention_share: float
    attn_max_over_mean: float
    exchange_cost: float
    pp_ratio: float
    pp_bubble_before: float
    """Modeled 1F1B bubble share with the plan's micro-batch order (SimConfig.pp stages)."""
    pp_bubble_after: float
    """The same with each exchange pool's balanced order (system.pp_order = balanced)."""
    plan_ms: float
    imbalance_before: float
    imbalance_after: float
    rank_attention: list
    error: str = ""

    @property
    def throughput(self) -> float:
        return self.tokens_per_step / self.step_time if self.step_time > 0 else 0.0


def source_for(scenario: Scenario, workload: str | None, lengths_file: str | None) -> LengthSource:
    if lengths_file:
        return LengthSource(lengths_file=lengths_file)
    name = workload or scenario.workload
    if name.startswith("file:"):
        return LengthSource(lengths_file=name[5:])
    return LengthSource(preset=name)


def run_point(
    system: str,
    scenario: Scenario,
    dp: int,
    pool: int,
    steps_data: list,
    cfg: SimConfig,
    hw: HardwareProfile,
    model_bubble: bool = True,
) -> PointResult:
    """`model_bubble`: also model each step's 1F1B bubble (reported at the top DP point only)."""
    model = cfg.model
    layout = LayoutConfig(
        dp=dp, cp=scenario.cp, tp=scenario.tp, pool_size=pool, context=scenario.context
    )
    if system == "megatron-dcp":  # megatron-core's Python scheduler: fewer steps
        return _run_dcp(system, scenario, dp, steps_data[: cfg.dcp_steps], cfg, hw)
    if system == "megatron-dyncp":
        return _run_dcp(system, scenario, dp, steps_data, cfg, hw)
    if system == "distca":
        return _run_distca_gpu(scenario, dp, steps_data, cfg, hw)
    opts, pipelined = SYSTEM_SPECS[system]
    planner = Planner(layout, model, PlannerOptions(**opts, order=cfg.order))
    planner.set_cost_model(cfg.cost_table)  # (ulysses plans do not change)
    times, tokens, plan_ms, before, after, stats, bubbles = [], [], [], [], [], [], []
    last: StepTimes | None = None
    for seqs in steps_data:
        plan = planner.plan(seqs)
        t = simulate_plan(plan, model, hw, pipelined=pipelined, chunks=cfg.chunks,
                          attention_memory=cfg.attention_memory)
        times.append(t.step)
        tokens.append(float(plan.doc_lengths.sum()))
        plan_ms.append(plan.plan_ms)
        before.append(plan.inter_pool_imbalance_before)
        after.append(plan.inter_pool_imbalance)
        lat = t.attention_latency
        share = float((t.attention.mean()) / max(t.rank_total.mean(), 1e-30))
        exch = float(t.pool_comm.mean() / max(t.attention.mean(), 1e-30))
        stats.append(
            (
                lat.mean(),
                lat.max(),
                share,
                t.attention.max() / max(t.attention.mean(), 1e-30),
                exch,
                t.slot.max() / max(t.slot.mean(), 1e-30),
            )
        )
        if model_bubble and cfg.pp > 1:
            o = order_slots(t.slot, plan.exchange_pool, cfg.pp, "balanced")
            bubbles.append((o.bubble_before, o.bubble_after))
        last = t
    s = np.mean(stats, axis=0)
    bubble = np.mean(bubbles, axis=0) if bubbles else (0.0, 0.0)
    return PointResult(
        step_time=float(np.mean(times)),
        tokens_per_step=float(np.mean(tokens)),
        attn_mean=float(s[0]),
        attn_max=float(s[1]),
        attention_share=float(s[2]),
        attn_max_over_mean=float(s[3]),
        exchange_cost=float(s[4]),
        pp_ratio=float(s[5]),
        pp_bubble_before=float(bubble[0]),
        pp_bubble_after=float(bubble[1]),
        plan_ms=float(statistics.median(plan_ms)),
        imbalance_before=float(np.mean(before)),
        imbalance_after=float(np.mean(after)),
        rank_attention=last.attention[:, 0].tolist() if last is not None else [],
    )


def _run_dcp(
    peer: str,
    scenario: Scenario,
    dp: int,
    steps_data: list,
    cfg: SimConfig,
    hw: HardwareProfile,
) -> PointResult:
    """A Megatron CP-scheduler peer (dcp.SCHEDULERS) on the steps."""
    nan = float("nan")
    scheduler, why = dcp.balanced_cp_scheduler() if peer == "megatron-dcp" else (True, "")
    if scheduler is None:
        return PointResult(
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            [],
            error=f"not importable: {why}",
        )
    exposed = dp_reduction(cfg.model, hw, dp, scenario.cp, scenario.tp)
    steps, attn, sched = [], [], []
    for seqs in steps_data:
        r = dcp.simulate_cp_step(
            peer, seqs, dp, scenario.cp, scenario.context, cfg.model, hw, exposed, tp=scenario.tp
        )
        steps.append(r.step)
        attn.append(r.gpu_attention)
        sched.append(r.schedule_ms)
    return _per_gpu_point(steps, steps_data, attn, sched)


def _per_gpu_point(steps: list, steps_data: list, attn: list, sched: list) -> PointResult:
    """A peer simulated GPU by GPU (no plan): step seconds, the steps' tokens, attention seconds
    per GPU and scheduling ms per step; what only a plan has is NaN."""
    nan = float("nan")
    a = np.mean(attn, axis=0)
    return PointResult(
        step_time=float(np.mean(steps)),
        tokens_per_step=float(np.mean([sum(map(sum, s)) for s in steps_data])),
        attn_mean=float(a.mean()),
        attn_max=float(a.max()),
        attention_share=nan,
        attn_max_over_mean=float(a.max() / a.mean()),
        exchange_cost=nan,
        pp_ratio=nan,
        pp_bubble_before=nan,
        pp_bubble_after=nan,
        plan_ms=float(statistics.median(sched)),
        imbalance_before=nan,
        imbalance_after=nan,
        rank_attention=attn[-1].tolist(),
    )


def _run_distca_gpu(
    scenario: Scenario, dp: int, steps_data: list, cfg: SimConfig, hw: HardwareProfile
) -> PointResult:
    """DistCA as deployed (distca_gpu): each micro-batch's D x C GPUs are attention servers,
    balanced by DistCA's greedy at the planner's DistCA tolerance. A micro-batch takes its
    slowest GPU: attention of the pieces it serves (all of its tp slice's heads; each part at the
    efficiency of the keys it attends) plus the linear
    layers of its S/C tokens, or the micro-batch's all-to-all if that is longer - the busiest
    GPU's query and KV rows to and from servers (distca_gpu.traffic), forward and backward, which
    DistCA's ping-pong overlaps with compute (assumed here in full: generous to DistCA)."""
    model, C, tp, S = cfg.model, scenario.cp, scenario.tp, scenario.context
    n_gpus, tolerance = dp * C, PlannerOptions().distca_tolerance
    L, d, h = model.layers, model.head_dim, model.heads
    lin = (linear_fwd_flops_per_token(model) * (1 + LINEAR_BWD_FACTOR) * L / tp
           / (hw.bf16_peak * hw.linear_efficiency))
    exposed = dp_reduction(model, hw, dp, C, tp)
    link = hw.link(n_gpus * tp <= hw.gpus_per_node)
    steps, attn, sched = [], [], []
    for seqs in steps_data:
        seqs = [list(s) for s in seqs]
        total, gpu_attn, ms = 0.0, np.zeros(n_gpus), 0.0
        for batch in distca_gpu.slots_of(seqs, dp, cfg.order):
            t0 = time.perf_counter()
            _, layout = distca_gpu.balance(
                batch, S // C, n_gpus, tolerance, h * d, model.kv_heads * d, pieces=True)
            ms += (time.perf_counter() - t0) * 1e3
            rows = distca_gpu.traffic(layout, n_gpus)
            one_way = (rows[:, 0] * (h / tp) + rows[:, 1] * 2 * (model.kv_heads / tp)) * d * 2
            comm = (one_way.max() / link.bandwidth + 4 * link.latency) * L if one_way.any() else 0.0
            # each part at the efficiency of the keys it attends (as the planner's tiles are
            # timed: a tile of rows against its causal prefix runs at its prefix's length)
            _, (g, hq, hk, tq, tk, _) = layout
            a = np.zeros(len(g))
            for q, kv in ((hq, hk), (tq, tk)):
                part = distca_gpu.pairs(q, kv).astype(np.float64)
                a += part / hw.attn_efficiency(np.maximum(kv, 1).astype(np.float64))
            a *= 4.0 * d * (h / tp) * L / hw.attn_peak * (1.0 + ATTN_BWD_FACTOR / hw.attn_bwd_speed)
            per_gpu = np.bincount(g, weights=a, minlength=n_gpus) + 2 * L * hw.call_floor
            gpu_attn += per_gpu
            total += max(float((per_gpu + (S / C) * lin).max()), comm)
        steps.append(total + exposed)
        attn.append(gpu_attn)
        sched.append(ms)
    return _per_gpu_point(steps, steps_data, attn, sched)


def recommend_pool(sweep: dict) -> tuple[int, str]:
    """The pool size with the lowest modeled step time, and why."""
    best = min(sweep, key=lambda p: sweep[p]["step_time"])
    b = sweep[best]
    others = ", ".join(f"P={p}: {sweep[p]['step_time']:.2f} s" for p in sorted(sweep) if p != best)
    reason = (
        f"P={best} gives the lowest modeled step time ({b['step_time']:.2f} s; {others}): "
        f"imbalance after VRSP {b['imbalance_after']:.4f}, exchange cost "
        f"{b['exchange_cost']:.3f} of attention time"
    )
    return best, reason


def pool_sweep(
    scenario: Scenario, steps_data: list, cfg: SimConfig, hw: HardwareProfile, progress=None
) -> dict:
    out = {}
    sweep_data = steps_data
    if scenario.sweep_dp > scenario.gbs:
        raise ValueError(f"scenarios.{scenario.name}.pool_sweep.dp exceeds gbs")
    for p in scenario.sweep_pools:
        r = run_point(
            "libra", scenario, scenario.sweep_dp, p, sweep_data, cfg, hw, model_bubble=False
        )
        out[p] = {
            "imbalance_before": r.imbalance_before,
            "imbalance_after": r.imbalance_after,
            "exchange_cost": r.exchange_cost,
            "step_time": r.step_time,
        }
        if progress is not None:
            progress.update(1)
    return out


def simulate(
    cfg: SimConfig,
    workload: str | None = None,
    lengths_file: str | None = None,
    progress: bool = True,
) -> dict:
    """Run every scenario of `cfg`; returns the results dictionary (see results.json)."""
    hw = (
        HardwareProfile.load(cfg.hardware)
        if not cfg.hardware.endswith(".yaml")
        else HardwareProfile.load(cfg.hardware)
    )
    total = sum(len(s.dp) * len(cfg.systems) + len(s.sweep_pools) for s in cfg.scenarios)
    bar = None
    if progress:

        bar = tqdm(total=total, desc="simulate", unit="point", leave=False)
    results = {
        "config": cfg.path,
        "hardware": hw.name,
        "hardware_source": hw.source,
        "steps": cfg.steps,
        "dcp_steps": cfg.dcp_steps,
        "pipeline_stages": cfg.pp,
        "attention_memory": cfg.attention_memory,
        "workload": {},
        "scenarios": {},
    }
    try:
        for sc in cfg.scenarios:
            src = source_for(sc, workload, lengths_file)
            results["workload"][sc.name] = src.name
            steps_data = [src.step(sc.gbs, sc.context, cfg.seed, s) for s in range(cfg.steps)]
            points: dict[str, dict[int, PointResult]] = {}
            for system in cfg.systems:
                points[system] = {}
                for dp in sc.dp:
                    pool = _pool_for(sc.pool_size, dp)
                    points[system][dp] = run_point(
                        system, sc, dp, pool, steps_data, cfg, hw, model_bubble=dp == max(sc.dp)
                    )
                    if bar is not None:
                        bar.update(1)
            sweep = pool_sweep(sc, steps_data, cfg, hw, bar)
            results["scenarios"][sc.name] = _summarize(sc, points, sweep, src.name)
    finally:
        if bar is not None:
            bar.close()
    results["reference"] = cfg.reference
    return results


def _pool_for(pool: int, dp: int) -> int:
    """The pool size at a DP point: the configured one, or all of dp below it (the config
    refuses a pool size that does not divide a larger dp)."""
    p = min(pool, dp)
    if dp % p:
        raise ValueError(f"pool size {pool} does not divide dp {dp}")
    return p


def _summarize(sc: Scenario, points: dict, sweep: dict, workload: str) -> dict:
    dps = sorted(sc.dp)
    top = dps[-1]
    out = {
        "workload": workload,
        "context": sc.context,
        "gbs": sc.gbs,
        "cp": sc.cp,
        "dp_values": dps,
        "dp_scaling": {},
        "scaling_efficiency_dp16": {},
        "step_time": {},
        "attention_latency": {},
        "pp_worst_over_mean": {},
        "pp_bubble": {},
        "planner_ms": {},
        "speedup_over_ulysses": {},
        "attention_share": {},
        "attn_max_over_mean": {},
        "rank_attention": {},
        "errors": {},
    }
    for system, by_dp in points.items():
        base = by_dp[dps[0]]
        if by_dp[top].error:
            out["errors"][system] = by_dp[top].error
            continue
        out["dp_scaling"][system] = {
            dp: by_dp[dp].throughput / base.throughput * dps[0] if base.throughput else float("nan")
            for dp in dps
        }
        out["scaling_efficiency_dp16"][system] = out["dp_scaling"][system][top] / top
        out["step_time"][system] = {dp: by_dp[dp].step_time for dp in dps}
        p = by_dp[top]
        out["attention_latency"][system] = {"mean": p.attn_mean, "max": p.attn_max}
        out["pp_worst_over_mean"][system] = p.pp_ratio
        if not system.startswith("megatron-"):
            out["pp_bubble"][system] = {"before": p.pp_bubble_before, "after": p.pp_bubble_after}
        out["planner_ms"][system] = p.plan_ms
        out["attention_share"][system] = p.attention_share
        out["attn_max_over_mean"][system] = p.attn_max_over_mean
        out["rank_attention"][system] = p.rank_attention
    if "ulysses" in points and not points["ulysses"][top].error:
        u = points["ulysses"][top]
        for system, by_dp in points.items():
            if not by_dp[top].error:
                out["speedup_over_ulysses"][system] = by_dp[top].throughput / u.throughput
    out["pool_sweep"] = sweep
    out["pool_sweep_dp"] = sc.sweep_dp
    out["recommended_pool_size"], out["recommended_pool_reason"] = recommend_pool(sweep)
    out["scaling_dp"] = top
    return out
