"""Fused row gathers and scatters: several (buffer, index) parts moved by one device op.

The exchange moves rows (vectors: one head of one token, `d` elements) between its buffers by
index arrays built once per slot (`meta.upload`). Q, K and V - or dQ, dK and dV - travel
together, so their gathers and scatters come in groups of two to six parts. Each group is one
op here, and one kernel launch on a GPU:

  gather_rows_(outs, srcs, idxs)             outs[p][r] = srcs[p][idxs[p][r]]
  scatter_rows_(dsts, idxs, srcs, adds)      dsts[p][idxs[p][r]] = srcs[p][r]   (adds[p]: +=)
  sum_rows_(dsts, rows, srcs, idxs, offs, adds)
      dsts[p][rows[p][j]] = sum over k in [offs[p][j], offs[p][j+1]) of srcs[p][idxs[p][k]]
      (adds[p]: +=), each sum in fp32 in k order and rounded once; an empty rows / idxs / offs
      stands for the identity (j, k, one k per j). It sums the K/V gradients returned for
      rows that several pool members read, deterministically (no atomics: an output row is
      addressed once per part), and moves rows between two buffers at the same index.

Every tensor is [rows, d] with unit stride along d and one dtype per call; indices are int32 or
int64 on the same device. On CUDA, with Triton installed, one Triton kernel runs every part: a
grid of (row blocks of the largest part, parts), each program moving a block of one part's rows.
An accumulating part adds with atomics, as `index_add_` does on CUDA (a row addressed several
times gets each addition once, in an order the hardware picks); with
`torch.use_deterministic_algorithms(True)` a scatter that adds runs the torch ops instead.
Elsewhere (CPU, or CUDA without Triton) each part is one `index_select` / `index_put_` /
`index_add_`, in part order; a write part whose index repeats a row keeps one of the values,
as `index_put_` does.

Both are `torch.library` custom ops that mutate their first argument, so a dispatch mode (the
GPU-readiness gate's probe, `measure.traffic.TrafficProbe`) sees one op per call: `written`
names the tensors it writes, `measure.traffic.op_bytes` prices what it reads and writes.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

MAX_PARTS = 6
"""Parts one call may carry (the kernel's pointer arguments)."""

NAMESPACE = "libra"


def _check(name: str, a: list, b: list, c: list) -> None:
    if not (len(a) == len(b) == len(c)) or not 1 <= len(a) <= MAX_PARTS:
        raise ValueError(f"{name}: 1 to {MAX_PARTS} parts with one tensor of each kind per part, "
                         f"got {len(a)} / {len(b)} / {len(c)}")
    dtype, device = a[0].dtype, a[0].device
    for p, x in enumerate(a):
        if x.dtype != dtype or x.device != device or b[p].dtype != dtype:
            raise ValueError(f"{name}: part {p} has dtype {x.dtype} / {b[p].dtype} on "
                             f"{x.device}; the call's is {dtype} on {device}")
        if x.dim() != 2 or b[p].dim() != 2 or x.shape[1] != b[p].shape[1]:
            raise ValueError(f"{name}: part {p} must be two [rows, d] tensors of one d, got "
                             f"{tuple(x.shape)} and {tuple(b[p].shape)}")
        if c[p].dim() != 1 or c[p].dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: part {p}'s index must be 1-D int32 / int64, got "
                             f"{tuple(c[p].shape)} {c[p].dtype}")


@torch.library.custom_op(f"{NAMESPACE}::gather_rows_", mutates_args=("outs",))
def gather_rows_(outs: list[Tensor], srcs: list[Tensor], idxs: list[Tensor]) -> None:
    """outs[p][r] = srcs[p][idxs[p][r]] for every part p, in one op."""
    _check("gather_rows_", outs, srcs, idxs)
    for p, (o, s, i) in enumerate(zip(outs, srcs, idxs)):
        if o.shape[0] != i.shape[0]:
            raise ValueError(f"gather_rows_: part {p} has {o.shape[0]} rows out and "
                             f"{i.shape[0]} indices")
    if _use_triton(outs[0]):
        _launch(outs, srcs, idxs, gather=True, adds=(False,) * len(outs))
        return
    for o, s, i in zip(outs, srcs, idxs):
        torch.index_select(s, 0, i, out=o)


