"""megatron-core's MoE layer with Libra's expert-load balancer (`moe.balancer: libra`).

The layer keeps megatron-core's router, its loss-based balancing and its all-gather token
dispatcher (every EP rank receives the EP group's tokens and routing map; the combine is a
reduce-scatter that sums each token's expert outputs over the ranks), padded here for EP ranks
whose micro-batches hold different token counts (`PaddedAllGatherDispatcher`). What changes is
who computes each (token, expert) pair: the C++ planner (`libra_ext.moe.plan_layer`) places
copies of hot experts on lightly loaded EP ranks and shards each expert's tokens over its copies,
and every rank computes exactly the pairs the plan gives it, so each pair is computed once
somewhere and the reduce-scatter sums the same terms as before. The layer's math is unchanged;
only the order of floating-point sums differs.

Per layer and micro-batch:

1. Plan. With `moe.lookahead`, the previous MoE layer applied this layer's router to its own
   input (one layer early), all-gathered the predicted per-expert counts of the EP ranks, planned
   this layer, and started moving the replicated experts' weights; the actual tokens are then
   sharded over the hosts that plan chose (`shard`). Without a lookahead (the first
   MoE layer of a chunk, or `moe.lookahead: false`) the plan is made from the actual counts,
   which every rank holds after the all-gather (no extra collective).
2. Local stage: the experts this rank owns run on their assigned tokens while the replicated
   weights are in flight (one asynchronous all-reduce over the EP group: owners contribute their
   experts' weights, the others zeros).
3. Remote stage: the copies run with the received weights (megatron-core's own expert module run
   with the received tensors, so the expert's code path is the same).

Backward mirrors it: the gradients of every copy are summed onto the owner's weights by one
all-reduce inside the backward of `_ReplicaWeights`, before megatron-core's gradient reduction
and the optimizer see them. That function also passes the layer's partial output (after the
local stage) through, so its collective runs on every EP rank at the same point of the backward
(after the combine's, before the dispatch's), whatever experts a rank computed.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.func import functional_call

from libra_ext import moe as moe_plan

with warnings.catch_warnings():  # megatron-core's notices about optional TE / apex
    warnings.simplefilter("ignore")
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


class _UnknownMlpNotice(logging.Filter):
    """TransformerLayer passes its process groups only to the MLP classes it knows and logs a
    warning for any other; LibraMoELayer then takes megatron-core's default process groups, the
    ones this application builds its layers with, so the notice says nothing actionable."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_UnknownMlpNotice())


class BalanceStats:
    """Per-step statistics of every balanced layer (layer number -> lists over micro-batches),
    computed from the plan and the routing map that every EP rank holds (no communication).
    A value may be a device tensor (the lookahead's overlap, counted on the device): those stay
    there until `summary`, which reads them all in one transfer per step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.before: dict[int, list[float]] = {}
        self.after: dict[int, list[float]] = {}
        self.overlap: dict[int, list[float]] = {}
        self.load_error: dict[int, list[float]] = {}
        self.bytes: dict[int, list[float]] = {}
        self.plan_ms: dict[int, list[float]] = {}
        # first micro-batch: (topk ids, predicted ids, tokens of each source rank)
        self.routing: dict[int, tuple] = {}

    def add(self, layer: int, **values) -> None:
        for k, v in values.items():
            getattr(self, k).setdefault(layer, []).append(
                v.detach() if isinstance(v, torch.Tensor) else float(v))

    def _on_host(self, d: dict) -> dict:
        """d with its device values read in one transfer."""
        dev = [(k, i) for k, v in d.items() for i, x in enumerate(v) if isinstance(x, torch.Tensor)]
        if not dev:
            return d
        vals = torch.stack([d[k][i].reshape(()).float() for k, i in dev]).tolist()
        out = {k: list(v) for k, v in d.items()}
        for (k, i), x in zip(dev, vals):
            out[k][i] = x
        return out

    def summary(self) -> dict:
        """Means over micro-batches per layer, then over layers."""
        if not self.before:
            return {}
        per = lambda d: {k: float(np.mean(v)) for k, v in sorted(self._on_host(d).items())}  # noqa: E731
        out = {
            "expert_tokens_max_over_mean_before": per(self.before),
            "expert_tokens_max_over_mean_after": per(self.after),
            "moe_bytes_moved": per(self.bytes),
            "moe_plan_ms": per(self.plan_ms),
        }
        if self.overlap:
            out["lookahead_topk_overlap"] = per(self.overlap)
            out["lookahead_load_error"] = per(self.load_error)
        return out


STATS = BalanceStats()
"""The process's statistics (the trainer reads and resets them every step)."""


