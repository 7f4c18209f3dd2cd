"""`pretrain_gpt_libra.py`'s main: parse Megatron-LM's and Libra's arguments (with --yaml-cfg),
refuse bad ones in one line before any process group, then run Megatron-LM's own
`megatron.training.pretrain` with Libra's layer spec, dataset provider and forward step."""

from __future__ import annotations

import importlib
import os
import sys

import megatron.core.datasets.utils as dataset_utils
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from megatron.libra import cpu_shims
from megatron.libra.megatron_lm.args import add_libra_args, check_args
from megatron.libra.megatron_lm.iterator import (
    datasets_provider,
    finalize_model_grads_then_log,
    forward_step,
)
from megatron.libra.megatron_lm.spec import layer_spec
from megatron.libra.megatron_lm.yaml_cfg import expand_yaml_cfg
from megatron.libra.notices import quiet_megatron_notices


def skip_helper_build() -> None:
    """megatron-core's wheel ships its dataset index helpers compiled (helpers_cpp) but not their
    Makefile, so `megatron.training`'s start-up compile step fails on every machine: skip it
    when the compiled module imports."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return

    dataset_utils.compile_helpers = lambda: None


def main(argv=None) -> int:
    """pretrain_gpt_libra.py: parse Megatron-LM's and Libra's arguments, refuse bad ones before
    any process group, then run megatron.training.pretrain with Libra's providers."""
    quiet_megatron_notices()
    if cpu_shims.needed():
        # Megatron-LM asks for it with TP or CP (kernel ordering on a GPU's queues); on CPU
        # there are no queues to order
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cpu_shims.apply()
    skip_helper_build()
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
