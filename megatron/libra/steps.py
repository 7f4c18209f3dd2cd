"""The per-step pipeline both trainers share (`libra train`'s Trainer and Megatron-LM's loop in
`pretrain_gpt_libra.py`): where a step's plan becomes what the attention layers run.

    source.step(k)                         the step's packed sequences (document lengths only)
      -> Planner.plan                      the StepPlan, the same on every rank (hash-checked)
      -> compile_rank + make_micro_batch   this rank's attention program and THD micro-batch of
                                           every slot, staged side by side in one (pinned) host
                                           buffer per slot (`StagedSlot`)
         [all of the above one step ahead, in the sampler's thread: `StepSampler`]
      -> check_plan                        the plan hash compared across ranks
      -> device_micro_batches              one non-blocking copy per slot; the program becomes
                                           the operator's AttentionStep, carried to the layers
                                           in the micro-batch's LibraPackedSeqParams
      -> forward / backward                timed per rank (`AttentionTimer`)
      -> StepStats.record                  the step's metrics record, the same keys in both
                                           trainers

`new_planner` and `new_runtime` build the planner and the attention runtime of a config;
`settle_heap` readies the process's heap before the first step.
"""

from __future__ import annotations

import atexit
import gc
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from libra_ext import costmodel
from libra_ext.attention import meta, thd
from libra_ext.attention.comm import GroupCache
from libra_ext.attention.core import LibraCoreAttention, Runtime, check_plan_hash
from libra_ext.attention.counters import KernelTimer
from libra_ext.pipeline import order_slots
from libra_ext.planner import LayoutConfig, Planner, StepPlan
from libra_ext.simulator.cost import simulate_plan
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.workload import document_count
from megatron.libra.batch import MicroBatch, make_micro_batch
from megatron.libra.config import TrainConfig
from megatron.libra.sources import SyntheticSource, held_steps, make_source


def new_planner(cfg: TrainConfig, dp: int, dtype_bytes: int) -> Planner:
    """The step planner of `cfg`'s layout, model and system at data-parallel size dp."""
    p = cfg.parallel
    return Planner(
        LayoutConfig(dp=dp, cp=p.cp, tp=p.tp, pool_size=p.pool_size, context=cfg.data.context),
        cfg.model,
        cfg.system.planner_options(cfg.data.order, dtype_bytes),
    )


def new_runtime(cfg: TrainConfig, dp: int, cp_group=None) -> Runtime:
    """The attention operator's runtime of `cfg` on this rank: its process groups (the Ulysses
    all-to-all on `cp_group`, megatron-core's CP group where given), exchange chunks, pipelining
    and kernel."""
    p, s = cfg.parallel, cfg.system
    return Runtime(
        groups=GroupCache(tp=p.tp, cp=p.cp, dp=dp, timeout_s=p.timeout_minutes * 60, pp=p.pp,
                          cp_group=cp_group),
        chunks=s.chunks,
        pipelined=s.pipeline,
        backend=None if s.attention_backend == "auto" else s.attention_backend,
        memory=s.attention_memory,
    )


# ------------------------------------------------------------------------------ staging


@dataclass
class StagedSlot:
    """One slot of this rank, staged by the sampler's thread for one host-to-device copy: a
    single int32 host buffer (pinned on a GPU) that holds the slot's attention program (its
    index arrays, `meta.stage`) followed by its micro-batch (`MicroBatch.stage`'s layout)."""

    program: meta.Staged
    """The program; its `host` is `host[:program_len]`."""
    micro: MicroBatch
    """The micro-batch; its `host` is `host[program_len:]`."""
    host: torch.Tensor
    """[program_len + the micro-batch's length] int32: the one buffer that is copied."""
    program_len: int

    @classmethod
    def of(cls, program: meta.Staged, micro: MicroBatch, pin: bool) -> "StagedSlot":
        """Lay `program` and `micro` (each staged on its own) out in one buffer."""
        joint = torch.cat([program.host, micro.host])
        if pin:
            joint = joint.pin_memory()
        n = len(program.host)
        program.host, micro.host = joint[:n], joint[n:]
        return cls(program, micro, joint, n)

    def upload(self, device: torch.device) -> tuple:
        """(program part, micro-batch part) of the buffer on `device`, from one non-blocking
        copy (the host buffer itself on the CPU)."""
        buf = self.host.to(device, non_blocking=True) if device.type != "cpu" else self.host
        return buf[: self.program_len], buf[self.program_len :]


