"""Python face of the C++ planner: typed options, `plan_step`, and the `StepPlan` it returns.

One call plans one optimizer step (DESIGN.md section 5). Arrays come back as numpy arrays that
own the C++ buffers (no copy). The call releases the GIL, so the sampler can plan the next step
from a background thread while the current one trains.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from libra_ext import _planner as _core
from libra_ext.workload import ModelConfig, PackedBatch

SYSTEMS = ("libra", "ulysses", "wlb", "distca")
ORDERS = ("megatron", "contiguous")
"""Production orders of a step's input sequences (see PlannerOptions.order)."""
"""Systems the planner serves behind one switch."""


DISTCA_SERVERS = {
    "replica": "distca (one attention server per replica)",
    "gpu": "distca (every GPU an attention server, as DistCA deploys it)",
}
"""What a DistCA attention server can be (`distca_server`), and how a report names the variant
that ran."""


def system_label(system: str, distca_server: str = "replica") -> str:
    """The system's name with the variant it runs, for reports and log lines."""
    return DISTCA_SERVERS.get(distca_server, system) if system == "distca" else system


@dataclass
class LayoutConfig:
    """Parallel layout of a step (Megatron rank order tp-cp-ep-dp-pp)."""

    dp: int
    """D: data-parallel replicas."""
    cp: int
    """C: context-parallel ranks per replica."""
    pool_size: int
    """P: replicas per sequence pool; must divide dp."""
    context: int
    """S: tokens per packed sequence."""
    tp: int = 1
    """T: tensor-parallel ranks."""

    def __post_init__(self) -> None:
        for f in fields(self):
            int64_field(getattr(self, f.name), f.name)
        self.to_core().validate()

    def to_core(self) -> "_core.Layout":
        out = _core.Layout()
        out.dp, out.cp, out.tp, out.pool, out.context = (
            self.dp,
            self.cp,
            self.tp,
            self.pool_size,
            self.context,
        )
        return out


_DEFAULTS = _core.PlanOptions()
"""The C++ core's default options (`cpp/include/libra/plan.h`): the one place each default is
written; the Python declarations below read theirs from it."""


@dataclass
class PlannerKnobs:
    """The planner's settings a user chooses: the one declaration from which the training
    config's `system` section (`SystemConfig`), `pretrain_gpt_libra.py`'s `--libra-*`
    arguments, `libra plan`'s flags and docs/config_reference.md are derived."""

    block: int | None = None
    """Query tokens per SH-tile (None: context / 16, at least 1024)."""
    head_group: int = _DEFAULTS.head_group
    """Heads per SH-tile (0: the whole slice of a rank)."""
    epsilon: float = _DEFAULTS.epsilon
    """TAP soft cap: a member takes tiles up to (1 + epsilon) x the group mean."""
    max_tile_share: float = _DEFAULTS.max_tile_share
    """TAP: tiles heavier than this share of a member's mean load are split (heads, then rows;
    0: never)."""
    vrsp: bool = _DEFAULTS.vrsp
    """libra: VRSP placement (false: Megatron's production order)."""
    tap: bool = _DEFAULTS.tap
    """libra: move tiles inside the pool (false: every owner computes its own attention)."""
    refine: bool = _DEFAULTS.refine
    """libra: TAP's refinement pass after the greedy."""
    distca_tolerance: float = _DEFAULTS.distca_tolerance
    """distca: a replica stops receiving once its deficit is within this share of the mean."""
    distca_server: str = _DEFAULTS.distca_server
    """distca: what an attention server is. replica (one per replica, its heads split evenly
    over its GPUs by Ulysses: stronger than DistCA's own) or gpu (DistCA as deployed: every GPU
    a server, its planner's decisions; run where a GPU is a replica, cp 1; with cp > 1 it cuts
    documents at GPU boundaries, which `libra simulate` models as system distca)."""
    wlb_outlier_len: int = _DEFAULTS.wlb_outlier_len
    """wlb: documents at least this long wait in the delay queue (0: context / 4)."""
    wlb_max_delay: int = _DEFAULTS.wlb_max_delay
    """wlb: most steps an outlier document may wait."""
    wlb_release_count: int = _DEFAULTS.wlb_release_count
    """wlb: an outlier level is released once it holds this many documents (0: dp)."""

    def knobs(self) -> dict:
        """{field: value} of every planner knob (what PlannerOptions takes of them)."""
        return {f.name: getattr(self, f.name) for f in fields(PlannerKnobs)}


