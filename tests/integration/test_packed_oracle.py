"""Packed against unpacked: one step of the Trainer's own path (plan, THD micro-batches, Libra's
operator, megatron-core's schedule, DDP's gradient reduction) against megatron-core's stock
GPTModel with its local DotProductAttention, run on every document alone as an unpacked sequence
from the same weights, combined as the project's loss is defined: the sum of every labelled
token's loss over the global batch, divided by the batch's labelled tokens. fp64; the loss and
every parameter's gradient element-wise.

What it catches: attention crossing document boundaries, RoPE positions that do not restart per
document (visible under CP >= 2, where a rank's tokens are not contiguous), labels or loss masks
wrong at boundaries, and a loss averaged per micro-batch, CP rank or replica instead of per token
(the reported loss can stay exact while the gradients are off: they are compared directly).
Documents of 1 and 2 tokens, odd lengths and one full-context document."""

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from libra_ext.distributed import free_port, run_ranks

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path"),
    pytest.mark.slow,  # spawns gloo processes
]

CONTEXT = 64
# 4 packed sequences of at most 64 tokens: lengths 1 and 2, odd lengths, one full-context
SEQUENCES = [[1, 2, 61], [64], [3, 5, 7, 9, 11, 13, 15, 1], [2, 33, 29]]
MODEL = ["model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
         "model.ffn=64", "model.layers=2", "model.vocab=64", "model.moe_topk=0",
         "model.experts=1", "model.moe_ffn=0"]
BASE = MODEL + [f"data.context={CONTEXT}", "data.gbs=4", "data.source=synthetic",
                "dtype=fp64", "schedule.train_steps=1", "schedule.warmup_steps=0",
                "system.chunks=2"]
REL = 1e-6


def _global_params(chunks) -> dict:
    """name -> parameter over this rank's chunks, layers renamed by their global number."""
    out = {}
    for chunk in chunks:
        layers = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
        for name, p in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(layers[int(parts[2])])
            out[".".join(parts)] = p
    return out


