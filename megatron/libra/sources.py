"""Where a step's documents come from: a synthetic long-tail source, a Megatron indexed dataset
(`libra train`), and Megatron's GPTDataset (`pretrain_gpt_libra.py`), each packed into the
step's S-token sequences. Every source answers the same three questions: `step(k)` (the
document lengths of step k's packed sequences, from the lengths or indices alone), `piece(id,
length)` (one document's tokens, labels and loss mask, read only by the replica that executes
it) and `epochs(k)`; the per-step pipeline (`steps.StepSampler`) plans from the first and reads
the second."""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from libra_ext.workload import LengthSource, PackedBatch, pack_production
from megatron.libra.config import TrainConfig, split_bounds

with warnings.catch_warnings():  # megatron-core's notices on import (no GPU, no TE, ...)
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset


@dataclass
class Piece:
    """Tokens of one document (or the part of it that landed in this step)."""

    tokens: np.ndarray
    labels: np.ndarray
    mask: np.ndarray


def held_steps(cfg: TrainConfig) -> int:
    """Steps whose input documents may still run (WLB-LLM holds outliers back at most
    `wlb_max_delay` steps), so the sampler and the indexed source keep them addressable."""
    return cfg.system.wlb_max_delay + 2


class SyntheticSource:
    """Long-tail document lengths (a preset or a lengths file) with token ids that are a function
    of (seed, global document id) only. Tokens follow a fixed first-order rule with 20% noise
    (next = 7 * token + 3 mod vocab, else uniform), so a model has something to learn and the
    loss falls below ln(vocab)."""

    def __init__(self, cfg: TrainConfig, split: str = "train"):
        d = cfg.data
        self.src = LengthSource(preset=d.workload, lengths_file=d.lengths_file)
        # validation reads a stream of its own: the next seed
        seed = d.seed if split == "train" else (d.seed + 1) % 2**31
        self.gbs, self.context, self.seed, self.vocab = d.gbs, d.context, seed, cfg.model.vocab
        self._mul = np.ones(1, dtype=np.int64)  # 7^k mod vocab
        self._add = np.zeros(1, dtype=np.int64)  # 3 (7^k - 1) / 6 mod vocab

    def step(self, step: int, doc_base: int = 0) -> PackedBatch:
        return self.src.step(self.gbs, self.context, self.seed, step)

    def epochs(self, step: int) -> tuple[int, int]:
        """A synthetic stream has no passes: always (0, 0)."""
        return 0, 0

    def _tables(self, n: int) -> None:
        """Extend the affine-map tables to k < n: k steps of x -> 7x + 3 (mod vocab) take x to
        mul[k] * x + add[k]."""
        k0 = len(self._mul)
        if n <= k0:
            return
        mul, add = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        mul[:k0], add[:k0] = self._mul, self._add
        for k in range(k0, n):
            mul[k] = (7 * mul[k - 1]) % self.vocab
            add[k] = (7 * add[k - 1] + 3) % self.vocab
        self._mul, self._add = mul, add

    def piece(self, doc_id: int, length: int) -> Piece:
        rng = np.random.default_rng([self.seed, int(doc_id)])
        n = int(length) + 1
        noise = rng.integers(0, self.vocab, size=n)
        keep = rng.random(n) < 0.8
        keep[0] = False  # the first token is drawn
        # token i follows the rule from the last drawn token j <= i: t[i] = f^(i-j)(noise[j])
        idx = np.arange(n)
        last = np.maximum.accumulate(np.where(keep, 0, idx))
        self._tables(n)
        k = idx - last
        t = (self._mul[k] * noise[last] + self._add[k]) % self.vocab
        return Piece(t[:-1], t[1:], np.ones(int(length), dtype=np.float32))

    def label_count(self, doc_id: int, length: int) -> int:
        """Tokens of the piece that have a label (all of them: labels run one token past)."""
        return int(length)