@dataclass
class PlannerOptions(PlannerKnobs):
    """Which system plans the step, its knobs, and what the caller fixes for it."""

    system: str = _DEFAULTS.system
    """One of libra, ulysses, wlb, distca."""
    dtype_bytes: int = _DEFAULTS.dtype_bytes
    """Bytes per Q/K/V/O element (2 for bf16)."""
    order: str = _DEFAULTS.order
    """Production order of the step's input sequences, used where nothing balances them (ulysses,
    distca, the `_before` figures, VRSP's fallback): megatron (Megatron-LM's pretraining sampler:
    each micro-batch round hands micro_batch_size samples to each data-parallel rank in turn;
    with 1, sample q to replica q mod D, slot q // D) or contiguous (replica q // m)."""
    micro_batch_size: int = _DEFAULTS.micro_batch_size
    """Sequences per micro-batch and replica in Megatron order; divides gbs / dp."""
    threads: int = _DEFAULTS.threads
    """Worker threads for TAP's groups; 0 = automatic: one per 16K documents of the step, at most
    the machine's cores and 8. The plan does not depend on it."""

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system must be one of {', '.join(SYSTEMS)}; got {self.system!r}")
        bad_block = (
            isinstance(self.block, bool) or not isinstance(self.block, int) or self.block <= 0
        )
        if self.block is not None and bad_block:
            raise ValueError(
                f"block must be a positive integer, got {self.block!r} (unset: context / 16)"
            )
        self.to_core().validate()

    def to_core(self) -> "_core.PlanOptions":
        out = _core.PlanOptions()
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "block" and v is None:
                v = 0  # the core's "context / 16"
            expected = type(getattr(out, f.name))
            if expected is bool:
                if not isinstance(v, (bool, np.bool_)):
                    raise ValueError(f"{f.name} must be true or false, got {v!r}")
                v = bool(v)
            elif expected is int:
                v = int64_field(v, f.name)
            elif expected is float:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
                    raise ValueError(f"{f.name} must be a number, got {v!r}")
                v = float(v)
            elif not isinstance(v, str):
                raise ValueError(f"{f.name} must be a string, got {v!r}")
            setattr(out, f.name, v)
        return out


_SCALARS = (
    "dp",
    "cp",
    "tp",
    "pool",
    "context",
    "slots",
    "exchange_pool",
    "heads_local",
    "kv_heads_local",
    "head_dim",
    "dtype_bytes",
)
_METRICS = (
    "max_over_mean",
    "max_over_mean_before",
    "inter_pool_imbalance",
    "inter_pool_imbalance_before",
    "pool_total_imbalance",
    "pool_total_imbalance_before",
    "vrsp_max_group",
    "vrsp_lower_bound",
    "vrsp_max_pool",
    "vrsp_pool_lower_bound",
    "achievable_max_over_mean",
    "moved_token_fraction",
    "total_bytes",
    "plan_ms",
)


PLAN_PHASES = ("input", "placement", "tiles", "exchange", "metrics", "hash")
"""Phases of planning a step, timed in `StepPlan.phase_ms` (they sum to `plan_ms`): reading,
validating and copying the input; placing sequences on replicas (VRSP; WLB-LLM's packing), while a
second thread finishes the document arrays and the placement bounds; making and placing tiles (for
libra also each group's exchange tables and loads, and laying the arrays out); the other systems'
exchange tables; the metrics; the hash."""


