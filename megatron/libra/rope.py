"""Rotary embeddings of THD micro-batches in a fixed number of kernels.

megatron-core's unfused THD RoPE (`_apply_rotary_pos_emb_thd`) splits the packed sequence by
cu_seqlens and gathers each document's frequencies on its own: its device kernels per call grow
with the documents (tens of thousands per micro-batch over a deep model on long-tail data), and
it reads cu_seqlens on the host. Each Libra micro-batch registers each slot's position inside
its (padded) document - the same positions megatron-core's CP split gives it - under the
cu_seqlens tensor megatron-core's attention passes to RoPE (`register`; a weak mapping, so an
entry lives as long as its micro-batch), with the device copy of the offsets. `install()` puts
a wrapper in place of the `apply_rotary_pos_emb` that megatron-core's attention calls; for a
registered micro-batch it gathers the frequencies of every slot by its position (one
index_select) and rotates as megatron-core's bshd path does - the same arithmetic per token,
whatever the document count - or, with `apply_rope_fusion` (Transformer Engine), calls TE's
fused THD kernel with the device offsets. Any other call goes to megatron-core's own function
unchanged.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention


@dataclass
class Positions:
    """A registered micro-batch's RoPE inputs."""

    slots: torch.Tensor
    """[t] each local slot's position inside its (padded) document, on the slots' device."""
    device_offsets: torch.Tensor | None = None
    """The padded cu_seqlens on the device (TE's fused THD kernel reads them there)."""
    zigzag: bool = True
    """The slots are in Megatron's per-document zigzag CP layout (or one cp rank): TE's fused
    THD kernel, which derives positions from cu_seqlens that way, may run them. The contiguous
    layout at cp > 1 always takes the position gather."""


_REGISTERED: dict = {}
"""id of a cu_seqlens tensor (a micro-batch's cu_seqlens_q_padded) -> (a weak reference to it,
its Positions). Keyed by identity (tensors compare elementwise); an entry whose tensor is gone
is dropped at the next registration."""


def register(cu_seqlens: torch.Tensor, positions: Positions) -> None:
    """RoPE of the micro-batch whose attention passes `cu_seqlens` rotates by `positions`."""
    for key in [k for k, (ref, _) in _REGISTERED.items() if ref() is None]:
        del _REGISTERED[key]
    _REGISTERED[id(cu_seqlens)] = (weakref.ref(cu_seqlens), positions)


def registered(cu_seqlens) -> Positions | None:
    """The Positions registered under `cu_seqlens` (None: not a Libra micro-batch)."""
    entry = _REGISTERED.get(id(cu_seqlens))
    return entry[1] if entry is not None and entry[0]() is cu_seqlens else None


def _positions_rope(original, bshd):
    accepted = set(inspect.signature(bshd).parameters)

    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             *args, **kwargs):
        mine = registered(cu_seqlens)
        if mine is None or args or kwargs:
            return original(t, freqs, config, cu_seqlens, mscale, cp_group, *args, **kwargs)
        if getattr(config, "apply_rope_fusion", False) and mine.zigzag:
            # TE's fused THD kernel, device offsets
            device_cu = mine.device_offsets
            return original(t, freqs, config, device_cu if device_cu is not None else cu_seqlens,
                            mscale, cp_group)
        positions = mine.slots
        if positions.device != t.device:
            positions = positions.to(t.device)
        # freqs [max_s, 1, 1, d] -> each slot's [t, 1, 1, d]
        f = freqs.index_select(0, positions)
        kw = {"rotary_interleaved": config.rotary_interleaved, "mscale": mscale,
              "multi_latent_attention": getattr(config, "multi_latent_attention", False)}
        return bshd(t.unsqueeze(1), f, **{k: v for k, v in kw.items() if k in accepted}).squeeze(1)

    apply_rotary_pos_emb.libra_positions_rope = True
    return apply_rotary_pos_emb


def install() -> None:
    """Route megatron-core's attention RoPE through the positions path (idempotent)."""
    if getattr(attention.apply_rotary_pos_emb, "libra_positions_rope", False):
        return
    attention.apply_rotary_pos_emb = _positions_rope(
        attention.apply_rotary_pos_emb, rope_utils._apply_rotary_pos_emb_bshd
    )
