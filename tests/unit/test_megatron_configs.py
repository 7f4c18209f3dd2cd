"""configs/megatron/*.yaml: the paper's Qwen3-30B-A3B layouts for pretrain_gpt_libra.py read by
Megatron-LM's own parser and argument checks (megatron-core 0.19's megatron.training), and the
same model, layout, system and schedule as the `libra train` configs of the same name."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.libra.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="megatron.training ships with megatron-core >= 0.19 (Python >= 3.12)")

# Megatron-LM's parse_and_validate_args on the file, as rank 0 of `world` would run it on an
# H100/H200 (compute capability 9.0, which --moe-grouped-gemm asks for; a GPU for Libra's
# GPU-only refusals); the config it stands for as JSON on the last line
_READ = r"""
import dataclasses, json, sys
from megatron.libra import cpu_shims
from megatron.libra.notices import quiet_megatron_notices
quiet_megatron_notices()
cpu_shims.apply()
import megatron.training.arguments as arguments
arguments.torch.cuda.get_device_capability = lambda device=None: (9, 0)
from megatron.libra.megatron_lm import args as libra_args
libra_args.on_gpu = lambda: True  # the distributed optimizer is refused on the CPU only
from megatron.libra.megatron_lm.args import add_libra_args, train_config
from megatron.libra.megatron_lm.yaml_cfg import expand_yaml_cfg
argv, _ = expand_yaml_cfg(["--yaml-cfg", sys.argv[1]])
sys.argv = ["pretrain_gpt_libra.py", *argv, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", sys.argv[2]]
args = arguments.parse_and_validate_args(extra_args_provider=add_libra_args, args_defaults={})
cfg = train_config(args)
out = cfg.to_dict()
out["libra_dp"] = cfg.check_layout(args.world_size)  # Libra's own layout checks
out["megatron"] = {k: getattr(args, k) for k in (
    "data_parallel_size", "padded_vocab_size", "lr", "min_lr", "weight_decay", "clip_grad",
    "train_iters", "lr_warmup_iters", "save_interval", "bf16", "use_distributed_optimizer",
    "moe_token_dispatcher_type", "dataloader_type", "cp_comm_type",
    "calculate_per_token_loss")}
print(json.dumps(out))
"""


@pytest.mark.parametrize("name,world", [("qwen3_30b_a3b_256k", 128), ("qwen3_30b_a3b_1m", 256)])
def test_the_paper_layouts_parse_as_megatron_lm_and_match_the_libra_train_configs(name, world):
    ref = TrainConfig.load(ROOT / "configs/train" / f"{name}.yaml")
    # Megatron-LM pads the tokenizer's vocabulary to a multiple of 128: Qwen3's 151,643 ids
    # and its special tokens give the 151,936 rows the libra train config names
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE=str(world), RANK="0",
               LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    run = subprocess.run(
        [sys.executable, "-c", _READ, str(ROOT / "configs/megatron" / f"{name}.yaml"),
         str(ref.model.vocab - 1)], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    mlm = got.pop("megatron")
    want = ref.to_dict()
    for key in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "layers", "moe_topk",
                "moe_ffn", "experts", "vocab", "qk_norm", "rope_base", "tie_embeddings",
                "recompute", "recompute_method", "recompute_num_layers"):
        assert got["model"][key] == want["model"][key], key
    for key in ("tp", "cp", "pool_size", "ep", "pp"):
        assert got["parallel"][key] == want["parallel"][key], key
    for key in ("name", "chunks", "block", "tap", "pipeline"):
        assert got["system"][key] == want["system"][key], key
    assert (got["data"]["context"], got["data"]["gbs"]) == (want["data"]["context"],
                                                            want["data"]["gbs"])
    assert got["dtype"] == want["dtype"] == "bf16"
    o, s = ref.optimizer, ref.schedule
    assert (mlm["lr"], mlm["min_lr"], mlm["weight_decay"], mlm["clip_grad"]) == (
        o.lr, o.min_lr, o.weight_decay, o.clip_grad)
    assert (mlm["train_iters"], mlm["lr_warmup_iters"], mlm["save_interval"]) == (
        s.train_steps, s.warmup_steps, ref.checkpoint.save_interval)
    assert mlm["bf16"] and mlm["use_distributed_optimizer"] == o.distributed
    # what Libra needs of Megatron-LM's loop, by default
    assert (mlm["dataloader_type"], mlm["cp_comm_type"], mlm["calculate_per_token_loss"]) == (
        "external", ["a2a"], True)
    # Libra's own layout checks pass at the config's world size, with Megatron-LM's DP size
    assert got["libra_dp"] == mlm["data_parallel_size"] == world // ref.parallel.cp
