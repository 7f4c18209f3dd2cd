"""Step-time model per rank (DESIGN.md section 4): linear layers, attention tiles, Ulysses
all-to-all, the pool exchange and how much of it the TAP pipeline hides, WLB-LLM's KV all-gather,
the attention operator's own data path (its device copies, gathers and scatters around the
kernels, and its launches: `operator_time`), and the data-parallel gradient reduction. Step time
= max over ranks + the exposed reduction."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra_ext.memory import check_attention_memory
from libra_ext.planner import StepPlan
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.workload import (
    ATTN_BWD_FACTOR,
    LINEAR_BWD_FACTOR,
    ModelConfig,
    linear_fwd_flops_per_token,
)


@dataclass
class StepTimes:
    """Seconds for one optimizer step. Per-rank arrays are [D, C] (every tp rank of a (replica,
    cp) pair is identical); `slot` is [D, m], the time of each micro-batch slot of a replica."""

    linear: np.ndarray
    attention: np.ndarray
    cp_comm: np.ndarray
    """Ulysses all-to-all (or WLB-LLM's KV all-gather and dK/dV reduce-scatter)."""
    pool_comm: np.ndarray
    """Pool-exchange transfer time."""
    pool_exposed: np.ndarray
    """The part of pool_comm the TAP pipeline does not hide."""
    operator: np.ndarray
    """The attention operator's device traffic and launches around its kernels."""
    dp_exposed: float
    slot: np.ndarray

    @property
    def rank_total(self) -> np.ndarray:
        return self.linear + self.attention + self.cp_comm + self.pool_exposed + self.operator

    @property
    def step(self) -> float:
        return float(self.rank_total.max()) + self.dp_exposed

    @property
    def attention_latency(self) -> np.ndarray:
        """Per-rank time of core attention including its communication."""
        return self.attention + self.cp_comm + self.pool_exposed + self.operator


OPERATOR_LAUNCHES = {"ulysses": 12, "wlb": 6}
"""Device ops of one layer call, forward + backward, beyond a plain call's (whose kernel calls
`call_floor` counts): the Ulysses layout copies, per-document CP's key pack and reduction (the
GPU-readiness gate's counts at 256K tokens, 32 / 4 heads: 17 and 11 against a plain call's 5;
Ulysses's O and dO move between the layouts in exchange.ROUNDS token ranges, own block in
place: 13 before). At one cp rank the operator is the plain call: nothing beyond it."""
LAUNCHES_PER_SUBCHUNK = 3
"""Device ops one sub-chunk of the pool exchange adds to a layer call (its fused gathers, kernel
calls and fused scatters, forward + backward; the gate: libra 10 forward and 13-14 backward
at pool 2 and 8, against Ulysses's 8 / 9, over 2 x chunks sub-chunks)."""
OWNER_GATHERED = 0.005
"""The share of an owner's moved Q and K/V that travels gathered (its send gathered, its
returned O and dQ scattered) rather than sent from X and received in place: 0 on the
libra-256k preset at CP 8 and libra-1m at CP 16, 0.004 / 0.001 at CP 2 (DP 16, pool 8, two
steps; 0.08-0.22 / 0.03-0.07 when a message had to be one contiguous range, 1 before the
exchange went in place)."""
EXECUTOR_PACKED = 0.2
"""The share of an executor's received units run from packs (gathered, their outputs and
gradients scattered) rather than directly on the receive buffers: with TAP's contiguous pieces
0 on the libra-256k preset and 0.21 on libra-1m (DP 16, pool 8, two steps; before them 0.56 and
0.46)."""


def operator_time(plan: StepPlan, model: ModelConfig, hw: HardwareProfile,
                  tokens_rank_slot: np.ndarray, chunks: int) -> np.ndarray:
    """[D, C, m] seconds per step of the attention operator's own device work around its
    kernels, every layer, forward + backward, counted as the gate counts it (docs/runtime.md):
    bytes read + written at `hw.copy_bandwidth` plus `hw.launch` per device op.

    - one cp rank: nothing moves (the kernel reads the inputs and writes the output itself);
    - Ulysses family at C > 1: a layout copy on one side of every all-to-all: 4 x (Q + K + V)
      + 4 x O;
    - libra / distca: per pool member, for the elements it sends as an owner (the plan's
      exchange cells) 3 x KV (the returned gradients added) and, for the share that travels
      gathered (OWNER_GATHERED), 8 x Q (send gather, output placement, dO gather, dQ
      placement) and 2 x KV (gather); for what it receives as an executor 8 x Q and 5 x KV for
      the packed share (EXECUTOR_PACKED);
    - wlb at C > 1: its key pack (about the sequence's K and V) gathered and, backward, added
      into a zeroed all-gather-sized buffer reduced over C.
    """
    D, C, m, T = plan.dp, plan.cp, plan.slots, plan.tp
    d, dt = model.head_dim, float(plan.dtype_bytes)
    h, hkv = model.heads / T, max(1.0, model.kv_heads / T)
    t = tokens_rank_slot  # [D, m]
    qkv = t * (h + 2 * hkv) * d * dt
    o = t * h * d * dt
    kv_row = 2 * hkv * d * dt  # K and V of one token
    launches = np.zeros((D, m))
    nbytes = np.zeros((D, m))
    if C > 1 and plan.system == "wlb":
        nbytes = 5 * (C * t) * kv_row + (2 * C + C + 1) * t * kv_row
        launches = np.where(t > 0, OPERATOR_LAUNCHES["wlb"], 0).astype(np.float64)
    elif C > 1:
        nbytes = 4 * qkv + 4 * o
        launches = np.where(t > 0, OPERATOR_LAUNCHES["ulysses"], 0).astype(np.float64)
    out = np.repeat((nbytes / hw.copy_bandwidth + launches * hw.launch)[:, None, :], C, axis=1)
    px = plan.exchange_pool
    if plan.system in ("libra", "distca") and px > 1 and plan.xchg_q.any():
        q, kv = plan.xchg_q.astype(np.float64), plan.xchg_kv.astype(np.float64)
        eye = np.eye(px, dtype=bool)[None]
        q, kv = np.where(eye, 0.0, q), np.where(eye, 0.0, kv)
        own = OWNER_GATHERED * (8 * q.sum(axis=2) + 2 * kv.sum(axis=2)) + 3 * kv.sum(axis=2)
        exe = EXECUTOR_PACKED * (8 * q.sum(axis=1) + 5 * kv.sum(axis=1))  # as executor
        per = (own + exe) * dt / hw.copy_bandwidth + LAUNCHES_PER_SUBCHUNK * 2 * chunks * \
            hw.launch * (q.sum(axis=2) + q.sum(axis=1) > 0)
        for g in range(per.shape[0]):
            pool, slot = divmod(g, m)
            out[pool * px : (pool + 1) * px, :, slot] += per[g][:, None]
    return out * model.layers


def exposed_pool_comm(
    comm: np.ndarray, attn: np.ndarray, chunks: int, pipelined: bool
) -> np.ndarray:
    """Pool exchange time left on the critical path. With the TAP pipeline over `chunks` head
    chunks, chunk i+1's transfer overlaps chunk i's attention: the first chunk's send and the last
    chunk's return stay exposed, the middle transfers only where they outlast the compute."""
    if not pipelined or chunks <= 1:
        return comm
    n = float(chunks)
    return comm * 2.0 / n + np.maximum(0.0, comm * (n - 2.0) / n - attn * (n - 1.0) / n)


def pool_collective_time(plan: StepPlan, hw: HardwareProfile, chunks: int,
                         attention_memory: str = "keep") -> np.ndarray:
    """[D, m] seconds per layer of each replica's pool exchange in each slot
    (`attention_memory`: system.attention_memory; owner and rebuild ship each moved unit's Q,
    K/V and O once more, with its dO)."""
    px, m, D = plan.exchange_pool, plan.slots, plan.dp
    out = np.zeros((D, m))
    if px == 1 or not plan.xchg_q.any():
        return out
    dt = float(plan.dtype_bytes)
    q, kv, o = (x.astype(np.float64) for x in (plan.xchg_q, plan.xchg_kv, plan.xchg_o))
    # [G, a, b]: bytes a sends b over forward (Q, KV as owner; O as executor) and backward
    # (dO as owner; dQ, dKV as executor).
    send = dt * (q + kv + o + np.swapaxes(o, 1, 2) + np.swapaxes(q, 1, 2) + np.swapaxes(kv, 1, 2))
    if attention_memory != "keep":  # backward, as owner: Q, KV and O again beside dO
        send = send + dt * (q + kv + np.swapaxes(o, 1, 2))
    busiest = np.maximum(send.sum(axis=2), send.sum(axis=1)).max(axis=1)  # [G]
    peers = ((send > 0).sum(axis=2) + (send > 0).sum(axis=1)).max(axis=1)  # [G]
    link = hw.link(plan.cp * plan.tp * px <= hw.gpus_per_node)
    # Messages: Q, KV, O out and back per peer and head chunk, forward and backward.
    t = busiest / link.bandwidth + peers * 3 * chunks * link.latency  # [G]
    for g in range(len(t)):
        pool_idx, slot = divmod(g, m)
        out[pool_idx * px : (pool_idx + 1) * px, slot] = t[g]
    return out


def dp_reduction(model: ModelConfig, hw: HardwareProfile, dp: int, cp: int, tp: int) -> float:
    """Exposed gradient reduction over the data x context-parallel group (ring)."""
    n = dp * cp
    nbytes = model.param_count() / tp * hw.grad_bytes_per_param
    same_node = n * tp <= hw.gpus_per_node
    return hw.allreduce_exposed * hw.ring_allreduce(nbytes, n, same_node)


def simulate_plan(
    plan: StepPlan,
    model: ModelConfig,
    hw: HardwareProfile,
    *,
    pipelined: bool = True,
    chunks: int = 4,
    attention_memory: str = "keep",
) -> StepTimes:
    """Model one step of `plan` (any system) on `hw`; `attention_memory` (system.attention_
    memory) prices what owner and rebuild send again in the backward: the moved units' Q, K/V
    and O in the pool exchange, with rebuild the Ulysses O once more, and wlb's K and V
    all-gathered once more (owner, rebuild)."""
    check_attention_memory(attention_memory)
    D, C, m, T = plan.dp, plan.cp, plan.slots, plan.tp
    L = model.layers
    d = model.head_dim
    dtype = plan.dtype_bytes
    # Tokens of every executed sequence, and the (replica, slot) it runs in.
    seq_tokens = plan.sequence_tokens().astype(np.float64)
    rs = plan.seq_replica * m + plan.seq_slot
    slot_tokens = np.bincount(rs, weights=seq_tokens, minlength=D * m).reshape(D, m)
    tokens_rank_slot = slot_tokens / C  # every cp rank holds 1/C of each sequence's tokens

    # Linear layers: forward + backward, sharded over tp.
    lin_flops = linear_fwd_flops_per_token(model) * (1.0 + LINEAR_BWD_FACTOR) * L / T
    linear_slot = tokens_rank_slot * lin_flops / (hw.bf16_peak * hw.linear_efficiency)

    # Attention tiles: forward at the curve's speed, backward at backward_speed_ratio of it.
    single = plan.tile_doc_count == 1
    length = np.where(
        single, plan.tile_kv_len, plan.tile_q_len / np.maximum(plan.tile_doc_count, 1)
    )
    eff = hw.attn_efficiency(length)
    fwd = 4.0 * d * plan.tile_head_count * plan.tile_pairs.astype(np.float64) * L
    t_tile = fwd / (hw.attn_peak * eff) * (1.0 + ATTN_BWD_FACTOR / hw.attn_bwd_speed)
    exec_slot = plan.tile_executor * m + plan.seq_slot[plan.tile_seq]
    attn_slot = np.zeros((D, C, m))
    all_cp = plan.tile_cp < 0
    per_rs = np.bincount(exec_slot[all_cp], weights=t_tile[all_cp], minlength=D * m).reshape(D, m)
    attn_slot += per_rs[:, None, :]
    if (~all_cp).any():
        idx = (plan.tile_executor[~all_cp] * C + plan.tile_cp[~all_cp]) * m + exec_slot[~all_cp] % m
        attn_slot += np.bincount(idx, weights=t_tile[~all_cp], minlength=D * C * m).reshape(D, C, m)
    # Kernel-call floor: one batched varlen call for a rank's own tiles and one per exchange
    # chunk (the runtime's two head classes at most are counted as one), forward and backward.
    calls = (1 + chunks if plan.exchange_pool > 1 else 1) * 2 * L
    busy = np.zeros((D, C, m), dtype=bool)
    busy[:, :, :] = attn_slot > 0
    attn_slot += busy * calls * hw.call_floor

    # Context-parallel communication inside the replica.
    h, hkv = model.heads, model.kv_heads
    cp_link = hw.link(C * T <= hw.gpus_per_node)
    if plan.system == "wlb":
        # Per-document CP: all-gather K, V (fwd) and reduce-scatter dK, dV (bwd) over C ranks.
        per_token = 2 * hkv / T * d * dtype * 2 * (C - 1)
        msgs = 2 * 2 * (C - 1)
        if attention_memory != "keep":  # its key and value packs gathered again (backward)
            per_token += 2 * hkv / T * d * dtype * (C - 1)
            msgs += 2 * (C - 1)
    else:
        # Ulysses: all-to-all Q, K, V in and O out (fwd), dO in and dQ, dK, dV out (bwd).
        per_token = ((h + 2 * hkv) + h) / T * d * dtype * 2 * (C - 1) / C
        msgs = 4 * (C - 1)
        if attention_memory == "rebuild":  # O rebuilt backward: its all-to-all once more
            per_token += h / T * d * dtype * (C - 1) / C
            msgs += C - 1
    cp_slot = (
        np.where(
            tokens_rank_slot > 0,
            (tokens_rank_slot * per_token / cp_link.bandwidth + msgs * cp_link.latency) * L,
            0.0,
        )
        if C > 1
        else np.zeros((D, m))
    )

    # Pool exchange (libra, distca): one all-to-all-v per group and layer, forward and backward.
    # A collective ends when its busiest member has sent and received everything, so every member
    # of the group waits for max over members of max(bytes sent, bytes received).
    pool_comm = (
        np.repeat(
            pool_collective_time(plan, hw, chunks, attention_memory).sum(axis=1)[:, None],
            C,
            axis=1,
        )
        * L
    )
    attention = attn_slot.sum(axis=2)
    pool_exposed = exposed_pool_comm(pool_comm, attention, chunks, pipelined)
    op_slot = operator_time(plan, model, hw, tokens_rank_slot, chunks)
    operator = op_slot.sum(axis=2)
    linear = np.repeat(linear_slot.sum(axis=1)[:, None], C, axis=1)
    cp_comm = np.repeat(cp_slot.sum(axis=1)[:, None], C, axis=1)
    # Per-slot time of each replica (the slowest cp rank), with the pool exposure spread over
    # slots in proportion to their attention time.
    share = np.divide(
        attn_slot,
        attention[:, :, None],
        out=np.zeros_like(attn_slot),
        where=attention[:, :, None] > 0,
    )
    slot = (
        linear_slot[:, None, :] + attn_slot + op_slot + cp_slot[:, None, :]
        + pool_exposed[:, :, None] * share
    ).max(axis=1)
    return StepTimes(
        linear=linear,
        attention=attention,
        cp_comm=cp_comm,
        pool_comm=pool_comm,
        pool_exposed=pool_exposed,
        operator=operator,
        dp_exposed=dp_reduction(model, hw, D, C, T),
        slot=slot,
    )
