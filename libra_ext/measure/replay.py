"""`libra bench replay`: the attention work of every rank under a step plan, measured on one
device with the kernel the runtime would use there.

For each rank of the layout, the calls its compiled programs make (every slot, local tiles and
tiles received from the pool; WLB-LLM: its two chunks of each document against the gathered
KV) run forward and backward with the same segments and the same batching as in training, one
rank at a time, timed with device events (wall time on CPU). Every rank is timed in each of
`rounds` rounds, the ranks taken in turn within a round, and its time is the median of its rounds,
so that a burst of load on a shared machine lands on one round of every rank rather than on all
of one rank's calls. The cp ranks of a replica execute
the same tiles on their own head slices (not WLB-LLM, whose chunks differ per cp rank), so one
of them stands for all. Beside the measured per-rank max/mean: the planner's modeled one, the
total over all ranks against the same documents run untiled (one call per packed sequence, as a
plain THD attention layer runs them), and the planner's byte counts.

Memory: one call's inputs, gradients and output are alive at a time (allocated per call, so a
rank's peak is its largest call), and a rank whose largest call does not fit the device's free
memory is refused before anything runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from libra_ext import costmodel
from libra_ext.attention import meta
from libra_ext.attention.counters import cpu_clock, timed_as_a_rank
from libra_ext.attention.kernels import backend_for, segments_on
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions, StepPlan
from libra_ext.workload import ModelConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# name -> planner options of each replayable system (ablations of libra included)
SYSTEM_OPTIONS = {
    "ulysses": dict(system="ulysses"),
    "libra": dict(system="libra"),
    "libra-no-vrsp": dict(system="libra", vrsp=False),
    "libra-no-tap": dict(system="libra", tap=False),
    "wlb": dict(system="wlb"),
    "distca": dict(system="distca"),
}


@dataclass
class Call:
    """One kernel call of a rank: heads, rows and host segment offsets."""

    hc: int
    hk: int
    cu_q: np.ndarray
    cu_k: np.ndarray

    @property
    def n_q(self) -> int:
        return int(self.cu_q[-1])

    @property
    def n_k(self) -> int:
        return int(self.cu_k[-1])

    def bytes(self, head_dim: int, elem: int) -> int:
        """Device bytes alive while it runs: q, k, v, their gradients, the output and its
        gradient (the kernel's own workspace is not counted)."""
        return 2 * (2 * self.n_q * self.hc + 2 * self.n_k * self.hk) * head_dim * elem


def rank_calls(plan: StepPlan, replica: int, cp_rank: int, model: ModelConfig) -> list[Call]:
    """Every kernel call rank (replica, cp_rank) makes for the plan's step, all slots. (WLB-LLM's
    call runs all heads of the tensor-parallel rank: its program leaves them to the layer.)"""
    out = []
    for prog in meta.compile_rank(plan, replica, cp_rank, chunks=1):
        for c in prog.calls:
            hc, hk = c.hc, c.hk
            if plan.system == "wlb":
                hc, hk = model.heads // plan.tp, max(1, model.kv_heads // plan.tp)
            out.append(Call(hc, hk, np.asarray(c.cu_q), np.asarray(c.cu_k)))
    return out


def untiled_calls(plan: StepPlan) -> list[Call]:
    """One call per executed sequence over its documents in natural order, one rank's head
    slice (what a plain THD attention layer does)."""
    out = []
    for r in range(plan.dp):
        for slot in range(plan.slots):
            L = meta.sequence_lengths(plan, r, slot)
            if len(L):
                cu = np.r_[0, np.cumsum(L)]
                out.append(Call(plan.heads_local, plan.kv_heads_local, cu, cu))
    return out


class Timer:
    """Forward + backward of calls on one device, fresh random inputs per call."""

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int, backend=None):
        self.device, self.dtype, self.d = device, dtype, head_dim
        self.scale = head_dim**-0.5
        probe = torch.zeros(1, 1, head_dim, device=device, dtype=dtype)
        self.kernel = backend_for(probe, backend)
        self.gen = torch.Generator(device=device).manual_seed(0)

    def _inputs(self, call: Call) -> tuple:
        def rand(n, h):
            return torch.randn(
                n, h, self.d, device=self.device, dtype=self.dtype, generator=self.gen
            )

        q, k, v = rand(call.n_q, call.hc), rand(call.n_k, call.hk), rand(call.n_k, call.hk)
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        return q, k, v, rand(call.n_q, call.hc), segments_on(call.cu_q, call.cu_k, self.device)

    def _attend(self, q, k, v, grad, seg) -> None:
        out = self.kernel.attend(q, k, v, seg, self.scale)
        torch.autograd.grad(out, (q, k, v), grad)

    def ms(self, calls: list[Call]) -> float:
        """Milliseconds of the calls' forward + backward, summed (drawing the random inputs
        and building the segments stay outside the timed intervals)."""
        total = 0.0
        cuda = self.device.type == "cuda"
        for call in calls:
            args = self._inputs(call)
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                self._attend(*args)
                end.record()
                end.synchronize()
                total += start.elapsed_time(end)
            else:  # the rank's own work, as training times it (counters.cpu_clock)
                clock = cpu_clock()
                t0 = clock()
                self._attend(*args)
                total += (clock() - t0) * 1e3
            del args
        return total


