"""Bad input: one clear ValueError naming the field; the C++ core never crashes on Python input."""

import copy
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from libra_ext import _planner as core
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions, plan_step
from libra_ext.workload import ModelConfig

LAYOUT = LayoutConfig(dp=2, cp=2, pool_size=2, context=64)
MODEL = ModelConfig(
    hidden=64, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
)


@pytest.mark.parametrize(
    "seqs, message",
    [
        ([[3, 0], [5]], r"sequences\[0\]\[1\] must be positive, got 0"),
        ([[3], [-2]], r"sequences\[1\]\[0\] must be positive, got -2"),
        ([[60, 10], [5]], r"sequences\[0\] holds 70 tokens, more than context 64"),
        ([[65], [5]], r"sequences\[0\]\[0\] = 65 exceeds the limit 64"),
        ([[3], [4], [5]], r"gbs \(B=3\) must be divisible by dp \(D=2\)"),
        ([], r"sequences is empty"),
        ([[3], ["x"]], r"sequences\[1\]\[0\] must be an integer, got 'x'"),
        ([[3], [2.5]], r"sequences\[1\]\[0\] must be an integer, got 2.5"),
        ([[3], 7], r"sequences\[1\] must be a list of document lengths, got 7"),
        (7, r"sequences must be a list of lists of document lengths, got 7"),
        ([[3], [2**70]], r"sequences\[1\]\[0\] = \d+ is out of range"),
    ],
)
def test_bad_sequences(seqs, message):
    with pytest.raises(ValueError, match=message):
        plan_step(seqs, LAYOUT, MODEL)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_bad_sequence_is_named_alike_whatever_reads_the_input(threads):
    """The input is read on the planner's threads, each a range of sequences; the error names the
    first bad entry, as a single thread does."""
    seqs = [[3, 4]] * 40
    seqs[13] = [3, -1]
    seqs[31] = [0]
    with pytest.raises(ValueError, match=r"sequences\[13\]\[1\] must be positive, got -1"):
        plan_step(seqs, LAYOUT, MODEL, PlannerOptions(threads=threads))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dp=6, cp=1, pool_size=4, context=64), r"pool_size \(P=4\) must divide dp \(D=6\)"),
        (dict(dp=0, cp=1, pool_size=1, context=64), r"dp must be positive"),
        (dict(dp=2, cp=1, pool_size=1, context=0), r"context must be positive"),
        (dict(dp=2, cp=1, pool_size=1, context=2**31), r"context = \d+ exceeds"),
        (dict(dp=2, cp="2", pool_size=1, context=64), r"cp must be an integer"),
    ],
)
def test_bad_layout(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayoutConfig(**kwargs)


def test_heads_must_divide_by_cp_times_tp():
    layout = LayoutConfig(dp=2, cp=4, tp=2, pool_size=2, context=64)
    model = ModelConfig(
        hidden=64, heads=12, kv_heads=4, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    with pytest.raises(ValueError, match=r"model.heads \(h=12\) must be divisible by cp\*tp \(8\)"):
        plan_step([[3], [4]], layout, model)


def test_kv_heads_must_group_with_the_slice():
    layout = LayoutConfig(dp=2, cp=2, pool_size=2, context=64)
    model = ModelConfig(
        hidden=64, heads=12, kv_heads=4, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )  # slice of 6 heads, KV groups of 3: fine
    plan_step([[3], [4]], layout, model)
    model = ModelConfig(
        hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    layout = LayoutConfig(dp=2, cp=8, pool_size=2, context=64)  # 1 head a rank, groups of 4: fine
    plan_step([[3], [4]], layout, model)
    model = ModelConfig(
        hidden=64, heads=12, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    layout = LayoutConfig(dp=2, cp=4, pool_size=2, context=64)  # 3 heads a rank inside a group of 6
    plan_step([[3], [4]], layout, model)
    model = ModelConfig(
        hidden=64, heads=24, kv_heads=4, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    layout = LayoutConfig(dp=2, cp=6, pool_size=2, context=64)  # 4 heads a rank, groups of 6
    with pytest.raises(ValueError, match=r"model.kv_heads \(4\)"):
        plan_step([[3], [4]], layout, model)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block=0), r"block must be a positive integer, got 0"),
        (dict(block=-5), r"block must be a positive integer, got -5"),
        (dict(system="megatron"), r"system must be one of libra, ulysses, wlb, distca"),
        (dict(head_group=-1), r"head_group must be >= 0"),
        (dict(epsilon=-0.1), r"epsilon must be >= 0"),
        (dict(dtype_bytes=0), r"dtype_bytes must be positive"),
        (dict(epsilon="a"), r"epsilon must be a number"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlannerOptions(**kwargs)


def test_tiny_block_that_would_explode_is_refused():
    layout = LayoutConfig(dp=2, cp=1, pool_size=2, context=2**30)
    model = ModelConfig(
        hidden=64, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    message = r"about \d+ tiles .*raise block \(1\) or head_group \(4\)"
    with pytest.raises(ValueError, match=message):
        Planner(layout, model, PlannerOptions(block=1)).plan([[2**30], [2**30]])


def test_per_document_cp_counts_its_2c_tiles_per_document_against_the_budget():
    # 2^23 documents of 16 tokens at C = 4 would be 2^26 tiles: refused before any is made
    layout = LayoutConfig(dp=1, cp=4, pool_size=1, context=2**27)
    model = ModelConfig(
        hidden=64, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=1, moe_topk=0, moe_ffn=0
    )
    with pytest.raises(ValueError, match=r"per-document CP makes 2C tiles per document"):
        Planner(layout, model, PlannerOptions(system="wlb")).plan([[16] * 2**23], flush=True)


def test_planner_state_rejects_garbage():
    with pytest.raises(ValueError, match="version"):
        core.PlannerState.deserialize([7, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="length does not match"):
        core.PlannerState.deserialize([1, 0, 0, 2, 0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"planner state entry\[0\]"):
        core.PlannerState.deserialize([1, 0, 0, 1, 0, 5, -1, 0])


# --- fuzz: random malformed input straight at the binding -------------------------------------

_atoms = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-5, 300),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
)
_seqs = st.one_of(
    st.lists(st.lists(_atoms, max_size=6), max_size=8),
    st.lists(st.lists(st.integers(-3, 200), max_size=6), max_size=8),
    _atoms,
)


@given(
    seqs=_seqs,
    dp=_atoms,
    cp=_atoms,
    tp=_atoms,
    pool=_atoms,
    context=_atoms,
    heads=_atoms,
    kv=_atoms,
    block=_atoms,
    head_group=_atoms,
    system=st.sampled_from(["libra", "ulysses", "wlb", "distca", "bogus"]),
)
def test_fuzz_binding_never_crashes(
    seqs, dp, cp, tp, pool, context, heads, kv, block, head_group, system
):
    try:
        layout = core.Layout()
        layout.dp, layout.cp, layout.tp, layout.pool, layout.context = dp, cp, tp, pool, context
        model = core.ModelDims()
        model.heads, model.kv_heads = heads, kv
        opt = core.PlanOptions()
        opt.system = system
        opt.block, opt.head_group = block, head_group
        out = core.plan_step(seqs, layout, model, opt, core.PlannerState(), True)
    except (ValueError, TypeError):
        return
    # whatever was accepted produced a well-formed plan
    assert len(out["seq_replica"]) == len(seqs)
    assert out["max_over_mean"] >= 1.0 - 1e-9 or sum(out["rank_load"]) == 0


def test_fuzz_random_small_layouts_with_valid_types():
    rng = random.Random(0)
    for _ in range(3000):
        layout = core.Layout()
        layout.dp, layout.cp, layout.tp = rng.randint(-1, 5), rng.randint(-1, 5), rng.randint(-1, 3)
        layout.pool, layout.context = rng.randint(-1, 5), rng.choice([-1, 0, 1, 7, 64])
        model = core.ModelDims()
        model.heads, model.kv_heads = rng.randint(-1, 9), rng.randint(-1, 9)
        model.head_dim = rng.randint(-1, 4)
        opt = core.PlanOptions()
        opt.system = rng.choice(["libra", "ulysses", "wlb", "distca"])
        opt.block, opt.head_group = rng.randint(-2, 70), rng.randint(-1, 5)
        opt.epsilon = rng.choice([-1.0, 0.0, 0.02, float("nan"), float("inf")])
        opt.max_tile_share = rng.choice([-1.0, 0.0, 0.1, float("nan")])
        seqs = [
            [rng.randint(-2, 70) for _ in range(rng.randint(0, 4))]
            for _ in range(rng.randint(0, 8))
        ]
        try:
            core.plan_step(seqs, layout, model, opt, core.PlannerState(), rng.random() < 0.5)
        except ValueError:
            pass


_PROGRAM_FIELDS = (
    "doc_lengths", "seq_doc_offsets", "seq_replica", "seq_slot", "send_order",
    "send_group_offsets", "tile_doc", "tile_doc_count", "tile_q_start", "tile_q_len",
    "tile_kv_start", "tile_kv_len", "tile_head_start", "tile_head_count", "tile_owner",
    "tile_executor", "tile_cp",
)


def test_fuzz_program_compiler_never_crashes():
    """The C++ program compiler (meta.compile_slot) on plans with corrupted arrays and scalars:
    a program or a ValueError naming the field, never a crash."""
    rng = random.Random(0)
    layout = LayoutConfig(dp=4, cp=2, pool_size=4, context=256)
    model = ModelConfig(hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=64, layers=1,
                        moe_topk=0, moe_ffn=0)
    seqs = [[100, 60, 90], [256], [1] * 40, [200, 56], [30] * 8, [], [128, 128], [7, 249]]
    clean = Planner(layout, model, PlannerOptions(system="libra", block=16,
                                                  max_tile_share=0.01)).plan(seqs)
    values = [-(2**62), -7, -1, 0, 1, 2, 3, 5, 64, 255, 256, 10**6, 2**62]
    refused = 0
    for _ in range(600):
        plan = copy.copy(clean)
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(_PROGRAM_FIELDS)
            arr = np.array(getattr(plan, name), copy=True)
            if len(arr) and rng.random() < 0.8:
                arr[rng.randrange(len(arr))] = rng.choice(values)
            else:
                arr = arr[: rng.randint(0, len(arr))]
            setattr(plan, name, arr)
        if rng.random() < 0.2:
            field = rng.choice(["heads_local", "kv_heads_local", "exchange_pool", "cp"])
            setattr(plan, field, rng.choice(values[:9]))
        try:
            core.compile_slots(plan, rng.randrange(4), [rng.randrange(plan.slots)],
                               rng.randint(1, 4))
        except ValueError:
            refused += 1
    assert 0 < refused < 600


def test_an_interpreter_exiting_while_a_thread_plans_exits_cleanly():
    # the sampler plans in a daemon thread with the GIL released; when the process ends while
    # it is inside the planner, Python (< 3.14) would end that thread by unwinding its C++
    # frames when it asks for the GIL back, which aborts the process ("terminate called
    # without an active exception"); the binding parks the thread instead
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import threading, time
        from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
        from libra_ext.workload import LengthSource, ModelConfig
        lay = LayoutConfig(dp=256, cp=8, pool_size=8, context=262144)
        step = LengthSource(preset="libra-256k").step(256, 262144, 0, 0)
        p = Planner(lay, ModelConfig(), PlannerOptions(system="libra", threads=1))
        started = threading.Event()
        def plan_forever():
            started.set()
            while True:
                p.plan(step)
        threading.Thread(target=plan_forever, daemon=True).start()
        started.wait()
        time.sleep(0.05)
    """)
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "terminate" not in r.stderr, (r.returncode, r.stderr[-500:])


def test_samplers_still_staging_are_stopped_before_the_interpreter_exits():
    # a daemon thread inside a torch op when the interpreter ends it aborts the process (torch
    # releases the GIL in most ops and takes it back through noexcept frames); the sampler's
    # thread stages with torch ops one step ahead, and Megatron-LM's loop exits without closing
    # its samplers - so every sampler still running is stopped and joined at exit
    import subprocess
    import sys
    import textwrap

    hazard = textwrap.dedent("""
        import threading, time, torch
        x = torch.randn(256, 256)
        def work():
            while True:
                torch.mm(x, x)
        threading.Thread(target=work, daemon=True).start()
        time.sleep(0.05)
    """)
    r = subprocess.run([sys.executable, "-c", hazard], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "terminate called" in r.stderr, (r.returncode, r.stderr[-300:])
    script = textwrap.dedent("""
        import atexit
        held = {}
        # (registered first, so it runs after the samplers' own exit hook)
        atexit.register(lambda: print("alive at exit:", held["s"]._thread.is_alive()))
        from megatron.libra.config import TrainConfig
        from megatron.libra.steps import StepSampler, new_planner
        cfg = TrainConfig.load("configs/train/cpu_tiny.yaml", [
            "data.context=16384", "data.gbs=8", "parallel.cp=2", "parallel.pool_size=2"])
        held["s"] = s = StepSampler(cfg, new_planner(cfg, 2, 4), replica=0, cp_rank=0,
                                    stop_step=10**9)
        s.next()  # its thread plans and stages the next steps
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and "alive at exit: False" in r.stdout, (r.returncode,
                                                                     r.stdout[-300:],
                                                                     r.stderr[-500:])
