"""Per-rank THD micro-batches of a packed sequence: tokens, labels, loss mask, position ids,
cu_seqlens and the LibraPackedSeqParams that carry the step plan to the attention layers, in
the system's CP layout (`thd.layout_of`: contiguous rank slices for the Ulysses family,
Megatron's per-document zigzag for wlb); each slot's RoPE positions registered for
`megatron.libra.rope`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libra_ext.attention import thd
from libra_ext.attention.params import AttentionStep, LibraPackedSeqParams
from megatron.libra import rope
from megatron.libra.sources import Piece


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [1, t]
    labels: torch.Tensor  # [1, t]
    loss_mask: torch.Tensor  # [1, t]
    position_ids: torch.Tensor  # [1, t]
    packed_seq_params: object
    num_tokens: int  # tokens that count in the loss on this rank
    host: torch.Tensor | None = None
    """The micro-batch in one flat int32 host tensor (pinned when staged for a GPU): tokens,
    labels, position ids, the loss mask's float32 bits, each [t], then cu_seqlens_padded
    [n_doc + 1]. Made by `stage`, off the critical path (the sampler's thread)."""

    def stage(self, pin: bool) -> "MicroBatch":
        """Lay the micro-batch out in `host` (pinned with `pin`) for one transfer."""
        cu_pad = self.packed_seq_params.cu_seqlens_q_padded.numpy().astype(np.int32)
        mask_bits = self.loss_mask[0].numpy().view(np.int32)
        flat = np.concatenate([self.tokens[0].numpy().astype(np.int32),
                               self.labels[0].numpy().astype(np.int32),
                               self.position_ids[0].numpy().astype(np.int32), mask_bits, cu_pad])
        host = torch.from_numpy(flat)
        self.host = host.pin_memory() if pin else host
        return self

    def to(self, device, buffer: torch.Tensor | None = None) -> "MicroBatch":
        """The micro-batch on `device`: one non-blocking copy of `host` (staged if it was not),
        or `buffer`, that copy made already; every tensor a view of it or cast from it (token
        ids and labels widened to int64, the loss mask viewed back from its bits). The host
        cu_seqlens stay what megatron-core reads on the host; the device position ids and
        offsets are registered under them for Libra's RoPE (`megatron.libra.rope`)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        if buffer is None:
            if self.host is None:
                self.stage(pin=True)
            buffer = self.host.to(device, non_blocking=True)
        t = self.tokens.shape[1]
        psp = self.packed_seq_params
        host_positions = rope.registered(psp.cu_seqlens_q_padded)
        rope.register(psp.cu_seqlens_q_padded, rope.Positions(
            slots=buffer[2 * t : 3 * t],  # int32: index_select takes it
            device_offsets=buffer[4 * t :],
            zigzag=host_positions.zigzag if host_positions is not None else True))
        return MicroBatch(
            tokens=buffer[:t].long()[None],
            labels=buffer[t : 2 * t].long()[None],
            loss_mask=buffer[3 * t : 4 * t].view(torch.float32)[None],
            position_ids=buffer[2 * t : 3 * t].long()[None],
            packed_seq_params=psp,
            num_tokens=self.num_tokens,
        )


def make_micro_batch(pieces: list, cp: int, cp_rank: int, step: AttentionStep | None,
                     layout: str) -> MicroBatch:
    """One cp rank's share, in `layout` (thd.LAYOUTS), of a packed sequence made of `pieces`
    (sources.Piece: tokens, labels and loss mask of each document, in order).

    A sequence without documents (WLB-LLM's repacking can leave one empty when it holds
    outliers back) becomes one padding document (`thd.empty_sequence_tokens`) with no loss, so
    the model runs and every collective of the step still lines up; it adds nothing to the
    loss."""
    if sum(len(p.tokens) for p in pieces) == 0:
        n = thd.empty_sequence_tokens(cp, layout)
        pad = np.zeros(n, dtype=np.int64)
        pieces = [Piece(pad, pad, np.zeros(n, dtype=np.float32))]
    lengths = [len(p.tokens) for p in pieces]
    z = thd.split(lengths, cp, cp_rank, layout)
    inputs = np.concatenate([p.tokens for p in pieces])
    targets = np.concatenate([p.labels for p in pieces])
    weights = np.concatenate([p.mask for p in pieces])
    real = z.token_index >= 0
    idx = np.where(real, z.token_index, 0)
    if layout == "zigzag":  # documents padded to multiples of 2 * cp
        padded = thd.padded_lengths(lengths, cp)
    else:  # the sequence's tail padding (C t - n slots) counted in its last document
        padded = np.asarray(lengths, dtype=np.int64).copy()
        padded[-1] += cp * len(z.token_index) - int(padded.sum())
    cu_padded_global = np.concatenate([[0], np.cumsum(padded)])
    # Megatron's meaning: cu_seqlens_* the documents' real lengths, *_padded with the padding
    # slots the CP layout adds (cu_seqlens_q_padded[-1] = C t, every rank's slots)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    cu_padded = torch.tensor(cu_padded_global, dtype=torch.int32)
    longest = int(max(np.diff(cu_padded_global), default=1))
    psp = LibraPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        libra=step,
        doc_lengths=lengths,
    )
    # each slot's position inside its (padded) document: RoPE from it (megatron.libra.rope)
    rope.register(cu_padded, rope.Positions(torch.as_tensor(z.position_ids.astype(np.int64)),
                                            zigzag=layout == "zigzag" or cp == 1))
    mask = np.where(real, weights[idx], 0.0).astype(np.float32)
    return MicroBatch(
        tokens=torch.as_tensor(np.where(real, inputs[idx], 0).astype(np.int64))[None],
        labels=torch.as_tensor(np.where(real, targets[idx], 0).astype(np.int64))[None],
        loss_mask=torch.as_tensor(mask)[None],
        position_ids=torch.as_tensor(z.position_ids)[None],
        packed_seq_params=psp,
        num_tokens=int(mask.sum()),
    )
