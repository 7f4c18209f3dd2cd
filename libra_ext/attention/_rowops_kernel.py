"""The Triton kernel of `rowops` (imported only where it runs: see `rowops._kernel`)."""

import triton
import triton.language as tl


@triton.jit
def _move(buf, src, idx, n, bstride, sstride, d, block, GATHER: tl.constexpr,
          ADD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [block * BLOCK_R, ...) of one part."""
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    rmask = r < n
    mask = rmask[:, None] & (c < d)[None, :]
    at = tl.load(idx + r, mask=rmask, other=0).to(tl.int64)
    r64 = r.to(tl.int64)
    if GATHER:
        x = tl.load(src + at[:, None] * sstride + c[None, :], mask=mask)
        tl.store(buf + r64[:, None] * bstride + c[None, :], x, mask=mask)
    else:
        x = tl.load(src + r64[:, None] * sstride + c[None, :], mask=mask)
        dst = buf + at[:, None] * bstride + c[None, :]
        if ADD:
            tl.atomic_add(dst, x, mask=mask)
        else:
            tl.store(dst, x, mask=mask)

@triton.jit
def rows_kernel(b0, s0, i0, n0, bs0, ss0, b1, s1, i1, n1, bs1, ss1,
                 b2, s2, i2, n2, bs2, ss2, b3, s3, i3, n3, bs3, ss3,
                 b4, s4, i4, n4, bs4, ss4, b5, s5, i5, n5, bs5, ss5,
                 d, GATHER: tl.constexpr, ADDS: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    block = tl.program_id(0)
    part = tl.program_id(1)
    if part == 0:
        _move(b0, s0, i0, n0, bs0, ss0, d, block, GATHER, (ADDS >> 0) & 1, BLOCK_R, BLOCK_D)
    elif part == 1:
        _move(b1, s1, i1, n1, bs1, ss1, d, block, GATHER, (ADDS >> 1) & 1, BLOCK_R, BLOCK_D)
    elif part == 2:
        _move(b2, s2, i2, n2, bs2, ss2, d, block, GATHER, (ADDS >> 2) & 1, BLOCK_R, BLOCK_D)
    elif part == 3:
        _move(b3, s3, i3, n3, bs3, ss3, d, block, GATHER, (ADDS >> 3) & 1, BLOCK_R, BLOCK_D)
    elif part == 4:
        _move(b4, s4, i4, n4, bs4, ss4, d, block, GATHER, (ADDS >> 4) & 1, BLOCK_R, BLOCK_D)
    else:
        _move(b5, s5, i5, n5, bs5, ss5, d, block, GATHER, (ADDS >> 5) & 1, BLOCK_R, BLOCK_D)


@triton.jit
def _sum(dst, rows, src, idx, offs, n, dstride, sstride, d, block, FLAGS: tl.constexpr,
         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Output rows [block * BLOCK_R, ...) of one part of `rowops.sum_rows_` (FLAGS: has a row
    index, a source index, offsets; adds)."""
    j = block * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    jmask = j < n
    cmask = (c < d)[None, :]
    if FLAGS & 1:
        out = tl.load(rows + j, mask=jmask, other=0).to(tl.int64)
    else:
        out = j.to(tl.int64)
    if FLAGS & 4:
        lo = tl.load(offs + j, mask=jmask, other=0).to(tl.int64)
        hi = tl.load(offs + j + 1, mask=jmask, other=0).to(tl.int64)
    else:
        lo = j.to(tl.int64)
        hi = tl.where(jmask, lo + 1, lo)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    most = tl.max(hi - lo, axis=0)
    for t in range(0, most):
        k = lo + t
        m = jmask & (k < hi)
        if FLAGS & 2:
            at = tl.load(idx + k, mask=m, other=0).to(tl.int64)
        else:
            at = k
        x = tl.load(src + at[:, None] * sstride + c[None, :], mask=m[:, None] & cmask, other=0)
        acc += x.to(tl.float32)
    mask = jmask[:, None] & cmask
    ptr = dst + out[:, None] * dstride + c[None, :]
    val = acc.to(dst.dtype.element_ty)
    if FLAGS & 8:
        old = tl.load(ptr, mask=mask, other=0)
        val = (old.to(tl.float32) + val.to(tl.float32)).to(dst.dtype.element_ty)
    tl.store(ptr, val, mask=mask)


@triton.jit
def sum_kernel(d0, r0, s0, i0, o0, n0, ds0, ss0, d1, r1, s1, i1, o1, n1, ds1, ss1,
               d2, r2, s2, i2, o2, n2, ds2, ss2, d3, r3, s3, i3, o3, n3, ds3, ss3,
               d4, r4, s4, i4, o4, n4, ds4, ss4, d5, r5, s5, i5, o5, n5, ds5, ss5,
               d, FLAGS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    block = tl.program_id(0)
    part = tl.program_id(1)
    if part == 0:
        _sum(d0, r0, s0, i0, o0, n0, ds0, ss0, d, block, (FLAGS >> 0) & 15, BLOCK_R, BLOCK_D)
    elif part == 1:
        _sum(d1, r1, s1, i1, o1, n1, ds1, ss1, d, block, (FLAGS >> 4) & 15, BLOCK_R, BLOCK_D)
    elif part == 2:
        _sum(d2, r2, s2, i2, o2, n2, ds2, ss2, d, block, (FLAGS >> 8) & 15, BLOCK_R, BLOCK_D)
    elif part == 3:
        _sum(d3, r3, s3, i3, o3, n3, ds3, ss3, d, block, (FLAGS >> 12) & 15, BLOCK_R, BLOCK_D)
    elif part == 4:
        _sum(d4, r4, s4, i4, o4, n4, ds4, ss4, d, block, (FLAGS >> 16) & 15, BLOCK_R, BLOCK_D)
    else:
        _sum(d5, r5, s5, i5, o5, n5, ds5, ss5, d, block, (FLAGS >> 20) & 15, BLOCK_R, BLOCK_D)