_STEP_ROWS: int | None = None
"""Rows every EP rank's tokens are padded to for the all-gather and the reduce-scatter in this
step (`set_step_rows`); None: each layer all-gathers the ranks' counts."""


def set_step_rows(rows: int | None) -> None:
    """The most tokens any rank's micro-batch holds in this step (the training loop knows it
    from the step's plan, one step ahead): every EP rank pads its tokens to it, so no layer
    exchanges or reads token counts. None: count per layer (an all-gather and a host read)."""
    global _STEP_ROWS
    if rows is not None and rows < 1:
        raise ValueError(f"step rows must be >= 1, got {rows}")
    _STEP_ROWS = rows


def step_rows() -> int | None:
    return _STEP_ROWS


class PaddedAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """megatron-core's all-gather dispatcher for micro-batches whose token counts differ between
    the EP ranks (packed sequences of different lengths on different replicas): every rank's
    tokens are padded to one row count for the all-gather and the reduce-scatter, and the
    padding dropped. The count is the step's (`set_step_rows`: padding rows route to no expert
    and stay in the gathered tensors, so nothing about them is read on the host), or else the
    micro-batch's largest, from an all-gather of the counts (`sizes`: each source rank's), the
    padding then dropped after each gather.

    After token_dispatch: `pad_to` rows per source rank, `n_local` this rank's tokens,
    `rows` the index of each gathered token row in the padded layout (source = rows // pad_to),
    `sizes` each source's count where it was gathered, else None."""

    def token_dispatch(self, hidden_states, probs):
        n = hidden_states.shape[0]
        self.n_local = n
        if self.tp_size == 1 and self.ep_size == 1:
            self.sizes, self.pad_to, self.rows, self.keep = [n], n, None, None
            return hidden_states, probs
        dev = hidden_states.device
        step = step_rows()
        if step is not None:
            if n > step:
                raise RuntimeError(f"this rank's micro-batch holds {n} tokens, more than the "
                                   f"step's {step} (set_step_rows)")
            self.sizes, self.pad_to, self.keep = None, step, None
            self.rows = torch.arange(step * dist.get_world_size(self.tp_ep_group), device=dev)
        else:
            mine = torch.tensor([n], dtype=torch.int64, device=dev)
            sizes = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.tp_ep_group))]
            dist.all_gather(sizes, mine, group=self.tp_ep_group)
            self.sizes = [int(x) for x in sizes]
            m = max(self.sizes)
            self.pad_to = m
            self.keep = self.rows = torch.cat(
                [torch.arange(i * m, i * m + k, device=dev) for i, k in enumerate(self.sizes)])
        self.routing_map = self.gather_rows(self.routing_map)
        probs = self._unpad(gather_from_sequence_parallel_region(
            self._pad(probs), group=self.tp_ep_group))
        hidden_states = self._unpad(gather_from_sequence_parallel_region(
            self._pad(hidden_states), group=self.tp_ep_group))
        return hidden_states, probs

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows padded with zeros to `pad_to`."""
        return torch.nn.functional.pad(t, (0,) * (2 * t.dim() - 1) + (self.pad_to - t.shape[0],))

    def _unpad(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.keep is None else t[self.keep]

    @torch.no_grad()
    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every EP rank's rows of a per-token tensor of this micro-batch (after
        token_dispatch), in source-rank order; no autograd."""
        if self.tp_size == 1 and self.ep_size == 1:
            return t
        parts = [torch.empty((self.pad_to,) + tuple(t.shape[1:]), dtype=t.dtype,
                             device=t.device) for _ in range(dist.get_world_size(self.tp_ep_group))]
        dist.all_gather(parts, self._pad(t).contiguous(), group=self.tp_ep_group)
        return self._unpad(torch.cat(parts))

    def token_combine(self, hidden_states):
        if self.tp_size == 1 and self.ep_size == 1:
            return hidden_states
        full = hidden_states
        if self.keep is not None:
            full = hidden_states.new_zeros(
                (self.pad_to * len(self.sizes),) + hidden_states.shape[1:])
            full = full.index_copy(0, self.keep, hidden_states)
        out = reduce_scatter_to_sequence_parallel_region(
            full.to(self.local_probs.dtype), group=self.tp_ep_group
        ).to(hidden_states.dtype)
        return out[: self.n_local]