@gather_rows_.register_fake
def _gather_fake(outs, srcs, idxs) -> None:
    _check("gather_rows_", outs, srcs, idxs)


@torch.library.custom_op(f"{NAMESPACE}::scatter_rows_", mutates_args=("dsts",))
def scatter_rows_(dsts: list[Tensor], idxs: list[Tensor], srcs: list[Tensor],
                  adds: list[bool]) -> None:
    """dsts[p][idxs[p][r]] = srcs[p][r] (adds[p]: +=) for every part p, in one op."""
    _check("scatter_rows_", dsts, srcs, idxs)
    if len(adds) != len(dsts):
        raise ValueError(f"scatter_rows_: {len(adds)} add flags for {len(dsts)} parts")
    for p, (s, i) in enumerate(zip(srcs, idxs)):
        if s.shape[0] != i.shape[0]:
            raise ValueError(f"scatter_rows_: part {p} has {s.shape[0]} source rows and "
                             f"{i.shape[0]} indices")
    if _use_triton(dsts[0], adds=any(adds)):
        _launch(dsts, srcs, idxs, gather=False, adds=tuple(adds))
        return
    for d, i, s, add in zip(dsts, idxs, srcs, adds):
        if add:
            d.index_add_(0, i, s)
        else:
            d.index_put_((i,), s)


@scatter_rows_.register_fake
def _scatter_fake(dsts, idxs, srcs, adds) -> None:
    _check("scatter_rows_", dsts, srcs, idxs)


def _sum_parts(rows: list, idxs: list, offs: list) -> list:
    """Per part of a `sum_rows_` call, (outputs, source rows read)."""
    out = []
    for r, i, o in zip(rows, idxs, offs):
        n = int(r.shape[0]) if r.numel() else int(o.shape[0]) - 1 if o.numel() else \
            int(i.shape[0])
        out.append((n, int(i.shape[0]) if i.numel() else n))
    return out


def _check_sum(dsts, rows, srcs, idxs, offs, adds) -> list:
    _check("sum_rows_", dsts, srcs, idxs)
    if not (len(rows) == len(offs) == len(adds) == len(dsts)):
        raise ValueError(f"sum_rows_: {len(rows)} row indices, {len(offs)} offsets and "
                         f"{len(adds)} add flags for {len(dsts)} parts")
    parts = _sum_parts(rows, idxs, offs)
    for p, ((n, k), r, i, o) in enumerate(zip(parts, rows, idxs, offs)):
        for what, x in (("row index", r), ("offsets", o)):
            if x.dim() != 1 or x.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"sum_rows_: part {p}'s {what} must be 1-D int32 / int64, "
                                 f"got {tuple(x.shape)} {x.dtype}")
        if o.numel() and not i.numel():
            raise ValueError(f"sum_rows_: part {p} has offsets but no source index")
        if not (r.numel() or o.numel() or i.numel()):
            raise ValueError(f"sum_rows_: part {p} has no row index, offsets or source index")
        if r.numel() and o.numel() and o.shape[0] != n + 1:
            raise ValueError(f"sum_rows_: part {p} has {n} rows and {o.shape[0]} offsets "
                             f"(rows + 1 expected)")
        if not r.numel() and n > dsts[p].shape[0]:
            raise ValueError(f"sum_rows_: part {p} writes {n} rows into {dsts[p].shape[0]}")
        if not i.numel() and k > srcs[p].shape[0]:
            raise ValueError(f"sum_rows_: part {p} reads {k} rows of {srcs[p].shape[0]}")
    return parts