@dataclass
class StepBatch:
    """One step as the sampler's thread hands it to the training loop."""

    step: int
    plan: StepPlan
    pieces: dict
    """Executed document index in the plan -> Piece (this replica's documents only)."""
    label_tokens: int | None
    """Tokens with a label in the whole global batch (the loss denominator; None from a source
    without label_count, in a loop that counts them itself)."""
    planner_state: dict
    """The planner's state after planning this step (checkpointed with it)."""
    doc_base: int
    """Global id of this step's first input document."""
    n_inputs: int
    """Input documents this step consumed."""
    recent_bases: dict
    """step -> doc_base of the steps whose documents may still run (WLB-LLM)."""
    slot_order: list
    """The order this replica runs its slots in (micro_batch_order)."""
    staged: list | None = None
    """Per slot, this rank's StagedSlot (None: a sampler without this rank's cp index)."""
    epochs: tuple = (0, 0)
    """The pass over the data it starts in, and the one the next starts in."""
    features: np.ndarray | None = None
    """This rank's cost-model features of the step, one layer (`meta.program_features` over
    its programs' calls; None without a cost model)."""
    cost_table: object = None
    """The cost table the step was planned with (None: pairs)."""


# ------------------------------------------------------------------------------ cost model


class CostModels:
    """system.cost_model on one rank: the table each step is planned with, and (online) its fit
    from the measured attention times.

    The sampler's thread asks `table_for(step)` before planning a step; the training loop calls
    `step_end` after every step with this rank's features and its kernels' measured seconds
    (`kernel_timer`, which the loop installs as the runtime's: a rank's own attention work; the
    operator's time around the kernels includes waits that follow the slowest rank). Every
    `cost_fit_interval` steps the ranks all-gather their rows (one collective of a few KB on the
    gloo group of host tensors), and every rank folds the same rows in the same order into the
    same fit (`costmodel.OnlineFit`), so every rank gets the same table bit for bit and plan
    hashes keep agreeing. A fit made after step k plans steps k + LAG on: the sampler plans at
    most two steps ahead of the step that trains, and `table_for` waits until the table of its
    step is settled, so which table a step gets never depends on timing."""

    LAG = 3

    def __init__(self, cfg: TrainConfig, start_step: int = 0, layers: int = 1, group=None):
        s = cfg.system
        self.mode, self.interval = s.cost_model, s.cost_fit_interval
        self.balances = s.name in ("libra", "distca", "wlb")
        self.layers, self.group = max(1, int(layers)), group
        profile = (costmodel.CostTable.from_profile(HardwareProfile.load(s.cost_profile),
                                                    cfg.model.head_dim)
                   if s.cost_profile else None)
        self.fit = costmodel.OnlineFit(prior=profile) if self.mode == "online" else None
        start_table = profile if self.mode in ("profile", "online") else None
        # (first step, table) in step order: the table of step k is the last entry at or
        # before it
        self._tables: list = [(0, start_table)]
        self._settled = start_step + self.LAG - 1  # tables of steps up to here are known
        self._cond = threading.Condition()
        self._stop = False
        self._pending: list = []  # this rank's rows since the last fit
        self.fit_ms: list = []
        # a rank's own kernel time: what the fit learns from, and beside any plan the kernel
        # time max/mean (with logging.attention_time)
        self.kernel_timer = KernelTimer() if self.active or cfg.logging.attention_time else None

    @property
    def active(self) -> bool:
        """Whether plans depend on it (libra, distca or wlb with a table, or one to come)."""
        return self.balances and self.mode != "pairs"

    def table_for(self, step: int, stop: threading.Event | None = None):
        """The table step `step` is planned with (None: pairs); waits until it is settled."""
        with self._cond:
            while step > self._settled and not self._stop and not (stop and stop.is_set()):
                self._cond.wait(0.1)
            table = None
            for first, t in self._tables:
                if first <= step:
                    table = t
            return table

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def step_end(self, step: int, features, seconds: float) -> None:
        """After step `step` (0-based) on every rank: its row, and at the fit interval the fit
        (collective). Tables of steps up to step + LAG are then settled."""
        table = None
        if self.fit is not None and self.active:
            if features is not None:
                self._pending.append(np.r_[np.asarray(features) * self.layers, seconds])
            if (step + 1) % self.interval == 0:
                table = self._fit()
        with self._cond:
            if table is not None:
                self._tables = [e for e in self._tables if e[0] < step + self.LAG]
                self._tables.append((step + self.LAG, table))
            self._settled = step + self.LAG
            self._cond.notify_all()

    def _fit(self):
        mine = torch.tensor(np.array(self._pending, dtype=np.float64).reshape(-1),
                            dtype=torch.float64)
        self._pending = []
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        every = [torch.zeros_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(every, mine, group=self.group)
        else:
            every = [mine]
        t0 = time.perf_counter()
        for rows in every:  # rank order, then step order: the same on every rank
            r = rows.numpy().reshape(-1, costmodel.FEATURES + 1)
            self.fit.add(r[:, :-1], r[:, -1])
        table = self.fit.fit()
        self.fit_ms.append((time.perf_counter() - t0) * 1e3)
        return table

    def predicted(self, table, features) -> float:
        """This rank's predicted seconds of a step under `table` (0 without one)."""
        if table is None or features is None:
            return 0.0
        return float(table.predict(np.asarray(features) * self.layers))

    def state_dict(self) -> dict:
        with self._cond:
            tables = [(int(k), None if t is None else t.to_dict()) for k, t in self._tables]
        return {"mode": self.mode, "tables": tables,
                "fit": None if self.fit is None else self.fit.state_dict()}

    def load_state_dict(self, sd: dict | None, where: str = "cost_model") -> None:
        """Restore `state_dict` (a checkpoint's; refused naming the field)."""
        if sd is None:
            return
        mode = sd.get("mode") if isinstance(sd, dict) else repr(sd)
        if mode != self.mode:
            raise ValueError(f"{where}: saved for system.cost_model = {mode}, this run has "
                             f"{self.mode}")
        tables = []
        for i, entry in enumerate(sd.get("tables", [])):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2
                    and isinstance(entry[0], int) and entry[0] >= 0):
                raise ValueError(f"{where}.tables[{i}] must be [first step, table], got "
                                 f"{entry!r:.80}")
            first, t = entry
            tables.append((int(first), None if t is None else
                           costmodel.CostTable.from_dict(t, f"{where}.tables[{i}]")))
        if self.fit is not None and sd.get("fit") is not None:
            self.fit.load_state_dict(sd["fit"], f"{where}.fit")
        with self._cond:
            self._tables = tables or self._tables


