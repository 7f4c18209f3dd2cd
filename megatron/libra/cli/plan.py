"""`libra plan`: plan N steps of a workload and report balance, traffic and exactness.
Torch-free: it imports the planner and the workload only."""

from __future__ import annotations

import statistics

import numpy as np

from libra_ext import checks, costmodel, explain
from libra_ext.attention import DEFAULT_CHUNKS
from libra_ext.pipeline import order_slots
from libra_ext.planner import (
    DISTCA_SERVERS,
    ORDERS,
    SYSTEMS,
    LayoutConfig,
    Planner,
    PlannerKnobs,
    PlannerOptions,
    system_label,
)
from libra_ext.simulator.cost import simulate_plan
from libra_ext.simulator.hardware import HardwareProfile
from megatron.libra.cli.args import add_model_args, add_workload_args, model_of, positive, source_of
from megatron.libra.flags import add_fields, dashed, values


class _DocView:
    """The two arrays of a plan that `checks.documents_preserved` reads."""

    def __init__(self, doc_ids, doc_lengths):
        self.doc_ids, self.doc_lengths = doc_ids, doc_lengths


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan steps and report balance, traffic and exactness",
        description="Plan N steps of a workload and report the plan's metrics.",
    )
    p.add_argument("--system", default="libra", choices=SYSTEMS)
    add_workload_args(p)
    p.add_argument("--gbs", type=int, default=128, help="packed sequences per step (B)")
    p.add_argument("--dp", type=int, default=16, help="data-parallel replicas (D)")
    p.add_argument("--cp", type=int, default=8, help="context-parallel ranks per replica (C)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (T)")
    p.add_argument("--pool-size", type=int, default=8, help="replicas per pool (P)")
    add_model_args(p)
    knobs = p.add_argument_group("planner knobs", "the system section's keys of a `libra "
                                 "train` config (docs/config_reference.md)")
    add_fields(knobs, PlannerKnobs, dashed(), choices={"distca_server": tuple(DISTCA_SERVERS)})
    p.add_argument(
        "--order", choices=ORDERS, default="megatron",
        help="production order of each step's sequences: megatron (Megatron-LM's pretraining "
        "sampler, the default) or contiguous (replica q // m)",
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=1,
        help="sequences per micro-batch and replica in Megatron order (divides gbs / dp)",
    )
    p.add_argument(
        "--pp", type=int, default=1,
        help="pipeline stages: with pp > 1, also model each replica's 1F1B schedule and report its "
        "bubble with the plan's micro-batch order and with the balanced order (system.pp_order)",
    )
    p.add_argument(
        "--hardware", default="h200-sxm",
        help="hardware profile (name or file) of the --pp step model (default h200-sxm)",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cost-table",
        help="balance a cost table's predicted time instead of pairs (libra, distca, wlb's "
        "packing): profile "
        "(the --hardware profile's) or a JSON / YAML file (a table, or a `libra bench replay "
        "--json` result with an online_table); --explain then explains in its time",
    )
    p.add_argument(
        "--explain", action="store_true",
        help="explain the first step's plan pool by pool: the bound each pool could reach, "
        "what kept its busiest member from it, and the largest tiles moved",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_plan)


def run_plan(args) -> dict | None:
    positive(args.steps, "steps")
    source, context = source_of(args)
    layout = LayoutConfig(
        dp=args.dp, cp=args.cp, tp=args.tp, pool_size=args.pool_size, context=context
    )
    model = model_of(args)
    options = PlannerOptions(system=args.system, order=args.order,
                             micro_batch_size=args.micro_batch_size,
                             **values(args, PlannerKnobs))
    if args.gbs <= 0 or args.gbs % args.dp:
        raise ValueError(f"gbs (B={args.gbs}) must be a positive multiple of dp (D={args.dp})")
    positive(args.pp, "pp")
    planner = Planner(layout, model, options)
    table = None
    if args.cost_table:
        table = costmodel.load_table(args.cost_table, HardwareProfile.load(args.hardware),
                                     model.head_dim)
        planner.set_cost_model(table)
    run = _PlanRun(args, planner, model, table)
    for step in range(args.steps):
        run.step(step, source.step(args.gbs, context, args.seed, step))
    if args.system == "wlb":
        run.drain()
    result = run.result(source.name, context)
    if run.explained is not None:
        result["explain"] = run.explained
    if args.json:
        return result
    _print_plan_table(result)
    if run.explained is not None:
        print("\n".join(explain.render(run.explained)))
    return None


