"""The core-attention operator with Megatron-Core's contract, for every system.

Inputs are one cp rank's THD tensors in Megatron's per-document zigzag layout (see `thd`):
query [t, h, d], key/value [t, h_kv, d] (h, h_kv already divided by tp). Output [t, h * d].

- `ulysses`: all-to-all over heads inside the CP group, attention over whole documents, back.
- `libra` / `distca`: the same all-to-all, then the step plan's tiles run through the pool
  exchange (TileExchange), then back.
- `wlb`: per-document CP: K and V all-gathered in the CP group, each rank computes its two chunks
  of every document; dK/dV reduce-scattered back.
"""

from __future__ import annotations

import datetime
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from libra_ext.attention import thd
from libra_ext.attention.comm import AllGatherRS, ByteCounter, EqualAllToAll, GroupCache
from libra_ext.attention.exchange import TileExchange, build_spec
from libra_ext.attention.kernels import select_backend
from libra_ext.planner import StepPlan

logger = logging.getLogger(__name__)

SYSTEMS = ("ulysses", "libra", "wlb", "distca")


@dataclass
class AttentionStep:
    """What the operator needs about the current micro-batch: the step plan and the slot."""

    plan: StepPlan
    slot: int


@dataclass
class Runtime:
    """Per-process runtime state: process groups (created once), byte counters, options."""

    groups: GroupCache
    chunks: int = 4
    """TAP pipeline head chunks."""
    pipelined: bool = True
    counter: ByteCounter = field(default_factory=ByteCounter)
    _specs: dict = field(default_factory=dict)
    _backend: object = None

    def backend(self, device):
        if self._backend is None:
            self._backend = select_backend(device)
        return self._backend

    def spec(self, plan: StepPlan, replica: int, slot: int):
        key = (plan.hash, replica, slot, self.chunks)
        if key not in self._specs:
            self._specs.clear()  # one plan at a time
            self._specs[key] = build_spec(plan, replica, slot, self.chunks)
        return self._specs[key]


