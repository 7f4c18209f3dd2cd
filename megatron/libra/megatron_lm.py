"""Libra inside Megatron-LM's own training loop (`pretrain_gpt_libra.py`, megatron-core >= 0.19,
whose wheel ships `megatron.training`).

Megatron-LM keeps its arguments (and `--yaml-cfg`), its iteration log line, timers,
TensorBoard, checkpoints and exit-signal handling; this module adds what Libra needs:

- `add_libra_args`: the `--libra-*` arguments (every knob of a `libra train` config's `system`
  section, with its help text) as `extra_args_provider`, and Megatron defaults Libra relies on
  (`--dataloader-type external`: the step plan decides which rank reads which sample;
  `--cp-comm-type a2a`: Libra's operator is the core attention; `--calculate-per-token-loss`;
  `--eval-iters 0`: validation is not served through the plan yet);
- `check_args`: every refusal knowable from the arguments, before any process group, in one
  line naming the argument;
- `layer_spec`: megatron-core's GPT layer (TE spec on a GPU with TE, local otherwise) with
  Libra's core attention, for `GPTModelConfig.transformer_layer_spec`;
- `datasets_provider`: Megatron's own GPTDataset (blends, `--split`, any `--tokenizer-type`),
  or MockGPTDataset with `--mock-data`, served as per-step THD micro-batches: each step's plan
  is made one step ahead in a background thread from the global batch's document lengths, read
  from the dataset's index (never from the tokens), and every rank yields the micro-batches of
  the sequences its replica executes under that plan;
- `forward_step` / `loss_func`: the micro-batch through the model with its PackedSeqParams,
  per-token loss (`--calculate-per-token-loss`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from libra_ext.workload import read_lengths_file
from megatron.libra.config import SystemConfig, TrainConfig
from megatron.libra.data import Piece

logger = logging.getLogger("libra.megatron_lm")

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
    `libra train` config's `system` section, and the pool size), and the defaults Libra needs."""
    from megatron.libra.config_doc import field_docs

    docs = field_docs(SystemConfig)
    group = parser.add_argument_group(
        title="Libra", description="attention-straggler removal (a `libra train` config's "
        "system section; docs/config_reference.md)")
    default = SystemConfig()
    for f in dataclasses.fields(SystemConfig):
        value, help_text = getattr(default, f.name), docs.get(f.name, "")
        if f.name == "name":
            group.add_argument("--libra-system", dest="libra_system", default=value,
                               choices=SYSTEM_CHOICES, help=help_text.replace(
                                   "libra | ulysses | wlb | distca.",
                                   "libra | ulysses | wlb | distca, or megatron-hybrid: "
                                   "megatron-core's own hybrid CP scheduler (a GPU with "
                                   "Transformer Engine)."))
        elif isinstance(value, bool):
            # Megatron-LM's convention: a flag sets what its default does not
            name = _arg(f.name)
            flag = name if not value else "--no-" + name[2:]
            group.add_argument(flag, dest=_dest(f.name), default=value,
                               action="store_false" if value else "store_true", help=help_text)
        else:
            kind = float if isinstance(value, float) else int if isinstance(value, int) else str
            if f.name == "block":
                kind = int
            group.add_argument(_arg(f.name), dest=_dest(f.name), type=kind, default=value,
                               help=help_text)
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
    return parser


def system_config(args) -> SystemConfig:
    """The `system` section the --libra-* arguments stand for."""
    kw = {f.name: getattr(args, _dest(f.name)) for f in dataclasses.fields(SystemConfig)}
    return SystemConfig(**kw)


def train_config(args) -> TrainConfig:
    """A `libra train` config of the same layout, model, data stream and system as Megatron-LM's
    arguments: what the planner, the sampler and the checks read."""
    from megatron.libra.config import (DataConfig, ParallelConfig, ScheduleConfig,
                                       TrainModelConfig)

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


def _named(message: str) -> str:
    """A config check's message with Megatron-LM's argument names for its fields."""
    for f in dataclasses.fields(SystemConfig):
        message = message.replace(f"system.{f.name}", _arg(f.name))
    for field, arg in ARG_NAMES.items():
        message = message.replace(field, arg)
    return message


