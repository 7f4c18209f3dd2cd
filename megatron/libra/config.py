"""Training configuration: typed sections loaded from YAML, overridable as `key.sub=value`.

Unknown keys and bad values are rejected with the field path; everything that can be checked
before any process group exists (pool size vs DP, heads vs CP*TP, system, data path) is checked
by `TrainConfig.validate(world_size)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from libra_ext.attention import BACKENDS, DEFAULT_CHUNKS
from libra_ext.costmodel import COST_MODELS
from libra_ext.memory import check_attention_memory
from libra_ext.pipeline import PP_ORDERS
from libra_ext.planner import DISTCA_SERVERS, ORDERS, SYSTEMS, PlannerKnobs, PlannerOptions
from libra_ext.workload import MAX_TOKENS, ModelConfig, check_int, preset_names, read_lengths_file

_NAMES: contextvars.ContextVar = contextvars.ContextVar("field_names", default=None)


def name(field: str) -> str:
    """How a check's message names a config field: its path (`parallel.pool_size`), or, inside
    `field_names(mapping)`, the name the caller's users know it by (a `pretrain_gpt_libra.py`
    argument, say)."""
    mapping = _NAMES.get()
    return mapping.get(field, field) if mapping else field


@contextlib.contextmanager
def field_names(mapping: dict):
    """Checks inside name the fields of `mapping` (field path -> name) by their names there."""
    token = _NAMES.set(mapping)
    try:
        yield
    finally:
        _NAMES.reset(token)


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""
    cp: int = 1
    """Context-parallel size (Ulysses / per-document CP inside a replica)."""
    pool_size: int = 1
    """Replicas per Libra pool; must divide the data-parallel size."""
    ep: int = 1
    """Expert-parallel size of MoE layers (megatron-core's expert_model_parallel_size); must
    divide the number of experts and the world size. Tokens reach their experts by all-to-all
    on GPU and by all-gather on CPU."""
    timeout_minutes: float = 10.0
    """Every process group's collective timeout (Megatron-LM's --distributed-timeout-minutes):
    a rank that stops or hangs ends the run with an error after this long instead of a hang."""
    pp: int = 1
    """Pipeline-parallel stages (megatron-core's 1F1B schedule; model.layers must divide over
    pp * vpp). Ranks are laid out tp-cp-ep-dp-pp, as Megatron-LM does."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank: > 1 runs megatron-core's
    interleaved 1F1B schedule (needs pp > 1 and gbs / dp micro-batches a multiple of pp)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism with TP: layer norms and dropout on a 1/tp share of the
    tokens (needs tp > 1)."""


@dataclass
class SystemConfig(PlannerKnobs):
    """Which system runs the step and how: the planner's knobs (`PlannerKnobs`, declared once in
    libra_ext.planner, defaults from the C++ core) and the runtime's settings."""

    name: str = "libra"
    """libra | ulysses | wlb | distca."""
    pipeline: bool = True
    """Overlap the pool exchange with attention compute (false: each transfer completes before
    the next step; identical results)."""
    chunks: int = DEFAULT_CHUNKS
    """Chunks of the pool exchange pipeline: each executor's incoming bytes are cut into this
    many equal rounds (fewer when little moves)."""
    attention_backend: str = "auto"
    """Attention kernel: auto (best available: te > flash > varlen > reference, one log line
    says which and why) or one of te, flash, varlen, reference to force it."""
    attention_memory: str = "keep"
    """What the attention operator keeps for backward. keep: every kernel keeps its output and
    inputs; at cp > 1 that is the layer's O twice (the kernel's before the Ulysses all-to-all
    back, and the layer's output: ~0.8x the layer's Q/K/V more than a plain call) and, for
    moved tiles, their Q/K/V/O on the executor beside the owner's. owner: moved tiles' Q/K/V/O
    kept once, by their owner, and shipped to the executor again with dO in the backward (pool
    bytes, overlapped with the owner's own backward; Ulysses as keep). rebuild: no more than a
    plain call (its Q/K/V and the layer's output): that, and the kernel's O freed after the
    forward and rebuilt in the backward by one more all-to-all of O over the CP group, and
    where the plan says it lowers the backward's peak, the executed units' backward run before
    the direct call's, holding no more than it will (the first sub-chunk's dO exposed, and a
    sub-chunk's that an executor could not post ahead). wlb
    (owner or rebuild): its key and value packs freed after the forward and gathered again (K
    and V all-gathered once more) in the backward. Identical
    results under every setting; `libra simulate --attention-memory` prices the time owner and
    rebuild add (docs/simulator.md)."""
    pp_order: str = "none"
    """With pipeline parallelism: none (micro-batches in the plan's slot order) or balanced
    (each exchange pool's slots reordered to shorten the modeled 1F1B step; the same samples,
    only their order changes; see `libra plan --pp`)."""
    cost_model: str = "pairs"
    """What libra, distca and wlb's packing balance: pairs (causal pairs x heads), profile (the table of the
    hardware profile system.cost_profile, e.g. `libra calibrate`'s) or online (a table fitted
    every system.cost_fit_interval steps from the run's measured attention times, the same on
    every rank, saved with checkpoints; its prior: system.cost_profile's table where set, else
    pairs). ulysses plans as before under any setting."""
    cost_fit_interval: int = 10
    """online: steps between fits; a fit made after step k plans steps k + 3 on."""
    cost_profile: str | None = None
    """profile (and online's prior): a hardware profile, a name in configs/hardware or a file."""

    def check(self) -> None:
        """The system section's own checks: the system, the exchange chunks, the kernel."""
        if self.name not in SYSTEMS:
            raise ValueError(
                f"{name('system.name')} must be one of {', '.join(SYSTEMS)}, got {self.name!r}")
        if self.chunks < 1:
            raise ValueError(f"{name('system.chunks')} must be >= 1, got {self.chunks}")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"{name('system.cost_model')} must be one of "
                             f"{', '.join(COST_MODELS)}, got {self.cost_model!r}")
        if self.cost_model == "profile" and not self.cost_profile:
            raise ValueError(f"{name('system.cost_model')} = profile needs "
                             f"{name('system.cost_profile')} (a hardware profile)")
        if self.cost_fit_interval < 1:
            raise ValueError(f"{name('system.cost_fit_interval')} must be >= 1, got "
                             f"{self.cost_fit_interval}")
        check_attention_memory(self.attention_memory, name("system.attention_memory"))
        if self.attention_backend not in ("auto",) + BACKENDS:
            raise ValueError(
                f"{name('system.attention_backend')} must be auto or one of {', '.join(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )

    def planner_options(self, order: str, dtype_bytes: int) -> PlannerOptions:
        """The PlannerOptions these settings stand for."""
        return PlannerOptions(system=self.name, order=order, dtype_bytes=dtype_bytes,
                              **self.knobs())


@dataclass
class DataConfig:
    source: str = "synthetic"
    """synthetic (long-tail document lengths, random token ids) or indexed (Megatron .bin/.idx)."""
    workload: str = "libra-256k"
    """synthetic: length preset."""
    lengths_file: str | None = None
    """synthetic: draw document lengths from this file instead of a preset."""
    path: str | None = None
    """indexed: dataset prefix (PATH.bin / PATH.idx)."""
    shuffle: bool = True
    """indexed: visit documents in a seeded random order, a new order each pass (epoch);
    false: index order."""
    context: int = 256
    """Tokens per packed sequence (S)."""
    gbs: int = 8
    """Packed sequences per optimizer step (B); a multiple of the data-parallel size."""
    order: str = "megatron"
    """Production order of a step's packed sequences over data-parallel replicas, where nothing
    balances them (ulysses, distca, the `before` figures): megatron (Megatron-LM's pretraining
    sampler: sequence q to replica q mod D, micro-batch q // D) or contiguous (replica q // m)."""
    seed: int = 1234
    """Seed of the document stream, synthetic token ids and the model's initialisation, in
    [0, 2^31)."""
    split: str = "969,30,1"
    """indexed: train,valid,test weights over the dataset's documents in index order, as
    Megatron-LM's --split: training reads the first part, validation (schedule.eval_interval)
    the second; the test part is left alone. synthetic: validation reads a stream of its own
    (seed data.seed + 1)."""

    def check_synthetic(self) -> None:
        """The synthetic source's lengths: a known preset, or a lengths file that exists."""
        if self.lengths_file is None and self.workload not in preset_names():
            raise ValueError(
                f"{name('data.workload')} must be one of {', '.join(preset_names())}, got "
                f"{self.workload!r}"
            )
        if self.lengths_file is not None and not Path(self.lengths_file).is_file():
            raise ValueError(f"{name('data.lengths_file')} {self.lengths_file} does not exist")

    def split_weights(self) -> tuple[float, float, float]:
        """data.split as three non-negative weights summing to 1."""
        try:
            w = [float(x) for x in str(self.split).split(",")]
        except ValueError:
            w = []
        if not 1 <= len(w) <= 3 or any(not (x >= 0) or x == float("inf") for x in w) \
                or sum(w) <= 0:
            raise ValueError(f"{name('data.split')} must be up to three comma-separated weights >= "
                             f"0 "
                             f"(train,valid,test) with a positive sum, got {self.split!r}")
        w += [0.0] * (3 - len(w))
        return tuple(x / sum(w) for x in w)


def split_bounds(weights: tuple[float, float, float], n: int) -> list[int]:
    """Document index bounds [0, a, b, n] of the train / valid / test parts of n documents, as
    Megatron-LM rounds them (each part rounded, the last bound moved to n)."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * n)))
    diff = bounds[-1] - n
    return [bounds[0]] + [b - diff for b in bounds[1:]]


@dataclass
class OptimizerSection:
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    distributed: bool = False
    """megatron-core's distributed optimizer (ZeRO-1: fp32 main weights and Adam states
    sharded over the data-parallel ranks). GPU only: it accepts CUDA tensors only."""
    adam_eps: float = 1e-8
    """Adam's epsilon. Gradients far below it move parameters proportionally less, which keeps
    float-summation-order noise in near-zero gradients from becoming lr-sized steps."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass (megatron-core DDP's
    overlap_grad_reduce). GPU only."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward
    (overlap_param_gather; needs optimizer.distributed). GPU only."""


@dataclass
class ScheduleConfig:
    train_steps: int = 50
    warmup_steps: int = 5
    decay_style: str = "cosine"
    """constant | linear | cosine."""
    decay_steps: int | None = None
    """Steps over which the learning rate goes from its warmup peak to optimizer.min_lr, where
    it stays afterwards (as Megatron-LM's --lr-decay-iters); None: schedule.train_steps. To
    extend a finished run keeping its schedule, raise train_steps and set decay_steps to the old
    train_steps."""

    eval_interval: int = 0
    """Validate every N steps and after the last one (0: never), as Megatron-LM's
    --eval-interval: the validation loss and perplexity of schedule.eval_iters global batches
    of the validation data, planned by the run's system, forward only."""
    eval_iters: int = 2
    """Global batches per validation (the same ones every time, so validations compare)."""

    def decay_length(self) -> int:
        """The decay's length in steps (decay_steps, or train_steps when unset)."""
        return self.train_steps if self.decay_steps is None else self.decay_steps


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go (None: no checkpoints)."""
    save_interval: int = 0
    """Save every N steps (0: only at the end)."""
    resume: bool = True
    """Continue from the latest checkpoint in `dir` if there is one; false is refused while
    `dir` holds checkpoints (the run would overwrite them)."""
    async_save: bool = False
    """Write checkpoints in the background (megatron-core's async save): training continues
    while a writer process stores the host copy of each rank's shards."""
    override_scheduler: bool = False
    """Resume with this config's learning-rate schedule (optimizer.lr, min_lr, weight_decay,
    schedule.*) where it differs from the checkpoint's (as Megatron-LM's
    --override-opt_param-scheduler); false: such a change is refused."""
    load_dir: str | None = None
    """Another run's checkpoint directory to start from while checkpoint.dir holds no checkpoint
    yet (as Megatron-LM's --load beside --save): a full resume continues that run, saving into
    checkpoint.dir; with finetune, only its weights. Once checkpoint.dir holds a checkpoint, the
    run resumes from there. None: load from checkpoint.dir."""
    finetune: bool = False
    """Load only the model weights from checkpoint.load_dir (required; never checkpoint.dir,
    which this run writes) and start at step 0 with a fresh optimizer, schedule and data
    position (as Megatron-LM's --finetune); the data and system may then differ."""
    save_on_signal: bool = False
    """On SIGTERM or SIGINT (e.g. a scheduler's pre-emption warning) save a checkpoint after the
    current iteration and stop, as Megatron-LM's --exit-signal-handler; the launcher then waits
    up to 10 minutes for the save instead of 10 seconds."""
    load_iteration: int | None = None
    """Load this saved iteration instead of the newest one of the directory loaded from (e.g.
    the newest intact one when the latest is damaged)."""


BALANCERS = ("none", "libra")


@dataclass
class MoeConfig:
    balancer: str = "none"
    """Expert-load balancing of MoE layers under expert parallelism: none (megatron-core's
    layer; balance only through its router losses) or libra (hot experts replicated onto lightly
    loaded EP ranks and their tokens sharded over the copies, planned per layer by the C++
    planner; needs model.moe_topk > 0, parallel.ep > 1 and megatron-core's local layers). The
    model's math is unchanged: the same (token, expert) pairs are computed, on other ranks."""
    replica_slots: int = 2
    """libra: extra expert slots per EP rank (copies of other ranks' experts it may hold)."""
    local_slots: int = -1
    """libra: of those, how many the locality phase may use (-1: replica_slots / 4)."""
    lookahead: bool = True
    """libra: plan layer l+1 from its router applied to layer l's input, one layer early, and
    start moving the copies' weights then; false: plan each layer from its actual routing."""


@dataclass
class LoggingConfig:
    log_interval: int = 1
    tensorboard_dir: str | None = None
    """Write the step's figures (and the validation loss) as TensorBoard scalars here."""
    wandb_project: str | None = None
    """Log the same figures to this Weights & Biases project (where wandb is installed)."""
    wandb_run_name: str | None = None
    """The W&B run's name (None: W&B picks one)."""
    metrics_file: str | None = None
    """Write one JSON line per step here (used by `libra ab`)."""
    attention_time: bool = True
    """Measure each rank's core-attention time (forward + backward; CUDA events on GPU, read
    once per step) for the attn time max/mean column; false: no timing hooks."""
    record_routing: bool = False
    """moe.balancer libra: write each step's routing (first micro-batch, every balanced MoE
    layer, the EP group's tokens) and its lookahead prediction to
    routing_dir/routing_step<N>.npz, for `libra bench moe --routing`."""
    routing_dir: str = "routing"
    """Where record_routing writes."""


RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class TrainModelConfig(ModelConfig):
    """The model's dimensions and how its activations are kept. Every key left out takes the
    tiny dense model's value below (the defaults docs/config_reference.md lists), whether the
    `model` section is absent or partial - never the planner's Qwen3-30B-A3B shape."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    layers: int = 2
    moe_topk: int = 0
    moe_ffn: int = 0
    experts: int = 1
    vocab: int = 512
    """Token ids; 512 is what tools/build_indexed_dataset.py's default BPE holds."""

    recompute: str = "none"
    """Activation recompute: none, selective (core attention recomputed in the backward; the
    Libra operator runs its exchange again) or full (whole layers: megatron-core's
    recompute_granularity=full)."""
    recompute_method: str = "uniform"
    """full recompute: uniform (every recompute_num_layers layers one checkpoint) or block
    (the first recompute_num_layers layers of each pipeline stage recomputed)."""
    recompute_num_layers: int = 1
    """full recompute: layers per checkpoint (uniform) or layers recomputed per stage (block)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer (megatron-core's
    share_embeddings_and_output_weights: with pipeline stages the last stage keeps a copy that
    its gradients are summed with across the first and last stage)."""

    TRAINING_ONLY = ("recompute", "recompute_method", "recompute_num_layers")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"{name('model.recompute')} must be one of {', '.join(RECOMPUTE)}, got "
                f"{self.recompute!r}"
            )
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(
                f"{name('model.recompute_method')} must be uniform or block, got "
                f"{self.recompute_method!r}"
            )
        check_int(self.recompute_num_layers, "model.recompute_num_layers", 1, self.layers)

    def weight_fields(self) -> dict:
        """The fields a checkpoint's weights depend on (everything but how activations are
        kept)."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k not in self.TRAINING_ONLY}

    def megatron_recompute(self, stages: int) -> dict:
        """TransformerConfig's recompute fields for this setting."""
        if self.recompute == "none":
            return {}
        if self.recompute == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        per_stage = self.layers // max(stages, 1)
        return {
            "recompute_granularity": "full",
            "recompute_method": self.recompute_method,
            "recompute_num_layers": min(self.recompute_num_layers, per_stage),
        }


@dataclass
class TrainConfig:
    model: TrainModelConfig = field(default_factory=TrainModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dtype: str = "fp32"
    """Parameter and activation dtype: fp32, fp64 (exact comparisons on CPU) or bf16 (GPU).
    Validation refuses bf16 without a GPU and fp32 / fp64 with one."""
    transformer_impl: str = "auto"
    """Layer spec: transformer_engine (TE's fused layers), local (megatron-core's PyTorch
    layers), or auto (transformer_engine when TE imports on a GPU). Core attention is Libra's
    operator either way."""

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: list[str] = ()) -> "TrainConfig":
        raw = {}
        if path is not None:
            try:
                with open(path, encoding="utf-8") as fh:
                    raw = yaml.safe_load(fh) or {}
            except OSError as e:
                raise ValueError(f"config {path}: cannot open ({e.strerror})") from None
            except yaml.YAMLError as e:
                raise ValueError(f"config {path}: not valid YAML ({_yaml_error(e)})") from None
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} must look like key.sub=value")
            key, value = item.split("=", 1)
            node = raw
            parts = key.split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ValueError(f"override {key}: {p} is not a section")
            node[parts[-1]] = _scalar(value)
        return _build(cls, raw, "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def resume_fields(self) -> dict:
        """The settings an exact resume depends on, "section.field" -> value: the learning-rate
        schedule (SCHEDULE_FIELDS) and what decides each step's documents and their placement
        (STREAM_FIELDS)."""
        d = self.to_dict()
        d["schedule"]["decay_steps"] = self.schedule.decay_length()
        return {k: d[k.split(".")[0]][k.split(".")[1]] for k in SCHEDULE_FIELDS + STREAM_FIELDS}

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: int) -> int:
        """Check everything knowable before process groups exist; returns the DP size."""
        dp = self.check_layout(world_size)
        self._check_rest(world_size, dp)
        return dp

    def check_layout(self, world_size: int) -> int:
        """The parallel layout's checks (what `libra memory` needs; no GPU asked for); returns
        the DP size."""
        p, m, d, s = self.parallel, self.model, self.data, self.system
        for key in ("tp", "cp", "pool_size", "ep", "pp", "vpp"):
            if getattr(p, key) < 1:
                raise ValueError(f"{name('parallel.' + key)} must be >= 1, got {getattr(p, key)}")
        if not p.timeout_minutes > 0:
            raise ValueError(f"{name('parallel.timeout_minutes')} must be positive, got "
                             f"{p.timeout_minutes}")
        if world_size % (p.tp * p.cp * p.pp):
            raise ValueError(
                f"world size {world_size} must be a multiple of {name('parallel.tp')} * "
                f"{name('parallel.cp')} * "
                f"{name('parallel.pp')} = {p.tp * p.cp * p.pp} (the data-parallel size is what "
                f"remains)"
            )
        if p.vpp > 1 and p.pp <= 2:
            raise ValueError(
                f"{name('parallel.vpp')} ({p.vpp}) > 1 needs {name('parallel.pp')} > 2 (got "
                f"{p.pp}): the interleaved "
                "schedule's sends to the previous and the next stage go to one peer at pp = 2"
                if p.pp == 2
                else f"{name('parallel.vpp')} ({p.vpp}) > 1 needs pipeline parallelism "
                     f"({name('parallel.pp')} > 2)"
            )
        if m.layers % (p.pp * p.vpp):
            raise ValueError(
                f"{name('parallel.pp')} * {name('parallel.vpp')} ({p.pp} * {p.vpp}) must divide "
                f"{name('model.layers')} "
                f"({m.layers}): every (virtual) stage holds the same number of layers"
            )
        if p.sequence_parallel and p.tp == 1:
            raise ValueError(
                f"{name('parallel.sequence_parallel')} needs tensor parallelism "
                f"({name('parallel.tp')} > 1)"
            )
        if m.recompute == "full" and m.recompute_method == "uniform":
            per_stage = m.layers // (p.pp * p.vpp)
            if per_stage % m.recompute_num_layers:
                raise ValueError(
                    f"{name('model.recompute_num_layers')} ({m.recompute_num_layers}) must divide "
                    f"the "
                    f"{per_stage} layers of each (virtual) pipeline stage with "
                    f"{name('model.recompute_method')} = uniform"
                )
        if s.distca_server not in DISTCA_SERVERS:
            raise ValueError(
                f"{name('system.distca_server')} must be one of {', '.join(DISTCA_SERVERS)}, "
                f"got {s.distca_server!r}"
            )
        if s.name == "distca" and s.distca_server == "gpu" and p.cp != 1:
            raise ValueError(
                f"{name('system.distca_server')}: gpu (DistCA as deployed: every GPU an attention "
                f"server) "
                f"runs where a GPU is a replica ({name('parallel.cp')} = 1), got "
                f"{name('parallel.cp')} = {p.cp}: "
                "DistCA then cuts documents at GPU boundaries inside a replica, a layout the "
                "operator's Ulysses ranks do not hold (`libra simulate` models it at any cp); "
                f"set {name('system.distca_server')}: replica or {name('parallel.cp')}: 1"
            )
        if s.pp_order not in PP_ORDERS:
            raise ValueError(
                f"{name('system.pp_order')} must be one of {', '.join(PP_ORDERS)}, got "
                f"{s.pp_order!r}"
            )
        dp = world_size // (p.tp * p.cp * p.pp)
        if p.vpp > 1 and d.gbs % dp == 0 and (d.gbs // dp) % p.pp:
            raise ValueError(
                f"{name('parallel.vpp')} > 1: the micro-batches per replica ({name('data.gbs')} / "
                f"dp = "
                f"{d.gbs // dp}) must be a multiple of {name('parallel.pp')} ({p.pp}) for the "
                f"interleaved "
                "schedule"
            )
        if dp % p.pool_size:
            raise ValueError(
                f"{name('parallel.pool_size')} (P={p.pool_size}) must divide the data-parallel "
                f"size (D={dp})"
            )
        if m.heads % (p.cp * p.tp):
            raise ValueError(
                f"{name('model.heads')} ({m.heads}) must be divisible by {name('parallel.cp')} * "
                f"{name('parallel.tp')} ({p.cp * p.tp})"
            )
        if p.ep > 1:
            if m.moe_topk <= 0:
                raise ValueError(
                    f"{name('parallel.ep')} ({p.ep}) > 1 needs an MoE model "
                    f"({name('model.moe_topk')} > 0)"
                )
            if m.experts % p.ep:
                raise ValueError(f"{name('parallel.ep')} ({p.ep}) must divide "
                                 f"{name('model.experts')} ({m.experts})")
            if world_size % p.ep:
                raise ValueError(f"{name('parallel.ep')} ({p.ep}) must divide the world size "
                                 f"{world_size}")
        if d.gbs % dp or d.gbs <= 0:
            raise ValueError(
                f"{name('data.gbs')} ({d.gbs}) must be a positive multiple of the data-parallel "
                f"size ({dp})"
            )
        return dp

    def _check_rest(self, world_size: int, dp: int) -> None:
        self._check_optimizer()
        self.system.check()
        self._check_data()
        self._check_schedule()
        impl = self._check_dtype_and_layers()
        self._check_planner_knobs()
        self._check_checkpoint()
        lg, d = self.logging, self.data
        if lg.log_interval < 1:
            raise ValueError(f"{name('logging.log_interval')} must be >= 1, got {lg.log_interval}")
        if self.system.cost_model == "online" and not lg.attention_time:
            raise ValueError(f"{name('system.cost_model')} = online fits the measured attention "
                             f"times: it needs {name('logging.attention_time')} = true")
        if d.source == "synthetic" and d.lengths_file is not None:
            read_lengths_file(d.lengths_file)  # names the file and line of a bad entry
        self._check_moe(impl)

    def _check_optimizer(self) -> None:
        """The optimizer's settings: what needs a GPU, and every value's range."""
        o = self.optimizer
        if self.optimizer.distributed and not _cuda():
            raise ValueError(
                f"{name('optimizer.distributed')} needs a GPU: megatron-core's distributed "
                f"optimizer accepts CUDA tensors only (set {name('optimizer.distributed')}=false "
                "on CPU)"
            )
        for key in ("overlap_grad_reduce", "overlap_param_gather"):
            if getattr(self.optimizer, key) and not _cuda():
                raise ValueError(
                    f"{name('optimizer.' + key)} needs a GPU (megatron-core overlaps it on CUDA "
                    f"streams); set {name('optimizer.' + key)}=false on CPU"
                )
        if self.optimizer.overlap_param_gather and not self.optimizer.distributed:
            raise ValueError(
                f"{name('optimizer.overlap_param_gather')} needs the distributed optimizer "
                f"({name('optimizer.distributed')}=true)"
            )
        for key in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps"):
            if not math.isfinite(getattr(o, key)):
                raise ValueError(f"{name('optimizer.' + key)} must be a finite number, got "
                                 f"{getattr(o, key)}")
        if not o.lr > 0:
            raise ValueError(f"{name('optimizer.lr')} must be positive, got {o.lr}")
        if not 0 <= o.min_lr <= o.lr:
            raise ValueError(f"{name('optimizer.min_lr')} ({o.min_lr}) must be in [0, "
                             f"{name('optimizer.lr')} = {o.lr}]")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(o, key) < 1:
                raise ValueError(f"{name('optimizer.' + key)} must be in [0, 1), got "
                                 f"{getattr(o, key)}")
        if not o.adam_eps > 0:
            raise ValueError(f"{name('optimizer.adam_eps')} must be positive, got {o.adam_eps}")
        if o.weight_decay < 0:
            raise ValueError(f"{name('optimizer.weight_decay')} must be >= 0, got {o.weight_decay}")
        if o.clip_grad < 0:
            raise ValueError(
                f"{name('optimizer.clip_grad')} must be >= 0 (0: no clipping), got {o.clip_grad}"
            )

    def _check_data(self) -> None:
        d = self.data
        if d.context <= 0:
            raise ValueError(f"{name('data.context')} must be positive, got {d.context}")
        if d.context > MAX_TOKENS:
            raise ValueError(
                f"{name('data.context')} = {d.context} exceeds 2^30 tokens, the most one packed "
                f"sequence "
                "may hold (the planner's and the attention metadata's limit)"
            )
        if d.order not in ORDERS:
            raise ValueError(f"{name('data.order')} must be one of {', '.join(ORDERS)}, got "
                             f"{d.order!r}")
        check_int(d.seed, "data.seed", 0, 2**31 - 1)  # megatron-core offsets it per rank
        if d.source == "synthetic":
            d.check_synthetic()
        elif d.source == "indexed":
            if not d.path:
                raise ValueError(f"{name('data.path')} is required for {name('data.source')} = "
                                 f"indexed")
            for ext in (".bin", ".idx"):
                if not Path(d.path + ext).is_file():
                    raise ValueError(f"{name('data.path')}: {d.path}{ext} does not exist")
        else:
            raise ValueError(f"{name('data.source')} must be synthetic or indexed, got "
                             f"{d.source!r}")

    def _check_schedule(self) -> None:
        if self.schedule.train_steps <= 0:
            raise ValueError(
                f"{name('schedule.train_steps')} must be positive, got {self.schedule.train_steps}"
            )
        if not 0 <= self.schedule.warmup_steps < self.schedule.train_steps:
            raise ValueError(
                f"{name('schedule.warmup_steps')} ({self.schedule.warmup_steps}) must be in "
                f"[0, {name('schedule.train_steps')} = {self.schedule.train_steps})"
            )
        if self.schedule.eval_interval < 0:
            raise ValueError(
                f"{name('schedule.eval_interval')} must be >= 0 (0: no validation), got "
                f"{self.schedule.eval_interval}"
            )
        if self.schedule.eval_iters < 1:
            raise ValueError(f"{name('schedule.eval_iters')} must be >= 1, got "
                             f"{self.schedule.eval_iters}")
        self.data.split_weights()  # names the field
        ds = self.schedule.decay_steps
        if ds is not None and not self.schedule.warmup_steps < ds:
            raise ValueError(
                f"{name('schedule.decay_steps')} ({ds}) must exceed "
                f"{name('schedule.warmup_steps')} "
                f"({self.schedule.warmup_steps})"
            )
        if self.schedule.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"{name('schedule.decay_style')} must be constant, linear or cosine, got "
                f"{self.schedule.decay_style!r}"
            )

    def _check_dtype_and_layers(self) -> str:
        """The dtype against the device, and the layer implementation (returned)."""
        if self.dtype not in ("fp32", "fp64", "bf16"):
            raise ValueError(f"dtype must be fp32, fp64 or bf16, got {self.dtype!r}")
        if self.dtype != "bf16" and _cuda():
            raise ValueError(
                f"dtype {self.dtype} on a GPU: the fused attention kernels (Transformer Engine, "
                "flash-attn, PyTorch's varlen_attn) take bf16, and the PyTorch reference kernel "
                "that wider dtypes fall back to is the CPU's (it reads segment boundaries on the "
                "host and its memory grows with the scores); set dtype: bf16 (with "
                "transformer-engine or flash-attn installed, or PyTorch >= 2.10)"
            )
        if self.dtype == "bf16" and not _cuda():
            raise ValueError(
                "dtype bf16 needs a GPU: megatron-core's bf16 mixed precision (fp32 main "
                "weights, Float16Module) runs on CUDA devices only; on CPU set dtype: fp32 "
                "(or fp64 for exact comparisons)"
            )
        impl = resolve_impl(self.transformer_impl)  # unknown name, or TE asked for but unusable
        if self.parallel.sequence_parallel and impl != "transformer_engine":
            raise ValueError(
                f"{name('parallel.sequence_parallel')} needs Transformer Engine layers "
                f"(megatron-core's "
                "local layer norm does not split the sequence); use it on a GPU with TE "
                "(transformer_impl auto or transformer_engine)"
            )
        return impl

    def _check_planner_knobs(self) -> None:
        s = self.system
        if s.block is not None and s.block <= 0:
            raise ValueError(
                f"{name('system.block')} must be positive (or unset: context / 16), got {s.block}"
            )
        if s.head_group < 0:
            raise ValueError(
                f"{name('system.head_group')} must be >= 0 (0: the whole slice), got {s.head_group}"
            )
        if not s.epsilon >= 0:
            raise ValueError(f"{name('system.epsilon')} must be >= 0, got {s.epsilon}")
        try:  # every planner knob, as the planner itself checks it
            s.planner_options(self.data.order, 2)
        except ValueError as e:
            raise ValueError(f"system.{e}") from None
        if s.wlb_outlier_len < 0 or s.wlb_max_delay < 0:
            raise ValueError(
                f"{name('system.wlb_outlier_len')} and {name('system.wlb_max_delay')} must be >= "
                f"0, got "
                f"{s.wlb_outlier_len} and {s.wlb_max_delay}"
            )

    def _check_checkpoint(self) -> None:
        c = self.checkpoint
        if c.load_iteration is not None and c.load_iteration < 0:
            raise ValueError(f"{name('checkpoint.load_iteration')} must be >= 0, got "
                             f"{c.load_iteration}")
        if c.save_interval < 0:
            raise ValueError(f"{name('checkpoint.save_interval')} must be >= 0, got "
                             f"{c.save_interval}")
        if c.dir is not None and Path(c.dir).exists() and not Path(c.dir).is_dir():
            raise ValueError(f"{name('checkpoint.dir')} {c.dir} exists and is not a directory")
        if c.load_dir is not None and not Path(c.load_dir).is_dir():
            raise ValueError(f"{name('checkpoint.load_dir')} {c.load_dir} is not a directory")
        if c.finetune and c.load_dir is None:
            raise ValueError(
                f"{name('checkpoint.finetune')} needs {name('checkpoint.load_dir')}, the run whose "
                f"weights to load "
                f"({name('checkpoint.dir')} is where this run saves: loading from it would "
                f"overwrite the "
                "source run's iterations)"
            )
        if (c.finetune and c.dir is not None
                and Path(c.dir).resolve() == Path(c.load_dir).resolve()):
            raise ValueError(
                f"{name('checkpoint.finetune')} would write into its source: "
                f"{name('checkpoint.dir')} and "
                f"{name('checkpoint.load_dir')} are both {c.load_dir}; set "
                f"{name('checkpoint.dir')} to a new "
                "directory"
            )
        if c.load_dir is not None and c.dir is None:
            raise ValueError(
                f"{name('checkpoint.load_dir')} needs {name('checkpoint.dir')}, where this run "
                f"saves (it may be a "
                "new directory)"
            )

    def _check_moe(self, impl: str) -> None:
        mo, m, p = self.moe, self.model, self.parallel
        if mo.balancer not in BALANCERS:
            raise ValueError(
                f"{name('moe.balancer')} must be one of {', '.join(BALANCERS)}, got {mo.balancer!r}"
            )
        if self.logging.record_routing and mo.balancer != "libra":
            raise ValueError(f"{name('logging.record_routing')} records the balanced layers' "
                             f"routing: it "
                             f"needs {name('moe.balancer')} = libra")
        if mo.balancer == "none":
            return
        if m.moe_topk <= 0:
            raise ValueError(f"{name('moe.balancer')} = libra needs an MoE model "
                             f"({name('model.moe_topk')} > 0)")
        if p.ep <= 1:
            raise ValueError(
                f"{name('moe.balancer')} = libra needs expert parallelism ({name('parallel.ep')} > "
                f"1, got {p.ep}): "
                "with one EP rank there is no other rank to move work to"
            )
        foreign = m.experts - m.experts // p.ep
        check_int(mo.replica_slots, "moe.replica_slots", 0)
        if mo.replica_slots > foreign:
            raise ValueError(
                f"{name('moe.replica_slots')} ({mo.replica_slots}) is larger than the expert slots "
                f"a rank "
                f"can fill: it owns {m.experts // p.ep} of {name('model.experts')} ({m.experts}) "
                f"and can "
                f"hold copies of the other {foreign} at most"
            )
        check_int(mo.local_slots, "moe.local_slots", -1, mo.replica_slots)
        if p.tp != 1:
            raise ValueError(f"{name('moe.balancer')} = libra needs {name('parallel.tp')} = 1 (got "
                             f"{p.tp}): the "
                             "balanced layer runs on the all-gather dispatcher over EP only")
        if impl != "local":
            raise ValueError(f"{name('moe.balancer')} = libra needs megatron-core's local layers "
                             "(transformer_impl = local): it runs SequentialMLP experts")
        if m.recompute == "full":
            raise ValueError(f"{name('moe.balancer')} = libra does not support "
                             f"{name('model.recompute')} = full (a "
                             "recomputed layer would plan again from other inputs)")


