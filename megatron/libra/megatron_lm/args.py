"""Libra's arguments in Megatron-LM's parser (`add_libra_args`, derived from the `system`
section's declaration), the `libra train` config they stand for (`train_config`), every refusal
knowable from them before any process group (`check_args`: one line naming the argument), and
the settings a resume must keep (`libra_settings`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import torch

from libra_ext.attention.kernels import HAVE_TE
from libra_ext.workload import read_lengths_file
from megatron.libra.config import (
    DataConfig,
    ParallelConfig,
    ScheduleConfig,
    SystemConfig,
    TrainConfig,
    TrainModelConfig,
    field_names,
)
from megatron.libra.flags import add_fields, values

DATA_CHOICES = ("megatron", "synthetic")
"""--libra-data: Megatron's GPTDataset, or Libra's synthetic long-tail documents."""

SYSTEM_CHOICES = ("libra", "ulysses", "wlb", "distca", "megatron-hybrid")
"""--libra-system: the planner's systems, or megatron-core's own hybrid CP scheduler as a peer
(Libra off: Megatron-LM's --hybrid-context-parallel path)."""

_FIELD_ARGS = {"name": "--libra-system"}
"""SystemConfig field -> argument, where the argument is not --libra-<field>."""

ARG_NAMES = {
    "parallel.pool_size": "--libra-pool-size",
    "parallel.tp": "--tensor-model-parallel-size",
    "parallel.cp": "--context-parallel-size",
    "parallel.pp": "--pipeline-model-parallel-size",
    "parallel.vpp": "--num-layers-per-virtual-pipeline-stage",
    "parallel.ep": "--expert-model-parallel-size",
    "parallel.sequence_parallel": "--sequence-parallel",
    "model.heads": "--num-attention-heads",
    "model.layers": "--num-layers",
    "model.experts": "--num-experts",
    "model.moe_topk": "--moe-router-topk",
    "data.gbs": "--global-batch-size",
    "data.context": "--seq-length",
    "data.seed": "--seed",
    "data.workload": "--libra-workload",
    "data.lengths_file": "--libra-lengths-file",
    "schedule.train_steps": "--train-iters",
}
"""A `libra train` config field -> the Megatron-LM argument it comes from (for error lines)."""


def _arg(field: str) -> str:
    return _FIELD_ARGS.get(field, "--libra-" + field.replace("_", "-"))


def _dest(field: str) -> str:
    return _arg(field)[2:].replace("-", "_")


def add_libra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's extra_args_provider: the Libra argument group (one argument per field of a
    `libra train` config's `system` section - `SystemConfig`, whose planner knobs are declared
    once in `PlannerKnobs` - and the pool size, the documents' source and the metrics file),
    and the defaults Libra needs."""
    group = parser.add_argument_group(
        title="Libra", description="attention-straggler removal (a `libra train` config's "
        "system section; docs/config_reference.md)")
    add_fields(group, SystemConfig, _arg, _dest, choices={"name": SYSTEM_CHOICES},
               help_text={"name": "libra | ulysses | wlb | distca, or megatron-hybrid: "
                          "megatron-core's own hybrid CP scheduler (a GPU with Transformer "
                          "Engine)."})
    group.add_argument("--libra-pool-size", dest="libra_pool_size", type=int, default=1,
                       help="Replicas per Libra pool; must divide the data-parallel size.")
    group.add_argument("--libra-data", dest="libra_data", choices=DATA_CHOICES,
                       default="megatron",
                       help="Where each step's documents come from: megatron (Megatron's own "
                       "GPTDataset of --data-path, or --mock-data) or synthetic (Libra's "
                       "long-tail document lengths, --libra-workload or --libra-lengths-file, "
                       "with token ids a function of --seed and the document; the stream "
                       "`libra train` reads with data.source synthetic).")
    group.add_argument("--libra-workload", dest="libra_workload", default="libra-256k",
                       help="--libra-data synthetic: the document-length preset "
                       "(`libra plan --help` lists them).")
    group.add_argument("--libra-lengths-file", dest="libra_lengths_file", default=None,
                       help="--libra-data synthetic: draw document lengths from this file (one "
                       "positive integer per line) instead of a preset.")
    group.add_argument("--libra-metrics-file", dest="libra_metrics_file", default=None,
                       help="Write one JSON line per iteration here (rank 0): the loss over "
                       "the global batch's tokens, tokens/s, attention work and measured "
                       "attention time per rank, bytes sent; what `libra ab --trainer megatron` "
                       "reads.")
    group.add_argument("--no-libra-attention-time", dest="libra_attention_time",
                       action="store_false", default=True,
                       help="Do not measure each rank's core-attention time (forward and "
                       "backward; CUDA events on a GPU, read once per log interval) for "
                       "Libra's log line.")
    parser.set_defaults(dataloader_type="external", cp_comm_type=["a2a"],
                        calculate_per_token_loss=True, eval_iters=0)
    escape_help(parser)
    _check_when_parsed(parser)
    return parser


def escape_help(parser: argparse.ArgumentParser) -> None:
    """A literal % in an argument's help (megatron-core 0.19.2 has "10%)" in one) breaks
    argparse's --help, which %-formats every help string: escape the ones that are not a
    %(name)s field."""
    for a in parser._actions:
        if a.help and "%" in a.help:
            a.help = re.sub(r"%%|%\(\w+\)[a-z]|%",
                            lambda m: m.group(0) if len(m.group(0)) > 1 else "%%", a.help)


def _check_when_parsed(parser: argparse.ArgumentParser) -> None:
    """Run `precheck_args` as soon as the command line is parsed, before Megatron-LM's own
    validation (whose checks of the same arguments, and its argument dump, would come first)."""
    for name in ("parse_args", "parse_known_args"):
        original = getattr(parser, name)

        def parse(*a, _original=original, _name=name, **kw):
            out = _original(*a, **kw)
            precheck_args(out[0] if _name == "parse_known_args" else out)
            return out

        setattr(parser, name, parse)


def on_gpu() -> bool:
    """Whether this process runs on a GPU (the refusals of GPU-only arguments ask only this;
    tests that read the paper's GPU configs on the CPU stand in for a GPU here)."""
    return torch.cuda.is_available()


def precheck_args(args) -> None:
    """The refusals that need only the parsed command line: combinations of Megatron-LM's
    arguments that Libra's operator replaces or that its micro-batches rule out. Raises
    ValueError with one line naming the argument. Arguments a parser lacks keep Megatron-LM's
    defaults."""
    if args.libra_system == "megatron-hybrid":
        if not on_gpu():
            raise ValueError(
                "--libra-system megatron-hybrid runs megatron-core's hybrid CP scheduler, which "
                "needs a GPU with Transformer Engine (its THD attention with per-sequence CP "
                "groups); run it on a GPU or choose libra, ulysses, wlb or distca")
        return
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError(
            f"--hybrid-context-parallel is megatron-core's own CP scheduler; use it with "
            f"--libra-system megatron-hybrid, not {args.libra_system}")
    cp_comm = getattr(args, "cp_comm_type", "a2a")
    cp_comm = cp_comm if isinstance(cp_comm, list) else [cp_comm]
    if getattr(args, "context_parallel_size", 1) > 1 and any(c != "a2a" for c in cp_comm):
        raise ValueError(
            f"--cp-comm-type {' '.join(map(str, cp_comm))}: with --libra-system "
            f"{args.libra_system} Libra's operator is the core attention and runs its own CP "
            "(Ulysses all-to-all inside the CP group); leave --cp-comm-type at a2a")
    if getattr(args, "micro_batch_size", 1) != 1:
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size}: Libra's micro-batch is one packed "
            "sequence in THD layout (--micro-batch-size 1; the global batch size sets the "
            "sequences per step)")
    if getattr(args, "dataloader_type", "external") != "external":
        raise ValueError(
            f"--dataloader-type {args.dataloader_type}: Libra serves each rank the samples its "
            "replica executes under the step plan (leave --dataloader-type at external)")
    if getattr(args, "rampup_batch_size", None):
        raise ValueError(
            f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: Libra plans "
            "every step's global batch of --global-batch-size sequences; leave it off")
    if getattr(args, "sequence_parallel", False) and (
            getattr(args, "transformer_impl", "local") == "local" or not HAVE_TE):
        raise ValueError(
            "--sequence-parallel needs Transformer Engine layers (megatron-core's local layer "
            "norm does not split the sequence): use it on a GPU with Transformer Engine "
            "(--transformer-impl transformer_engine), or leave it off")
    if getattr(args, "use_distributed_optimizer", False) and not on_gpu():
        raise ValueError(
            "--use-distributed-optimizer needs a GPU: megatron-core's distributed optimizer "
            "takes CUDA tensors only; leave it off on the CPU (on a GPU it runs as usual)")


