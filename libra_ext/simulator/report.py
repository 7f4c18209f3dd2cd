"""Markdown report, results.json and figures of a simulator run, with the paper's numbers beside
ours and the gap."""

from __future__ import annotations

import json
import math
from pathlib import Path

GAP_NOTE = 0.20
"""Differences above this share of the paper's figure get an explanation line."""


def _fmt(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _gap(ours, paper) -> str:
    if paper is None or ours is None or (isinstance(ours, float) and math.isnan(ours)):
        return "–"
    rel = (ours - paper) / paper if paper else float("inf")
    return f"{ours - paper:+.3f} ({rel:+.0%})"


def _bubble(b: dict | None) -> str:
    if not b or any(isinstance(b[k], float) and math.isnan(b[k]) for k in ("before", "after")):
        return "–"  # not modeled for this system
    return f"{b['before']:.3f} → {b['after']:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _ref(results: dict, scenario: str) -> dict:
    return (results.get("reference") or {}).get("scenarios", {}).get(scenario, {})


def explain_efficiency(s: dict, system: str, paper_eff: float | None) -> str:
    """Why the scaling efficiency is what it is: eff ~ 1 / (f R + 1 - f) with f the attention
    share of a rank's time and R the per-rank attention max/mean at the top DP."""
    f, R = s["attention_share"].get(system), s["attn_max_over_mean"].get(system)
    if f is None or R is None or math.isnan(f):
        return ""
    text = (
        f"{system}: attention is f = {f:.2f} of a rank's time and the per-rank attention "
        f"max/mean at DP{s['scaling_dp']} is R = {R:.2f}, so efficiency ~ 1/(fR + 1 - f) = "
        f"{1 / (f * R + 1 - f):.3f}"
    )
    if paper_eff:
        need = (1 / paper_eff - 1 + f) / f
        if R < 1.05:
            text += (
                f"; attention is already balanced here, so the paper's {paper_eff:.3f} "
                f"implies about {1 / paper_eff - 1 / (f * R + 1 - f):.2f} step-times of cost "
                f"outside this model's balanced attention and exposed exchange (runtime "
                f"overheads of the real system)"
            )
        else:
            text += (
                f"; the paper's {paper_eff:.3f} would need R ~ {need:.2f} at this f, i.e. a "
                f"more skewed per-replica workload than the preset calibrated to the "
                f"published length statistics and inter-pool imbalance produces"
            )
    return text


def render_markdown(results: dict) -> str:
    lines = [
        "# Libra simulator report",
        "",
        f"Hardware `{results['hardware']}` (attention: "
        f"{results.get('hardware_source', 'published figures')}); every number averages "
        f"{results['steps']} sampled "
        f"steps ({results['dcp_steps']} for megatron-dcp). Config: `{results['config']}`.",
        "",
    ]
    for name, s in results["scenarios"].items():
        lines += _scenario(results, name, s)
    return "\n".join(lines)


def _scenario(results: dict, name: str, s: dict) -> list[str]:
    """One scenario's sections: DP scaling, scaling efficiency, the pool sweep, the per-system
    table, and the explanation of every gap above GAP_NOTE."""
    ref = _ref(results, name)
    lines = [
        f"## Scenario `{name}`",
        "",
        f"Workload: `{s['workload']}`; context {s['context']}, GBS {s['gbs']}, CP {s['cp']}.",
        "",
    ]
    notes: list = []
    lines += _dp_scaling(s, ref, notes)
    lines += _efficiency(s, ref)
    lines += _pool_sweep(results, name, s, ref, notes)
    lines += _per_system(results, s, ref, notes)
    for system, why in s.get("errors", {}).items():
        lines += [f"- `{system}`: not simulated — {why}"]
    notes = [n for n in notes if n]
    if notes:
        lines += ["### Differences above 20% of the paper's figure", ""]
        lines += [f"- {n}" for n in dict.fromkeys(notes)]
        lines += [""]
    lines += [
        f"![DP scaling](dp_scaling_{name}.png)",
        f"![pool sweep](pool_sweep_{name}.png)",
        f"![per-rank attention](rank_attention_{name}.png)",
        "",
    ]
    return lines


def _dp_scaling(s: dict, ref: dict, notes: list) -> list[str]:
    top = s["scaling_dp"]
    paper_dp = ref.get("dp_scaling_dp16", {})
    rows = []
    for system, by_dp in s["dp_scaling"].items():
        row = [system] + [_fmt(by_dp[dp], 2) for dp in s["dp_values"]]
        p = paper_dp.get(system)
        row += [_fmt(p, 2) if p else "–", _gap(by_dp[top], p) if p else "–"]
        rows.append(row)
        if p and abs(by_dp[top] - p) > GAP_NOTE * p:
            notes.append(explain_efficiency(s, system, p / top))
    return [
        "### DP scaling (throughput relative to DP1, fixed GBS)",
        "",
        _table(
            ["system"] + [f"DP{d}" for d in s["dp_values"]] + [f"paper DP{top}", "gap"], rows
        ),
        "",
    ]


def _efficiency(s: dict, ref: dict) -> list[str]:
    top = s["scaling_dp"]
    paper_eff = ref.get("scaling_efficiency_dp16", {})
    rows = [
        [
            system,
            _fmt(v),
            _fmt(paper_eff.get(system)) if system in paper_eff else "–",
            _gap(v, paper_eff.get(system)) if system in paper_eff else "–",
        ]
        for system, v in s["scaling_efficiency_dp16"].items()
    ]
    return [
        f"### Scaling efficiency at DP{top}",
        "",
        _table(["system", "ours", "paper", "gap"], rows),
        "",
    ]


def _pool_sweep(results: dict, name: str, s: dict, ref: dict, notes: list) -> list[str]:
    imb = ref.get("imbalance_p8", {})
    exch = ref.get("exchange_cost", {})
    rows = []
    for p, v in sorted(s["pool_sweep"].items(), key=lambda kv: int(kv[0])):
        pi = int(p)
        pb, pa = (imb.get("before"), imb.get("after")) if pi == 8 else (None, None)
        pe = exch.get(pi)
        rows.append(
            [
                str(pi),
                _fmt(v["imbalance_before"]),
                _fmt(pb) if pb else "–",
                _fmt(v["imbalance_after"], 4),
                _fmt(pa, 4) if pa else "–",
                _fmt(v["exchange_cost"]),
                _fmt(pe, 2) if pe else "–",
                _gap(v["exchange_cost"], pe) if pe else "–",
                _fmt(v["step_time"], 2),
            ]
        )
        if pe and abs(v["exchange_cost"] - pe) > GAP_NOTE * pe:
            notes.append(
                f"exchange cost at P={pi}: ours is the busiest member's pool all-to-all time "
                f"(bytes / inter-node bandwidth + per-peer latency) over the mean attention "
                f"time; it grows with P because a heavy owner ships its excess to more peers "
                f"and the busiest member sets the collective's time ({_fmt(v['exchange_cost'])}"
                f" vs the paper's {pe})"
            )
        if pb and abs(v["imbalance_before"] - pb) > GAP_NOTE * pb:
            notes.append(
                f"imbalance before VRSP at P=8: {_fmt(v['imbalance_before'])} vs "
                f"{pb}: it is a property of the workload preset (see "
                f"cpp/src/generators.cpp for what each preset reproduces)"
            )
        if pa and v["imbalance_after"] > pa * (1 + GAP_NOTE) and v["imbalance_after"] > 0.01:
            notes.append(
                f"imbalance after VRSP at P=8: {_fmt(v['imbalance_after'], 4)} vs {pa}: some "
                f"packed sequences are one long document (up to the context length) heavier "
                f"than a group's mean, so no exact-cardinality placement can go lower (the "
                f"planner reports its ratio to that lower bound)"
            )
    return [
        f"### Pool-size sweep (libra, DP{results['scenarios'][name]['pool_sweep_dp']})",
        "",
        _table(
            [
                "P",
                "imbalance before",
                "paper",
                "after VRSP",
                "paper",
                "exchange cost",
                "paper",
                "gap",
                "step s",
            ],
            rows,
        ),
        "",
        f"**Recommended pool size: {s['recommended_pool_size']}** — "
        f"{s['recommended_pool_reason']}.",
        "",
    ]


def _per_system(results: dict, s: dict, ref: dict, notes: list) -> list[str]:
    top = s["scaling_dp"]
    sp_ref = ref.get("speedup_over_ulysses_dp16", {})
    rows = []
    for system in s["attention_latency"]:
        lat = s["attention_latency"][system]
        sp = s["speedup_over_ulysses"].get(system)
        p = sp_ref.get(system)
        rows.append(
            [
                system,
                _fmt(lat["mean"], 2),
                _fmt(lat["max"], 2),
                _fmt(s["pp_worst_over_mean"].get(system), 2),
                _bubble(s.get("pp_bubble", {}).get(system)),
                _fmt(s["planner_ms"].get(system), 2),
                _fmt(sp, 2),
                _fmt(p, 2) if p else "–",
                _gap(sp, p) if p else "–",
            ]
        )
        if p and sp and abs(sp - p) > GAP_NOTE * p:
            notes.append(
                explain_efficiency(s, "ulysses", None)
                + "; "
                + explain_efficiency(s, system, None)
            )
    return [
        f"### Per system at DP{top}",
        "",
        _table(
            [
                "system",
                "attention mean s",
                "attention max s",
                "PP worst/mean",
                f"1F1B bubble pp={results.get('pipeline_stages', 4)}: plan → balanced",
                "planner ms",
                "speedup vs ulysses",
                "paper",
                "gap",
            ],
            rows,
        ),
        "",
        "Attention time includes its communication (Ulysses all-to-all or KV all-gather, "
        "and the exposed pool exchange); PP worst/mean is the slowest micro-batch slot "
        "over the mean one (1F1B bubbles scale with it); the 1F1B bubble is the modeled "
        "share of a pipelined step its slowest replica waits, with the plan's micro-batch "
        "order and with each exchange pool's balanced order (system.pp_order); planner ms is "
        "the C++ planner "
        "per step (megatron-dcp and megatron-dyncp: their Python schedulers; megatron-dcp is "
        "megatron-core's BalancedCPScheduler, megatron-dyncp Megatron-LM's DefaultDynamicCPScheduler, "
        "a CP group per document chosen per micro-batch; distca: DistCA's greedy as its "
        "planner runs it, in Python). `distca` is DistCA as deployed - every GPU an attention "
        "server, documents cut at GPU boundaries (system.distca_server: gpu); "
        "`distca-replica` is the planner's DistCA, one server per replica with its heads "
        "split evenly over its GPUs (replica: the stronger variant, the one the operator "
        "runs).",
        "",
    ]


def write_figures(results: dict, out: Path) -> list[Path]:
    # optional: matplotlib draws the figures
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, path: Path) -> Path:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    paths = []
    for name, s in results["scenarios"].items():
        dps = s["dp_values"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(dps, dps, "k--", label="ideal")
        for system, by_dp in s["dp_scaling"].items():
            ax.plot(dps, [by_dp[d] for d in dps], marker="o", label=system)
        ax.set_xlabel("data-parallel replicas")
        ax.set_ylabel("throughput relative to DP1")
        ax.set_title(f"DP scaling, {name} ({s['workload']})")
        ax.legend(fontsize=7)
        paths.append(save(fig, out / f"dp_scaling_{name}.png"))

        sweep = sorted(s["pool_sweep"].items(), key=lambda kv: int(kv[0]))
        ps = [int(p) for p, _ in sweep]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(ps, [v["imbalance_before"] for _, v in sweep], marker="o", label="imbalance before")
        ax.plot(
            ps, [v["imbalance_after"] for _, v in sweep], marker="o", label="imbalance after VRSP"
        )
        ax.plot(ps, [v["exchange_cost"] for _, v in sweep], marker="s", label="exchange cost")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.set_xlabel("pool size P")
        ax.set_ylabel("imbalance (max/mean - 1); exchange / attention time")
        ax2 = ax.twinx()  # what the recommendation minimises
        ax2.plot(ps, [v["step_time"] for _, v in sweep], "k-^", label="modeled step time")
        best = s["recommended_pool_size"]
        ax2.plot([best], [s["pool_sweep"][str(best)]["step_time"] if str(best) in s["pool_sweep"]
                          else s["pool_sweep"][best]["step_time"]], "r*", markersize=14,
                 label=f"recommended P = {best}")
        ax2.set_ylabel("modeled step time (s)")
        ax.set_title(f"Pool-size sweep, {name} (DP{s['pool_sweep_dp']})")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7)
        paths.append(save(fig, out / f"pool_sweep_{name}.png"))

        systems = list(s["rank_attention"])
        fig, axes = plt.subplots(len(systems), 1, figsize=(7, 1.3 * len(systems) + 1))
        axes = [axes] if len(systems) == 1 else axes
        for ax, system in zip(axes, systems):
            vals = s["rank_attention"][system]
            ax.bar(range(len(vals)), vals)
            ax.set_ylabel(system, fontsize=7, rotation=0, ha="right")
        axes[-1].set_xlabel("replica (cp rank 0); megatron-dcp, megatron-dyncp: GPU")
        fig.suptitle(f"Per-rank attention seconds, one step at DP{s['scaling_dp']}, {name}")
        paths.append(save(fig, out / f"rank_attention_{name}.png"))
    return paths


def write_report(results: dict, out: str | Path) -> dict:
    """Write report.md, results.json and the figures under `out`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (out / "report.md").write_text(render_markdown(results) + "\n")
    figures = write_figures(results, out)
    return {
        "report": str(out / "report.md"),
        "results": str(out / "results.json"),
        "figures": [str(p) for p in figures],
    }
