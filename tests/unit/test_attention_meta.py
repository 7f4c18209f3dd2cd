"""The per-step metadata (meta.py) checked in one process: a whole exchange group is run from
its members' programs with the all-to-alls done by hand, on random plans of every shape, and
every output must equal independent attention per document; message sizes must agree between
senders and receivers; the call count must not grow with tiles or documents."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from libra_ext.attention import kernels, meta, reference_kernel, thd
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import LengthSource, ModelConfig
from tests.strategies import layouts, step_inputs

D_HEAD = 4


def _member_inputs(plan, replica, slot, gen):
    """Random q, k, v of a member's sequence and the Ulysses buffer X they give (what the
    all-to-all delivers: every cp rank's slots, rank-major, this head slice)."""
    L = meta.sequence_lengths(plan, replica, slot).tolist()
    hl, kvl, C = plan.heads_local, plan.kv_heads_local, plan.cp
    S = sum(L)
    q = torch.randn(S, hl, D_HEAD, generator=gen, dtype=torch.float64)
    k = torch.randn(S, kvl, D_HEAD, generator=gen, dtype=torch.float64)
    v = torch.randn(S, kvl, D_HEAD, generator=gen, dtype=torch.float64)
    if L:
        ti = np.concatenate([thd.zigzag_split(L, C, r).token_index for r in range(C)])
    else:
        ti = np.zeros(0, dtype=np.int64)
    X = torch.zeros(len(ti), hl + 2 * kvl, D_HEAD, dtype=torch.float64)
    real = torch.as_tensor(ti >= 0)
    src = torch.as_tensor(np.where(ti >= 0, ti, 0))
    X[real] = torch.cat([q, k, v], dim=1)[src[real]]
    return L, q, k, v, X, ti


def _run_block(block, source, d):
    return [
        kernels.ReferenceBackend().attend(*call.views(source, d), call.seg, 0.5)
        for call in block.calls
    ]


def run_group(plan, replica, slot, chunks, seed=0):
    """Forward of every member of replica's exchange group, all-to-alls by hand. Returns
    {member: (doc lengths, q, k, v, out [S, hl, d] in position order, program)}."""
    px = plan.exchange_pool
    base = replica // px * px
    gen = torch.Generator().manual_seed(seed)
    progs, data = {}, {}
    for m in range(px):
        progs[m] = meta.upload(meta.compile_slot(plan, base + m, slot, chunks), "cpu")
        data[m] = _member_inputs(plan, base + m, slot, gen)
    d = D_HEAD
    n_ch = len(progs[0].chunks)
    for m in range(px):
        assert len(progs[m].chunks) == n_ch  # every member runs the same rounds
    xf = {m: data[m][4].reshape(-1, d) for m in range(px)}
    send = {m: xf[m][progs[m].send_idx] for m in range(px)}
    out_flat = {}
    for m, p in progs.items():
        out_flat[m] = torch.zeros(len(data[m][5]) * p.heads_local, d, dtype=torch.float64)
        if p.local is not None:
            pack = xf[m][p.local.gather]
            for call, o in zip(p.local.calls, _run_block(p.local, pack, d)):
                if p.local.out is None:  # already in output-buffer order
                    out_flat[m][call.out_off : call.out_off + call.n_out] = o.reshape(-1, d)
                else:
                    idx = p.local.out[call.out_off : call.out_off + call.n_out]
                    out_flat[m][idx] = o.reshape(-1, d)
    recv = {m: [] for m in range(px)}
    o_msgs = {m: [] for m in range(px)}  # per executor, per chunk: its O message
    for i in range(n_ch):
        for e in range(px):
            parts = []
            for o in range(px):
                c_o, c_e = progs[o].chunks[i], progs[e].chunks[i]
                assert c_o.qkv_send[e] == c_e.qkv_recv[o]  # sender and receiver agree
                assert c_o.o_recv[e] == c_e.o_send[o]
                start = c_o.send_off + sum(c_o.qkv_send[:e])
                parts.append(send[o][start : start + c_o.qkv_send[e]])
            recv[e].append(torch.cat(parts))
        for e in range(px):
            c = progs[e].chunks[i]
            all_recv = torch.cat(recv[e])
            if c.block is None:
                o_msgs[e].append(torch.zeros(0, d, dtype=torch.float64))
                continue
            outs = _run_block(c.block, all_recv[c.block.gather], d)
            msg = torch.zeros(c.n_o_send, d, dtype=torch.float64)
            for call, o in zip(c.block.calls, outs):
                if c.block.out is None:
                    msg[call.out_off : call.out_off + call.n_out] = o.reshape(-1, d)
                else:
                    msg[c.block.out[call.out_off : call.out_off + call.n_out]] = o.reshape(-1, d)
            o_msgs[e].append(msg)
    for m, p in progs.items():
        back = []
        for i, c in enumerate(p.chunks):
            for e in range(px):
                ce = progs[e].chunks[i]
                start = sum(ce.o_send[:m])
                back.append(o_msgs[e][i][start : start + ce.o_send[m]])
        if back:
            back = torch.cat(back)
            assert len(back) == len(p.o_out_idx)
            out_flat[m][p.o_out_idx] = back
    result = {}
    for m, p in progs.items():
        L, q, k, v, X, ti = data[m]
        order = thd.gather_order(L, plan.cp) if L else np.zeros(0, dtype=np.int64)
        out = out_flat[m].view(-1, p.heads_local, d)[torch.as_tensor(order)]
        result[m] = (L, q, k, v, out, p)
    return result


