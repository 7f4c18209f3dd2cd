"""Attention kernels and the backend ladder.

Every backend runs one *batched varlen call*: packed queries `q [n_q, hc, d]` and keys/values
`k, v [n_k, hk, d]` cut into segments by `cu_q` / `cu_k` (int32, on the query's device). Segment
i's query rows attend to its keys causally aligned to the bottom right: query row r of a segment
with q_len rows and k_len keys sees keys [0, r + k_len - q_len]. A tile of query rows [a, b) of
a document against its prefix [0, b) is such a segment. GQA is native: query head j uses KV head
j // (hc / hk). The call is differentiable with the kernel's own backward (no recomputed forward
around it).

Backends, best first (the choice is a pure function of `KernelParams`, cached, with one log line
for the pick and one debug line per backend skipped and why):

- `te`: Transformer Engine `DotProductAttention` (qkv_format="thd", padding_causal_bottom_right),
  one module per (layer, head counts);
- `flash`: flash-attn's `flash_attn_varlen_func` (FlashAttention-3's interface when installed,
  else FlashAttention-2);
- `varlen`: PyTorch's `torch.nn.attention.varlen.varlen_attn` (every CUDA build of PyTorch >=
  2.10; signature differences between releases are detected);
- `reference`: the PyTorch math on the host's segments, in fp32 or better, with its analytic
  backward from the saved output and log-sum-exp. It is the CPU path; on a GPU it refuses work
  beyond `REFERENCE_GPU_LIMIT` score elements and names the packages to install.

`system.attention_backend` (or LIBRA_ATTENTION_BACKEND) forces one; a forced backend that is not
installed or cannot run these inputs raises, naming the package.

Shape legend (shared by the attention modules; `meta` gives the index-array details):
  S tokens of a packed sequence; C cp ranks; t = S / C (padded) tokens of one cp rank;
  h, h_kv query and KV heads of a rank (after tp); hl = h / C, kvl = max(1, h_kv / C) heads of
  its Ulysses slice; d head dim; W = hl + 2 kvl vectors per token of the Ulysses buffer
  X [C*t, W, d]; P pool members; n_q, n_k rows and hc, hk heads of one batched kernel call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from libra_ext.attention import BACKENDS  # kernel backends, best first (one list)

logger = logging.getLogger(__name__)

try:  # FlashAttention-3 (Hopper) ships as flash_attn_interface
    from flash_attn_interface import flash_attn_varlen_func as _flash_varlen

    HAVE_FLASH, FLASH_VERSION = True, 3
except Exception:
    try:
        from flash_attn import flash_attn_varlen_func as _flash_varlen

        HAVE_FLASH, FLASH_VERSION = True, 2
    except Exception:
        HAVE_FLASH, FLASH_VERSION = False, 0

try:
    from transformer_engine.pytorch import DotProductAttention as _TEDotProductAttention

    HAVE_TE = True
except Exception:
    HAVE_TE = False

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    HAVE_VARLEN = True
    _VARLEN_ARGS = set(inspect.signature(_varlen_attn).parameters)
except Exception:
    HAVE_VARLEN, _VARLEN_ARGS = False, set()


def _varlen_ops():
    """varlen_attn's own forward and backward ops (torch_attn::_varlen_attn and
    _varlen_attn_backward), where their leading arguments are the ones the GQA path passes."""
    want_fwd = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
                "scale", "window_size"]
    want_bwd = ["grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q",
                "max_k", "is_causal", "rng_state", "scale", "window_size"]
    try:
        fwd = torch.ops.torch_attn._varlen_attn.default
        bwd = torch.ops.torch_attn._varlen_attn_backward.default
    except (AttributeError, RuntimeError):
        return None
    names = [[a.name for a in op._schema.arguments] for op in (fwd, bwd)]
    if names[0][: len(want_fwd)] != want_fwd or names[1][: len(want_bwd)] != want_bwd:
        return None
    return fwd, bwd


_VARLEN_OPS = _varlen_ops() if HAVE_VARLEN else None
"""(forward, backward) of varlen_attn's ops, for GQA without enable_gqa (None: not usable)."""

