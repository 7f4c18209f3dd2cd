"""`pretrain_gpt_libra.py`'s main: parse Megatron-LM's and Libra's arguments (with --yaml-cfg),
refuse bad ones in one line before any process group, then run Megatron-LM's own
`megatron.training.pretrain` with Libra's layer spec, dataset provider and forward step."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import sys
import traceback

import megatron.core.datasets.utils as dataset_utils
import megatron.core.parallel_state as ps
import torch
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from megatron.libra import cpu_shims, lifetime
from megatron.libra.megatron_lm.args import add_libra_args, check_args
from megatron.libra.megatron_lm.iterator import (
    datasets_provider,
    finalize_model_grads_then_log,
    forward_step,
)
from megatron.libra.megatron_lm.spec import layer_spec
from megatron.libra.megatron_lm.yaml_cfg import expand_yaml_cfg
from megatron.libra.notices import quiet_megatron_notices
from megatron.libra.steps import close_live_samplers


def skip_helper_build() -> None:
    """megatron-core's wheel ships its dataset index helpers compiled (helpers_cpp) but not their
    Makefile, so `megatron.training`'s start-up compile step fails on every machine: skip it
    when the compiled module imports."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return

    dataset_utils.compile_helpers = lambda: None


def refusal(e: BaseException) -> str:
    """A refusal's one line: its message, or for an assertion without one (megatron-core's
    `validate_args` has many) the failing statement and where it is."""
    text = str(e).strip()
    if text:
        return text.splitlines()[0]
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return type(e).__name__
    f = frames[-1]
    where = f.filename.split("site-packages/")[-1]
    return f"{(f.line or type(e).__name__).strip()} ({where}:{f.lineno})"


def main(argv=None) -> int:
    """pretrain_gpt_libra.py: parse Megatron-LM's and Libra's arguments, refuse bad ones before
    any process group, then run megatron.training.pretrain with Libra's providers."""
    quiet_megatron_notices()
    # a worker ends with torchrun, and megatron-core's checkpoint writers with their worker,
    # however the run ends (SIGKILL included)
    lifetime.watch_torchrun()
    lifetime.end_children_with_this_process()
    if cpu_shims.needed():
        # Megatron-LM asks for it with TP or CP (kernel ordering on a GPU's queues); on CPU
        # there are no queues to order
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cpu_shims.apply()
    skip_helper_build()
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = os.path.basename(sys.argv[0]) or "pretrain_gpt_libra.py"
    # Megatron-LM's argument dump is held back until every check has passed, so that a
    # refusal is the first thing printed (by rank 0 only: every rank checks the same arguments)
    held = io.StringIO()
    try:
        argv, yaml_cfg = expand_yaml_cfg(argv)
        sys.argv = [sys.argv[0]] + argv
        with contextlib.redirect_stdout(held):
            args = parse_and_validate_args(extra_args_provider=add_libra_args,
                                           args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except SystemExit:  # --help, or argparse's own usage error: as it printed them
        sys.stdout.write(held.getvalue())
        raise
    except (ValueError, AssertionError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {refusal(e)}", file=sys.stderr, flush=True)
        return 2
    sys.stdout.write(held.getvalue())
    if os.environ.get("RANK", "0") != "0":  # Libra's start-up lines (the kernel pick): rank 0
        logging.getLogger("libra_ext").setLevel(logging.WARNING)
    if yaml_cfg and args.rank == 0:
        print(f"{prog}: arguments from --yaml-cfg {yaml_cfg}, then the command line's",
              flush=True)
    if args.eval_interval is None:  # (Megatron-LM divides by it): validate at the last iteration
        args.eval_interval = args.train_iters
    if args.libra_system == "megatron-hybrid":
        args.hybrid_context_parallel = True
    elif args.save and not getattr(args, "dataloader_save", None):
        args.dataloader_save = args.save  # the planner's state beside each checkpoint
    model_cfg = gpt_config_from_args(args)
    if args.libra_system != "megatron-hybrid":
        model_cfg.transformer_layer_spec = layer_spec
        model_cfg.transformer.finalize_model_grads_func = finalize_model_grads_then_log
        # a packed micro-batch's tokens per rank change from micro-batch to micro-batch (the
        # contiguous layout's t = ceil(n / C), per-document CP's padding): the pipeline's
        # stages exchange each activation's shape before it (megatron-core's variable
        # sequence lengths; Megatron-LM's own default assumes --seq-length / cp)
        model_cfg.transformer.variable_seq_lengths = args.pipeline_model_parallel_size > 1
    full = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    shut_down()
    return 0


def shut_down() -> None:
    """After Megatron-LM's loop returns: Libra's samplers stopped and joined, then the model-
    parallel state and the process groups destroyed, while the interpreter is still whole.
    Left to interpreter exit, a worker could abort there ("terminate called without an active
    exception", about one run in four on a loaded 2-core host) after its run had finished."""
    close_live_samplers()
    if torch.distributed.is_initialized():
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