def micro_batch_order(cfg: TrainConfig):
    """plan -> [D, m] the order each replica runs its slots in: the plan's, or with pipeline
    parallelism and system.pp_order = balanced, each exchange pool's order from the modeled
    1F1B schedule (libra_ext.pipeline). Every rank computes the same order from the same plan."""
    stages = cfg.parallel.pp
    if stages == 1 or cfg.system.pp_order == "none":
        return lambda plan: np.tile(np.arange(plan.slots), (plan.dp, 1))
    hardware = HardwareProfile.load("h200-sxm")  # only the slots' relative times matter

    def order(plan):
        times = simulate_plan(plan, cfg.model, hardware, chunks=cfg.system.chunks,
                              attention_memory=cfg.system.attention_memory)
        return order_slots(times.slot, plan.exchange_pool, stages, "balanced").order

    return order


_LIVE_SAMPLERS: weakref.WeakSet = weakref.WeakSet()
"""Samplers whose thread may still run (closed at interpreter exit)."""


@atexit.register
def close_live_samplers() -> None:
    """Stop and join every sampler's thread at interpreter exit, before Python ends daemon
    threads: one ended inside a torch op (which releases the GIL, as most do) is unwound through
    torch's noexcept frames, which aborts the process ("terminate called without an active
    exception") - a loop that exits without closing its samplers (Megatron-LM's, after its last
    evaluation) would otherwise abort whenever a sampler was still staging ahead."""
    for sampler in list(_LIVE_SAMPLERS):
        sampler.close()


