"""Cost model, packing, generators and lengths files (libra_ext.workload vs the C++ core)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from libra_ext import _planner as core
from libra_ext import workload as wl


@given(st.integers(0, 2**30))
def test_causal_pairs_matches_core(l):
    assert core.causal_pairs(l) == wl.causal_pairs(l) == l * (l + 1) // 2


@given(st.integers(0, 2**20), st.integers(0, 2**20))
def test_block_pairs_matches_core_and_sums(a, b):
    a, b = min(a, b), max(a, b)
    assert core.block_pairs(a, b) == wl.block_pairs(a, b)
    # rows [0, a) and [a, b) together are the causal pairs of the first b rows
    assert wl.block_pairs(0, a) + wl.block_pairs(a, b) == wl.causal_pairs(b)


def test_block_pairs_counts_rows_against_prefix():
    # rows 2, 3, 4 of a document see 3, 4 and 5 keys
    assert wl.block_pairs(2, 5) == 3 + 4 + 5


def test_linear_and_attention_flops():
    m = wl.ModelConfig(
        hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=2, moe_topk=0, moe_ffn=0
    )
    qkv_o = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64
    expected = 2 * qkv_o + 6 * 64 * 128
    assert wl.linear_fwd_flops_per_token(m) == expected
    assert core.linear_fwd_flops_per_token(m.to_core()) == expected
    moe = wl.ModelConfig(
        hidden=64, heads=4, kv_heads=2, head_dim=16, moe_topk=2, moe_ffn=32, shared_ffn=16
    )
    assert wl.linear_fwd_flops_per_token(moe) == 2 * qkv_o + 6 * 64 * (2 * 32 + 16)
    assert core.linear_fwd_flops_per_token(moe.to_core()) == wl.linear_fwd_flops_per_token(moe)
    assert wl.attn_fwd_flops(10, 4, 16) == core.attn_fwd_flops(10, 4, 16) == 4 * 16 * 4 * 10
    assert wl.ATTN_BWD_FACTOR == core.ATTN_BWD_FACTOR == 2.5


def test_model_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="model.kv_heads"):
        wl.ModelConfig(heads=32, kv_heads=5)
    with pytest.raises(ValueError, match="model.heads"):
        wl.ModelConfig(heads=0)
    with pytest.raises(ValueError, match="model.hidden"):
        wl.ModelConfig(hidden=2.5)


def test_production_packing_splits_at_boundary():
    seqs = wl.pack_production([5, 7, 3, 9], 8)
    assert [s.doc_lengths for s in seqs] == [[5, 3], [4, 3, 1], [8]]
    assert [s.cu_seqlens for s in seqs] == [[0, 5, 8], [0, 4, 7, 8], [0, 8]]
    assert [s.doc_lengths for s in wl.pack_production([5, 7, 3, 9], 8, max_sequences=2)] == [
        [5, 3],
        [4, 3, 1],
    ]


@given(st.lists(st.integers(1, 50), min_size=1, max_size=60), st.integers(1, 64))
def test_production_packing_keeps_every_token(lengths, S):
    seqs = wl.pack_production(lengths, S)
    assert sum(s.tokens for s in seqs) == sum(lengths)
    assert all(s.tokens == S for s in seqs[:-1]) and 0 < seqs[-1].tokens <= S


@given(st.lists(st.integers(1, 64), min_size=1, max_size=60), st.integers(64, 200))
def test_best_fit_packing(lengths, S):
    seqs = wl.pack_best_fit(lengths, S)
    assert sorted(l for s in seqs for l in s.doc_lengths) == sorted(lengths)
    assert all(s.tokens <= S for s in seqs)
    # best fit never leaves two sequences that could have been merged
    tokens = sorted(s.tokens for s in seqs)
    assert len(tokens) < 2 or tokens[0] + tokens[1] > S or len(seqs) == 1


def test_best_fit_rejects_document_longer_than_context():
    with pytest.raises(ValueError, match=r"lengths\[1\] = 20 is longer than context 10"):
        wl.pack_best_fit([3, 20], 10)


@pytest.mark.parametrize("bad, field", [([3, 0], r"lengths\[1\]"), ([-4], r"lengths\[0\]")])
def test_packing_rejects_non_positive_lengths(bad, field):
    with pytest.raises(ValueError, match=field):
        wl.pack_production(bad, 10)
    with pytest.raises(ValueError, match=field):
        wl.pack_best_fit(bad, 10)


def test_generators_are_deterministic_and_presets_match_published_median():
    for name in wl.preset_names():
        src = wl.LengthSource(preset=name)
        a, b = src.sample(200_000, 3), src.sample(200_000, 3)
        assert a == b and a != src.sample(200_000, 4)
        assert abs(np.median(a) - 644) <= 20  # published median 644 tokens
        # long documents go past the context (packing cuts them); the Pareto tail stops at 2^20
        assert max(a) <= 2**26 and min(a) >= 16
    p99 = np.percentile(wl.LengthSource(preset="libra-1m-v1").sample(400_000, 5), 99)
    assert 60_000 <= p99 <= 85_000  # published p99 about 71K for the 1M set (the v1 fit)


def test_fast_draw_lengths_equal_their_libm_definition():
    """The draws' lengths come from polynomial log / cos / exp and take libm only where x is
    within the polynomials' error bound of a rounding boundary: every length equals the one libm
    gives (every preset, a plain lognormal, a narrow one near a boundary, and a Pareto tail so
    heavy that its exponent leaves the polynomials' range), edge uniforms included."""
    dists = [core.preset(name) for name in wl.preset_names()]
    plain = core.LengthDist()
    plain.kind, plain.median, plain.sigma = "lognormal", 100.5, 1e-10  # x sits on 100.5
    heavy = core.preset("libra-256k")
    heavy.tail_alpha, heavy.tail_weight, heavy.cap = 0.04, 0.5, 1 << 20  # a^(-25): past e^700
    dists.append(core.LengthDist())
    for d in dists + [plain, heavy]:
        draws, mismatches, exact = core.check_fast_lengths(d, 17, 300_000)
        assert draws > 300_000 and mismatches == 0, (d.kind, d.median, mismatches)
        if d in dists:
            assert exact < draws // 1000  # libm for a few draws only
    # the narrow distribution straddles 100.5: its draws need libm to decide
    assert core.check_fast_lengths(plain, 3, 10_000)[2] > 1_000
    # the heavy tail's largest exponents go past the polynomials' range: libm decides those
    assert core.check_fast_lengths(heavy, 3, 100_000)[2] > 0
    with pytest.raises(ValueError, match="n must be in"):
        core.check_fast_lengths(plain, 0, -1)


def test_steps_are_a_shuffled_draw_of_the_packed_stream():
    # Megatron's GPTDataset serves packed samples through a shuffle index: a step is a slice of
    # a shuffled window of steps, a function of (seed, step) only, and with a window of 1 it is
    # the step's own production-packed stream
    src = wl.LengthSource(preset="libra-1m")
    steps = [src.step(4, 65536, seed=2, step=k) for k in range(16)]
    fresh = wl.LengthSource(preset="libra-1m")
    assert steps[9] == fresh.step(4, 65536, seed=2, step=9)  # no dependence on what came before
    lengths, offsets, order = wl._core.window_batch(src._dist, 4, 65536, 2, 1, wl.SAMPLE_SHUFFLE_WINDOW)
    window = wl.PackedBatch(*wl._core.gather_sequences(lengths, offsets, order))
    assert window.tolist() == [s for st in steps[8:16] for s in st]
    assert sorted(order.tolist()) == list(range(32))  # a permutation of the window's sequences
    plain = wl.LengthSource(preset="libra-1m", shuffle_window=1)
    assert plain.step(4, 65536, seed=2, step=3) == wl._core.step_sequences(
        src._dist, 4, 65536, 2, 3
    )
    assert all(sum(s) == 65536 for st in steps for s in st)
    with pytest.raises(ValueError, match="shuffle_window"):
        wl.LengthSource(preset="libra-1m", shuffle_window=0)


def test_a_source_reusing_its_window_buffers_serves_the_same_steps_as_a_fresh_window():
    # the window cache keeps one window and reuses its buffers for the next: going forward,
    # back, to other shapes and seeds, each step is still the function of (seed, step) that
    # step_sequences makes from scratch, on any number of threads
    src = wl.LengthSource(preset="libra-256k")
    dist, w = src._dist, src.shuffle_window
    visits = [(4, 65536, 3, 1), (4, 65536, 3, w + 2), (4, 65536, 3, 0), (8, 32768, 3, 5),
              (8, 32768, 9, 5), (4, 65536, 3, 1)]
    for gbs, context, seed, step in visits:
        for threads in (1, 2, 0):
            got = src.step(gbs, context, seed, step, threads=threads)
            assert got == wl._core.step_sequences(dist, gbs, context, seed, step, w, 1), (
                gbs, context, seed, step, threads)
    cache = wl._core.WindowCache(dist, w)
    with pytest.raises(ValueError, match="step must be >= 0"):
        cache.step(4, 65536, 3, -1)
    with pytest.raises(ValueError, match="gbs"):
        cache.step(0, 65536, 3, 0)
    # a failed window leaves nothing half-made: the next valid call serves the right step
    assert wl.PackedBatch(*cache.step(4, 65536, 3, 2)) == src.step(4, 65536, 3, 2)
    with pytest.raises(ValueError, match="shuffle_window"):
        wl._core.WindowCache(dist, 0)


def test_a_parallel_gather_copies_the_same_sequences():
    src = wl.LengthSource(preset="libra-1m", shuffle_window=1)
    b = src.step(64, 65536, seed=4, step=0)
    order = np.random.default_rng(0).permutation(len(b))
    want = [b[int(i)] for i in order]
    for threads in (1, 2, 3, 0):
        got = wl.PackedBatch(*wl._core.gather_sequences(b.lengths, b.offsets, order, threads))
        assert got.tolist() == want, threads
    with pytest.raises(ValueError, match=r"threads must be in \[0, 1024\]"):
        wl._core.gather_sequences(b.lengths, b.offsets, order, -1)


def test_a_lognormal_ignores_the_mixture_fields():
    # kind "lognormal" is the body alone, whatever a mixture's weights say (they are validated
    # for mixtures only): weights past 1 once sent every draw to the tail
    plain = wl._core.LengthDist()
    stray = wl._core.LengthDist()
    stray.tail_weight, stray.long_weight = 2.0, 5.0
    assert wl._core.sample_lengths(stray, 2000, 7) == wl._core.sample_lengths(plain, 2000, 7)


def test_step_sequences_fill_the_context():
    src = wl.LengthSource(preset="libra-256k")
    seqs = src.step(gbs=16, context=65536, seed=1, step=2)
    assert len(seqs) == 16 and all(sum(s) == 65536 for s in seqs)
    assert seqs == src.step(gbs=16, context=65536, seed=1, step=2)
    assert seqs != src.step(gbs=16, context=65536, seed=1, step=3)


def test_lengths_file(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# lengths\n100\n\n200  # two hundred\n300\n")
    assert wl.read_lengths_file(f) == [100, 200, 300]
    src = wl.LengthSource(lengths_file=str(f))
    assert set(src.sample(1000, 0)) == {100, 200, 300}
    assert src.default_context() is None and src.name == f"file:{f}"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty"),
        ("# only a comment\n", "is empty"),
        ("10\n2.5\n", "line 2: '2.5' is not a positive integer"),
        ("10\nabc\n", "line 2: 'abc' is not a positive integer"),
        ("0\n", "line 1: 0 is not in"),
        ("-3\n", "line 1: '-3' is not a positive integer"),
        # only plain ASCII decimal digits: no underscores, signs or other scripts' digits
        ("5\n1_000\n", "line 2: '1_000' is not a positive integer"),
        ("+7\n", "line 1: '\\+7' is not a positive integer"),
        ("4\n\u0663\n", "line 2: not ASCII text"),
    ],
)
def test_lengths_file_errors_name_the_line(tmp_path, text, message):
    f = tmp_path / "bad.txt"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        wl.read_lengths_file(f)


