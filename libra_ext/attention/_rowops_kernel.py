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
