"""THD layouts of a packed sequence over C context-parallel ranks, written without Transformer
Engine. Everything is vectorized numpy (no loop over documents): these run once per step when a
rank's micro-batch and attention program are made.

- `contiguous` (ulysses, libra, distca): rank c holds positions [c*t, (c+1)*t) of the packed
  sequence, t = ceil(n / C) for its n tokens; the last rank's tail past n is padding. Ulysses'
  all-to-all then delivers every rank's tokens rank-major, which is the sequence in order: the
  documents arrive contiguous, with no per-document padding and no reorder.
- `zigzag` (wlb: per-document CP): Megatron's per-document split (each document padded to a
  multiple of 2C, rank c holds chunks c and 2C-1-c). With C = 1 both are the sequence as it is.

Shape legend (shared by the attention modules; `meta` gives the index-array details):
  S tokens of a packed sequence; C cp ranks; t = S / C (padded) tokens of one cp rank;
  h, h_kv query and KV heads of a rank (after tp); hl = h / C, kvl = max(1, h_kv / C) heads of
  its Ulysses slice; d head dim; W = hl + 2 kvl vectors per token of the Ulysses buffer
  X [C*t, W, d]; P pool members; n_q, n_k rows and hc, hk heads of one batched kernel call.
"""

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


def _lengths(doc_lengths) -> np.ndarray:
    L = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
    if (L <= 0).any():
        raise ValueError(f"doc_lengths[{int(np.argmax(L <= 0))}] must be positive")
    return L


LAYOUTS = ("contiguous", "zigzag")


def layout_of(system: str) -> str:
    """The THD layout a system's micro-batches use: per-document CP (wlb) needs Megatron's
    zigzag; the Ulysses family (ulysses, libra, distca) takes contiguous rank slices."""
    return "zigzag" if system == "wlb" else "contiguous"


