"""Megatron-LM's data side of Libra: the training iterator (`--dataloader-type external`) that
serves each rank the micro-batches its replica executes under the step plan, Megatron-LM's
dataset provider, forward step and loss function, Libra's log line beside Megatron-LM's, the
metrics file, and the planner's state beside each checkpoint. The per-step pipeline itself is
`megatron.libra.steps`, the one `libra train` runs."""

from __future__ import annotations

import functools
import json
import os
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import finalize_model_grads
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, get_timers, training
from megatron.training.checkpointing import get_checkpoint_name
from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
from megatron.training.utils import get_blend_and_blend_per_split

from libra_ext import costmodel
from libra_ext.attention.comm import ByteCounter
from megatron.libra.megatron_lm.args import changed_settings, libra_settings, train_config
from megatron.libra.megatron_lm.spec import runtime
from megatron.libra.sources import GPTDatasetSource, SyntheticSource, held_steps
from megatron.libra.steps import (
    AttentionTimer,
    CostModels,
    StepSampler,
    StepStats,
    check_plan,
    device_micro_batches,
    new_planner,
    settle_heap,
)

_TRAIN_ITERATOR: list = [None]  # the StepMicroBatches of this process's training run


def finalize_model_grads_then_log(*args, **kwargs):
    """megatron-core's finalize_model_grads (the step's gradient reduction, at the end of its
    backward on every rank), then Libra's per-step accounting (StepMicroBatches.step_end)."""
    out = finalize_model_grads(*args, **kwargs)
    if _TRAIN_ITERATOR[0] is not None:
        _TRAIN_ITERATOR[0].step_end()
    return out