REFERENCE_GPU_LIMIT = 1 << 28
"""Score elements (query rows x keys x heads, summed over segments) above which the reference
refuses to run on a GPU: its memory grows with them, the fused kernels' does not."""

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Segments:
    """The segment layout of one batched call: device cumulative lengths plus host copies (the
    reference slices with the host copies, so it never reads a device tensor back)."""

    cu_q: torch.Tensor
    """[n_seg + 1] int32 query offsets, on the compute device."""
    cu_k: torch.Tensor
    """[n_seg + 1] int32 key offsets, on the compute device."""
    max_q: int
    max_k: int
    host_q: np.ndarray
    """[n_seg + 1] the same offsets on the host."""
    host_k: np.ndarray
    work: tuple | None = None
    """The reference kernel's work items with their index tensors, made ahead of the call (on
    CPU, where the reference runs; None: made by the call)."""

    @classmethod
    def from_host(cls, cu_q: torch.Tensor, cu_k: torch.Tensor, host_q, host_k,
                  reference_work: bool = False) -> "Segments":
        """Device offsets with their host copies; the longest segments from the host copies;
        with `reference_work`, the reference kernel's work items too."""
        hq = np.asarray(host_q, dtype=np.int64)
        hk = np.asarray(host_k, dtype=np.int64)
        seg = cls(cu_q, cu_k, int(np.diff(hq).max(initial=0)), int(np.diff(hk).max(initial=0)),
                  hq, hk)
        if reference_work:
            seg = dataclasses.replace(seg, work=tuple(_work(seg, cu_q.device)))
        return seg


@dataclass(frozen=True)
class KernelParams:
    """Everything that decides the kernel."""

    device_type: str
    """"cuda" or "cpu"."""
    dtype: torch.dtype
    head_dim: int
    forced: str | None = None
    """A backend name to use regardless of the ladder (None: best available)."""