class StepPlan:
    """One step's plan: flat integer arrays plus metrics (see DESIGN.md section 5).

    Attributes mirror the C++ struct: `seq_doc_offsets`, `doc_lengths`, `doc_ids`, `seq_replica`,
    `seq_slot`, `tile_*`, `xchg_q|kv|o` (shape [groups, P, P], sender x receiver, elements
    per rank), `send_order`, `send_group_offsets`, `kv_*`, `rank_load` ([D, C]) and the scalar
    metrics. `hash` is the 64-bit plan hash that ranks compare; `plan_ms` and `phase_ms` (per
    phase of `PLAN_PHASES`) time the planning and are not hashed.
    """

    def __init__(self, raw: dict):
        self.system: str = raw.pop("system")
        self.hash: int = int(raw.pop("hash"))
        for k in _SCALARS:
            setattr(self, k, int(raw.pop(k)))
        for k in _METRICS:
            setattr(self, k, float(raw.pop(k)))
        px = self.exchange_pool
        for k in ("xchg_q", "xchg_kv", "xchg_o"):
            raw[k] = raw[k].reshape(-1, px, px)
        for k in ("rank_load", "rank_load_before", "rank_bytes_sent"):
            raw[k] = raw[k].reshape(self.dp, self.cp)
        self.phase_ms = dict(zip(PLAN_PHASES, (float(x) for x in raw.pop("phase_ms"))))
        for k, v in raw.items():
            setattr(self, k, v)

    @property
    def n_seq(self) -> int:
        return len(self.seq_replica)

    @property
    def n_tiles(self) -> int:
        return len(self.tile_seq)

    @property
    def vrsp_lower_bound_ratio(self) -> float:
        """VRSP's max group load over the exact-cardinality lower bound."""
        return self.vrsp_max_group / self.vrsp_lower_bound if self.vrsp_lower_bound > 0 else 1.0

    @property
    def vrsp_pool_bound_ratio(self) -> float:
        """VRSP's max pool total over the exact-cardinality lower bound of pool totals."""
        if self.vrsp_pool_lower_bound <= 0:
            return 1.0
        return self.vrsp_max_pool / self.vrsp_pool_lower_bound

    def sequences(self) -> list[list[int]]:
        """Document lengths of every executed packed sequence."""
        off = self.seq_doc_offsets
        return [self.doc_lengths[off[s] : off[s + 1]].tolist() for s in range(self.n_seq)]

    def sequence_tokens(self) -> np.ndarray:
        """[n_seq] tokens of each packed sequence (0 for one without documents: WLB-LLM's
        repacking can leave one empty, the last one included)."""
        csum = np.zeros(len(self.doc_lengths) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths, out=csum[1:])
        off = np.asarray(self.seq_doc_offsets)
        return csum[off[1:]] - csum[off[:-1]]

    def group_of(self, replica: int, slot: int) -> int:
        """Exchange group of a (replica, slot)."""
        return (replica // self.exchange_pool) * self.slots + slot

    def metrics(self) -> dict:
        out = {k: getattr(self, k) for k in _METRICS}
        out["vrsp_lower_bound_ratio"] = self.vrsp_lower_bound_ratio
        out["vrsp_pool_bound_ratio"] = self.vrsp_pool_bound_ratio
        out["bytes_moved_per_rank"] = float(self.rank_bytes_sent.mean())
        out["bytes_moved_max_rank"] = float(self.rank_bytes_sent.max())
        return out

    def sequence_at(self, replica: int, slot: int) -> int:
        """The sequence that (replica, slot) executes (every pair holds exactly one)."""
        s = np.flatnonzero((self.seq_replica == replica) & (self.seq_slot == slot))
        if len(s) != 1:
            raise ValueError(f"plan has {len(s)} sequences at replica {replica}, slot {slot}")
        return int(s[0])

    def rank_slice(self, replica: int, cp_rank: int) -> dict:
        """What rank (replica, cp_rank) needs of the plan: its sequences, the tiles it owns and
        executes, and per slot its rows (sends) and columns (receives) of the exchange matrices.
        Every tp rank of the pair gets the same slice."""
        if not 0 <= replica < self.dp:
            raise ValueError(f"replica must be in [0, {self.dp}), got {replica}")
        if not 0 <= cp_rank < self.cp:
            raise ValueError(f"cp_rank must be in [0, {self.cp}), got {cp_rank}")
        mine_cp = (self.tile_cp == -1) | (self.tile_cp == cp_rank)
        px, member = self.exchange_pool, replica % self.exchange_pool
        groups = [self.group_of(replica, s) for s in range(self.slots)]
        out = {
            "sequences": np.flatnonzero(self.seq_replica == replica),
            "tiles_owned": np.flatnonzero((self.tile_owner == replica) & mine_cp),
            "tiles_executed": np.flatnonzero((self.tile_executor == replica) & mine_cp),
            "groups": np.asarray(groups, dtype=np.int64),
        }
        for k in ("xchg_q", "xchg_kv", "xchg_o"):
            m = getattr(self, k)
            out[k + "_send"] = m[groups, member, :].reshape(self.slots, px)
            out[k + "_recv"] = m[groups, :, member].reshape(self.slots, px)
        return out


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def int64_field(value, name: str) -> int:
    """An integer that fits the core's 64-bit fields, or a ValueError naming the field (bools
    and floats are refused, not coerced)."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if not INT64_MIN <= v <= INT64_MAX:
        raise ValueError(f"{name} = {v} is out of range (a 64-bit integer)")
    return v


def _flush_arg(flush) -> bool:
    if not isinstance(flush, (bool, np.bool_)):
        raise ValueError(f"flush must be True or False, got {flush!r}")
    return bool(flush)


class Planner:
    """Plans steps for one layout, model and system; carries WLB-LLM's queue between steps."""

    def __init__(self, layout: LayoutConfig, model: ModelConfig, options: PlannerOptions):
        self.layout, self.model, self.options = layout, model, options
        self._layout, self._model, self._options = (
            layout.to_core(),
            model.to_core(),
            options.to_core(),
        )
        self.state = _core.PlannerState()

    def plan(self, sequences: PackedBatch | Sequence[Sequence[int]], flush: bool = False) -> StepPlan:
        """Plan one step. `sequences`: a PackedBatch (read without a copy), or a list of lists
        (or 1-D integer arrays) of document lengths; `flush` releases everything WLB-LLM holds."""
        flush = _flush_arg(flush)
        core = (self._layout, self._model, self._options, self.state, flush)
        if isinstance(sequences, PackedBatch):
            raw = _core.plan_step_flat(sequences.lengths, sequences.offsets, *core)
        else:
            raw = _core.plan_step(sequences, *core)
        return StepPlan(raw)

    def set_cost_model(self, table) -> None:
        """Balance `table`'s predicted time (a `costmodel.CostTable`) from the next plan on, or
        causal pairs with None. libra and distca balance attention work, wlb packs documents by
        it; ulysses plans do not change."""
        self._options.cost = _core.CostModel() if table is None else table.to_core()
        self._options.validate()

    @property
    def pending_documents(self) -> int:
        """Documents held back in WLB-LLM's delay queue or overflow."""
        return int(self.state.pending)

    def state_dict(self) -> dict:
        return {"planner_state": list(self.state.serialize())}

    def load_state_dict(self, sd: dict) -> None:
        """Load a state from `state_dict` (a checkpoint's: untrusted input). Every entry is
        checked, against this planner's layout and options too; a refused state leaves the
        current one in place."""
        if not isinstance(sd, dict) or "planner_state" not in sd:
            raise ValueError("planner state: expected a dict with a 'planner_state' list")
        flat = sd["planner_state"]
        if isinstance(flat, np.ndarray):
            flat = flat.tolist()
        if not isinstance(flat, (list, tuple)):
            raise ValueError(f"planner_state must be a list of integers, got {type(flat).__name__}")
        values = [int64_field(v, f"planner_state[{i}]") for i, v in enumerate(flat)]
        state = _core.PlannerState.deserialize(values)
        state.validate(self._layout, self._options)
        self.state = state


def plan_step(
    sequences: PackedBatch | Sequence[Sequence[int]],
    layout: LayoutConfig,
    model: ModelConfig | None = None,
    options: PlannerOptions | None = None,
) -> StepPlan:
    """Plan one step with a fresh planner state (for wlb use `Planner` to carry the queue)."""
    return Planner(layout, model or ModelConfig(), options or PlannerOptions()).plan(sequences)
