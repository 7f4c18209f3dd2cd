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
from megatron.training.utils import get_blend_and_blend_per_split

from megatron.libra.megatron_lm.args import changed_settings, libra_settings, train_config
from megatron.libra.megatron_lm.spec import runtime
from megatron.libra.sources import GPTDatasetSource, SyntheticSource, held_steps
from megatron.libra.steps import (
    AttentionTimer,
    StepSampler,
    StepStats,
    check_plan,
    device_micro_batches,
    new_planner,
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
        self._window: list[tuple[float, float]] = []  # per step: plan metrics
        self._gathered = None  # StepStats summed over the log window
        # --libra-metrics-file: the step's loss sum and token count, summed on the device
        self._record = args.libra_metrics_file
        self._loss = torch.zeros(2, dtype=torch.float64, device=self.device) \
            if self._record else None
        self._clock = time.perf_counter()
        if self._record and self.rank0:
            Path(self._record).parent.mkdir(parents=True, exist_ok=True)
            Path(self._record).write_text("")
        doc_base, recent = 0, {}
        if start_step > 0 and args.load:
            state = self._load_state(start_step)
            if state is not None:
                planner.load_state_dict(state["planner_state"])
                doc_base, recent = int(state["doc_base"]), dict(state["recent_bases"])
        self.sampler = StepSampler(cfg, planner, replica=self.r, start_step=start_step,
                                   doc_base=doc_base, recent_bases=recent,
                                   cp_rank=self.c, source=src, stop_step=args.train_iters)
        _TRAIN_ITERATOR[0] = self

    def __iter__(self):
        return self

    def __next__(self):
        if not self._micro:
            batch = self.last = self.sampler.next()
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

    def attach(self, model) -> None:
        """Time this rank's core attention (forward and backward) on the model Megatron-LM
        built: module hooks, CUDA events on a GPU (read once per log interval)."""
        if self.timer is None:
            self.timer = AttentionTimer(model, self.args.libra_attention_time)

    def step_end(self) -> None:
        """The end of a step's backward on every rank (Megatron-LM's finalize_model_grads,
        before the optimizer step): at the log interval, Libra's line over the interval's
        steps, beside Megatron-LM's iteration line: the plan's attention work max/mean and
        inter-pool imbalance, the measured attention time per rank (max/mean and the mean
        per iteration) and the bytes each rank sent per iteration (the pool's tile exchange;
        the CP group's all-to-alls), gathered on the gloo group of host tensors."""
        b = self.last
        if b is None:
            return
        plan = b.plan
        self._window.append((plan.max_over_mean, plan.inter_pool_imbalance))
        it = b.step + 1
        line = it % max(self.args.log_interval, 1) == 0 or it == self.args.train_iters
        if not (line or self._record):
            return
        timed = self.timer is not None and self.timer.enabled
        loss = self._loss.cpu().tolist() if self._record else [0.0, 0.0]
        stats = StepStats.gather(self.rt, self.timer.seconds() if timed else 0.0,
                                 loss_sum=loss[0], label_tokens=loss[1])
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
        if self.rank0:
            self._print_line(it, window, timed)
        self._window.clear()

    def _print_line(self, it: int, stats: StepStats, timed: bool) -> None:
        """Libra's line beside Megatron-LM's, over the log window's steps."""
        n = len(self._window)
        work, imbalance = (sum(w[i] for w in self._window) / n for i in range(2))
        t = stats.column("attn_seconds")
        attn = (f"{float(t.max() / max(float(t.mean()), 1e-12)):.3f} (mean "
                f"{1e3 * float(t.mean()) / n:.1f} ms/iteration)" if timed else "off")
        pool = float(stats.column("pool_bytes").mean()) / n / 1e6
        cp = float(stats.column("cp_bytes").mean()) / n / 1e6
        print(f" libra | iteration {it:8d} | system: {self.args.libra_system} | attn work "
              f"max/mean: {work:.3f} | attn time max/mean: {attn} | inter-pool imbalance: "
              f"{imbalance:.3f} | pool exchange MB/rank: {pool:.2f} | CP all-to-all MB/rank: "
              f"{cp:.2f} |", flush=True)

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


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM's dataset provider: the training iterator over GPTDataset (MockGPTDataset
    with --mock-data) under the step plan; no validation or test iterators."""
    args = get_args()
    if args.libra_data == "synthetic":
        return StepMicroBatches(args, None, start_step=args.iteration), None, None
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
    train, _, _ = BlendedMegatronDatasetBuilder(kind, sizes, lambda: True, config).build()
    return StepMicroBatches(args, train, start_step=args.iteration), None, None


datasets_provider.is_distributed = True  # every rank builds it (it reads its replica's samples)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: the micro-batch's summed token losses and its token count (Megatron-LM
    divides by the global batch's count, --calculate-per-token-loss)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    if _TRAIN_ITERATOR[0] is not None:
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
    return out, functools.partial(loss_func, mb.loss_mask)