def check_memory(name: str, calls_of: dict, head_dim: int, elem: int, device: torch.device) -> None:
    """Refuse, before anything runs, a rank whose largest call does not fit the free memory."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    for rank, calls in calls_of.items():
        need = max((c.bytes(head_dim, elem) for c in calls), default=0)
        if need > free:
            raise ValueError(
                f"replay {name}: rank {rank} needs {need / 2**30:.2f} GiB for its largest call, "
                f"the device has {free / 2**30:.2f} GiB free"
            )


def _replayed_ranks(plan: StepPlan) -> tuple[list, np.ndarray]:
    """The ranks a replay times, (replica, cp rank), and their modeled loads: every cp rank of a
    replica runs what cp rank 0 runs (on its own heads), so one stands for all - except under
    wlb, whose chunks differ per cp rank."""
    if plan.system == "wlb":
        ranks = [(r, c) for r in range(plan.dp) for c in range(plan.cp)]
        return ranks, np.asarray(plan.rank_load, dtype=np.float64).ravel()
    return [(r, 0) for r in range(plan.dp)], np.asarray(plan.rank_load[:, 0], dtype=np.float64)


def _max_over_mean(x) -> float:
    x = np.asarray(x)
    return float(x.max() / x.mean()) if x.mean() > 0 else 1.0


def _round_spread(times: np.ndarray, ms: np.ndarray) -> float:
    """How far the rounds of a rank spread: the largest (max - min) / median over the ranks."""
    return float(np.max((times.max(0) - times.min(0)) / np.maximum(ms, 1e-12)))


def replay_plan(
    plan: StepPlan, name: str, model: ModelConfig, timer: Timer, progress: bool = False,
    rounds: int = 1,
) -> dict:
    """Measured and modeled per-rank attention of one plan: each rank's time is the median of
    `rounds` rounds (ranks in turn within a round); so is the untiled total."""
    if rounds <= 0:
        raise ValueError(f"rounds must be positive, got {rounds}")
    wlb = plan.system == "wlb"
    ranks, modeled = _replayed_ranks(plan)
    calls_of = {rank: rank_calls(plan, *rank, model) for rank in ranks}
    untiled = untiled_calls(plan)
    elem = torch.tensor([], dtype=timer.dtype).element_size()
    check_memory(name, calls_of, timer.d, elem, timer.device)
    bar = None
    if progress:

        bar = tqdm(total=rounds * (len(ranks) + 1), desc=f"replay {name}", unit="rank",
                   file=sys.stderr, leave=False)
    times = np.zeros((rounds, len(ranks)))
    untiled_ms = np.zeros(rounds)
    for rnd in range(rounds):
        for i, rank in enumerate(ranks):
            times[rnd, i] = timer.ms(calls_of[rank])
            if bar is not None:
                bar.update(1)
        untiled_ms[rnd] = timer.ms(untiled)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    rank_ms = np.median(times, axis=0)
    # every cp rank of a replica runs what cp rank 0 runs (on its own heads), except wlb
    tiled_total = float(rank_ms.sum() * (1 if wlb else plan.cp))
    untiled_total = float(np.median(untiled_ms)) * plan.cp

    return {
        "rank_ms": rank_ms.tolist(),
        "rounds": rounds,
        "round_spread": _round_spread(times, rank_ms),
        "measured_max_over_mean": _max_over_mean(rank_ms),
        "modeled_max_over_mean": _max_over_mean(modeled),
        "tiled_total_ms": tiled_total,
        "untiled_total_ms": untiled_total,
        "tiling_efficiency": untiled_total / tiled_total if tiled_total > 0 else 1.0,
        "kernel_calls": int(sum(len(c) for c in calls_of.values())),
        # each rank's cost-model features (costmodel.call_features), beside its rank_ms
        "features": [costmodel.call_features(calls_of[rank]).tolist() for rank in ranks],
        "bytes_sent_per_rank": float(plan.rank_bytes_sent.mean()),
        "bytes_sent_max_rank": float(plan.rank_bytes_sent.max()),
    }


def noise_floor(plan: StepPlan, model: ModelConfig, timer: Timer, rounds: int = 1) -> dict:
    """What the replay measures for a perfectly balanced step: the calls of one rank (the one
    with the median modeled load) timed once per rank of the layout, in `rounds` rounds taken
    the way `replay_plan` takes its ranks, each copy's time the median of its rounds. Its
    max/mean is the floor the measuring host puts under any system's measured max/mean."""
    if rounds <= 0:
        raise ValueError(f"rounds must be positive, got {rounds}")
    ranks, load = _replayed_ranks(plan)
    rank = ranks[int(np.argsort(load, kind="stable")[len(load) // 2])]
    calls = rank_calls(plan, *rank, model)
    times = np.array([[timer.ms(calls) for _ in ranks] for _ in range(rounds)])
    ms = np.median(times, axis=0)
    return {
        "rank": list(rank),
        "copies": len(ranks),
        "measured_max_over_mean": _max_over_mean(ms),
        "round_spread": _round_spread(times, ms),
    }


def run(
    steps_data: list,
    layout: LayoutConfig,
    model: ModelConfig,
    systems: list[str],
    device: str = "cpu",
    dtype: str = "bf16",
    backend: str | None = None,
    progress: bool = False,
    order: str = "megatron",
    rounds: int = 3,
    cost_models: tuple = ("pairs",),
    repeats: int = 1,
    profile=None,
) -> dict:
    """Replay every step under every system and cost model (`costmodel.COST_MODELS`; `profile`:
    the hardware profile the `profile` model's table comes from, and the `online` fit's prior),
    `repeats` times interleaved (each repeat runs every cost model and system in turn); per
    entry (the system's name under pairs, `system+model` otherwise) per-step figures and their
    mean over steps of the median over repeats."""
    for i, m in enumerate(cost_models):
        if m not in costmodel.COST_MODELS:
            raise ValueError(f"cost_models[{i}] = {m!r} is not one of "
                             f"{', '.join(costmodel.COST_MODELS)}")
    if "profile" in cost_models and profile is None:
        raise ValueError("cost model 'profile' needs a hardware profile (libra calibrate's)")
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for i, s in enumerate(systems):
        if s not in SYSTEM_OPTIONS:
            raise ValueError(
                f"systems[{i}] = {s!r} is not one of {', '.join(SYSTEM_OPTIONS)}"
            )
    if rounds <= 0:
        raise ValueError(f"rounds must be positive, got {rounds}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but no GPU is available")
    # One thread per rank on the CPU: with intra-op threads over small pieces, the time of a
    # rank follows the other cores' load more than its own work (medians move by 20-40% between
    # rounds on a shared 2-core machine; one thread, a few percent).
    with timed_as_a_rank(dev, 1):
        return _run(steps_data, layout, model, systems, dev, dtype, backend, progress, order,
                    rounds, tuple(cost_models), repeats, profile)


def _entry_name(system: str, cost_model: str) -> str:
    return system if cost_model == "pairs" else f"{system}+{cost_model}"


def _predicted(step: dict, table) -> np.ndarray:
    """Each rank's predicted seconds: the table's, or under pairs the ranks' pairs x heads
    scaled to their measured times (one least-squares factor)."""
    f = np.asarray(step["features"])
    y = np.asarray(step["rank_ms"]) / 1e3
    if table is not None:
        return table.predict(f)
    pairs = f[:, : costmodel.BINS].sum(axis=1)
    c = float(pairs @ y) / max(float(pairs @ pairs), 1e-300)
    return c * pairs


def _run(steps_data, layout, model, systems, dev, dtype, backend, progress, order, rounds,
         cost_models=("pairs",), repeats=1, profile=None):
    timer = Timer(dev, DTYPES[dtype], model.head_dim, backend)
    timer.ms(untiled_calls(  # warm-up: the kernel's first call (allocator, dispatch) untimed
        Planner(layout, model, PlannerOptions(system="ulysses")).plan(steps_data[0])
    )[:1])
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "backend": timer.kernel.name,
        "dtype": dtype,
        "steps": len(steps_data),
        "rounds": rounds,
        "repeats": repeats,
        "cost_models": list(cost_models),
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "systems": {},
    }
    prior = (costmodel.CostTable.from_profile(profile, model.head_dim)
             if profile is not None else None)
    # one fit for the whole run: every replayed rank adds its (features, seconds) row, so the
    # online table at a step has learned from every replay before it (pairs' first)
    fit = costmodel.OnlineFit(prior=prior)
    runs: dict = {}
    for _ in range(repeats):
        for cm in cost_models:
            for name in systems:
                planner = Planner(layout, model,
                                  PlannerOptions(**SYSTEM_OPTIONS[name], order=order))
                out = []
                for seqs in steps_data:
                    table = fit.fit() if cm == "online" else (prior if cm == "profile" else None)
                    planner.set_cost_model(table)
                    step = replay_plan(planner.plan(seqs), name, model, timer, progress, rounds)
                    pred = _predicted(step, table)
                    meas = np.asarray(step["rank_ms"]) / 1e3
                    step["predicted_max_over_mean"] = float(pred.max() / max(pred.mean(), 1e-300))
                    step["prediction_error"] = costmodel.error_of(pred, meas)
                    step["split_error"] = costmodel.split_error_of(pred, meas)
                    step["predicted_s"] = pred.tolist()
                    fit.add(step["features"], meas)
                    out.append(step)
                runs.setdefault(_entry_name(name, cm), []).append(out)
    # the host's floor: one rank's calls timed as every rank, per step (the first system's
    # plan under pairs), measured after the replays so that it sees the same host
    floor_planner = Planner(layout, model, PlannerOptions(**SYSTEM_OPTIONS[systems[0]],
                                                          order=order))
    floors = [noise_floor(floor_planner.plan(seqs), model, timer, rounds) for seqs in steps_data]
    result["noise_floor"] = {
        "system": systems[0],
        "measured_max_over_mean": float(np.mean([f["measured_max_over_mean"] for f in floors])),
        "measured_max_over_mean_worst": max(f["measured_max_over_mean"] for f in floors),
        "per_step": floors,
    }
    result["online_fits"] = fit.fits
    result["online_dropped_rows"] = fit.dropped
    if fit.table is not None:
        result["online_table"] = fit.table.to_dict()
    for key, reps in runs.items():
        # per step: the median over repeats of each figure; then the mean over steps
        per_step = reps[0] if len(reps) == 1 else [
            {k: (float(np.median([r[i][k] for r in reps]))
                 if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
             for k, v in reps[0][i].items()}
            for i in range(len(steps_data))
        ]
        keys = ("measured_max_over_mean", "modeled_max_over_mean", "predicted_max_over_mean",
                "prediction_error", "split_error", "tiling_efficiency", "bytes_sent_per_rank",
                "bytes_sent_max_rank", "round_spread")
        out = {k: float(np.mean([s[k] for s in per_step])) for k in keys}
        out["measured_max_over_mean_worst"] = max(s["measured_max_over_mean"] for s in per_step)
        out["measured_max_over_mean_repeats"] = [
            float(np.mean([s["measured_max_over_mean"] for s in r])) for r in reps]
        out["rank_ms"] = np.sum([s["rank_ms"] for s in per_step], axis=0).tolist()
        out["kernel_calls"] = int(sum(s["kernel_calls"] for s in per_step))
        for s in per_step:
            s.pop("features", None)
        out["per_step"] = per_step
        result["systems"][key] = out
    return result
