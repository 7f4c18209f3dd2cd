"""Stand-ins for what the fake device cannot run: the attention kernels of every backend, with
each entry point's own signature and checks, and the collectives of a multi-rank layout.

Kernels. One pair of custom ops (`libra_gate::attn_fwd` / `attn_bwd`, with fake
implementations and autograd) behaves like a flash kernel: it returns O and the LSE, keeps Q, K,
V, O and the LSE for its backward, and checks what every real kernel requires - every tensor on
the query's device, cu_seqlens int32 and 1-D, maximum lengths as host integers (a tensor there
would be read on the host) and rounded up as the runtime rounds them (`kernels.rounded_max`),
GQA only where the entry point supports it. The entry points wrap it
with the signatures of Transformer Engine's `DotProductAttention` (THD), flash-attn 2's and 3's
`flash_attn_varlen_func`, and PyTorch's `varlen_attn` of 2.11 (GQA as ATen's flash kernel
takes it) and 2.13 (`enable_gqa`); `use_backend(name)` puts one in place of the real one in
`kernels`.

Collectives. `FakeGroups` stands for the runtime's GroupCache at a given (replica, cp rank); the
all-to-alls and all-gathers check their buffers (device, split sizes) and move nothing, so each
rank's program runs on its own.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from libra_ext.attention import exchange, kernels
from megatron.libra import moe_layer
from megatron.libra.gpu_ready.harness import _where

Tensor = torch.Tensor


class StandInError(RuntimeError):
    """A stand-in kernel or collective was called in a way the real one would refuse (or
    would have to sync for)."""


def _check(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> None:
    for name, t in (("key", k), ("value", v), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if t.device != q.device:
            raise StandInError(f"{name} is on {t.device}, the query on {q.device}")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise StandInError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if cu_q.shape != cu_k.shape:
        raise StandInError(f"cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_k "
                           f"{tuple(cu_k.shape)} must have one entry per segment each")
    if q.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise StandInError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                           "expected [n_q, hq, d] and [n_k, hk, d]")
    if q.shape[1] % k.shape[1]:
        raise StandInError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise StandInError(f"flash kernels take fp16/bf16, got {q.dtype}")


@torch.library.custom_op("libra_gate::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
             max_k: int, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    raise StandInError("the gate's stand-in kernels run on fake tensors only")


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    _check(q, k, v, cu_q, cu_k)
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("libra_gate::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float,
             causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    raise StandInError("the gate's stand-in kernels run on fake tensors only")


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    _check(q, k, v, cu_q, cu_k)
    if dout.device != q.device or dout.shape != q.shape:
        raise StandInError(f"dout {tuple(dout.shape)} on {dout.device} must match q")
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
    ctx.args = (max_q, max_k, scale, causal)


def _backward(ctx, dout, dlse):
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    dq, dk, dv = attn_bwd(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup)


def _int(x, name: str) -> int:
    if isinstance(x, torch.Tensor) or not isinstance(x, int):
        raise StandInError(f"{name} must be a host int (a tensor would be read on the host), "
                           f"got {type(x).__name__}")
    return x


def _max_seqlen(x, name: str) -> int:
    """A call's max_seqlen: a host int, rounded up as the runtime rounds it."""
    x = _int(x, name)
    if x != kernels.rounded_max([x]):
        raise StandInError(
            f"{name} {x} is not rounded up as the runtime's calls round it (a power of two, at "
            f"least {kernels.MIN_MAX_SEQLEN}: kernels.rounded_max): a shape-keyed cache (TE's "
            "cuDNN graphs) would see a new value nearly every step")
    return x


def _call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return attn_fwd(q, k, v, cu_q, cu_k, _max_seqlen(max_q, "max_seqlen_q"),
                    _max_seqlen(max_k, "max_seqlen_k"), scale, bool(causal))