def check_args(args, world_size: int | None = None) -> None:
    """Every refusal knowable from the arguments, before any process group: raises ValueError
    with one line naming the argument."""
    world = world_size or args.world_size
    if args.libra_system == "megatron-hybrid":
        if not torch.cuda.is_available():
            raise ValueError(
                "--libra-system megatron-hybrid runs megatron-core's hybrid CP scheduler, which "
                "needs a GPU with Transformer Engine (its THD attention with per-sequence CP "
                "groups); run it on a GPU or choose libra, ulysses, wlb or distca")
        return
    cp_comm = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    if args.context_parallel_size > 1 and any(c != "a2a" for c in cp_comm):
        raise ValueError(
            f"--cp-comm-type {' '.join(map(str, cp_comm))}: with --libra-system "
            f"{args.libra_system} Libra's operator is the core attention and runs its own CP "
            "(Ulysses all-to-all inside the CP group); leave --cp-comm-type at a2a")
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError(
            f"--hybrid-context-parallel is megatron-core's own CP scheduler; use it with "
            f"--libra-system megatron-hybrid, not {args.libra_system}")
    if args.micro_batch_size != 1:
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size}: Libra's micro-batch is one packed "
            "sequence in THD layout (--micro-batch-size 1; the global batch size sets the "
            "sequences per step)")
    if args.dataloader_type != "external":
        raise ValueError(
            f"--dataloader-type {args.dataloader_type}: Libra serves each rank the samples its "
            "replica executes under the step plan (leave --dataloader-type at external)")
    cfg = train_config(args)
    if args.libra_data == "synthetic":
        try:
            cfg.data.check_synthetic()
        except ValueError as e:
            raise ValueError(_named(str(e))) from None
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
    if args.eval_iters and args.eval_interval and args.eval_interval <= (args.train_iters or 0):
        raise ValueError(
            f"--eval-iters {args.eval_iters}: validation through the step plan is not served by "
            "pretrain_gpt_libra.py yet; set --eval-iters 0")
    try:
        cfg.check_layout(world)
        cfg.system.check()
    except ValueError as e:
        raise ValueError(_named(str(e))) from None


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


# ------------------------------------------------------------------------------ --yaml-cfg

LIBRA_SECTION_KEYS = {"name": "libra_system", "system": "libra_system",
                      "pool_size": "libra_pool_size", "data": "libra_data",
                      "workload": "libra_workload", "lengths_file": "libra_lengths_file",
                      "attention_time": "libra_attention_time"}
"""Keys of a --yaml-cfg file's `libra:` section that are not a system field's `--libra-<key>`:
the section takes the keys of a `libra train` config's `system` section (`name`, `block`,
`chunks`, ...), the pool size, where the documents come from (`data: synthetic`, `workload`,
`lengths_file`) and `attention_time`."""


