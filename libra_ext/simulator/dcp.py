"""Megatron's variable-length context-parallel schedulers as simulated peers.

`megatron-dcp`: the installed megatron-core's `BalancedCPScheduler` (megatron.core.
pipeline_parallel.hybrid_cp_schedule) is fed the step's documents and forms groups of
sub-samples over the D x C GPUs; each document runs on a power-of-two set of GPUs.

`megatron-dyncp`: Megatron's newer packing-aware dynamic context parallelism, implemented here
from its description (`dynamic_cp_schedule`): every document gets the smallest power-of-two CP
group whose GPUs hold it under the per-GPU token cap; documents, heaviest first, are packed into
bins whose CP size and token capacity (CP size x cap) are set by their first (tallest) document;
bins, heaviest first, fill micro-batch rounds of the D x C GPUs, each bin on the free aligned
block of its CP size whose GPUs carry the least work so far.

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


def cp_sizes(n_gpus: int) -> list[int]:
    """Runtime CP group sizes over n_gpus GPUs: the powers of two that divide it, and n_gpus."""
    sizes, p = [], 1
    while p < n_gpus:
        if n_gpus % p == 0:
            sizes.append(p)
        p *= 2
    return sizes + [n_gpus]


def dynamic_cp_schedule(lengths: list[int], n_gpus: int, cap: int) -> list[list[list[int]]]:
    """Megatron's packing-aware dynamic CP, from its description: rounds (micro-batches) of
    per-GPU document-id lists; a document listed on k GPUs of a round runs on CP group k.

    Each document gets the smallest CP size p (see `cp_sizes`) with length <= p * cap (the full
    pool if none). Documents by work (length squared), heaviest first, go into the first open bin
    of at least their CP size with room left; a new bin takes the CP size of the document that
    opens it and p * cap tokens. Bins by work, heaviest first, fill rounds: each round takes the
    next bins that fit the GPUs it has left, and places them largest CP size first, each on the
    free aligned block of consecutive GPUs that carries the least work so far.
    """
    if n_gpus <= 0 or cap <= 0:
        raise ValueError(f"n_gpus and cap must be positive, got {n_gpus} and {cap}")
    sizes = cp_sizes(n_gpus)

    def size_of(length: int) -> int:
        for p in sizes:
            if length <= p * cap:
                return p
        return n_gpus

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i] * lengths[i], i))
    bins: list[dict] = []  # {"p", "room", "docs", "work"}
    # Documents come longest first, so every open bin's CP size is at least the current
    # document's: first fit only needs the first bin with room, found in a max-tree over bins.
    size = 1
    while size < max(1, len(order)):
        size *= 2
    tree = [-1] * (2 * size)  # max room under each node; -1: no bin there

    def set_room(b: int, room: int) -> None:
        k = size + b
        tree[k] = room
        while k > 1:
            k //= 2
            tree[k] = max(tree[2 * k], tree[2 * k + 1])

    def first_with_room(need: int) -> int:
        if tree[1] < need:
            return -1
        k = 1
        while k < size:
            k = 2 * k if tree[2 * k] >= need else 2 * k + 1
        return k - size

    for i in order:
        length = lengths[i]
        b = first_with_room(length)
        if b < 0:
            p = size_of(length)
            bins.append({"p": p, "room": max(p * cap, length), "docs": [], "work": 0})
            b = len(bins) - 1
        bins[b]["docs"].append(i)
        bins[b]["room"] -= length
        bins[b]["work"] += length * length
        set_room(b, bins[b]["room"])
    pending = sorted(bins, key=lambda b: -b["work"])  # stable: ties in opening order
    rounds = []
    carried = [0.0] * n_gpus  # attention work (length squared / CP size) per GPU so far
    while pending:
        free, chosen, rest = n_gpus, [], []
        for b in pending:
            if b["p"] <= free:
                chosen.append(b)
                free -= b["p"]
            else:
                rest.append(b)
        pending = rest
        per_gpu: list[list[int]] = [[] for _ in range(n_gpus)]
        used = [False] * n_gpus
        # largest CP size first, each bin on the free aligned block whose GPUs carry the least
        # work so far (sizes descending keep every free block aligned)
        for b in sorted(chosen, key=lambda b: -b["p"]):
            p = b["p"]
            starts = [g for g in range(0, n_gpus, p) if not any(used[g : g + p])]
            g0 = min(starts, key=lambda g: (sum(carried[g : g + p]), g))
            for g in range(g0, g0 + p):
                per_gpu[g].extend(b["docs"])
                used[g] = True
                carried[g] += b["work"] / p
        rounds.append(per_gpu)
    return rounds


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
