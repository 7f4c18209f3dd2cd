"""Expert-load balancing for MoE layers under expert parallelism (EP).

Routers send disproportionate tokens to a few hot experts, so the EP rank that owns them sets the
pace of every MoE layer. The balancer moves work, not tokens' routing: per layer the C++ planner
(`moe_plan`) places copies of hot experts on other EP ranks, under a per-rank budget of extra
expert slots, in two phases:

1. locality: each rank imports the non-resident experts that receive the most of its own tokens
   (they then compute on the rank that holds them), while that does not raise the heaviest rank;
2. balance: the hottest expert of the most loaded rank is replicated onto the least loaded rank
   with a free slot, while that lowers the maximum.

The tokens of an expert with copies are sharded over its hosts: each host's own tokens stay on it,
the other sources' tokens fill the hosts up to a common level (water filling). Loads are counted
in tokens (every routed expert has the same FLOPs per token); the weights a replica moves are
reported as bytes.

The decision for layer l+1 is made one layer early from a lookahead prediction: layer l+1's router
applied to layer l's input (hidden states change slowly across layers); the copies' weights move
then. Once the layer's actual routing is known, `shard` splits the actual tokens over the hosts
that plan chose (the copies stay, the shares follow the actual loads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from libra_ext import _planner as _core


@dataclass
class MoeLayerPlan:
    """One layer's replication plan (see the module docstring). Arrays are numpy."""

    ep: int
    experts: int
    host_offsets: np.ndarray  # [experts + 1]
    hosts: np.ndarray  # owner first, then replicas
    assign: np.ndarray  # [ep (source), experts, ep (host)] tokens
    rank_tokens_before: np.ndarray
    rank_tokens_after: np.ndarray
    replicas_local: int
    replicas_balance: int
    remote_tokens_before: int
    remote_tokens_after: int
    max_over_mean_before: float
    max_over_mean_after: float
    bytes_moved: float
    plan_ms: float

    def hosts_of(self, e: int) -> list[int]:
        return self.hosts[self.host_offsets[e]:self.host_offsets[e + 1]].tolist()

    @property
    def replicas(self) -> list[tuple[int, int]]:
        """(expert, rank) of every copy beyond the owner's, by expert then placement order."""
        return [(e, int(h)) for e in range(self.experts) for h in self.hosts_of(e)[1:]]

    def host_mask(self) -> np.ndarray:
        """[experts, ep] bool: rank r holds a copy (or the original) of expert e."""
        m = np.zeros((self.experts, self.ep), dtype=bool)
        for e in range(self.experts):
            m[e, self.hosts_of(e)] = True
        return m


def plan_layer(
    counts: np.ndarray, replica_slots: int, local_slots: int = -1, expert_bytes: float = 0.0
) -> MoeLayerPlan:
    """Replication plan of one layer from counts[source rank, expert] (top-k assignments)."""
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be [ep, experts], got shape {counts.shape}")
    if not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"counts must hold integers, got {counts.dtype}")
    o = _options(counts.shape[0], counts.shape[1], replica_slots, local_slots, expert_bytes)
    return _plan_of(_core.moe_plan(counts.astype(np.int64).ravel(), o))


def shard(plan: MoeLayerPlan, counts: np.ndarray, replica_slots: int,
          expert_bytes: float = 0.0) -> MoeLayerPlan:
    """The actual counts sharded over the hosts a plan chose (a plan made one layer early from
    predicted counts): the copies stay where their weights were sent, the tokens are split by
    the actual loads."""
    counts = np.asarray(counts)
    if counts.shape != (plan.ep, plan.experts):
        raise ValueError(
            f"counts must be [ep={plan.ep}, experts={plan.experts}], got {counts.shape}"
        )
    o = _options(plan.ep, plan.experts, replica_slots, -1, expert_bytes)
    return _plan_of(
        _core.moe_shard(counts.astype(np.int64).ravel(), o, plan.host_offsets, plan.hosts)
    )


def _options(ep: int, experts: int, replica_slots: int, local_slots: int,
             expert_bytes: float) -> _core.MoeOptions:
    o = _core.MoeOptions()
    o.ep, o.experts = int(ep), int(experts)
    o.replica_slots, o.local_slots, o.expert_bytes = replica_slots, local_slots, expert_bytes
    return o


def _plan_of(d: dict) -> MoeLayerPlan:
    d["assign"] = d["assign"].reshape(d["ep"], d["experts"], d["ep"])
    return MoeLayerPlan(**d)


# ---------------------------------------------------------------------------------------------
# Synthetic routing: skewed popularity with a drifting hot set, and a router lookahead
# ---------------------------------------------------------------------------------------------


