"""Single-process parts of the attention runtime: the reference kernel, the THD zigzag layout,
input validation, and the plan-hash check (two gloo ranks)."""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from libra_ext.attention import kernels, reference_kernel, thd
from libra_ext.attention.core import Runtime
from libra_ext.attention.kernels import KernelParams, select_backend, why_not
from libra_ext.attention.reference_kernel import reference_attention
from libra_ext.distributed import free_port, run_ranks, share_cores


def _naive(q, k, v, scale):
    """Row by row softmax attention, bottom-right causal, GQA by head // group."""
    n_q, hq, d = q.shape
    n_k, hk = k.shape[0], k.shape[1]
    out = torch.zeros_like(q)
    for h in range(hq):
        kh = h // (hq // hk)
        for i in range(n_q):
            keys = i + (n_k - n_q) + 1
            s = (k[:keys, kh] @ q[i, h]) * scale
            out[i, h] = torch.softmax(s, 0) @ v[:keys, kh]
    return out


@pytest.mark.parametrize(
    "n_q, n_k, hq, hk", [(5, 5, 2, 2), (3, 9, 4, 2), (1, 7, 4, 1), (6, 6, 3, 1)]
)
def test_reference_kernel_matches_naive(n_q, n_k, hq, hk):
    g = torch.Generator().manual_seed(n_q * 10 + n_k)
    q, k, v = (
        torch.randn(n, h, 8, generator=g, dtype=torch.float64)
        for n, h in ((n_q, hq), (n_k, hk), (n_k, hk))
    )
    out, lse = reference_attention(q, k, v, 0.3)
    assert torch.allclose(out, _naive(q, k, v, 0.3), atol=1e-12)
    assert lse.shape == (hq, n_q)


def test_reference_kernel_block_diagonal_documents():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = reference_attention(q, k, v, 0.5, doc_lengths=[3, 4])
    a, _ = reference_attention(q[:3], k[:3], v[:3], 0.5)
    b, _ = reference_attention(q[3:], k[3:], v[3:], 0.5)
    assert torch.allclose(out, torch.cat([a, b]), atol=1e-12)


@pytest.mark.parametrize("hq, hk", [(2, 2), (4, 2)])
def test_batched_reference_matches_per_segment_math(monkeypatch, hq, hk):
    """The reference backend's work decomposition (long segments by row pieces, short ones
    batched by length with causal row blocks) against each segment alone, forward and
    backward: query tiles shorter than their key prefix, empty and one-row segments, GQA."""
    monkeypatch.setattr(reference_kernel, "_PIECE_ELEMS", 600)  # some segments long, several batches
    rng = np.random.default_rng(3)
    ql = np.array([5, 1, 0, 17, 40, 3, 9, 9, 30, 2, 12, 1])
    kl = ql + np.array([0, 4, 3, 0, 10, 0, 2, 0, 0, 5, 0, 0])
    hq_off, hk_off = np.concatenate([[0], np.cumsum(ql)]), np.concatenate([[0], np.cumsum(kl)])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(int(hq_off[-1]), hq, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(int(hk_off[-1]), hk, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(int(hk_off[-1]), hk, 8, generator=g, dtype=torch.float64, requires_grad=True)
    seg = kernels.segments_on(hq_off, hk_off, "cpu")
    assert {type(w).__name__ for w in reference_kernel.work_items(seg, "cpu")} == {"_Rows", "_Batch"}
    out = kernels.ReferenceBackend().attend(q, k, v, seg, 0.4)
    dout = torch.as_tensor(rng.standard_normal(out.shape))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, want_grads = [], [torch.zeros_like(x) for x in (q, k, v)]
    for s in range(len(ql)):
        a, b, c, d = int(hq_off[s]), int(hq_off[s + 1]), int(hk_off[s]), int(hk_off[s + 1])
        if b == a:
            continue
        o, _ = reference_attention(q[a:b], k[c:d], v[c:d], 0.4)
        want.append(o)
        for acc, gr in zip(want_grads, torch.autograd.grad(o, (q, k, v), dout[a:b])):
            acc += gr
    assert torch.allclose(out, torch.cat(want), atol=1e-12)
    for got, ref in zip(grads, want_grads):
        assert torch.allclose(got, ref, atol=1e-10)


def test_one_off_segments_pass_max_seqlen_rounded_as_the_runtime_does():
    """Checks, replay, calibration and benchmarks call the kernels as the runtime's calls do:
    the longest segment rounded up to a power of two, at least 128 (or as given)."""
    seg = kernels.segments_on([0, 5, 305], [0, 0, 700], "cpu")
    assert (seg.max_q, seg.max_k) == (512, 1024)
    assert kernels.segments_on([0, 1], [0, 1], "cpu").max_q == kernels.MIN_MAX_SEQLEN
    assert kernels.segments_on([0, 256], [0, 256], "cpu").max_q == 256  # a power of two stays
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert kernels.Segments.from_host(cu, cu, [0, 3], [0, 3], max_q=3, max_k=3).max_q == 3


def test_local_tokens_of_every_sequence_match_the_zigzag_split():
    # the rows every EP rank pads its MoE tokens to come from these, one step ahead
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, 40, size=n).tolist() for n in (1, 5, 9)] + [[]]
    off = np.r_[0, np.cumsum([len(s) for s in seqs])]
    flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    for cp in (1, 2, 4):
        got = thd.local_tokens(flat, off, cp)
        want = [len(thd.zigzag_split(s, cp, 0).token_index) if s else 2 for s in seqs]
        assert got.tolist() == want, cp