# -- entry points, each with its library's signature -------------------------------------------


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1)):
    """torch.nn.attention.varlen.varlen_attn of PyTorch 2.11: key and value go to ATen's flash
    kernel as they are, which takes KV heads dividing the query heads (GQA without a flag)."""
    out, lse = _call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                     tuple(window_size) == (-1, 0))
    return (out, lse) if return_aux is not None and return_aux.lse else out


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                     block_table=None, num_splits=None):
    """torch.nn.attention.varlen.varlen_attn of PyTorch 2.13: GQA with enable_gqa."""
    if not enable_gqa and query.size(1) != key.size(1):
        raise StandInError(f"varlen_attn (2.13) needs enable_gqa=True for {key.size(1)} KV heads "
                           f"and {query.size(1)} query heads")
    out, lse = _call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                     tuple(window_size) == (-1, 0))
    return (out, lse) if return_aux is not None and return_aux.lse else out


def flash_attn_varlen_func_2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's flash_attn_varlen_func (GQA native)."""
    if dropout_p:
        raise StandInError("the runtime runs attention without dropout")
    out, lse = _call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func_3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                             qv=None, q_descale=None, k_descale=None, v_descale=None,
                             window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                             pack_gqa=None, deterministic=False, sm_margin=0,
                             return_attn_probs=False):
    """FlashAttention-3's flash_attn_interface.flash_attn_varlen_func: (out, lse)."""
    return _call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                 causal)