SCHEDULE_FIELDS = (
    "optimizer.lr",
    "optimizer.min_lr",
    "optimizer.weight_decay",
    "schedule.decay_steps",
    "schedule.warmup_steps",
    "schedule.decay_style",
)
"""Learning-rate schedule settings a checkpoint records (checkpoint.override_scheduler)."""
STREAM_FIELDS = (
    "system.name",
    "system.cost_model",
    "system.cost_fit_interval",
    "system.cost_profile",
    "data.source",
    "data.workload",
    "data.lengths_file",
    "data.path",
    "data.shuffle",
    "data.context",
    "data.gbs",
    "data.order",
    "data.seed",
    "data.split",
)
"""Settings that decide each step's documents and where they run (change: checkpoint.finetune)."""

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


def _cuda() -> bool:
    """Whether a GPU is usable (torch imported here only: loading a config needs no torch)."""
    # deferred: a config loads without torch (the CLI)
    import torch

    return torch.cuda.is_available()


def te_available() -> tuple[bool, str]:
    """(usable, why not): Transformer Engine needs a GPU and an importable build."""
    if not _cuda():
        return False, "no GPU"
    try:
        # optional: Transformer Engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a build that fails to load its CUDA library
        return False, f"transformer_engine does not import ({type(e).__name__}: {e})"
    return True, ""


def resolve_impl(impl: str) -> str:
    """`auto` -> transformer_engine when usable, else local; an explicit choice is checked."""
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"transformer_impl must be one of {', '.join(TRANSFORMER_IMPLS)}, got {impl!r}"
        )
    ok, why = te_available()
    if impl == "auto":
        return "transformer_engine" if ok else "local"
    if impl == "transformer_engine" and not ok:
        raise ValueError(f"transformer_impl is transformer_engine, but {why}")
    return impl


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (line and column, 1-based)."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return what
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}"


def _scalar(text: str):
    """An override's value: YAML scalars, plus numbers YAML 1.1 reads as strings (1e-6)."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        for conv in (int, float):
            try:
                return conv(value)
            except ValueError:
                pass
    return value


def _build(cls, raw, path: str):
    if not isinstance(raw, dict):
        raise ValueError(f"{path or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            raise ValueError(f"{where} is not a config field (known: {', '.join(fields)})")
        kwargs[key] = _coerce(hints[key], value, where)
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own validation (e.g. ModelConfig)
        raise ValueError(f"{path + ': ' if path else ''}{e}") from None


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    return value
