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
"""

from __future__ import annotations

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

    @classmethod
    def from_host(cls, cu_q: torch.Tensor, cu_k: torch.Tensor, host_q, host_k) -> "Segments":
        """Device offsets with their host copies; the longest segments from the host copies."""
        hq = np.asarray(host_q, dtype=np.int64)
        hk = np.asarray(host_k, dtype=np.int64)
        return cls(cu_q, cu_k, int(np.diff(hq).max(initial=0)), int(np.diff(hk).max(initial=0)),
                   hq, hk)


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
            if "enable_gqa" in _VARLEN_ARGS:
                kw["enable_gqa"] = True
            else:
                g = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return _varlen_attn(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, **kw)


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

_PIECE_ELEMS = 1 << 22
"""Score elements per head computed at once by the reference (rows x keys)."""
_PIECE_ROWS = 512
"""Query rows of one dense piece that covers several segments (bounds the masked-out work)."""


def _pieces(hq: np.ndarray, hk: np.ndarray):
    """Work items of the reference: ("multi", s0, s1) covers whole segments s0..s1-1 (dense with
    a block-diagonal mask), ("rows", s, r0, r1) rows r0..r1-1 of one long segment."""
    ql, kl = np.diff(hq), np.diff(hk)
    n = len(ql)
    s = 0
    while s < n:
        if int(ql[s]) * int(kl[s]) > _PIECE_ELEMS:
            step = max(1, _PIECE_ELEMS // max(1, int(kl[s])))
            for r0 in range(0, int(ql[s]), step):
                yield ("rows", s, r0, min(int(ql[s]), r0 + step))
            s += 1
            continue
        s1, nq, nk = s, 0, 0
        while (
            s1 < n
            and nq + ql[s1] <= _PIECE_ROWS
            and (nq + ql[s1]) * (nk + kl[s1]) <= _PIECE_ELEMS
        ):
            nq, nk = nq + int(ql[s1]), nk + int(kl[s1])
            s1 += 1
        yield ("multi", s, max(s1, s + 1))
        s = max(s1, s + 1)


def _piece_ranges(item, seg: Segments):
    """(q rows, k rows, mask [nq, nk] bool) of a work item, built from device tensors."""
    hq, hk = seg.host_q, seg.host_k
    dev = seg.cu_q.device
    if item[0] == "rows":
        _, s, r0, r1 = item
        ql, kl = int(hq[s + 1] - hq[s]), int(hk[s + 1] - hk[s])
        q0, q1 = int(hq[s]) + r0, int(hq[s]) + r1
        k_end = min(kl, r1 - 1 + kl - ql + 1)
        k0, k1 = int(hk[s]), int(hk[s]) + max(0, k_end)
        i = torch.arange(r0, r1, device=dev)[:, None]
        j = torch.arange(0, k1 - k0, device=dev)[None, :]
        return (q0, q1), (k0, k1), j <= i + (kl - ql)
    _, s0, s1 = item
    q0, q1, k0, k1 = int(hq[s0]), int(hq[s1]), int(hk[s0]), int(hk[s1])
    cu_q, cu_k = seg.cu_q.long(), seg.cu_k.long()
    rows = torch.arange(q0, q1, device=dev)
    cols = torch.arange(k0, k1, device=dev)
    sq = torch.searchsorted(cu_q, rows, right=True) - 1
    sk = torch.searchsorted(cu_k, cols, right=True) - 1
    i = (rows - cu_q[sq])[:, None]
    j = (cols - cu_k[sk])[None, :]
    shift = ((cu_k[sq + 1] - cu_k[sq]) - (cu_q[sq + 1] - cu_q[sq]))[:, None]
    return (q0, q1), (k0, k1), (sq[:, None] == sk[None, :]) & (j <= i + shift)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, mask, scale, g):
    kf = k.repeat_interleave(g, dim=1) if g > 1 else k
    s = torch.einsum("qhd,khd->hqk", q, kf) * scale
    return s.masked_fill(~mask, float("-inf"))


class _ReferenceVarlen(torch.autograd.Function):
    """Exact varlen attention; backward from the saved output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, seg: Segments, scale: float):
        acc = _acc_dtype(q.dtype)
        n_q, hc, d = q.shape
        g = hc // max(1, k.shape[1])
        out = torch.zeros(n_q, hc, d, dtype=acc, device=q.device)
        lse = torch.full((hc, n_q), float("-inf"), dtype=acc, device=q.device)
        for item in _pieces(seg.host_q, seg.host_k):
            (q0, q1), (k0, k1), mask = _piece_ranges(item, seg)
            if q1 <= q0 or k1 <= k0:
                continue
            s = _scores(q[q0:q1].to(acc), k[k0:k1].to(acc), mask, scale, g)
            m = torch.logsumexp(s, dim=-1)  # [hc, rows]
            p = torch.exp(s - m.masked_fill(torch.isinf(m), 0.0)[..., None])
            vf = v[k0:k1].to(acc)
            vf = vf.repeat_interleave(g, dim=1) if g > 1 else vf
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p, vf)
            lse[:, q0:q1] = m
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seg, ctx.scale = seg, scale
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
        for item in _pieces(seg.host_q, seg.host_k):
            (q0, q1), (k0, k1), mask = _piece_ranges(item, seg)
            if q1 <= q0 or k1 <= k0:
                continue
            qf, kf, vf = q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc)
            do, o = dout[q0:q1].to(acc), out[q0:q1].to(acc)
            s = _scores(qf, kf, mask, scale, g)
            m = lse[:, q0:q1]
            p = torch.exp(s - m.masked_fill(torch.isinf(m), 0.0)[..., None])  # [hc, r, c]
            ve = vf.repeat_interleave(g, dim=1) if g > 1 else vf
            ke = kf.repeat_interleave(g, dim=1) if g > 1 else kf
            dve = torch.einsum("hqk,qhd->khd", p, do)
            dp = torch.einsum("qhd,khd->hqk", do, ve)
            delta = (do * o).sum(-1).transpose(0, 1)[..., None]  # [hc, r, 1]
            ds = p * (dp - delta) * scale
            dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, ke)
            dke = torch.einsum("hqk,qhd->khd", ds, qf)
            if g > 1:
                dke = dke.view(k1 - k0, hk, g, -1).sum(2)
                dve = dve.view(k1 - k0, hk, g, -1).sum(2)
            dk[k0:k1] += dke
            dv[k0:k1] += dve
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def segments_on(host_q, host_k, device) -> Segments:
    """Segments from host offsets (tests and one-off calls; the runtime builds them ahead)."""
    return Segments.from_host(
        torch.as_tensor(np.asarray(host_q), dtype=torch.int32, device=device),
        torch.as_tensor(np.asarray(host_k), dtype=torch.int32, device=device),
        host_q,
        host_k,
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
