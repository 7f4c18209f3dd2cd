"""Per-rank THD micro-batches of a packed sequence: tokens, labels, loss mask, position ids,
cu_seqlens and PackedSeqParams carrying the step plan, in Megatron's per-document zigzag CP
layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libra_ext.attention import thd
from libra_ext.attention.core import AttentionStep

try:
    from megatron.core.packed_seq_params import PackedSeqParams
except ImportError:  # pragma: no cover - megatron-core is a dependency of the training app
    PackedSeqParams = None


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [1, t]
    labels: torch.Tensor  # [1, t]
    loss_mask: torch.Tensor  # [1, t]
    position_ids: torch.Tensor  # [1, t]
    packed_seq_params: object
    num_tokens: int  # tokens that count in the loss on this rank


def make_micro_batch(pieces: list, cp: int, cp_rank: int, step: AttentionStep | None) -> MicroBatch:
    """One cp rank's share of a packed sequence made of `pieces` (data.Piece: tokens, labels and
    loss mask of each document, in order).

    A sequence without documents (WLB-LLM's repacking can leave one empty when it holds
    outliers back) becomes one padding document of 2*cp tokens with no loss, so the model runs
    and every collective of the step still lines up; it adds nothing to the loss."""
    if sum(len(p.tokens) for p in pieces) == 0:
        from megatron.libra.data import Piece

        pad = np.zeros(2 * cp, dtype=np.int64)
        pieces = [Piece(pad, pad, np.zeros(2 * cp, dtype=np.float32))]
    lengths = [len(p.tokens) for p in pieces]
    z = thd.zigzag_split(lengths, cp, cp_rank)
    inputs = np.concatenate([p.tokens for p in pieces]) if pieces else np.zeros(0, dtype=np.int64)
    targets = np.concatenate([p.labels for p in pieces]) if pieces else np.zeros(0, dtype=np.int64)
    weights = np.concatenate([p.mask for p in pieces]) if pieces else np.zeros(0, dtype=np.float32)
    real = z.token_index >= 0
    idx = np.where(real, z.token_index, 0)
    cu_padded_global = np.concatenate([[0], np.cumsum(thd.padded_lengths(lengths, cp))])
    # Megatron's meaning: cu_seqlens_* the documents' real lengths, *_padded the lengths padded
    # to multiples of 2 * cp that the zigzag CP layout (and RoPE's per-document split) uses
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    cu_padded = torch.tensor(cu_padded_global, dtype=torch.int32)
    longest = int(max(np.diff(cu_padded_global), default=1))
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    psp.libra = step
    psp.libra_doc_lengths = lengths
    mask = np.where(real, weights[idx], 0.0).astype(np.float32)
    return MicroBatch(
        tokens=torch.as_tensor(np.where(real, inputs[idx], 0).astype(np.int64))[None],
        labels=torch.as_tensor(np.where(real, targets[idx], 0).astype(np.int64))[None],
        loss_mask=torch.as_tensor(mask)[None],
        position_ids=torch.as_tensor(z.position_ids)[None],
        packed_seq_params=psp,
        num_tokens=int(mask.sum()),
    )