def _split_yaml_cfg(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--yaml-cfg's path, the other arguments) of a command line."""
    path, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--yaml-cfg":
            if i + 1 >= len(argv):
                raise ValueError("--yaml-cfg: expected a file path")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--yaml-cfg="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return path, rest


def yaml_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """A --yaml-cfg file as the command-line arguments it stands for, checked against `parser`
    (Megatron-LM's arguments and Libra's).

    Keys are Megatron-LM's argument names with underscores (`num_layers: 2`,
    `context_parallel_size: 2`, `mock_data: true`), as at the top level of Megatron-LM's own
    YAML files; a mapping under a key that is no argument (`model_parallel:`, `training:`, ...)
    only groups such keys. The `libra:` section takes the keys of a `libra train` config's
    `system` section and `pool_size`. Arguments given on the command line as well win (they come
    after these); `null` leaves an argument at its default. An unknown key, a value of the wrong
    kind or one key given twice raises ValueError naming the key."""
    import difflib

    import yaml

    where = f"--yaml-cfg {path}"
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not YAML ({str(e).splitlines()[0]})") from None
    if doc is None:
        return []
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping of argument names to values")
    actions: dict[str, list] = {}
    options: dict[str, argparse.Action] = {}  # option name (no dashes) -> its action
    for a in parser._actions:
        if a.option_strings and a.dest != "help":
            actions.setdefault(a.dest, []).append(a)
            for o in a.option_strings:
                options[o.lstrip("-").replace("-", "_")] = a
    system_fields = {f.name for f in dataclasses.fields(SystemConfig)}
    out: list[str] = []
    seen: dict[str, str] = {}

    def emit(key: str, dest: str, value) -> None:
        if dest in seen:
            raise ValueError(f"{where}: {key} sets --{dest.replace('_', '-')} again "
                             f"(as {seen[dest]} did)")
        seen[dest] = key
        if value is None:
            return
        acts = actions[dest]
        long = lambda a: next((o for o in a.option_strings if o.startswith("--")),  # noqa: E731
                              a.option_strings[0])
        if isinstance(value, bool):
            flags = [a for a in acts if isinstance(a.const, bool) and a.nargs == 0]
            for a in flags:
                if a.const is value:
                    out.append(long(a))
                    return
            if flags:
                if value == flags[0].default:
                    return
                raise ValueError(f"{where}: {key}: {long(flags[0])} cannot be set to {value}")
        a = acts[0]
        if a.nargs == 0:
            raise ValueError(f"{where}: {key}: {long(a)} is a flag: give true or false, "
                             f"not {value!r}")
        many = a.nargs in ("+", "*") or isinstance(a.nargs, int)
        if isinstance(value, list):
            if not many:
                raise ValueError(f"{where}: {key}: {long(a)} takes one value, not a list")
            out.extend([long(a), *map(str, value)])
        elif isinstance(value, dict):
            raise ValueError(f"{where}: {key}: {long(a)} takes a value, not a mapping")
        else:
            out.extend([long(a), str(value)])

    def unknown(key: str, name: str, pool) -> ValueError:
        near = difflib.get_close_matches(name, list(pool), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return ValueError(f"{where}: {key} is not a Megatron-LM or Libra argument{hint}")

    def walk(mapping: dict, prefix: str) -> None:
        for k, v in mapping.items():
            key = f"{prefix}{k}"
            name = str(k).replace("-", "_")
            if prefix == "" and name == "libra" and name not in actions:
                if not isinstance(v, dict):
                    raise ValueError(f"{where}: libra: expected a mapping (the system section)")
                for lk, lv in v.items():
                    lname = str(lk).replace("-", "_")
                    if lname in LIBRA_SECTION_KEYS:
                        emit(f"libra.{lk}", LIBRA_SECTION_KEYS[lname], lv)
                    elif lname in system_fields:
                        emit(f"libra.{lk}", _dest(lname), lv)
                    else:
                        near = difflib.get_close_matches(
                            lname, sorted(system_fields | set(LIBRA_SECTION_KEYS)), n=1)
                        hint = f" (did you mean {near[0]}?)" if near else ""
                        raise ValueError(
                            f"{where}: libra.{lk} is not a key of the system section or one of "
                            f"{', '.join(k for k in LIBRA_SECTION_KEYS if k != 'system')}{hint}")
            elif name == "yaml_cfg":
                raise ValueError(f"{where}: {key}: a --yaml-cfg file cannot name another")
            elif name in actions:
                emit(key, name, v)
            elif name in options and options[name].nargs == 0:
                # a flag by its option's name (disable_bias_linear: true)
                a = options[name]
                if not isinstance(v, bool):
                    raise ValueError(f"{where}: {key}: --{k} is a flag: give true or false, "
                                     f"not {v!r}")
                emit(key, a.dest, a.const if v else None)
            elif name in options:
                emit(key, options[name].dest, v)
            elif isinstance(v, dict):
                walk(v, key + ".")
            else:
                raise unknown(key, name, set(actions) | set(options))

    walk(doc, "")
    return out


def expand_yaml_cfg(argv: list[str]) -> tuple[list[str], str | None]:
    """Megatron-LM's and Libra's arguments with --yaml-cfg replaced by the file's arguments
    (the command line's own after them, so they win), and the file's path. Megatron-LM's own
    --yaml-cfg mode (every argument from the file, the command line ignored) is not used."""
    path, rest = _split_yaml_cfg(argv)
    if path is None:
        return argv, None
    return yaml_argv(path, _megatron_parser()) + rest, path


def _megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM's argument parser with Libra's arguments (as parse_args builds it)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_libra_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


# ------------------------------------------------------------------------------ model


_RUNTIME = None


def runtime(args=None):
    """This process's attention runtime (made once, on megatron-core's groups)."""
    global _RUNTIME
    if _RUNTIME is None:
        from megatron.core import parallel_state as ps

        from libra_ext.attention.comm import GroupCache
        from libra_ext.attention.core import Runtime

        s = system_config(args)
        dp = ps.get_data_parallel_world_size()
        _RUNTIME = Runtime(
            groups=GroupCache(tp=args.tensor_model_parallel_size,
                              cp=args.context_parallel_size, dp=dp,
                              timeout_s=float(args.distributed_timeout_minutes or 10) * 60,
                              pp=args.pipeline_model_parallel_size,
                              cp_group=ps.get_context_parallel_group()),
            chunks=s.chunks, pipelined=s.pipeline,
            backend=None if s.attention_backend == "auto" else s.attention_backend)
    return _RUNTIME


def layer_spec(config=None, vp_stage=None):
    """GPTModelConfig.transformer_layer_spec: megatron-core's GPT layer with Libra's core
    attention (TE spec where TE imports on a GPU, local otherwise)."""
    from megatron.training import get_args

    from megatron.libra import model as libra_model
    from megatron.libra import rope
    from megatron.libra.config import resolve_impl

    args = get_args()
    rope.install()  # THD RoPE from each slot's position: a fixed number of kernels
    cfg = train_config(args)
    impl = resolve_impl("auto" if args.transformer_impl != "local" else "local")
    # each layer's weights drawn from a generator seeded by (--seed, its global layer number),
    # and the embedding from --seed itself, as `libra train` draws them: the same model at any
    # pipeline layout, and in both loops. Megatron-LM builds the model right after asking for
    # its spec; weights made on a GPU draw from megatron-core's CUDA RNG tracker instead
    if args.use_cpu_initialization and not vp_stage:
        torch.manual_seed(cfg.data.seed)
    return libra_model.layer_spec(cfg.model, args.libra_system, runtime(args), impl,
                                  init_seed=cfg.data.seed)


# ------------------------------------------------------------------------------ data


class GPTDatasetSource:
    """Megatron's GPTDataset (or a blend of them) as the sampler's document source: step k is
    the samples [k * gbs, (k + 1) * gbs), each a packed sequence whose documents' lengths come
    from the dataset's sample and document indices (never from the tokens). A document of a
    sample is a piece of it with the tokens, labels and loss mask GPTDataset gives (its EOD
    handling, `--eod-mask-loss`, `--reset-*` as Megatron-LM sets them). It has no label_count:
    Megatron-LM's loop counts the loss tokens itself, so no rank reads the samples of replicas
    other than its own."""

    def __init__(self, dataset, gbs: int, keep_steps: int):
        self.ds, self.gbs, self.keep_steps = dataset, gbs, keep_steps
        self._pieces: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}
        self._samples: dict[int, dict] = {}

    def _leaf(self, i: int):
        """(GPTDataset, its sample index) of sample i of the (possibly blended) dataset."""
        ds = self.ds
        while hasattr(ds, "dataset_index"):  # a BlendedDataset
            ds, i = ds.datasets[int(ds.dataset_index[i])], int(ds.dataset_sample_index[i])
        return ds, i

    def lengths(self, i: int) -> list[int]:
        """Document lengths of sample i inside its seq_length tokens, from the indices."""
        ds, j = self._leaf(i)
        j = int(ds.shuffle_index[j])
        (p0, o0), (p1, o1) = ds.sample_index[j], ds.sample_index[j + 1]
        docs = np.asarray(ds.document_index[p0:p1 + 1])
        full = np.asarray(ds.dataset.sequence_lengths)[docs].astype(np.int64)
        extra = int(getattr(ds.config, "add_extra_token_to_sequence", True))
        if p0 == p1:
            seg = [int(o1 - o0 + extra)]
        else:
            seg = [int(full[0] - o0)] + [int(x) for x in full[1:-1]] + [int(o1 + extra)]
        # the sample's tokens are its first seq_length; the extra one is only a label
        n = ds.config.sequence_length
        out, used = [], 0
        for x in seg:
            take = min(x, n - used)
            if take > 0:
                out.append(take)
                used += take
        if used < n:  # a short last sample is padded by GPTDataset: one more piece
            out.append(n - used)
        return out

    def step(self, step: int, doc_base: int = 0) -> list[list[int]]:
        seqs, flat = [], []
        for i in range(step * self.gbs, (step + 1) * self.gbs):
            lengths = self.lengths(i % len(self.ds))
            off = 0
            for n in lengths:
                flat.append((i % len(self.ds), off, n))
                off += n
            seqs.append(lengths)
        self._pieces[step] = (doc_base, flat)
        for gone in [k for k in self._pieces if k <= step - self.keep_steps]:
            del self._pieces[gone]
        return seqs

    def epochs(self, step: int) -> tuple[int, int]:
        return 0, 0

    def _lookup(self, doc_id: int) -> tuple[int, int, int]:
        for base, flat in self._pieces.values():
            if base <= doc_id < base + len(flat):
                return flat[doc_id - base]
        raise KeyError(f"document {doc_id} is not among the last {self.keep_steps} steps' inputs")

    def _sample(self, i: int) -> dict:
        if i not in self._samples:
            if len(self._samples) >= 4 * self.gbs:
                self._samples.pop(next(iter(self._samples)))
            self._samples[i] = self.ds[i]
        return self._samples[i]

    def piece(self, doc_id: int, length: int) -> Piece:
        i, off, n = self._lookup(doc_id)
        if n != length:
            raise ValueError(f"document {doc_id} has {n} tokens here, the plan says {length}")
        s = self._sample(i)
        sl = slice(off, off + n)
        return Piece(np.asarray(s["tokens"][sl], dtype=np.int64),
                     np.asarray(s["labels"][sl], dtype=np.int64),
                     np.asarray(s["loss_mask"][sl], dtype=np.float32))


_TRAIN_ITERATOR: list = [None]  # the StepMicroBatches of this process's training run


def finalize_model_grads_then_log(*args, **kwargs):
    """megatron-core's finalize_model_grads (the step's gradient reduction, at the end of its
    backward on every rank), then Libra's per-step accounting (StepMicroBatches.step_end)."""
    from megatron.core.distributed import finalize_model_grads

    out = finalize_model_grads(*args, **kwargs)
    if _TRAIN_ITERATOR[0] is not None:
        _TRAIN_ITERATOR[0].step_end()
    return out


class StepMicroBatches:
    """The training iterator Megatron-LM's schedule reads (`--dataloader-type external`): each
    `next` is this rank's next micro-batch, on the device; the step plan behind them is made one
    step ahead by the sampler's thread."""

    def __init__(self, args, dataset, start_step: int):
        from megatron.core import parallel_state as ps

        from megatron.libra.data import StepSampler, held_steps
        from megatron.libra.train import new_planner

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
            from megatron.libra.data import SyntheticSource

            src = SyntheticSource(cfg)
        else:
            src = GPTDatasetSource(dataset, cfg.data.gbs, held_steps(cfg))
        self.step = start_step
        self.last = None  # the StepBatch whose micro-batches were served last
        self._micro: deque = deque()
        self.timer = None  # AttentionTimer, on the model Megatron-LM built (attach)
        self._window: list[tuple[float, float]] = []  # per step: plan metrics
        self._gathered = None  # per rank: attention s, pool bytes, CP bytes over the window
        # --libra-metrics-file: the step's loss sum and token count, summed on the device
        self._record = args.libra_metrics_file
        self._loss = torch.zeros(2, dtype=torch.float64, device=self.device) \
            if self._record else None
        self._clock = time.perf_counter()
        if self._record and self.rank0:
            Path(self._record).parent.mkdir(parents=True, exist_ok=True)
            Path(self._record).write_text("")
        if start_step > 0 and args.load:
            state = self._load_state(start_step)
            if state is not None:
                planner.load_state_dict(state["planner_state"])
                src_state = (int(state["doc_base"]), dict(state["recent_bases"]))
            else:
                src_state = (0, {})
        else:
            src_state = (0, {})
        self.sampler = StepSampler(cfg, planner, replica=self.r, start_step=start_step,
                                   doc_base=src_state[0], recent_bases=src_state[1],
                                   cp_rank=self.c, source=src, stop_step=args.train_iters)
        _TRAIN_ITERATOR[0] = self

    def __iter__(self):
        return self

    def __next__(self):
        from megatron.libra.train import device_micro_batches

        if not self._micro:
            batch = self.last = self.sampler.next()
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
        from megatron.training import training

        update = getattr(training, "update_seqlen_stats_from_cu_seqlens", None)
        if update is None:
            return
        lengths = [n for mb in micro for n in mb.packed_seq_params.libra_doc_lengths]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        if self.device.type != "cpu":
            cu = cu.pin_memory().to(self.device, non_blocking=True)
        update(cu)

    def attach(self, model) -> None:
        """Time this rank's core attention (forward and backward) on the model Megatron-LM
        built: module hooks, CUDA events on a GPU (read once per log interval)."""
        if self.timer is None:
            from megatron.libra.train import AttentionTimer

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
        pool = float(self.rt.counter.total("pool."))
        loss = self._loss.cpu() if self._record else torch.zeros(2, dtype=torch.float64)
        mine = torch.tensor([self.timer.seconds() if timed else 0.0, pool,
                             float(self.rt.counter.total()) - pool, *loss.tolist()],
                            dtype=torch.float64)
        world = torch.distributed.get_world_size()
        every = [torch.zeros(5, dtype=torch.float64) for _ in range(world)]
        torch.distributed.all_gather(every, mine, group=self.rt.groups.check_group)
        every = torch.stack(every)
        if self.timer is not None:
            self.timer.reset()
        self.rt.counter.reset()
        if self._record:
            self._loss.zero_()
            if self.rank0:
                self._write_record(it, plan, every, timed)
        self._gathered = every if self._gathered is None else self._gathered + every
        if not line:
            return
        every, self._gathered = self._gathered, None
        n = len(self._window)
        if self.rank0:
            work, imbalance = (sum(w[i] for w in self._window) / n for i in range(2))
            t = every[:, 0]
            attn = (f"{float(t.max() / max(float(t.mean()), 1e-12)):.3f} (mean "
                    f"{1e3 * float(t.mean()) / n:.1f} ms/iteration)" if timed else "off")
            print(f" libra | iteration {it:8d} | system: {self.args.libra_system} | attn work "
                  f"max/mean: {work:.3f} | attn time max/mean: {attn} | inter-pool imbalance: "
                  f"{imbalance:.3f} | pool exchange MB/rank: {float(every[:, 1].mean()) / n / 1e6:.2f} "
                  f"| CP all-to-all MB/rank: {float(every[:, 2].mean()) / n / 1e6:.2f} |",
                  flush=True)
        self._window.clear()

    def count_loss(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        """A micro-batch's loss sum and token count into the step's (on the device, read once
        per step in step_end); only with --libra-metrics-file."""
        if self._record:
            self._loss += torch.stack([loss.detach().double(), tokens.detach().double()])

    def _write_record(self, it: int, plan, every: torch.Tensor, timed: bool) -> None:
        """One --libra-metrics-file line for iteration `it` (the keys of `libra train`'s
        logging.metrics_file that Megatron-LM's loop can fill; its grad norm is in
        Megatron-LM's own line): the loss over the global batch's tokens (every
        tensor-parallel rank holds the same sums: they cancel), the step's wall time since the
        previous step ended, the attention time per rank and the bytes sent."""
        now = time.perf_counter()
        dt, self._clock = now - self._clock, now
        loss_sum, tokens = float(every[:, 3].sum()), float(every[:, 4].sum())
        t = every[:, 0]
        tp = self.args.tensor_model_parallel_size
        rec = {
            "step": it,
            "loss": loss_sum / max(tokens, 1.0),
            "tokens": tokens / tp,
            "step_time": dt,
            "tokens_per_s": tokens / tp / max(dt, 1e-12),
            "attn_work_max_over_mean": plan.max_over_mean,
            "inter_pool_imbalance": plan.inter_pool_imbalance,
            "attn_time_max_over_mean": float(t.max() / max(float(t.mean()), 1e-12))
            if timed else None,
            "attn_time_per_rank": t.tolist() if timed else None,
            "bytes_exchanged": float(every[:, 1:3].sum()),
        }
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
        from megatron.core import parallel_state as ps
        from megatron.training.checkpointing import get_checkpoint_name

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


def changed_settings(old: dict, new: dict) -> list[str]:
    """The settings a resume changes, "NAME = OLD there, NEW here", from the checkpoint's
    libra_settings (`old`) and this run's (`new`); a checkpoint saved before --libra-data
    existed read Megatron's own dataset."""
    old = {"--libra-data": "megatron", **old}
    return [f"{k} = {old.get(k)!r} there, {new[k]!r} here" for k in new if old.get(k) != new[k]]


def libra_settings(args) -> dict:
    """The arguments a resumed run must keep for its samples and plans to be the uninterrupted
    run's: every --libra-* argument, the global batch, the sequence length and the seed."""
    out = {_arg(f.name): getattr(args, _dest(f.name)) for f in dataclasses.fields(SystemConfig)}
    out["--libra-pool-size"] = args.libra_pool_size
    out["--libra-data"] = args.libra_data
    if args.libra_data == "synthetic":
        out["--libra-workload"] = args.libra_workload
        out["--libra-lengths-file"] = args.libra_lengths_file
    out["--global-batch-size"] = args.global_batch_size
    out["--seq-length"] = args.seq_length
    out["--seed"] = args.seed
    return out


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM's dataset provider: the training iterator over GPTDataset (MockGPTDataset
    with --mock-data) under the step plan; no validation or test iterators."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import get_blend_and_blend_per_split

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
    train, _, _ = BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, lambda: True, config).build()
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
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    if _TRAIN_ITERATOR[0] is not None:  # (Megatron-LM wraps the iterator it was given)
        _TRAIN_ITERATOR[0].attach(model)
    mb = next(data_iterator)
    timers("batch-generator").stop()
    out = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                packed_seq_params=mb.packed_seq_params)
    return out, functools.partial(loss_func, mb.loss_mask)


