"""Megatron's variable-length context-parallel schedulers as simulated peers.

`megatron-dcp`: the installed megatron-core's `BalancedCPScheduler` (megatron.core.
pipeline_parallel.hybrid_cp_schedule) is fed the step's documents and forms groups of
sub-samples over the D x C GPUs; each document runs on a power-of-two set of GPUs.

`megatron-dyncp`: Megatron-LM's `DefaultDynamicCPScheduler` (its packing-aware dynamic context
parallelism, `dynamic_cp_schedule`): micro-batches are built one at a time over the D x C GPUs,
longest document first; a document may take a larger CP group than it needs, each choice is the
one with the lowest projected busiest-GPU workload under a cap set by the micro-batch's longest
document, what does not fit waits for the next micro-batch, and idle GPUs are filled by doubling
groups.

Both are timed with the same cost model as the other systems: a round is a lock-step
micro-batch, so its time is its slowest GPU's.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.workload import (
    ATTN_BWD_FACTOR,
    LINEAR_BWD_FACTOR,
    ModelConfig,
    linear_fwd_flops_per_token,
)


def balanced_cp_scheduler():
    """(megatron-core's BalancedCPScheduler class or None, why not). Imported on first use:
    megatron-core takes seconds to import, and only the megatron-dcp peer needs it."""
    global _DCP
    if _DCP is None:
        try:  # megatron-core (and torch) are optional for the simulator
            with warnings.catch_warnings():  # its optional-dependency notices are not ours
                warnings.simplefilter("ignore")
                # optional: megatron-core (the simulator runs without it)
                from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

            _DCP = (BalancedCPScheduler, "")
        except Exception as e:  # ImportError, or a torch/megatron import-time failure
            _DCP = (None, f"{type(e).__name__}: {e}")
    return _DCP


_DCP = None


class _GroupSize:
    """The only thing BalancedCPScheduler reads of its process group."""

    def __init__(self, n: int):
        self._n = n

    def size(self) -> int:
        return self._n


@dataclass
class DcpStep:
    step: float
    """Seconds: sum over groups of the slowest GPU, plus the exposed gradient reduction."""
    gpu_attention: np.ndarray
    """[D*C] attention seconds per GPU over the step."""
    groups: int
    schedule_ms: float


def dynamic_cp_schedule(
    lengths: list[int], n_gpus: int, cap: int, min_cp: int = 1, cap_slack: float = 0.05
) -> list[list[list[int]]]:
    """Megatron's dynamic CP (`DefaultDynamicCPScheduler`, Megatron-LM dev) on the step's
    documents: rounds (micro-batches) of per-GPU document-id lists; a document listed on k GPUs
    of a round runs on CP group k.

    The documents, longest first, fill one micro-batch at a time (`_one_micro_batch`); what does
    not fit waits for the next one. Every GPU of a group carries the same documents, so a group
    is a contiguous block of GPUs with one workload (sum of length^2 / group size) and one
    per-GPU token count (sum of length / group size, at most `cap`).
    """
    if n_gpus <= 0 or cap <= 0:
        raise ValueError(f"n_gpus and cap must be positive, got {n_gpus} and {cap}")
    lens = np.asarray([int(l) for l in lengths], dtype=np.int64)
    ids = np.argsort(-lens, kind="stable")  # longest first, ties in step order
    lens = lens[ids]
    need = np.ones_like(lens)
    while (short := need * cap < lens).any():
        need[short] *= 2
    need = np.minimum(np.maximum(need, min_cp), n_gpus)
    rounds = []
    while ids.size:
        per_gpu, waiting = _one_micro_batch(ids, lens, need, n_gpus, cap, cap_slack)
        rounds.append(per_gpu)
        w = np.asarray(waiting, dtype=np.int64)
        ids, lens, need = ids[w], lens[w], need[w]
    return rounds


def _one_micro_batch(
    ids: np.ndarray, lens: np.ndarray, need: np.ndarray, n_gpus: int, cap: int, cap_slack: float
) -> tuple[list[list[int]], list[int]]:
    """One micro-batch of Megatron's dynamic CP over documents sorted longest first (ids,
    lengths, the CP size each needs): (ids per GPU, positions of the documents left for later
    micro-batches, in order).

    1. The longest document opens a group of its needed size on GPUs 0.. and sets the workload
       cap: its length x `cap` x (1 + `cap_slack`).
    2. Each further document tries every power-of-two size from the one it needs up to n_gpus;
       at each size it may join an existing group of that size with token room, or open a new
       group on the lowest free GPUs. Every option is scored by the micro-batch's projected
       busiest-GPU workload; the lowest score within the cap wins (ties: the smaller size, an
       older group, joining before opening). A document with no option waits.
    3. Idle GPUs are filled by doubling the first smallest group that can grow in place (the
       groups after it shift right); when none can, the micro-batch is replaced by one group of
       all GPUs holding every document, in order, that fits its per-GPU token room.
    """
    id_of, len_of, size_of = ids.tolist(), lens.tolist(), need.tolist()
    tall = float(len_of[0])
    limit = tall * float(cap) * (1.0 + cap_slack)
    # groups, in opening order: size, first GPU, workload per GPU, tokens per GPU, ids
    g_size: list[int] = []
    g_first: list[int] = []
    g_work: list[float] = []
    g_tokens: list[float] = []
    g_ids: list[list[int]] = []
    by_size: dict[int, list[int]] = {}
    free_from = 0  # GPUs free_from.. belong to no group (groups take the lowest free GPUs)
    left: list[int] = []

    def open_group(size: int, work: float, tokens: float, doc: int) -> None:
        nonlocal free_from
        by_size.setdefault(size, []).append(len(g_size))
        g_size.append(size)
        g_first.append(free_from)
        g_work.append(work)
        g_tokens.append(tokens)
        g_ids.append([doc])
        free_from += size

    first_id, first_len = id_of[0], len_of[0]
    open_group(size_of[0], first_len * first_len / size_of[0], first_len / size_of[0], first_id)
    emptiest = {size_of[0]: g_tokens[0]}  # size -> the fewest tokens per GPU of its groups
    busiest = g_work[0]  # the largest group workload (free GPUs carry 0)
    n = len(id_of)
    flens = None  # float lengths, made when documents start to wait in runs
    k, misses = 1, 0
    while k < n:
        if misses >= 16:  # documents keep waiting: skip, in one pass, those with no room
            if flens is None:
                flens = lens.astype(np.float64)
            k = _next_with_room(k, flens, need, n_gpus - free_from, emptiest, cap, left)
            misses = 0
            if k >= n:
                break
        doc, length, size = id_of[k], len_of[k], size_of[k]
        k += 1
        best = None  # (score, group index or -1 for a new group, size)
        while size <= n_gpus:
            work = length * length / size
            share = length / size
            # no group of this size has room when the emptiest has none (float addition is
            # monotone, so this skips exactly the groups the loop would)
            groups = by_size.get(size, ()) if emptiest.get(size, cap) + share <= cap else ()
            for g in groups:
                if g_tokens[g] + share > cap:
                    continue
                t = g_work[g] + work
                score = t if t > busiest else busiest
                if score <= limit and (best is None or score < best[0]):
                    best = (score, g, size)
                    if score == busiest:  # no option scores below the busiest GPU: the
                        break  # first to reach it wins every tie after it
            if best is not None and best[0] == busiest:
                break
            if n_gpus - free_from >= size:
                score = work if work > busiest else busiest
                if score <= limit and (best is None or score < best[0]):
                    best = (score, -1, size)
            size *= 2
        if best is None:
            left.append(k - 1)
            misses += 1
            continue
        misses = 0
        score, g, size = best
        work, share = length * length / size, length / size
        if g < 0:
            open_group(size, work, share, doc)
        else:
            g_work[g] += work
            g_tokens[g] += share
            g_ids[g].append(doc)
        emptiest[size] = min(g_tokens[h] for h in by_size[size])
        busiest = max(busiest, score)
    while free_from < n_gpus:
        if not _double_first_smallest(g_size, g_first, free_from, n_gpus):
            return _one_full_group(id_of, len_of, n_gpus, cap)
        free_from = sum(g_size)
    per_gpu: list[list[int]] = [[] for _ in range(n_gpus)]
    for size, first, docs in zip(g_size, g_first, g_ids):
        for gpu in range(first, first + size):
            per_gpu[gpu] = list(docs)
    return per_gpu, left


def _next_with_room(
    k: int,
    lens: np.ndarray,
    need: np.ndarray,
    free: int,
    emptiest: dict[int, float],
    cap: int,
    left: list[int],
) -> int:
    """The first document from k on that has room somewhere: a new group (enough free GPUs
    for the size it needs) or a group of a size at least that with token room for its share.
    The ones before it have no option at all, so they wait (their positions appended to `left`),
    exactly as the one-by-one loop would decide; the state does not change while they do.
    Scans in growing windows: documents that wait come in long runs."""
    n, width = len(lens), 256
    while k < n:
        end = min(n, k + width)
        ok = need[k:end] <= free
        for size, tokens in emptiest.items():
            ok |= (need[k:end] <= size) & (tokens + lens[k:end] / size <= cap)
        hit = int(np.argmax(ok)) if ok.any() else end - k
        left.extend(range(k, k + hit))
        k += hit
        if k < end:
            return k
        width *= 2
    return k


def _double_first_smallest(g_size: list[int], g_first: list[int], used: int, n_gpus: int) -> bool:
    """Grow the first (in opening order) of the smallest groups to twice its size (at most
    n_gpus) where it can grow in place: the groups after it move right by the added GPUs, into
    the idle tail. False when no smallest group can."""
    smallest = min(g_size)
    grow = min(2 * smallest, n_gpus) - smallest
    for g, size in enumerate(g_size):
        if size != smallest:
            continue
        last = g_first[g] + size - 1
        if last + 1 > used or last + grow >= n_gpus:
            continue
        for h in range(len(g_size)):
            if h != g and g_first[h] > last:
                g_first[h] += grow
        g_size[g] = size + grow
        return True
    return False


def _one_full_group(
    id_of: list[int], len_of: list[int], n_gpus: int, cap: int
) -> tuple[list[list[int]], list[int]]:
    """The fallback micro-batch: every GPU in one group, holding each document (longest first)
    whose share still fits the per-GPU token room; the rest wait."""
    ids, left, tokens = [], [], 0.0
    for k, (doc, length) in enumerate(zip(id_of, len_of)):
        share = length / n_gpus
        if tokens + share <= cap:
            ids.append(doc)
            tokens += share
        else:
            left.append(k)
    return [list(ids) for _ in range(n_gpus)], left


def time_rounds(
    rounds: list[list[list[int]]],
    length: dict[int, int] | list[int],
    model: ModelConfig,
    hw: HardwareProfile,
    tp: int = 1,
    dtype_bytes: int = 2,
) -> tuple[float, np.ndarray]:
    """Seconds of a step's lock-step micro-batch rounds (the slowest GPU of each, summed) and
    attention seconds per GPU. A document listed on k GPUs of a round runs on CP group k: each
    GPU computes 1/k of its attention and tokens and exchanges its KV with the others."""
    n_gpus = len(rounds[0]) if rounds else 0
    L, d, h, hkv = model.layers, model.head_dim, model.heads, model.kv_heads
    lin = (
        linear_fwd_flops_per_token(model)
        * (1 + LINEAR_BWD_FACTOR)
        * L
        / tp
        / (hw.bf16_peak * hw.linear_efficiency)
    )
    total, attn_gpu = 0.0, np.zeros(n_gpus)
    for ids_per_gpu in rounds:
        holders: dict[int, int] = {}
        for ids in ids_per_gpu:
            for sid in ids:
                holders[sid] = holders.get(sid, 0) + 1
        group_time = 0.0
        for g, ids in enumerate(ids_per_gpu):
            t = 0.0
            for sid in ids:
                l, k = length[sid], holders[sid]
                pairs = l * (l + 1) / 2.0
                eff = float(hw.attn_efficiency(np.array([l]))[0])
                a = 4.0 * d * (h / tp) * pairs * L / k / (hw.attn_peak * eff)
                a *= 1.0 + ATTN_BWD_FACTOR / hw.attn_bwd_speed
                a += 2 * L * hw.call_floor
                attn_gpu[g] += a
                t += a + (l / k) * lin
                if k > 1:  # per-document CP inside the sub-group: KV all-gather, dKV reduce-scatter
                    link = hw.link(k * tp <= hw.gpus_per_node)
                    kv_bytes = (k - 1) * (l / k) * 2 * hkv / tp * d * dtype_bytes * 2
                    t += (kv_bytes / link.bandwidth + 4 * (k - 1) * link.latency) * L
            group_time = max(group_time, t)
        total += group_time
    return total, attn_gpu


def balanced_cp_rounds(lengths: list[int], n_gpus: int, cap: int) -> list[list[list[int]]]:
    """megatron-core's BalancedCPScheduler on the documents: rounds of per-GPU document ids."""
    BalancedCPScheduler, why = balanced_cp_scheduler()
    if BalancedCPScheduler is None:
        raise RuntimeError(f"megatron-core's BalancedCPScheduler is not importable ({why})")
    sched = BalancedCPScheduler(max_seq_len_per_rank=cap, dp_cp_group=_GroupSize(n_gpus))
    _, rounds = sched.get_groups_and_subsamples(list(enumerate(lengths)), None)
    return rounds


SCHEDULERS = {"megatron-dcp": balanced_cp_rounds, "megatron-dyncp": dynamic_cp_schedule}
"""Peer -> (document lengths, GPUs, per-GPU token cap) -> rounds of per-GPU document ids."""


def simulate_cp_step(
    peer: str,
    sequences: list[list[int]],
    dp: int,
    cp: int,
    context: int,
    model: ModelConfig,
    hw: HardwareProfile,
    dp_exposed: float,
    tp: int = 1,
    dtype_bytes: int = 2,
) -> DcpStep:
    """Schedule the step's documents with a peer of SCHEDULERS (per-GPU token cap: the static
    layout's context / cp) and time its rounds."""
    lengths = [int(l) for s in sequences for l in s]
    t0 = time.perf_counter()
    rounds = SCHEDULERS[peer](lengths, dp * cp, max(1, context // cp))
    schedule_ms = (time.perf_counter() - t0) * 1e3
    total, attn_gpu = time_rounds(rounds, lengths, model, hw, tp, dtype_bytes)
    return DcpStep(
        step=total + dp_exposed,
        gpu_attention=attn_gpu,
        groups=len(rounds),
        schedule_ms=schedule_ms,
    )
