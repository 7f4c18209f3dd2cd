"""Training config: YAML + overrides, and bad configs fail before any process group exists,
naming the field."""

import pytest
import torch

from megatron.libra.cli import main
from megatron.libra.config import TrainConfig, resolve_impl

CPU_TINY = "configs/train/cpu_tiny.yaml"


def test_every_planner_knob_is_reachable_from_the_config():
    from dataclasses import fields


    cfg = TrainConfig.load(CPU_TINY, ["system.max_tile_share=0.2", "system.refine=false",
                                      "system.distca_tolerance=0.1", "system.wlb_release_count=3"])
    opts = cfg.system.planner_options("contiguous", 4)
    assert (opts.max_tile_share, opts.refine, opts.distca_tolerance, opts.wlb_release_count) == (
        0.2, False, 0.1, 3)
    assert opts.order == "contiguous" and opts.dtype_bytes == 4
    # every planner knob is a system key, declared once (PlannerKnobs), with the core's default
    from libra_ext import _planner
    from libra_ext.planner import PlannerKnobs

    knobs = {f.name for f in fields(PlannerKnobs)}
    assert knobs <= {f.name for f in fields(type(cfg.system))}
    core = _planner.PlanOptions()
    for name in knobs - {"block"}:
        assert getattr(PlannerKnobs(), name) == getattr(core, name), name


def test_cpu_tiny_loads_and_overrides_apply():
    cfg = TrainConfig.load(CPU_TINY, ["system.name=wlb", "optimizer.lr=1e-2", "model.layers=3"])
    assert cfg.system.name == "wlb" and cfg.optimizer.lr == 1e-2 and cfg.model.layers == 3
    assert cfg.validate(4) == 2  # 4 ranks, cp 2 -> dp 2


