"""The operator and the model agree with megatron-core's parallel_state: the runtime's Ulysses
all-to-all runs on megatron-core's own CP group, and a TransformerConfig whose parallel sizes
differ from parallel_state is refused naming the field."""

import json
import os
import warnings

import pytest
import torch.distributed as dist

from libra_ext.attention.core import LibraCoreAttention
from libra_ext.distributed import free_port, run_ranks

pytestmark = pytest.mark.slow  # spawns gloo processes


def _worker(rank: int, world: int, port: int, out: str) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.libra import cpu_shims

    cpu_shims.apply()
    from megatron.core import parallel_state as ps

    from libra_ext.attention.comm import GroupCache
    from libra_ext.workload import ModelConfig
    from megatron.libra.model import check_parallel_agreement, transformer_config

    ps.initialize_model_parallel(context_parallel_size=world, order="tp-cp-ep-dp-pp")
    res = {}
    groups = GroupCache(tp=1, cp=world, dp=1, cp_group=ps.get_context_parallel_group())
    res["same_group"] = groups.cp_group() is ps.get_context_parallel_group()
    res["label"] = groups.label(groups.cp_group())
    try:  # a group with other ranks than the layout's CP group
        GroupCache(tp=1, cp=world, dp=1, cp_group=ps.get_data_parallel_group())
    except ValueError as e:
        res["wrong_group"] = str(e)
    model = ModelConfig(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=1, vocab=64)
    check_parallel_agreement(
        transformer_config(model, context_parallel_size=world, cp_comm_type="a2a")
    )
    for field, kw in (
        ("context_parallel_size", dict(context_parallel_size=1)),
        ("tensor_model_parallel_size", dict(context_parallel_size=world,
                                            tensor_model_parallel_size=2)),
    ):
        try:
            check_parallel_agreement(transformer_config(model, **kw))
        except ValueError as e:
            res[field] = str(e)
    with open(f"{out}/{rank}.json", "w") as fh:
        json.dump(res, fh)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_runtime_uses_megatron_cp_group_and_config_must_agree(tmp_path):
    run_ranks(_worker, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        res = json.loads((tmp_path / f"{rank}.json").read_text())
        assert res["same_group"] and res["label"] == "context-parallel group [0, 1]"
        assert "cp_group holds ranks" in res["wrong_group"] and "[0, 1]" in res["wrong_group"]
        for field in ("context_parallel_size", "tensor_model_parallel_size"):
            assert f"TransformerConfig.{field}" in res[field] and "parallel_state" in res[field]


def test_operator_refuses_a_cp_comm_type_it_does_not_run():
    LibraCoreAttention(cp_comm_type="a2a")
    with pytest.raises(ValueError, match="cp_comm_type must be 'a2a'.*'p2p'"):
        LibraCoreAttention(cp_comm_type="p2p")