def system_config(args) -> SystemConfig:
    """The `system` section the --libra-* arguments stand for."""
    return SystemConfig(**values(args, SystemConfig, _dest))


_CONFIGS: dict = {}


def train_config(args) -> TrainConfig:
    """A `libra train` config of the same layout, model, data stream and system as Megatron-LM's
    arguments: what the planner, the sampler and the checks read (made once per arguments
    object)."""
    key = id(args)
    if key not in _CONFIGS or _CONFIGS[key][0] is not args:
        _CONFIGS[key] = (args, _train_config(args))
    return _CONFIGS[key][1]


def _train_config(args) -> TrainConfig:
    heads = args.num_attention_heads
    kv = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    experts = getattr(args, "num_experts", None) or 1
    topk = getattr(args, "moe_router_topk", 0) if experts > 1 else 0
    head_dim = args.kv_channels or args.hidden_size // heads
    model = TrainModelConfig(
        hidden=args.hidden_size, heads=heads, kv_heads=kv, head_dim=head_dim,
        ffn=args.ffn_hidden_size or 4 * args.hidden_size, layers=args.num_layers,
        moe_topk=topk, moe_ffn=getattr(args, "moe_ffn_hidden_size", None) or 0,
        experts=experts, vocab=getattr(args, "padded_vocab_size", None) or 1,
        qk_norm=bool(getattr(args, "qk_layernorm", False)),
        rope_base=float(getattr(args, "rotary_base", None) or 10000.0),
        tie_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        **_recompute(args))
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    return TrainConfig(
        model=model,
        parallel=ParallelConfig(
            tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
            pool_size=args.libra_pool_size, ep=getattr(args, "expert_model_parallel_size", 1),
            pp=args.pipeline_model_parallel_size, vpp=vpp,
            sequence_parallel=bool(args.sequence_parallel),
            timeout_minutes=float(args.distributed_timeout_minutes or 10)),
        system=system_config(args) if args.libra_system != "megatron-hybrid" else SystemConfig(),
        data=DataConfig(
            source="synthetic" if args.libra_data == "synthetic" else "indexed",
            workload=args.libra_workload, lengths_file=args.libra_lengths_file,
            context=args.seq_length, gbs=args.global_batch_size, seed=args.seed % 2**31),
        schedule=ScheduleConfig(train_steps=args.train_iters or 1, warmup_steps=0),
        dtype="bf16" if args.bf16 else "fp32",
    )