def test_binary_lengths_file_names_the_file_and_line(tmp_path):
    f = tmp_path / "lengths.bin"
    f.write_bytes(b"12\n\x00\xff\xfe\x89PNG")
    with pytest.raises(ValueError, match=rf"lengths file {f} line 2: not ASCII text"):
        wl.read_lengths_file(f)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_seeds_outside_64_bits_are_refused_by_name(seed):
    src = wl.LengthSource(preset="libra-256k")
    with pytest.raises(ValueError, match="seed must be"):
        src.step(2, 1024, seed, 0)
    with pytest.raises(ValueError, match="seed must be"):
        src.sample(3, seed)


def test_a_source_over_a_built_distribution_serves_steps_as_a_preset_does():
    preset = wl.LengthSource(preset="libra-1m")
    built = wl.LengthSource.from_dist(core.preset("libra-1m"), name="fit")
    for step in (0, 3, 9):
        assert built.step(8, 65536, 5, step) == preset.step(8, 65536, 5, step)
    assert built.name == "fit" and built.default_context() is None
    with pytest.raises(ValueError, match="shuffle_window"):
        wl.LengthSource.from_dist(core.preset("libra-1m"), shuffle_window=0)


# Digests of steps made before the step source was drawn in stages on several threads and
# packed in CSR form: the same documents, whatever the thread count.
PINNED_STEPS = {
    ("libra-256k", 16, 262_144, 0): "1e6ec1e908041e39",
    ("libra-256k", 16, 262_144, 9): "7c1c80c5a025cdda",
    ("libra-1m", 8, 1_048_576, 0): "cfa03cbaa4876fe5",
    ("libra-1m", 8, 1_048_576, 9): "925e220084835ad7",
    ("libra-256k-v1", 32, 65_536, 0): "c82392010a2a0e35",
    ("libra-256k-v1", 32, 65_536, 9): "6d085a945a85045c",
}


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_steps_are_the_pinned_streams_for_any_thread_count(threads):
    import hashlib
    import json

    for (preset, gbs, context, step), digest in PINNED_STEPS.items():
        seqs = wl.LengthSource(preset=preset).step(gbs, context, 0, step, threads=threads)
        got = hashlib.sha1(json.dumps(seqs.tolist()).encode()).hexdigest()[:16]
        assert got == digest, (preset, step)


def test_a_packed_batch_reads_like_lists_and_slices_without_copying():
    seqs = [[3, 4], [], [5], [1, 1, 1]]
    b = wl.PackedBatch.from_lists(seqs)
    assert len(b) == 4 and b == seqs and b.tolist() == seqs and list(b) == seqs
    assert b[2] == [5] and b[-1] == [1, 1, 1] and b.n_documents == 6
    assert b[1:3] == [[], [5]] and b[1:3].lengths.base is not None  # a view of b's lengths
    assert b.tokens().tolist() == [7, 0, 5, 3]
    assert wl.document_count(b) == wl.document_count(seqs) == 6
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        wl.PackedBatch([1, 2], [0, 2, 1])
    with pytest.raises(IndexError):
        b[4]


def test_gather_refuses_an_order_entry_outside_the_batch():
    b = wl.PackedBatch.from_lists([[1], [2, 3]])
    assert wl._core.gather_sequences(b.lengths, b.offsets, np.array([1, 0]))[0].tolist() == [2, 3, 1]
    with pytest.raises(ValueError, match=r"order\[1\] = 2 is not a sequence of the 2"):
        wl._core.gather_sequences(b.lengths, b.offsets, np.array([0, 2]))
