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

from libra_ext.attention import (
    BACKENDS,  # kernel backends, best first (one list)
    reference_kernel,
)

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

MIN_MAX_SEQLEN = 128
"""A call's max_seqlen is its longest segment rounded up to a power of two, at least this: the
kernels' grids are sized by it, and shape-keyed caches (TE's cuDNN graphs) see few values."""


def rounded_max(lengths) -> int:
    """The longest of `lengths` rounded up to a power of two (at least MIN_MAX_SEQLEN)."""
    m = int(np.max(lengths, initial=0))
    return max(MIN_MAX_SEQLEN, 1 << max(0, m - 1).bit_length())


@dataclass(frozen=True)
class Segments:
    """The segment layout of one batched call: device cumulative lengths plus host copies (the
    reference slices with the host copies, so it never reads a device tensor back)."""

    cu_q: torch.Tensor
    """[n_seg + 1] int32 query offsets, on the compute device."""
    cu_k: torch.Tensor
    """[n_seg + 1] int32 key offsets, on the compute device."""
    max_q: int
    """The longest segment's query rows, as the kernels take it (`rounded_max` unless given)."""
    max_k: int
    host_q: np.ndarray
    """[n_seg + 1] the same offsets on the host."""
    host_k: np.ndarray
    work: tuple | None = None
    """The reference kernel's work items with their index tensors, made ahead of the call (on
    CPU, where the reference runs; None: made by the call)."""

    @classmethod
    def from_host(cls, cu_q: torch.Tensor, cu_k: torch.Tensor, host_q, host_k,
                  reference_work: bool = False, max_q: int | None = None,
                  max_k: int | None = None) -> "Segments":
        """Device offsets with their host copies; the longest segments (`max_q`, `max_k`, or
        from the host copies, rounded up as the runtime's calls pass them: `rounded_max`); with
        `reference_work`, the reference kernel's work items too."""
        hq = np.asarray(host_q, dtype=np.int64)
        hk = np.asarray(host_k, dtype=np.int64)
        seg = cls(cu_q, cu_k, rounded_max(np.diff(hq)) if max_q is None else int(max_q),
                  rounded_max(np.diff(hk)) if max_k is None else int(max_k), hq, hk)
        if reference_work:
            work = reference_kernel.work_items(seg, cu_q.device)
            seg = dataclasses.replace(seg, work=tuple(work))
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
        return reference_kernel.ReferenceVarlen.apply(q, k, v, seg, scale)


class VarlenBackend(Backend):
    """PyTorch's varlen_attn. GQA is native in every release: the op hands key and value to
    ATen's flash kernel as they are (PyTorch 2.11's torch/nn/attention/varlen.py passes them to
    aten._flash_attention_forward unchanged, and that kernel takes KV heads dividing the query
    heads); 2.13 and later ask for `enable_gqa=True` to allow it."""

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
        if k.shape[1] != q.shape[1] and "enable_gqa" in _VARLEN_ARGS:
            kw["enable_gqa"] = True
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


def segments_on(host_q, host_k, device) -> Segments:
    """Segments from host offsets (tests, checks and measurements; the runtime builds them
    ahead), with max_seqlen rounded up as the runtime's calls pass it."""
    return Segments.from_host(
        torch.as_tensor(np.asarray(host_q), dtype=torch.int32, device=device),
        torch.as_tensor(np.asarray(host_k), dtype=torch.int32, device=device),
        host_q,
        host_k,
        reference_work=torch.device(device).type == "cpu",
    )