class VarlenMoELayer(MoELayer):
    """megatron-core's MoELayer, unchanged but for the dispatcher: with EP > 1 on the all-gather
    dispatcher it is PaddedAllGatherDispatcher (megatron-core's all-gather requires the same
    token count on every EP rank, which packed micro-batches of different replicas do not
    have)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        # (kwargs: what newer megatron-core passes its MoELayer, e.g. 0.19's is_mtp_layer, name)
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        if isinstance(self.token_dispatcher, MoEAllGatherTokenDispatcher) and (
            self.token_dispatcher.ep_size > 1 or self.token_dispatcher.tp_size > 1
        ):
            if pg_collection is None:
                pg_collection = get_default_pg_collection()
            self.token_dispatcher = PaddedAllGatherDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config,
                pg_collection=pg_collection,
            )


class LibraMoELayer(VarlenMoELayer):
    """MoELayer whose routed experts are balanced by hot-expert replication (see module doc)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                 replica_slots: int = 2, local_slots: int = -1, lookahead: bool = True,
                 record_routing: bool = False, **kwargs):
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        if not isinstance(self.token_dispatcher, PaddedAllGatherDispatcher):
            raise ValueError("moe.balancer=libra runs on megatron-core's all-gather token "
                             "dispatcher (moe_token_dispatcher_type='allgather')")
        if not isinstance(self.experts, SequentialMLP):
            raise ValueError(
                "moe.balancer=libra needs megatron-core's SequentialMLP experts "
                "(transformer_impl=local); grouped expert GEMMs are not balanced"
            )
        if self.token_dispatcher.tp_size != 1:
            raise ValueError("moe.balancer=libra needs expert tensor parallelism 1 (parallel.tp=1)")
        if config.gradient_accumulation_fusion:
            raise ValueError("moe.balancer=libra needs gradient_accumulation_fusion off: a copy's "
                             "weight gradient must reach its owner through autograd")
        self.ep = self.token_dispatcher.ep_size
        self.group = self.token_dispatcher.tp_ep_group
        self.ep_rank = dist.get_rank(self.group)
        self.replica_slots, self.local_slots = replica_slots, local_slots
        self.lookahead, self.record_routing = lookahead, record_routing
        self.next_moe: LibraMoELayer | None = None  # set by link_moe_layers
        self.first_expert = int(self.local_expert_indices[0])
        e0 = self.experts.local_experts[0]
        # one expert's parameters in the weights buffer: (name, start, end, shape), in the
        # order of parameters()
        self._layout, off = [], 0
        for name, prm in e0.named_parameters():
            self._layout.append((name, off, off + prm.numel(), prm.shape))
            off += prm.numel()
        self._per_expert = off
        self._expert_bytes = float(self._per_expert * e0.linear_fc1.weight.element_size())
        # (plan, predicted ids of this rank's tokens, weights in flight, predicted counts)
        self._pending = None
        self._host_buffers: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ lookahead
    def forward(self, hidden_states, *args, **kwargs):
        ahead = None
        if self.lookahead and self.next_moe is not None:
            ahead = self.next_moe._predict(hidden_states)
        out = super().forward(hidden_states, *args, **kwargs)
        if ahead is not None:  # read once this layer's experts are launched
            self.next_moe._pending = self.next_moe._plan_predicted(*ahead)
        return out

    @torch.no_grad()
    def _predict(self, hidden_states: torch.Tensor):
        """This layer's routing predicted from its router applied to the previous layer's input:
        (topk ids of this rank's tokens, the EP ranks' predicted counts [source, expert]), on
        the device; the counts are copied to the host behind an event (`_host_counts`)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = self.router.gating(x)
        ids = torch.topk(logits, self.config.moe_router_topk, dim=-1).indices
        local = torch.zeros(self.config.num_moe_experts, dtype=torch.int64, device=x.device)
        local.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        counts = local.new_empty(self.ep, local.numel())
        dist.all_gather(list(counts.unbind(0)), local, group=self.group)
        return ids, self._copy_counts(counts, "predicted")

    def _plan_predicted(self, ids, copied):
        """The plan from the predicted counts (read now); the replicated weights start
        moving at once."""
        predicted = self._host_counts(copied)
        plan = self._plan(predicted)
        return plan, ids, self._send_weights(plan), predicted

    def _pinned(self, name: str, shape, dtype) -> torch.Tensor:
        """This layer's pinned host buffer `name` (made once per shape). Reusing one is safe:
        between two calls of a layer the host waits on a later event of the same stream
        (`_host_counts`), so the previous call's copy from or into it has finished."""
        buf = self._host_buffers.get(name)
        if buf is None or buf.shape != tuple(shape):
            buf = self._host_buffers[name] = torch.empty(shape, dtype=dtype).pin_memory()
        return buf

    def _copy_counts(self, counts: torch.Tensor, name: str):
        """Start copying a [source, expert] count matrix to pinned host memory: (device
        tensor, host buffer or None on the host, event)."""
        if counts.device.type == "cpu":
            return counts, None, None
        host = self._pinned(name, counts.shape, counts.dtype)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return counts, host, event

    def _upload(self, a: np.ndarray, device) -> torch.Tensor:
        """A small host array on the device: one non-blocking copy from a pinned buffer."""
        if device.type == "cpu":
            return torch.from_numpy(a)
        host = self._pinned("upload", a.shape, torch.int64)
        host.numpy()[...] = a
        return host.to(device, non_blocking=True)

    def _host_counts(self, copied) -> np.ndarray:
        """The counts of `_copy_counts` on the host. The one host read a balanced layer makes
        per micro-batch (twice with the lookahead: its own actual counts and the next layer's
        predicted ones): the planner runs on the host and shards each expert's actual tokens
        over its copies; the host waits only for the counting kernel and its collective."""
        counts, host, event = copied
        if host is None:
            return counts.numpy().copy()
        event.synchronize()
        return host.numpy().copy()

    def _plan(self, counts: np.ndarray):
        return moe_plan.plan_layer(counts, self.replica_slots, self.local_slots,
                                   self._expert_bytes)

    def _send_weights(self, plan):
        """Start the all-reduce that gives every rank the replicated experts' weights: (flat
        buffer, work handle, experts in buffer order)."""
        offsets = plan.host_offsets
        copied = [e for e in range(plan.experts) if offsets[e + 1] - offsets[e] > 1]
        if not copied:
            return None
        w0 = self.experts.local_experts[0].linear_fc1.weight
        flat = torch.zeros(len(copied) * self._per_expert, dtype=w0.dtype, device=w0.device)
        per = self.num_local_experts
        for i, e in enumerate(copied):
            if e // per == self.ep_rank:
                params = [p.detach().reshape(-1) for p in
                          self.experts.local_experts[e - self.first_expert].parameters()]
                flat[i * self._per_expert:(i + 1) * self._per_expert] = torch.cat(params)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        return flat, work, copied

    # ------------------------------------------------------------------ expert compute
    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        disp = self.token_dispatcher
        routing_map = disp.routing_map  # [tokens of the EP group, experts], source-rank major
        E, ep = self.config.num_moe_experts, self.ep
        dev = routing_map.device
        # source of each token (padding rows, where the step's row count pads, route nowhere)
        src = torch.div(disp.rows, disp.pad_to, rounding_mode="floor")
        rmi = routing_map.to(torch.int64)
        counts_t = torch.zeros(ep, E, dtype=torch.int64, device=dev).index_add_(0, src, rmi)
        counts = self._host_counts(self._copy_counts(counts_t, "actual"))  # actual [source, expert]
        pending, self._pending = self._pending, None
        if pending is not None:
            planned, predicted, weights, predicted_counts = pending
            plan = moe_plan.shard(planned, counts, self.replica_slots, self._expert_bytes)
            sent = planned.bytes_moved  # every planned copy moved, used or not
            err = float(np.abs(predicted_counts - counts).sum()) / max(1, int(counts.sum()))
        else:
            plan, predicted, err = self._plan(counts), None, None
            weights = self._send_weights(plan)
            sent = plan.bytes_moved
        assign = plan.assign
        self._record(plan, predicted, routing_map, sent, err)
        # pairs of this rank: position of each (token, expert) inside its (source, expert) run
        # against the planned bounds of this host
        hi = np.cumsum(assign, axis=-1)[..., self.ep_rank]  # [source, expert]
        lo, hi = self._upload(np.stack([hi - assign[..., self.ep_rank], hi]), dev).unbind(0)
        run = torch.cumsum(rmi, dim=0)  # pairs up to each token, per expert
        start = torch.cumsum(counts_t, dim=0) - counts_t  # pairs before each source's tokens
        pos = run - 1 - start[src]
        mine = routing_map & (pos >= lo[src]) & (pos < hi[src])

        # this rank's tokens of every expert, ascending, from one index pass whose size the
        # host already knows (the plan's counts): no device-to-host read per expert
        per_expert = assign[:, :, self.ep_rank].sum(0)  # [experts], host
        if mine.device.type == "cpu" and int(mine.sum()) != int(per_expert.sum()):
            raise RuntimeError(  # the plan's counts and the routing map must agree
                f"MoE layer {self.layer_number}: {int(mine.sum())} (token, expert) pairs on "
                f"EP rank {self.ep_rank}, the plan gives it {int(per_expert.sum())}"
            )
        pairs = _nonzero(mine.t(), int(per_expert.sum()))  # (expert, token), expert-major
        tokens_of = dict(zip(range(E), torch.split(pairs[:, 1], per_expert.tolist())))
        out = hidden_states * 0  # every rank's output depends on the gathered tokens
        # local stage: resident experts, while the copies' weights are in flight
        for j, expert in enumerate(self.experts.local_experts):
            e = self.first_expert + j
            idx = tokens_of[e]
            if per_expert[e]:
                y, _ = expert(hidden_states[idx], probs[idx, e])
                out = out.index_add(0, idx, y.to(out.dtype))
        if weights is None:
            disp.local_probs = probs  # token_combine reads its dtype
            return out, None
        # remote stage: the copies this rank hosts, with the received weights; the pass-through
        # of `out` puts the copies' gradient all-reduce between the combine's and the dispatch's
        # collectives in every rank's backward
        owned = []  # ((start, end, shape) inside the buffer, parameter) of this rank's experts
        for i, e in enumerate(weights[2]):
            if e // self.num_local_experts == self.ep_rank:
                off = i * self._per_expert
                params = self.experts.local_experts[e - self.first_expert].parameters()
                for prm, (_, a, b, shape) in zip(params, self._layout):
                    owned.append(((off + a, off + b, shape), prm))
        out, wflat = _ReplicaWeights.apply(out, weights, self.group, [s for s, _ in owned],
                                           *[prm for _, prm in owned])
        template = self.experts.local_experts[0]
        for i, e in enumerate(weights[2]):
            if e // self.num_local_experts == self.ep_rank:
                continue
            idx = tokens_of[e]
            if not per_expert[e]:
                continue
            chunk = wflat[i * self._per_expert:(i + 1) * self._per_expert]
            params = {name: chunk[a:b].view(shape) for name, a, b, shape in self._layout}
            y, _ = functional_call(template, params, (hidden_states[idx], probs[idx, e]))
            out = out.index_add(0, idx, y.to(out.dtype))
        disp.local_probs = probs  # token_combine reads its dtype
        return out, None

    def _record(self, plan, predicted, routing_map, sent, err) -> None:
        """The step's statistics of this layer; `plan` holds the actual counts' figures (owners
        alone, and as computed)."""
        layer = int(self.layer_number)
        STATS.add(layer, before=plan.max_over_mean_before, after=plan.max_over_mean_after,
                  bytes=sent, plan_ms=plan.plan_ms)
        if err is not None:
            STATS.add(layer, load_error=err)
        disp = self.token_dispatcher
        first = (self.ep_rank * disp.pad_to if disp.sizes is None
                 else sum(disp.sizes[: self.ep_rank]))
        mine = routing_map[first:first + disp.n_local]
        if predicted is not None:
            hit = mine.gather(1, predicted).sum()
            # on the device: read with the step's other statistics (BalanceStats.summary)
            STATS.add(layer, overlap=hit / max(1, predicted.numel()))
        if self.record_routing and layer not in STATS.routing:
            k = self.config.moe_router_topk
            # (a debugging record: reads the routing on the host)
            sizes = disp.sizes
            if sizes is None:  # the sources' real rows of the padded layout
                n = torch.tensor([disp.n_local], device=routing_map.device)
                gathered = [torch.zeros_like(n) for _ in range(self.ep)]
                dist.all_gather(gathered, n, group=self.group)
                sizes = [int(x) for x in gathered]
                routing_map = torch.cat([routing_map[i * disp.pad_to:i * disp.pad_to + k]
                                         for i, k in enumerate(sizes)])
            ids = torch.nonzero(routing_map)[:, 1].reshape(-1, k)
            pred = None
            if predicted is not None:
                pred = disp.gather_rows(predicted)
                if disp.sizes is None:
                    pred = torch.cat([pred[i * disp.pad_to:i * disp.pad_to + n]
                                      for i, n in enumerate(sizes)])
                pred = pred.cpu().numpy()
            STATS.routing[layer] = (ids.cpu().numpy(), pred, np.asarray(sizes))


