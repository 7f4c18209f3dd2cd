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
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from libra_ext import hostmem
from megatron.libra.config import TrainConfig
from megatron.libra.notices import quiet_megatron_notices

logger = logging.getLogger("libra.train")


# megatron-core's notices that hold on every CPU run and say nothing a user can act on: filtered
# once, deliberately, in each training process (every other warning still shows).
LAUNCH_ENV = "LIBRA_LAUNCH_TIME"
"""Set by the local launcher (`--nproc`): when it started, so workers can say how long
start-up took."""


PROGRESS_ENV = "LIBRA_PROGRESS_STREAM"
"""stderr: the run's lines go to stderr (set by `libra ab --json`, whose stdout is the JSON)."""


def progress_stream():
    """Where the run's lines go: stdout, as Megatron-LM prints them, unless PROGRESS_ENV says
    stderr."""
    return sys.stderr if os.environ.get(PROGRESS_ENV) == "stderr" else sys.stdout


def _since_launch() -> str:
    """'N.N s after launch' (the local launcher's start, else this process's)."""
    start = os.environ.get(LAUNCH_ENV)
    if start is None:
        try:
            import psutil

            start = psutil.Process().create_time()
        except Exception:  # no psutil: say nothing about when
            return ""
    return f"{time.time() - float(start):.1f} s after launch"


def config_lines(cfg: TrainConfig) -> list[str]:
    """The resolved config one key per line, as Megatron-LM prints its arguments."""
    flat = {}
    for section, value in cfg.to_dict().items():
        if isinstance(value, dict):
            flat.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            flat[section] = value
    lines = ["------------------------ libra train: config ------------------------"]
    for key in sorted(flat):
        lines.append(f"  {key} {'.' * max(48 - len(key), 2)} {json.dumps(flat[key])}")
    lines.append("-------------------- libra train: end of config --------------------")
    return lines


def _progress_log() -> None:
    """Iteration lines on stdout as Megatron prints them (message only), under torchrun, Slurm
    or `--nproc` alike; errors stay on stderr; `libra --log-level` still governs everything
    else."""
    if not any(getattr(h, "_libra_progress", False) for h in logger.handlers):
        handler = logging.StreamHandler(progress_stream())
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._libra_progress = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _init_distributed(
    rank: int | None, world: int | None, init_method: str | None, timeout_minutes: float
) -> tuple:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if rank is None:  # torchrun / Slurm environment, or a single process
            rank = int(os.environ.get("RANK", 0))
            world = int(os.environ.get("WORLD_SIZE", 1))
            if world == 1 and "MASTER_ADDR" not in os.environ:
                from libra_ext.attention.verify import free_port

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


def _megatron():
    """megatron-core's training pieces (imported once the shims hold, its notices quiet)."""
    with warnings.catch_warnings():
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
    return dict(
        ps=ps, tensor_parallel=tensor_parallel, DistributedDataParallel=DistributedDataParallel,
        DistributedDataParallelConfig=DistributedDataParallelConfig,
        finalize_model_grads=finalize_model_grads, OptimizerConfig=OptimizerConfig,
        get_megatron_optimizer=get_megatron_optimizer,
        OptimizerParamScheduler=OptimizerParamScheduler,
        get_forward_backward_func=get_forward_backward_func,
    )


