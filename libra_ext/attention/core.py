"""The core-attention operator with Megatron-Core's contract, for every system.

Inputs are one cp rank's THD tensors in its system's layout (`thd.layout_of`): query [t, h, d],
key/value [t, h_kv, d] (h, h_kv already divided by tp). Output [t, h * d].

- `ulysses`: contiguous layout; all-to-all over heads inside the CP group, one batched kernel
  call over the whole packed sequence as it arrives (segments = documents), all-to-all back.
- `libra` / `distca`: the same all-to-all, then the step plan's tiles: one call over the
  received sequence itself for the rank's own work while the pool exchange moves the others'
  tiles in sub-chunks, one call per sub-chunk on what arrives (exchange.PlannedAttention).
- `wlb`: per-document CP in Megatron's zigzag layout: K and V all-gathered in the CP group, the
  rank's two chunks of every document in one batched call; dK/dV reduce-scattered back
  (exchange.per_doc_attention). At one cp rank it is the plain call of `ulysses`.

What a micro-batch needs of the plan is compiled ahead, once per step (`meta`), and copied to
the device in one transfer (`Runtime.prepare`); the operator then runs only device gathers,
collectives and kernel calls.

Shape legend (shared by the attention modules; `meta` gives the program's details):
  n tokens of a packed sequence; C cp ranks; t slots of one cp rank; h, h_kv query and KV heads
  of a rank (after tp); hl = h / C, kvl = max(1, h_kv / C) heads of its Ulysses slice; d head
  dim; S' = C t rows of the Ulysses buffers Xq [S', hl, d], Xk / Xv [S', kvl, d].
"""

from __future__ import annotations

import datetime
import logging
import math
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from libra_ext.attention import DEFAULT_CHUNKS, meta
from libra_ext.attention.comm import ByteCounter, GroupCache
from libra_ext.attention.counters import RuntimeStats
from libra_ext.attention.exchange import ExecEnv, per_doc_attention, planned_attention
from libra_ext.attention.kernels import backend_for
from libra_ext.attention.meta import WlbProgram
from libra_ext.attention.params import AttentionStep, LibraPackedSeqParams
from libra_ext.memory import check_attention_memory
from libra_ext.planner import SYSTEMS, StepPlan

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    """Per-process runtime state: process groups (created once), options, byte counters, call
    counters, and the current step's device programs."""

    groups: GroupCache
    chunks: int = DEFAULT_CHUNKS
    """Chunks of the pool exchange pipeline (fewer when little moves)."""
    pipelined: bool = True
    """Overlap the exchange with compute (False: every transfer completes before the next
    step; results are identical)."""
    backend: str | None = None
    """Force an attention kernel backend (kernels.BACKENDS); None: best available."""
    wait_timer: object = None
    """A context-manager factory timing the operator's waits for pool-exchange transfers
    (ExecEnv.wait_timer); None: not timed."""
    kernel_timer: object = None
    """A `counters.KernelTimer` timing this rank's kernel calls (ExecEnv.kernel_timer); None:
    not timed."""
    memory: str = "keep"
    """What a layer call keeps for backward (system.attention_memory, `ExecEnv.memory`): keep,
    owner (the moved units' copies freed, their O, Q, K, V shipped again by the owner) or
    rebuild (that, and ~0.8x Q/K/V less per layer at cp > 1 for one more all-to-all of O in the
    CP group: what a plain call keeps)."""
    counter: ByteCounter = field(default_factory=ByteCounter)
    stats: RuntimeStats = field(default_factory=RuntimeStats)
    _programs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_attention_memory(self.memory, "memory")

    def prepare(self, plan: StepPlan, device, host_programs: list | None = None,
                device_buffers: list | None = None) -> list:
        """AttentionSteps of every slot of this rank for `plan`, their programs on `device`
        (compiled now unless `host_programs` were built ahead; uploaded now unless
        `device_buffers` hold each slot's staged arrays on the device already)."""
        g = self.groups
        if host_programs is None:
            host_programs = meta.compile_rank(plan, g.r, g.c, self.chunks)
        device = torch.device(device)
        self._programs = {
            (plan.hash, slot, device): meta.upload(
                p, device, device_buffer=device_buffers[slot] if device_buffers else None)
            for slot, p in enumerate(host_programs)
        }
        return [
            AttentionStep(plan, slot, self._programs[(plan.hash, slot, device)])
            for slot in range(len(host_programs))
        ]

    def program(self, plan: StepPlan, slot: int, device):
        """The device program of (this rank, slot) of `plan` (prepared on first use)."""
        key = (plan.hash, slot, torch.device(device))
        if key not in self._programs:
            self.prepare(plan, device)
        return self._programs[key]


