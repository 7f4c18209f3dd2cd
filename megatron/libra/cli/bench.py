"""`libra bench`: the planner against its Python reference and at scale (`planner`), the sampler
thread's host work (`host`), balance over a sweep of length distributions (`balance`), the
operator against one plain kernel call (`attention`), every rank's kernel calls under a plan
(`replay`) and MoE expert balancing (`moe`, `bench_moe`). Torch is imported by the commands that
run kernels, not at module load."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from libra_ext import costmodel, sweep
from libra_ext.attention import DEFAULT_CHUNKS
from libra_ext.planner import (
    ORDERS,
    PLAN_PHASES,
    LayoutConfig,
    Planner,
    PlannerOptions,
)
from libra_ext.reference import plan_libra
from libra_ext.simulator.cost import simulate_plan
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.workload import LengthSource, ModelConfig, check_seed
from megatron.libra.cli import bench_moe
from megatron.libra.cli.args import (
    add_model_args,
    add_workload_args,
    default_dtype,
    int_list_arg,
    model_of,
    positive,
    source_of,
    systems_arg,
)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    b = bsub.add_parser(
        "planner",
        help="C++ planner against the pure-Python reference",
        description="Planning time per step, C++ core against the Python "
        "reference implementation, measured side by side.",
    )
    b.add_argument("--steps", type=int, default=10, help="C++ steps timed per case")
    b.add_argument("--python-steps", type=int, default=3, help="Python steps timed per case")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--dp",
        help="comma-separated D values: time planning at 256K with B = 8D, C = 8, P = 8 for each "
        "and report the growth exponent (instead of the C++ vs Python comparison)",
    )
    b.add_argument(
        "--threads", type=int, default=0,
        help="planner worker threads for --dp (0: automatic, one per 16K documents up to the "
        "idle cores and 8)",
    )
    b.add_argument(
        "--busy", type=int, default=0,
        help="with --dp: run this many busy-loop processes meanwhile and time automatic threads "
        "against one thread on the same steps",
    )
    b.add_argument(
        "--cost-table",
        help="with --dp: also plan every step balancing this cost table's predicted time, in "
        "the same process, interleaved step by step with pairs: 'profile' (the --hardware "
        "profile's table) or a table file (as libra plan --cost-table)",
    )
    b.add_argument("--hardware", default="h200-sxm",
                   help="hardware profile for --cost-table profile")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=run_bench_planner)
    bh = bsub.add_parser(
        "host",
        help="the sampler thread's host work per step against the modeled GPU step",
        description="At the paper's layouts (256K: GBS 128, DP 16, CP 8, P 8; 1M: GBS 32, DP 16, "
        "CP 16, P 8; Qwen3-30B-A3B) the host time the sampler's thread spends one step ahead "
        "(the step source, the plan, one rank's attention metadata for every slot, staging it) "
        "beside the step's modeled time on the GPUs (the simulator's H200 profile): the lead "
        "by which the thread runs ahead of the training loop.",
    )
    bh.add_argument("--steps", type=int, default=2, help="steps timed per layout")
    bh.add_argument("--seed", type=int, default=0)
    bh.add_argument("--gil", action="store_true",
                    help="also measure how much a thread launching small torch ops is slowed "
                    "while the heaviest rank's programs compile beside it (the GIL), and beside "
                    "a GIL-free call of the same length (the floor)")
    bh.add_argument("--gil-seconds", type=float, default=2.0)
    bh.add_argument("--json", action="store_true")
    bh.set_defaults(func=run_bench_host)
    bb = bsub.add_parser(
        "balance",
        help="every system on a sweep of length distributions against the achievable bound",
        description="Plan steps of 42 document-length distributions (lognormal, Pareto, "
        "lognormal with Pareto tails, bimodal) at the 256K and 1M layouts and pool sizes 2-16 "
        "under every system; print per-rank attention max/mean beside the lowest value "
        "reachable with tiles kept inside pools.",
    )
    bb.add_argument("--layouts", default="256k,1m", help="256k and/or 1m")
    bb.add_argument("--pools", default="2,4,8,16")
    bb.add_argument("--systems", default="libra,ulysses,distca,wlb")
    bb.add_argument("--steps", type=int, default=2, help="steps per distribution")
    bb.add_argument("--seed", type=int, default=0)
    bb.add_argument("--json", action="store_true")
    bb.set_defaults(func=run_bench_balance)
    a = bsub.add_parser(
        "attention",
        help="core-attention operator against one plain kernel call",
        description="The operator of each system (world size 1) against one plain batched "
        "varlen call over the same packed sequence, forward + backward, side by side, with "
        "kernel-call, tile and host-copy counters.",
    )
    _add_bench_attention_args(a)
    a.set_defaults(func=run_bench_attention)
    r = bsub.add_parser(
        "replay",
        help="every rank's attention work under a step plan, measured on one device",
        description="Plan steps as `libra plan` does, then run each rank's kernel calls "
        "(forward + backward, the runtime's segments and batching) one rank at a time on one "
        "device; print measured per-rank attention max/mean beside the planner's modeled one, "
        "the tiling efficiency against the same documents run untiled, and bytes per rank.",
    )
    r.add_argument(
        "--system", default="ulysses,libra,distca,wlb",
        help="comma-separated systems among ulysses, libra, libra-no-vrsp, libra-no-tap, wlb, "
        "distca (default ulysses,libra,distca,wlb)",
    )
    add_workload_args(r)
    r.add_argument("--gbs", type=int, default=16, help="packed sequences per step (B)")
    r.add_argument("--dp", type=int, default=8, help="data-parallel replicas (D)")
    r.add_argument("--cp", type=int, default=2, help="context-parallel ranks per replica (C)")
    r.add_argument("--pool-size", type=int, default=4, help="replicas per pool (P)")
    add_model_args(r)
    r.add_argument("--order", choices=ORDERS, default="megatron", help="production order")
    r.add_argument("--steps", type=int, default=1)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="cpu", choices=("cuda", "cpu"))
    r.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"),
        help="input dtype (default: bf16 on cuda, fp32 on cpu, where bf16 matmuls are slow)",
    )
    r.add_argument("--backend", default="auto", help="auto, te, flash, varlen or reference")
    r.add_argument(
        "--rounds", type=int, default=3,
        help="times each rank is measured, ranks in turn; its time is the median (default 3)",
    )
    r.add_argument(
        "--cost-model", default="pairs",
        help="comma-separated cost models the planner balances, among pairs, profile (the "
        "--hardware profile's table) and online (fitted from the replay's own measured rank "
        "times; prior: the profile's where given, else pairs) (default pairs)",
    )
    r.add_argument(
        "--repeats", type=int, default=1,
        help="times the whole replay runs, every cost model and system in turn; per step the "
        "median over repeats (default 1)",
    )
    r.add_argument("--hardware", help="hardware profile for the profile cost model (a name in "
                   "configs/hardware or a file, e.g. written by libra calibrate)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=run_bench_replay)

    bench_moe.add_parser(bsub)


def run_bench_balance(args) -> dict | None:
    layouts = [x for x in args.layouts.split(",") if x]
    for name in layouts:
        if name not in sweep.LAYOUTS:
            raise ValueError(f"layouts: unknown layout {name!r} (256k, 1m)")
    pools = int_list_arg(args.pools, "pools")
    systems = systems_arg(args.systems)
    positive(args.steps, "steps")
    check_seed(args.seed)
    rows = sweep.run(
        layouts=layouts, pools=pools, systems=systems, steps=args.steps, seed=args.seed
    )
    gaps = [r["libra"] - r["bound"] for r in rows if r.get("libra") is not None]
    out = {
        "rows": rows,
        "distributions": len({r["distribution"] for r in rows}),
        "libra_max_gap": max(gaps) if gaps else None,
    }
    if args.json:
        return out
    cols = [s for s in ("libra", "ulysses", "distca", "wlb") if s in systems]
    print("libra bench balance: per-rank attention max/mean (mean over steps); bound = lowest "
          "reachable with tiles inside pools")
    print(f"  {'distribution':28s} {'layout':6s} {'P':>3s} " + " ".join(
        f"{c:>8s}" for c in (["bound"] if "libra" in systems else []) + cols))
    for r in rows:
        vals = ([r["bound"]] if "libra" in systems else []) + [r[c] for c in cols]
        print(f"  {r['distribution']:28s} {r['layout']:6s} {r['pool']:3d} " + " ".join(
            f"{v:8.4f}" if v is not None else f"{'refused':>8s}" for v in vals))
    if gaps:
        print(f"  largest gap of libra to the bound: {max(gaps):.4f} over {len(rows)} cases")
    refused = sorted({s for r in rows for s in r.get("refused", {})})
    if refused:
        print(f"  refused (over the plan's tile budget): {', '.join(refused)} in "
              f"{sum(bool(r.get('refused')) for r in rows)} cases")
    return None


def _add_bench_attention_args(a: argparse.ArgumentParser) -> None:
    a.add_argument("--context", type=int, default=262_144, help="tokens of the packed sequence")
    a.add_argument("--workload", default="libra-256k", help="length preset")
    a.add_argument("--lengths-file", help="draw document lengths from this file")
    a.add_argument("--heads", type=int, default=32)
    a.add_argument("--kv-heads", type=int, default=4)
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--systems", default="libra,ulysses,wlb")
    a.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    a.add_argument("--backend", default="auto", help="auto, te, flash, varlen or reference")
    a.add_argument("--reps", type=int, default=3)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", help="also write the JSON result here")
    a.add_argument("--json", action="store_true")


def run_bench_replay(args) -> dict | None:
    # deferred: the CLI starts without torch
    from libra_ext.measure import replay

    systems = [x for x in args.system.split(",") if x]
    positive(args.steps, "steps")
    positive(args.rounds, "rounds")
    positive(args.repeats, "repeats")
    cost_models = [x for x in args.cost_model.split(",") if x]
    if not cost_models:
        raise ValueError("cost-model: give at least one of pairs, profile, online")
    profile = HardwareProfile.load(args.hardware) if args.hardware else None
    source, context = source_of(args)
    if args.gbs <= 0 or args.gbs % args.dp:
        raise ValueError(f"gbs (B={args.gbs}) must be a positive multiple of dp (D={args.dp})")
    layout = LayoutConfig(dp=args.dp, cp=args.cp, pool_size=args.pool_size, context=context)
    model = model_of(args)
    steps = [source.step(args.gbs, context, args.seed, s) for s in range(args.steps)]
    r = replay.run(
        steps, layout, model, systems, device=args.device, dtype=default_dtype(args),
        backend=None if args.backend == "auto" else args.backend, progress=not args.no_progress,
        order=args.order, rounds=args.rounds, cost_models=tuple(cost_models),
        repeats=args.repeats, profile=profile,
    )
    r["layout"] = {"gbs": args.gbs, "dp": args.dp, "cp": args.cp, "pool_size": args.pool_size,
                   "context": context, "workload": source.name}
    if args.json:
        return r
    print(
        f"libra bench replay: {r['device']}, {r['backend']} kernel, {r['dtype']}, "
        f"{source.name}, S={context} B={args.gbs} D={args.dp} C={args.cp} P={args.pool_size}, "
        f"{r['steps']} step(s); per-rank attention forward + backward, median of "
        f"{r['rounds']} round(s), {r['repeats']} repeat(s)"
    )
    print(f"  {'system':22s} {'measured max/mean':>18s} {'predicted':>10s} {'pred. error':>12s} "
          f"{'split error':>12s} {'modeled max/mean':>17s} {'tiling eff.':>12s} {'calls':>7s} "
          f"{'MiB sent/rank':>14s} {'round spread':>13s}")
    for name, x in r["systems"].items():
        print(f"  {name:22s} {x['measured_max_over_mean']:18.3f} "
              f"{x['predicted_max_over_mean']:10.3f} {x['prediction_error']:12.3f} "
              f"{x['split_error']:12.3f} {x['modeled_max_over_mean']:17.3f} "
              f"{x['tiling_efficiency']:12.3f} {x['kernel_calls']:7d} "
              f"{x['bytes_sent_per_rank'] / 2**20:14.1f} {x['round_spread']:13.3f}")
    nf = r["noise_floor"]
    print(f"  {'noise floor':22s} {nf['measured_max_over_mean']:18.3f}   (one {nf['system']} "
          f"rank's calls timed as each of {nf['per_step'][0]['copies']} ranks)")
    print("  predicted: the cost model's per-rank max/mean (pairs: pairs x heads); pred. error: "
          "median |predicted - measured| / measured over ranks; split error: the same with the "
          "predictions scaled to the step's measured total (what costs balance)")
    return None


def run_bench_attention(args) -> dict | None:
    # deferred: the CLI starts without torch
    from libra_ext.measure import bench

    systems = systems_arg(args.systems)
    for field in ("context", "heads", "kv_heads", "head_dim", "reps"):
        positive(getattr(args, field), field)
    if args.heads % args.kv_heads:
        raise ValueError(f"heads ({args.heads}) must be a multiple of kv_heads ({args.kv_heads})")
    r = bench.run(
        context=args.context,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        systems=systems,
        device=args.device,
        dtype=args.dtype,
        reps=args.reps,
        workload=args.workload,
        lengths_file=args.lengths_file,
        seed=args.seed,
        backend=None if args.backend == "auto" else args.backend,
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=1))
    if args.json:
        return r
    print(
        f"libra bench attention: {r['device']}, {r['backend']} kernel, {r['dtype']}, "
        f"{r['context']} tokens in {r['documents']} documents (longest {r['longest_document']})"
    )
    print(f"  plain varlen call: {r['plain_ms']:.2f} ms (forward + backward)")
    print(f"  {'system':8s} {'ms':>10s} {'ratio':>7s} {'tiles':>6s} {'calls f/b':>9s} host copies")
    for name, s in r["systems"].items():
        print(
            f"  {name:8s} {s['operator_ms']:10.2f} {s['ratio']:7.3f} {s['tiles']:6d} "
            f"{s['kernel_calls_fwd']:>4d}/{s['kernel_calls_bwd']:<4d} {s['host_copies']}"
        )
    return None


def bench_attention_main(argv) -> int:
    """Entry point of tools/gpu_bench_attention.py (the same options as the subcommand)."""
    p = argparse.ArgumentParser(prog="gpu_bench_attention", description=__doc__)
    _add_bench_attention_args(p)
    args = p.parse_args(argv)
    r = run_bench_attention(args)
    if r is not None:
        print(json.dumps(r))
    return 0


BENCH_CASES = {
    # name: (preset, context, gbs, dp, cp, pool)
    "256k": ("libra-256k", 262_144, 128, 16, 8, 8),
    "1m": ("libra-1m", 1_048_576, 32, 16, 16, 8),
}


def _spin(stop) -> None:
    while not stop.is_set():
        pass


class BusyLoops:
    """`n` busy-loop processes for the duration of a `with` block: a host whose cores other work
    holds, as a training host's are."""

    def __init__(self, n: int):
        self.n, self._ctx = n, mp.get_context("spawn")
        self._stop, self._procs = self._ctx.Event(), []

    def __enter__(self):
        for _ in range(self.n):
            proc = self._ctx.Process(target=_spin, args=(self._stop,), daemon=True)
            proc.start()
            self._procs.append(proc)
        if self.n:
            time.sleep(0.3)  # let them reach their loops
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()


