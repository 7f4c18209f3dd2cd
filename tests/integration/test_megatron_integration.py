"""megatron-core end to end on CPU gloo: a GPTModel whose core attention is Libra's operator
trains with megatron-core's DDP, optimizer and forward-backward schedule, and placing the step's
sequences with Libra (VRSP + moved tiles) gives the same losses as Ulysses' production order."""

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from libra_ext.attention.verify import free_port

pytestmark = pytest.mark.slow  # spawns training or multi-rank processes

STEPS = 3


def _train(rank, world, port, system, out_dir):
    import warnings

    from libra_ext.attention.verify import share_cores

    share_cores(world)

    warnings.simplefilter("ignore")
    import torch.distributed as dist

    from megatron.libra import cpu_shims

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    cpu_shims.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from libra_ext.attention.comm import GroupCache
    from libra_ext.attention.core import AttentionStep, Runtime, check_plan_hash
    from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
    from libra_ext.workload import LengthSource, ModelConfig
    from megatron.libra.batch import make_micro_batch
    from megatron.libra.data import Piece
    from megatron.libra.model import build_gpt

    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model_cfg = ModelConfig(
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        ffn=128,
        layers=2,
        moe_topk=0,
        moe_ffn=0,
        experts=1,
        vocab=128,
    )
    D, S = world, 96
    runtime = Runtime(groups=GroupCache(tp=1, cp=1, dp=D), chunks=2)
    model = build_gpt(model_cfg, system, runtime, max_seq=S)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.finalize_model_grads_func = finalize_model_grads  # the DP gradient all-reduce
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, params_dtype=torch.float32, clip_grad=1.0),
        [ddp],
    )
    planner = Planner(
        LayoutConfig(dp=D, cp=1, pool_size=D, context=S),
        model_cfg,
        PlannerOptions(system=system, block=16),
    )
    src = LengthSource(preset="libra-256k")
    losses, norms = [], []
    for step in range(STEPS):
        seqs = src.step(D, S, seed=7, step=step)
        plan = planner.plan(seqs)
        check_plan_hash(plan)
        s = [i for i in range(plan.n_seq) if plan.seq_replica[i] == rank][0]
        off = plan.seq_doc_offsets
        pieces = []
        for doc in range(off[s], off[s + 1]):
            g = np.random.default_rng([step, int(plan.doc_ids[doc])])
            t = g.integers(0, model_cfg.vocab, size=int(plan.doc_lengths[doc]) + 1)
            pieces.append(Piece(t[:-1], t[1:], np.ones(len(t) - 1, dtype=np.float32)))
        mb = make_micro_batch(pieces, 1, 0, AttentionStep(plan, 0))
        global_tokens = int(plan.doc_lengths.sum())

        def forward_step(_it, m):
            out = m(
                mb.tokens,
                mb.position_ids,
                None,
                labels=mb.labels,
                packed_seq_params=mb.packed_seq_params,
            )

            def loss_fn(per_token):
                local = (per_token.float() * mb.loss_mask).sum()
                # DDP averages gradients over D replicas: scale so the result is the gradient
                # of the global per-token mean.
                return local * D / global_tokens, {"local_sum": local.detach()}

            return out, loss_fn

        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[ddp],
            num_microbatches=1,
            seq_length=mb.tokens.shape[1],
            micro_batch_size=1,
            forward_only=False,
        )
        _, grad_norm, _ = opt.step()
        norms.append(grad_norm)
        total = out[0]["local_sum"].clone()
        dist.all_reduce(total)
        losses.append(float(total) / global_tokens)
    if rank == 0:
        with open(os.path.join(out_dir, f"{system}.json"), "w") as fh:
            json.dump(
                {
                    "losses": losses,
                    "grad_norms": norms,
                    "pool_bytes": runtime.counter.total("pool"),
                    "placement": plan.seq_replica.tolist(),
                },
                fh,
            )
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path")
def test_libra_and_ulysses_train_to_the_same_losses(tmp_path):
    for system in ("ulysses", "libra"):
        mp.spawn(_train, args=(2, free_port(), system, str(tmp_path)), nprocs=2, join=True)
    uly = json.loads((tmp_path / "ulysses.json").read_text())
    lib = json.loads((tmp_path / "libra.json").read_text())
    assert lib["pool_bytes"] > 0 and uly["pool_bytes"] == 0  # libra really moved tiles
    for a, b in zip(uly["losses"], lib["losses"]):
        assert abs(a - b) <= 1e-6 * abs(a), (uly["losses"], lib["losses"])
    assert lib["losses"][-1] < lib["losses"][0]