def test_zigzag_split_layout():
    # 10 tokens, C = 2: padded to 12, chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2
    r0, r1 = thd.zigzag_split([10], 2, 0), thd.zigzag_split([10], 2, 1)
    assert r0.token_index.tolist() == [0, 1, 2, 9, -1, -1]
    assert r1.token_index.tolist() == [3, 4, 5, 6, 7, 8]
    assert r0.position_ids.tolist() == [0, 1, 2, 9, 10, 11]
    assert r0.cu_seqlens.tolist() == [0, 4] and r0.cu_seqlens_padded.tolist() == [0, 6]
    # every real token lands on exactly one rank; gather_order inverts the rank-major layout
    for docs, cp in (([1, 7, 3], 2), ([5], 4), ([16, 1], 4)):
        parts = [thd.zigzag_split(docs, cp, r).token_index for r in range(cp)]
        allidx = np.concatenate(parts)
        assert sorted(allidx[allidx >= 0].tolist()) == list(range(sum(docs)))
        order = thd.gather_order(docs, cp)
        assert (allidx[order] == np.arange(sum(docs))).all()
    with pytest.raises(ValueError, match="rank must be in"):
        thd.zigzag_split([4], 2, 2)
    with pytest.raises(ValueError, match=r"doc_lengths\[1\] must be positive"):
        thd.zigzag_split([4, 0], 2, 0)


def test_backend_ladder_says_why(caplog):
    select_backend.cache_clear()
    with caplog.at_level("INFO", logger="libra_ext.attention.kernels"):
        b = select_backend(KernelParams("cpu", torch.float32, 64))
    assert b.name == "reference"
    line = [r.message for r in caplog.records if r.levelname == "INFO"]
    assert len(line) == 1 and line[0].startswith("attention backend: reference (")
    for better in ("te: ", "flash: ", "varlen: "):
        assert better in line[0]  # every better backend is named with its reason
    # the choice is cached by its parameters: no second log line
    caplog.clear()
    assert select_backend(KernelParams("cpu", torch.float32, 64)) is b
    assert not caplog.records