class _PlanRun:
    """The steps of `libra plan`, each plan checked as it comes and only its metrics kept (so
    memory stays flat over steps): pairs exact, samples (wlb: documents) preserved, and with
    --pp > 1 the modeled 1F1B order of its micro-batches."""

    def __init__(self, args, planner: Planner, model, table=None):
        self.args, self.planner, self.model, self.table = args, planner, model, table
        self.metrics, self.hashes, self.tiles = [], [], []
        self.inexact, self.unpreserved = [], []  # why pairs_exact / samples_preserved failed
        self.inputs_docs, self.executed = [], []  # wlb: documents over the whole run
        self.arrival: list[int] = []  # wlb: the step that brought each document (input order)
        self.wlb_backlog: list[int] = []  # wlb: documents held back after each step
        self.wlb_delay = 0  # wlb: most steps a document waited before it trained
        self.pipeline = []  # with --pp > 1: each step's PipelineOrder
        self.hardware = HardwareProfile.load(args.hardware) if args.pp > 1 else None
        self.explained = None  # --explain: the first step's explanation

    def check(self, plan, seqs=None) -> None:
        ok, why = checks.pairs_exact(plan)
        if not ok:
            self.inexact.append(why)
        if seqs is not None and self.args.system != "wlb":
            ok, why = checks.samples_preserved(seqs, plan)
            if not ok:
                self.unpreserved.append(why)
        if self.args.system == "wlb":
            self.executed.append(_DocView(plan.doc_ids.copy(), plan.doc_lengths.copy()))

    def step(self, step: int, seqs) -> None:
        plan = self.planner.plan(seqs)
        if step == 0 and getattr(self.args, "explain", False):
            self.explained = explain.explain(plan, epsilon=self.args.epsilon, table=self.table)
        self.metrics.append(plan.metrics())
        self.hashes.append(f"{plan.hash:016x}")
        self.tiles.append(plan.n_tiles)
        self.check(plan, seqs)
        if self.args.pp > 1:
            times = simulate_plan(plan, self.model, self.hardware, chunks=DEFAULT_CHUNKS)
            self.pipeline.append(order_slots(times.slot, plan.exchange_pool, self.args.pp,
                                             "balanced"))
        if self.args.system == "wlb":
            self.inputs_docs.extend(l for q in seqs for l in q)
            self.arrival.extend([step] * sum(len(q) for q in seqs))
            waited = step - np.asarray(self.arrival, dtype=np.int64)[plan.doc_ids]
            self.wlb_delay = max(self.wlb_delay, int(waited.max(initial=0)))
            self.wlb_backlog.append(self.planner.pending_documents)

    def drain(self) -> None:
        """wlb: release what the delay queue still holds, then check every document ran."""
        empty = [[] for _ in range(self.args.gbs)]
        for _ in range(10_000):
            if self.planner.pending_documents == 0:
                break
            self.check(self.planner.plan(empty, flush=True))
        ok, why = checks.documents_preserved(self.inputs_docs, self.executed)
        if not ok:
            self.unpreserved.append(why)

    def result(self, workload: str, context: int) -> dict:
        args, metrics = self.args, self.metrics

        def mean(key):
            return float(np.mean([m[key] for m in metrics]))

        def worst(key):
            return float(np.max([m[key] for m in metrics]))

        result = {
            "system": args.system,
            "distca_server": args.distca_server,
            "workload": workload,
            "steps": args.steps,
            "layout": {"gbs": args.gbs, "dp": args.dp, "cp": args.cp, "tp": args.tp,
                       "pool_size": args.pool_size, "context": context},
            "inter_pool_imbalance": mean("inter_pool_imbalance"),
            "inter_pool_imbalance_before": mean("inter_pool_imbalance_before"),
            "pool_total_imbalance": mean("pool_total_imbalance"),
            "pool_total_imbalance_before": mean("pool_total_imbalance_before"),
            "vrsp_lower_bound_ratio": worst("vrsp_lower_bound_ratio"),
            "vrsp_pool_bound_ratio": worst("vrsp_pool_bound_ratio"),
            "achievable_max_over_mean": mean("achievable_max_over_mean"),
            "max_over_mean": mean("max_over_mean"),
            "max_over_mean_worst": worst("max_over_mean"),
            "max_over_mean_before": mean("max_over_mean_before"),
            "moved_token_fraction": mean("moved_token_fraction"),
            "bytes_moved_per_rank": mean("bytes_moved_per_rank"),
            "bytes_moved_max_rank": worst("bytes_moved_max_rank"),
            "plan_ms": float(statistics.median(m["plan_ms"] for m in metrics)),
            "tiles_per_step": float(np.mean(self.tiles)),
            "pairs_exact": not self.inexact,
            "samples_preserved": not self.unpreserved,
            "hashes": self.hashes,
        }
        if self.pipeline:
            p = self.pipeline
            result["pp"] = args.pp
            result["pp_bubble_before"] = float(np.mean([o.bubble_before for o in p]))
            result["pp_bubble_after"] = float(np.mean([o.bubble_after for o in p]))
            result["pp_step_after_over_before"] = float(
                np.mean([o.step_after / o.step_before for o in p]))
            result["samples_preserved"] = result["samples_preserved"] and all(
                o.samples_preserved for o in p)
        if args.system == "wlb":
            # over the planned steps (the final flush that drains the queue is not counted)
            result["wlb_backlog_max"] = max(self.wlb_backlog)
            result["wlb_backlog_final"] = self.wlb_backlog[-1]
            result["wlb_max_delay_steps"] = self.wlb_delay
        if self.inexact or self.unpreserved:
            result["problems"] = sorted(set(self.inexact + self.unpreserved))
        return result


