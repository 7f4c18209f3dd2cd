"""Defects planted on purpose (`python -m megatron.libra.gpu_ready --mutate NAME`), so that the tests
can show the gate failing on each: a host index tensor in a device op, a host read in the
forward, a device op per document, a micro-batch copied to the device field by field with
blocking copies, MoE layers that exchange and read their token counts in every layer, and
kernel calls given their exact longest segment as max_seqlen (not rounded up)."""

from __future__ import annotations

import numpy as np
import torch

from libra_ext.attention import core, exchange, kernels
from megatron.libra import batch, moe_layer


def _host_index() -> None:
    original = exchange._Call.__init__

    def init(self, call, q, k, v, env, counts):
        # gathers with a host index tensor
        q = q.index_select(0, torch.arange(q.shape[0]))
        original(self, call, q, k, v, env, counts)

    exchange._Call.__init__ = init


def _item() -> None:
    original = exchange._Call.__init__

    def init(self, call, q, k, v, env, counts):
        if float(q[0, 0, 0].item()) != 0.0:  # a host read of a device value
            pass
        original(self, call, q, k, v, env, counts)

    exchange._Call.__init__ = init


def _per_document_loop() -> None:
    original = core.core_attention

    def core_attention(query, key, value, doc_lengths, *args, **kwargs):
        start = 0
        for n in doc_lengths:  # one device op per document
            query[start : start + n].mul_(1.0)
            start += n
        return original(query, key, value, doc_lengths, *args, **kwargs)

    core.core_attention = core_attention


def _blocking_batch_copies() -> None:
    def to(self, device, buffer=None):  # each field copied on its own, blocking
        return batch.MicroBatch(
            tokens=self.tokens.to(device), labels=self.labels.to(device),
            loss_mask=self.loss_mask.to(device), position_ids=self.position_ids.to(device),
            packed_seq_params=self.packed_seq_params, num_tokens=self.num_tokens)

    batch.MicroBatch.to = to


def _exact_max_seqlen() -> None:
    original = kernels.Segments.from_host.__func__

    def from_host(cls, cu_q, cu_k, host_q, host_k, reference_work=False, max_q=None,
                  max_k=None):  # each call's longest segment as it is, not rounded up
        lq, lk = np.diff(np.asarray(host_q)), np.diff(np.asarray(host_k))
        return original(cls, cu_q, cu_k, host_q, host_k, reference_work,
                        int(lq.max(initial=0)), int(lk.max(initial=0)))

    kernels.Segments.from_host = classmethod(from_host)


def _moe_counts_per_layer() -> None:
    original = moe_layer.set_step_rows
    # the step's row count never set: every MoE layer all-gathers and reads the token counts
    moe_layer.set_step_rows = lambda rows: original(None)


MUTATIONS = {"host-index": _host_index, "item": _item, "per-document-loop": _per_document_loop,
             "blocking-batch-copies": _blocking_batch_copies,
             "moe-counts-per-layer": _moe_counts_per_layer,
             "exact-max-seqlen": _exact_max_seqlen}


def apply(name: str) -> None:
    if name not in MUTATIONS:
        raise ValueError(f"mutation must be one of {', '.join(MUTATIONS)}, got {name!r}")
    MUTATIONS[name]()
