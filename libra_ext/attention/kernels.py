"""Attention kernels and the backend ladder.

Every kernel computes, for query rows against a key range, causal attention aligned to the
bottom right (the last query row sees every key), with GQA (query heads share KV heads in
groups), returning the output and the softmax log-sum-exp. Backends, best first: flash-attn's
varlen kernel, PyTorch on GPU, and the PyTorch reference on CPU (Transformer Engine's
DotProductAttention holds per-layer module state and is not used per tile). One log line says
which was chosen and why the better ones were not.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

try:
    from flash_attn import flash_attn_varlen_func

    HAVE_FLASH = True
except Exception:
    HAVE_FLASH = False


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    doc_lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n_q, hq, d], k/v [n_k, hk, d] (hq a multiple of hk) -> out [n_q, hq, d], lse [hq, n_q].

    Without `doc_lengths`: query i sees keys j <= i + n_k - n_q (bottom-right causal). With
    `doc_lengths` (q and k the same tokens): block-diagonal, causal inside every document.
    Computed in fp32 and cast back; differentiable.
    """
    n_q, hq, d = q.shape
    n_k, hk = k.shape[0], k.shape[1]
    g = hq // hk
    qf, kf, vf = q.float(), k.float(), v.float()
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


class Backend:
    """A chosen attention kernel: `flash` (flash-attn varlen), `torch-gpu` (the PyTorch math on
    GPU tensors) or `reference` (the same math on CPU)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, q, k, v, scale, doc_lengths=None):
        if self.name == "flash":
            return _flash(q, k, v, scale, doc_lengths)
        return reference_attention(q, k, v, scale, doc_lengths)


def _flash(q, k, v, scale, doc_lengths):
    if doc_lengths is None:
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
        mq, mk = q.shape[0], k.shape[0]
    else:
        cu = torch.tensor(
            [0] + list(torch.cumsum(torch.tensor(doc_lengths), 0).tolist()),
            dtype=torch.int32,
            device=q.device,
        )
        cu_q = cu_k = cu
        mq = mk = max(doc_lengths)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, mq, mk, softmax_scale=scale, causal=True, return_attn_probs=True
    )
    return out, lse


def select_backend(device: torch.device, prefer: str | None = None) -> Backend:
    """Pick the best available backend and say why in one log line."""
    why = []
    if device.type == "cuda":
        if prefer in (None, "flash") and HAVE_FLASH:
            logger.info("attention backend: flash-attn varlen")
            return Backend("flash")
        why.append("flash-attn not installed" if not HAVE_FLASH else "flash-attn not preferred")
        logger.info("attention backend: PyTorch on GPU (%s)", "; ".join(why))
        return Backend("torch-gpu")
    why += ["no GPU: flash-attn and the PyTorch GPU path need CUDA"]
    logger.info("attention backend: PyTorch reference on CPU (%s)", "; ".join(why))
    return Backend("reference")
