"""Workload-ordered micro-batches for pipeline parallelism (1F1B).

With PP, each replica's m micro-batches (the plan's slots) flow through p stages under
megatron-core's 1F1B schedule. A micro-batch heavy in attention stalls every stage behind it, so
the order of the slots matters: the critical path of the schedule depends on which micro-batch
comes first (pipeline fill), last (drain) and how heavy ones alternate with light ones.

`order_slots` chooses, for every exchange pool, one order of the slots (a permutation) that
minimises the modeled 1F1B step: the pool's replicas must run a slot at the same schedule
position, because its tiles are exchanged between them (Libra: P replicas; DistCA: all D; Ulysses
and WLB-LLM: each replica alone). Only the order changes: every slot keeps its sequences, so a
step trains on exactly the same samples (`samples_preserved`).

The stage time of a micro-batch is its slot time from the cost model (linear layers, attention
tiles as the plan places them, CP and pool communication; `simulator.cost.simulate_plan`)
divided over the p stages, a third forward and two thirds backward (backward costs about twice
the forward). Non-interleaved 1F1B only (virtual stages shrink every bubble by their count).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

PP_ORDERS = ("none", "balanced")
"""system.pp_order: none (the plan's slot order) | balanced (order_slots)."""

FORWARD_SHARE = 1.0 / 3.0
"""Share of a micro-batch's stage time spent in its forward pass."""

@functools.lru_cache(maxsize=64)
def _schedule(stages: int, m: int) -> tuple:
    """megatron-core's non-interleaved 1F1B op order of every stage, as one list of
    (stage, kind, micro-batch, dependency) in an order where each op's dependency comes first:
    kind 0 is a forward, 1 a backward; the dependency is (kind, stage) of the same micro-batch,
    or None for stage 0's forwards."""
    p = stages
    per_stage = []
    for s in range(p):
        warm = min(p - s - 1, m)
        seq = [(0, j) for j in range(warm)]
        for i in range(m - warm):
            seq += [(0, warm + i), (1, i)]
        seq += [(1, j) for j in range(m - warm, m)]
        per_stage.append(seq)
    done = set()
    pos = [0] * p
    out = []
    while len(out) < 2 * p * m:
        progressed = False
        for s in range(p):
            while pos[s] < len(per_stage[s]):
                kind, j = per_stage[s][pos[s]]
                if kind == 0:
                    dep = (0, s - 1) if s > 0 else None
                else:
                    dep = (1, s + 1) if s < p - 1 else (0, s)
                if dep is not None and (dep[0], dep[1], j) not in done:
                    break
                done.add((kind, s, j))
                out.append((s, kind, j, dep))
                pos[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - the 1F1B order has no cycle
            raise RuntimeError("1F1B schedule did not progress")
    return tuple(out)


def one_f_one_b(fwd: np.ndarray, bwd: np.ndarray, stages: int) -> np.ndarray:
    """Makespan of megatron-core's non-interleaved 1F1B schedule.

    fwd, bwd: [..., m] stage times of each micro-batch in schedule order (the same on every
    stage); returns [...] the time from the first forward on stage 0 to the last backward on
    stage 0. Stage s runs min(p - s - 1, m) warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards; a forward waits for the previous stage's forward of
    the same micro-batch, a backward for the next stage's backward (the last stage's for its own
    forward). Leading dimensions are evaluated side by side."""
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.shape != bwd.shape or fwd.ndim < 1:
        raise ValueError("fwd and bwd must have the same shape [..., m]")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    m = fwd.shape[-1]
    lead = fwd.shape[:-1]
    if m == 0:
        return np.zeros(lead)
    times = (np.moveaxis(fwd, -1, 0), np.moveaxis(bwd, -1, 0))  # [m, ...] each
    done = {}
    free = [np.zeros(lead) for _ in range(stages)]
    for s, kind, j, dep in _schedule(stages, m):
        start = free[s] if dep is None else np.maximum(free[s], done[(dep[0], dep[1], j)])
        free[s] = start + times[kind][j]
        done[(kind, s, j)] = free[s]
    return np.max(np.stack(free), axis=0)


def stage_times(slot_times: np.ndarray, stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward stage times of each micro-batch from whole-model slot times."""
    per_stage = np.asarray(slot_times, dtype=np.float64) / stages
    return per_stage * FORWARD_SHARE, per_stage * (1.0 - FORWARD_SHARE)


def _makespans(slot_times: np.ndarray, orders: np.ndarray, stages: int) -> np.ndarray:
    """Heaviest member's 1F1B makespan of a pool's [members, m] slot times under each of
    `orders` ([n, m]), side by side."""
    ordered = slot_times[:, orders]  # [members, n, m]
    f, b = stage_times(ordered, stages)
    return one_f_one_b(f, b, stages).max(axis=0)


def _best_order(slot_times: np.ndarray, stages: int) -> np.ndarray:
    """A slot order of one exchange pool ([members, m] slot times) with the lowest heaviest
    makespan found: the plan's order or a light-heavy arrangement, then the best pairwise swap
    while one lowers it (every swap of a round evaluated side by side, at most 2m rounds).
    Never worse than the plan's order."""
    m = slot_times.shape[1]
    identity = np.arange(m)
    if stages == 1 or m < 2:
        return identity
    work = slot_times.max(axis=0)
    light_first = np.argsort(work, kind="stable")
    # lightest at both ends, heaviest in the middle: the fill and the drain wait on light ones
    ends = np.empty(m, dtype=np.int64)
    ends[: (m + 1) // 2] = light_first[0::2]
    ends[(m + 1) // 2 :] = light_first[1::2][::-1]
    candidates = np.stack([identity, light_first, light_first[::-1], ends])
    spans = _makespans(slot_times, candidates, stages)
    k = int(np.argmin(spans))  # the first of equals: the plan's order unless one is lower
    best, best_t = candidates[k], float(spans[k])
    i_idx, j_idx = np.triu_indices(m, 1)
    rows = np.arange(len(i_idx))
    for _ in range(2 * m):
        swaps = np.tile(best, (len(i_idx), 1))
        swaps[rows, i_idx], swaps[rows, j_idx] = best[j_idx], best[i_idx]
        spans = _makespans(slot_times, swaps, stages)
        k = int(np.argmin(spans))
        if not spans[k] < best_t * (1 - 1e-12):
            break
        best, best_t = swaps[k], float(spans[k])
    return best


@dataclass
class PipelineOrder:
    """Slot order of every replica and the modeled 1F1B step before and after."""

    stages: int
    order: np.ndarray
    """[D, m]: order[r, k] = the slot replica r runs k-th (identical inside an exchange pool)."""
    step_before: float
    """Modeled pipeline time (s) of the slowest replica in the plan's slot order."""
    step_after: float
    bubble_before: float
    """Share of step_before in which a stage waits (fill, drain and stalls)."""
    bubble_after: float
    samples_preserved: bool
    """Every replica runs exactly its own slots, each once (only the order changed)."""

    def as_dict(self) -> dict:
        return {
            "pp": self.stages,
            "pp_step_before_s": self.step_before,
            "pp_step_after_s": self.step_after,
            "pp_bubble_before": self.bubble_before,
            "pp_bubble_after": self.bubble_after,
            "samples_preserved": self.samples_preserved,
        }


def _bubble(slot_times: np.ndarray, order: np.ndarray, stages: int) -> tuple[float, float]:
    """(step, bubble share) of all replicas run in `order` ([D, m] each)."""
    ordered = np.take_along_axis(slot_times, order, axis=1)
    f, b = stage_times(ordered, stages)
    span = one_f_one_b(f, b, stages)  # [D]
    busy = (f + b).sum(axis=1)  # each stage's own work
    step = float(span.max())
    # the slowest replica's waiting: what it spends beyond its own stage work
    r = int(np.argmax(span))
    return step, (float((span[r] - busy[r]) / span[r]) if span[r] > 0 else 0.0)


def order_slots(slot_times: np.ndarray, exchange_pool: int, stages: int,
                mode: str = "balanced") -> PipelineOrder:
    """Order the slots of every exchange pool for a `stages`-stage 1F1B pipeline.

    slot_times: [D, m] seconds of each replica's micro-batch slot for the whole model;
    exchange_pool: replicas that run each slot together (D must be a multiple); mode: one of
    PP_ORDERS."""
    if mode not in PP_ORDERS:
        raise ValueError(f"pp_order must be one of {', '.join(PP_ORDERS)}, got {mode!r}")
    slot_times = np.asarray(slot_times, dtype=np.float64)
    if slot_times.ndim != 2:
        raise ValueError("slot_times must be [D, m]")
    if stages < 1:
        raise ValueError(f"pp must be >= 1, got {stages}")
    D, m = slot_times.shape
    if exchange_pool < 1 or D % exchange_pool:
        raise ValueError(f"exchange pool ({exchange_pool}) must divide the replicas ({D})")
    order = np.tile(np.arange(m), (D, 1))
    if mode == "balanced":
        for k in range(D // exchange_pool):
            rows = slice(k * exchange_pool, (k + 1) * exchange_pool)
            order[rows] = _best_order(slot_times[rows], stages)
    identity = np.tile(np.arange(m), (D, 1))
    step_before, bubble_before = _bubble(slot_times, identity, stages)
    step_after, bubble_after = _bubble(slot_times, order, stages)
    preserved = bool((np.sort(order, axis=1) == identity).all())
    return PipelineOrder(stages, order, step_before, step_after, bubble_before, bubble_after,
                         preserved)
