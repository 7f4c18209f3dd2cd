"""Defects planted on purpose (`python -m megatron.libra.gpu_ready --mutate NAME`), so that the tests
can show the gate failing on each: a host index tensor in a device op, a host read in the
forward, a device op per document, a micro-batch copied to the device field by field with
blocking copies, and MoE layers that exchange and read their token counts in every layer."""

from __future__ import annotations

import torch

from libra_ext.attention import core, exchange
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


def _moe_counts_per_layer() -> None:
    original = moe_layer.set_step_rows
    # the step's row count never set: every MoE layer all-gathers and reads the token counts
    moe_layer.set_step_rows = lambda rows: original(None)


MUTATIONS = {"host-index": _host_index, "item": _item, "per-document-loop": _per_document_loop,
             "blocking-batch-copies": _blocking_batch_copies,
             "moe-counts-per-layer": _moe_counts_per_layer}


def apply(name: str) -> None:
    if name not in MUTATIONS:
        raise ValueError(f"mutation must be one of {', '.join(MUTATIONS)}, got {name!r}")
    MUTATIONS[name]()
