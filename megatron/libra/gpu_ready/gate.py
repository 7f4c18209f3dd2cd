"""The GPU-readiness gate's scenarios, run on fake CUDA (see `harness`).

Operator: for every system (libra, ulysses, wlb, distca) and every kernel entry point's
stand-in (TE DotProductAttention THD, flash-attn 2 and 3, PyTorch varlen_attn of 2.11 and
2.13), one layer call of `LibraCoreAttention` - forward and backward - on every rank of a
single-rank layout and of two multi-rank ones (cp 2 with pools of 2 and 8; each rank's program
against stand-in collectives), on a 256K-token sequence of 32 query / 4 KV heads of dimension
128 in bf16, as the training app calls it (the step's programs compiled and staged in pinned
memory by the sampler's thread, uploaded by `Runtime.prepare`); and per-document CP as a
drop-in operator without a plan (Megatron's cu_seqlens only), whose program must be made and
uploaded once per micro-batch, not per layer. Per rank and call it reports device ops forward
and backward (kernel launches), the stand-in kernel calls, host reads of device values,
blocking transfers, the step's uploads with their bytes and host compile time per slot, the
extra device bytes (`libra_ext.measure.traffic.op_bytes`: every device op but the attention
kernels and the collectives' transfers, read + written), the bytes kept for backward and the
peak, all over the layer's Q/K/V bytes (the same measured for one plain varlen call over the
whole sequence; the call's output is held, as by Megatron's linear_proj, through the forward
and released before the call's backward: `traffic.layer_call`); the modeled overhead over a
plain call at one rank on the presets' sequences; and per system how the device ops change
from 500 to 5000 documents per sequence (with few documents every pool message may be one
contiguous piece sent in place, and the exchange's fused gathers and scatters of the other
messages drop out: both counts are taken where documents are many). Training: one step of the
app's Trainer (megatron-core's GPTModel and schedule) per system at one rank, and the
MULTI_RANK scenarios (cp 2 per system; dp 2 / ep 2 with Libra's MoE balancer), each rank a
process.

Rebuild: the same layer call of libra, distca and ulysses at the exchanging layouts with
system.attention_memory = rebuild (through one stand-in), reported under "rebuild"; libra and
distca with owner, under "owner".

Bounds (each constant below says what was measured): no errors (a device mismatch, a stand-in
refusing its arguments), no host reads, no blocking transfers and no host-to-device copies
inside a call, one pinned non-blocking upload per slot per step; at one rank extra bytes, kept
and peak as a plain call's (EXTRA_BOUND_SINGLE, KEPT_BOUND, PEAK_BOUND) and the modeled overhead
(MODELED_OVERHEAD_BOUND); where ranks exchange, Ulysses's absolute bounds and its peers' against
Ulysses's (PEER_BOUND, OPS_BOUND, KEPT_PEER_EXTRA, PEAK_PEER_EXTRA), for every kernel; with
rebuild, kept and peak as at one rank for every system (EXTRA_BOUND_ULYSSES_REBUILD,
PEER_BOUND_REBUILD for the bytes that costs); at most
GROWTH_BOUND x the device ops from 500 to 5000 documents; in training steps, inherent host reads
and uploads only as ALLOWED_READS and ALLOWED_UPLOADS bound them. `run(...)` returns the report;
`check(report)` lists what fails.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings import rope_utils

from libra_ext.attention import kernels, thd
from libra_ext.attention.core import LibraCoreAttention, Runtime
from libra_ext.attention.meta import compile_rank, compile_slot, sequence_lengths, stage
from libra_ext.attention.params import LibraPackedSeqParams
from libra_ext.distributed import free_port
from libra_ext.measure import traffic
from libra_ext.planner import SYSTEMS, LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import ModelConfig
from megatron.libra import cpu_shims, rope
from megatron.libra.config import TrainConfig
from megatron.libra.gpu_ready import harness, standins
from megatron.libra.train import Trainer

EXTRA_BOUND_SINGLE = 1.5
"""Extra device bytes of a layer call (forward + backward, every device op but the attention
kernels and the collectives' own transfers, read + written) at one rank, at most this many
times its Q/K/V bytes: nothing needs to move there (measured: 0.01, a plain call's)."""
EXTRA_BOUND_ULYSSES = 8.0
"""The same for Ulysses where ranks exchange: one layout copy on one side of each all-to-all,
4 x (Q + K + V) + 4 x O (measured 7.21 at 32 / 4 heads)."""
PEER_BOUND = 1.25
"""Libra, DistCA and WLB-LLM where ranks exchange: extra device bytes at most this many times
Ulysses's at the same layout and kernel. Measured on the gate's sequences (one replica holds a
document of half the sequence, so most of its tiles move): 1.05 / 1.11 (libra, pool 2 / 8;
1.05 / 1.23 before the K/V gradients returned were summed per vector, 1.33 / 1.66 before the
exchange went in place, 1.70 / 1.93 before TAP's contiguous pieces), 1.04 / 1.11 (distca;
1.04 / 1.23, 1.20 / 1.66), 0.49 (wlb). A moved range that is one contiguous run of X is sent
from X and its O and dQ land in place; what a pool exchange still adds is the K/V gradients
returned - each read once and each distinct vector's sum added to dK / dV (read, read and
written: `rowops.sum_rows_`), a prefix sent to several executors adding once - and, for
ranges that are not contiguous, 8 x their Q and 2 x their K/V."""
OPS_BOUND = 2.0
"""Device ops of the forward and of the backward, each at most this many times Ulysses's at the
same layout and kernel (Ulysses: 8 / 9, its layout copies around the all-to-alls included:
O's and dO's are each this rank's own block copied in place and one copy per range of the
others' (`exchange.ROUNDS`)). Measured: libra 10 / 13-14 (13-15 / 19-21 before TAP's
contiguous pieces removed the local packs and the executors' packs), distca 9 / 11, wlb 5 / 6
at pool 2 and pool 8; with rebuild, libra 8 / 16-18 against Ulysses 6 / 12 (the early order
sums the K/V gradients returned before the direct call's backward: one op more). Each group of rows moved together (Q, K
and V out; dQ, dK and dV back; the packs' outputs) is one fused row op
(`libra_ext.attention.rowops`), so the count is a fixed number per exchange sub-chunk and kernel
call, whatever the documents, tiles and members. What remains above Ulysses's is the kernel
calls themselves (the direct call and each sub-chunk's call, and a pack's where a local run or
a received unit needs one: each a forward, a backward and the backward's zeroed softmax
gradient) and the row ops around them."""
KEPT_BOUND = 1.15
"""At one rank, bytes a layer call keeps for backward at most this many times a plain varlen
call's over the same kernel (measured: equal)."""
KEPT_BOUND_EXCHANGE = 1.9
"""Ulysses where ranks exchange: kept bytes at most this many times its Q/K/V (measured 1.81:
the all-to-all's receive, which the kernel keeps, and its output O before the all-to-all back;
a plain call's output is the layer's own). Dropping O needs a kernel backward that takes it
from the caller."""
KEPT_OWNER_EXTRA = 0.05
"""Libra and DistCA with system.attention_memory = owner (the "owner" scenarios): kept bytes at
most Ulysses's (keeping) + this many times Q/K/V (measured +0.01: the moved units' Q/K/V/O
are kept once, by their owner, and shipped again in the backward - 1.82 / 1.81 against
keeping's 2.37-2.68 / 1.98-2.14); extra device bytes and device ops as keeping (the messages
sent again go from X and O in place, into the executed calls' own memory); their peak as
keeping's (PEAK_PEER_EXTRA): in the backward the executed units' memory is alive again beside
X and O (which the messages sent again are read from), dO and dX (measured 4.39-4.83 /
3.84-4.07)."""
KEPT_PEER_EXTRA = 1.0
"""Libra, DistCA and WLB-LLM where ranks exchange: kept bytes at most Ulysses's + this many
times Q/K/V (what the moved units keep on their executor: their received Q/K/V and O;
measured at most +0.87, +1.05 before TAP's contiguous pieces)."""
EXTRA_BOUND_ULYSSES_REBUILD = 9.0
"""Ulysses with system.attention_memory = rebuild (the "rebuild" scenarios): extra device bytes
at most this many times its Q/K/V - EXTRA_BOUND_ULYSSES's copies plus one layout copy of the
layer's output before its all-to-all back to the kernel's layout (2 x O; measured 8.81). There
every system keeps at most KEPT_BOUND x a plain call's bytes (measured ulysses and distca 1.01,
libra 1.02, against 1.81 / 1.98-2.14 / 2.65-2.86 keeping them)."""
PEER_BOUND_REBUILD = 1.25
"""Libra, DistCA and WLB-LLM with rebuild: extra device bytes at most this many times Ulysses's
(also rebuilding) at the same layout: PEER_BOUND's, the moved units' O and Q / K / V sent
again from where they lie, and in a group that runs its executed units backward first every
returned dQ moved from dO into dQ (measured libra 1.09 / 1.17, distca 1.06 / 1.09 at pool 2 /
8; 1.09 / 1.24 and 1.06 / 1.19 before K/V gradients were summed per vector; 1.04 / 1.19 and
1.03 / 1.19 before that order; 1.39 / 1.79 and 1.24 / 1.78 before the exchange went in
place)."""
REBUILDING = ("libra", "distca", "ulysses", "wlb")
"""The systems system.attention_memory = rebuild changes: the kernels' outputs released (wlb's
per-document CP returns its kernel's output as the layer's, and rebuilds its key and value
packs instead: K and V all-gathered again in the backward - kept 1.01x against 1.31x). Their
peak is held to PEAK_PEER_EXTRA over Ulysses keeping, as keeping's is: what is rebuilt is
alive again in the backward; where a group runs its executed units backward first
(`meta.early_return_groups`) the peak is below keeping's and within PEAK_BOUND
(PEAK_BOUND_REBUILDING: libra 3.75 / 3.84 against 4.39 / 4.83 at pool 2 / 8, distca 3.73 /
3.84; wlb 4.22, keeping's: its local K and V, held for the rebuild, are dropped once the packs
are gathered again, before the kernel's backward - 4.43 while they were saved tensors)."""
PEAK_BOUND = 4.0
"""Peak device bytes of a layer call (forward and backward) at most this many times its
Q/K/V: at one rank for every system and kernel, torch 2.11's varlen_attn included (measured
3.63), and where ranks exchange for Ulysses (measured 3.81 keeping, 3.63 rebuilding). The
Ulysses transfers stage a range of the other ranks' blocks only (`exchange.ROUNDS`), and the
layer's dO is freed once moved to the kernel's layout (`exchange._UlyssesOut` is an autograd
node of its own); with rebuild O is rebuilt before, from the output, which is freed then
(`exchange._RebuildO`). Before: Ulysses 4.43. Libra, DistCA and WLB-LLM are held to
PEAK_PEER_EXTRA over Ulysses keeping under every setting: their backward holds what their
executed units (or WLB-LLM's key packs, 5/4 of the sequence's K/V at cp 2) read beside what
Ulysses holds (measured libra 4.39 / 4.83 at pool 2 / 8, distca 4.15 / 3.98 keeping, 4.07 /
3.84 rebuilding, wlb 4.22 / 4.22)."""
PEAK_BOUND_REBUILDING = ("libra", "distca")
"""With system.attention_memory = rebuild these peak within PEAK_BOUND too, as Ulysses does
(measured libra 3.75 / 3.84, distca 3.73 / 3.84 at pool 2 / 8; 3.96 / 4.42 and 3.84 / 3.84
before): in the early order (`meta.early_return_groups`) a dQ range returned in place lands in
dO, whose rows of moved units the direct call gives no keys, and the K/V gradients returned
for a vector read on several executors are summed into one buffer of the distinct vectors
before the direct call's backward (`rowops.sum_rows_`); an executor posts the next sub-chunk's
messages ahead only where it then holds no more than its direct backward will
(`exchange._Exchange._ahead`). WLB-LLM is held to PEAK_PEER_EXTRA only: its kernel's backward
holds the key and value packs and their gradients (5/4 of the sequence's K/V at cp 2, each),
4.22."""
PEAK_PEER_EXTRA = 1.1
"""Libra, DistCA and WLB-LLM where ranks exchange, under every system.attention_memory: peak
at most Ulysses's (keeping) + this many times Q/K/V (measured at most +1.02, libra at pool 8:
what its executed units hold in the backward; +1.20 before dO was freed in the backward, +1.39
before TAP's contiguous pieces)."""
GROWTH_BOUND = 1.1
"""Device ops per layer call with 5000 documents per sequence, at most this many times those
with 500."""
MODELED_OVERHEAD_BOUND = 0.02
"""At one rank, the operator's cost over a plain call's - its extra device bytes at
COPY_BANDWIDTH plus LAUNCH per extra device op - at most this fraction of the kernel's time
(forward at KERNEL_FWD FLOP/s, backward at KERNEL_BWD) on the median and 10th-percentile
sequences of the libra-256k and libra-1m presets."""
COPY_BANDWIDTH, LAUNCH, KERNEL_FWD, KERNEL_BWD = 4.3e12, 4e-6, 600e12, 450e12
"""An H200's device-to-device copy bandwidth (bytes read + written per second), seconds per
launch, and attention kernel FLOP/s forward and backward."""
OVERHEAD_PRESETS = {"libra-256k": 262_144, "libra-1m": 1_048_576}

LAYOUTS = {"single": (1, 1, 1), "cp2-pool2": (2, 2, 2), "cp2-pool8": (8, 2, 8)}
"""Layout name -> (dp, cp, pool size)."""
KERNEL_OPS = ("attn_fwd", "attn_bwd")
"""The stand-in kernels' op names (not counted in the extra device bytes)."""


@dataclass(frozen=True)
class Shape:
    tokens: int = 262_144
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16


def _sequences(dp: int, tokens: int, docs: int, seed: int) -> list[list[int]]:
    """dp sequences of `tokens` tokens and `docs` documents each; the first replica's holds one
    document of half the sequence, so tiles move in a pool."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(dp):
        head = [tokens // 2] if r == 0 else []
        rest = tokens - sum(head)
        n = docs - len(head)
        cuts = np.sort(rng.choice(np.arange(1, rest), size=n - 1, replace=False))
        out.append(head + np.diff(np.r_[0, cuts, rest]).astype(int).tolist())
    return out


def _plan(system: str, layout: tuple, shape: Shape, docs: int):
    dp, cp, pool = layout
    model = ModelConfig(hidden=shape.heads * shape.head_dim, heads=shape.heads,
                        kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn=64, layers=1,
                        moe_topk=0)
    planner = Planner(LayoutConfig(dp=dp, cp=cp, pool_size=pool, context=shape.tokens), model,
                      PlannerOptions(system=system))
    return planner.plan(_sequences(dp, shape.tokens, docs, seed=docs), flush=True)


def _failure(e: BaseException) -> dict:
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if ("libra_ext" in f.filename or "megatron/libra" in f.filename)
              and "gpu_ready" not in f.filename]
    where = f"{frames[-1].filename.split('/libra_ext/')[-1]}:{frames[-1].lineno}" if frames else "?"
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", "where": where}


def _compiled(plan, groups, chunks: int) -> tuple[list, list]:
    """The sampler thread's work for this rank: each slot's program compiled and staged in
    pinned memory (outside the training thread's modes: host tensors), and the host
    milliseconds per slot."""

    def work():
        staged, ms = [], []
        for slot in range(plan.slots):
            t0 = time.perf_counter()
            prog = compile_rank(plan, groups.r, groups.c, chunks)[slot] if plan.system == "wlb" \
                else compile_slot(plan, groups.r, slot, chunks)
            staged.append(stage(prog, pin=True, owned=True))
            ms.append((time.perf_counter() - t0) * 1e3)
        return staged, ms

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result()


def _layer_call(probe, call, q0, k0, v0) -> dict:
    """`traffic.layer_call` on the fake device: the stand-in kernels' own ops left out of the
    extra bytes, device ops as the probe counts launches."""
    r = traffic.layer_call(probe, call, q0, k0, v0, ops=lambda ph: ph.kernels,
                           kernel_ops=KERNEL_OPS)
    _, fwd, bwd = r["phases"]
    r["ops_by_name"] = {"fwd": dict(fwd.ops), "bwd": dict(bwd.ops)}
    return r


def _exchanged_bytes(plan, replica: int, shape: Shape) -> int:
    """Bytes of Q, K and V this rank sends and receives in slot 0's pool exchange (forward;
    the plan's cells, elements of this rank's head slice)."""
    px = plan.exchange_pool
    if px == 1 or plan.system == "wlb":
        return 0
    g, m = plan.group_of(replica, 0), replica % px
    es = torch.tensor([], dtype=shape.dtype).element_size()
    total = 0
    for x in (plan.xchg_q, plan.xchg_kv):
        cells = x[g].astype(np.int64).copy()
        np.fill_diagonal(cells, 0)
        total += int(cells[m].sum() + cells[:, m].sum())
    return total * es


def _rank_call(probe, plan, system: str, backend: str, groups, shape: Shape, chunks: int = 2,
               memory: str = "keep"):
    """One layer call (forward + backward) of rank (groups.r, groups.c) for slot 0 (`memory`:
    system.attention_memory)."""

    runtime = Runtime(groups=groups, chunks=chunks, backend=backend, memory=memory)
    staged, compile_ms = _compiled(plan, groups, chunks)
    upload = probe.start("upload")
    steps = runtime.prepare(plan, "cuda", staged)
    probe.start("inputs")
    t = steps[0].program.t
    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    q0 = torch.empty(t, h, d, device="cuda", dtype=shape.dtype, requires_grad=True)
    k0 = torch.empty(t, hkv, d, device="cuda", dtype=shape.dtype, requires_grad=True)
    v0 = torch.empty(t, hkv, d, device="cuda", dtype=shape.dtype, requires_grad=True)
    psp = LibraPackedSeqParams(libra=steps[0],
                               doc_lengths=sequence_lengths(plan, groups.r, 0).tolist())
    module = LibraCoreAttention(system=system, runtime=runtime, layer_number=1)
    r = _layer_call(probe, lambda q, k, v: module(q, k, v, packed_seq_params=psp), q0, k0, v0)
    _, fwd, bwd = r.pop("phases")
    kernel_ops = [n for n in list(fwd.ops) + list(bwd.ops) if n.startswith(KERNEL_OPS)]
    top = bwd if bwd.peak_live >= fwd.peak_live else fwd
    traced = {"at_peak": [(n / r["qkv_bytes"], op, where) for n, op, where in top.at_peak],
              "peak_phase": "bwd" if top is bwd else "fwd"} if probe.trace else {}
    return {
        **traced,
        **r,
        "kernel_calls": sum(fwd.ops[n] + bwd.ops[n] for n in set(kernel_ops)),
        "host_reads": fwd.reads + bwd.reads,
        "blocking_transfers": fwd.blocking + bwd.blocking,
        "transfers_in_call": len(fwd.h2d) + len(bwd.h2d),
        "uploads": len(upload.h2d),
        "uploads_pinned_non_blocking": sum(1 for x in upload.h2d if x[1] and x[2]),
        "slots": plan.slots,
        "exchanged_bytes": _exchanged_bytes(plan, groups.r, shape),
        "subchunks": len(getattr(steps[0].program, "subchunks", [])),
        "early_returns": bool(getattr(steps[0].program, "early_returns", False)),
        "upload_bytes": [x.host.numel() * x.host.element_size() for x in staged],
        "host_compile_ms": compile_ms,
    }


def _plain_call(probe, shape: Shape, backend: str, docs: int = 500) -> dict:
    """One plain varlen call over a whole packed sequence (the reference for memory)."""

    L = np.asarray(_sequences(1, shape.tokens, docs, seed=docs)[0], dtype=np.int64)
    cu = np.r_[0, np.cumsum(L)]
    probe.start("inputs")
    seg = kernels.Segments.from_host(torch.as_tensor(cu, dtype=torch.int32).to("cuda"),
                                     torch.as_tensor(cu, dtype=torch.int32).to("cuda"), cu, cu)
    kern = kernels.backend_for(torch.empty(1, shape.heads, shape.head_dim, device="cuda",
                                           dtype=shape.dtype), backend)
    n = int(cu[-1])
    q0 = torch.empty(n, shape.heads, shape.head_dim, device="cuda", dtype=shape.dtype,
                     requires_grad=True)
    k0 = torch.empty(n, shape.kv_heads, shape.head_dim, device="cuda", dtype=shape.dtype,
                     requires_grad=True)
    v0 = torch.empty_like(k0, requires_grad=True)
    scale = 1.0 / math.sqrt(shape.head_dim)
    r = _layer_call(probe, lambda q, k, v: kern.attend(q, k, v, seg, scale, key="plain"),
                    q0, k0, v0)
    r.pop("phases")
    return r


def _drop_in_calls(probe, backend: str, layout: tuple, shape: Shape, layers: int = 3) -> dict:
    """Per-document CP used as a drop-in operator (no step plan: Megatron's cu_seqlens_q only),
    `layers` layer calls on one micro-batch per rank: its program is made and uploaded once."""

    dp, cp, _ = layout
    L = np.asarray(_sequences(1, shape.tokens, 500, seed=7)[0], dtype=np.int64)
    ranks = {}
    for c in range(cp):
        try:
            groups = standins.FakeGroups(1, cp, 0, c)
            runtime = Runtime(groups=groups, backend=backend)
            with ThreadPoolExecutor(1) as pool:  # a host tensor, made outside the fake mode
                cu = pool.submit(torch.from_numpy, np.r_[0, np.cumsum(L)].astype(np.int32)).result()
            psp = SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_kv=cu)
            t = len(thd.split(L, cp, c, "zigzag").token_index)
            module = LibraCoreAttention(system="wlb", runtime=runtime, layer_number=1)
            uploads, blocking = 0, 0
            for _ in range(layers):
                x = probe.start("call")
                q = torch.empty(t, shape.heads, shape.head_dim, device="cuda", dtype=shape.dtype,
                                requires_grad=True)
                k = torch.empty(t, shape.kv_heads, shape.head_dim, device="cuda",
                                dtype=shape.dtype, requires_grad=True)
                v = torch.empty_like(k, requires_grad=True)
                out = module(q, k, v, packed_seq_params=psp)
                out.backward(torch.empty_like(out))
                uploads += len(x.h2d)
                blocking += len(x.blocking) + len(x.reads)
            ranks[f"0.{c}"] = {"layers": layers, "uploads": uploads, "blocking_or_reads": blocking}
        except Exception as e:  # noqa: BLE001
            ranks[f"0.{c}"] = _failure(e)
    return ranks


class _CpGroup:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _rope_calls(probe, shape: Shape, docs: int, cp: int = 2) -> dict:
    """Device ops of one THD RoPE call (a rank's queries at cp 2): megatron-core's unfused THD
    path, and the training app's (megatron.libra.rope) on the same micro-batch."""

    L = np.asarray(_sequences(1, shape.tokens, docs, seed=docs)[0], dtype=np.int64)
    z = thd.zigzag_split(L, cp, 0)
    t = len(z.position_ids)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False,
                             multi_latent_attention=False)
    with ThreadPoolExecutor(1) as pool:  # host tensors, as the sampler's thread makes them
        cu = pool.submit(torch.from_numpy, np.r_[0, np.cumsum(thd.padded_lengths(L, cp))]
                         .astype(np.int32)).result()
        positions = pool.submit(torch.from_numpy, z.position_ids.astype(np.int64)).result()
    out = {}
    original = rope_utils.apply_rotary_pos_emb
    for name, fn in (("megatron", original),
                     ("libra", rope._positions_rope(original, rope_utils._apply_rotary_pos_emb_bshd))):
        probe.start("inputs")
        q = torch.empty(t, shape.heads, shape.head_dim, device="cuda", dtype=shape.dtype)
        freqs = torch.empty(int(L.max()) + 2 * cp, 1, 1, shape.head_dim, device="cuda")
        if name == "libra":
            rope.register(cu, rope.Positions(positions.to("cuda", non_blocking=True)))
        call = probe.start("rope")
        try:
            fn(q, freqs, config, cu_seqlens=cu, cp_group=_CpGroup(cp, 0))
            out[name] = {"device_ops": call.kernels, "host_reads": len(call.reads)}
        except Exception as e:  # noqa: BLE001
            out[name] = _failure(e)
        probe.start("done")
    return out


TRAINER_CONFIG = "configs/train/cpu_tiny.yaml"
TRAINER_OVERRIDES = [
    "dtype=bf16", "parallel.cp=1", "parallel.pool_size=1", "data.gbs=2", "data.context=4096",
    "model.heads=8", "model.kv_heads=2", "model.head_dim=64", "model.hidden=512",
    "schedule.train_steps=2", "schedule.warmup_steps=1", "optimizer.distributed=false",
]
"""A megatron-core GPTModel of two layers (GQA 8/2, head dim 64, bf16) on one rank."""


MULTI_RANK = {
    "cp2": (2, ["parallel.cp=2", "parallel.pool_size=1"], SYSTEMS),
    "dp2-ep2-moe": (2, ["parallel.cp=1", "parallel.pool_size=2", "parallel.ep=2",
                        "model.moe_topk=2", "model.experts=4", "model.moe_ffn=128",
                        "transformer_impl=local", "moe.balancer=libra"], ("libra",)),
}
"""Multi-rank training scenarios: name -> (ranks, overrides of TRAINER_OVERRIDES, systems). Each
rank is a process of its own on the fake device (host collectives over gloo, device ones
stand-ins); dp2-ep2-moe runs Libra's expert balancer (MoE layers of 4 experts over 2 EP ranks,
the second layer planned one layer ahead)."""

TRAINER_SCENARIOS = ("one-rank", *MULTI_RANK)
"""The training-step scenarios: megatron-core's GPTModel at one rank, and each MULTI_RANK one."""

ALLOWED_READS = {
    "moe-counts": (
        "the expert planner runs on the host: a balanced MoE layer reads its EP group's expert "
        "token counts to place copies and shard tokens, and with the lookahead the next "
        "layer's predicted counts (a pinned non-blocking copy behind an event)", 2),
}
"""Host reads inherent to a design: name -> (reason, at most this many per balanced MoE layer
and micro-batch). A stand-in makes each such read on the fake device and logs it."""
ALLOWED_UPLOADS = {
    "moe-bounds": ("megatron/libra/moe_layer.py", "_upload",
                   "the plan made on the host reaches the device: each (source, expert) run's "
                   "bounds on this EP rank (one pinned non-blocking copy)", 1),
}
"""Host-to-device copies inside forward-backward inherent to a design: name -> (file, function
that makes it, reason, at most this many per balanced MoE layer and micro-batch); each must be
pinned and non-blocking."""


def _allowed_upload(h2d_entry) -> str | None:
    where = h2d_entry[3]
    for name, (path, func, _, _) in ALLOWED_UPLOADS.items():
        if where.startswith(path + ":") and where.endswith(" " + func):
            return name
    return None


def _trainer_calls(probe, systems, backend: str, overrides=(), rank: int = 0, world: int = 1,
                   port: int | None = None) -> dict:
    """One training micro-step of the app's Trainer per system on the fake device, on `rank`
    of `world` processes: the step's uploads (`Trainer.micro_batches`), then megatron-core's
    forward-backward schedule over the micro-batches (`Trainer.forward_backward`) with Libra's
    attention (and, in MoE scenarios, its MoE layers) in its GPTModel."""

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}",
                                rank=rank, world_size=world)
    # megatron-core's model-parallel RNG tracker on the host generator (no device RNG here), and
    # (0.19) its gradient reduction's stream ordering without CUDA streams (none here either)
    cpu_shims.apply(only=("rng_tracker", "recompute_rng", "moe_without_te", "grad_sync_stream"),
                    force=True)
    out = {}
    for system in systems:

        trainer = None
        try:
            cfg = TrainConfig.load(TRAINER_CONFIG, TRAINER_OVERRIDES + list(overrides) + [
                f"system.name={system}", f"system.attention_backend={backend}"])
            with standins.fake_module_cuda():
                trainer = Trainer(cfg, rank, world)
            batch = trainer.sampler.next()
            up = probe.start("uploads")
            micro = trainer.micro_batches(batch)
            fb = probe.start("forward_backward")
            trainer.forward_backward(micro, float(batch.label_tokens))
            probe.start("done")
            moe = sum(1 for c in trainer.chunks for m in c.modules()
                      if type(m).__name__ == "LibraMoELayer")
            out[system] = {
                "slots": int(batch.plan.slots), "micro_batches": len(micro),
                "balanced_moe_layers": moe, "allowed_reads": fb.allowed,
                "uploads": len(up.h2d), "uploads_pinned_non_blocking":
                    sum(1 for x in up.h2d if x[1] and x[2]),
                "device_ops": fb.kernels, "host_reads": fb.reads,
                "blocking_transfers": fb.blocking,
                "transfers_in_call": sum(1 for x in fb.h2d if _allowed_upload(x) is None),
                "allowed_uploads": [(_allowed_upload(x), x[3]) for x in fb.h2d
                                    if _allowed_upload(x) is not None],
            }
        except Exception as e:  # noqa: BLE001
            out[system] = _failure(e)
        finally:
            if trainer is not None:
                trainer.sampler.close()
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return out


def trainer_rank(scenario: str, rank: int, port: int, standin: str) -> dict:
    """One rank's part of a MULTI_RANK scenario (run in a process of its own)."""
    world, overrides, systems = MULTI_RANK[scenario]
    with harness.fake_cuda() as probe, standins.fake_collectives(), \
            standins.use_backend(standin) as backend, standins.fake_distributed(), \
            standins.moe_counts(probe):
        return _trainer_calls(probe, systems, backend, overrides, rank, world, port)


def _multi_rank(scenario: str, standin: str) -> dict:
    """A MULTI_RANK scenario's ranks, each a process of the gate's own kind: system -> rank ->
    its report."""

    world, _, systems = MULTI_RANK[scenario]
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "megatron.libra.gpu_ready", "--rank-of", f"{scenario},{r},{port}",
         "--standins", standin], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)]
    out = {s: {} for s in systems}
    for r, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        lines = [x for x in stdout.splitlines() if x.startswith("{")]
        if p.returncode != 0 or not lines:
            err = {"error": f"rank {r} exited with {p.returncode}: "
                            f"{(stderr.strip().splitlines() or ['?'])[-1][:200]}", "where": "?"}
            for s in systems:
                out[s][str(r)] = err
            continue
        for s, rep in json.loads(lines[-1]).items():
            out[s][str(r)] = rep
    return out


