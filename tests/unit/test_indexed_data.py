"""tools/build_indexed_dataset.py and training on the indexed dataset it writes."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.libra.config import TrainConfig
from megatron.libra.sources import IndexedSource

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
    assert bid.build(texts, prefix, tokenizer="bytes") == 3
    return prefix, [(texts / n).read_text() for n in ("a.txt", "b.txt", "c.txt")]


def _corpus(tmp_path, lines: int = 400):
    """A folder tree of text files (found recursively), one document per line."""
    root = tmp_path / "corpus"
    (root / "part" / "deeper").mkdir(parents=True)
    words = ["long", "context", "attention", "straggler", "packed", "sequence", "pool",
             "replica", "tile", "ünïcode", "✓", "Libra", "Megatron"]
    rng = np.random.default_rng(0)
    for i, sub in enumerate([root, root / "part", root / "part" / "deeper"]):
        text = "\n".join(" ".join(rng.choice(words, size=rng.integers(3, 40)))
                         for _ in range(lines // 3))
        (sub / f"f{i}.txt").write_text(text + "\n")
    (root / "part" / "skip.md").write_text("not matched by *.txt")
    return root


def test_the_default_bpe_tokenizer_round_trips_and_fits_the_tiny_config(tmp_path):
    from tokenizers import Tokenizer

    from megatron.libra.sources import check_data, tokenizer_size

    root = _corpus(tmp_path)
    prefix = str(tmp_path / "bpe")
    n = bid.build(root, prefix, per_line=True)
    docs = [ln for f in sorted(root.rglob("*.txt")) for ln in f.read_text().splitlines() if ln]
    assert n == len(docs) and n > 300  # all three files, subfolders included
    tok = Tokenizer.from_file(prefix + ".tokenizer.json")
    eod = tok.token_to_id(bid.EOD_TOKEN)
    assert tokenizer_size(Path(prefix + ".tokenizer.json")) == tok.get_vocab_size() <= 512
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    for i in (0, 1, n // 2, n - 1):  # every document decodes back to its text, then EOD
        ids = np.asarray(ds[i]).tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        assert tok.decode(ids[:-1]) == docs[i]
    del ds
    cfg = TrainConfig.load("configs/train/cpu_tiny.yaml",
                           ["data.source=indexed", f"data.path={prefix}"])
    cfg.validate(4)
    check_data(cfg)  # the tiny config reads what the tool writes by default
    small = TrainConfig.load("configs/train/cpu_tiny.yaml",
                             ["data.source=indexed", f"data.path={prefix}", "model.vocab=300"])
    with pytest.raises(ValueError, match=r"(holds token id|smaller than the dataset's tokenizer)"):
        check_data(small)
    # an existing tokenizers file is used as it is, and kept beside the new dataset
    other = str(tmp_path / "again")
    assert bid.build(root, other, per_line=True, tokenizer=prefix + ".tokenizer.json") == n
    assert Path(other + ".bin").read_bytes() == Path(prefix + ".bin").read_bytes()
    assert Path(other + ".tokenizer.json").is_file()
    # both also as a HuggingFace tokenizer folder (Megatron-LM's --tokenizer-type
    # HuggingFaceTokenizer --tokenizer-model PREFIX.hf_tokenizer), end of document as eos
    import json

    for p in (prefix, other):
        folder = bid.hf_tokenizer_dir(p)
        assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab() == tok.get_vocab()
        conf = json.loads((folder / "tokenizer_config.json").read_text())
        assert conf["eos_token"] == bid.EOD_TOKEN


def test_builder_refuses_bad_outputs_and_tokenizers_in_one_line(tmp_path, capsys):
    root = _corpus(tmp_path, lines=30)
    assert bid.main([str(root), str(tmp_path / "missing" / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output directory" in err and "does not exist" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bid.main([str(root), str(tmp_path / "ds"), "--tokenizer", str(bad)]) == 2
    assert "is not a HuggingFace tokenizers file" in capsys.readouterr().err
    assert bid.main([str(root), str(tmp_path / "ds"), "--vocab-size", "100"]) == 2
    assert "--vocab-size must be >= 257" in capsys.readouterr().err


def test_splits_are_disjoint_parts_in_index_order(tmp_path):
    from megatron.libra.config import split_bounds
    from megatron.libra.sources import check_data

    prefix = str(tmp_path / "bpe")
    n = bid.build(_corpus(tmp_path), prefix, per_line=True)
    over = ["data.source=indexed", f"data.path={prefix}", "data.context=64", "data.gbs=2"]
    cfg = TrainConfig.load(None, over + ["data.split=80,15,5"])
    b = split_bounds(cfg.data.split_weights(), n)
    assert b[0] == 0 and b[-1] == n and b[1] == round(0.8 * n)
    train, valid = IndexedSource(cfg), IndexedSource(cfg, "valid")
    assert list(train.index) == list(range(b[0], b[1]))
    assert list(valid.index) == list(range(b[1], b[2]))
    # a validation piece holds the validation document's own tokens
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    seqs = valid.step(0)
    first = valid.piece(0, seqs[0][0])
    doc, off, _ = valid._lookup(0)
    assert np.array_equal(first.tokens, np.asarray(ds[int(valid.index[doc])])[off:off + len(
        first.tokens)])
    del ds
    assert split_bounds((1.0, 0.0, 0.0), 3) == [0, 3, 3, 3]  # a tiny dataset: all training
    cfg = TrainConfig.load(None, over + ["data.split=100,0,0", "schedule.eval_interval=2"])
    with pytest.raises(ValueError, match=r"data.split '100,0,0' leaves no valid documents"):
        check_data(cfg)
    for bad in ("a,b", "1,2,3,4", "-1,1", "0,0"):
        with pytest.raises(ValueError, match="data.split must be up to three"):
            TrainConfig.load(None, over + [f"data.split={bad}"]).validate(2)


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
def test_training_on_a_bpe_dataset_validates_every_eval_interval(tmp_path, capfd):
    """The README's path: the tool's default BPE dataset, the tiny config, Megatron-LM's
    validation lines every schedule.eval_interval steps and after the last, on stdout."""
    from megatron.libra.cli import main

    prefix = str(tmp_path / "bpe")
    bid.build(_corpus(tmp_path), prefix, per_line=True)
    metrics = tmp_path / "m.jsonl"
    over = [o for o in _train_overrides(prefix, 5) if not o.startswith("model.vocab")]
    over += ["schedule.eval_interval=2", "schedule.eval_iters=2", "logging.log_interval=1",
             f"logging.metrics_file={metrics}"]
    assert main(["train", "--config", "configs/train/cpu_tiny.yaml", "--nproc", "2", *over]) == 0
    out, err = capfd.readouterr()
    import json

    hist = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [h["step"] for h in hist if "valid_loss" in h] == [2, 4, 5]
    losses = [h["valid_loss"] for h in hist if "valid_loss" in h]
    assert all(np.isfinite(v) and 0 < v < np.log(512) + 1 for v in losses)
    assert losses[-1] < losses[0]  # it learns the held-out text too
    for step in (2, 4, 5):
        assert f" validation loss at iteration {step} | lm loss value: " in out
    assert "lm loss PPL: " in out and "iteration        5/       5" in out
    assert "data: train: " in out and "data: valid: " in out and "tokenizer" in out
    assert "iteration" not in err  # Megatron's lines are on stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path")
@pytest.mark.slow
def test_training_runs_on_an_indexed_dataset_and_says_when_an_epoch_ends(tmp_path, capfd):
    from megatron.libra.launch import launch

    prefix, texts = _dataset(tmp_path)
    cfg = TrainConfig.load("configs/train/cpu_tiny.yaml", _train_overrides(prefix, 4))
    hist = launch(cfg, 2, 2)
    assert len(hist) == 4 and all(np.isfinite(h["loss"]) for h in hist)
    total = sum(len(t.encode()) + 1 for t in texts)  # 128 tokens a step: the first pass ends
    first_wrap = (total - 1) // 128 + 1  # in the step holding its last token
    out = capfd.readouterr().out
    assert (f"epoch 1 of the training data ended during iteration {first_wrap}; epoch 2 reads"
            in out), out[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path")
@pytest.mark.slow
def test_wlb_on_indexed_data_resumes_with_its_held_back_documents(tmp_path):
    """WLB-LLM holds outliers back for later steps (here it even leaves sequences empty); a run
    resumed from a checkpoint must still find the documents read before the checkpoint and
    repeat the same losses."""
    import shutil

    from megatron.libra.launch import launch

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
    from megatron.libra.sources import check_indexed_dataset

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
