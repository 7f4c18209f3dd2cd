"""Fused row gathers and scatters (`libra_ext.attention.rowops`): the torch path, the Triton
kernel under Triton's CPU interpreter, the errors, and what a probe counts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from libra_ext.attention import counters, rowops
from libra_ext.measure import traffic

ROOT = Path(__file__).resolve().parents[2]


def _parts(dtype, seed=0, d=40):
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(n, d, generator=g).to(dtype) for n in (50, 30, 7)]
    idxs = [torch.randint(0, 50, (40,), generator=g, dtype=torch.int32),
            torch.randint(0, 30, (13,), generator=g),  # int64 beside int32
            torch.zeros(0, dtype=torch.int32)]
    return srcs, idxs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gather_of_several_parts_is_each_parts_index_select(dtype):
    srcs, idxs = _parts(dtype)
    buf, views = rowops.gather(srcs, idxs)
    assert buf.shape == (53, 40) and [v.shape[0] for v in views] == [40, 13, 0]
    for v, s, i in zip(views, srcs, idxs):
        assert torch.equal(v, s.index_select(0, i))
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scatter_writes_and_adds_as_index_put_and_index_add_do(dtype):
    g = torch.Generator().manual_seed(1)
    dq, dk = torch.zeros(60, 8, dtype=dtype), torch.randn(30, 8, generator=g).to(dtype)
    iq = torch.randperm(60, generator=g)[:25].to(torch.int32)  # written: each row once
    ik = torch.randint(0, 30, (40,), generator=g, dtype=torch.int32)  # added: rows repeat
    sq, sk = torch.randn(25, 8, generator=g).to(dtype), torch.randn(40, 8, generator=g).to(dtype)
    want_q, want_k = dq.clone(), dk.clone()
    want_q.index_put_((iq,), sq)
    want_k.index_add_(0, ik, sk)
    rowops.scatter([dq, dk, dk], [iq, ik, ik[:0]], [sq, sk, sk[:0]], [False, True, True])
    assert torch.equal(dq, want_q) and torch.equal(dk, want_k)


def _returned(n: int, rows: int, d: int, dtype, seed: int):
    """K/V gradients returned for `n` sends of `rows` distinct vectors (some sent to several
    executors): (sources, destination of each, its distinct destinations, the sends grouped by
    them in send order, the groups' offsets)."""
    g = torch.Generator().manual_seed(seed)
    dest = torch.randint(0, rows, (n,), generator=g)
    srt, order = torch.sort(dest, stable=True)
    uniq = torch.unique(srt)
    offs = torch.searchsorted(srt, torch.cat([uniq, uniq.new_tensor([rows])]))
    src = torch.randn(n, d, generator=g).to(dtype)
    return src, dest, uniq, order.to(torch.int32), offs.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_sum_adds_each_vector_s_returns_in_send_order_rounded_once(dtype):
    src, dest, uniq, order, offs = _returned(57, 20, 8, dtype, seed=3)
    u = len(uniq)
    acc = torch.promote_types(dtype, torch.float32)
    want = torch.empty(u, 8, dtype=dtype)
    for j, r in enumerate(uniq):
        s = torch.zeros(8, dtype=acc)
        for x in src[dest == r]:  # in send order
            s += x.to(acc)
        want[j] = s.to(dtype)
    out = torch.full((u, 8), float("nan"), dtype=dtype)  # every row written: no fill needed
    rowops.sum_into([out], [None], [src], [order], [offs], [False])
    assert torch.equal(out, want)
    # the sums added at the distinct rows afterwards (the early order) or straight away (the
    # late one): the same bits
    dk = torch.randn(20, 8, dtype=torch.float64).to(dtype)
    late = dk.clone()
    rowops.sum_into([dk], [uniq.to(torch.int32)], [out], [None], [None], [True])
    rowops.sum_into([late], [uniq], [src], [order], [offs], [True])
    assert torch.equal(dk, late)


def test_a_sum_moves_rows_between_buffers_at_one_index_and_writes_others_where_told():
    g = torch.Generator().manual_seed(4)
    dq, do = torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g)
    rest, at = torch.randn(5, 8, generator=g), torch.tensor([3, 9, 20, 21, 33])
    same = torch.tensor([0, 1, 2, 30, 31], dtype=torch.int32)
    want = dq.clone()
    want[same.long()] = do[same.long()]
    want[at] = rest
    rowops.sum_into([dq, dq], [same, at], [do, rest], [same, None], [None, None],
                    [False, False])
    assert torch.equal(dq, want)
    with traffic.TrafficProbe("cpu") as probe:  # one op: the rows read and written
        probe.start("sum")
        rowops.sum_into([dq, dq], [same, at], [do, rest], [same, None], [None, None],
                        [False, False])
        probe.start("done")
    ph, row = probe.phases["sum"], 8 * 4
    assert ph.ops == 1 and ph.bytes == 2 * 10 * row + 2 * 5 * 4 + 5 * 8