def run(systems=SYSTEMS, standin_names=tuple(standins.BACKEND_STANDINS), layouts=tuple(LAYOUTS),
        shape: Shape = Shape(), growth_standin: str = "varlen-2.13", trainer: bool = True,
        trainer_scenarios: tuple[str, ...] = TRAINER_SCENARIOS) -> dict:
    """Every scenario of the module docstring; the report (JSON-ready). `trainer_scenarios`:
    which training steps run, of TRAINER_SCENARIOS (with `trainer`)."""
    unknown = set(trainer_scenarios) - set(TRAINER_SCENARIOS)
    if unknown:
        raise ValueError(f"trainer scenario(s) {', '.join(sorted(unknown))} unknown (known: "
                         f"{', '.join(TRAINER_SCENARIOS)})")
    t0 = time.perf_counter()
    report = {"shape": {"tokens": shape.tokens, "heads": shape.heads, "kv_heads": shape.kv_heads,
                        "head_dim": shape.head_dim, "dtype": str(shape.dtype)},
              "bounds": {"extra_single": EXTRA_BOUND_SINGLE,
                         "extra_ulysses": EXTRA_BOUND_ULYSSES, "extra_peer": PEER_BOUND,
                         "ops_peer": OPS_BOUND, "kept_over_plain": KEPT_BOUND,
                         "kept_exchange": KEPT_BOUND_EXCHANGE, "kept_peer": KEPT_PEER_EXTRA,
                         "kept_owner": KEPT_OWNER_EXTRA, "peak": PEAK_BOUND,
                         "peak_peer": PEAK_PEER_EXTRA, "growth": GROWTH_BOUND,
                         "modeled_overhead": MODELED_OVERHEAD_BOUND,
                         "extra_ulysses_rebuild": EXTRA_BOUND_ULYSSES_REBUILD,
                         "extra_peer_rebuild": PEER_BOUND_REBUILD},
              "operator": {}, "rebuild": {}, "owner": {}, "plain": {}, "growth": {},
              "drop_in": {}, "trainer": {}}
    with harness.fake_cuda() as probe, standins.fake_collectives():
        for name in standin_names:
            with standins.use_backend(name) as backend:
                try:
                    report["plain"][name] = _plain_call(probe, shape, backend)
                except Exception as e:  # noqa: BLE001 - reported, and failed by check()
                    report["plain"][name] = _failure(e)
                for system in systems:
                    for lay in layouts:
                        report["operator"][f"{system}/{name}/{lay}"] = _layout_calls(
                            probe, system, backend, LAYOUTS[lay], shape, docs=500)
        with standins.use_backend(growth_standin) as backend:
            for system in set(systems) & set(REBUILDING):
                for lay in layouts:
                    if LAYOUTS[lay][1] > 1:
                        for memory in (("rebuild", "owner") if system in ("libra", "distca")
                                       else ("rebuild",)):
                            report[memory][f"{system}/{growth_standin}/{lay}"] = _layout_calls(
                                probe, system, backend, LAYOUTS[lay], shape, docs=500,
                                memory=memory)
            if "wlb" in systems:
                for lay in layouts:
                    report["drop_in"][f"wlb/{lay}"] = _drop_in_calls(probe, backend,
                                                                     LAYOUTS[lay], shape)
            report["rope"] = {"50": _rope_calls(probe, shape, 50), "500": _rope_calls(probe, shape, 500)}
            for system in systems:
                for lay in layouts:
                    few = report["operator"].get(f"{system}/{growth_standin}/{lay}") or \
                        _layout_calls(probe, system, backend, LAYOUTS[lay], shape, docs=500)
                    many = _layout_calls(probe, system, backend, LAYOUTS[lay], shape, docs=5000)
                    report["growth"][f"{system}/{lay}"] = _growth(few, many)
        if trainer and "one-rank" in trainer_scenarios:
            with standins.use_backend(growth_standin) as backend, standins.fake_distributed():
                report["trainer"] = _trainer_calls(probe, systems, backend)
    if "single" in layouts:
        report["modeled_overhead"] = modeled_overhead(report, shape)
    if trainer:
        report["trainer_ranks"] = {}
        for name, (_, _, scenario_systems) in MULTI_RANK.items():
            if name in trainer_scenarios and set(scenario_systems) & set(systems):
                for system, ranks in _multi_rank(name, growth_standin).items():
                    if system in systems:
                        report["trainer_ranks"][f"{system}/{name}"] = ranks
    report["seconds"] = time.perf_counter() - t0
    return report