def check_indexed_dataset(path: str, vocab: int, chunk: int = 1 << 26) -> None:
    """Refuse, before any worker starts, an indexed dataset whose files are damaged or whose
    token ids do not fit the model's vocabulary, naming the file and what is wrong."""

    idx, bin_ = Path(path + ".idx"), Path(path + ".bin")
    try:
        with open(idx, "rb") as fh:
            header = fh.read(34)
    except OSError as e:
        raise ValueError(f"data.path: {idx} cannot be read ({e.strerror})") from None
    if len(header) < 34 or header[:9] != b"MMIDIDX\x00\x00":
        raise ValueError(f"data.path: {idx} is not a Megatron index (bad header)")
    version, code = struct.unpack("<Q", header[9:17])[0], header[17]
    count, docs = struct.unpack("<QQ", header[18:34])
    dtypes = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
              7: np.float32, 8: np.uint16}
    if version != 1 or code not in dtypes:
        raise ValueError(f"data.path: {idx} has version {version} / dtype code {code}, not a "
                         "Megatron index this reader knows")
    need = 34 + count * 4 + count * 8 + docs * 8
    if idx.stat().st_size < need:
        raise ValueError(f"data.path: {idx} is truncated ({idx.stat().st_size} bytes, its header "
                         f"needs {need})")
    mm = np.memmap(idx, mode="r")
    lengths = np.frombuffer(mm, dtype=np.int32, count=count, offset=34)
    pointers = np.frombuffer(mm, dtype=np.int64, count=count, offset=34 + count * 4)
    itemsize = np.dtype(dtypes[code]).itemsize
    end = int(pointers[-1]) + int(lengths[-1]) * itemsize if count else 0
    if not bin_.is_file() or bin_.stat().st_size < end:
        size = bin_.stat().st_size if bin_.is_file() else 0
        raise ValueError(f"data.path: {bin_} is truncated ({size} bytes, the index needs {end})")
    tokens = np.memmap(bin_, dtype=dtypes[code], mode="r")
    integer = np.issubdtype(dtypes[code], np.integer)
    if integer and np.iinfo(dtypes[code]).min >= 0 and np.iinfo(dtypes[code]).max < vocab:
        return  # every id the dtype can hold is in [0, vocab)
    for start in range(0, end // itemsize, chunk):
        part = np.asarray(tokens[start : start + chunk])
        top = int(part.max()) if len(part) else 0
        if top >= vocab or (len(part) and int(part.min()) < 0):
            raise ValueError(
                f"data.path: {bin_} holds token id {top if top >= vocab else int(part.min())} "
                f"(model.vocab is {vocab}; ids must be in [0, vocab))"
            )


SPLITS = ("train", "valid", "test")


def split_documents(cfg: TrainConfig, n: int) -> dict[str, range]:
    """The document index ranges of data.split's train / valid / test parts of n documents."""
    b = split_bounds(cfg.data.split_weights(), n)
    return {name: range(b[i], b[i + 1]) for i, name in enumerate(SPLITS)}


def check_data(cfg: TrainConfig) -> None:
    """Everything about an indexed dataset that can fail a run, before any worker starts: its
    files (check_indexed_dataset), a tokenizer beside it with more ids than model.vocab, and a
    data.split that leaves training (or, with schedule.eval_interval, validation) empty."""
    d = cfg.data
    check_indexed_dataset(d.path, cfg.model.vocab)
    tok = Path(f"{d.path}.tokenizer.json")
    if tok.is_file() and tokenizer_size(tok) > cfg.model.vocab:
        raise ValueError(f"model.vocab ({cfg.model.vocab}) is smaller than the dataset's "
                         f"tokenizer ({tokenizer_size(tok)} ids, {tok})")
    ds = IndexedDataset(d.path)
    n = len(ds.sequence_lengths)
    del ds
    parts = split_documents(cfg, n)
    needed = ["train"] + (["valid"] if cfg.schedule.eval_interval else [])
    for name in needed:
        if not len(parts[name]):
            raise ValueError(
                f"data.split {d.split!r} leaves no {name} documents of the {n} in {d.path}"
                + ("; raise its second weight, or schedule.eval_interval=0" if name == "valid"
                   else "")
            )


class IndexedSource:
    """Documents of one part (data.split) of a Megatron indexed dataset, production-packed
    into the step's sequences (documents split at sequence boundaries; a document's last token
    has no label). With `data.shuffle` the documents are visited in a seeded random order, a new
    one each pass over the part (epoch); otherwise in index order. Either way a step's documents
    are a function of (seed, step) only, so a resumed run reads exactly what the uninterrupted
    one read."""

    def __init__(self, cfg: TrainConfig, split: str = "train"):
        self.ds = IndexedDataset(cfg.data.path)
        every = np.asarray(self.ds.sequence_lengths, dtype=np.int64)
        part = split_documents(cfg, len(every))[split]
        self.index = np.arange(part.start, part.stop, dtype=np.int64)  # part -> dataset ids
        self.lengths = every[part.start:part.stop]
        if len(self.lengths) == 0:
            raise ValueError(
                f"data.path {cfg.data.path}: data.split {cfg.data.split!r} leaves no {split} "
                f"documents of its {len(every)}"
            )
        self.gbs, self.context = cfg.data.gbs, cfg.data.context
        self.shuffle, self.seed = cfg.data.shuffle, cfg.data.seed
        self.keep_steps = held_steps(cfg)
        self.total = int(self.lengths.sum())
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # step -> (global id of its first input document, its (doc, offset, length) pieces)
        self._pieces: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}

    def order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token counts in that order) of pass `epoch`."""
        if epoch not in self._orders:
            n = len(self.lengths)
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                perm = np.arange(n)
            if len(self._orders) >= 2:  # a step spans at most two passes at a time
                self._orders.pop(min(self._orders))
            self._orders[epoch] = (perm, np.cumsum(self.lengths[perm]))
        return self._orders[epoch]

    def epochs(self, step: int) -> tuple[int, int]:
        """(the pass over the part `step` starts in, the pass the next step starts in): they
        differ when a pass ends inside this step."""
        need = self.gbs * self.context
        return step * need // self.total, (step + 1) * need // self.total

    def _layout(self, step: int):
        """(doc, offset, length) pieces of every sequence of `step`, cycling the dataset."""
        need = self.gbs * self.context
        epoch, pos = divmod(step * need, self.total)
        perm, cum = self.order(epoch)
        k = int(np.searchsorted(cum, pos, side="right"))
        offset = pos - (int(cum[k - 1]) if k > 0 else 0)
        pieces, got = [], 0
        while got < need:
            doc = int(perm[k])
            take = min(int(self.lengths[doc]) - offset, need - got)
            pieces.append((doc, offset, take))
            got += take
            k, offset = k + 1, 0
            if k == len(perm):
                epoch, k = epoch + 1, 0
                perm, cum = self.order(epoch)
        return pieces

    def step(self, step: int, doc_base: int = 0) -> list[list[int]]:
        """The step's packed sequences; its input documents get global ids doc_base, ...."""
        pieces = self._layout(step)
        seqs = pack_production([p[2] for p in pieces], self.context, self.gbs)
        # production packing may split a piece again at a sequence boundary: track sub-pieces
        flat, k, used = [], 0, 0
        for s in seqs:
            for length in s.doc_lengths:
                doc, off, plen = pieces[k]
                flat.append((doc, off + used, length))
                used += length
                if used == plen:
                    k, used = k + 1, 0
        self._pieces[step] = (doc_base, flat)
        for gone in [k for k in self._pieces if k <= step - self.keep_steps]:
            del self._pieces[gone]
        return [s.doc_lengths for s in seqs]

    def _lookup(self, doc_id: int) -> tuple[int, int, int]:
        for base, flat in self._pieces.values():
            if base <= doc_id < base + len(flat):
                return flat[doc_id - base]
        raise KeyError(
            f"document {doc_id} is not among the last {self.keep_steps} steps' inputs "
            "(system.wlb_max_delay larger than the source keeps?)"
        )

    def piece(self, doc_id: int, length: int) -> Piece:
        doc, off, plen = self._lookup(doc_id)
        if plen != length:
            raise ValueError(f"document {doc_id} has {plen} tokens here, the plan says {length}")
        arr = np.asarray(
            self.ds.get(int(self.index[doc]), offset=off,
                        length=min(length + 1, int(self.lengths[doc]) - off))
        )
        tokens = arr[:length]
        labels = np.zeros(length, dtype=tokens.dtype)
        labels[: len(arr) - 1] = arr[1:]
        mask = np.ones(length, dtype=np.float32)
        if len(arr) == length:  # the document ends here: its last token has no next token
            mask[-1] = 0.0
        return Piece(tokens, labels, mask)

    def label_count(self, doc_id: int, length: int) -> int:
        """Tokens of the piece that have a label (a document's last token has none)."""
        doc, off, plen = self._lookup(doc_id)
        return int(length) - int(off + plen == int(self.lengths[doc]))