MOE = ["moe.balancer=libra", "model.moe_topk=2", "model.experts=8", "model.moe_ffn=8",
       "parallel.ep=4"]


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["parallel.pool_size=3"],
            4,
            r"parallel.pool_size \(P=3\) must divide the data-parallel size",
        ),
        (
            ["model.heads=3", "model.kv_heads=1"],
            4,
            r"model.heads \(3\) must be divisible by parallel.cp",
        ),
        (["system.name=ring"], 4, r"system.name must be one of libra, ulysses, wlb, distca"),
        (["data.source=indexed"], 4, r"data.path is required for data.source = indexed"),
        (
            ["data.source=indexed", "data.path=/nonexistent/ds"],
            4,
            r"data.path: /nonexistent/ds.bin",
        ),
        (["data.gbs=3"], 4, r"data.gbs \(3\) must be a positive multiple"),
        (["schedule.warmup_steps=60"], 4, r"schedule.warmup_steps \(60\)"),
        ([], 3, r"world size 3 must be a multiple of parallel.tp \* parallel.cp \* parallel.pp"),
        (["parallel.pp=2"], 6, r"world size 6 must be a multiple of .* parallel.pp = 4"),
        (["parallel.pp=3"], 12, r"parallel.pp \* parallel.vpp \(3 \* 1\) must divide model.layers"),
        (["parallel.vpp=2"], 4, r"parallel.vpp \(2\) > 1 needs pipeline parallelism"),
        (["parallel.pp=2", "parallel.vpp=2", "model.layers=4"], 8, r"needs parallel.pp > 2"),
        (
            ["parallel.pp=4", "parallel.vpp=2", "model.layers=8", "parallel.cp=1",
             "parallel.pool_size=1", "data.gbs=6"],
            24,
            r"micro-batches per replica \(data.gbs / dp = 1\) must be a multiple of parallel.pp",
        ),
        (["parallel.sequence_parallel=true"], 4, r"parallel.sequence_parallel needs tensor"),
        (["parallel.pp=0"], 4, r"parallel.pp must be >= 1, got 0"),
        (
            ["model.recompute=full", "model.recompute_num_layers=2", "model.layers=3"],
            4,
            r"model.recompute_num_layers \(2\) must divide the 3 layers",
        ),
        (["system.pp_order=fastest"], 4, r"system.pp_order must be one of none, balanced"),
        (["system.distca_server=node"], 4, r"system.distca_server must be one of replica, gpu"),
        (["system.attention_memory=some"], 4,
         r"system.attention_memory must be one of keep, owner, rebuild, got .some."),
        (
            ["system.name=distca", "system.distca_server=gpu", "parallel.cp=2"],
            4,
            r"system.distca_server: gpu \(DistCA as deployed.*parallel.cp = 1\), got "
            r"parallel.cp = 2",
        ),
        (["parallel.ep=2"], 4, r"parallel.ep \(2\) > 1 needs an MoE model"),
        (
            ["parallel.ep=3", "model.moe_topk=2", "model.experts=4", "model.moe_ffn=8"],
            4,
            r"parallel.ep \(3\) must divide model.experts \(4\)",
        ),
        (["transformer_impl=apex"], 4, r"transformer_impl must be one of auto, local"),
        (["logging.log_interval=0"], 4, r"logging.log_interval must be >= 1, got 0"),
        (["system.epsilon=-0.1"], 4, r"system.epsilon must be >= 0"),
        (["system.block=0"], 4, r"system.block must be positive"),
        (["optimizer.min_lr=0.1"], 4, r"optimizer.min_lr \(0.1\) must be in \[0, optimizer.lr"),
        (["optimizer.adam_beta1=1.0"], 4, r"optimizer.adam_beta1 must be in \[0, 1\)"),
        (["optimizer.adam_beta2=-0.5"], 4, r"optimizer.adam_beta2 must be in \[0, 1\)"),
        (["optimizer.clip_grad=-1"], 4, r"optimizer.clip_grad must be >= 0"),
        (["checkpoint.save_interval=-2"], 4, r"checkpoint.save_interval must be >= 0"),
        (["checkpoint.dir=README.md"], 4, r"checkpoint.dir README.md exists and is not a dir"),
        (["data.order=sorted"], 4, r"data.order must be one of megatron, contiguous"),
        (["system.max_tile_share=-1"], 4, r"system.max_tile_share must be >= 0"),
        (["system.distca_tolerance=-0.5"], 4, r"system.distca_tolerance must be >= 0"),
        (["moe.balancer=greedy"], 4, r"moe.balancer must be one of none, libra"),
        (["moe.balancer=libra"], 4, r"moe.balancer = libra needs an MoE model"),
        (MOE + ["parallel.ep=1"], 4, r"moe.balancer = libra needs expert parallelism"),
        (MOE + ["moe.replica_slots=7"], 4,
         r"moe.replica_slots \(7\) is larger than the expert slots a rank can fill: it owns 2 "
         r"of model.experts \(8\) and can hold copies of the other 6 at most"),
        (MOE + ["moe.local_slots=3"], 4, r"moe.local_slots must be in \[-1, 2\], got 3"),
        (MOE + ["transformer_impl=local", "model.recompute=full"], 4,
         r"does not support model.recompute = full"),
        (["logging.record_routing=true"], 4, r"logging.record_routing .* needs moe.balancer"),
        (["data.context=1099511627776"], 4, r"data.context = 1099511627776 exceeds 2\^30 tokens"),
        (["optimizer.lr=.nan"], 4, r"optimizer.lr must be a finite number, got nan"),
        (["optimizer.lr=inf"], 4, r"optimizer.lr must be a finite number, got inf"),
        (["optimizer.weight_decay=nan"], 4, r"optimizer.weight_decay must be a finite number"),
        (["optimizer.clip_grad=nan"], 4, r"optimizer.clip_grad must be a finite number"),
    ],
)
def test_bad_configs_name_the_field(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.load(CPU_TINY, overrides).validate(world)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.layer=2"], r"model.layer is not a config field"),
        (["optimizer.lr=fast"], r"optimizer.lr must be a number, got 'fast'"),
        (["system.pipeline=3"], r"system.pipeline must be true or false"),
        (["parallel"], r"override 'parallel' must look like key.sub=value"),
        (["model.qk_norm=1"], r"model.qk_norm must be true or false"),
        (["model.rope_base=0.5"], r"model.rope_base must be a number > 1"),
        (["model.recompute=partial"], r"model.recompute must be one of none, selective, full"),
        (["model.recompute_method=random"], r"model.recompute_method must be uniform or block"),
        (["model.recompute_num_layers=0"], r"model.recompute_num_layers"),
    ],
)
def test_bad_fields_and_overrides(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.load(CPU_TINY, overrides)


def test_garbage_lengths_file_fails_before_launch_naming_file_and_line(tmp_path):
    bad = tmp_path / "lengths.txt"
    bad.write_text("100\n200\n3e4\n")
    cfg = TrainConfig.load(CPU_TINY, [f"data.lengths_file={bad}"])
    with pytest.raises(ValueError, match=r"lengths file .*lengths.txt line 3: '3e4'"):
        cfg.validate(4)
    bad.write_bytes(b"\x00\x81\xff binary")
    with pytest.raises(ValueError, match=r"lengths.txt line 1: not ASCII text"):
        cfg.validate(4)


def test_malformed_yaml_names_line_and_column(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model:\n  layers: 2\n  heads: [4\ndata:\n  gbs: 8\n")
    assert main(["train", "--config", str(cfg), "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err and "line" in err and "column" in err


def test_unknown_log_level_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--log-level", "FOO", "plan", "--steps", "1"])
    assert e.value.code == 2
    assert "--log-level" in capsys.readouterr().err


def test_train_cli_fails_before_starting_workers(capsys):
    assert main(["train", "--config", CPU_TINY, "--nproc", "4", "parallel.pool_size=3"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pool_size (P=3) must divide" in err and err.count("\n") == 1
    assert main(["train", "--config", "/nonexistent.yaml", "--nproc", "1"]) == 2
    assert "cannot open" in capsys.readouterr().err


def test_checkpoint_tracker_errors_name_the_file(tmp_path):
    from megatron.libra.checkpoint import latest_step

    assert latest_step(None) is None and latest_step(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("abc")
    with pytest.raises(ValueError, match="checkpoint.dir: .*should hold a step number"):
        latest_step(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(ValueError, match="names step 7, but .*iter_0000007 is missing"):
        latest_step(tmp_path)
    (tmp_path / "iter_0000007").mkdir()
    assert latest_step(tmp_path) == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine refuses")
def test_gpu_only_features_are_refused_on_cpu():
    cfg = TrainConfig.load(CPU_TINY, ["transformer_impl=transformer_engine"])
    with pytest.raises(ValueError, match="transformer_impl is transformer_engine, but no GPU"):
        cfg.validate(4)
    cfg = TrainConfig.load(CPU_TINY, ["optimizer.distributed=true"])
    with pytest.raises(ValueError, match="optimizer.distributed needs a GPU"):
        cfg.validate(4)
    cfg = TrainConfig.load(CPU_TINY, ["parallel.tp=2", "parallel.sequence_parallel=true"])
    with pytest.raises(ValueError, match="parallel.sequence_parallel needs Transformer Engine"):
        cfg.validate(8)
    for name in ("overlap_grad_reduce", "overlap_param_gather"):
        cfg = TrainConfig.load(CPU_TINY, [f"optimizer.{name}=true"])
        with pytest.raises(ValueError, match=f"optimizer.{name} needs a GPU"):
            cfg.validate(4)
    cfg = TrainConfig.load(CPU_TINY, ["dtype=bf16"])
    with pytest.raises(ValueError, match="dtype bf16 needs a GPU: .* on CPU set dtype: fp32"):
        cfg.validate(4)
    assert resolve_impl("auto") == "local"


def test_layer_spec_replaces_only_core_attention():
    from libra_ext.attention.core import LibraCoreAttention
    from libra_ext.workload import ModelConfig
    from megatron.libra.model import layer_spec

    spec = layer_spec(ModelConfig(qk_norm=True), "libra", None, "local")
    sub = spec.submodules.self_attention.submodules
    assert sub.core_attention.module is LibraCoreAttention
    assert sub.core_attention.params["system"] == "libra"
    assert sub.q_layernorm is not None and sub.k_layernorm is not None  # Qwen3's QK-norm
    assert "Linear" in sub.linear_qkv.__name__ and "Linear" in sub.linear_proj.__name__


@pytest.mark.parametrize(
    "name, world, dp", [("qwen3_30b_a3b_256k", 128, 16), ("qwen3_30b_a3b_1m", 256, 16)]
)
def test_cluster_configs_have_consistent_layouts(name, world, dp, monkeypatch):
    """The paper's settings: 16 replicas in pools of 8 on 128 (256K) or 256 (1M) GPUs. The
    GPU-only switches and the cluster's data path are set aside to check the rest here; bf16
    is checked as a GPU host would."""
    from megatron.libra import config

    monkeypatch.setattr(config, "_cuda", lambda: True)
    cfg = TrainConfig.load(
        f"configs/train/{name}.yaml",
        ["optimizer.distributed=false", "transformer_impl=local", "data.source=synthetic"],
    )
    assert cfg.validate(world) == dp
    assert cfg.model.qk_norm and cfg.model.experts % cfg.parallel.ep == 0


def test_a_wide_dtype_is_refused_on_a_gpu(monkeypatch):
    # fp32 / fp64 would fall to the CPU's reference kernel on a GPU: refused before launch
    from megatron.libra import config

    monkeypatch.setattr(config, "_cuda", lambda: True)
    for dtype in ("fp32", "fp64"):
        cfg = TrainConfig.load(CPU_TINY, [f"dtype={dtype}", "optimizer.distributed=false"])
        with pytest.raises(ValueError, match=rf"dtype {dtype} on a GPU: .* set dtype: bf16"):
            cfg._check_rest(4, 2)


def test_a_partial_model_section_keeps_the_documented_defaults(tmp_path):
    # a key left out takes the tiny model's value (docs/config_reference.md), not Qwen3-30B-A3B's
    p = tmp_path / "p.yaml"
    p.write_text("model: {hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 128, layers: 2, "
                 "vocab: 512}\nparallel: {cp: 2, pool_size: 2}\ndata: {context: 128, gbs: 4}\n")
    m = TrainConfig.load(p).model
    assert (m.experts, m.moe_topk, m.moe_ffn) == (1, 0, 0)
    assert m == TrainConfig().model  # the same as an absent section
    m = TrainConfig.load(None, ["model.layers=4"]).model
    assert (m.layers, m.hidden, m.heads, m.vocab, m.moe_topk) == (4, 64, 4, 512, 0)


def test_overrides_may_follow_options(capsys):
    # `--nproc 4 key=value`: the override after the option is applied, not refused
    assert main(["train", "--config", CPU_TINY, "parallel.cp=2", "--nproc", "4",
                 "parallel.pool_size=3"]) == 2
    assert "parallel.pool_size (P=3) must divide" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", CPU_TINY, "--nproc", "4", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_background_save_asks_for_megatron_cores_own_writer_where_there_is_a_choice():
    # megatron-core 0.19's dist_checkpointing.save defaults to NVIDIA Resiliency Extension's
    # writer (async_strategy="nvrx"); the queue the checkpointer drives is megatron-core's own
    from types import SimpleNamespace

    from megatron.libra.checkpoint import _async_save_options

    def save_016(state, path, async_sharded_save=False):
        return None

    def save_019(state, path, async_sharded_save=False, async_strategy="nvrx"):
        return None

    assert _async_save_options(SimpleNamespace(save=save_016)) == {"async_sharded_save": True}
    assert _async_save_options(SimpleNamespace(save=save_019)) == {
        "async_sharded_save": True, "async_strategy": "mcore"}