def test_bad_parts_are_refused_naming_the_part():
    x, i = torch.zeros(4, 8), torch.zeros(2, dtype=torch.int32)
    cases = [
        (lambda: rowops.gather_rows_([torch.zeros(2, 8)], [x.double()], [i]), "part 0 has dtype"),
        (lambda: rowops.gather_rows_([torch.zeros(2, 8), torch.zeros(2, 4)], [x, x], [i, i]),
         "part 1 must be two [rows, d] tensors"),
        (lambda: rowops.gather_rows_([torch.zeros(3, 8)], [x], [i]), "part 0 has 3 rows out"),
        (lambda: rowops.gather_rows_([torch.zeros(2, 8)], [x], [i.float()]),
         "part 0's index must be 1-D int32 / int64"),
        (lambda: rowops.scatter_rows_([x], [i], [torch.zeros(3, 8)], [True]),
         "part 0 has 3 source rows"),
        (lambda: rowops.scatter_rows_([x], [i], [torch.zeros(2, 8)], [True, False]),
         "2 add flags for 1 parts"),
        (lambda: rowops.gather_rows_([x] * 7, [x] * 7, [i] * 7), "1 to 6 parts"),
        (lambda: rowops.sum_rows_([x], [i], [x], [i], [i], [False]),
         "part 0 has 2 rows and 2 offsets"),
        (lambda: rowops.sum_rows_([x], [i[:0]], [x], [i[:0]], [i], [False]),
         "part 0 has offsets but no source index"),
        (lambda: rowops.sum_rows_([x], [i.float()], [x], [i], [i[:0]], [False]),
         "part 0's row index must be 1-D int32 / int64"),
        (lambda: rowops.sum_rows_([x], [i[:0]], [torch.zeros(2, 8)], [i[:0]], [i[:0]],
                                  [False]), "part 0 has no row index, offsets or source"),
        (lambda: rowops.sum_rows_([torch.zeros(1, 8)], [i[:0]], [x], [i], [i[:0]], [False]),
         "part 0 writes 2 rows into 1"),
        (lambda: rowops.sum_rows_([x], [i], [x], [i], [i[:0]], [False, True]),
         "1 row indices, 1 offsets and 2 add flags for 1 parts"),
        (lambda: rowops.sum_into([x], [None], [x], [None], [None], [False]),
         "part 0 has no row index, offsets or source index"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            call()


def test_a_probe_counts_a_fused_call_as_one_op_with_its_parts_bytes():
    srcs, idxs = _parts(torch.float32)
    d = torch.zeros(50, 40)
    with traffic.TrafficProbe("cpu") as probe:
        probe.start("gather")
        buf, _ = rowops.gather(srcs, idxs)
        probe.start("scatter")
        rowops.scatter([d, d], idxs[:1] * 2, [buf[:40], buf[:40]], [False, True])
        probe.start("done")
    g, s = probe.phases["gather"], probe.phases["scatter"]
    row, i4, i8 = 40 * 4, 4, 8
    assert g.ops == 1 and g.bytes == 2 * 53 * row + 40 * i4 + 13 * i8
    # a written row: its source read and the row written; an added one also read first
    assert s.ops == 1 and s.bytes == 2 * 40 * row + 3 * 40 * row + 2 * 40 * i4


def test_a_probe_hears_storage_freed_and_grown_back_on_any_thread():
    # the operator frees a storage in its forward and grows it back in its backward, which
    # autograd runs on a thread of its own for a device: the probe hears both, wherever they run
    with traffic.TrafficProbe("cpu") as probe:
        probe.start("fwd")
        x = torch.zeros(1024)  # 4 KiB, live
        counters.resize_storage(x, 0)
        probe.start("bwd")
        grow = threading.Thread(target=counters.resize_storage, args=(x, 4096))
        grow.start()
        grow.join()
        probe.start("done")
    assert probe.phases["fwd"].end_live == probe.phases["fwd"].start_live
    assert probe.phases["bwd"].peak_live == probe.phases["bwd"].start_live + 4096


def test_deterministic_algorithms_keep_additions_off_the_atomic_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the decision only: nothing is launched)
    monkeypatch.setattr(rowops, "have_triton", lambda: True)
    x = torch.zeros(1)
    assert rowops._use_triton(x) and rowops._use_triton(x, adds=True)
    torch.use_deterministic_algorithms(True)
    try:
        assert rowops._use_triton(x) and not rowops._use_triton(x, adds=True)
    finally:
        torch.use_deterministic_algorithms(False)


_INTERPRETED = textwrap.dedent("""
    import torch
    from libra_ext.attention import rowops
    assert rowops._use_triton(torch.zeros(1))
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        srcs = [torch.randn(n, 100, generator=g).to(dtype) for n in (70, 20, 5, 9)]
        idxs = [torch.randint(0, len(s), (m,), generator=g, dtype=torch.int32)
                for s, m in zip(srcs, (37, 18, 0, 40))]
        idxs[1] = idxs[1].long()
        _, views = rowops.gather(srcs, idxs)
        for v, s, i in zip(views, srcs, idxs):
            assert torch.equal(v, s.index_select(0, i)), dtype
        dst = torch.zeros(70, 100, dtype=dtype)
        rows = torch.randperm(70, generator=g)[:33].to(torch.int32)
        src = torch.randn(33, 100, generator=g).to(dtype)
        want = dst.clone()
        want.index_put_((rows,), src)
        rowops.scatter([dst], [rows], [src], [False])
        assert torch.equal(dst, want), dtype
    # additions with repeated rows (Triton's interpreter adds atomically in fp32 only; a GPU
    # adds bf16 too)
    dk = torch.randn(20, 100, generator=g)
    ik = torch.randint(0, 20, (64,), generator=g, dtype=torch.int32)
    sk = torch.randn(64, 100, generator=g)
    want = dk.clone()
    want.index_add_(0, ik, sk)
    rowops.scatter([dk, dk], [ik, ik[:0]], [sk, sk[:0]], [True, False])
    assert torch.allclose(dk, want, atol=1e-6), (dk - want).abs().max()
    # sums: each destination's returns in send order, written compact or added at distinct rows
    for dtype in (torch.float32, torch.bfloat16):
        dest = torch.randint(0, 20, (70,), generator=g)
        srt, order = torch.sort(dest, stable=True)
        uniq = torch.unique(srt)
        offs = torch.searchsorted(srt, torch.cat([uniq, uniq.new_tensor([20])])).int()
        srcs = [torch.randn(70, 100, generator=g).to(dtype) for _ in range(2)]
        outs = [torch.empty(len(uniq), 100, dtype=dtype) for _ in range(2)]
        rowops.sum_into(outs, [None, None], srcs, [order.int()] * 2, [offs] * 2, [False] * 2)
        for o, s in zip(outs, srcs):
            want = torch.zeros(len(uniq), 100).index_add_(
                0, torch.searchsorted(uniq, dest), s.float()).to(dtype)
            assert torch.allclose(o.float(), want.float(), rtol=1e-2, atol=1e-5), dtype
        dk = torch.randn(20, 100, generator=g).to(dtype)
        want = dk.float().index_add_(0, uniq, outs[0].float()).to(dtype)
        same = torch.tensor([1, 5, 6], dtype=torch.int32)
        dq, do = torch.randn(9, 100, generator=g).to(dtype), torch.randn(9, 100, generator=g).to(dtype)
        wq = dq.clone()
        wq[same.long()] = do[same.long()]
        rowops.sum_into([dk, dq], [uniq.int(), same], [outs[0], do], [None, same], [None, None],
                        [True, False])
        # (the interpreter rounds fp32 to bf16 its own way: one bf16 step apart at most)
        assert torch.allclose(dk.float(), want.float(), rtol=1e-2, atol=0), dtype
        assert torch.equal(dq, wq), dtype
    print("interpreted ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed in this environment (the CPU torch wheel)")
def test_the_triton_kernel_moves_the_rows_the_torch_path_moves():
    # the CUDA path's kernel, run by Triton's CPU interpreter (the variable is read when the
    # kernel is defined, so in a process of its own)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "interpreted ok" in r.stdout, r.stdout + r.stderr