def padded_lengths(doc_lengths, cp: int) -> np.ndarray:
    """Each document's length rounded up to a multiple of 2C (zigzag; as it is at C = 1)."""
    L = np.asarray(doc_lengths, dtype=np.int64)
    if cp == 1:
        return L.copy()
    return -(-L // (2 * cp)) * (2 * cp)


def contiguous_slots(n: int, cp: int) -> int:
    """t: the slots each cp rank holds of a contiguous n-token sequence (at least one)."""
    return max(1, -(-int(n) // cp))


def empty_sequence_tokens(cp: int, layout: str) -> int:
    """Tokens of the padding document a sequence without documents trains as (WLB-LLM's
    repacking can leave one empty): 2C (zigzag: Megatron's per-document padding) or C
    (contiguous: one slot per cp rank). It adds nothing to the loss."""
    return 2 * cp if layout == "zigzag" else cp


def local_tokens(doc_lengths, seq_doc_offsets, cp: int, layout: str = "zigzag") -> np.ndarray:
    """[n_seq] tokens one cp rank holds of each packed sequence (a sequence without documents
    runs as one padding document, `empty_sequence_tokens`)."""
    off = np.asarray(seq_doc_offsets, dtype=np.int64)
    if layout == "contiguous":
        tokens = np.r_[0, np.cumsum(np.asarray(doc_lengths, dtype=np.int64))]
        n = tokens[off[1:]] - tokens[off[:-1]]
        return np.maximum(1, -(-n // cp))
    padded = np.r_[0, np.cumsum(padded_lengths(doc_lengths, cp))]
    per = padded[off[1:]] - padded[off[:-1]]
    return np.where(per > 0, per, 2 * cp) // cp


def ranges(starts, lengths) -> np.ndarray:
    """Concatenation of arange(s, s + n) for every (s, n), vectorized."""
    n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    s = np.asarray(starts, dtype=np.int64).reshape(-1)
    total = int(n.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    excl = np.cumsum(n) - n
    return np.arange(total, dtype=np.int64) + np.repeat(s - excl, n)


def within(lengths) -> np.ndarray:
    """Concatenation of arange(n) for every n: each element's index inside its run."""
    n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    return ranges(np.zeros(len(n), dtype=np.int64), n)


def split(doc_lengths, cp: int, rank: int, layout: str) -> RankTHD:
    """Rank `rank`'s slots of the sequence in `layout` (contiguous or zigzag)."""
    if layout == "contiguous":
        return contiguous_split(doc_lengths, cp, rank)
    if layout == "zigzag":
        return zigzag_split(doc_lengths, cp, rank)
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def contiguous_split(doc_lengths, cp: int, rank: int) -> RankTHD:
    """Rank `rank`'s slots: positions [rank * t, (rank + 1) * t) of the sequence (padding past
    its n tokens on the last ranks: token index -1, position 0)."""
    if cp <= 0 or not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, cp={cp}), got {rank}")
    L = _lengths(doc_lengths)
    n = int(L.sum())
    t = contiguous_slots(n, cp)
    pos = rank * t + np.arange(t, dtype=np.int64)
    real = pos < n
    starts = np.cumsum(L) - L
    doc = np.searchsorted(np.cumsum(L), pos, side="right")
    within_doc = np.where(real, pos - starts[np.minimum(doc, len(L) - 1)], 0) if len(L) else pos
    # this rank's share of each document's tokens, for Megatron's cu_seqlens semantics
    lo, hi = rank * t, rank * t + t
    ends = starts + L
    share = np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None)
    cu = np.concatenate([[0], np.cumsum(share)]).astype(np.int64)
    return RankTHD(np.where(real, pos, -1).astype(np.int64), within_doc.astype(np.int64), cu,
                   cu.copy())


def zigzag_split(doc_lengths, cp: int, rank: int) -> RankTHD:
    """Rank `rank`'s slots: for every document, chunk `rank` then chunk 2C-1-rank."""
    if cp <= 0 or not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, cp={cp}), got {rank}")
    if cp == 1:  # one rank holds the sequence as it is
        return contiguous_split(doc_lengths, 1, 0)
    L = _lengths(doc_lengths)
    ch = padded_lengths(L, cp) // (2 * cp)  # [n_doc] chunk size
    starts = np.cumsum(L) - L
    # local slots of document j: [ch_j slots of chunk rank | ch_j slots of chunk 2C-1-rank]
    n_local = 2 * ch
    doc = np.repeat(np.arange(len(L)), n_local)
    k = within(n_local)  # slot inside the document
    second = k >= ch[doc]
    chunk = np.where(second, 2 * cp - 1 - rank, rank)
    pos = chunk * ch[doc] + np.where(second, k - ch[doc], k)
    idx = np.where(pos < L[doc], starts[doc] + pos, -1)
    real = np.clip(L[:, None] - np.stack([rank * ch, (2 * cp - 1 - rank) * ch], 1), 0, ch[:, None])
    cu = np.concatenate([[0], np.cumsum(real.sum(1))]).astype(np.int64)
    cu_pad = np.concatenate([[0], np.cumsum(n_local)]).astype(np.int64)
    return RankTHD(idx.astype(np.int64), pos.astype(np.int64), cu, cu_pad)


def gather_order(doc_lengths, cp: int) -> np.ndarray:
    """For the rank-major concatenation of all cp ranks' zigzag slots (what a gather over the
    CP group delivers), the slot holding each packed-sequence position, in position order."""
    L = _lengths(doc_lengths)
    if cp == 1:
        return np.arange(int(L.sum()), dtype=np.int64)
    ch = padded_lengths(L, cp) // (2 * cp)
    t = int(2 * ch.sum())  # local slots per rank (the same on every rank)
    doc = np.repeat(np.arange(len(L)), L)
    p = np.arange(int(L.sum()), dtype=np.int64) - np.repeat(np.cumsum(L) - L, L)
    k = p // ch[doc]  # chunk index in [0, 2C)
    rank = np.where(k < cp, k, 2 * cp - 1 - k)
    local_doc_start = np.cumsum(2 * ch) - 2 * ch  # slot of the document's first local slot
    slot = local_doc_start[doc] + np.where(k < cp, 0, ch[doc]) + p % ch[doc]
    return (rank * t + slot).astype(np.int64)
