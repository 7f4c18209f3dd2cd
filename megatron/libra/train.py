"""The training loop: megatron-core GPTModel with Libra's core attention, DDP, the megatron
optimizer and LR schedule, `get_forward_backward_func`, a per-token loss over packed THD
batches, the planner one step ahead, Megatron-style logs, and checkpoints that also hold the data
position and the planner's carried state."""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import signal
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from libra_ext import hostmem
from libra_ext import moe as moe_plan
from libra_ext.attention import thd
from libra_ext.attention.comm import LAST_COLLECTIVE
from libra_ext.attention.kernels import KernelParams, choose_backend
from libra_ext.distributed import free_port
from megatron.libra import checkpoint, cpu_shims, moe_layer
from megatron.libra.config import TrainConfig
from megatron.libra.logs import config_lines, log_line, progress_log, since_launch, step_flops
from megatron.libra.model import build_model_chunks
from megatron.libra.notices import quiet_megatron_notices
from megatron.libra.sources import describe_data
from megatron.libra.steps import (
    AttentionTimer,
    CostModels,
    StepSampler,
    StepStats,
    check_plan,
    device_micro_batches,
    new_planner,
    new_runtime,
    settle_heap,
)

with warnings.catch_warnings():  # megatron-core's notices on import (no GPU, no TE, ...)
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

logger = logging.getLogger("libra.train")


def _init_distributed(
    rank: int | None, world: int | None, init_method: str | None, timeout_minutes: float
) -> tuple:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if rank is None:  # torchrun / Slurm environment, or a single process
            rank = int(os.environ.get("RANK", 0))
            world = int(os.environ.get("WORLD_SIZE", 1))
            if world == 1 and "MASTER_ADDR" not in os.environ:
                init_method = f"tcp://127.0.0.1:{free_port()}"
            else:
                init_method = "env://"
        if backend == "nccl":
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            )
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return dist.get_rank(), dist.get_world_size()


def run(
    cfg: TrainConfig,
    rank: int | None = None,
    world: int | None = None,
    init_method: str | None = None,
) -> list[dict]:
    """Train; returns the per-step metrics (on every rank)."""
    return Trainer(cfg, rank, world, init_method).train()