class StepSampler:
    """Plans step k+1 in a background thread while step k trains. Every rank plans the whole
    global batch (the plan is the same everywhere and checked by hash) but reads only the
    documents of its own replica's sequences. With `cp_rank` given, the same thread also
    compiles this rank's attention programs and stages each slot's program and micro-batch in
    one buffer (`StagedSlot`), and orders the replica's slots for the pipeline schedule
    (micro_batch_order). `source`: the document source (default: data.source's,
    sources.make_source)."""

    def __init__(
        self,
        cfg: TrainConfig,
        planner: Planner,
        replica: int,
        start_step: int = 0,
        doc_base: int = 0,
        recent_bases: dict | None = None,
        cp_rank: int | None = None,
        split: str = "train",
        stop_step: int | None = None,
        source=None,
        costs: "CostModels | None" = None,
    ):
        self.cfg, self.planner, self.replica, self.cp_rank = cfg, planner, replica, cp_rank
        self.costs = costs if costs is not None and costs.active else None
        self._pin = torch.cuda.is_available()  # staged buffers in pinned memory on a GPU
        self._order = micro_batch_order(cfg)
        self.source = make_source(cfg, split) if source is None else source
        # plans steps [start_step, stop_step); the last one flushes what WLB-LLM holds when
        # the stream ends there (validation: every document of its batches is computed)
        self.stop_step = cfg.schedule.train_steps if stop_step is None else stop_step
        self._flush_last = stop_step is not None
        self.keep_steps = held_steps(cfg)
        self._bases = dict(recent_bases or {})
        if not isinstance(self.source, SyntheticSource):
            # a resumed run: documents WLB-LLM holds back from before the checkpoint stay
            # addressable (a step's layout is a function of the step alone)
            for s, base in sorted(self._bases.items()):
                self.source.step(int(s), int(base))
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._next, self._doc_base = start_step, doc_base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        _LIVE_SAMPLERS.add(self)
        self._thread.start()

    def _plan(self, step: int) -> StepBatch:
        seqs = self.source.step(step, self._doc_base)
        table = None
        if self.costs is not None:
            table = self.costs.table_for(step, self._stop)
            self.planner.set_cost_model(table)
        plan = self.planner.plan(seqs, flush=self._flush_last and step + 1 == self.stop_step)
        n_in = document_count(seqs)
        ids = plan.doc_ids if self.cfg.system.name == "wlb" else plan.doc_ids + self._doc_base
        pieces = self._pieces(plan, ids)
        self._bases[step] = self._doc_base
        for gone in [k for k in self._bases if k <= step - self.keep_steps]:
            del self._bases[gone]
        batch = StepBatch(
            step, plan, pieces, self._label_tokens(plan, ids), self.planner.state_dict(),
            self._doc_base, n_in, dict(self._bases),
            [int(x) for x in self._order(plan)[self.replica]],
            None, self.source.epochs(step),
        )
        if self.cp_rank is not None:
            programs = meta.compile_rank(plan, self.replica, self.cp_rank,
                                         self.cfg.system.chunks, staged_only=True)
            if self.costs is not None:  # (before staging: an upload may fill in the programs)
                batch.features = meta.program_features(programs)
                batch.cost_table = table
            batch.staged = self._stage(plan, pieces, programs)
        self._doc_base += n_in
        return batch

    def _label_tokens(self, plan: StepPlan, ids) -> int | None:
        """The loss denominator where the loop needs it from the sampler (a source without
        label_count serves a loop that counts its tokens itself, as Megatron-LM's does)."""
        if not hasattr(self.source, "label_count"):
            return None
        return sum(self.source.label_count(int(i), int(n))
                   for i, n in zip(ids, plan.doc_lengths, strict=True))

    def _pieces(self, plan: StepPlan, ids) -> dict:
        """The tokens of this replica's documents (ids: each plan document's global id)."""
        pieces, off, lengths = {}, plan.seq_doc_offsets, plan.doc_lengths
        for seq in np.flatnonzero(plan.seq_replica == self.replica):
            for i in range(off[seq], off[seq + 1]):
                pieces[i] = self.source.piece(int(ids[i]), int(lengths[i]))
        return pieces

    def _stage(self, plan: StepPlan, pieces: dict, programs: list) -> list[StagedSlot]:
        """Per slot, this rank's attention program (`programs`, compiled for it) and THD
        micro-batch in one buffer."""
        layout = thd.layout_of(plan.system)
        out, off = [], plan.seq_doc_offsets
        for slot, program in enumerate(programs):
            seq = plan.sequence_at(self.replica, slot)
            mb = make_micro_batch([pieces[i] for i in range(off[seq], off[seq + 1])],
                                  self.cfg.parallel.cp, self.cp_rank, None, layout).stage(pin=False)
            out.append(StagedSlot.of(meta.stage(program, owned=True), mb, self._pin))
        return out

    def _run(self) -> None:
        step = self._next
        try:
            while not self._stop.is_set() and step < self.stop_step:
                self._queue.put(self._plan(step))
                step += 1
        except BaseException as e:  # surfaced to the training loop on the next get()
            self._queue.put(e)

    def next(self) -> StepBatch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the planning thread and wait for it (it may be inside a plan or a put)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread.join()
        _LIVE_SAMPLERS.discard(self)