def make_source(cfg: TrainConfig, split: str = "train"):
    """The document source of data.source for `split` (train or valid)."""
    if cfg.data.source == "synthetic":
        return SyntheticSource(cfg, split)
    return IndexedSource(cfg, split)


def describe_data(cfg: TrainConfig) -> list[str]:
    """What the run reads, for the start-up lines: documents, tokens and sequences per epoch of
    each part of an indexed dataset and its tokenizer, or the synthetic stream."""
    d = cfg.data
    per_step = f"{d.gbs} sequences of {d.context} tokens per step"
    if d.source == "synthetic":
        src = d.lengths_file or f"the {d.workload} preset"
        return [f"data: synthetic documents (lengths from {src}), {per_step}; validation reads "
                f"seed {(d.seed + 1) % 2**31}"]
    ds = IndexedDataset(d.path)  # kept while its memory-mapped lengths are read
    lengths = np.array(ds.sequence_lengths, dtype=np.int64)
    del ds
    parts = split_documents(cfg, len(lengths))
    lines = [f"data: {d.path}: {len(lengths):,} documents, {int(lengths.sum()):,} tokens; "
             f"{per_step}; data.split {d.split}"]
    for name in ("train", "valid"):
        r = parts[name]
        tokens = int(lengths[r.start:r.stop].sum())
        seqs = tokens / d.context
        lines.append(
            f"data: {name}: {len(r):,} documents, {tokens:,} tokens, {seqs:,.1f} sequences "
            f"per epoch ({seqs / d.gbs:,.1f} steps)" if len(r) else f"data: {name}: none"
        )
    tok = Path(f"{d.path}.tokenizer.json")
    lines.append(f"data: tokenizer {tok} ({tokenizer_size(tok):,} ids)" if tok.is_file()
                 else "data: no tokenizer file beside the dataset (PATH.tokenizer.json)")
    return lines