class Trainer:
    """One training run in small steps: `__init__` builds (process groups, runtime, model
    chunks, DDP, optimizer, schedule, planner, resume, data, checkpointer, log sinks);
    `train()` runs `train_step` / `log` / `maybe_save` for every step and closes."""

    def __init__(self, cfg: TrainConfig, rank=None, world=None, init_method=None):
        quiet_megatron_notices()
        self.rank, self.world = _init_distributed(
            rank, world, init_method, cfg.parallel.timeout_minutes
        )
        progress_log()
        self.cfg = cfg
        self.dp = cfg.validate(self.world)
        if not torch.cuda.is_available():
            cpu_shims.apply()
            hostmem.retain_freed_memory()  # attention pieces reuse freed host memory
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.dtype = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}[
            cfg.dtype
        ]
        if self.rank == 0:
            logger.info("libra train: %d rank(s) joined the process group (%s) %s", self.world,
                        dist.get_backend(), since_launch())
        self._build_parallel()
        t0 = time.perf_counter()
        self._build_model()
        self._build_optimizer()
        built = time.perf_counter() - t0
        self._build_data()
        self._open_sinks()
        if self.rank == 0:
            logger.info("libra train: model and optimizer built in %.1f s; training starts %s",
                        built, since_launch())

    # ------------------------------------------------------------------ build
    def _build_parallel(self) -> None:
        cfg, p = self.cfg, self.cfg.parallel
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
            context_parallel_size=p.cp,
            expert_model_parallel_size=p.ep,
            distributed_timeout_minutes=p.timeout_minutes,
            order="tp-cp-ep-dp-pp",
        )
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.data.seed)
        # the operator's Ulysses all-to-all runs on megatron-core's own CP group
        self.runtime = new_runtime(cfg, self.dp, ps.get_context_parallel_group())
        self.r, self.c = self.runtime.groups.r, self.runtime.groups.c
        if self.rank == 0:
            for line in config_lines(cfg):
                logger.info(line)
            logger.info(
                "libra train: layout: world %d = tp %d x cp %d x dp %d x pp %d (vpp %d, ep %d); "
                "%d pool(s) of %d replica(s); system %s; %s on %s",
                self.world, p.tp, p.cp, self.dp, p.pp, p.vpp, p.ep, self.dp // p.pool_size,
                p.pool_size, cfg.system.name, cfg.dtype,
                "cuda" if torch.cuda.is_available() else "cpu (gloo)",
            )
            logger.info("libra train: building the model with megatron-core ...")

    def _build_model(self) -> None:
        cfg, p = self.cfg, self.cfg.parallel
        self.chunks = build_model_chunks(
            cfg.model,
            cfg.system.name,
            self.runtime,
            max_seq=cfg.data.context,
            dtype=self.dtype,
            expert_parallel=p.ep,
            transformer_impl=cfg.transformer_impl,
            pp=p.pp,
            vpp=p.vpp,
            init_seed=cfg.data.seed,
            moe=cfg.moe,
            record_routing=cfg.logging.record_routing,
            tensor_model_parallel_size=p.tp,
            sequence_parallel=p.sequence_parallel,
            context_parallel_size=p.cp,
            cp_comm_type="a2a",
            # on a GPU the weights are made on the device (no host copy of the full model)
            use_cpu_initialization=not torch.cuda.is_available(),
            **cfg.model.megatron_recompute(p.pp * p.vpp),
        )
        if torch.cuda.is_available():
            for chunk in self.chunks:
                chunk.cuda()
        self._moe_all_gather = any(isinstance(m, moe_layer.PaddedAllGatherDispatcher)
                                   for chunk in self.chunks for m in _dispatchers(chunk))
        self.timer = AttentionTimer(self.chunks, cfg.logging.attention_time)
        if self.rank == 0:
            n_params = sum(x.numel() for chunk in self.chunks for x in chunk.parameters())
            shard = f" (a 1/{p.tp} tensor-parallel shard)" if p.tp > 1 else ""
            if p.pp > 1:
                shard += f" (pipeline stage 0 of {p.pp})"
            logger.info("libra train: %s parameters on this rank%s", f"{n_params:,}", shard)
            name, why = choose_backend(
                KernelParams(self.device.type, self.dtype, cfg.model.head_dim,
                             self.runtime.backend)
            )
            logger.info("libra train: attention backend: %s%s", name, f" ({why})" if why else "")

    def _build_optimizer(self) -> None:
        o, s = self.cfg.optimizer, self.cfg.schedule
        ddp_config = DistributedDataParallelConfig(
            # bf16 runs keep fp32 gradient buffers (Megatron's accumulate-allreduce-grads-in-fp32)
            grad_reduce_in_fp32=self.dtype == torch.bfloat16,
            use_distributed_optimizer=o.distributed,
            overlap_grad_reduce=o.overlap_grad_reduce,
            overlap_param_gather=o.overlap_param_gather,
        )
        self.model = [
            DistributedDataParallel(
                chunk.config, ddp_config, chunk,
                # as Megatron-LM: only the first chunk's buffers use buckets
                disable_bucketing=i > 0,
            )
            for i, chunk in enumerate(self.chunks)
        ]
        model = self.model
        config = self.chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads

        def per_chunk(name):
            return [getattr(m, name) for m in model] if len(model) > 1 else getattr(model[0], name)

        if o.overlap_grad_reduce:  # the schedule starts each chunk's reduction as grads are done
            config.no_sync_func = per_chunk("no_sync")
            config.grad_sync_func = per_chunk("start_grad_sync")
        self.opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                params_dtype=self.dtype,
                bf16=self.dtype == torch.bfloat16,  # fp32 main weights and Adam states
                use_distributed_optimizer=o.distributed,
            ),
            model,
        )
        if o.overlap_param_gather:  # each chunk's parameters gathered as its forward needs them
            config.param_sync_func = per_chunk("start_param_sync")
        self.sched = OptimizerParamScheduler(
            self.opt,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=s.warmup_steps,
            lr_decay_steps=s.decay_length(),
            lr_decay_style=s.decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=s.train_steps,
            wd_incr_style="constant",
            # a schedule that differs from the checkpoint's is refused before launch unless
            # checkpoint.override_scheduler says to use this config's
            override_opt_param_scheduler=self.cfg.checkpoint.override_scheduler,
            use_checkpoint_opt_param_scheduler=not self.cfg.checkpoint.override_scheduler,
        )
        self.fb = get_forward_backward_func()

    def _new_planner(self):
        return new_planner(self.cfg, self.dp, torch.tensor([], dtype=self.dtype).element_size())

    def _build_data(self) -> None:
        cfg, ck = self.cfg, self.cfg.checkpoint
        planner = self._new_planner()
        self.start, doc_base, recent = 0, 0, {}
        model_fields = cfg.model.weight_fields()
        src = checkpoint.load_plan(ck, model_fields, cfg.resume_fields())
        self.latest = None if src is None else src.step
        if src is not None:
            resumed = checkpoint.load(src.root, src.step, self.chunks, self.opt, self.sched,
                                      model_fields, src.finetune)
            if resumed.planner_state is not None:
                planner.load_state_dict(resumed.planner_state)
            self.start, doc_base, recent = (
                resumed.next_step, resumed.doc_base, resumed.recent_bases
            )
        self.costs = CostModels(cfg, self.start, self.timer.layers,
                                self.runtime.groups.check_group)
        self.runtime.kernel_timer = self.costs.kernel_timer
        if src is not None and not src.finetune:
            self.costs.load_state_dict(resumed.cost_model, f"{src.path}: cost_model")
            if self.rank == 0:
                what = "loaded the weights of" if src.finetune else "resumed from"
                logger.info("%s %s at step %d", what, src.path, self.start)
        if self.rank == 0:
            for line in describe_data(cfg):
                logger.info("libra train: %s", line)
        self.sampler = StepSampler(
            cfg, planner, replica=self.r, start_step=self.start, doc_base=doc_base,
            recent_bases=recent, cp_rank=self.c, costs=self.costs,
        )
        self.saver = (
            checkpoint.Checkpointer(ck.dir, ck.async_save, model_fields, cfg.resume_fields(),
                                    need=checkpoint.checkpoint_bytes(cfg))
            if ck.dir
            else None
        )

    def _open_sinks(self) -> None:
        cfg = self.cfg
        self.history: list[dict] = []
        self.log_file, self.tb, self.wandb = None, None, None
        if self.rank == 0 and cfg.logging.wandb_project:
            try:
                # optional: wandb
                import wandb

                self.wandb = wandb.init(project=cfg.logging.wandb_project,
                                        name=cfg.logging.wandb_run_name, config=cfg.to_dict())
            except ImportError:
                logger.warning("logging.wandb_project is set but wandb is not installed; "
                               "pip install wandb to log the figures there")
        if self.rank == 0 and cfg.logging.tensorboard_dir:
            try:
                # optional: tensorboard
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(cfg.logging.tensorboard_dir)
            except ImportError:
                logger.warning(
                    "logging.tensorboard_dir is set but tensorboard is not installed; "
                    "pip install tensorboard to get the scalars"
                )
        if self.rank == 0 and cfg.logging.metrics_file:
            Path(cfg.logging.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.log_file = open(
                cfg.logging.metrics_file, "a" if self.latest is not None else "w"
            )

    # ------------------------------------------------------------------ steps
    def micro_batches(self, batch) -> list:
        """This rank's micro-batches of the step, in the order the schedule runs them, on the
        device: the attention metadata of every slot and the micro-batch's tokens, labels,
        positions and loss mask, each one non-blocking copy from the pinned buffers the
        sampler's thread staged."""
        plan, C = batch.plan, self.cfg.parallel.cp
        if self._moe_all_gather:
            # every EP rank pads its tokens to the step's longest micro-batch for the MoE
            # layers' all-gather (no layer exchanges or reads token counts)
            p = self.cfg.parallel
            rows = int(thd.local_tokens(plan.doc_lengths, plan.seq_doc_offsets, C,
                                        thd.layout_of(plan.system)).max())
            moe_layer.set_step_rows(-(-rows // p.tp) if p.sequence_parallel else rows)
        return device_micro_batches(batch, self.runtime, self.device, C, self.c, self.r)

    def forward_backward(self, micro: list, global_tokens: float,
                         forward_only: bool = False) -> list:
        """megatron-core's schedule over the micro-batches; returns the last stage's outputs."""
        p = self.cfg.parallel
        T, C, m = p.tp, p.cp, len(micro)
        sp = p.sequence_parallel
        # Per-token loss over the whole global batch: each rank returns its token-loss sum
        # times dp * m / global_tokens, because megatron-core's schedule multiplies a
        # (loss, stats) result by the CP size and divides it by the micro-batch count, and
        # DDP averages gradients over the dp * cp ranks. The gradient is then exactly that of
        # sum(token losses) / global_tokens, whatever the layout.
        scale = self.dp * m / max(global_tokens, 1.0)
        # Pipeline stages pass activations at one shape per step: the longest micro-batch's
        # rows (the same on every stage of this replica: the same plan); shorter ones are
        # padded and sliced back, so no shape is exchanged (no host sync per transfer).
        longest = max(mb.tokens.shape[1] for mb in micro)
        stage_rows = longest // (T if sp else 1)

        def forward_step(data, model_chunk):
            # each model chunk reads the micro-batches in order from its own iterator; the
            # tokens matter on the first stage, the labels on the last, the plan everywhere
            mb = next(data)  # already on the device (micro_batches)
            gpt = model_chunk.module
            rows = mb.tokens.shape[1] // (T if sp else 1)  # this micro-batch's hidden rows
            if not gpt.pre_process:  # the previous stage's activations, padded: our rows
                gpt.decoder.input_tensor = gpt.decoder.input_tensor[:rows]
            out = model_chunk(
                mb.tokens,
                mb.position_ids,
                None,
                labels=mb.labels,
                packed_seq_params=mb.packed_seq_params,
            )
            if not gpt.post_process:  # to the next stage at the step's one shape
                out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, stage_rows - rows))

            def loss_fn(per_token):
                # at least fp32 (bf16 logits' losses are summed in fp32); fp64 stays fp64
                per_token = per_token.to(torch.promote_types(per_token.dtype, torch.float32))
                local = (per_token * mb.loss_mask.to(per_token.dtype)).sum()
                return local * scale, {"local_sum": local.detach()}

            return out, loss_fn

        if not forward_only:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.opt.zero_grad()
        iters = [iter(micro) for _ in self.model]
        return self.fb(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.model,
            num_microbatches=m,
            # the schedule divides it by cp (and tp with sequence parallelism)
            seq_length=longest * C,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def evaluate(self, step: int) -> dict:
        """Megatron-LM's validation after iteration `step`: schedule.eval_iters global batches
        of the validation data (the same ones each time), planned by the run's system with a
        planner of their own (the last batch flushes what WLB-LLM holds, so every document of
        them is computed) and run forward only; the per-token loss over all of them."""
        cfg = self.cfg
        n = cfg.schedule.eval_iters
        sampler = StepSampler(cfg, self._new_planner(), replica=self.r, cp_rank=self.c,
                              split="valid", stop_step=n)
        local, tokens = [], 0.0
        for chunk in self.model:
            chunk.eval()
        try:
            with torch.no_grad():
                for _ in range(n):
                    batch = sampler.next()
                    self.phase = "validation: the plan-hash check (group of all ranks, gloo)"
                    check_plan(batch.plan, self.runtime)
                    self.phase = "validation forward (the attention operator's groups)"
                    outs = self.forward_backward(self.micro_batches(batch),
                                                 float(batch.label_tokens), forward_only=True)
                    local += [x["local_sum"] for x in outs]
                    tokens += float(batch.label_tokens)
        finally:
            sampler.close()
            for chunk in self.model:
                chunk.train()
        total = float(torch.stack(local).sum(dtype=torch.float64)) if local else 0.0
        stats = torch.tensor([total], dtype=torch.float64)
        self.phase = "the validation loss all-reduce (group of all ranks, gloo)"
        dist.all_reduce(stats, group=self.runtime.groups.check_group)
        loss = float(stats[0]) / cfg.parallel.tp / max(tokens, 1.0)
        return {"valid_loss": loss, "valid_ppl": math.exp(min(20.0, loss)),
                "valid_tokens": tokens}

    def log_validation(self, rec: dict) -> None:
        """Megatron-LM's validation lines (rank 0) and TensorBoard scalars."""
        if self.rank != 0:
            return
        text = (f" validation loss at iteration {rec['step']} | lm loss value: "
                f"{rec['valid_loss']:.6E} | lm loss PPL: {rec['valid_ppl']:.6E} | ")
        logger.info("-" * (len(text) + 1))
        logger.info(text)
        logger.info("-" * (len(text) + 1))
        if self.tb is not None:
            self.tb.add_scalar("lm loss validation", rec["valid_loss"], rec["step"])
            self.tb.add_scalar("lm loss validation ppl", rec["valid_ppl"], rec["step"])
        if self.wandb is not None:
            self.wandb.log({"lm loss validation": rec["valid_loss"],
                            "lm loss validation ppl": rec["valid_ppl"]}, step=rec["step"])

    def train_step(self, step: int, stop: "_StopRequest") -> tuple[dict, object, bool]:
        """One optimizer step: (metrics record, the step's batch, whether a rank asked to
        stop)."""
        t0 = time.perf_counter()
        batch = self.sampler.next()
        plan = batch.plan
        LAST_COLLECTIVE[0] = None
        self.phase = "the plan-hash check (group of all ranks, gloo)"
        check_plan(plan, self.runtime)
        micro = self.micro_batches(batch)
        global_tokens = float(batch.label_tokens)
        self.runtime.counter.reset()
        self.timer.reset()
        if self.costs.kernel_timer is not None:
            self.costs.kernel_timer.reset()
        if self.cfg.moe.balancer == "libra":
            moe_layer.STATS.reset()
        self.phase = (
            "forward/backward (the attention operator's CP and pool groups, megatron-core's "
            "tensor/pipeline groups, then the gradient reduction over the data-parallel group)"
        )
        outs = self.forward_backward(micro, global_tokens)
        self.phase = "the optimizer step (megatron-core's grad-norm and parameter collectives)"
        updated, grad_norm, _ = self.opt.step()
        self.sched.step(1)
        # the step's loss sum, summed on the device and read once (one sync per step, not one
        # per micro-batch)
        local = 0.0
        if outs:
            local = float(torch.stack([x["local_sum"] for x in outs]).sum(dtype=torch.float64))
        self.phase = "the step statistics' all-gather (group of all ranks, gloo)"
        kernel = self.costs.kernel_timer.seconds() if self.costs.kernel_timer else 0.0
        stats = StepStats.gather(self.runtime, self.timer.seconds() if self.timer.enabled
                                 else 0.0, loss_sum=local, stop=stop.requested,
                                 attn_predicted=self.costs.predicted(batch.cost_table,
                                                                     batch.features),
                                 kernel_seconds=kernel)
        self.phase = "the cost model's fit (all-gather of the ranks' rows, gloo)"
        self.costs.step_end(step, batch.features, kernel)
        dt = time.perf_counter() - t0
        T = self.cfg.parallel.tp
        # every tensor-parallel rank holds the same loss sum: count it once
        rec = stats.record(step + 1, plan, dt, self.timer.enabled, T,
                           loss_sum=float(stats.column("loss_sum").sum()) / T,
                           tokens=global_tokens)
        rec.update({
            "lr": self.opt.param_groups[0]["lr"],
            "grad_norm": float(grad_norm or 0.0),
            "skipped": not updated,
            # model FLOPs of the step (forward + backward), per GPU per second
            "tflops_per_gpu": step_flops(self.cfg.model, global_tokens, plan, T)
            / self.world / dt / 1e12,
        })
        if self.cfg.moe.balancer == "libra":
            rec.update(self._moe_stats(step + 1))
        return rec, batch, stats.stop_requested

    def _moe_stats(self, step: int) -> dict:
        """The balanced MoE layers' expert-token balance of the step (this rank's EP group; the
        means over micro-batches per layer and over layers), and the routing record."""
        per = moe_layer.STATS.summary()
        out = {"moe_layers": per}
        for key in ("expert_tokens_max_over_mean_before", "expert_tokens_max_over_mean_after",
                    "lookahead_topk_overlap", "lookahead_load_error"):
            if key in per:
                out[key] = sum(per[key].values()) / len(per[key])
        lg = self.cfg.logging
        routing = moe_layer.STATS.routing
        if lg.record_routing and self.rank == 0 and routing:
            layers = sorted(routing)
            m = self.cfg.model
            Path(lg.routing_dir).mkdir(parents=True, exist_ok=True)
            moe_plan.save_routing(
                Path(lg.routing_dir) / f"routing_step{step}.npz",
                [routing[k][0] for k in layers], [routing[k][1] for k in layers],
                experts=m.experts, ep=self.cfg.parallel.ep, hidden=m.hidden, moe_ffn=m.moe_ffn,
                source_sizes=routing[layers[0]][2],
            )
        return out

    def log(self, rec: dict) -> None:
        """Megatron's iteration line every log_interval steps, the metrics file, TensorBoard."""
        self.history.append(rec)
        if self.rank != 0:
            return
        cfg, step = self.cfg, rec["step"]
        if step % cfg.logging.log_interval == 0:
            window = self.history[-cfg.logging.log_interval :]
            logger.info(log_line(window, cfg.schedule.train_steps, cfg.data.gbs, self.world))
        if self.log_file:
            self.log_file.write(json.dumps(rec) + "\n")
            self.log_file.flush()
        scalars = {k: rec[k] for k in SCALARS if rec.get(k) is not None}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def maybe_save(self, step: int, batch, last: bool, stopping: bool) -> None:
        """A checkpoint at the save interval, at the end, or when a rank asked to stop."""
        if self.saver is None:
            return
        self.saver.poll()
        every = self.cfg.checkpoint.save_interval
        if last or stopping or (every and step % every == 0):
            self.saver.save(step, self.chunks, self.opt, self.sched, batch,
                            cost_model=self.costs.state_dict())

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg, rank = self.cfg, self.rank
        stop = _StopRequest(cfg.checkpoint.save_on_signal)
        settle_heap()
        try:
            every = cfg.schedule.eval_interval
            for step in range(self.start, cfg.schedule.train_steps):
                rec, batch, stopping = self.train_step(step, stop)
                last = step + 1 == cfg.schedule.train_steps
                if every and ((step + 1) % every == 0 or last):
                    rec.update(self.evaluate(step + 1))
                self.log(rec)
                if "valid_loss" in rec:
                    self.log_validation(rec)
                first, final = batch.epochs
                if final > first and rank == 0:
                    logger.info("libra train: epoch %d of the training data ended during "
                                "iteration %d; epoch %d reads its documents in a new order",
                                first + 1, step + 1, final + 1)
                self.maybe_save(step + 1, batch, last, stopping)
                if stopping and not last:
                    if rank == 0:
                        logger.info("libra train: stopping after iteration %d on a signal%s",
                                    step + 1, " (checkpoint saved)" if self.saver else "")
                    break
            if self.saver is not None:
                self.saver.close()
            self._summary()
        except RuntimeError as e:
            if _timed_out(e):
                raise RuntimeError(
                    f"rank {rank}: a collective did not complete within "
                    f"parallel.timeout_minutes = {cfg.parallel.timeout_minutes} during "
                    f"{self.where()} (another rank stopped or hangs): "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                ) from e
            raise
        finally:
            stop.restore()
            self.close()
        return self.history

    def where(self) -> str:
        """The phase of the step this rank is in, and the group of the attention operator's last
        collective in it (for a timeout's message)."""
        text = getattr(self, "phase", "start-up")
        if LAST_COLLECTIVE[0] is not None and text.startswith("forward"):
            kind, group = LAST_COLLECTIVE[0]
            text += (
                f"; the attention operator's last collective: {kind} on the "
                f"{self.runtime.groups.label(group)}"
            )
        return text

    def _summary(self) -> None:
        if self.rank != 0 or not self.history:
            return
        done = self.history  # the steps this run trained
        secs = sum(h["step_time"] for h in done)
        logger.info(
            "libra train: done: %d step(s) in %.1f s, %.1f tokens/s, final lm loss %.6E, "
            "attn work max/mean %.3f (mean over steps)",
            len(done), secs, sum(h["tokens"] for h in done) / max(secs, 1e-12),
            done[-1]["loss"],
            sum(h["attn_work_max_over_mean"] for h in done) / max(len(done), 1),
        )

    def close(self) -> None:
        self.costs.close()
        self.sampler.close()
        if self.log_file:
            self.log_file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        # megatron-core's parallel state is process-global: release it so that another run can
        # follow in this process (`libra ab` under torchrun trains every system in turn)
        ps.destroy_model_parallel()


SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time", "attn_work_max_over_mean",
           "attn_time_max_over_mean", "inter_pool_imbalance", "bytes_exchanged",
           "pool_mb_per_rank", "cp_mb_per_rank", "plan_ms", "attn_time_predicted_max_over_mean",
           "attn_kernel_time_max_over_mean", "cost_model_error")
"""The step record's keys written as TensorBoard scalars and W&B metrics (rank 0)."""


class _StopRequest:
    """With checkpoint.save_on_signal, SIGTERM or SIGINT asks the run to save a checkpoint after
    the current iteration and stop (as Megatron-LM's --exit-signal-handler); every rank learns
    of it through the step statistics' all-reduce. Without it, the signals keep their default
    (the process ends at once)."""

    def __init__(self, enabled: bool):
        self.requested = False
        self._previous = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _dispatchers(chunk):
    """The token dispatchers of a model chunk's MoE layers."""
    return [m.token_dispatcher for m in chunk.modules() if hasattr(m, "token_dispatcher")]


def _timed_out(e: BaseException) -> bool:
    """Whether a communication error is a collective's timeout (gloo and NCCL word it so)."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