def _print_plan_table(r: dict) -> None:
    lay = r["layout"]
    print(
        f"libra plan: system={system_label(r['system'], r.get('distca_server', 'replica'))} "
        f"workload={r['workload']} steps={r['steps']} "
        f"S={lay['context']} B={lay['gbs']} D={lay['dp']} C={lay['cp']} T={lay['tp']} "
        f"P={lay['pool_size']}"
    )
    rows = [
        (
            "inter-pool imbalance (max/mean-1, (pool,slot) groups)",
            r["inter_pool_imbalance_before"],
            r["inter_pool_imbalance"],
        ),
        (
            "pool-total imbalance (max/mean-1)",
            r["pool_total_imbalance_before"],
            r["pool_total_imbalance"],
        ),
        ("per-rank attention max/mean", r["max_over_mean_before"], r["max_over_mean"]),
    ]
    print(f"  {'metric':58s} {'production':>11s} {'planned':>9s}")
    for name, before, after in rows:
        print(f"  {name:58s} {before:11.4f} {after:9.4f}")
    print(f"  worst-step max/mean                    {r['max_over_mean_worst']:.4f}")
    print(f"  achievable max/mean (tiles in pools)   {r['achievable_max_over_mean']:.4f}")
    print(f"  VRSP max pool / lower bound (worst)    {r['vrsp_pool_bound_ratio']:.4f}")
    print(f"  VRSP max group / lower bound (worst)   {r['vrsp_lower_bound_ratio']:.4f}")
    print(f"  moved query-token fraction             {r['moved_token_fraction']:.4f}")
    print(f"  pool bytes sent per rank (fwd+bwd)     {r['bytes_moved_per_rank'] / 2**20:.1f} MiB")
    print(f"  plan time per step (median)            {r['plan_ms']:.3f} ms")
    print(f"  pairs exact / samples preserved        {r['pairs_exact']} / {r['samples_preserved']}")
    if "pp" in r:
        print(f"  1F1B bubble, pp={r['pp']}: plan order / balanced  {r['pp_bubble_before']:.4f} / "
              f"{r['pp_bubble_after']:.4f} (step x{r['pp_step_after_over_before']:.4f})")
    if "wlb_backlog_max" in r:
        print(f"  wlb held documents max / final         {r['wlb_backlog_max']} / "
              f"{r['wlb_backlog_final']}")
        print(f"  wlb most steps a document waited       {r['wlb_max_delay_steps']}")