def _layout_calls(probe, system, backend, layout, shape, docs, memory="keep") -> dict:
    dp, cp, _ = layout
    try:
        plan = _plan(system, layout, shape, docs)
    except Exception as e:  # noqa: BLE001
        return {"plan": _failure(e)}
    ranks = {}
    for r in range(dp):
        for c in range(cp):
            try:
                ranks[f"{r}.{c}"] = _rank_call(probe, plan, system, backend,
                                               standins.FakeGroups(dp, cp, r, c), shape,
                                               memory=memory)
            except Exception as e:  # noqa: BLE001
                ranks[f"{r}.{c}"] = _failure(e)
    return ranks


def modeled_overhead(report: dict, shape: Shape) -> dict:
    """Per system and kernel at one rank: the operator's modeled cost over a plain call's
    (MODELED_OVERHEAD_BOUND) on each preset's median and 10th-percentile sequence, as a fraction
    of the kernel's time. The gate's ratios (extra bytes over Q/K/V, device ops) hold at any
    length; the sequences give the kernel's work."""
    # deferred: the measuring tools import the operator's benchmark only here
    from libra_ext.measure.bench import quantile_sequences

    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    es = torch.tensor([], dtype=shape.dtype).element_size()
    seqs = {f"{p}/{q}": docs for p, n in OVERHEAD_PRESETS.items()
            for q, docs in quantile_sequences(p, n).items()}
    out = {}
    for key, ranks in report["operator"].items():
        system, kernel, layout = key.split("/")
        plain = report["plain"].get(kernel, {})
        r = ranks.get("0.0", {})
        if layout != "single" or "extra_over_qkv" not in r or "extra_over_qkv" not in plain:
            continue
        row = {}
        for name, docs in seqs.items():
            L = np.asarray(docs, dtype=np.float64)
            pairs = float((L * (L + 1) / 2).sum())
            fwd = 4 * pairs * h * d
            kernel_s = fwd / KERNEL_FWD + 2.5 * fwd / KERNEL_BWD
            qkv = L.sum() * (h + 2 * hkv) * d * es
            extra = (r["extra_over_qkv"] - plain["extra_over_qkv"]) * qkv
            ops = r["device_ops"] - plain["device_ops"]
            row[name] = max(0.0, extra / COPY_BANDWIDTH + ops * LAUNCH) / kernel_s
        out[f"{system}/{kernel}"] = row
    return out


