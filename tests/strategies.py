"""Hypothesis strategies for random workloads and layouts."""

from hypothesis import strategies as st

from libra_ext.planner import LayoutConfig
from libra_ext.workload import ModelConfig


@st.composite
def layouts(draw, max_dp=8):
    """(layout, model): D, C, T, P, S with heads divisible by C*T and a valid GQA grouping."""
    pool = draw(st.sampled_from([1, 2, 4]))
    dp = pool * draw(st.integers(1, max(1, max_dp // pool)))
    cp = draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([1, 2]))
    heads_local = draw(st.sampled_from([1, 2, 4]))
    heads = heads_local * cp * tp
    kv_heads = draw(
        st.sampled_from(
            [
                k
                for k in (1, 2, 4, 8)
                if heads % k == 0
                and (heads_local % (heads // k) == 0 or (heads // k) % heads_local == 0)
            ]
        )
    )
    context = draw(st.sampled_from([64, 256, 1024, 4096]))
    layout = LayoutConfig(dp=dp, cp=cp, tp=tp, pool_size=pool, context=context)
    model = ModelConfig(
        hidden=64,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=8,
        ffn=128,
        layers=2,
        moe_topk=0,
        moe_ffn=0,
    )
    return layout, model


@st.composite
def step_inputs(draw, layout):
    """B packed sequences for the layout: long documents, tiny ones, length-1 ones, empties."""
    m = draw(st.integers(1, 3))
    S = layout.context
    seqs = []
    for _ in range(layout.dp * m):
        kind = draw(st.sampled_from(["one", "many", "mixed", "empty", "ones"]))
        if kind == "one":
            seqs.append([draw(st.integers(1, S))])
        elif kind == "empty":
            seqs.append([])
        elif kind == "ones":
            seqs.append([1] * draw(st.integers(1, min(S, 40))))
        else:
            hi = S if kind == "mixed" else max(1, S // 16)
            docs, room = [], S
            for _ in range(draw(st.integers(1, 12))):
                if room == 0:
                    break
                l = draw(st.integers(1, min(hi, room)))
                docs.append(l)
                room -= l
            seqs.append(docs)
    return seqs