def tokenizer_size(path: Path) -> int:
    """The vocabulary size of a HuggingFace tokenizers file (read as JSON: no import needed)."""
    try:
        spec = json.loads(path.read_text())
        vocab = spec["model"]["vocab"]
        ids = list(vocab.values()) + [t["id"] for t in spec.get("added_tokens", [])]
        return max(ids) + 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"data.path: {path} is not a readable tokenizers file "
                         f"({type(e).__name__}: {e})") from None


class GPTDatasetSource:
    """Megatron's GPTDataset (or a blend of them) as the sampler's document source: step k is
    the samples [k * gbs, (k + 1) * gbs), each a packed sequence whose documents' lengths come
    from the dataset's sample and document indices (never from the tokens). A document of a
    sample is a piece of it with the tokens, labels and loss mask GPTDataset gives (its EOD
    handling, `--eod-mask-loss`, `--reset-*` as Megatron-LM sets them). It has no label_count:
    Megatron-LM's loop counts the loss tokens itself, so no rank reads the samples of replicas
    other than its own."""

    def __init__(self, dataset, gbs: int, keep_steps: int):
        self.ds, self.gbs, self.keep_steps = dataset, gbs, keep_steps
        self._pieces: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}
        self._samples: dict[int, dict] = {}

    def _leaf(self, i: int):
        """(GPTDataset, its sample index) of sample i of the (possibly blended) dataset."""
        ds = self.ds
        while hasattr(ds, "dataset_index"):  # a BlendedDataset
            ds, i = ds.datasets[int(ds.dataset_index[i])], int(ds.dataset_sample_index[i])
        return ds, i

    def lengths(self, i: int) -> list[int]:
        """Document lengths of sample i inside its seq_length tokens, from the indices."""
        ds, j = self._leaf(i)
        j = int(ds.shuffle_index[j])
        (p0, o0), (p1, o1) = ds.sample_index[j], ds.sample_index[j + 1]
        docs = np.asarray(ds.document_index[p0:p1 + 1])
        full = np.asarray(ds.dataset.sequence_lengths)[docs].astype(np.int64)
        extra = int(getattr(ds.config, "add_extra_token_to_sequence", True))
        if p0 == p1:
            seg = [int(o1 - o0 + extra)]
        else:
            seg = [int(full[0] - o0)] + [int(x) for x in full[1:-1]] + [int(o1 + extra)]
        # the sample's tokens are its first seq_length; the extra one is only a label
        n = ds.config.sequence_length
        out, used = [], 0
        for x in seg:
            take = min(x, n - used)
            if take > 0:
                out.append(take)
                used += take
        if used < n:  # a short last sample is padded by GPTDataset: one more piece
            out.append(n - used)
        return out

    def step(self, step: int, doc_base: int = 0) -> list[list[int]]:
        seqs, flat = [], []
        for i in range(step * self.gbs, (step + 1) * self.gbs):
            lengths = self.lengths(i % len(self.ds))
            off = 0
            for n in lengths:
                flat.append((i % len(self.ds), off, n))
                off += n
            seqs.append(lengths)
        self._pieces[step] = (doc_base, flat)
        for gone in [k for k in self._pieces if k <= step - self.keep_steps]:
            del self._pieces[gone]
        return seqs

    def epochs(self, step: int) -> tuple[int, int]:
        return 0, 0

    def _lookup(self, doc_id: int) -> tuple[int, int, int]:
        for base, flat in self._pieces.values():
            if base <= doc_id < base + len(flat):
                return flat[doc_id - base]
        raise KeyError(f"document {doc_id} is not among the last {self.keep_steps} steps' inputs")

    def _sample(self, i: int) -> dict:
        if i not in self._samples:
            if len(self._samples) >= 4 * self.gbs:
                self._samples.pop(next(iter(self._samples)))
            self._samples[i] = self.ds[i]
        return self._samples[i]

    def piece(self, doc_id: int, length: int) -> Piece:
        i, off, n = self._lookup(doc_id)
        if n != length:
            raise ValueError(f"document {doc_id} has {n} tokens here, the plan says {length}")
        s = self._sample(i)
        sl = slice(off, off + n)
        return Piece(np.asarray(s["tokens"][sl], dtype=np.int64),
                     np.asarray(s["labels"][sl], dtype=np.int64),
                     np.asarray(s["loss_mask"][sl], dtype=np.float32))