@torch.library.custom_op(f"{NAMESPACE}::sum_rows_", mutates_args=("dsts",))
def sum_rows_(dsts: list[Tensor], rows: list[Tensor], srcs: list[Tensor], idxs: list[Tensor],
              offs: list[Tensor], adds: list[bool]) -> None:
    """dsts[p][rows[p][j]] (+)= sum of srcs[p][idxs[p][k]], k in [offs[p][j], offs[p][j+1])
    for every part p, in one op (see the module; an output row is addressed once per part)."""
    parts = _check_sum(dsts, rows, srcs, idxs, offs, adds)
    if _use_triton(dsts[0]) and dsts[0].dtype in _TRITON_DTYPES:
        _launch_sum(dsts, rows, srcs, idxs, offs, adds, parts)
        return
    for d, r, s, i, o, add, (n, k) in zip(dsts, rows, srcs, idxs, offs, adds, parts):
        acc = torch.promote_types(s.dtype, torch.float32)
        x = (s.index_select(0, i) if i.numel() else s[:k]).to(acc)
        if o.numel():  # each output's run of sources, summed in order
            seg = torch.repeat_interleave(torch.arange(n, device=s.device), o.diff(),
                                          output_size=k)
            x = x.new_zeros(n, x.shape[1]).index_add_(0, seg, x)
        x = x.to(d.dtype)
        if r.numel() and add:
            d.index_add_(0, r, x)
        elif r.numel():
            d.index_put_((r,), x)
        elif add:
            d[:n].add_(x)
        else:
            d[:n].copy_(x)


@sum_rows_.register_fake
def _sum_fake(dsts, rows, srcs, idxs, offs, adds) -> None:
    _check_sum(dsts, rows, srcs, idxs, offs, adds)


def gather(srcs: list, idxs: list, out: Tensor | None = None) -> tuple[Tensor, list]:
    """The parts gathered into one new [rows, d] buffer, part after part (or into `out`).
    Returns (the buffer, each part's rows as a view of it)."""
    n = [int(i.shape[0]) for i in idxs]
    if out is None:
        out = srcs[0].new_empty(sum(n), srcs[0].shape[1])
    views = list(out.split(n)) if len(n) > 1 else [out]
    if sum(n):
        gather_rows_(views, srcs, idxs)
    return out, views


def gather_into(outs: list, srcs: list, idxs: list) -> None:
    """`gather_rows_` into given buffers (nothing launched when no part has rows)."""
    if any(int(i.shape[0]) for i in idxs):
        gather_rows_(outs, srcs, idxs)


def sum_into(dsts: list, rows: list, srcs: list, idxs: list, offs: list, adds: list) -> None:
    """`sum_rows_` over the parts that have outputs (an empty call launches nothing); None for a
    row index, source index or offsets: the identity. A part has as many outputs as its row
    index has entries, else its offsets groups, else its source index entries."""
    parts = []
    for p in range(len(dsts)):
        r, i, o = rows[p], idxs[p], offs[p]
        n = int(r.shape[0]) if r is not None else int(o.shape[0]) - 1 if o is not None else \
            int(i.shape[0]) if i is not None else None
        if n is None:
            raise ValueError(f"sum_into: part {p} has no row index, offsets or source index")
        if n:
            empty = None if None not in (r, i, o) else \
                torch.empty(0, dtype=torch.int32, device=dsts[p].device)
            r, i, o = (x if x is not None else empty for x in (r, i, o))
            parts.append((dsts[p], r, srcs[p], i, o, adds[p]))
    if parts:
        sum_rows_(*(list(x) for x in zip(*parts)))


def scatter(dsts: list, idxs: list, srcs: list, adds: list) -> None:
    """`scatter_rows_` over the parts that move rows (an empty call launches nothing)."""
    keep = [p for p in range(len(dsts)) if idxs[p].shape[0]]
    if keep:
        scatter_rows_([dsts[p] for p in keep], [idxs[p] for p in keep],
                      [srcs[p] for p in keep], [adds[p] for p in keep])


# ----------------------------------------------------------------------------------------------
# What a dispatch mode sees
# ----------------------------------------------------------------------------------------------