def test_backend_choice_is_a_function_of_device_dtype_and_head_dim():
    cuda_bf16 = KernelParams("cuda", torch.bfloat16, 128)
    assert why_not("reference", cuda_bf16) is None
    assert "fp16/bf16" in why_not("varlen", KernelParams("cuda", torch.float32, 128))
    assert "needs CUDA" in why_not("varlen", KernelParams("cpu", torch.bfloat16, 128))
    assert "head_dim" in why_not("varlen", KernelParams("cuda", torch.bfloat16, 100))
    if not kernels.HAVE_FLASH:
        assert "pip install flash-attn" in why_not("flash", cuda_bf16)
    if not kernels.HAVE_TE:
        assert "transformer_engine" in why_not("te", cuda_bf16)


def test_forced_backend_that_cannot_run_names_the_package(monkeypatch):
    select_backend.cache_clear()
    with pytest.raises(RuntimeError, match="'flash' was forced but cannot run: flash-attn"):
        select_backend(KernelParams("cpu", torch.float32, 64, forced="flash"))
    with pytest.raises(ValueError, match="attention_backend must be auto or one of"):
        select_backend(KernelParams("cpu", torch.float32, 64, forced="ring"))
    monkeypatch.setenv("LIBRA_ATTENTION_BACKEND", "reference")
    assert select_backend(KernelParams("cpu", torch.float32, 32)).name == "reference"