def _growth(few: dict, many: dict) -> dict:
    def ops(ranks):
        vals = [v["device_ops"] for v in ranks.values() if "device_ops" in v]
        return max(vals) if vals and len(vals) == len(ranks) else None

    a, b = ops(few), ops(many)
    return {"device_ops_500_docs": a, "device_ops_5000_docs": b,
            "ratio": (b / a) if a and b else None}


def _transfer_failures(where: str, r: dict, scope: str) -> list[str]:
    """A scenario's host reads, blocking transfers and host-to-device copies during `scope`,
    and uploads that are not one pinned non-blocking copy per slot."""
    bad = [f"{where}: host read {op} at {at} {scope}" for op, at in r["host_reads"]]
    bad += [f"{where}: blocking transfer of {x[0]} bytes at {x[-1]} {scope}"
            for x in r["blocking_transfers"]]
    if r["transfers_in_call"]:
        bad.append(f"{where}: {r['transfers_in_call']} host-to-device copies {scope}")
    if r["uploads"] != r["slots"] or r["uploads_pinned_non_blocking"] != r["slots"]:
        bad.append(f"{where}: {r['uploads']} uploads ({r['uploads_pinned_non_blocking']} "
                   f"pinned and non-blocking) for {r['slots']} slots")
    return bad


