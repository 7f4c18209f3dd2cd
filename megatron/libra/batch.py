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


def document_tokens(doc_ids, doc_lengths, vocab: int, seed: int) -> np.ndarray:
    """Synthetic token ids of whole documents, a function of (seed, document id) only, so the
    same document has the same tokens wherever and whenever it is placed."""
    out = []
    for doc, length in zip(doc_ids, doc_lengths):
        rng = np.random.default_rng([seed, int(doc)])
        out.append(rng.integers(0, vocab, size=int(length) + 1))  # +1: the label of the last
    return out


def make_micro_batch(
    doc_tokens: list[np.ndarray], cp: int, cp_rank: int, step: AttentionStep | None
) -> MicroBatch:
    """One cp rank's share of a packed sequence whose documents carry `doc_tokens` (each one
    token longer than the document: labels are the next tokens inside a document)."""
    lengths = [len(t) - 1 for t in doc_tokens]
    z = thd.zigzag_split(lengths, cp, cp_rank)
    inputs = np.concatenate([t[:-1] for t in doc_tokens])
    targets = np.concatenate([t[1:] for t in doc_tokens])
    real = z.token_index >= 0
    idx = np.where(real, z.token_index, 0)
    cu_padded_global = np.concatenate([[0], np.cumsum(thd.padded_lengths(lengths, cp))])
    cu = torch.tensor(cu_padded_global, dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=int(max(np.diff(cu_padded_global), default=1)),
        max_seqlen_kv=int(max(np.diff(cu_padded_global), default=1)),
    )
    psp.libra = step
    psp.libra_doc_lengths = lengths
    return MicroBatch(
        tokens=torch.as_tensor(np.where(real, inputs[idx], 0))[None],
        labels=torch.as_tensor(np.where(real, targets[idx], 0))[None],
        loss_mask=torch.as_tensor(real, dtype=torch.float32)[None],
        position_ids=torch.as_tensor(z.position_ids)[None],
        packed_seq_params=psp,
        num_tokens=int(real.sum()),
    )
