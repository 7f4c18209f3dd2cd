"""The synthetic source (token ids follow the documented rule, as a plain loop computes it) and
micro-batches of empty sequences."""

import numpy as np

from megatron.libra.config import TrainConfig
from megatron.libra.sources import SyntheticSource


def _loop_tokens(seed: int, vocab: int, doc_id: int, length: int) -> np.ndarray:
    rng = np.random.default_rng([seed, doc_id])
    n = length + 1
    noise = rng.integers(0, vocab, size=n)
    keep = rng.random(n) < 0.8
    t = np.empty(n, dtype=np.int64)
    t[0] = noise[0]
    for i in range(1, n):
        t[i] = (7 * t[i - 1] + 3) % vocab if keep[i] else noise[i]
    return t


def test_tokens_follow_the_rule_and_depend_only_on_seed_and_document():
    for vocab in (256, 257, 151936):
        src = SyntheticSource(TrainConfig.load(None, [f"model.vocab={vocab}", "data.seed=5"]))
        for doc_id, length in ((0, 1), (3, 17), (12345, 700), (7, 3000), (8, 40)):
            want = _loop_tokens(5, vocab, doc_id, length)
            p = src.piece(doc_id, length)
            assert np.array_equal(p.tokens, want[:-1]) and np.array_equal(p.labels, want[1:])
            assert p.mask.sum() == length == src.label_count(doc_id, length)


def test_an_empty_sequence_becomes_one_padding_document_without_loss():
    from megatron.libra.batch import make_micro_batch

    for cp in (1, 2, 4):
        for rank in range(cp):
            # zigzag (wlb): Megatron's per-document padding, 2C tokens, two per rank
            mb = make_micro_batch([], cp, rank, None, "zigzag")
            assert mb.tokens.shape == (1, 2) and mb.num_tokens == 0
            assert float(mb.loss_mask.sum()) == 0.0
            assert mb.packed_seq_params.doc_lengths == [2 * cp]
            # contiguous (the Ulysses family): one slot per rank
            mb = make_micro_batch([], cp, rank, None, "contiguous")
            assert mb.tokens.shape == (1, 1) and mb.num_tokens == 0
            assert mb.packed_seq_params.doc_lengths == [cp]


def test_micro_batch_cu_seqlens_follow_megatron_real_and_padded():
    """cu_seqlens_q/kv hold the documents' real lengths (Megatron's meaning); the *_padded ones
    the lengths padded to multiples of 2 * cp that the zigzag layout and RoPE's split use
    (contiguous: the sequence's tail padding only)."""
    import numpy as np

    from megatron.libra.batch import make_micro_batch
    from megatron.libra.sources import Piece

    def piece(n):
        return Piece(np.arange(n), np.arange(n), np.ones(n, dtype=np.float32))

    mb = make_micro_batch([piece(5), piece(3)], 2, 0, None, "zigzag")
    psp = mb.packed_seq_params
    assert psp.cu_seqlens_q.tolist() == psp.cu_seqlens_kv.tolist() == [0, 5, 8]
    assert psp.cu_seqlens_q_padded.tolist() == psp.cu_seqlens_kv_padded.tolist() == [0, 8, 12]
    assert psp.doc_lengths == [5, 3] and mb.tokens.shape == (1, 6)
    # contiguous: no per-document padding; the sequence's tail padding (C t - n = 1 slot of
    # rank 1) counted in its last document
    for rank in (0, 1):
        mb = make_micro_batch([piece(4), piece(3)], 2, rank, None, "contiguous")
        psp = mb.packed_seq_params
        assert psp.cu_seqlens_q.tolist() == [0, 4, 7]
        assert psp.cu_seqlens_q_padded.tolist() == [0, 4, 8]
        assert mb.tokens.shape == (1, 4)
        assert mb.position_ids[0].tolist() == ([0, 1, 2, 3] if rank == 0 else [0, 1, 2, 0])
        assert float(mb.loss_mask.sum()) == (4.0 if rank == 0 else 3.0)