def _allowed_failures(where: str, r: dict) -> list[str]:
    """Allow-listed reads beyond their bound (per balanced MoE layer and micro-batch)."""
    bad = []
    for kind, table, key in (("reads", ALLOWED_READS, "allowed_reads"),
                             ("uploads", ALLOWED_UPLOADS, "allowed_uploads")):
        for name, entry in table.items():
            n = sum(1 for x in r[key] if x[0] == name)
            bound = entry[-1] * r["balanced_moe_layers"] * r["micro_batches"]
            if n > bound:
                bad.append(f"{where}: {n} {name} {kind} (bound {bound}: {entry[-1]} per "
                           f"balanced MoE layer and micro-batch)")
    return bad


def _worst_of(ranks: dict, field: str):
    vals = [r[field] for r in ranks.values() if field in r]
    return max(vals) if vals and len(vals) == len(ranks) else None


def _cost_failures(report: dict, key: str, where: str, r: dict,
                   section: str = "operator") -> list[str]:
    """A rank's extra device bytes, device ops and memory against the bounds: absolute at one
    rank (kept against a plain call's), Ulysses's absolute where ranks exchange, and its peers'
    against Ulysses's at the same kernel and layout (in the same `section` of the report:
    "rebuild" for system.attention_memory = rebuild; "owner", against Ulysses keeping, for
    owner: kept as Ulysses's, KEPT_OWNER_EXTRA; peaks always against Ulysses keeping)."""
    system, kernel, layout = key.split("/")
    bad = []
    x = r["extra_over_qkv"]
    plain = report["plain"].get(kernel, {})
    over_peak = ([f"{where}: peaks at {r['peak']:.2f}x its Q/K/V (bound {PEAK_BOUND})"]
                 if r["peak"] > PEAK_BOUND else [])
    if section == "owner":
        ulysses = report["operator"].get(f"ulysses/{kernel}/{layout}", {})
        kept = _worst_of(ulysses, "kept")
        if kept is not None and r["kept"] > kept + KEPT_OWNER_EXTRA:
            bad.append(f"{where}: keeps {r['kept']:.2f}x its Q/K/V for backward, over Ulysses's "
                       f"{kept:.2f} + {KEPT_OWNER_EXTRA}")
        section = "operator"  # bytes, ops and peak as keeping
    ulysses = report[section].get(f"ulysses/{kernel}/{layout}", {})
    keeping = report["operator"].get(f"ulysses/{kernel}/{layout}", {})  # (peaks' reference)
    rebuilt = section == "rebuild"
    kept_over_plain = ([f"{where}: keeps {r['kept']:.2f}x its Q/K/V for backward, over "
                        f"{KEPT_BOUND} x a plain call's {plain['kept']:.2f}x"]
                       if "kept" in plain and r["kept"] > KEPT_BOUND * plain["kept"] else [])
    if layout == "single":
        if x > EXTRA_BOUND_SINGLE:
            bad.append(f"{where}: {x:.2f}x Q/K/V extra device bytes (bound "
                       f"{EXTRA_BOUND_SINGLE})")
        return bad + kept_over_plain + over_peak
    if system == "ulysses":
        for name, value, bound in (
                ("extra device bytes", x,
                 EXTRA_BOUND_ULYSSES_REBUILD if rebuilt else EXTRA_BOUND_ULYSSES),
                ("kept for backward", r["kept"],
                 KEPT_BOUND * plain.get("kept", math.inf) if rebuilt else KEPT_BOUND_EXCHANGE),
                ("peak", r["peak"], PEAK_BOUND)):
            if value > bound:
                bad.append(f"{where}: {name} {value:.2f}x its Q/K/V (bound {bound})")
        return bad
    if not ulysses:
        return bad
    checks = [("extra device bytes", x, _worst_of(ulysses, "extra_over_qkv"),
               PEER_BOUND_REBUILD if rebuilt else PEER_BOUND, "x"),
              ("device ops in fwd", r["device_ops_fwd"], _worst_of(ulysses, "device_ops_fwd"),
               OPS_BOUND, "x"),
              ("device ops in bwd", r["device_ops_bwd"], _worst_of(ulysses, "device_ops_bwd"),
               OPS_BOUND, "x"),
              ("kept for backward", r["kept"], _worst_of(ulysses, "kept"), KEPT_PEER_EXTRA, "+"),
              ("peak", r["peak"], _worst_of(keeping, "peak"), PEAK_PEER_EXTRA, "+")]
    if rebuilt:
        bad += kept_over_plain
        if system in PEAK_BOUND_REBUILDING:
            bad += over_peak
    for name, value, ref, bound, how in checks:
        if ref is None:
            continue
        limit = ref * bound if how == "x" else ref + bound
        if value > limit:
            bad.append(f"{where}: {name} {value:.2f}, over Ulysses's {ref:.2f} {how} {bound}")
    return bad