class Backend:
    """A chosen kernel: `attend(q, k, v, seg, scale, key)` -> out [n_q, hc, d] (autograd)."""

    name = "base"

    def attend(self, q, k, v, seg: Segments, scale: float, key=None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Backend({self.name})"


class ReferenceBackend(Backend):
    name = "reference"

    def attend(self, q, k, v, seg, scale, key=None):
        if q.is_cuda:
            elems = int(np.dot(np.diff(seg.host_q), np.diff(seg.host_k))) * q.shape[1]
            if elems > REFERENCE_GPU_LIMIT:
                raise RuntimeError(
                    f"the PyTorch reference attention would need {elems} score elements on the "
                    f"GPU (limit {REFERENCE_GPU_LIMIT}); install flash-attn or Transformer "
                    "Engine, or use PyTorch >= 2.10 with bf16/fp16 inputs (varlen_attn)"
                )
        return _ReferenceVarlen.apply(q, k, v, seg, scale)


class VarlenBackend(Backend):
    name = "varlen"

    def attend(self, q, k, v, seg, scale, key=None):
        kw = {}
        if "window_size" in _VARLEN_ARGS:
            kw["window_size"] = (-1, 0)  # causal, bottom-right aligned
        else:
            kw["is_causal"] = True
        if "scale" in _VARLEN_ARGS:
            kw["scale"] = scale
        elif abs(scale * q.shape[-1] ** 0.5 - 1.0) > 1e-12:
            q = q * (scale * q.shape[-1] ** 0.5)  # the kernel's fixed scale is 1/sqrt(d)
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in _VARLEN_ARGS:  # native GQA (PyTorch >= 2.13)
                kw["enable_gqa"] = True
            elif _VARLEN_OPS is not None and "window_size" in _VARLEN_ARGS:
                return _VarlenExpandedKV.apply(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k,
                                               kw.get("scale"))
            else:  # PyTorch 2.10: the expanded copies are kept for backward
                g = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return _varlen_attn(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, **kw)


class _VarlenExpandedKV(torch.autograd.Function):
    """varlen_attn for GQA where it has no enable_gqa (PyTorch 2.11, 2.12): K and V expanded to
    the query heads only while its forward or backward op runs. The backward keeps the
    unexpanded K and V (not g copies) and sums the expanded gradients back per KV head (fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        fwd, _ = _VARLEN_OPS
        g = q.shape[1] // k.shape[1]
        out, lse, rng = fwd(q, _expand_heads(k, g), _expand_heads(v, g), cu_q, cu_k, max_q, max_k,
                            True, scale, [-1, 0])
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, rng)
        ctx.args = (max_q, max_k, scale, g)
        return out

    @staticmethod
    def backward(ctx, dout):
        _, bwd = _VARLEN_OPS
        q, k, v, cu_q, cu_k, out, lse, rng = ctx.saved_tensors
        max_q, max_k, scale, g = ctx.args
        dq, dk, dv = bwd(dout.contiguous(), q, _expand_heads(k, g), _expand_heads(v, g), out, lse,
                         cu_q, cu_k, max_q, max_k, True, rng, scale, [-1, 0])
        n, hk, d = k.shape
        dk = dk.view(n, hk, g, d).sum(2, dtype=torch.float32).to(k.dtype)
        dv = dv.view(n, hk, g, d).sum(2, dtype=torch.float32).to(v.dtype)
        return dq, dk, dv, None, None, None, None, None


def _expand_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """[n, hk, d] -> [n, hk * g, d]: query head j reads KV head j // g."""
    return x.repeat_interleave(g, dim=1)


class FlashBackend(Backend):
    name = "flash"

    def attend(self, q, k, v, seg, scale, key=None):
        out = _flash_varlen(
            q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, softmax_scale=scale, causal=True
        )
        return out[0] if isinstance(out, tuple) else out


class TEBackend(Backend):
    """Transformer Engine's DotProductAttention, one module per (layer, heads, KV heads)."""

    name = "te"

    def __init__(self):
        self._modules: dict = {}

    def attend(self, q, k, v, seg, scale, key=None):
        hc, hk, d = q.shape[1], k.shape[1], q.shape[2]
        mk = (key, hc, hk, d, scale)
        mod = self._modules.get(mk)
        if mod is None:
            mod = _TEDotProductAttention(
                num_attention_heads=hc,
                kv_channels=d,
                num_gqa_groups=hk,
                attention_dropout=0.0,
                qkv_format="thd",
                attn_mask_type="padding_causal_bottom_right",
                softmax_scale=scale,
            )
            self._modules[mk] = mod
        out = mod(
            q,
            k,
            v,
            qkv_format="thd",
            cu_seqlens_q=seg.cu_q,
            cu_seqlens_kv=seg.cu_k,
            max_seqlen_q=seg.max_q,
            max_seqlen_kv=seg.max_k,
            attn_mask_type="padding_causal_bottom_right",
        )
        return out.view(q.shape[0], hc, d)


_FACTORIES = {
    "te": TEBackend,
    "flash": FlashBackend,
    "varlen": VarlenBackend,
    "reference": ReferenceBackend,
}


_REQUIREMENTS = {
    # name: (installed?, what to install, what the messages call it, head-dim limits apply)
    "te": (
        lambda: HAVE_TE,
        "Transformer Engine not installed (pip install transformer_engine[pytorch])",
        "Transformer Engine's fused THD attention",
        False,
    ),
    "flash": (lambda: HAVE_FLASH, "flash-attn not installed (pip install flash-attn)",
              "flash-attn", True),
    "varlen": (
        lambda: HAVE_VARLEN,
        f"torch.nn.attention.varlen needs PyTorch >= 2.10 (have {torch.__version__})",
        "varlen_attn",
        True,
    ),
}


def why_not(name: str, p: KernelParams) -> str | None:
    """Why backend `name` cannot run inputs described by `p` (None: it can)."""
    if name == "reference":
        return None
    if name not in _REQUIREMENTS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    installed, missing, label, head_dims = _REQUIREMENTS[name]
    if not installed():
        return missing
    if p.device_type != "cuda":
        return f"{label} needs CUDA"
    if p.dtype not in _HALF:
        return f"{label} takes fp16/bf16, not {p.dtype}"
    if head_dims and (p.head_dim > 256 or p.head_dim % 8):
        return f"{label} needs head_dim <= 256 and a multiple of 8, got {p.head_dim}"
    return None


def _forced(p: KernelParams) -> str | None:
    name = p.forced or os.environ.get("LIBRA_ATTENTION_BACKEND") or None
    if name in (None, "", "auto"):
        return None
    if name not in BACKENDS:
        raise ValueError(
            f"system.attention_backend must be auto or one of {', '.join(BACKENDS)}, got {name!r}"
        )
    return name


def choose_backend(p: KernelParams) -> tuple[str, str]:
    """(the backend that runs `p`, why: "forced", or the reasons the better ones were skipped)."""
    forced = _forced(p)
    if forced is not None:
        reason = why_not(forced, p)
        if reason is not None:
            raise RuntimeError(f"attention backend {forced!r} was forced but cannot run: {reason}")
        return forced, "forced"
    skipped = []
    for name in BACKENDS:
        reason = why_not(name, p)
        if reason is None:
            return name, "; ".join(f"{n}: {r}" for n, r in skipped)
        skipped.append((name, reason))
    raise AssertionError("the reference backend always applies")


@functools.lru_cache(maxsize=None)
def select_backend(p: KernelParams) -> Backend:
    """The best backend that can run `p`, named in one log line with the reasons the better
    ones were skipped."""
    name, why = choose_backend(p)
    logger.info("attention backend: %s%s", name, f" ({why})" if why else "")
    if name == "reference" and p.device_type == "cuda":
        logger.warning(
            "attention on %s %s uses the O(n^2)-memory PyTorch reference; use bf16 and "
            "install flash-attn or Transformer Engine (or PyTorch >= 2.10) for real runs",
            p.device_type,
            p.dtype,
        )
    return _FACTORIES[name]()


def backend_for(q: torch.Tensor, forced: str | None = None) -> Backend:
    """select_backend for tensors shaped like `q` [n, heads, d]."""
    return select_backend(KernelParams(q.device.type, q.dtype, int(q.shape[-1]), forced))


# --------------------------------------------------------------------------------------------
# The reference: exact math, host-side segment boundaries, bounded memory per piece of work.
# --------------------------------------------------------------------------------------------

_PIECE_ELEMS = 1 << 17
"""Score elements per head computed at once by the reference (rows x keys). Small enough that
a piece's scores over a rank's heads stay in cache-sized temporaries (a few MiB), so the cost of
a piece follows its elements whatever the segment lengths; large pieces (4M elements) run
2-3x slower per element and made the measured time of a rank depend on how its work was cut."""
_BATCH_SPREAD = 1.125
"""Largest ratio of key lengths batched together (bounds the padded-out work)."""
_ROW_BLOCKS = 4
"""Row blocks of a batch: each attends only as far as its causal end (bounds the masked-out
work to about 1 / _ROW_BLOCKS of the triangle)."""


@dataclass(frozen=True)
class _Rows:
    """Rows r0..r1-1 of one long segment s against its causal prefix."""

    s: int
    r0: int
    r1: int


@dataclass(frozen=True)
class _Batch:
    """Short segments of about one length, padded to (lq, lk) and run as one batched call:
    gather indices [n, lq] / [n, lk] into q and k (clipped), their validity, each segment's
    causal shift (kl - ql), and the row blocks [(i0, i1, k_end)]."""

    idx_q: torch.Tensor
    ok_q: torch.Tensor
    idx_k: torch.Tensor
    ok_k: torch.Tensor
    shift: torch.Tensor
    blocks: tuple


def _work(seg: Segments, device) -> list:
    """The reference's work items: long segments (more than _PIECE_ELEMS scores) by row pieces,
    every other segment in a batch of segments of nearly the same key length, so that the work
    done follows the causal pairs (few padded or masked-out scores) whatever the lengths."""
    hq, hk = seg.host_q, seg.host_k
    ql, kl = np.diff(hq), np.diff(hk)
    items: list = []
    long = np.flatnonzero(ql * kl > _PIECE_ELEMS)
    for s in long.tolist():
        step = max(1, _PIECE_ELEMS // max(1, int(kl[s])))
        for r0 in range(0, int(ql[s]), step):
            items.append(_Rows(s, r0, min(int(ql[s]), r0 + step)))
    short = np.flatnonzero((ql * kl <= _PIECE_ELEMS) & (ql > 0) & (kl > 0))
    short = short[np.lexsort((ql[short], kl[short]))]  # by key length, then query length
    i = 0
    while i < len(short):
        # extend while the key lengths stay within _BATCH_SPREAD and the scores fit
        j, lq, lk = i, 0, 0
        while j < len(short):
            s = short[j]
            nlq, nlk = max(lq, int(ql[s])), max(lk, int(kl[s]))
            too_long = nlk > _BATCH_SPREAD * kl[short[i]]
            if j > i and (too_long or (j - i + 1) * nlq * nlk > _PIECE_ELEMS):
                break
            lq, lk, j = nlq, nlk, j + 1
        members = short[i:j]
        i = j
        rq, rk = np.arange(lq), np.arange(lk)
        ok_q = rq[None, :] < ql[members][:, None]
        ok_k = rk[None, :] < kl[members][:, None]
        idx_q = np.where(ok_q, hq[members][:, None] + rq[None, :], 0)
        idx_k = np.where(ok_k, hk[members][:, None] + rk[None, :], 0)
        shift = kl[members] - ql[members]
        edges = np.unique(np.linspace(0, lq, min(_ROW_BLOCKS, lq) + 1).astype(np.int64))
        blocks = tuple(
            (int(r0), int(r1), int(min(lk, r1 - 1 + int(shift.max()) + 1)))
            for r0, r1 in zip(edges[:-1], edges[1:])
        )
        items.append(_Batch(
            *(torch.as_tensor(x, device=device) for x in (idx_q, ok_q, idx_k, ok_k, shift)),
            blocks,
        ))
    return items


def _rows_ranges(item: _Rows, seg: Segments, device):
    """(q rows, k rows, mask [nq, nk] bool) of a long segment's row piece."""
    hq, hk = seg.host_q, seg.host_k
    s, r0, r1 = item.s, item.r0, item.r1
    ql, kl = int(hq[s + 1] - hq[s]), int(hk[s + 1] - hk[s])
    q0, q1 = int(hq[s]) + r0, int(hq[s]) + r1
    k_end = min(kl, r1 - 1 + kl - ql + 1)
    k0, k1 = int(hk[s]), int(hk[s]) + max(0, k_end)
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(0, k1 - k0, device=device)[None, :]
    return (q0, q1), (k0, k1), j <= i + (kl - ql)


def _batch_mask(b: _Batch, r0: int, r1: int, k_end: int) -> torch.Tensor:
    """[n, rows, k_end] bool: valid rows and keys, causal inside each segment."""
    i = torch.arange(r0, r1, device=b.shift.device)[None, :, None]
    j = torch.arange(k_end, device=b.shift.device)[None, None, :]
    causal = j <= i + b.shift[:, None, None]
    return causal & b.ok_q[:, r0:r1, None] & b.ok_k[:, None, :k_end]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, mask, scale, g):
    kf = k.repeat_interleave(g, dim=1) if g > 1 else k
    s = torch.einsum("qhd,khd->hqk", q, kf) * scale
    return s.masked_fill(~mask, float("-inf"))


def _expand(x: torch.Tensor, g: int, dim: int) -> torch.Tensor:
    return x.repeat_interleave(g, dim=dim) if g > 1 else x


def _safe(m: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with fully masked rows (-inf) set to 0, to subtract from scores."""
    return m.masked_fill(torch.isinf(m), 0.0)


class _ReferenceVarlen(torch.autograd.Function):
    """Exact varlen attention; backward from the saved output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, seg: Segments, scale: float):
        acc = _acc_dtype(q.dtype)
        n_q, hc, d = q.shape
        g = hc // max(1, k.shape[1])
        out = torch.zeros(n_q, hc, d, dtype=acc, device=q.device)
        lse = torch.full((hc, n_q), float("-inf"), dtype=acc, device=q.device)
        work = seg.work if seg.work is not None else _work(seg, q.device)
        for item in work:
            if isinstance(item, _Rows):
                (q0, q1), (k0, k1), mask = _rows_ranges(item, seg, q.device)
                if q1 <= q0 or k1 <= k0:
                    continue
                s = _scores(q[q0:q1].to(acc), k[k0:k1].to(acc), mask, scale, g)
                m = torch.logsumexp(s, dim=-1)  # [hc, rows]
                p = torch.exp(s - _safe(m)[..., None])
                out[q0:q1] = torch.einsum("hqk,khd->qhd", p, _expand(v[k0:k1].to(acc), g, 1))
                lse[:, q0:q1] = m
                continue
            kb = _expand(k[item.idx_k].to(acc), g, 2)  # [n, lk, hc, d]
            vb = _expand(v[item.idx_k].to(acc), g, 2)
            for r0, r1, k_end in item.blocks:
                qb = q[item.idx_q[:, r0:r1]].to(acc)  # [n, rows, hc, d]
                s = torch.einsum("nqhd,nkhd->nhqk", qb, kb[:, :k_end]) * scale
                s = s.masked_fill(~_batch_mask(item, r0, r1, k_end)[:, None], float("-inf"))
                m = torch.logsumexp(s, dim=-1)  # [n, hc, rows]
                p = torch.exp(s - _safe(m)[..., None])
                o = torch.einsum("nhqk,nkhd->nqhd", p, vb[:, :k_end])
                ok = item.ok_q[:, r0:r1]
                rows = item.idx_q[:, r0:r1][ok]
                out[rows] = o[ok]
                lse[:, rows] = m.permute(1, 0, 2)[:, ok]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seg, ctx.scale, ctx.work = seg, scale, work
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        seg, scale = ctx.seg, ctx.scale
        acc = _acc_dtype(q.dtype)
        hc, hk = q.shape[1], k.shape[1]
        g = hc // max(1, hk)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)

        def fold(x: torch.Tensor, dim: int) -> torch.Tensor:  # expanded heads -> KV heads
            if g == 1:
                return x
            shape = list(x.shape)
            shape[dim:dim + 1] = [hk, g]
            return x.reshape(shape).sum(dim + 1)

        for item in ctx.work:
            if isinstance(item, _Rows):
                (q0, q1), (k0, k1), mask = _rows_ranges(item, seg, q.device)
                if q1 <= q0 or k1 <= k0:
                    continue
                qf, kf, vf = q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc)
                do, o = dout[q0:q1].to(acc), out[q0:q1].to(acc)
                s = _scores(qf, kf, mask, scale, g)
                p = torch.exp(s - _safe(lse[:, q0:q1])[..., None])  # [hc, r, c]
                dve = torch.einsum("hqk,qhd->khd", p, do)
                dp = torch.einsum("qhd,khd->hqk", do, _expand(vf, g, 1))
                delta = (do * o).sum(-1).transpose(0, 1)[..., None]  # [hc, r, 1]
                ds = p * (dp - delta) * scale
                dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, _expand(kf, g, 1))
                dk[k0:k1] += fold(torch.einsum("hqk,qhd->khd", ds, qf), 1)
                dv[k0:k1] += fold(dve, 1)
                continue
            kb = _expand(k[item.idx_k].to(acc), g, 2)  # [n, lk, hc, d]
            vb = _expand(v[item.idx_k].to(acc), g, 2)
            dkb = torch.zeros_like(kb)
            dvb = torch.zeros_like(vb)
            for r0, r1, k_end in item.blocks:
                idx = item.idx_q[:, r0:r1]
                qb, do, o = q[idx].to(acc), dout[idx].to(acc), out[idx].to(acc)
                mask = _batch_mask(item, r0, r1, k_end)[:, None]  # [n, 1, rows, k]
                s = torch.einsum("nqhd,nkhd->nhqk", qb, kb[:, :k_end]) * scale
                s = s.masked_fill(~mask, float("-inf"))
                m = lse[:, idx].permute(1, 0, 2)  # [n, hc, rows]
                p = torch.exp(s - _safe(m)[..., None])
                dvb[:, :k_end] += torch.einsum("nhqk,nqhd->nkhd", p, do)
                dp = torch.einsum("nqhd,nkhd->nhqk", do, vb[:, :k_end])
                delta = (do * o).sum(-1).permute(0, 2, 1)[..., None]  # [n, hc, rows, 1]
                ds = p * (dp - delta) * scale
                ok = item.ok_q[:, r0:r1]
                dq.index_add_(0, idx[ok], torch.einsum("nhqk,nkhd->nqhd", ds, kb[:, :k_end])[ok])
                dkb[:, :k_end] += torch.einsum("nhqk,nqhd->nkhd", ds, qb)
            okk = item.ok_k
            dk.index_add_(0, item.idx_k[okk], fold(dkb, 2)[okk])
            dv.index_add_(0, item.idx_k[okk], fold(dvb, 2)[okk])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def segments_on(host_q, host_k, device) -> Segments:
    """Segments from host offsets (tests and one-off calls; the runtime builds them ahead)."""
    return Segments.from_host(
        torch.as_tensor(np.asarray(host_q), dtype=torch.int32, device=device),
        torch.as_tensor(np.asarray(host_k), dtype=torch.int32, device=device),
        host_q,
        host_k,
        reference_work=torch.device(device).type == "cpu",
    )


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    doc_lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent check: q [n_q, hq, d], k/v [n_k, hk, d] -> (out [n_q, hq, d], lse
    [hq, n_q]), dense math, differentiable by autograd.

    Without `doc_lengths`: query i sees keys j <= i + n_k - n_q (bottom-right causal). With
    `doc_lengths` (q and k the same tokens): block-diagonal, causal inside every document.
    Computed in fp32 (or better) and cast back.
    """
    n_q, hq, d = q.shape
    n_k, hk = k.shape[0], k.shape[1]
    g = hq // hk
    acc = _acc_dtype(q.dtype)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    if g > 1:
        kf = kf.repeat_interleave(g, dim=1)
        vf = vf.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    i = torch.arange(n_q, device=q.device)[:, None]
    j = torch.arange(n_k, device=q.device)[None, :]
    if doc_lengths is None:
        mask = j <= i + (n_k - n_q)
    else:
        doc = torch.repeat_interleave(
            torch.arange(len(doc_lengths), device=q.device),
            torch.as_tensor(doc_lengths, device=q.device),
        )
        mask = (j <= i) & (doc[:n_q, None] == doc[None, :n_k])
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [hq, n_q]
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vf)
    return out.to(q.dtype), lse