def _time_source(preset: str, gbs: int, context: int, seed: int, steps: int):
    """The steps of a source and its time per step, amortized over whole shuffle windows (a
    window's first step makes all of its steps). One window is made untimed first, as the plan
    is timed after an untimed pass: the timed windows see the process as a training run does
    after its first steps (the source's buffers and the allocator grown). Each timed step is
    dropped once made, as a training run drops a step once it has run; the steps returned are
    made again afterwards (the same steps: a source is a function of (seed, step))."""
    source = LengthSource(preset=preset)
    window = source.shuffle_window
    n = -(-steps // window) * window
    source.step(gbs, context, seed, 0)
    t0 = time.perf_counter()
    for s in range(window, window + n):
        source.step(gbs, context, seed, s)
    ms = (time.perf_counter() - t0) * 1e3 / n
    return [source.step(gbs, context, seed, s) for s in range(window, window + steps)], ms


def run_bench_scaling(args) -> dict | None:
    """Host time per step at 256K (B = 8D, C = 8, P = 8) for each D: the step source (amortized
    over its shuffle windows), the call's conversion (wall time of `Planner.plan` less the
    plan's own time; a PackedBatch goes in flat, lists for comparison) and the plan (median over
    `steps` steps, timed in a second pass after an untimed first one); with `busy` busy-loop
    processes running, automatic threads against one thread, interleaved step by step."""
    dps = int_list_arg(args.dp, "dp")
    busy = positive(args.busy, "busy", 0)
    model = ModelConfig()
    table = None
    if args.cost_table:
        table = costmodel.load_table(args.cost_table, HardwareProfile.load(args.hardware),
                                     model.head_dim)
    rows = []
    with BusyLoops(busy):
        for dp in dps:
            if dp % 8:
                raise ValueError(f"dp values must be multiples of the pool size 8, got {dp}")
            layout = LayoutConfig(dp=dp, cp=8, pool_size=8, context=262_144)
            planner = Planner(layout, model, PlannerOptions(system="libra", threads=args.threads))
            one = Planner(layout, model, PlannerOptions(system="libra", threads=1))
            priced = None
            if table is not None:
                priced = Planner(layout, model, PlannerOptions(system="libra",
                                                               threads=args.threads))
                priced.set_cost_model(table)
            steps, source_ms = _time_source("libra-256k", 8 * dp, 262_144, args.seed, args.steps)
            ms, ms_one, tiles, balance, phases, convert, convert_lists = [], [], [], [], [], [], []
            ms_table, phases_table = [], []
            # warm-up: one pass over the steps untimed, so the timed pass sees the process as a
            # training run does after its first steps (the allocator grown to plan-sized buffers)
            plan = None
            for seqs in steps:
                plan = planner.plan(seqs)
                if busy:
                    one.plan(seqs)
                if priced is not None:
                    priced.plan(seqs)
            for seqs in steps:
                # the previous step's plan stays alive while the next is planned, as in training
                t0 = time.perf_counter()
                plan = planner.plan(seqs)
                convert.append((time.perf_counter() - t0) * 1e3 - plan.plan_ms)
                ms.append(plan.plan_ms)
                tiles.append(plan.n_tiles)
                balance.append(plan.max_over_mean)
                phases.append(plan.phase_ms)
                if busy:  # the same step on one thread, right after
                    ms_one.append(one.plan(seqs).plan_ms)
                if priced is not None:  # the same step balancing the table, right after
                    timed = priced.plan(seqs)
                    ms_table.append(timed.plan_ms)
                    phases_table.append(timed.phase_ms)
                    del timed
            as_lists = steps[0].tolist()
            t0 = time.perf_counter()
            listed = planner.plan(as_lists)
            convert_lists.append((time.perf_counter() - t0) * 1e3 - listed.plan_ms)
            del plan, listed
            row = {
                "dp": dp,
                "gbs": 8 * dp,
                "documents": int(np.mean([st.n_documents for st in steps])),
                "tiles": float(np.mean(tiles)),
                "ms": statistics.median(ms),
                "phase_ms": {k: statistics.median(p[k] for p in phases) for k in PLAN_PHASES},
                "max_over_mean": float(np.mean(balance)),
                "source_ms": source_ms,
                "convert_ms": statistics.median(convert),
                "convert_lists_ms": convert_lists[0],
            }
            if busy:
                row["ms_one_thread"] = statistics.median(ms_one)
                row["auto_over_one_thread"] = row["ms"] / row["ms_one_thread"]
            if priced is not None:
                row["ms_table"] = statistics.median(ms_table)
                row["table_over_pairs"] = row["ms_table"] / row["ms"]
                row["phase_ms_table"] = {k: statistics.median(p[k] for p in phases_table)
                                         for k in PLAN_PHASES}
            rows.append(row)
    exponent = None
    if len(rows) > 1:
        x = np.log([r["dp"] for r in rows])
        y = np.log([r["ms"] for r in rows])
        exponent = float(np.polyfit(x, y, 1)[0])
    out = {"rows": rows, "growth_exponent": exponent, "busy": busy,
           "threads": args.threads or "auto", "cost_table": args.cost_table}
    if args.json:
        return out
    print("libra bench planner: host time per step, 256K, B = 8D, C = 8, P = 8, "
          f"{args.threads or 'auto'} threads" + (f", {busy} busy-loop processes" if busy else "")
          + (f", and balancing cost table {args.cost_table} (table, its ratio to pairs)"
             if table is not None else "")
          + ": step source (amortized), conversion into the call (flat / lists), plan (median); "
          "then the median ms of each phase")
    head = "".join(f" {k:>9s}" for k in PLAN_PHASES)
    cols = (f"{'D':>5s} {'B':>6s} {'documents':>10s} {'tiles':>8s} {'source':>8s} "
            f"{'convert':>8s} {'lists':>7s} {'plan':>8s}")
    if busy:
        cols += f" {'1 thread':>9s} {'ratio':>6s}"
    if table is not None:
        cols += f" {'table':>8s} {'ratio':>6s}"
    print(f"  {cols} {'max/mean':>9s} |{head}")
    for r in rows:
        cells = "".join(f" {r['phase_ms'][k]:9.2f}" for k in PLAN_PHASES)
        line = (f"  {r['dp']:5d} {r['gbs']:6d} {r['documents']:10d} {r['tiles']:8.0f} "
                f"{r['source_ms']:8.2f} {r['convert_ms']:8.3f} {r['convert_lists_ms']:7.2f} "
                f"{r['ms']:8.2f}")
        if busy:
            line += f" {r['ms_one_thread']:9.2f} {r['auto_over_one_thread']:6.2f}"
        if table is not None:
            line += f" {r['ms_table']:8.2f} {r['table_over_pairs']:6.3f}"
        print(f"{line} {r['max_over_mean']:9.4f} |{cells}")
        if table is not None:
            cells = "".join(f" {r['phase_ms_table'][k]:9.2f}" for k in PLAN_PHASES)
            print(f"  {'':{len(line) - 2}s} {'(table)':>9s} |{cells}")
    if exponent is not None:
        print(f"  growth: plan time ~ D^{exponent:.2f}")
    return None


def _slot_programs(plan, replica: int) -> tuple[list, list, int, float]:
    """Replica `replica`'s (cp rank 0's) programs compiled and staged slot by slot, as the
    sampler's thread makes them (`staged_only`): (the host ms of each slot, compile and
    staging, the staged programs, their bytes, the ms their upload then spends unpacking them
    on the training thread, all slots: the median of five passes)."""
    # deferred: the CLI starts without torch
    from libra_ext.attention import meta

    ms, staged = [], []
    for slot in range(plan.slots):
        t0 = time.perf_counter()
        prog = meta.compile_slots(plan, replica, [slot], DEFAULT_CHUNKS, staged_only=True)[0]
        staged.append(meta.stage(prog, owned=True))
        ms.append((time.perf_counter() - t0) * 1e3)
    unpacks = []
    for _ in range(5):  # the median of five (one pass is a few hundred microseconds)
        t0 = time.perf_counter()
        for x in staged:
            if isinstance(x.prog, meta.NativeProgram):
                x.prog.unpack(arrays=False)
        unpacks.append((time.perf_counter() - t0) * 1e3)
    unpack = statistics.median(unpacks)
    return ms, staged, sum(x.host.numel() * x.host.element_size() for x in staged), unpack


def _rank_programs(plan, replica: int, reference: bool = False) -> list:
    """What the sampler's thread does for a rank each step: every slot's program compiled (by
    the C++ core, or by the numpy reference compiler) and staged."""
    # deferred: the CLI starts without torch
    from libra_ext.attention import meta

    if reference:
        progs = [meta.compile_slot_reference(plan, replica, s, DEFAULT_CHUNKS)
                 for s in range(plan.slots)]
    else:
        progs = meta.compile_rank(plan, replica, 0, DEFAULT_CHUNKS, staged_only=True)
    return [meta.stage(p, owned=True) for p in progs]


def _launch_loop(stop, lat: list) -> None:
    """A thread that launches work the way a training loop does: small torch ops, each
    releasing and retaking the GIL; every iteration's latency recorded."""
    # deferred: the CLI starts without torch
    import torch

    x = torch.zeros(64)
    while not stop.is_set():
        t0 = time.perf_counter()
        for _ in range(20):
            torch.add(x, 1.0, out=x)
        lat.append(time.perf_counter() - t0)


def gil_blocking(work, seconds: float = 1.0) -> dict:
    """How much a launching thread (`_launch_loop`) is slowed while `work()` runs over and over
    in another thread of the same process, as the sampler's compile runs beside the training
    loop: `blocked_fraction` = 1 - its iterations per second with the work / alone (while the
    work runs back to back: the worst case), its longest pause with the work (ms), and
    `lost_ms_per_call`: the launching thread's time lost per `work()` call (the blocked
    fraction times the wall time of one call) - per step, where `work` is one step's compile."""
    def run(with_work: bool):
        stop, lat = threading.Event(), []
        t = threading.Thread(target=_launch_loop, args=(stop, lat))
        t.start()
        calls = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if with_work:
                work()
                calls += 1
            else:
                time.sleep(0.01)
        wall = time.perf_counter() - t0
        stop.set()
        t.join()
        return len(lat) / wall, max(lat, default=0.0), wall / max(calls, 1)

    alone, _, _ = run(False)
    busy, pause, per_call = run(True)
    blocked = max(0.0, 1.0 - busy / alone)
    return {"blocked_fraction": blocked, "max_pause_ms": pause * 1e3,
            "call_ms": per_call * 1e3, "lost_ms_per_call": blocked * per_call * 1e3}


def _gil_free_call(ms: float):
    """A call that holds the GIL only to enter and leave (numpy's sort of float64, which
    releases it for its loop), sized to take about `ms`: what any GIL-releasing call of that
    length costs a launching thread beside it - the floor `gil_blocking` measures for a compile
    that held the GIL for nothing but its entry and exit."""
    n = 1 << 12
    x = np.random.default_rng(0).random(n)
    while True:  # doubled until one sort takes `ms` or more (the median of five)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            np.sort(x)
            times.append((time.perf_counter() - t0) * 1e3)
        took = statistics.median(times)
        if took >= ms or n >= 1 << 26:
            break
        n *= 2
        x = np.random.default_rng(0).random(n)
    # then scaled to the length (a sort's time is about linear at these sizes)
    x = np.random.default_rng(0).random(max(1 << 12, int(n * min(1.0, ms / max(took, 1e-6)))))
    return lambda: np.sort(x)


def run_bench_host(args) -> dict | None:
    """See the `bench host` parser."""
    positive(args.steps, "steps")
    check_seed(args.seed)
    model, hw = ModelConfig(), HardwareProfile.load("h200-sxm")
    out = {"model": "qwen3-30b-a3b", "hardware": "h200-sxm", "layouts": {}}
    for name, (preset, context, gbs, dp, cp, pool) in BENCH_CASES.items():
        steps, source_ms = _time_source(preset, gbs, context, args.seed, args.steps)
        planner = Planner(LayoutConfig(dp=dp, cp=cp, pool_size=pool, context=context), model,
                          PlannerOptions(system="libra"))
        rows, slot_ms, upload = [], [], []
        for seqs in steps:
            plan = planner.plan(seqs)
            per_rank = [_slot_programs(plan, r) for r in range(plan.dp)]
            slot_ms += [x for ms, _, _, _ in per_rank for x in ms]
            upload += [n for _, _, n, _ in per_rank]
            rows.append({
                "plan_ms": plan.plan_ms,
                "rank_host_ms": max(sum(ms) for ms, _, _, _ in per_rank),
                "unpack_ms": max(u for _, _, _, u in per_rank),
                "gpu_step_ms": simulate_plan(plan, model, hw).step * 1e3,
            })
        r = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        r["source_ms"] = source_ms
        r["slots"] = int(plan.slots)
        r["host_compile_ms"] = {"median": statistics.median(slot_ms), "max": max(slot_ms)}
        r["upload_bytes"] = {"median": statistics.median(upload), "max": max(upload)}
        r["host_ms"] = r["source_ms"] + r["plan_ms"] + r["rank_host_ms"]
        r["lead_ms"] = r["gpu_step_ms"] - r["host_ms"]
        r["host_over_step"] = r["host_ms"] / r["gpu_step_ms"]
        if args.gil:  # the C++ compiler and, side by side, the numpy reference compiler
            heavy = max(range(plan.dp), key=lambda i: sum(per_rank[i][0]))
            r["gil"] = gil_blocking(lambda: _rank_programs(plan, heavy), args.gil_seconds)
            r["gil_free"] = gil_blocking(_gil_free_call(r["gil"]["call_ms"]), args.gil_seconds)
            r["gil_reference"] = gil_blocking(lambda: _rank_programs(plan, heavy, True),
                                              args.gil_seconds)
        out["layouts"][name] = r
    if args.json:
        return out
    print("libra bench host: the sampler thread's host work per step (the heaviest rank: its "
          "programs compiled and staged slot by slot) against the modeled GPU step (H200), "
          "Qwen3-30B-A3B; medians over the timed steps")
    print(f"  {'layout':7s} {'source':>8s} {'plan':>8s} {'programs':>9s} {'host':>9s} "
          f"{'GPU step':>10s} {'lead':>10s} {'ms/slot med/max':>16s} {'KiB/rank max':>13s}")
    for name, r in out["layouts"].items():
        c, u = r["host_compile_ms"], r["upload_bytes"]
        print(f"  {name:7s} {r['source_ms']:8.1f} {r['plan_ms']:8.1f} {r['rank_host_ms']:9.1f} "
              f"{r['host_ms']:9.1f} {r['gpu_step_ms']:10.1f} {r['lead_ms']:10.1f} "
              f"{c['median']:7.2f}/{c['max']:<8.2f} {u['max'] / 1024:13.1f}")
        print(f"          the training thread's upload unpacks a rank's programs in "
              f"{r['unpack_ms']:.3f} ms per step (the heaviest rank)")
        for key, what in (("gil", "the compile (C++)"), ("gil_free", "a GIL-free call"),
                          ("gil_reference", "numpy reference")):
            if key in r:
                g = r[key]
                print(f"          a launching thread beside {what:17s}: one step's compile "
                      f"{g['call_ms']:6.2f} ms, {g['lost_ms_per_call']:6.3f} ms lost per step "
                      f"({100 * g['blocked_fraction']:.1f}% slower while it runs back to back, "
                      f"longest pause {g['max_pause_ms']:.1f} ms)")
    return None


def run_bench_planner(args) -> dict | None:
    positive(args.steps, "steps")
    if args.dp:
        check_seed(args.seed)
        return run_bench_scaling(args)
    positive(args.python_steps, "python_steps")
    model = ModelConfig()
    out = {"model": "qwen3-30b-a3b", "cases": {}}
    for name, (preset, context, gbs, dp, cp, pool) in BENCH_CASES.items():
        source = LengthSource(preset=preset)
        layout = LayoutConfig(dp=dp, cp=cp, pool_size=pool, context=context)
        planner = Planner(layout, model, PlannerOptions(system="libra"))
        steps = [source.step(gbs, context, args.seed, s) for s in range(args.steps)]
        cpp_ms, wall_ms, kept, tiles = [], [], [], []
        for i, seqs in enumerate(steps):
            t0 = time.perf_counter()
            plan = planner.plan(seqs)
            wall_ms.append((time.perf_counter() - t0) * 1e3)
            cpp_ms.append(plan.plan_ms)
            tiles.append(plan.n_tiles)
            if i < args.python_steps:  # keep only what the reference is compared with
                kept.append(plan)
            del plan
        py_ms, identical = [], True
        for seqs, plan in zip(steps, kept):
            t0 = time.perf_counter()
            ref = plan_libra(seqs, layout, model, PlannerOptions(system="libra"))
            py_ms.append((time.perf_counter() - t0) * 1e3)
            identical &= ref.seq_replica == plan.seq_replica.tolist()
            identical &= ref.seq_slot == plan.seq_slot.tolist()
            identical &= [t[10] for t in ref.tiles] == plan.tile_executor.tolist()
        cpp, py = statistics.median(cpp_ms), statistics.median(py_ms)
        out["cases"][name] = {
            "workload": preset,
            "context": context,
            "gbs": gbs,
            "dp": dp,
            "cp": cp,
            "pool": pool,
            "tiles_per_step": float(np.mean(tiles)),
            "cpp_ms": cpp,
            "cpp_call_ms": statistics.median(wall_ms),
            "python_ms": py,
            "speedup": py / cpp if cpp > 0 else float("inf"),
            "identical": bool(identical),
            "cpp_steps": args.steps,
            "python_steps": len(py_ms),
        }
    if args.json:
        return out
    print("libra bench planner: planning time per step (median), C++ core vs Python reference")
    print(
        f"  {'case':6s} {'tiles':>7s} {'C++ ms':>8s} {'call ms':>8s} {'Python ms':>10s} "
        f"{'ratio':>7s} identical"
    )
    for name, c in out["cases"].items():
        print(
            f"  {name:6s} {c['tiles_per_step']:7.0f} {c['cpp_ms']:8.3f} {c['cpp_call_ms']:8.3f} "
            f"{c['python_ms']:10.1f} {c['speedup']:6.0f}x {c['identical']}"
        )
    return None