def check_plan_hash(plan: StepPlan, timeout_s: float = 60.0, group=None) -> None:
    """Compare the plan hash across the ranks of `group` (all ranks of a group made here); on a
    mismatch every rank raises, naming the (global) ranks that differ; a rank that never arrives turns into an error after the group's timeout
    (`timeout_s` for a group made here; pass GroupCache.check_group to reuse one), not a hang."""
    if group is None:
        group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s), backend="gloo")
    mine = torch.tensor([plan.hash & ((1 << 63) - 1), plan.hash >> 63], dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(out, mine, group=group)
    except RuntimeError as e:
        raise RuntimeError(
            f"plan hash check did not complete within {timeout_s:.0f} s ({str(e).splitlines()[0]})"
        ) from None
    hashes = [int(t[0]) | (int(t[1]) << 63) for t in out]
    ranks = dist.get_process_group_ranks(group)  # (global ranks, in group order)
    bad = [ranks[i] for i, h in enumerate(hashes) if h != hashes[0]]
    if bad:
        raise ValueError(
            f"plan hash differs across ranks: rank {ranks[0]} has {hashes[0]:016x}, ranks "
            f"{bad} have {[f'{hashes[ranks.index(r)]:016x}' for r in bad]}"
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
    layer=None,
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
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    env = ExecEnv(
        kernel=backend_for(query, runtime.backend),
        scale=scale,
        cp_group=groups.cp_group(),
        cp_rank=c,
        pool_group=None,
        counter=runtime.counter,
        stats=runtime.stats,
        pipelined=runtime.pipelined,
        key=layer,
        wait_timer=runtime.wait_timer,
        kernel_timer=runtime.kernel_timer,
        memory=runtime.memory,
    )
    if system == "wlb":
        if step is not None:
            prog = step.program or runtime.program(step.plan, step.slot, query.device)
        else:  # no plan: compile from the documents (a direct call; LibraCoreAttention
            # compiles once per micro-batch instead)
            if doc_lengths is None:
                raise ValueError("wlb without a step plan needs the documents (doc_lengths)")
            prog = meta.upload(meta.compile_wlb(doc_lengths, C, c, h, hkv, d), query.device)
        _check_slots(prog, t, c, r, step)
        if isinstance(prog, WlbProgram):
            return per_doc_attention(query, key, value, prog, env)
        return planned_attention(query, key, value, prog, env)  # one cp rank: plain
    if h % C:
        raise ValueError(f"query heads ({h}) must be divisible by cp ({C}) for {system}")
    hl = h // C
    kvl = max(1, hl // (h // hkv))
    if step is None:
        raise ValueError(f"{system} needs the step plan (packed_seq_params.libra)")
    plan = step.plan
    if plan.heads_local != hl or plan.kv_heads_local != kvl or plan.cp != C:
        raise ValueError(
            f"mismatched head counts: the plan has {plan.heads_local} query and "
            f"{plan.kv_heads_local} KV heads per rank over cp {plan.cp}, the tensors "
            f"give {hl} and {kvl} over cp {C}"
        )
    prog = step.program or runtime.program(plan, step.slot, query.device)
    _check_slots(prog, t, c, r, step)
    if prog.members > 1:
        env.pool_group = groups.pool_group(prog.members)
    return planned_attention(query, key, value, prog, env)


def _check_slots(prog, t: int, c: int, r: int, step) -> None:
    if prog.t != t:
        where = f" at replica {r}, slot {step.slot}" if step is not None else ""
        raise ValueError(
            f"cu_seqlens do not match the tokens: the plan's sequence{where} has "
            f"{prog.tokens} tokens, {prog.t} local slots on cp rank {c}; query has {t}"
        )


class LibraCoreAttention(torch.nn.Module):
    """Drop-in `core_attention` for Megatron-Core layer specs (THD / packed sequences).

    Constructor keywords follow Megatron-Core's (config, layer_number, attn_mask_type,
    attention_type, cp_comm_type, softmax_scale, pg_collection) plus `system` and `runtime`
    (pass them through the ModuleSpec's params). The current micro-batch arrives as a
    `LibraPackedSeqParams` (params.py): its `libra` (the step plan's AttentionStep of the
    micro-batch's slot, whose plan must be of this module's system) and its host `doc_lengths`.
    A plain Megatron `PackedSeqParams` serves per-document CP (system wlb) as a drop-in: the
    documents come from its `cu_seqlens_q`, read on the host once per micro-batch. Causal masks
    only (`causal`, `padding_causal`).
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
        if cp_comm_type not in (None, "a2a"):
            # the operator's context parallelism is Ulysses' all-to-all inside the CP group
            raise ValueError(
                f"cp_comm_type must be 'a2a' (or unset) for LibraCoreAttention, got "
                f"{cp_comm_type!r}: set TransformerConfig.cp_comm_type = 'a2a'"
            )
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
        mask = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        name = getattr(mask, "name", mask)
        if name is not None and name not in ("causal", "padding_causal"):
            raise ValueError(
                f"LibraCoreAttention computes causal attention per document; attn_mask_type "
                f"{name} is not supported"
            )
        if packed_seq_params is None:
            raise ValueError(
                "LibraCoreAttention needs THD inputs: packed_seq_params with cu_seqlens_q "
                "(a LibraPackedSeqParams with the step's AttentionStep, for the plan)"
            )
        ours = isinstance(packed_seq_params, LibraPackedSeqParams)
        step = packed_seq_params.libra if ours else None
        doc_lengths = packed_seq_params.doc_lengths if ours else None
        if step is None and self.system == "wlb":  # drop-in use without a step plan
            step = _drop_in_step(packed_seq_params, doc_lengths, self.runtime, query.device,
                                 (query.shape[-2], key.shape[-2], query.shape[-1]))
        elif step is not None and step.plan is not None and step.plan.system != self.system:
            raise ValueError(
                f"the micro-batch's step plan is a {step.plan.system} plan; this layer's core "
                f"attention was built for {self.system} (the layer spec's system and the "
                "planner's must agree)"
            )
        squeeze = query.dim() == 4  # [t, 1, h, d] (sbhd with b = 1) or [t, h, d]
        if squeeze:
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        out = core_attention(
            query,
            key,
            value,
            doc_lengths,
            self.system,
            self.runtime,
            step,
            self.softmax_scale,
            layer=self.layer_number,
        )
        return out.unsqueeze(1) if squeeze else out


_DROP_IN: dict = {}
"""id of a drop-in micro-batch's cu_seqlens_q -> (a weak reference to it, device, its
AttentionStep): the program made at its first layer's call, which every later layer and the
backward reuse. Keyed by identity; entries whose tensor is gone are dropped."""


def _drop_in_step(packed_seq_params, doc_lengths, runtime: Runtime, device,
                  heads: tuple) -> AttentionStep:
    """Per-document CP of a micro-batch that comes without a step plan (a caller of the operator
    outside the training app): its program is compiled and uploaded once per micro-batch - the
    first layer's call - and every later layer and the backward reuse it. The documents come
    from `doc_lengths` (host) or Megatron's `cu_seqlens_q`, read on the host once here (one
    sync per micro-batch when it is a device tensor; a LibraPackedSeqParams's doc_lengths
    avoid it)."""
    cu = getattr(packed_seq_params, "cu_seqlens_q", None)
    if cu is None and doc_lengths is None:
        raise ValueError(
            "LibraCoreAttention needs THD inputs: packed_seq_params.cu_seqlens_q (or a "
            "LibraPackedSeqParams's doc_lengths)"
        )
    cacheable = isinstance(cu, torch.Tensor)
    cached = _DROP_IN.get(id(cu)) if cacheable else None
    if cached is not None and cached[0]() is cu and cached[1] == torch.device(device):
        return cached[2]
    if doc_lengths is None:
        cu_host = np.asarray(cu.tolist() if hasattr(cu, "tolist") else list(cu), dtype=np.int64)
        doc_lengths = np.diff(cu_host)
    g = runtime.groups
    h, hkv, d = heads
    program = meta.upload(meta.compile_wlb(doc_lengths, g.cp, g.c, h, hkv, d), device)
    step = AttentionStep(None, 0, program)
    if cacheable:
        for key in [k for k, v in _DROP_IN.items() if v[0]() is None]:
            del _DROP_IN[key]
        _DROP_IN[id(cu)] = (weakref.ref(cu), torch.device(device), step)
    return step