def is_rowop(func) -> bool:
    return getattr(func, "namespace", None) == NAMESPACE


def written(func, args, kwargs) -> list:
    """The tensors a row op writes (its first argument's)."""
    first = args[0] if args else next(iter(kwargs.values()))
    return list(first)


# ----------------------------------------------------------------------------------------------
# The CUDA kernel
# ----------------------------------------------------------------------------------------------


def _use_triton(x: Tensor, adds: bool = False) -> bool:
    """Whether the Triton kernel runs: on CUDA (or under Triton's CPU interpreter) with Triton
    installed - except for a scatter that adds while torch.use_deterministic_algorithms is set,
    which takes `index_add_`'s deterministic path instead of atomics."""
    if adds and torch.are_deterministic_algorithms_enabled():
        return False
    return (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and \
        have_triton()


@functools.cache
def have_triton() -> bool:
    """Triton is installed (imported only where its kernel runs: CPU processes never load it)."""
    return importlib.util.find_spec("triton") is not None


BLOCK_ROWS = 16
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What `sum_rows_`'s kernel sums (in fp32); fp64 takes the torch path."""


def _launch(bufs: list, srcs: list, idxs: list, gather: bool, adds: tuple) -> None:
    """One launch over every part: `bufs` are the gather's outputs or the scatter's
    destinations."""
    parts = len(bufs)
    d = bufs[0].shape[1]
    rows = [int(i.shape[0]) for i in idxs]
    if not max(rows):
        return
    pad = MAX_PARTS - parts
    args = []
    for b, s, i, n in zip(bufs, srcs, idxs, rows):
        args += [b, s, i, n, b.stride(0), s.stride(0)]
    args += [bufs[0], srcs[0], idxs[0], 0, 0, 0] * pad
    add_mask = sum(1 << p for p, a in enumerate(adds) if a)
    triton, kernel = _kernel()
    grid = (triton.cdiv(max(rows), BLOCK_ROWS), parts)
    kernel[grid](*args, d, GATHER=gather, ADDS=add_mask, BLOCK_R=BLOCK_ROWS,
                 BLOCK_D=triton.next_power_of_2(d))


def _launch_sum(dsts, rows, srcs, idxs, offs, adds, parts) -> None:
    """`sum_rows_`'s one launch: a grid of (output row blocks of the largest part, parts)."""
    n = [p[0] for p in parts]
    if not max(n):
        return
    args = []
    flags = 0
    for p, (d, r, s, i, o) in enumerate(zip(dsts, rows, srcs, idxs, offs)):
        args += [d, r if r.numel() else d, s, i if i.numel() else d, o if o.numel() else d,
                 n[p], d.stride(0), s.stride(0)]
        flags |= (bool(r.numel()) << (4 * p)) | (bool(i.numel()) << (4 * p + 1)) | \
            (bool(o.numel()) << (4 * p + 2)) | (bool(adds[p]) << (4 * p + 3))
    args += args[:8] * (MAX_PARTS - len(dsts))
    triton, kernel = _sum_kernel()
    grid = (triton.cdiv(max(n), BLOCK_ROWS), len(dsts))
    kernel[grid](*args, dsts[0].shape[1], FLAGS=flags, BLOCK_R=BLOCK_ROWS,
                 BLOCK_D=triton.next_power_of_2(dsts[0].shape[1]))


@functools.cache
def _sum_kernel():
    """(triton, `sum_rows_`'s kernel), imported at first use as `_kernel` is."""
    # deferred: Triton reads TRITON_INTERPRET when the kernel is defined
    from libra_ext.attention import _rowops_kernel as k

    return k.triton, k.sum_kernel


@functools.cache
def _kernel():
    """(triton, the row kernel): their module is imported at first use (TRITON_INTERPRET is
    read then), so a process that never launches it never loads Triton."""
    # deferred: Triton reads TRITON_INTERPRET when the kernel is defined
    from libra_ext.attention import _rowops_kernel as k

    return k.triton, k.rows_kernel
