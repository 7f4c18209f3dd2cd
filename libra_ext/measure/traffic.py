"""What a device op costs in memory traffic, and a probe that counts it on a real device.

`op_bytes` is the one definition the GPU-readiness gate (on fake CUDA) and `libra verify
attention` (on the CPU) share: the bytes an op reads and writes as a kernel would do it. A
gather reads only the rows it gathers (its output's bytes), a scatter writes only the rows it
addresses and reads its source, an indexed add also reads the destination rows it adds to, a
fill only writes, index tensors count once; any other op reads its device inputs and writes its
outputs.

`TrafficProbe` (a TorchDispatchMode) counts, per phase, the ops with an output on its device
(what would be kernel launches; a fused row op of `libra_ext.attention.rowops`, which writes its
first argument in place, is one), their bytes, and the live bytes of the tensors they create,
with the peak. Work inside an attention kernel (`counters.inside_kernel`, entered by the
reference kernel) is the kernel's, not the operator's: its ops are not counted and its transient
workspace does not enter the peak (what it leaves alive - its output and what it saves for
backward - does).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from libra_ext.attention import counters, rowops

_aten = torch.ops.aten

GATHERS = ("index_select", "gather", "index", "embedding")
SCATTERS = ("index_put", "_index_put_impl", "index_copy", "scatter", "index_fill", "masked_fill",
            "masked_scatter")
ADDS = ("index_add", "scatter_add", "index_reduce", "scatter_reduce")
FILLS = ("zero_", "fill_", "zeros", "zeros_like", "new_zeros", "full", "new_full", "full_like",
         "ones", "ones_like", "new_ones", "arange")
INDEX_DTYPES = (torch.int32, torch.int64, torch.bool)
ALLOCATIONS = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.detach.default,
    _aten.lift_fresh.default,
}
"""Ops with a device output that move no bytes (allocations, metadata)."""
COLLECTIVES = ("c10d", "_c10d_functional")
"""Op namespaces of collectives (their buffers are the network's)."""
UNANNOTATED_VIEWS = {_aten._unsafe_view.default}
"""Views whose schema carries no alias annotation (reshape's result after its copy)."""


def outputs(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _tensors(args, kwargs) -> list:
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if isinstance(x, torch.Tensor)]
    return out


def returns_alias(func) -> bool:
    r = func._schema.returns
    return bool(r) and r[0].alias_info is not None and r[0].alias_info.is_write


def is_view(func) -> bool:
    """The op returns views of its inputs (no bytes move, no kernel runs)."""
    returns = func._schema.returns
    return func in UNANNOTATED_VIEWS or bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns)


def op_bytes(func, args, kwargs, out, on) -> int:
    """Bytes op `func` reads and writes on the device (`on(tensor)`: the tensor is there); 0
    for an op without a device output. Copies count only device to device (uploads and
    downloads are transfers). A fused row op (`rowops`) counts each of its parts as its
    single-part peer: a gather part as `index_select`, a scatter part as `index_put_` or, adding,
    `index_add_`."""
    if rowops.is_rowop(func):
        return _row_op_bytes(func, args, kwargs, on)
    name = func.overloadpacket.__name__
    outs = [o for o in outputs(out) if on(o)]
    if not outs:
        return 0

    def nbytes(t) -> int:
        return t.numel() * t.element_size() if on(t) else 0

    tensors = _tensors(args, kwargs)
    index = sum(nbytes(t) for t in tensors[1:] if t.dtype in INDEX_DTYPES)
    if name in FILLS:
        return sum(nbytes(o) for o in outs)
    if name.startswith(GATHERS) and not name.startswith(ADDS + SCATTERS):
        return 2 * sum(nbytes(o) for o in outs) + index
    if name.startswith(ADDS + SCATTERS):
        dst = tensors[0]
        idx = [t for t in tensors[1:] if t.dtype in INDEX_DTYPES]
        rows = (idx[0].numel() if idx and idx[0].dtype != torch.bool
                else dst.shape[0] if dst.dim() else 1)
        row_bytes = nbytes(dst) // max(1, dst.shape[0]) if dst.dim() else nbytes(dst)
        written = rows * row_bytes
        src = sum(nbytes(t) for t in tensors[1:] if t.dtype not in INDEX_DTYPES)
        if name.startswith(ADDS):
            return 2 * written + min(src, written) + index
        return written + min(src, written) + index
    if name in ("copy_", "_to_copy"):
        src, dst = (args[1], args[0]) if name == "copy_" else (args[0], outs[0])
        return nbytes(src) + nbytes(dst) if on(src) and on(dst) else 0
    read = sum(nbytes(t) for t in tensors)
    if returns_alias(func):  # an in-place op writes its first argument
        return read + nbytes(args[0])
    return read + sum(nbytes(o) for o in outs)