# ------------------------------------------------------------------------------ per step


def settle_heap() -> None:
    """Collect once, then freeze what survives (the model, the optimizer, the frameworks'
    objects) out of the garbage collector's generations: the sampler's thread makes many
    short-lived objects, and a full collection over a training process's heap otherwise pauses
    every thread - the one launching kernels included - for ~100 ms (measured beside a compile
    at 256K: the longest pause 107 ms, 3 ms once frozen). Called once, before the first step."""
    gc.collect()
    gc.freeze()


def check_plan(plan: StepPlan, runtime: Runtime) -> None:
    """The plan hash compared across the ranks of this pipeline stage (all ranks without
    pipeline parallelism; every exchange stays inside a stage) on the runtime's gloo group (a
    mismatch, or a rank that never arrives, is an error on every rank)."""
    check_plan_hash(plan, group=runtime.groups.stage_check_group)


def device_micro_batches(batch: StepBatch, runtime: Runtime, device: torch.device, cp: int,
                         cp_rank: int, replica: int) -> list[MicroBatch]:
    """Micro-batches of rank (replica, cp_rank) for a sampled step, in the order the schedule
    runs them, on `device`: every slot's attention program and micro-batch (tokens, labels,
    positions, loss mask) from one non-blocking copy of its StagedSlot; the program reaches
    the layers as the micro-batch's AttentionStep."""
    plan, device = batch.plan, torch.device(device)
    if batch.staged:
        parts = [s.upload(device) for s in batch.staged]
        steps = runtime.prepare(plan, device, [s.program for s in batch.staged],
                                [p for p, _ in parts] if device.type != "cpu" else None)
    else:  # not staged ahead (a sampler without this rank's cp index): compiled now
        parts, steps = None, runtime.prepare(plan, device)
    micro = []
    for slot in batch.slot_order:
        if parts is not None:
            mb = batch.staged[slot].micro.to(device, parts[slot][1])
        else:
            seq = plan.sequence_at(replica, slot)
            docs = range(plan.seq_doc_offsets[seq], plan.seq_doc_offsets[seq + 1])
            mb = make_micro_batch([batch.pieces[i] for i in docs], cp, cp_rank, None,
                                  thd.layout_of(plan.system)).to(device)
        mb.packed_seq_params.libra = steps[slot]
        micro.append(mb)
    return micro