class DotProductAttention(torch.nn.Module):
    """Transformer Engine's DotProductAttention, THD inputs only (what the runtime uses)."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                 window_size=None, bottom_right_diagonal=None, sequence_parallel=False,
                 tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                 attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type="p2p", softmax_scale=None, softmax_type="vanilla",
                 return_max_logit=False, name=None):
        super().__init__()
        self.heads, self.d = num_attention_heads, kv_channels
        self.groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.qkv_format, self.mask, self.scale = qkv_format, attn_mask_type, softmax_scale
        if attention_dropout:
            raise StandInError("the runtime runs attention without dropout")

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type=None, window_size=None, **kwargs):
        fmt = qkv_format or self.qkv_format
        mask = attn_mask_type or self.mask
        if fmt != "thd" or mask != "padding_causal_bottom_right":
            raise StandInError(f"expected THD with padding_causal_bottom_right, got {fmt} / {mask}")
        if query_layer.shape[1] != self.heads or key_layer.shape[1] != self.groups:
            raise StandInError(f"heads {query_layer.shape[1]}/{key_layer.shape[1]} differ from "
                               f"the module's {self.heads}/{self.groups}")
        if max_seqlen_q is None or max_seqlen_kv is None:  # TE would read cu_seqlens on the host
            raise StandInError("max_seqlen_q / max_seqlen_kv must be given for THD")
        out, _ = _call(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                       max_seqlen_q, max_seqlen_kv, self.scale, True)
        return out.reshape(out.shape[0], -1)


BACKEND_STANDINS = {
    "te": ("te", dict(_TEDotProductAttention=DotProductAttention, HAVE_TE=True)),
    "flash2": ("flash", dict(_flash_varlen=flash_attn_varlen_func_2, HAVE_FLASH=True,
                             FLASH_VERSION=2)),
    "flash3": ("flash", dict(_flash_varlen=flash_attn_varlen_func_3, HAVE_FLASH=True,
                             FLASH_VERSION=3)),
    "varlen-2.11": ("varlen", dict(_varlen_attn=varlen_attn_2_11, HAVE_VARLEN=True,
                                   _VARLEN_ARGS=set(inspect.signature(varlen_attn_2_11).parameters))),
    "varlen-2.13": ("varlen", dict(_varlen_attn=varlen_attn_2_13, HAVE_VARLEN=True,
                                   _VARLEN_ARGS=set(inspect.signature(varlen_attn_2_13).parameters))),
}
"""Stand-in name -> (the runtime's backend it stands for, the kernels-module names it sets)."""
NATIVE_GQA = set(BACKEND_STANDINS)
"""Entry points that run GQA natively: all of them (varlen_attn of 2.11 through ATen's flash
kernel, which takes fewer KV heads; 2.13 with enable_gqa)."""


@contextlib.contextmanager
def use_backend(name: str):
    """Put stand-in `name` in place of its backend's entry point; yields the backend's name."""
    backend, names = BACKEND_STANDINS[name]
    saved = {k: getattr(kernels, k, None) for k in names}
    for k, v in names.items():
        setattr(kernels, k, v)
    kernels.select_backend.cache_clear()
    try:
        yield backend
    finally:
        for k, v in saved.items():
            setattr(kernels, k, v)
        kernels.select_backend.cache_clear()


# -- collectives -------------------------------------------------------------------------------


class FakeGroup:
    def __init__(self, size: int, name: str):
        self.size, self.name = size, name


def _group_size(group) -> int:
    """A stand-in group's size, or a real process group's (multi-rank scenarios)."""
    if group is None:
        return 1
    return group.size if isinstance(group, FakeGroup) else group.size()


class _Done:
    def wait(self):
        return None


class FakeGroups:
    """The runtime's GroupCache at (replica r, cp rank c) of a layout, with stand-in groups."""

    def __init__(self, dp: int, cp: int, r: int, c: int, tp: int = 1, pp: int = 1):
        self.tp, self.cp, self.dp, self.pp = tp, cp, dp, pp
        self.t, self.c, self.r, self.s = 0, c, r, 0
        self.check_group = FakeGroup(dp * cp * tp * pp, "all")
        self.stage_check_group = FakeGroup(dp * cp * tp, "stage")
        self._cp = FakeGroup(cp, "cp")
        self._pool: dict = {}
        self.labels: dict = {}

    def label(self, group) -> str:
        return getattr(group, "name", "?")

    def cp_group(self):
        return self._cp

    def pool_group(self, pool: int):
        return self._pool.setdefault(pool, FakeGroup(pool, f"pool of {pool}") if pool > 1 else None)


class CollectiveLog:
    """What the stand-in collectives were asked to move."""

    def __init__(self):
        self.calls: list = []  # (kind, group size, bytes out of this rank)


def _fake_all_to_all(log: CollectiveLog):
    def all_to_all(out, inp, out_splits, in_splits, group, counter, kind, async_op=False):
        if out.device != inp.device:
            raise StandInError(f"{kind}: all_to_all between {inp.device} and {out.device}")
        if sum(out_splits) != out.numel() or sum(in_splits) != inp.numel():
            raise StandInError(f"{kind}: split sizes {sum(in_splits)} -> {sum(out_splits)} do not "
                               f"cover the buffers ({inp.numel()} -> {out.numel()})")
        size = _group_size(group)
        if len(out_splits) != size or len(in_splits) != size:
            raise StandInError(f"{kind}: {len(in_splits)} splits for a group of {size}")
        if any(not isinstance(n, int) for n in list(out_splits) + list(in_splits)):
            raise StandInError(f"{kind}: split sizes must be host ints")
        log.calls.append((kind, size, sum(in_splits) * inp.element_size()))
        return _Done() if async_op else None

    return all_to_all


def _fake_send_recv(log: CollectiveLog):
    def send_recv(transfers, group, counter, async_op=False):
        size = _group_size(group)
        for kind, sends, recvs in transfers:
            for what, pairs in (("send", sends), ("receive", recvs)):
                for j, t in pairs:
                    if not 0 <= j < size:
                        raise StandInError(f"{kind}: {what} with member {j} of a group of {size}")
                    if not t.is_contiguous():
                        raise StandInError(f"{kind}: {what} of a non-contiguous tensor "
                                           f"{tuple(t.shape)} / {t.stride()}")
                    if t.device != (sends or recvs)[0][1].device:
                        raise StandInError(f"{kind}: {what} on {t.device}, the transfer's other "
                                           f"tensors on {(sends or recvs)[0][1].device}")
            log.calls.append((kind, size, sum(t.numel() * t.element_size() for _, t in sends)))
        return _Done() if async_op and transfers else None

    return send_recv


def _fake_all_gather_rows(log: CollectiveLog):
    def all_gather_rows(x, group, counter, kind):
        size = _group_size(group)
        log.calls.append((kind, size, x.numel() * x.element_size()))
        return x.new_empty(size * x.shape[0], *x.shape[1:])

    return all_gather_rows


@contextlib.contextmanager
def fake_collectives():
    """The operator's all-to-alls and all-gathers replaced by checking stand-ins; yields their
    log."""
    log = CollectiveLog()
    saved = (exchange.all_to_all, exchange.all_gather_rows, exchange.send_recv)
    exchange.all_to_all, exchange.all_gather_rows, exchange.send_recv = (
        _fake_all_to_all(log), _fake_all_gather_rows(log), _fake_send_recv(log))
    try:
        yield log
    finally:
        exchange.all_to_all, exchange.all_gather_rows, exchange.send_recv = saved


# -- torch.distributed with fake tensors (the training step's own collectives) ----------------

_DEVICE_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_tensor", "broadcast", "all_to_all_single",
                       "_all_gather_base", "_reduce_scatter_base")
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                       "scatter_object_list")