# ------------------------------------------------------------------------------ set-up


def skip_helper_build() -> None:
    """megatron-core's wheel ships its dataset index helpers compiled (helpers_cpp) but not their
    Makefile, so `megatron.training`'s start-up compile step fails on every machine: skip it
    when the compiled module imports."""
    import importlib

    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


def main(argv=None) -> int:
    """pretrain_gpt_libra.py: parse Megatron-LM's and Libra's arguments, refuse bad ones before
    any process group, then run megatron.training.pretrain with Libra's providers."""
    from megatron.libra import cpu_shims
    from megatron.libra.notices import quiet_megatron_notices

    quiet_megatron_notices()
    if cpu_shims.needed():
        # Megatron-LM asks for it with TP or CP (kernel ordering on a GPU's queues); on CPU
        # there are no queues to order
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cpu_shims.apply()
    skip_helper_build()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (gpt_config_from_args,
                                                  pretrain_cfg_container_from_args)
    from megatron.training.arguments import parse_and_validate_args

    argv = list(sys.argv[1:] if argv is None else argv)
    prog = os.path.basename(sys.argv[0]) or "pretrain_gpt_libra.py"
    try:
        argv, yaml_cfg = expand_yaml_cfg(argv)
        sys.argv = [sys.argv[0]] + argv
        args = parse_and_validate_args(extra_args_provider=add_libra_args,
                                       args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, AssertionError) as e:
        print(f"{prog}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    if yaml_cfg and args.rank == 0:
        print(f"{prog}: arguments from --yaml-cfg {yaml_cfg}, then the command line's",
              flush=True)
    if args.eval_interval is None:  # no validation (check_args): Megatron-LM still divides
        args.eval_interval = args.train_iters
    if args.libra_system == "megatron-hybrid":
        args.hybrid_context_parallel = True
    elif args.save and not getattr(args, "dataloader_save", None):
        args.dataloader_save = args.save  # the planner's state beside each checkpoint
    model_cfg = gpt_config_from_args(args)
    if args.libra_system != "megatron-hybrid":
        model_cfg.transformer_layer_spec = layer_spec
        model_cfg.transformer.finalize_model_grads_func = finalize_model_grads_then_log
    full = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    return 0