def check_plan_hash(plan: StepPlan, timeout_s: float = 60.0, group=None) -> None:
    """Compare the plan hash across all ranks; on a mismatch every rank raises, naming the ranks
    that differ; a rank that never arrives turns into an error after the group's timeout
    (`timeout_s` for a group made here; pass GroupCache.check_group to reuse one), not a hang."""
    if group is None:
        group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    mine = torch.tensor([plan.hash & ((1 << 63) - 1), plan.hash >> 63], dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(out, mine, group=group)
    except RuntimeError as e:
        raise RuntimeError(
            f"plan hash check did not complete within {timeout_s:.0f} s ({str(e).splitlines()[0]})"
        ) from None
    hashes = [int(t[0]) | (int(t[1]) << 63) for t in out]
    bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if bad:
        raise ValueError(
            f"plan hash differs across ranks: rank 0 has {hashes[0]:016x}, ranks "
            f"{bad} have {[f'{hashes[r]:016x}' for r in bad]}"
        )


def core_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    doc_lengths,
    system: str,
    runtime: Runtime,
    step: AttentionStep | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """One rank's core attention for one packed sequence. Returns [t, h * d]."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("query, key and value must be THD tensors [t, heads, head_dim]")
    t, h, d = query.shape
    if key.shape != value.shape or key.shape[0] != t or key.shape[2] != d:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"[t={t}, kv_heads, d={d}]"
        )
    hkv = key.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    groups = runtime.groups
    C, c, r = groups.cp, groups.c, groups.r
    L = [int(x) for x in doc_lengths]
    mine = thd.zigzag_split(L, C, c)
    if len(mine.token_index) != t:
        raise ValueError(
            f"cu_seqlens do not match the tokens: the documents {sum(L)} tokens "
            f"give {len(mine.token_index)} local slots on cp rank {c}, query has {t}"
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kernel = runtime.backend(query.device)
    if system == "wlb":
        return _per_document_cp(query, key, value, L, mine, groups, runtime.counter, kernel, scale)
    if h % C:
        raise ValueError(f"query heads ({h}) must be divisible by cp ({C}) for {system}")
    hl = h // C
    g = h // hkv
    kvl = max(1, hl // g)
    if step is None:
        raise ValueError(f"{system} needs the step plan (packed_seq_params.libra)")
    plan = step.plan
    if plan.heads_local != hl or plan.kv_heads_local != kvl or plan.cp != C:
        raise ValueError(
            f"mismatched head counts: the plan has {plan.heads_local} query and "
            f"{plan.kv_heads_local} KV heads per rank over cp {plan.cp}, the tensors "
            f"give {hl} and {kvl} over cp {C}"
        )
    spec = runtime.spec(plan, r, step.slot)
    if spec.tokens != sum(L):
        raise ValueError(
            f"the plan's sequence at replica {r}, slot {step.slot} has "
            f"{spec.tokens} tokens, the batch {sum(L)}"
        )
    # [t, h, d] -> [t, C, hl*d]; KV: the heads each cp rank's query slice needs.
    kv_idx = np.stack(
        [
            np.arange(j * hl // g, j * hl // g + kvl) if hl >= g else np.full(kvl, j * hl // g)
            for j in range(C)
        ]
    )
    q_send = query.reshape(t, C, hl * d)
    k_send = key[:, torch.as_tensor(kv_idx.reshape(-1))].reshape(t, C, kvl * d)
    v_send = value[:, torch.as_tensor(kv_idx.reshape(-1))].reshape(t, C, kvl * d)
    qkv = torch.cat([q_send, k_send, v_send], dim=2)
    if C > 1:
        qkv = EqualAllToAll.apply(qkv, groups.cp_group(), runtime.counter, "ulysses.in")
    else:
        qkv = qkv.reshape(t, -1)
    order = torch.as_tensor(thd.gather_order(L, C))
    full = qkv.index_select(0, order)  # [S, hl*d + 2*kvl*d], natural token order
    S = full.shape[0]
    q_full = full[:, : hl * d].reshape(S, hl, d)
    k_full = full[:, hl * d : (hl + kvl) * d].reshape(S, kvl, d)
    v_full = full[:, (hl + kvl) * d :].reshape(S, kvl, d)
    pool_group = groups.pool_group(plan.exchange_pool) if plan.exchange_pool > 1 else None
    out_full = TileExchange.apply(
        q_full, k_full, v_full, spec, pool_group, kernel, scale, runtime.counter, runtime.pipelined
    )
    rows = out_full.new_zeros(C * t, hl * d).index_copy(0, order, out_full.reshape(S, hl * d))
    if C > 1:
        back = EqualAllToAll.apply(
            rows.reshape(C, t, hl * d).transpose(0, 1),
            groups.cp_group(),
            runtime.counter,
            "ulysses.out",
        )
    else:
        back = rows
    # [C*t, hl*d] (block i: head slice i of my tokens) -> [t, h*d]
    return back.reshape(C, t, hl, d).permute(1, 0, 2, 3).reshape(t, h * d)


def _per_document_cp(query, key, value, L, mine, groups, counter, kernel, scale):
    t, h, d = query.shape
    C = groups.cp
    if C > 1:
        kv = AllGatherRS.apply(torch.cat([key, value], dim=1), groups.cp_group(), counter, "wlb.kv")
    else:
        kv = torch.cat([key, value], dim=1)
    order = torch.as_tensor(thd.gather_order(L, C))
    kv_full = kv.index_select(0, order)
    hkv = key.shape[1]
    k_full, v_full = kv_full[:, :hkv], kv_full[:, hkv:]
    g = h // hkv
    out = query.new_zeros(t, h, d)
    starts = np.concatenate([[0], np.cumsum(L)[:-1]]).astype(np.int64)
    pad = thd.padded_lengths(L, C)
    slot = 0
    for s0, l, lp in zip(starts, L, pad):
        ch = int(lp) // (2 * C)
        for k in (groups.c, 2 * C - 1 - groups.c):
            a, b = min(l, k * ch), min(l, (k + 1) * ch)
            if b > a:
                q_t = query[slot + (a - k * ch) : slot + (b - k * ch)]
                kk = k_full[s0 : s0 + b].repeat_interleave(g, dim=1)
                vv = v_full[s0 : s0 + b].repeat_interleave(g, dim=1)
                o, _ = kernel(q_t, kk, vv, scale)
                out = out.index_copy(0, torch.arange(slot, slot + (b - a)), o)
            slot += ch
    return out.reshape(t, h * d)


class LibraCoreAttention(torch.nn.Module):
    """Drop-in `core_attention` for Megatron-Core layer specs (THD / packed sequences).

    Constructor keywords follow Megatron-Core's (config, layer_number, attn_mask_type,
    attention_type, cp_comm_type, softmax_scale, pg_collection) plus `system` and `runtime`
    (pass them through the ModuleSpec's params). The current micro-batch's plan and slot arrive
    as `packed_seq_params.libra` (an AttentionStep) and its documents as
    `packed_seq_params.libra_doc_lengths`.
    """

    def __init__(
        self,
        config=None,
        layer_number: int = 1,
        attn_mask_type=None,
        attention_type: str = "self",
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection=None,
        *,
        system: str = "libra",
        runtime: Runtime | None = None,
    ):
        super().__init__()
        if system not in SYSTEMS:
            raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
        self.config, self.layer_number, self.attn_mask_type = config, layer_number, attn_mask_type
        self.attention_type, self.cp_comm_type = attention_type, cp_comm_type
        self.softmax_scale, self.system, self.runtime = softmax_scale, system, runtime

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        *,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by LibraCoreAttention")
        if (
            packed_seq_params is None
            or getattr(packed_seq_params, "libra_doc_lengths", None) is None
        ):
            raise ValueError(
                "LibraCoreAttention needs THD inputs: packed_seq_params with "
                "libra_doc_lengths (and libra for the plan)"
            )
        squeeze = query.dim() == 4  # [t, 1, h, d] (sbhd with b = 1) or [t, h, d]
        if squeeze:
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        out = core_attention(
            query,
            key,
            value,
            packed_seq_params.libra_doc_lengths,
            self.system,
            self.runtime,
            getattr(packed_seq_params, "libra", None),
            self.softmax_scale,
        )
        return out.unsqueeze(1) if squeeze else out
