"""Each CPU shim is needed: megatron-core fails on CPU without it and works with it. Every case
runs in a fresh interpreter, since the shims patch modules process-wide (two at a time)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.libra import cpu_shims
from tests.processes import with_token

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims apply without a GPU"),
    pytest.mark.slow,  # spawns training or multi-rank processes
]

PRELUDE = """
import os, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from megatron.libra import cpu_shims
from tests.processes import with_token
applied = cpu_shims.apply(only=tuple(x for x in sys.argv[1].split(",") if x) or ("none",))
"""

CASES = {
    "rng_tracker": """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps, tensor_parallel
ps.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1)
with tensor_parallel.get_cuda_rng_tracker().fork():
    a = torch.rand(3)
with tensor_parallel.get_cuda_rng_tracker().fork():
    b = torch.rand(3)
assert not torch.equal(a, b)
""",
    "current_device": """
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
emb = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
assert emb(8).shape[0] == 8
""",
    "cuda_literals": """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
norm = get_grad_norm_fp32([torch.full((4,), 2.0)], norm_type=2, grad_stats_parallel_group=None)
assert abs(norm - 4.0) < 1e-6, norm
""",
    "moe_without_te": """
from megatron.core.transformer.moe.moe_utils import router_gating_linear
out = router_gating_linear(torch.randn(5, 8), torch.randn(4, 8), None, torch.float32)
assert out.shape == (5, 4)
""",
    "checkpoint_preload": """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
import tempfile
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import ShardedTensor
d = tempfile.mkdtemp()
dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, d)
out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, d)
assert torch.equal(out["w"], torch.arange(6.0)), out
""",
    "async_checkpoint": """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
import tempfile
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
d, w, queue = tempfile.mkdtemp(), torch.arange(6.0), AsyncCallsQueue()
import inspect  # megatron-core's own queue takes its own strategy (0.19's default is nvrx)
kw = {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dc.save).parameters else {}
queue.schedule_async_request(dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, d,
                                     async_sharded_save=True, **kw))
w.zero_()  # training goes on; the checkpoint holds the values at save time
queue.maybe_finalize_async_calls(blocking=True)
queue.close()
out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, d)
assert torch.equal(out["w"], torch.arange(6.0)), out
""",
    "recompute_rng": """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps, tensor_parallel
ps.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1)
x = torch.randn(4, requires_grad=True)
y = tensor_parallel.checkpoint(lambda t: (t * t).sum(), False, x)
y.backward()
assert torch.allclose(x.grad, 2 * x.detach()), x.grad
""",
    "p2p_synchronize": """
import torch.multiprocessing as mp
def stage(rank, port):  # (forked: the shims applied above hold in both stages)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    cfg = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    comm = P2PCommunicator(pp_group=ps.get_pipeline_model_parallel_group(), config=cfg)
    if rank == 0:
        comm.send_forward(torch.arange(6.0).view(3, 1, 2), False)
    else:
        got = comm.recv_forward((3, 1, 2), False)
        assert torch.equal(got, torch.arange(6.0).view(3, 1, 2)), got
mp.start_processes(stage, args=(sys.argv[2],), nprocs=2, start_method="fork")
""",
    "tied_embeddings": """
import torch.multiprocessing as mp
def stage(rank, port):  # (forked: the shims applied above hold in both stages)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                            use_cpu_initialization=True, pipeline_model_parallel_size=2,
                            pipeline_dtype=torch.float32)
    m = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8,
                 pre_process=rank == 0, post_process=rank == 1,
                 share_embeddings_and_output_weights=True)
    w = m.shared_embedding_or_output_weight().detach().clone()
    both = [torch.zeros_like(w), torch.zeros_like(w)]
    dist.all_gather(both, w)
    assert torch.equal(both[0], both[1])  # the last stage's copy is the first stage's embedding
mp.start_processes(stage, args=(sys.argv[2],), nprocs=2, start_method="fork")
""",
    "grad_sync_stream": """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
ps.initialize_model_parallel()
cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                        use_cpu_initialization=True)
m = DistributedDataParallel(cfg, DistributedDataParallelConfig(), torch.nn.Linear(4, 4))
m(torch.ones(2, 4)).sum().backward()
m.finish_grad_sync()
assert all(p.main_grad.abs().sum() > 0 for p in m.parameters())
""",
    "megatron_training": """
from megatron.core.timers import Timers
timers = Timers(log_level=2, log_option="minmax")
timers("step", log_level=0).start()
timers("step").stop()
assert timers("step").elapsed(reset=False) >= 0.0
""",
    "grad_clip_fp32": """
from megatron.core.optimizer import clip_grads
p = torch.nn.Parameter(torch.ones(4))
p.grad = torch.full((4,), 3.0)
clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5), p.grad
""",
}


def _run_cases(cases: list[tuple[list[str], str]]) -> list[subprocess.CompletedProcess]:
    """Each (shims, body) as PRELUDE + body in a fresh interpreter (the shims patch modules
    process-wide, and a process forked from one that imported torch fails differently on CUDA),
    two at a time: each keeps about one core busy."""
    from libra_ext.distributed import free_port

    token = uuid.uuid4().hex  # in the environment of every process the cases start
    env = dict(os.environ, LIBRA_SHIM_CASES=token)

    def run(case):
        shims, body = case
        code = PRELUDE.replace('("none",)', "()") + textwrap.dedent(body)
        return subprocess.run([sys.executable, "-c", code, ",".join(shims), str(free_port())],
                              capture_output=True, text=True, timeout=300, env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(run, cases))
    deadline = time.monotonic() + 10
    while (left := with_token(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} processes the cases started outlived them"
    return runs


@pytest.fixture(scope="module")
def shim_runs() -> dict:
    """shim -> (its case without the shim, with every shim), for every shim that applies here."""
    names = [n for n in sorted(CASES) if cpu_shims.applies(n)[0]]
    cases = []
    for name in names:
        cases += [([s for s in cpu_shims.SHIMS if s != name], CASES[name]),
                  (list(cpu_shims.SHIMS), CASES[name])]
    runs = _run_cases(cases)
    return {n: (runs[2 * i], runs[2 * i + 1]) for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def applied_runs() -> dict:
    """shim -> what apply(only=(shim,)) returned, for every shim some versions do not need."""
    names = sorted(cpu_shims.APPLIES)
    return dict(zip(names, _run_cases([([n], "print(applied)") for n in names])))


@pytest.mark.parametrize("shim", sorted(CASES))
def test_shim_is_needed_and_sufficient(shim, request):
    ok, why = cpu_shims.applies(shim)
    if not ok:
        pytest.skip(f"{shim} has nothing to patch here ({why}); apply() leaves it out")
    without, with_all = request.getfixturevalue("shim_runs")[shim]
    assert without.returncode != 0, f"{shim}: megatron-core worked on CPU without the shim"
    assert any(w in without.stderr for w in ("CUDA", "cuda", "FloatTensor", "te_general_gemm"))
    assert with_all.returncode == 0, with_all.stderr[-2000:]


@pytest.mark.parametrize("shim", sorted(cpu_shims.APPLIES))
def test_a_shim_is_applied_exactly_where_megatron_core_has_what_it_patches(shim, request):
    # (in a fresh interpreter: applying patches modules process-wide)
    ok, _ = cpu_shims.applies(shim)
    run = request.getfixturevalue("applied_runs")[shim]
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == (f"['{shim}']" if ok else "[]")


def test_apply_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown shim 'gpu'"):
        cpu_shims.apply(only=("gpu",))
