"""THD layout helpers: Megatron's per-document zigzag split of a packed sequence over C
context-parallel ranks (each document padded to a multiple of 2C, rank c holds chunks c and
2C-1-c), written without Transformer Engine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RankTHD:
    """One cp rank's share of a packed sequence."""

    token_index: np.ndarray
    """[t_local] position in the packed sequence of each local slot, -1 for padding."""
    position_ids: np.ndarray
    """[t_local] position inside its document (RoPE positions)."""
    cu_seqlens: np.ndarray
    """[n_doc + 1] cumulative real tokens per document on this rank."""
    cu_seqlens_padded: np.ndarray
    """[n_doc + 1] cumulative local slots per document on this rank (padded)."""


def padded_lengths(doc_lengths, cp: int) -> np.ndarray:
    """Each document's length rounded up to a multiple of 2C."""
    L = np.asarray(doc_lengths, dtype=np.int64)
    return -(-L // (2 * cp)) * (2 * cp)


def zigzag_split(doc_lengths, cp: int, rank: int) -> RankTHD:
    """Rank `rank`'s slots: for every document, chunk `rank` then chunk 2C-1-rank."""
    if cp <= 0 or not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, cp={cp}), got {rank}")
    L = np.asarray(doc_lengths, dtype=np.int64)
    if (L <= 0).any():
        raise ValueError(f"doc_lengths[{int(np.argmax(L <= 0))}] must be positive")
    Lp = padded_lengths(L, cp)
    chunk = Lp // (2 * cp)
    starts = np.concatenate([[0], np.cumsum(L)[:-1]]) if len(L) else np.zeros(0, dtype=np.int64)
    idx, pos, cu, cu_pad = [], [], [0], [0]
    for s, l, ch in zip(starts, L, chunk):
        real = 0
        for k in (rank, 2 * cp - 1 - rank):
            p = np.arange(k * ch, (k + 1) * ch)
            pos.append(p)
            idx.append(np.where(p < l, s + p, -1))
            real += int(np.clip(l - k * ch, 0, ch))
        cu.append(cu[-1] + real)
        cu_pad.append(cu_pad[-1] + 2 * int(ch))
    cat = (
        (lambda xs: np.concatenate(xs).astype(np.int64))
        if idx
        else (lambda xs: np.zeros(0, dtype=np.int64))
    )
    return RankTHD(
        cat(idx), cat(pos), np.asarray(cu, dtype=np.int64), np.asarray(cu_pad, dtype=np.int64)
    )


def gather_order(doc_lengths, cp: int) -> np.ndarray:
    """For the rank-major concatenation of all cp ranks' slots (what a Ulysses all-to-all
    delivers), the slot holding each packed-sequence position, in position order."""
    parts = [zigzag_split(doc_lengths, cp, r).token_index for r in range(cp)]
    allslots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n = int(np.sum(doc_lengths))
    order = np.full(n, -1, dtype=np.int64)
    real = allslots >= 0
    order[allslots[real]] = np.flatnonzero(real)
    return order