def check(report: dict) -> list[str]:
    """What fails the gate: every error, host read, blocking transfer, upload that is not one
    pinned non-blocking copy per slot, memory above the bounds, or growth above its bound."""
    bad = []
    for name, r in report["plain"].items():
        if "error" in r:
            bad.append(f"plain/{name}: {r['error']} at {r['where']}")
    for section in ("operator", "rebuild", "owner"):
        for key, ranks in report.get(section, {}).items():
            for rank, r in ranks.items():
                where = f"{key}{'' if section == 'operator' else f' ({section})'} rank {rank}"
                if "error" in r:
                    bad.append(f"{where}: {r['error']} at {r['where']}")
                    continue
                bad += _transfer_failures(where, r, "inside the call")
                bad += _cost_failures(report, key, where, r, section)
    for key, ranks in report["drop_in"].items():
        for rank, r in ranks.items():
            if "error" in r:
                bad.append(f"drop-in {key} rank {rank}: {r['error']} at {r['where']}")
            elif r["uploads"] != 1 or r["blocking_or_reads"]:
                bad.append(f"drop-in {key} rank {rank}: {r['uploads']} uploads and "
                           f"{r['blocking_or_reads']} blocking transfers or host reads over "
                           f"{r['layers']} layer calls (one upload per micro-batch, none else)")
    steps = {f"trainer {system}": r for system, r in report.get("trainer", {}).items()}
    steps.update({f"trainer {key} rank {rank}": r
                  for key, ranks in report.get("trainer_ranks", {}).items()
                  for rank, r in ranks.items()})
    for where, r in steps.items():
        if "error" in r:
            bad.append(f"{where}: {r['error']} at {r['where']}")
            continue
        bad += _transfer_failures(where, r, "in forward-backward")
        bad += _allowed_failures(where, r)
    rope = report.get("rope")
    if rope:
        for docs, r in rope.items():
            if "error" in r["libra"]:
                bad.append(f"rope ({docs} documents): {r['libra']['error']} at {r['libra']['where']}")
        if all("device_ops" in rope[k]["libra"] for k in rope):
            a, b = rope["50"]["libra"]["device_ops"], rope["500"]["libra"]["device_ops"]
            if b > GROWTH_BOUND * a:
                bad.append(f"rope: {a} -> {b} device ops from 50 to 500 documents")
    for key, row in report.get("modeled_overhead", {}).items():
        for name, x in row.items():
            if x > MODELED_OVERHEAD_BOUND:
                bad.append(f"modeled overhead {key} on {name}: {100 * x:.2f}% of the kernel "
                           f"(bound {100 * MODELED_OVERHEAD_BOUND:.0f}%)")
    for key, g in report["growth"].items():
        if g["ratio"] is None:
            bad.append(f"growth {key}: not measured (a call failed)")
        elif g["ratio"] > GROWTH_BOUND:
            bad.append(f"growth {key}: {g['device_ops_500_docs']} -> {g['device_ops_5000_docs']} "
                       f"device ops from 500 to 5000 documents (x{g['ratio']:.2f}, bound "
                       f"{GROWTH_BOUND})")
    return bad


