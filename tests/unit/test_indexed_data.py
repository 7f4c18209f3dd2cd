"""tools/build_indexed_dataset.py and training on the indexed dataset it writes."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.libra.config import TrainConfig
from megatron.libra.data import IndexedSource

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bid", ROOT / "tools" / "build_indexed_dataset.py")
bid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bid)


def _dataset(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello long context " * 20)
    (texts / "b.txt").write_text("short")
    (texts / "c.txt").write_text("ünïcode ✓ " * 7)
    prefix = str(tmp_path / "ds")
    assert bid.build(texts, prefix) == 3
    return prefix, [(texts / n).read_text() for n in ("a.txt", "b.txt", "c.txt")]


def test_indexed_source_packs_documents_with_next_token_labels(tmp_path):
    prefix, texts = _dataset(tmp_path)
    cfg = TrainConfig.load(
        None,
        [
            "data.source=indexed",
            f"data.path={prefix}",
            "data.context=64",
            "data.gbs=2",
            "model.vocab=257",
            "data.shuffle=false",
        ],
    )
    cfg.validate(1 * 1 * 2)
    src = IndexedSource(cfg)
    seqs = src.step(0, doc_base=0)
    assert len(seqs) == 2 and all(sum(s) == 64 for s in seqs)
    flat = sum(seqs, [])
    first = src.piece(0, flat[0])
    want = bid.encode(texts[0])[: len(first.tokens)]
    assert np.array_equal(first.tokens, want)
    assert np.array_equal(first.labels[:-1], first.tokens[1:])  # next token inside a document
    # the whole corpus comes back in order, each document closed by the EOD id
    allt = np.concatenate([bid.encode(t).tolist() + [bid.EOD] for t in texts])
    got = np.concatenate([src.piece(i, n).tokens for i, n in enumerate(flat)])
    assert np.array_equal(got, allt[: len(got)])
    # the loss denominator counts every token but a document's last
    assert sum(src.label_count(i, n) for i, n in enumerate(flat)) == sum(
        float(src.piece(i, n).mask.sum()) for i, n in enumerate(flat)
    )
    with pytest.raises(KeyError, match="document 99 is not among"):
        src.piece(99, 4)


def test_shuffled_passes_visit_every_document_once(tmp_path):
    prefix, texts = _dataset(tmp_path)
    over = ["data.source=indexed", f"data.path={prefix}", "data.context=16", "data.gbs=1"]
    src = IndexedSource(TrainConfig.load(None, over + ["data.seed=3"]))
    n, total = len(texts), int(src.lengths.sum())
    orders = [src.order(e)[0] for e in range(6)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # a new order per pass
    # the token stream of the first two passes, step by step, follows those orders exactly
    steps = 2 * total // 16
    docs = [d for s in range(steps) for d, off, _ in src._layout(s) if off == 0]
    assert docs[: 2 * n] == list(orders[0]) + list(orders[1])
    again = IndexedSource(TrainConfig.load(None, over + ["data.seed=3"]))
    assert [again._layout(s) for s in (5, 0)] == [src._layout(s) for s in (5, 0)]


def test_builder_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files match"):
        bid.build(tmp_path / "empty", str(tmp_path / "x"))
    assert bid.main([str(tmp_path / "empty"), str(tmp_path / "x")]) == 2


def _train_overrides(prefix: str, steps: int) -> list:
    """Tiny model on the tiny indexed dataset, 2 ranks (one pool of 2 replicas, no CP)."""
    return [
        "data.source=indexed",
        f"data.path={prefix}",
        "data.context=64",
        "model.vocab=257",
        "parallel.cp=1",
        "parallel.pool_size=2",
        "data.gbs=2",
        f"schedule.train_steps={steps}",
        "schedule.warmup_steps=0",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path")
@pytest.mark.slow
def test_training_runs_on_an_indexed_dataset(tmp_path):
    from megatron.libra.train_commands import launch

    prefix, _ = _dataset(tmp_path)
    cfg = TrainConfig.load("configs/train/cpu_tiny.yaml", _train_overrides(prefix, 4))
    hist = launch(cfg, 2, 2)
    assert len(hist) == 4 and all(np.isfinite(h["loss"]) for h in hist)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path")
@pytest.mark.slow
def test_wlb_on_indexed_data_resumes_with_its_held_back_documents(tmp_path):
    """WLB-LLM holds outliers back for later steps (here it even leaves sequences empty); a run
    resumed from a checkpoint must still find the documents read before the checkpoint and
    repeat the same losses."""
    import shutil

    from megatron.libra.train_commands import launch

    prefix, _ = _dataset(tmp_path)
    ck = tmp_path / "ck"
    over = _train_overrides(prefix, 8)
    over += ["system.name=wlb", f"checkpoint.dir={ck}", "checkpoint.save_interval=4"]
    full = launch(TrainConfig.load("configs/train/cpu_tiny.yaml", over), 2, 2)
    assert all(np.isfinite(h["loss"]) for h in full)
    shutil.rmtree(ck / "iter_0000008")
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = launch(TrainConfig.load("configs/train/cpu_tiny.yaml", over), 2, 2)
    assert [h["step"] for h in resumed] == [5, 6, 7, 8]
    for a, b in zip(full[4:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (full, resumed)


def test_damaged_or_out_of_vocabulary_datasets_are_refused_before_launch(tmp_path):
    from megatron.libra.data import check_indexed_dataset

    prefix, _ = _dataset(tmp_path)
    check_indexed_dataset(prefix, 257)  # the builder's byte vocabulary (+1)
    with pytest.raises(ValueError, match=r"ds.bin holds token id .* \(model.vocab is 100"):
        check_indexed_dataset(prefix, 100)
    bin_ = Path(prefix + ".bin")
    data = bin_.read_bytes()
    bin_.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"ds.bin is truncated"):
        check_indexed_dataset(prefix, 257)
    idx = Path(prefix + ".idx")
    idx.write_bytes(b"garbage" * 3)
    with pytest.raises(ValueError, match=r"ds.idx is not a Megatron index"):
        check_indexed_dataset(prefix, 257)