class AttentionTimer:
    """Each rank's core-attention time of a step, forward and backward (module hooks: from a
    layer's inputs arriving to its output leaving, and from its output gradient arriving to its
    input gradients leaving). On GPU the hooks record CUDA events (no synchronization); the
    events are read once per step, after the optimizer step. Disabled: no hooks at all."""

    def __init__(self, model, enabled: bool = True):
        self.enabled, self.cuda = enabled, torch.cuda.is_available()
        self.suspended = False
        """While set (a validation pass between two training steps), nothing is recorded."""
        self._open: dict = {}
        self._pairs: list = []
        self._host = 0.0
        self.layers = 0
        """Attention layers timed on this rank (with pipeline parallelism, its stage's)."""
        if not enabled:
            return
        chunks = model if isinstance(model, (list, tuple)) else [model]
        for mod in (x for chunk in chunks for x in chunk.modules()):
            if isinstance(mod, LibraCoreAttention):
                self.layers += 1
                mod.register_forward_pre_hook(self._start("fwd"))
                mod.register_forward_hook(self._stop("fwd"))
                mod.register_full_backward_pre_hook(self._start("bwd"))
                mod.register_full_backward_hook(self._stop("bwd"))

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _start(self, key):
        def hook(*_args):
            if not self.suspended:
                self._open[key] = self._mark()

        return hook

    def _stop(self, key):
        def hook(*_args):
            start, end = self._open.pop(key, None), self._mark()
            if start is None:
                return
            if self.cuda:
                self._pairs.append((start, end))
            else:
                self._host += end - start

        return hook

    def reset(self) -> None:
        self._pairs.clear()
        self._open.clear()
        self._host = 0.0

    def seconds(self) -> float:
        """The step's attention time so far (waits for the last recorded event on GPU)."""
        if not self.cuda:
            return self._host
        if not self._pairs:
            return 0.0
        self._pairs[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3


# ------------------------------------------------------------------------------ the record


STAT_FIELDS = ("attn_seconds", "pool_bytes", "cp_bytes", "loss_sum", "label_tokens", "stop",
               "attn_predicted", "kernel_seconds")
"""What each rank contributes to a step's record (`StepStats`), in this order."""


@dataclass
class StepStats:
    """Every rank's figures of one step (or log window), gathered on the runtime's gloo group of
    host tensors (no device sync under NCCL): per rank [attention seconds, pool-exchange bytes
    sent, CP all-to-all bytes sent, loss sum, labelled tokens, a stop request]."""

    per_rank: np.ndarray
    """[world, len(STAT_FIELDS)] float64."""

    @classmethod
    def gather(cls, runtime: Runtime, attn_seconds: float, loss_sum: float = 0.0,
               label_tokens: float = 0.0, stop: bool = False,
               attn_predicted: float = 0.0, kernel_seconds: float = 0.0) -> "StepStats":
        """This rank's figures (bytes from the runtime's counter) from every rank; resets the
        counter."""
        pool = float(runtime.counter.total("pool."))
        mine = torch.tensor([attn_seconds, pool, float(runtime.counter.total()) - pool,
                             loss_sum, label_tokens, float(stop), attn_predicted,
                             kernel_seconds],
                            dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine, group=runtime.groups.check_group)
        runtime.counter.reset()
        return cls(torch.stack(every).numpy())

    def __add__(self, other: "StepStats") -> "StepStats":
        return StepStats(self.per_rank + other.per_rank)

    def column(self, name: str) -> np.ndarray:
        return self.per_rank[:, STAT_FIELDS.index(name)]

    @property
    def stop_requested(self) -> bool:
        return bool(self.column("stop").max() > 0)

    def record(self, step: int, plan: StepPlan, step_time: float, timed: bool, tp: int,
               loss_sum: float | None = None, tokens: float | None = None) -> dict:
        """The step's metrics record, the keys both trainers write (`logging.metrics_file`,
        `--libra-metrics-file`): the loss over the global batch's labelled tokens (every
        tensor-parallel rank holds the same sums: counted once), tokens/s, the plan's attention
        work max/mean, inter-pool imbalance and planning time, each rank's measured attention
        time and the bytes sent (pool exchange and CP collectives: summed over ranks, and the
        MB per rank of each)."""
        loss_sum = float(self.column("loss_sum").sum()) / tp if loss_sum is None else loss_sum
        tokens = float(self.column("label_tokens").sum()) / tp if tokens is None else tokens
        t = self.column("attn_seconds")
        return {
            "step": step,
            "loss": loss_sum / max(tokens, 1.0),
            "tokens": tokens,
            "step_time": step_time,
            "tokens_per_s": tokens / max(step_time, 1e-12),
            "attn_work_max_over_mean": plan.max_over_mean,
            "inter_pool_imbalance": plan.inter_pool_imbalance,
            "attn_time_max_over_mean": float(t.max() / max(float(t.mean()), 1e-12))
            if timed else None,
            "attn_time_per_rank": t.tolist() if timed else None,
            "bytes_exchanged": float(self.column("pool_bytes").sum()
                                     + self.column("cp_bytes").sum()),
            "pool_mb_per_rank": float(self.column("pool_bytes").mean()) / 1e6,
            "cp_mb_per_rank": float(self.column("cp_bytes").mean()) / 1e6,
            "plan_ms": float(plan.plan_ms),
            **self._predicted(),
        }

    def _predicted(self) -> dict:
        """The cost model's figures where the step was planned with a table: each rank's
        measured kernel time max/mean (`counters.KernelTimer`: its own attention work, without
        the collectives' waits), the table's predicted max/mean and its error (median over ranks
        of |predicted - measured| / measured)."""
        p, k = self.column("attn_predicted"), self.column("kernel_seconds")
        out = {}
        if (k > 0).all():
            out["attn_kernel_time_max_over_mean"] = float(k.max() / k.mean())
        if (p > 0).all():
            out["attn_time_predicted_max_over_mean"] = float(p.max() / p.mean())
            if (k > 0).all():
                out["cost_model_error"] = costmodel.error_of(p, k)
        return out