@dataclass
class SyntheticRouting:
    """Routing of `layers` MoE layers for `tokens` tokens per EP rank, made the way a trained
    model routes: hidden states that change slowly from layer to layer (each layer adds a random
    update of relative size `drift`), a random linear router per layer, and expert popularity
    following Zipf(s) over a ranking that drifts between layers (`hot_swaps` random swaps of
    neighbouring ranks per layer). The lookahead prediction of layer l is layer l's router
    applied to layer l-1's hidden states, as the balancer does in training."""

    experts: int = 128
    topk: int = 8
    ep: int = 8
    layers: int = 8
    tokens: int = 4096
    zipf_s: float = 1.2
    hidden: int = 64
    drift: float = 0.35
    temperature: float = 2.0
    hot_swaps: int = 8
    seed: int = 0
    _actual: list = field(default_factory=list, repr=False)
    _predicted: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        for name in ("experts", "topk", "ep", "layers", "tokens", "hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.experts % self.ep:
            raise ValueError(f"experts ({self.experts}) must be divisible by ep ({self.ep})")
        if self.topk > self.experts:
            raise ValueError(f"topk ({self.topk}) must be at most experts ({self.experts})")
        if not self.zipf_s >= 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")
        rng = np.random.default_rng(self.seed)
        n = self.ep * self.tokens
        h = rng.standard_normal((n, self.hidden)).astype(np.float32)
        rank = rng.permutation(self.experts)  # popularity rank of each expert
        prev = h
        for _ in range(self.layers):
            step = rng.standard_normal((n, self.hidden)).astype(np.float32)
            h = h + self.drift * step
            h /= np.linalg.norm(h, axis=1, keepdims=True) / np.sqrt(self.hidden)
            for _ in range(self.hot_swaps):
                i = int(rng.integers(0, self.experts - 1))
                a, b = np.flatnonzero(rank == i)[0], np.flatnonzero(rank == i + 1)[0]
                rank[a], rank[b] = i + 1, i
            w = rng.standard_normal((self.hidden, self.experts)).astype(np.float32)
            w *= self.temperature / np.sqrt(self.hidden)
            bias = -self.zipf_s * np.log1p(rank).astype(np.float32)
            self._actual.append(self._topk(h @ w + bias))
            self._predicted.append(self._topk(prev @ w + bias))
            prev = h

    def _topk(self, logits: np.ndarray) -> np.ndarray:
        return np.argpartition(-logits, self.topk - 1, axis=1)[:, : self.topk]

    def counts(self, layer: int, predicted: bool = False) -> np.ndarray:
        """[ep, experts] tokens of each source rank routed to each expert."""
        return routing_counts((self._predicted if predicted else self._actual)[layer], self.ep,
                              self.experts)

    def topk_overlap(self, layer: int) -> float:
        """Mean share of a token's top-k experts that the lookahead predicted."""
        return topk_overlap(self._predicted[layer], self._actual[layer])


def routing_counts(topk_ids: np.ndarray, ep: int, experts: int,
                   sizes: np.ndarray | None = None) -> np.ndarray:
    """[ep, experts] counts from [tokens, k] expert ids in source-rank order: `sizes` tokens
    from each source rank (default: split evenly)."""
    n = topk_ids.shape[0]
    if sizes is None:
        if n % ep:
            raise ValueError(f"tokens ({n}) must be divisible by ep ({ep})")
        sizes = np.full(ep, n // ep)
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.shape != (ep,) or sizes.sum() != n or (sizes < 0).any():
        raise ValueError(f"sizes must be {ep} non-negative token counts summing to {n}")
    src = np.repeat(np.arange(ep), sizes)[:, None]
    out = np.zeros((ep, experts), dtype=np.int64)
    np.add.at(out, (np.broadcast_to(src, topk_ids.shape), topk_ids), 1)
    return out


def topk_overlap(predicted: np.ndarray, actual: np.ndarray) -> float:
    k = actual.shape[1]
    hits = (predicted[:, :, None] == actual[:, None, :]).any(-1).sum()
    return float(hits / (actual.shape[0] * k))


def bench_layers(
    actual: list[np.ndarray],
    predicted: list[np.ndarray] | None,
    replica_slots: int,
    local_slots: int = -1,
    expert_bytes: float = 0.0,
    overlaps: list[float] | None = None,
) -> dict:
    """Per-layer balance of plans made from the lookahead counts (or the actual ones where there
    is no prediction), the actual counts sharded over the hosts they chose."""
    rows = []
    for layer, act in enumerate(actual):
        pred = predicted[layer] if predicted is not None else act
        t0 = time.perf_counter()
        plan = plan_layer(pred, replica_slots, local_slots, expert_bytes)
        call_ms = (time.perf_counter() - t0) * 1e3
        # the actual counts over the planned hosts (both figures on the actual counts)
        used = shard(plan, act, replica_slots) if predicted is not None else plan
        err = float(np.abs(pred.sum(0) - act.sum(0)).sum() / max(1, act.sum()))
        rows.append({
            "layer": layer,
            "max_over_mean_before": used.max_over_mean_before,
            "max_over_mean_after": used.max_over_mean_after,
            "max_over_mean_after_exact": plan.max_over_mean_after if predicted is None else
            plan_layer(act, replica_slots, local_slots, expert_bytes).max_over_mean_after,
            "replicas": plan.replicas_local + plan.replicas_balance,
            "replicas_local": plan.replicas_local,
            "bytes_moved": plan.bytes_moved,
            "plan_ms": plan.plan_ms,
            "call_ms": call_ms,
            "load_error": err if predicted is not None else 0.0,
            "lookahead_topk_overlap": overlaps[layer] if overlaps is not None else None,
        })
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    out = {
        "layers": len(rows),
        "replica_slots": replica_slots,
        "max_over_mean_before": mean("max_over_mean_before"),
        "max_over_mean_after": mean("max_over_mean_after"),
        "max_over_mean_after_exact": mean("max_over_mean_after_exact"),
        "bytes_moved_per_layer": mean("bytes_moved"),
        "plan_ms_per_layer": mean("plan_ms"),
        "lookahead_load_error": mean("load_error"),
        "lookahead_topk_overlap": (
            float(np.mean(overlaps)) if overlaps is not None else None
        ),
        "rows": rows,
    }
    return out


def expert_bytes(hidden: int, moe_ffn: int, dtype_bytes: int = 2) -> float:
    """Weights of one SwiGLU expert: fc1 (gate and up, [2 F, H]) and fc2 ([H, F])."""
    return float(3 * hidden * moe_ffn * dtype_bytes)


# ---------------------------------------------------------------------------------------------
# Routing records (written by training with logging.record_routing = true)
# ---------------------------------------------------------------------------------------------

ROUTING_SCHEMA = 1


def save_routing(path, topk_ids: list[np.ndarray], predicted_ids: list[np.ndarray | None],
                 experts: int, ep: int, hidden: int, moe_ffn: int,
                 source_sizes: np.ndarray | None = None) -> None:
    """One step's routing of every MoE layer: [tokens, k] expert ids per layer (tokens of the
    EP group in source-rank order, `source_sizes` of each source rank; default an even split)
    and the lookahead's prediction (None for the first layer)."""
    n = topk_ids[0].shape[0]
    if source_sizes is None:
        source_sizes = np.full(ep, n // ep)
    k = topk_ids[0].shape[1]
    has = np.array([p is not None for p in predicted_ids])
    pred = np.stack([p if p is not None else np.full_like(a, -1)
                     for a, p in zip(topk_ids, predicted_ids)])
    np.savez_compressed(
        path, schema=ROUTING_SCHEMA, topk_ids=np.stack(topk_ids).astype(np.int32),
        predicted_ids=pred.astype(np.int32), has_prediction=has, experts=experts, ep=ep,
        topk=k, hidden=hidden, moe_ffn=moe_ffn, source_sizes=np.asarray(source_sizes),
    )


@dataclass
class RoutingRecord:
    topk_ids: np.ndarray  # [layers, tokens, k]
    predicted_ids: np.ndarray
    has_prediction: np.ndarray
    experts: int
    ep: int
    topk: int
    hidden: int
    moe_ffn: int
    source_sizes: np.ndarray  # tokens of each source rank

    def counts(self, layer: int, predicted: bool = False) -> np.ndarray:
        ids = (self.predicted_ids if predicted else self.topk_ids)[layer]
        return routing_counts(ids, self.ep, self.experts, self.source_sizes)


def load_routing(path, experts: int | None = None, ep: int | None = None,
                 topk: int | None = None) -> RoutingRecord:
    """Read a routing record; `experts` / `ep` / `topk`, when given, must match its model shape
    (the error names the field)."""
    try:
        z = np.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"routing file {path}: not a routing record ({e})") from None
    need = ("schema", "topk_ids", "predicted_ids", "has_prediction", "experts", "ep", "topk",
            "hidden", "moe_ffn", "source_sizes")
    for key in need:
        if key not in z.files:
            raise ValueError(f"routing file {path}: field {key!r} is missing")
    if int(z["schema"]) != ROUTING_SCHEMA:
        raise ValueError(f"routing file {path}: schema {int(z['schema'])}, expected "
                         f"{ROUTING_SCHEMA}")
    rec = RoutingRecord(
        z["topk_ids"], z["predicted_ids"], z["has_prediction"].astype(bool),
        *(int(z[k]) for k in ("experts", "ep", "topk", "hidden", "moe_ffn")),
        z["source_sizes"].astype(np.int64),
    )
    for name, want in (("experts", experts), ("ep", ep), ("topk", topk)):
        if want is not None and getattr(rec, name) != want:
            raise ValueError(f"routing file {path}: {name} is {getattr(rec, name)}, the model "
                             f"asked for has {want}")
    ids = rec.topk_ids
    if ids.ndim != 3 or ids.shape[2] != rec.topk or ids.shape != rec.predicted_ids.shape:
        raise ValueError(f"routing file {path}: topk_ids must be [layers, tokens, topk={rec.topk}]"
                         f" like predicted_ids, got {ids.shape} and {rec.predicted_ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= rec.experts):
        raise ValueError(f"routing file {path}: topk_ids holds expert ids outside "
                         f"[0, experts={rec.experts})")
    sz = rec.source_sizes
    if sz.shape != (rec.ep,) or (sz < 0).any() or sz.sum() != ids.shape[1]:
        raise ValueError(f"routing file {path}: source_sizes must be {rec.ep} token counts "
                         f"summing to the {ids.shape[1]} tokens")
    return rec