@contextlib.contextmanager
def fake_distributed():
    """torch.distributed as a one-process training step on the fake device uses it: collectives
    over fake (device) tensors move nothing (their counts are logged), those over host tensors
    and picklable objects run for real on the gloo group, outside the fake mode. Yields the log
    of faked calls."""

    log: list = []

    def tensors(args, kwargs):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                yield from (x for x in a if isinstance(x, torch.Tensor))

    def device_collective(name, original):
        def call(*args, **kwargs):
            if any(isinstance(t, FakeTensor) for t in tensors(args, kwargs)):
                log.append(name)
                return _Done() if kwargs.get("async_op") else None
            return original(*args, **kwargs)
        return call

    def host_collective(original):
        def call(*args, **kwargs):
            with _disable_current_modes():
                return original(*args, **kwargs)
        return call

    saved = {n: getattr(dist, n) for n in _DEVICE_COLLECTIVES + _OBJECT_COLLECTIVES
             if hasattr(dist, n)}
    for n in saved:
        setattr(dist, n, device_collective(n, saved[n]) if n in _DEVICE_COLLECTIVES
                else host_collective(saved[n]))
    try:
        yield log
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _module_cuda(self, device=None):
    """Module.cuda() with fake parameters: parameters and buffers not on the device move there
    as new tensors (a fake parameter cannot be swapped in place, as Module._apply does)."""
    for m in self.modules():
        for key, p in list(m._parameters.items()):
            if p is not None and p.device.type != "cuda":
                m._parameters[key] = torch.nn.Parameter(p.detach().to("cuda"),
                                                        requires_grad=p.requires_grad)
        for key, b in list(m._buffers.items()):
            if b is not None and b.device.type != "cuda":
                m._buffers[key] = b.to("cuda")
    return self


@contextlib.contextmanager
def fake_module_cuda():
    saved = torch.nn.Module.cuda
    torch.nn.Module.cuda = _module_cuda
    try:
        yield
    finally:
        torch.nn.Module.cuda = saved


@contextlib.contextmanager
def moe_counts(probe):
    """LibraMoELayer's host read of expert token counts (`_host_counts`, allow-listed as
    "moe-counts") made on the fake device: logged on the probe, and counts returned that a
    routing could give (each source's padded rows x top-k pairs, half of them on expert 0, so
    the planner replicates it and the copies' path runs)."""

    def host_counts(self, copied):
        probe.current().allowed.append(("moe-counts", _where()))
        ep, experts = copied[0].shape
        pairs = (moe_layer.step_rows() or 64) * self.config.moe_router_topk
        counts = np.full((ep, experts), (pairs // 2) // (experts - 1), dtype=np.int64)
        counts[:, 0] = pairs - counts[:, 1:].sum(1)
        return counts

    saved = moe_layer.LibraMoELayer._host_counts
    moe_layer.LibraMoELayer._host_counts = host_counts
    try:
        yield
    finally:
        moe_layer.LibraMoELayer._host_counts = saved
