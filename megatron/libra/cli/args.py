"""Argument helpers the `libra` subcommands share: comma-separated lists, positive integers,
the workload (a preset or a lengths file) and the model's attention shape, and the device's
default dtype. Torch-free."""

from __future__ import annotations

import argparse
import sys

from libra_ext.planner import SYSTEMS
from libra_ext.workload import MODEL_PRESETS, LengthSource, ModelConfig, preset_names


def list_arg(text: str, field: str, kind=int, minimum=1) -> list:
    """A non-empty comma-separated list of `kind` values, each at least `minimum`."""
    noun = "integers" if kind is int else "numbers"
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{field} must be comma-separated {noun}, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        what = "positive integers" if kind is int and minimum == 1 else f"{noun} >= {minimum}"
        raise ValueError(f"{field} must be {what}, got {text!r}")
    return values


def int_list_arg(text: str, field: str) -> list[int]:
    return list_arg(text, field)


def systems_arg(text: str) -> tuple:
    systems = tuple(s for s in text.split(",") if s)
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"systems: unknown system {s!r}")
    return systems


def default_dtype(args) -> str:
    """--dtype, or the device's default: bf16 on cuda, fp32 on cpu (where bf16 matmuls are
    slow)."""
    return args.dtype or ("bf16" if args.device == "cuda" else "fp32")


def positive(value: int, field: str, least: int = 1) -> int:
    if value < least:
        raise ValueError(f"{field} must be {'positive' if least == 1 else f'>= {least}'}, got {value}")
    return value


def model_of(args) -> ModelConfig:
    base = MODEL_PRESETS[args.model]
    kw = {k: getattr(base, k) for k in base.__dataclass_fields__}
    for arg, key in (("heads", "heads"), ("kv_heads", "kv_heads"), ("head_dim", "head_dim")):
        if getattr(args, arg) is not None:
            kw[key] = getattr(args, arg)
    return ModelConfig(**kw)


def source_of(args) -> tuple[LengthSource, int]:
    source = LengthSource(preset=args.workload, lengths_file=args.lengths_file)
    context = args.context if args.context is not None else source.default_context()
    if context is None:
        raise ValueError("context: --context is required with --lengths-file")
    positive(context, "context")
    cut = source.longer_than(context)
    if cut:
        print(
            f"libra {args.command}: note: {cut} document length(s) in {args.lengths_file} exceed "
            f"the context ({context}); packing cuts them into context-length pieces",
            file=sys.stderr,
        )
    return source, context


def add_workload_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        default="libra-256k",
        choices=preset_names(),
        help="document-length preset (default libra-256k)",
    )
    src.add_argument("--lengths-file", help="file of document lengths, one positive integer a line")
    p.add_argument("--context", type=int, help="tokens per packed sequence (default: the preset's)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODEL_PRESETS))
    p.add_argument("--heads", type=int, help="query heads (default: the model's)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: the model's)")
    p.add_argument("--head-dim", type=int, help="head dimension (default: the model's)")