def _row_op_bytes(func, args, kwargs, on) -> int:
    """A row op's parts priced by the rules above: a gather part reads and writes its rows, a
    write part writes the rows it addresses and reads its source, an adding part also reads
    the rows it adds to; a summing part reads each source row it sums; the indices count
    once."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args)) | dict(kwargs)

    def nb(t) -> int:
        return t.numel() * t.element_size() if on(t) else 0

    if func.__name__.startswith("gather_rows_"):
        return sum(2 * nb(o) + nb(i) for o, i in zip(bound["outs"], bound["idxs"]))
    if func.__name__.startswith("sum_rows_"):  # the source rows it reads, the rows it writes
        total = 0
        parts = rowops._sum_parts(bound["rows"], bound["idxs"], bound["offs"])
        for (n, k), d, r, i, o, add in zip(parts, bound["dsts"], bound["rows"], bound["idxs"],
                                            bound["offs"], bound["adds"]):
            row = nb(d) // max(1, d.shape[0])
            total += (k + (2 if add else 1) * n) * row + nb(r) + nb(i) + nb(o)
        return total
    return sum((3 if add else 2) * nb(s) + nb(i)
               for s, i, add in zip(bound["srcs"], bound["idxs"], bound["adds"]))


def row_op(func, args, kwargs, on) -> int | None:
    """For a fused row op of `rowops` that writes a tensor where `on` says (one launch, writing
    its first argument in place): its bytes (`op_bytes`). None for any other op - a probe then
    counts it as it counts every op."""
    if not rowops.is_rowop(func) or not any(on(o) for o in rowops.written(func, args, kwargs)):
        return None
    return op_bytes(func, args, kwargs, None, on)


def resized(holders: dict, storage, before: int, after: int) -> int:
    """A probe's live bytes change when a storage it counts (`holders`: storage key -> bytes)
    is freed or grown back in place (`counters.resize_storage`); 0 for one it does not."""
    key = storage._cdata
    if key not in holders:
        return 0
    holders[key] = after
    return after - before


@dataclass
class Phase:
    ops: int = 0
    bytes_by_op: Counter = field(default_factory=Counter)
    start_live: int = 0
    peak_live: int = 0
    end_live: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_op.values())


class TrafficProbe(TorchDispatchMode):
    """Ops, bytes and live bytes on `device_type`, per phase (`start(name)`), on this thread."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.phases: dict[str, Phase] = {}
        self.phase = "setup"
        self.live = 0
        self._holders: dict = {}

    def __enter__(self):
        counters.on_kernel_exit(self._note_peak)
        counters.on_storage_resize(self._resized)
        return super().__enter__()

    def __exit__(self, *exc):
        counters.on_kernel_exit(None)
        counters.on_storage_resize(None)
        return super().__exit__(*exc)

    def _resized(self, storage, before: int, after: int) -> None:
        self.live += resized(self._holders, storage, before, after)
        self._note_peak()

    def on(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device_type

    def start(self, name: str) -> Phase:
        self.current().end_live = self.live
        self.phase = name
        ph = self.phases[name] = Phase(start_live=self.live, peak_live=self.live)
        return ph

    def current(self) -> Phase:
        return self.phases.setdefault(self.phase, Phase())

    def _free(self, key: int) -> None:
        self.live -= self._holders.pop(key, 0)

    def _note_peak(self) -> None:
        ph = self.current()
        ph.peak_live = max(ph.peak_live, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        row_bytes = row_op(func, args, kwargs, self.on)
        if row_bytes is not None:  # one launch, writing its first argument in place
            if not counters.in_kernel():
                ph = self.current()
                ph.ops += 1
                ph.bytes_by_op[func.__name__] += row_bytes
            return out
        outs = [o for o in outputs(out) if self.on(o)]
        if not outs or is_view(func) or func.namespace in COLLECTIVES:
            return out  # (a collective's transfers are the network's, not device traffic)
        ph = self.current()
        if not counters.in_kernel() and func not in ALLOCATIONS:
            ph.ops += 1
            ph.bytes_by_op[func.__name__] += op_bytes(func, args, kwargs, out, self.on)
        if not any(r.alias_info is not None for r in func._schema.returns):
            for o in outs:
                storage = o.untyped_storage()
                key = storage._cdata
                if key not in self._holders:
                    self._holders[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        if not counters.in_kernel():
            self._note_peak()
        return out


class HeldOutput(torch.autograd.Function):
    """The layer's output projection as memory sees it (Megatron's linear_proj): it holds the
    attention output through the forward (its saved input, for the weight gradient) and releases
    it in its own backward, which runs before the attention's; the gradient it hands on is
    `grad`."""

    @staticmethod
    def forward(ctx, out, grad):
        ctx.out, ctx.grad = out, grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad, ctx.grad, ctx.out = ctx.grad, None, None
        return grad, None


def layer_call(probe, call, q0, k0, v0, grad=None, ops=lambda ph: ph.ops,
               kernel_ops: tuple = (), inspect=None) -> dict:
    """Forward and backward of `call(q, k, v)` as a layer makes them, measured by `probe`
    (phases "proj", "fwd", "bwd"): Q/K/V made by the projection (clones of q0, k0, v0), the
    output held by the output projection until its backward (`HeldOutput`), the output
    gradient `grad` (a clone handed on, as a projection hands on its own; uninitialized when
    None); `inspect(out)`, when given, sees the output
    between the forward and the backward, outside both phases. Returns per layer call the device
    ops forward and backward (`ops(phase)`), the extra device bytes (every op's but the kernels':
    names starting with `kernel_ops`) in bytes and over the layer's Q/K/V bytes, by op, and the
    bytes kept for backward and at the peak over Q/K/V."""
    made = probe.start("proj")
    q, k, v = q0.clone(), k0.clone(), v0.clone()  # the layer's Q/K/V, made by its projection
    if grad is not None:  # the projection's own: handed on, held by no one else
        grad = grad.clone()
    fwd = probe.start("fwd")
    out = call(q, k, v)
    del q, k, v  # kept alive now only by what the call saved for backward
    if grad is None:
        grad = torch.empty_like(out)
    out_bytes = out.numel() * out.element_size() + grad.numel() * grad.element_size()
    held = HeldOutput.apply(out, grad)
    del grad  # the projection hands it on: autograd holds it while the first node runs
    if inspect is not None:
        probe.start("inspect")
        inspect(out)
    del out  # held by the projection only, until its backward
    bwd = probe.start("bwd")
    held.backward()
    probe.start("done")
    qkv = sum(x.numel() * x.element_size() for x in (q0, k0, v0))
    by_op: dict = {}
    for ph in (fwd, bwd):
        for op, n in ph.bytes_by_op.items():
            if kernel_ops and op.startswith(kernel_ops):
                continue
            by_op[op] = by_op.get(op, 0) + n
    extra = sum(by_op.values())
    return {
        "phases": (made, fwd, bwd),
        "device_ops_fwd": ops(fwd),
        "device_ops_bwd": ops(bwd),
        "device_ops": ops(fwd) + ops(bwd),
        "qkv_bytes": qkv,
        "extra_device_bytes": extra,
        "extra_over_qkv": extra / qkv,
        "extra_by_op": dict(sorted(by_op.items(), key=lambda x: -x[1])),
        "kept": (fwd.end_live - made.start_live - out_bytes) / qkv,
        "peak": (max(fwd.peak_live, bwd.peak_live) - made.start_live) / qkv,
    }