def _bad_input_worker(rank, world, port, out_dir):
    share_cores(world)
    from libra_ext.attention.comm import GroupCache
    from libra_ext.attention.core import LibraCoreAttention, Runtime, check_plan_hash
    from libra_ext.attention.params import AttentionStep, LibraPackedSeqParams
    from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
    from libra_ext.workload import ModelConfig

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    groups = GroupCache(tp=1, cp=1, dp=2)
    model = ModelConfig(
        hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    layout = LayoutConfig(dp=2, cp=1, pool_size=2, context=64)
    seqs = [[40, 8], [16]] if rank == 0 else [[40, 8], [17]]  # rank 1 plans different data
    plan = Planner(layout, model, PlannerOptions()).plan(seqs)
    errors = []
    try:
        check_plan_hash(plan, timeout_s=30)
    except ValueError as e:
        errors.append(str(e))
    op = LibraCoreAttention(system="libra", runtime=Runtime(groups=groups))

    def Params():
        return LibraPackedSeqParams(libra=AttentionStep(plan, 0), doc_lengths=seqs[rank])

    n = len(thd.zigzag_split(seqs[rank], 1, 0).token_index)  # local slots
    try:
        op(
            torch.randn(n, 3, 8),
            torch.randn(n, 1, 8),
            torch.randn(n, 1, 8),
            packed_seq_params=Params(),
        )
    except ValueError as e:
        errors.append(str(e))
    q = torch.randn(n + 1, 4, 8)
    try:
        op(q, q[:, :2], q[:, :2], packed_seq_params=Params())
    except ValueError as e:
        errors.append(str(e))
    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as fh:
        fh.write("\n".join(errors))
    dist.destroy_process_group()


@pytest.mark.slow
def test_bad_inputs_fail_clearly_on_every_rank(tmp_path):
    run_ranks(_bad_input_worker, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        lines = (tmp_path / f"{rank}.txt").read_text().splitlines()
        assert lines[0].startswith("plan hash differs across ranks: rank 0 has")
        assert "ranks [1]" in lines[0]
        assert "mismatched head counts" in lines[1] or "multiple of key/value heads" in lines[1]
        assert lines[2].startswith("cu_seqlens do not match the tokens")


@pytest.mark.slow
def test_verify_cli_json(capsys):
    import json

    from megatron.libra.cli import main

    assert main(["verify", "attention", "--nproc", "2", "--system", "libra", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["bytes_sent"] == r["bytes_planned"] > 0
    assert r["max_abs_err_out"] <= 1e-5 and r["max_abs_err_grad"] <= 1e-5


@pytest.mark.slow
def test_verify_cli_failed_check_exits_nonzero_without_json(capsys):
    from megatron.libra.cli import main

    # a zero tolerance fails on float rounding alone: the table says FAIL and the exit status 1
    assert main(["verify", "attention", "--nproc", "2", "--system", "libra",
                 "--tolerance", "0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "ok: False" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "4", "--cp", "3"], "cp (3) must divide nproc (4)"),
        (["--nproc", "4", "--cp", "1", "--pool-size", "3"], "pool_size (P=3) must divide dp (D=4)"),
        (["--nproc", "0"], "nproc must be positive"),
    ],
)
def test_verify_cli_errors(capsys, argv, message):
    from megatron.libra.cli import main

    assert main(["verify", "attention", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_builds_from_a_megatron_module_spec():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from libra_ext.attention.core import LibraCoreAttention

    spec = ModuleSpec(module=LibraCoreAttention, params={"system": "ulysses", "runtime": None})
    op = build_module(
        spec,
        config=None,
        layer_number=3,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=0.1,
        pg_collection=None,
    )
    assert isinstance(op, LibraCoreAttention)
    assert (op.layer_number, op.system, op.softmax_scale) == (3, "ulysses", 0.1)
    with pytest.raises(ValueError, match="needs THD inputs"):
        op(torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), None)
    with pytest.raises(ValueError, match="system must be one of"):
        LibraCoreAttention(system="ring")


def test_core_attention_reads_megatrons_packed_seq_params_and_refuses_other_masks():
    """The documents come from Megatron's `cu_seqlens_q` when no host lengths are attached, and
    a mask type other than causal is refused."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from libra_ext.attention.comm import GroupCache
    from libra_ext.attention.core import LibraCoreAttention, Runtime
    from libra_ext.distributed import ensure_single_process_group

    ensure_single_process_group()
    runtime = Runtime(groups=GroupCache(tp=1, cp=1, dp=1))
    op = LibraCoreAttention(attn_mask_type=AttnMaskType.causal, system="wlb", runtime=runtime)
    docs = [6, 4]  # multiples of 2C: no padding slots
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6,
                          max_seqlen_kv=6)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(10, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    out = op(q, k, v, packed_seq_params=psp)
    want, _ = reference_attention(q, k, v, 8**-0.5, docs)
    assert torch.allclose(out.view(10, 4, 8), want, atol=1e-10)
    bad = LibraCoreAttention(attn_mask_type=AttnMaskType.no_mask, system="wlb", runtime=runtime)
    with pytest.raises(ValueError, match="attn_mask_type no_mask is not supported"):
        bad(q, k, v, packed_seq_params=psp)


def test_kernel_time_on_one_cpu_thread_is_the_threads_own_work():
    """With one intra-op thread (each of several local workers gets one), a kernel is timed by
    its thread's CPU time: time the thread spends off the core - another rank's work on a
    shared core, here a sleep - is not charged to it, while its own work is; with a thread pool
    it is wall time."""
    import time

    from libra_ext.attention.counters import KernelTimer

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        timer = KernelTimer()
        with timer():
            time.sleep(0.2)
        off_core = timer.seconds()
        timer.reset()
        x = torch.randn(256, 256)
        t0 = time.thread_time()
        with timer():
            while time.thread_time() - t0 < 0.05:
                x = x @ x.T / 256
        assert off_core < 0.02 and timer.seconds() >= 0.04
        torch.set_num_threads(2)  # a pool: its threads' work is not on this thread's clock
        timer.reset()
        with timer():
            time.sleep(0.2)
        assert timer.seconds() >= 0.2
    finally:
        torch.set_num_threads(before)


def test_a_runtime_refuses_an_unknown_attention_memory_setting():
    with pytest.raises(ValueError, match="memory must be one of keep, owner, rebuild, got 'kept'"):
        Runtime(groups=None, memory="kept")
