"""What a micro-batch carries to Libra's core attention through Megatron-Core's layers: a
declared `PackedSeqParams` subclass with the step plan's program of the micro-batch's slot and
its documents on the host, so that nothing rides on Megatron's objects or on tensors as
undeclared attributes."""

from __future__ import annotations

from dataclasses import dataclass

try:
    from megatron.core.packed_seq_params import PackedSeqParams

    HAVE_MCORE = True
except ImportError:  # the operator runs without megatron-core (tests, tools): the same fields
    HAVE_MCORE = False

    @dataclass
    class PackedSeqParams:  # type: ignore[no-redef]
        """Megatron-Core's THD parameters (the fields the operator reads)."""

        qkv_format: str | None = None
        cu_seqlens_q: object = None
        cu_seqlens_kv: object = None
        cu_seqlens_q_padded: object = None
        cu_seqlens_kv_padded: object = None
        max_seqlen_q: int | None = None
        max_seqlen_kv: int | None = None


@dataclass
class AttentionStep:
    """What the operator needs about the current micro-batch: the step plan, the slot, and the
    slot's device program when it was prepared ahead (`Runtime.prepare`)."""

    plan: object
    """The StepPlan (None for a drop-in per-document CP call without a plan)."""
    slot: int
    program: object = None


@dataclass
class LibraPackedSeqParams(PackedSeqParams):
    """Megatron-Core's `PackedSeqParams` of a THD micro-batch, with Libra's fields."""

    libra: AttentionStep | None = None
    """The step plan's program of this micro-batch's slot (`Runtime.prepare`); None: the
    operator compiles per-document CP from the documents (system wlb only)."""
    doc_lengths: list | None = None
    """The micro-batch's document lengths on the host (what the operator and Megatron-LM's
    FLOPs count read instead of the device cu_seqlens)."""