def _expected(L, q, k, v):
    outs, s = [], 0
    for l in L:
        o, _ = reference_kernel.reference_attention(q[s : s + l], k[s : s + l], v[s : s + l], 0.5)
        outs.append(o)
        s += l
    return torch.cat(outs) if outs else q


@pytest.mark.parametrize("system", ["libra", "distca", "ulysses"])
@given(data=st.data())
def test_every_member_gets_exact_attention_from_its_program(system, data):
    layout, model = data.draw(layouts(max_dp=4))
    seqs = data.draw(step_inputs(layout))
    opts = PlannerOptions(
        system=system,
        block=data.draw(st.sampled_from([None, 7, 64])),
        head_group=data.draw(st.sampled_from([0, 1, 3])),
        max_tile_share=data.draw(st.sampled_from([0.0, 0.1, 0.01])),
    )
    plan = Planner(layout, model, opts).plan(seqs, flush=True)
    chunks = data.draw(st.integers(1, 4))
    replica = data.draw(st.integers(0, layout.dp - 1))
    slot = data.draw(st.integers(0, plan.slots - 1))
    for m, (L, q, k, v, out, p) in run_group(plan, replica, slot, chunks).items():
        want = _expected(L, q, k, v)
        assert out.shape == want.shape
        if len(L):
            assert (out - want).abs().max() < 1e-10, (m, L)
        assert p.kernel_calls <= 2 * (1 + len(p.chunks))


def _scaled_preset_plan(preset_docs, system="libra", dp=4, pool=4, cp=2, context=4096, **kw):
    model = ModelConfig(
        hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    layout = LayoutConfig(dp=dp, cp=cp, pool_size=pool, context=context)
    return Planner(layout, model, PlannerOptions(system=system, **kw)).plan(preset_docs)


@pytest.mark.parametrize("workload", ["libra-256k", "many-short"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_calls_per_block_do_not_grow_with_tiles_or_documents(workload, chunks):
    context = 4096
    if workload == "many-short":
        rng = np.random.default_rng(0)
        seqs = []
        for _ in range(8):
            docs, room = [], context
            while room:
                docs.append(int(min(room, rng.integers(8, 120))))
                room -= docs[-1]
            seqs.append(docs)
    else:  # the preset's long-tail lengths, cut to the test context
        seqs = LengthSource(preset="libra-256k").step(8, context, seed=3, step=0)
    plan = _scaled_preset_plan(seqs, context=context, block=256)
    assert plan.n_tiles > 100
    assert max(len(s) for s in seqs) >= (40 if workload == "many-short" else 1)
    for replica in range(4):
        for slot in range(plan.slots):
            p = meta.compile_slot(plan, replica, slot, chunks)
            blocks = [p.local] + [c.block for c in p.chunks]
            active = [b for b in blocks if b is not None]
            assert all(len(b.calls) <= 2 for b in active)
            assert p.kernel_calls <= 2 * len(active)
            assert p.tiles_executed > len(active)  # many tiles, few calls


def test_chunks_balance_the_bytes_each_executor_receives():
    seqs = LengthSource(preset="libra-256k").step(8, 8192, seed=1, step=0)
    plan = _scaled_preset_plan(seqs, context=8192, block=256)
    sizes = []
    for replica in range(4):
        p = meta.compile_slot(plan, replica, 0, 4)
        recv = [c.n_recv for c in p.chunks]
        if sum(recv) and len(recv) == 4:
            sizes.append(max(recv) / (sum(recv) / len(recv)))
    assert sizes and max(sizes) < 2.0  # no chunk carries most of the bytes


def test_program_refuses_a_per_document_cp_plan_and_a_bad_slot():
    plan = _scaled_preset_plan([[100, 28]] * 4, system="wlb", context=128)
    with pytest.raises(ValueError, match="use compile_wlb"):
        meta.compile_slot(plan, 0, 0)
    plan = _scaled_preset_plan([[100, 28]] * 4, context=128)
    with pytest.raises(ValueError, match=r"\(replica, slot\) = \(0, 3\) outside"):
        meta.compile_slot(plan, 0, 3)
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        meta.compile_slot(plan, 0, 0, chunks=0)


def test_upload_is_one_host_to_device_copy_of_every_array():
    plan = _scaled_preset_plan(LengthSource(preset="libra-256k").step(4, 2048, 0, 0), context=2048)
    host = meta.compile_slot(plan, 1, 0, 2)
    dev = meta.upload(host, "cpu")
    assert isinstance(dev.send_idx, torch.Tensor) and isinstance(host.send_idx, np.ndarray)
    storages = {t.untyped_storage().data_ptr() for t in (dev.send_idx, dev.o_out_idx)}
    if dev.local is not None:
        storages.add(dev.local.gather.untyped_storage().data_ptr())
    assert len(storages) == 1  # views of one buffer
    for b in [dev.local] + [c.block for c in dev.chunks]:
        if b is not None:
            for call in b.calls:
                assert call.seg.cu_q.dtype == torch.int32
                assert call.seg.max_q == int(np.diff(call.seg.host_q).max())