class StepMicroBatches:
    """The training iterator Megatron-LM's schedule reads (`--dataloader-type external`): each
    `next` is this rank's next micro-batch, on the device; the step plan behind them is made one
    step ahead by the sampler's thread, and its hash is compared across ranks as each step's
    first micro-batch is served."""

    def __init__(self, args, dataset, start_step: int):
        self.args = args
        self.cfg = cfg = train_config(args)
        self.rt = runtime(args)
        self.r, self.c = self.rt.groups.r, self.rt.groups.c
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self.rank0 = torch.distributed.get_rank() == 0
        planner = new_planner(cfg, ps.get_data_parallel_world_size(),
                              torch.finfo(torch.bfloat16 if args.bf16 else torch.float32).bits
                              // 8)
        if dataset is None:  # --libra-data synthetic: the stream libra train reads
            src = SyntheticSource(cfg)
        else:
            src = GPTDatasetSource(dataset, cfg.data.gbs, held_steps(cfg))
        self.step = start_step
        self.last = None  # the StepBatch whose micro-batches were served last
        self._micro: deque = deque()
        self.timer = None  # AttentionTimer, on the model Megatron-LM built (attach)
        self._window: list[tuple] = []  # per step: plan metrics and tokens
        self._gathered = None  # StepStats summed over the log window
        # --libra-metrics-file: the step's loss sum and token count, summed on the device
        self._record = args.libra_metrics_file
        self._loss = torch.zeros(2, dtype=torch.float64, device=self.device) \
            if self._record else None
        self._clock = time.perf_counter()
        self._saved_counter = None  # the training counter while a validation pass runs
        self._first_line = True  # Megatron-LM logs this process's first iteration
        self._line_clock = time.perf_counter()
        if self._record and self.rank0:
            Path(self._record).parent.mkdir(parents=True, exist_ok=True)
            Path(self._record).write_text("")
        doc_base, recent = 0, {}
        # system.cost_model (--libra-cost-model): the attention layers are counted once the
        # model is attached; until then no row is fitted
        self.costs = CostModels(cfg, start_step, 1, self.rt.groups.check_group)
        if not args.libra_attention_time and not self.costs.active:
            self.costs.kernel_timer = None  # --no-libra-attention-time: nothing timed
        self.rt.kernel_timer = self.costs.kernel_timer
        self._predicted = 0.0  # this rank's predicted seconds over the log window
        self._kernel = 0.0  # this rank's kernel seconds over the log window
        if start_step > 0 and args.load:
            state = self._load_state(start_step)
            if state is not None:
                planner.load_state_dict(state["planner_state"])
                doc_base, recent = int(state["doc_base"]), dict(state["recent_bases"])
                self.costs.load_state_dict(state.get("cost_model"),
                                           f"iteration {start_step}'s planner state: cost_model")
        self.sampler = StepSampler(cfg, planner, replica=self.r, start_step=start_step,
                                   doc_base=doc_base, recent_bases=recent,
                                   cp_rank=self.c, source=src, stop_step=args.train_iters,
                                   costs=self.costs)
        _TRAIN_ITERATOR[0] = self

    def __iter__(self):
        return self

    def __next__(self):
        if not self._micro:
            if self.last is None:  # the first step: the model and optimizer are built
                settle_heap()
            self.end_validation()
            timers = get_timers()
            timers("libra-plan-wait", log_level=1).start()
            batch = self.last = self.sampler.next()
            timers("libra-plan-wait").stop()
            check_plan(batch.plan, self.rt)
            micro = device_micro_batches(batch, self.rt, self.device, self.cfg.parallel.cp,
                                         self.c, self.r)
            self._micro.extend(micro)
            self.step = batch.step + 1
            self._seqlen_stats(micro)
        return self._micro.popleft()

    def _seqlen_stats(self, micro: list) -> None:
        """Megatron-LM's FLOPs count of a packed step (sum of document lengths and of their
        squares): this replica's documents, once per step, from the host lengths the plan
        holds (one small non-blocking copy on a GPU, no sync)."""
        update = getattr(training, "update_seqlen_stats_from_cu_seqlens", None)
        if update is None:
            return
        lengths = [n for mb in micro for n in mb.packed_seq_params.doc_lengths]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        if self.device.type != "cpu":
            cu = cu.pin_memory().to(self.device, non_blocking=True)
        update(cu)

    def begin_validation(self) -> None:
        """A validation pass starts: its attention time and bytes are not the training steps'
        (the runtime counts into a scratch counter, the timer records nothing) until the next
        training step (`end_validation`)."""
        if self._saved_counter is None:
            self._saved_counter = self.rt.counter
            self.rt.counter = ByteCounter()
            if self.timer is not None:
                self.timer.suspended = True

    def end_validation(self) -> None:
        if self._saved_counter is not None:
            self.rt.counter, self._saved_counter = self._saved_counter, None
            if self.timer is not None:
                self.timer.suspended = False
            if self.costs.kernel_timer is not None:  # the validation's kernels are not a step's
                self.costs.kernel_timer.reset()

    def attach(self, model) -> None:
        """Time this rank's core attention (forward and backward) on the model Megatron-LM
        built: module hooks, CUDA events on a GPU (read once per log interval)."""
        if self.timer is None:
            self.timer = AttentionTimer(model, self.args.libra_attention_time)
            self.costs.layers = max(1, self.timer.layers)

    def step_end(self) -> None:
        """The end of a step's backward on every rank (Megatron-LM's finalize_model_grads,
        before the optimizer step): at the log interval (and at this run's first iteration, as
        Megatron-LM's line), Libra's line over the interval's steps, beside Megatron-LM's
        iteration line: tokens/s, the plan's attention work max/mean, inter-pool imbalance and
        planning time, the measured attention time per rank (max/mean and the mean per
        iteration) and the bytes each rank sent per iteration (the pool's tile exchange; the CP
        group's collectives), gathered on the gloo group of host tensors; the same as
        TensorBoard / W&B scalars where Megatron-LM writes them, and Libra's timers with
        Megatron-LM's at --timing-log-level 1 or 2."""
        b = self.last
        if b is None:
            return
        plan = b.plan
        timed = self.timer is not None and self.timer.enabled
        if self.costs.active:  # the step's row (and, at the fit interval, the fit: collective)
            kernel = self.costs.kernel_timer.seconds()  # (a read per step: the fit's rows)
            self.costs.kernel_timer.reset()
            self.costs.step_end(b.step, b.features, kernel)
            self._kernel += kernel
            self._predicted += self.costs.predicted(b.cost_table, b.features)
        self._window.append((plan.max_over_mean, plan.inter_pool_imbalance, plan.plan_ms,
                             float(plan.doc_lengths.sum())))
        it = b.step + 1
        line = (it % max(self.args.log_interval, 1) == 0 or it == self.args.train_iters
                or self._first_line)
        if not (line or self._record):
            return
        if self.costs.kernel_timer is not None and not self.costs.active:
            self._kernel = self.costs.kernel_timer.seconds()  # the window's, read once
            self.costs.kernel_timer.reset()
        loss = self._loss.cpu().tolist() if self._record else [0.0, 0.0]
        stats = StepStats.gather(self.rt, self.timer.seconds() if timed else 0.0,
                                 loss_sum=loss[0], label_tokens=loss[1],
                                 attn_predicted=self._predicted, kernel_seconds=self._kernel)
        self._predicted, self._kernel = 0.0, 0.0
        if self.timer is not None:
            self.timer.reset()
        if self._record:
            self._loss.zero_()
            if self.rank0:
                self._write_record(it, plan, stats, timed)
        self._gathered = stats if self._gathered is None else self._gathered + stats
        if not line:
            return
        window, self._gathered = self._gathered, None
        now = time.perf_counter()
        figures = self._figures(window, timed, now - self._line_clock)
        self._line_clock, self._first_line = now, False
        if self.rank0:
            self._print_line(it, figures)
        self._write_scalars(it, figures)
        if self.args.timing_log_level >= 1:  # Libra's timers beside Megatron-LM's
            names = ["libra-plan-wait"] + (["libra-pool-exchange-wait"]
                                           if self.args.timing_log_level >= 2 else [])
            get_timers().log(names, normalizer=len(self._window))
        self._window.clear()

    def _figures(self, stats: StepStats, timed: bool, seconds: float) -> dict:
        """The log window's figures, per iteration where they add up."""
        n = len(self._window)
        mean = lambda i: sum(w[i] for w in self._window) / n  # noqa: E731
        t = stats.column("attn_seconds")
        out = {"tokens per s": sum(w[3] for w in self._window) / max(seconds, 1e-9),
               "attn work max over mean": mean(0), "inter-pool imbalance": mean(1),
               "planning ms": mean(2),
               "pool exchange MB per rank": float(stats.column("pool_bytes").mean()) / n / 1e6,
               self._cp_name: float(stats.column("cp_bytes").mean()) / n / 1e6}
        if timed:
            out["attn time max over mean"] = float(t.max() / max(float(t.mean()), 1e-12))
            out["attn time ms per iteration"] = 1e3 * float(t.mean()) / n
        p, k = stats.column("attn_predicted"), stats.column("kernel_seconds")
        if (k > 0).all():  # each rank's own kernel time (no collective waits)
            out["attn kernel time max over mean"] = float(k.max() / k.mean())
        if (p > 0).all():  # planned with a cost table: its prediction and error (kernel time)
            out["attn predicted max over mean"] = float(p.max() / p.mean())
            if (k > 0).all():
                out["cost model error"] = costmodel.error_of(p, k)
        return out

    @property
    def _cp_name(self) -> str:
        """What the CP bytes are: the Ulysses all-to-alls, or per-document CP's K/V all-gather
        and dK/dV reduction."""
        return ("CP all-gather + reduce MB per rank" if self.args.libra_system == "wlb"
                else "CP all-to-all MB per rank")

    def _print_line(self, it: int, f: dict) -> None:
        """Libra's line beside Megatron-LM's, over the log window's steps."""
        attn = (f"{f['attn time max over mean']:.3f} (mean {f['attn time ms per iteration']:.1f}"
                " ms/iteration)" if "attn time max over mean" in f else "off")
        cp = self._cp_name.replace(" per rank", "/rank")
        print(f" libra | iteration {it:8d} | system: {self.args.libra_system} | tokens/s: "
              f"{f['tokens per s']:.1f} | attn work max/mean: {f['attn work max over mean']:.3f}"
              f" | attn time max/mean: {attn} | inter-pool imbalance: "
              f"{f['inter-pool imbalance']:.3f} | planning ms: {f['planning ms']:.2f} | "
              f"pool exchange MB/rank: {f['pool exchange MB per rank']:.2f} | {cp}: "
              f"{f[self._cp_name]:.2f} |{self._cost_words(f)}", flush=True)

    @staticmethod
    def _cost_words(f: dict) -> str:
        out = ""
        if "attn kernel time max over mean" in f:
            out += f" attn kernel time max/mean: {f['attn kernel time max over mean']:.3f} |"
        if "attn predicted max over mean" in f:
            out += f" attn predicted max/mean: {f['attn predicted max over mean']:.3f} |"
        if "cost model error" in f:
            out += f" cost model error: {f['cost model error']:.3f} |"
        return out

    def _write_scalars(self, it: int, f: dict) -> None:
        """The figures as TensorBoard scalars (libra/...) and W&B metrics, on the rank where
        Megatron-LM writes its own (--tensorboard-dir, --wandb-project)."""
        writer, wandb = get_tensorboard_writer(), get_wandb_writer()
        if writer is not None:
            for k, v in f.items():
                writer.add_scalar(f"libra/{k}", v, it)
        if wandb is not None:
            wandb.log({f"libra/{k}": v for k, v in f.items()}, it)

    def count_loss(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        """A micro-batch's loss sum and token count into the step's (on the device, read once
        per step in step_end); only with --libra-metrics-file."""
        if self._record:
            self._loss += torch.stack([loss.detach().double(), tokens.detach().double()])

    def _write_record(self, it: int, plan, stats: StepStats, timed: bool) -> None:
        """One --libra-metrics-file line for iteration `it` (the keys of `libra train`'s
        logging.metrics_file that Megatron-LM's loop can fill; its grad norm is in
        Megatron-LM's own line), the step's wall time since the previous step ended."""
        now = time.perf_counter()
        dt, self._clock = now - self._clock, now
        rec = stats.record(it, plan, dt, timed, self.args.tensor_model_parallel_size)
        with open(self._record, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self.costs.close()
        self.sampler.close()

    # Megatron-LM's checkpoint has no slot for a planner: its external-dataloader hook
    # (args.dataloader_save, `save_state`) stores this beside each checkpoint's shards, in the
    # iteration's directory, as train_dataloader_dprank<NNN>.pt; Megatron's loader ignores it.
    def save_state(self) -> dict:
        """What resuming after the last served step needs: the planner's state after planning
        it (WLB-LLM's held documents), the document counter and the recent steps' document
        bases, and the settings the sample stream depends on."""
        if self._micro:
            raise RuntimeError("a checkpoint inside a step: its micro-batches are not all run")
        b = self.last
        return {
            "next_step": 0 if b is None else b.step + 1,
            "planner_state": self.sampler.planner.state_dict() if b is None
            else b.planner_state,
            "doc_base": 0 if b is None else b.doc_base + b.n_inputs,
            "recent_bases": {} if b is None else dict(b.recent_bases),
            "cost_model": self.costs.state_dict(),
            "settings": libra_settings(self.args),
        }

    def _load_state(self, step: int) -> dict | None:
        path = get_checkpoint_name(
            self.args.load, step, pipeline_parallel=ps.get_pipeline_model_parallel_world_size()
            > 1, tensor_rank=0, pipeline_rank=0, expert_parallel=False, expert_rank=0,
            basename=f"train_dataloader_dprank{ps.get_data_parallel_rank():03d}.pt")
        if not os.path.isfile(path):
            if self.args.libra_system == "wlb":
                raise RuntimeError(
                    f"resume at iteration {step}: {path} is missing, so the documents WLB-LLM "
                    "held back at the checkpoint are unknown (a checkpoint saved without Libra?)")
            if self.rank0:
                print(f" libra | no planner state at {path}: the step plans restart at "
                      f"iteration {step} from the samples alone", flush=True)
            return None
        state = torch.load(path, weights_only=False)["dataloader_state_dict"]
        if int(state["next_step"]) != step:
            raise RuntimeError(f"{path} holds the planner state before iteration "
                               f"{state['next_step']}, not {step}")
        changed = changed_settings(state["settings"], libra_settings(self.args))
        if changed:
            raise RuntimeError(f"resume at iteration {step} with other Libra settings than the "
                               f"checkpoint's: {'; '.join(changed)}")
        return state


class ValidationMicroBatches:
    """Megatron-LM's validation iterator: the micro-batches of --eval-iters global batches of
    the validation data, planned by the run's system with a planner of their own (the last batch
    flushes what WLB-LLM holds, so every document of them is computed), each rank served its
    replica's in the schedule's order, as `libra train`'s validation does. Megatron-LM's
    `evaluate` reads exactly --eval-iters batches per evaluation; once they are all served the
    next evaluation starts them over, so every evaluation sees the same batches."""

    def __init__(self, args, dataset):
        self.args, self.dataset = args, dataset
        self.cfg = train_config(args)
        self.rt = runtime(args)
        self.r, self.c = self.rt.groups.r, self.rt.groups.c
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self.sampler, self.served = None, 0
        self._micro: deque = deque()

    def __iter__(self):
        return self

    def _start(self) -> StepSampler:
        cfg = self.cfg
        planner = new_planner(cfg, ps.get_data_parallel_world_size(),
                              torch.finfo(torch.bfloat16 if self.args.bf16 else torch.float32)
                              .bits // 8)
        src = SyntheticSource(cfg, "valid") if self.dataset is None \
            else GPTDatasetSource(self.dataset, cfg.data.gbs, held_steps(cfg))
        return StepSampler(cfg, planner, replica=self.r, cp_rank=self.c, source=src,
                           stop_step=self.args.eval_iters)

    def __next__(self):
        if not self._micro:
            if self.sampler is None:
                self.sampler, self.served = self._start(), 0
            if _TRAIN_ITERATOR[0] is not None:
                _TRAIN_ITERATOR[0].begin_validation()
            batch = self.sampler.next()
            check_plan(batch.plan, self.rt)
            for mb in device_micro_batches(batch, self.rt, self.device, self.cfg.parallel.cp,
                                           self.c, self.r):
                mb.validation = True  # (its loss is not the training step's)
                self._micro.append(mb)
            self.served += 1
            if self.served == self.args.eval_iters:  # the next evaluation starts over
                self.sampler.close()
                self.sampler = None
        return self._micro.popleft()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM's dataset provider: the training iterator over GPTDataset (MockGPTDataset
    with --mock-data, Libra's synthetic stream with --libra-data synthetic) under the step plan,
    and with --eval-iters the validation iterator over the validation split (the synthetic
    stream's next seed) planned the same way; no test iterator."""
    args = get_args()
    validate = bool(args.eval_iters)
    if args.libra_data == "synthetic":
        valid = ValidationMicroBatches(args, None) if validate else None
        return StepMicroBatches(args, None, start_step=args.iteration), valid, None
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split,
        path_to_cache=args.data_cache_path, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False, mmap_bin_files=args.mmap_bin_files)
    kind = MockGPTDataset if args.mock_data else GPTDataset
    # a split asked for no samples is built for one epoch (None), not for 0: megatron-core's
    # GPTDataset asks 0 samples for one extra token and never ends on a split without documents
    sizes = [n if n else None for n in train_val_test_num_samples]
    if validate:  # every evaluation serves the same --eval-iters global batches
        sizes[1] = args.eval_iters * args.global_batch_size
    train, valid_ds, _ = BlendedMegatronDatasetBuilder(kind, sizes, lambda: True, config).build()
    if validate and (valid_ds is None or len(valid_ds) == 0):
        raise RuntimeError(
            f"--eval-iters {args.eval_iters}: --split {args.split} leaves the validation split "
            "without documents (raise its second weight, or --eval-iters 0)")
    valid = ValidationMicroBatches(args, valid_ds) if validate else None
    return StepMicroBatches(args, train, start_step=args.iteration), valid, None


datasets_provider.is_distributed = True  # every rank builds it (it reads its replica's samples)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, training: bool = True):
    """Per-token loss: the micro-batch's summed token losses and its token count (Megatron-LM
    divides by the global batch's count, --calculate-per-token-loss); a training micro-batch's
    also into the step's metrics record."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    if training and _TRAIN_ITERATOR[0] is not None:
        _TRAIN_ITERATOR[0].count_loss(loss, tokens)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    """Megatron-LM's forward_step: the rank's next micro-batch (on the device, with the step
    plan in its PackedSeqParams) through the model."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    if _TRAIN_ITERATOR[0] is not None:  # (Megatron-LM wraps the iterator it was given)
        _TRAIN_ITERATOR[0].attach(model)
    mb = next(data_iterator)
    timers("batch-generator").stop()
    out = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                packed_seq_params=mb.packed_seq_params)
    return out, functools.partial(loss_func, mb.loss_mask,
                                  training=not getattr(mb, "validation", False))