class _ReplicaWeights(torch.autograd.Function):
    """Identity on the partial output and on the received replica weights. Forward: waits for
    the weights' all-reduce (started before the local stage). Backward: one all-reduce of the
    copies' weight gradients over the EP group; the slices of the experts this rank owns become
    their gradients (summed by autograd with the owner's own use)."""

    @staticmethod
    def forward(ctx, x, weights, group, owned_slices, *owned_params):
        flat, work, _ = weights
        work.wait()
        ctx.group, ctx.owned_slices = group, owned_slices
        ctx.numel, ctx.dtype, ctx.device = flat.numel(), flat.dtype, flat.device
        return x.view_as(x), flat.view_as(flat)

    @staticmethod
    def backward(ctx, gx, gflat):
        if gflat is None:
            g = torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
        else:
            g = gflat.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        grads = [g[a:b].view(shape) for a, b, shape in ctx.owned_slices]
        return (gx, None, None, None, *grads)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """[count, 2] indices of a 2-D mask's True entries in row-major order; with a known count
    nonzero_static needs no device-to-host read."""
    if hasattr(torch, "nonzero_static"):
        return torch.nonzero_static(mask, size=count)
    return torch.nonzero(mask)


def link_moe_layers(chunk: torch.nn.Module) -> int:
    """Chain the balanced MoE layers of one model chunk (each predicts the next); returns how
    many there are."""
    layers = [m for m in chunk.modules() if isinstance(m, LibraMoELayer)]
    for a, b in zip(layers, layers[1:]):
        a.next_moe = b
    return len(layers)