def _reference(params: dict, pieces: list, model_cfg) -> tuple:
    """Loss and gradients of megatron-core's stock GPTModel (local spec) on every document
    alone, from `params`: the sum of the labelled tokens' losses over their count."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.libra.model import transformer_config

    cfg = transformer_config(model_cfg, torch.float64)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=model_cfg.vocab, max_sequence_length=CONTEXT,
                   position_embedding_type="rope", rotary_base=model_cfg.rope_base)
    mine = dict(gpt.named_parameters())
    assert set(mine) == set(params), sorted(set(mine) ^ set(params))
    with torch.no_grad():
        for name, p in mine.items():
            p.data = params[name].to(torch.float64).clone()
    total = torch.zeros((), dtype=torch.float64)
    for tokens, labels, mask in pieces:
        n = len(tokens)
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        per_token = gpt(torch.as_tensor(tokens).long()[None], torch.arange(n)[None], causal,
                        labels=torch.as_tensor(labels).long()[None])
        total = total + (per_token * torch.as_tensor(mask, dtype=torch.float64)[None]).sum()
    loss = total / sum(sum(mask) for _, _, mask in pieces)
    loss.backward()
    return float(loss), {name: p.grad.detach().clone() for name, p in mine.items()}


def _document(trainer, batch, i: int, piece) -> tuple:
    """(tokens, labels, loss mask) of the plan's document i as the reference reads it. Synthetic
    data: the source's piece (its labels are the next tokens of one drawn stream). Indexed data:
    rebuilt from the dataset file itself (megatron-core's IndexedDataset): the piece's tokens,
    each labelled by the document's next token, the document's last token unlabelled."""
    src = trainer.sampler.source
    if trainer.cfg.data.source != "indexed":
        return piece.tokens.tolist(), piece.labels.tolist(), piece.mask.tolist()
    plan = batch.plan
    gid = int(plan.doc_ids[i]) + (0 if trainer.cfg.system.name == "wlb" else batch.doc_base)
    doc, off, n = src._lookup(gid)  # which document and where the step's layout cut it
    full = [int(t) for t in src.ds.get(int(src.index[doc]))]
    tokens = full[off:off + n]
    labels = [full[j + 1] if j + 1 < len(full) else 0 for j in range(off, off + n)]
    mask = [1.0 if j + 1 < len(full) else 0.0 for j in range(off, off + n)]
    assert len(tokens) == n == int(plan.doc_lengths[i])
    return tokens, labels, mask


def _worker(rank: int, world: int, port: int, out: str, layout: list, systems: list) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    from libra_ext.workload import PackedBatch
    from megatron.libra import sources as data_mod
    from megatron.libra.config import TrainConfig
    from megatron.libra.train import Trainer

    # synthetic data: the step's packed sequences, fixed (every system plans these)
    data_mod.SyntheticSource.step = lambda self, step, doc_base=0: PackedBatch.from_lists(
        SEQUENCES)
    results = {}
    for system in systems:  # "name" or "name:distca_server"
        name, _, server = system.partition(":")
        cfg = TrainConfig.load(None, BASE + layout + [f"system.name={name}"] + (
            [f"system.distca_server={server}"] if server else []))
        trainer = Trainer(cfg, rank, world)
        try:
            params = _global_params(trainer.chunks)
            dtypes = sorted({str(p.dtype) for p in params.values()})
            weights = {n: p.detach().clone() for n, p in params.items()}
            batch = trainer.sampler.next()
            outs = trainer.forward_backward(trainer.micro_batches(batch),
                                            float(batch.label_tokens))
            local = float(sum(float(x["local_sum"]) for x in outs))
            grads = {n: p.main_grad.detach().clone() for n, p in params.items()}
            # every executed document once: the CP rank 0 of each replica sends its pieces
            pieces = ([_document(trainer, batch, i, p) for i, p in sorted(batch.pieces.items())]
                      if trainer.c == 0 and parallel_state.is_pipeline_first_stage() else [])
            mine = {"weights": weights, "grads": grads, "local": local, "pieces": pieces,
                    "dtypes": dtypes, "label_tokens": int(batch.label_tokens),
                    "executed": int(len(batch.plan.doc_lengths)),
                    "moved": float(batch.plan.moved_token_fraction)}
            every = [None] * world
            dist.all_gather_object(every, mine)
        finally:
            trainer.close()
        # the reference: one stock model, no parallelism (parallel_state made again, on every
        # rank: its groups are collective), computed on rank 0
        ps = parallel_state
        ps.initialize_model_parallel()
        if rank == 0:
            weights, grads, pieces = {}, {}, []
            for r in every:  # each pipeline stage's parameters (replicas hold equal copies)
                weights.update(r["weights"])
                pieces += r["pieces"]
                for n, g in r["grads"].items():
                    if n in grads:
                        assert torch.equal(grads[n], g), f"{system}: {n} differs across ranks"
                    grads[n] = g
            tp = cfg.parallel.tp
            loss = sum(r["local"] for r in every) / tp / every[0]["label_tokens"]
            ref_loss, ref_grads = _reference(weights, pieces, cfg.model)
            worst = {}
            for n, g in ref_grads.items():
                scale = float(g.abs().max()) or 1.0
                worst[n] = float((grads[n].to(torch.float64) - g).abs().max()) / scale
            results[system] = {
                "loss": loss, "ref_loss": ref_loss, "worst_grad": max(worst.values()),
                "worst_name": max(worst, key=worst.get), "dtypes": sorted(
                    {d for r in every for d in r["dtypes"]}),
                "documents": len(pieces), "executed": every[0]["executed"],
                "label_tokens": every[0]["label_tokens"], "moved": every[0]["moved"],
                "ref_label_tokens": int(sum(sum(m) for _, _, m in pieces)),
            }
        dist.barrier()
        ps.destroy_model_parallel()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def _run(tmp_path, world: int, layout: list, systems: list) -> dict:
    out = str(tmp_path / "oracle.json")
    run_ranks(_worker, (world, free_port(), out, layout, systems), world)
    with open(out) as fh:
        return json.load(fh)


def _check(res: dict, systems: list, documents: int | None) -> None:
    """documents: how many the step holds (None: indexed data, counted by the run)."""
    assert set(res) == set(systems)
    for system, r in res.items():
        assert r["dtypes"] == ["torch.float64"], (system, r["dtypes"])
        # every document ran once this step (WLB-LLM may hold some back: then fewer ran, but
        # each one that ran is compared)
        assert r["documents"] == r["executed"], (system, r)
        if system != "wlb" and documents is not None:
            assert r["documents"] == documents, (system, r)
        assert r["label_tokens"] == r["ref_label_tokens"], (system, r)  # the denominator
        assert abs(r["loss"] - r["ref_loss"]) <= REL * abs(r["ref_loss"]), (system, r)
        assert r["worst_grad"] <= REL, (system, r)


@pytest.mark.parametrize("layout,world,systems", [
    # 2 replicas of CP 2 in one pool: tiles move between replicas; every system
    (["parallel.cp=2", "parallel.pool_size=2"], 4, ["libra", "ulysses", "wlb", "distca"]),
    # CP 4, one replica: per-document zigzag over 4 ranks, RoPE from positions
    (["parallel.cp=4", "parallel.pool_size=1"], 4, ["libra", "ulysses"]),
    # no CP, 2 replicas in one pool; DistCA as deployed (every GPU a server: here a replica)
    (["parallel.cp=1", "parallel.pool_size=2"], 2, ["libra", "wlb", "distca:gpu"]),
    # 2 pipeline stages of CP 2
    (["parallel.cp=2", "parallel.pool_size=1", "parallel.pp=2"], 4, ["libra"]),
], ids=["cp2-dp2-pool2", "cp4", "cp1-dp2-pool2", "pp2-cp2"])
def test_packed_step_equals_every_document_alone(tmp_path, layout, world, systems):
    res = _run(tmp_path, world, layout, systems)
    _check(res, systems, sum(len(s) for s in SEQUENCES))
    if "parallel.pool_size=2" in layout:  # tiles really moved between the replicas
        assert res["libra"]["moved"] > 0 and res.get("distca", {"moved": 1})["moved"] > 0
        assert res.get("distca:gpu", {"moved": 1})["moved"] > 0


def test_indexed_documents_equal_every_document_alone(tmp_path):
    """A Megatron indexed dataset (UTF-8 bytes, each document closed by id 256): documents of
    1, 2 and odd byte counts and one longer than the context, cut at sequence boundaries; the
    reference rebuilds every label and mask from the dataset file."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "bid", root / "tools" / "build_indexed_dataset.py")
    bid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bid)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["a", "bc", "def", "ghijk", "x" * 9, "the quick brown fox " * 6, "lorem ipsum " * 3,
             "z" * 13, "packed documents " * 2, "q" * 31, "m" * 7, "end"]
    for k, text in enumerate(texts):
        (corpus / f"{k:02d}.txt").write_text(text)
    prefix = str(tmp_path / "bytes")
    assert bid.main([str(corpus), prefix, "--tokenizer", "bytes"]) == 0
    layout = ["parallel.cp=2", "parallel.pool_size=2", "data.source=indexed",
              f"data.path={prefix}", "data.split='100,0,0'", "model.vocab=264"]
    res = _run(tmp_path, 4, layout, ["libra", "wlb"])
    _check(res, ["libra", "wlb"], None)
    # the step's last tokens of a document carry no label: fewer labelled tokens than tokens
    assert res["libra"]["label_tokens"] < 4 * CONTEXT