class Trainer:
    """One training run in small steps: `__init__` builds (process groups, runtime, model
    chunks, DDP, optimizer, schedule, planner, resume, data, checkpointer, log sinks);
    `train()` runs `train_step` / `log` / `maybe_save` for every step and closes."""

    def __init__(self, cfg: TrainConfig, rank=None, world=None, init_method=None):
        quiet_megatron_notices()
        self.rank, self.world = _init_distributed(
            rank, world, init_method, cfg.parallel.timeout_minutes
        )
        _progress_log()
        self.cfg = cfg
        self.dp = cfg.validate(self.world)
        if not torch.cuda.is_available():
            from megatron.libra import cpu_shims

            cpu_shims.apply()
            hostmem.retain_freed_memory()  # attention pieces reuse freed host memory
        self.mc = _megatron()
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
                        dist.get_backend(), _since_launch())
        self._build_parallel()
        t0 = time.perf_counter()
        self._build_model()
        self._build_optimizer()
        built = time.perf_counter() - t0
        self._build_data()
        self._open_sinks()
        if self.rank == 0:
            logger.info("libra train: model and optimizer built in %.1f s; training starts %s",
                        built, _since_launch())

    # ------------------------------------------------------------------ build
    def _build_parallel(self) -> None:
        from libra_ext.attention.comm import GroupCache
        from libra_ext.attention.core import Runtime

        cfg, p = self.cfg, self.cfg.parallel
        self.mc["ps"].initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
            context_parallel_size=p.cp,
            expert_model_parallel_size=p.ep,
            distributed_timeout_minutes=p.timeout_minutes,
            order="tp-cp-ep-dp-pp",
        )
        self.mc["tensor_parallel"].model_parallel_cuda_manual_seed(cfg.data.seed)
        self.runtime = Runtime(
            groups=GroupCache(
                tp=p.tp, cp=p.cp, dp=self.dp, timeout_s=p.timeout_minutes * 60, pp=p.pp,
                # the operator's Ulysses all-to-all runs on megatron-core's own CP group
                cp_group=self.mc["ps"].get_context_parallel_group(),
            ),
            chunks=cfg.system.chunks,
            pipelined=cfg.system.pipeline,
            backend=None
            if cfg.system.attention_backend == "auto"
            else cfg.system.attention_backend,
        )
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
        from megatron.libra.model import build_model_chunks

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
        from megatron.libra.moe_layer import PaddedAllGatherDispatcher

        self._moe_all_gather = any(isinstance(m, PaddedAllGatherDispatcher)
                                   for chunk in self.chunks for m in _dispatchers(chunk))
        self.timer = AttentionTimer(self.chunks, cfg.logging.attention_time)
        if self.rank == 0:
            n_params = sum(x.numel() for chunk in self.chunks for x in chunk.parameters())
            shard = f" (a 1/{p.tp} tensor-parallel shard)" if p.tp > 1 else ""
            if p.pp > 1:
                shard += f" (pipeline stage 0 of {p.pp})"
            logger.info("libra train: %s parameters on this rank%s", f"{n_params:,}", shard)
            from libra_ext.attention.kernels import KernelParams, choose_backend

            name, why = choose_backend(
                KernelParams(self.device.type, self.dtype, cfg.model.head_dim,
                             self.runtime.backend)
            )
            logger.info("libra train: attention backend: %s%s", name, f" ({why})" if why else "")

    def _build_optimizer(self) -> None:
        mc, o, s = self.mc, self.cfg.optimizer, self.cfg.schedule
        ddp_config = mc["DistributedDataParallelConfig"](
            # bf16 runs keep fp32 gradient buffers (Megatron's accumulate-allreduce-grads-in-fp32)
            grad_reduce_in_fp32=self.dtype == torch.bfloat16,
            use_distributed_optimizer=o.distributed,
            overlap_grad_reduce=o.overlap_grad_reduce,
            overlap_param_gather=o.overlap_param_gather,
        )
        self.model = [
            mc["DistributedDataParallel"](
                chunk.config, ddp_config, chunk,
                # as Megatron-LM: only the first chunk's buffers use buckets
                disable_bucketing=i > 0,
            )
            for i, chunk in enumerate(self.chunks)
        ]
        model = self.model
        config = self.chunks[0].config
        config.finalize_model_grads_func = mc["finalize_model_grads"]

        def per_chunk(name):
            return [getattr(m, name) for m in model] if len(model) > 1 else getattr(model[0], name)

        if o.overlap_grad_reduce:  # the schedule starts each chunk's reduction as grads are done
            config.no_sync_func = per_chunk("no_sync")
            config.grad_sync_func = per_chunk("start_grad_sync")
        self.opt = mc["get_megatron_optimizer"](
            mc["OptimizerConfig"](
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
        self.sched = mc["OptimizerParamScheduler"](
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
        self.fb = mc["get_forward_backward_func"]()

    def _new_planner(self):
        return new_planner(self.cfg, self.dp, torch.tensor([], dtype=self.dtype).element_size())

    def _build_data(self) -> None:
        from megatron.libra import checkpoint
        from megatron.libra.data import StepSampler, describe_data

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
            if self.rank == 0:
                what = "loaded the weights of" if src.finetune else "resumed from"
                logger.info("%s %s at step %d", what, src.path, self.start)
        if self.rank == 0:
            for line in describe_data(cfg):
                logger.info("libra train: %s", line)
        self.sampler = StepSampler(
            cfg, planner, replica=self.r, start_step=self.start, doc_base=doc_base,
            recent_bases=recent, cp_rank=self.c,
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
        self.log_file, self.tb = None, None
        if self.rank == 0 and cfg.logging.tensorboard_dir:
            try:
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
        from libra_ext.attention import thd
        from megatron.libra.moe_layer import set_step_rows

        plan, C = batch.plan, self.cfg.parallel.cp
        if self._moe_all_gather:
            # every EP rank pads its tokens to the step's longest micro-batch for the MoE
            # layers' all-gather (no layer exchanges or reads token counts)
            p = self.cfg.parallel
            rows = int(thd.local_tokens(plan.doc_lengths, plan.seq_doc_offsets, C).max())
            set_step_rows(-(-rows // p.tp) if p.sequence_parallel else rows)
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
        from libra_ext.attention.core import check_plan_hash
        from megatron.libra.data import StepSampler

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
                    check_plan_hash(batch.plan, group=self.runtime.groups.check_group)
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

    def train_step(self, step: int, stop: "_StopRequest") -> tuple[dict, object, bool]:
        """One optimizer step: (metrics record, the step's batch, whether a rank asked to
        stop)."""
        from libra_ext.attention.comm import LAST_COLLECTIVE
        from libra_ext.attention.core import check_plan_hash

        t0 = time.perf_counter()
        batch = self.sampler.next()
        plan = batch.plan
        LAST_COLLECTIVE[0] = None
        self.phase = "the plan-hash check (group of all ranks, gloo)"
        check_plan_hash(plan, group=self.runtime.groups.check_group)
        micro = self.micro_batches(batch)
        global_tokens = float(batch.label_tokens)
        self.runtime.counter.reset()
        self.timer.reset()
        if self.cfg.moe.balancer == "libra":
            from megatron.libra.moe_layer import STATS

            STATS.reset()
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
        # step statistics over host tensors on the gloo group (no device sync under NCCL)
        group = self.runtime.groups.check_group
        self.phase = "the step statistics' all-reduce (group of all ranks, gloo)"
        stats = torch.tensor(
            [local, float(self.runtime.counter.total()), float(stop.requested)],
            dtype=torch.float64,
        )
        dist.all_reduce(stats, group=group)
        attn_t = None
        if self.timer.enabled:
            attn = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
            dist.all_gather(
                attn, torch.tensor([self.timer.seconds()], dtype=torch.float64), group=group
            )
            attn_t = torch.cat(attn)
        dt = time.perf_counter() - t0
        T = self.cfg.parallel.tp
        rec = {
            "step": step + 1,
            # every tensor-parallel rank holds the same loss sum: count it once
            "loss": float(stats[0]) / T / max(global_tokens, 1.0),
            "lr": self.opt.param_groups[0]["lr"],
            "grad_norm": float(grad_norm or 0.0),
            "tokens": global_tokens,
            "step_time": dt,
            "tokens_per_s": global_tokens / dt,
            "attn_work_max_over_mean": plan.max_over_mean,
            "inter_pool_imbalance": plan.inter_pool_imbalance,
            "attn_time_max_over_mean": (
                float(attn_t.max() / max(attn_t.mean(), 1e-12)) if attn_t is not None else None
            ),
            "attn_time_per_rank": attn_t.tolist() if attn_t is not None else None,
            "bytes_exchanged": float(stats[1]),
            "skipped": not updated,
            # model FLOPs of the step (forward + backward), per GPU per second
            "tflops_per_gpu": step_flops(self.cfg.model, global_tokens, plan, T)
            / self.world / dt / 1e12,
        }
        if self.cfg.moe.balancer == "libra":
            rec.update(self._moe_stats(step + 1))
        return rec, batch, bool(stats[2] > 0)

    def _moe_stats(self, step: int) -> dict:
        """The balanced MoE layers' expert-token balance of the step (this rank's EP group; the
        means over micro-batches per layer and over layers), and the routing record."""
        from libra_ext import moe as moe_plan
        from megatron.libra.moe_layer import STATS

        per = STATS.summary()
        out = {"moe_layers": per}
        for key in ("expert_tokens_max_over_mean_before", "expert_tokens_max_over_mean_after",
                    "lookahead_topk_overlap", "lookahead_load_error"):
            if key in per:
                out[key] = sum(per[key].values()) / len(per[key])
        lg = self.cfg.logging
        if lg.record_routing and self.rank == 0 and STATS.routing:
            layers = sorted(STATS.routing)
            m = self.cfg.model
            Path(lg.routing_dir).mkdir(parents=True, exist_ok=True)
            moe_plan.save_routing(
                Path(lg.routing_dir) / f"routing_step{step}.npz",
                [STATS.routing[k][0] for k in layers], [STATS.routing[k][1] for k in layers],
                experts=m.experts, ep=self.cfg.parallel.ep, hidden=m.hidden, moe_ffn=m.moe_ffn,
                source_sizes=STATS.routing[layers[0]][2],
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
            logger.info(_log_line(window, cfg.schedule.train_steps, cfg.data.gbs, self.world))
        if self.log_file:
            self.log_file.write(json.dumps(rec) + "\n")
            self.log_file.flush()
        if self.tb is not None:
            for key in (
                "loss",
                "lr",
                "grad_norm",
                "tokens_per_s",
                "step_time",
                "attn_work_max_over_mean",
                "attn_time_max_over_mean",
                "inter_pool_imbalance",
                "bytes_exchanged",
            ):
                if rec[key] is not None:
                    self.tb.add_scalar(key, rec[key], step)

    def maybe_save(self, step: int, batch, last: bool, stopping: bool) -> None:
        """A checkpoint at the save interval, at the end, or when a rank asked to stop."""
        if self.saver is None:
            return
        self.saver.poll()
        every = self.cfg.checkpoint.save_interval
        if last or stopping or (every and step % every == 0):
            self.saver.save(step, self.chunks, self.opt, self.sched, batch)

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg, rank = self.cfg, self.rank
        stop = _StopRequest(cfg.checkpoint.save_on_signal)
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
        from libra_ext.attention.comm import LAST_COLLECTIVE

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
        self.sampler.close()
        if self.log_file:
            self.log_file.close()
        if self.tb is not None:
            self.tb.close()
        # megatron-core's parallel state is process-global: release it so that another run can
        # follow in this process (`libra ab` under torchrun trains every system in turn)
        self.mc["ps"].destroy_model_parallel()


def new_planner(cfg: TrainConfig, dp: int, dtype_bytes: int):
    """The step planner of `cfg`'s layout, model and system at data-parallel size dp."""
    from libra_ext.planner import LayoutConfig, Planner

    p = cfg.parallel
    return Planner(
        LayoutConfig(dp=dp, cp=p.cp, tp=p.tp, pool_size=p.pool_size, context=cfg.data.context),
        cfg.model,
        cfg.system.planner_options(cfg.data.order, dtype_bytes),
    )


def device_micro_batches(batch, runtime, device, cp: int, cp_rank: int, replica: int) -> list:
    """Micro-batches of rank (replica, cp_rank) for a sampled step, in the order the schedule
    runs them, on `device`: every slot's attention metadata and the micro-batch's tokens,
    labels, positions and loss mask, each one non-blocking copy from the pinned buffers the
    sampler's thread staged."""
    from megatron.libra.batch import make_micro_batch

    plan = batch.plan
    on_device = None
    if batch.uploads and device.type != "cpu":  # one copy per slot
        on_device = [joint.to(device, non_blocking=True) for joint, _ in batch.uploads]
    steps = runtime.prepare(
        plan, device, batch.programs,
        [buf[:n] for buf, (_, n) in zip(on_device, batch.uploads)] if on_device else None,
    )
    micro = []
    for slot in batch.slot_order:
        mb = batch.micro.get(slot) if batch.micro else None
        if mb is None:  # not staged ahead (a sampler without this rank's cp index)
            seq = plan.sequence_at(replica, slot)
            docs = range(plan.seq_doc_offsets[seq], plan.seq_doc_offsets[seq + 1])
            mb = make_micro_batch([batch.pieces[i] for i in docs], cp, cp_rank, None)
        buf = on_device[slot][batch.uploads[slot][1]:] if on_device else None
        mb = mb.to(device, buf)
        mb.packed_seq_params.libra = steps[slot]
        micro.append(mb)
    return micro


class _StopRequest:
    """With checkpoint.save_on_signal, SIGTERM or SIGINT asks the run to save a checkpoint after
    the current iteration and stop (as Megatron-LM's --exit-signal-handler); every rank learns
    of it through the step statistics' all-reduce. Without it, the signals keep their default
    (the process ends at once)."""

    def __init__(self, enabled: bool):
        import signal

        self.requested = False
        self._previous = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.requested = True

    def restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _dispatchers(chunk):
    """The token dispatchers of a model chunk's MoE layers."""
    return [m.token_dispatcher for m in chunk.modules() if hasattr(m, "token_dispatcher")]


def _timed_out(e: BaseException) -> bool:
    """Whether a communication error is a collective's timeout (gloo and NCCL word it so)."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def step_flops(model, tokens: float, plan, tp: int) -> float:
    """Forward + backward FLOPs of one step from the cost model: the linear layers and LM head
    per token, and the attention pairs the plan executes (every layer, every head)."""
    from libra_ext.workload import LINEAR_BWD_FACTOR, linear_fwd_flops_per_token

    linear = linear_fwd_flops_per_token(model) * model.layers + 2.0 * model.hidden * model.vocab
    # rank_load: one layer's attention FLOPs (forward + backward) of each rank's head slice
    attention = float(plan.rank_load.sum()) * tp * model.layers
    return linear * tokens * (1.0 + LINEAR_BWD_FACTOR) + attention


def _log_line(window: list, total: int, gbs: int, world: int) -> str:
    """Megatron-LM's iteration line (averages over the log interval) and Libra's fields."""
    import datetime as _dt

    rec, n = window[-1], len(window)
    loss = sum(w["loss"] for w in window) / n
    attn = [w["attn_time_max_over_mean"] for w in window if w["attn_time_max_over_mean"]]
    nan = sum(1 for w in window if w["loss"] != w["loss"])
    return (
        f" [{_dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {rec['step']:8d}/"
        f"{total:8d} | consumed samples: {rec['step'] * gbs:12d} | elapsed time per iteration "
        f"(ms): {1e3 * sum(w['step_time'] for w in window) / n:.1f} | throughput per GPU "
        f"(TFLOP/s/GPU): {sum(w['tflops_per_gpu'] for w in window) / n:.3f} | learning rate: "
        f"{rec['lr']:.6E} | global batch size: {gbs:5d} | lm loss: {loss:.6E} | grad norm: "
        f"{rec['grad_norm']:.3f} | number of skipped iterations: "
        f"{sum(1 for w in window if w['skipped']):3d} | number of nan iterations: {nan:3d} | "
        f"attn work max/mean: {sum(w['attn_work_max_over_mean'] for w in window) / n:.3f} | "
        f"attn time max/mean: {f'{sum(attn) / len(attn):.3f}' if attn else 'off'} | "
        f"inter-pool imbalance: {rec['inter_pool_imbalance']:.3f} | "
        f"exchange MB/rank: {sum(w['bytes_exchanged'] for w in window) / n / world / 1e6:.2f} | "
        f"tokens/s: {sum(w['tokens'] for w in window) / sum(w['step_time'] for w in window):.1f} |"
    )


class AttentionTimer:
    """Each rank's core-attention time of a step, forward and backward (module hooks: from a
    layer's inputs arriving to its output leaving, and from its output gradient arriving to its
    input gradients leaving). On GPU the hooks record CUDA events (no synchronization); the
    events are read once per step, after the optimizer step. Disabled: no hooks at all."""

    def __init__(self, model, enabled: bool = True):
        from libra_ext.attention.core import LibraCoreAttention

        self.enabled, self.cuda = enabled, torch.cuda.is_available()
        self._open: dict = {}
        self._pairs: list = []
        self._host = 0.0
        if not enabled:
            return
        chunks = model if isinstance(model, (list, tuple)) else [model]
        for mod in (x for chunk in chunks for x in chunk.modules()):
            if isinstance(mod, LibraCoreAttention):
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