def _worst(ranks: dict) -> tuple[list, str | None]:
    """A scenario's ranks that ran, and the first failure's line when one did not."""
    ok = [r for r in ranks.values() if "error" not in r]
    err = next((r for r in ranks.values() if "error" in r), None)
    return ok, err and f"FAILED: {err.get('error')} at {err.get('where')}"


def summary(report: dict) -> str:
    """The report as a table: per scenario the worst rank's figures, then the growth and what
    fails."""
    lines = [f"GPU-readiness gate (fake CUDA), {report['shape']['tokens']} tokens, "
             f"{report['shape']['heads']}/{report['shape']['kv_heads']} heads x "
             f"{report['shape']['head_dim']}, {report['shape']['dtype']}: per layer call, the "
             "worst rank"]
    lines.append(f"  {'system/kernel/layout':38s} {'ops fwd/bwd':>11s} {'kernels':>7s} "
                 f"{'reads':>5s} {'blocking':>8s} {'uploads':>7s} {'extra':>7s} {'kept':>5s} "
                 f"{'peak':>5s} {'KiB/slot':>8s} {'ms/slot':>7s}")
    rows = list(report["operator"].items())
    rows += [(f"{key}+{section}", ranks) for section in ("rebuild", "owner")
             for key, ranks in report.get(section, {}).items()]
    for key, ranks in rows:
        ok, err = _worst(ranks)
        if err:
            lines.append(f"  {key:38s} {err}")
            continue
        ops = f"{max(r['device_ops_fwd'] for r in ok)}/{max(r['device_ops_bwd'] for r in ok)}"
        lines.append(
            f"  {key:38s} {ops:>11s} "
            f"{max(r['kernel_calls'] for r in ok):7d} {max(len(r['host_reads']) for r in ok):5d} "
            f"{max(len(r['blocking_transfers']) for r in ok):8d} "
            f"{max(r['uploads'] for r in ok):7d} {max(r['extra_over_qkv'] for r in ok):6.2f}x "
            f"{max(r['kept'] for r in ok):5.2f} {max(r['peak'] for r in ok):5.2f} "
            f"{max(max(r['upload_bytes']) for r in ok) / 1024:8.1f} "
            f"{max(max(r['host_compile_ms']) for r in ok):7.1f}")
    for name, r in report["plain"].items():
        if "error" not in r:
            ops = f"{r['device_ops_fwd']}/{r['device_ops_bwd']}"
            lines.append(f"  {'plain varlen call/' + name:38s} {ops:>11s} {2:7d} {0:5d} {0:8d} "
                         f"{0:7d} {r['extra_over_qkv']:6.2f}x {r['kept']:5.2f} {r['peak']:5.2f}")
    for key, ranks in report["drop_in"].items():
        ok = [r for r in ranks.values() if "error" not in r]
        if ok:
            lines.append(f"  drop-in {key} (no plan), {ok[0]['layers']} layer calls: "
                         f"{max(r['uploads'] for r in ok)} upload(s), "
                         f"{max(r['blocking_or_reads'] for r in ok)} blocking transfers/reads")
    for system, r in report.get("trainer", {}).items():
        if "error" in r:
            lines.append(f"  trainer/{system}: FAILED: {r['error']} at {r['where']}")
        else:
            lines.append(f"  trainer/{system} (GPTModel, one rank): {r['device_ops']} device ops "
                         f"in forward-backward of {r['micro_batches']} micro-batch(es), "
                         f"{len(r['host_reads'])} host reads, {len(r['blocking_transfers'])} "
                         f"blocking transfers, {r['uploads']} upload(s) for {r['slots']} slot(s)")
    for key, ranks in report.get("trainer_ranks", {}).items():
        ok, err = _worst(ranks)
        if err:
            lines.append(f"  trainer/{key}: {err}")
            continue
        lines.append(
            f"  trainer/{key} ({len(ranks)} ranks): {max(r['device_ops'] for r in ok)} device "
            f"ops, {max(len(r['host_reads']) for r in ok)} host reads, "
            f"{max(len(r['blocking_transfers']) for r in ok)} blocking transfers, "
            f"{max(len(r['allowed_reads']) for r in ok)} allowed reads and "
            f"{max(len(r['allowed_uploads']) for r in ok)} allowed uploads "
            f"({max(r['balanced_moe_layers'] for r in ok)} balanced MoE layers), "
            f"{max(r['uploads'] for r in ok)} upload(s) for {ok[0]['slots']} slot(s)")
    rope = report.get("rope") or {}
    for name in ("megatron", "libra"):
        if rope and all("device_ops" in rope[k][name] for k in rope):
            lines.append(f"  THD RoPE ({name}): {rope['50'][name]['device_ops']} (50 documents) -> "
                         f"{rope['500'][name]['device_ops']} (500) device ops per call")
    for key, row in report.get("modeled_overhead", {}).items():
        lines.append(f"  modeled overhead at one rank {key}: " + ", ".join(
            f"{name} {100 * x:.3f}%" for name, x in row.items()))
    for key, g in report["growth"].items():
        lines.append(f"  device ops {key}: {g['device_ops_500_docs']} (500 documents) -> "
                     f"{g['device_ops_5000_docs']} (5000)")
    fails = report.get("failures", [])
    lines.append(f"  {len(fails)} failures" + "".join(f"\n    {f}" for f in fails[:40]))
    return "\n".join(lines)