def _recompute(args) -> dict:
    """A `libra train` model section's recompute keys for Megatron-LM's --recompute-* arguments
    (what `libra memory` reads)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full":
        return {"recompute": "full", "recompute_method": args.recompute_method or "uniform",
                "recompute_num_layers": args.recompute_num_layers or 1}
    if granularity == "selective":
        return {"recompute": "selective"}
    return {}


def arg_names() -> dict:
    """Config field path -> the argument a Megatron-LM user sets it with (what the config's
    checks name in their messages here, `config.field_names`)."""
    return {**{f"system.{f.name}": _arg(f.name) for f in dataclasses.fields(SystemConfig)},
            **ARG_NAMES}


def check_args(args, world_size: int | None = None) -> None:
    """Every refusal knowable from the arguments, before any process group: raises ValueError
    with one line naming the argument."""
    world = world_size or args.world_size
    precheck_args(args)
    if args.libra_system == "megatron-hybrid":
        return
    cfg = train_config(args)
    if args.libra_data == "synthetic":
        with field_names(arg_names()):
            cfg.data.check_synthetic()
        if args.libra_lengths_file is not None:
            try:
                read_lengths_file(args.libra_lengths_file)
            except ValueError as e:
                raise ValueError(f"--libra-lengths-file: {e}") from None
    elif not args.mock_data:
        paths = _data_paths(args)
        if not paths:
            raise ValueError("--data-path is required (or --mock-data for synthetic samples)")
        for p in paths:
            for ext in (".bin", ".idx"):
                if not Path(p + ext).is_file():
                    raise ValueError(f"--data-path: {p}{ext} does not exist")
    if getattr(args, "full_validation", False):
        raise ValueError(
            "--full-validation: Libra's validation serves --eval-iters global batches planned "
            "by the run's system (the same at every evaluation); set --eval-iters instead")
    if getattr(args, "multiple_validation_sets", False):
        raise ValueError(
            "--multiple-validation-sets: Libra's validation reads one validation split; leave "
            "it off")
    with field_names(arg_names()):
        cfg.check_layout(world)
        cfg.system.check()
    if cfg.system.cost_model == "online" and not args.libra_attention_time:
        raise ValueError("--libra-cost-model online fits the measured attention times: it "
                         "needs them timed (drop --no-libra-attention-time)")


def _data_paths(args) -> list[str]:
    """Dataset prefixes of --data-path (weights dropped) and the per-split paths."""
    out = []
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        items = getattr(args, name, None) or []
        for x in items:
            try:
                float(x)
            except ValueError:
                out.append(x)
    return out


RESUMABLE_CHANGES = ("attention_memory",)
"""SystemConfig fields a resume may change: neither samples nor plans depend on them."""


def changed_settings(old: dict, new: dict) -> list[str]:
    """The settings a resume changes, "NAME = OLD there, NEW here", from the checkpoint's
    libra_settings (`old`) and this run's (`new`); a checkpoint saved before --libra-data
    existed read Megatron's own dataset."""
    old = {"--libra-data": "megatron", **old}
    return [f"{k} = {old.get(k)!r} there, {new[k]!r} here" for k in new if old.get(k) != new[k]]


def libra_settings(args) -> dict:
    """The arguments a resumed run must keep for its samples and plans to be the uninterrupted
    run's: every --libra-* argument (but --libra-attention-memory, which changes only what the
    operator keeps for backward), the global batch, the sequence length and the seed."""
    out = {_arg(f.name): getattr(args, _dest(f.name)) for f in dataclasses.fields(SystemConfig)
           if f.name not in RESUMABLE_CHANGES}
    out["--libra-pool-size"] = args.libra_pool_size
    out["--libra-data"] = args.libra_data
    if args.libra_data == "synthetic":
        out["--libra-workload"] = args.libra_workload
        out["--libra-lengths-file"] = args.libra_lengths_file
    out["--global-batch-size"] = args.global_batch_size
    out["--seq-length"] = args.seq_length
    out["--seed"] = args.seed
    return out
