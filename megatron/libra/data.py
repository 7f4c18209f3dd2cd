"""Document streams for training: a synthetic long-tail source and Megatron indexed datasets,
packed into S-token sequences per step; and the sampler that plans each step one step ahead in a
background thread and hands every rank its THD micro-batches and the plan."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np

from libra_ext.planner import Planner, StepPlan
from libra_ext.workload import LengthSource, pack_production
from megatron.libra.config import TrainConfig


@dataclass
class Piece:
    """Tokens of one document (or the part of it that landed in this step)."""

    tokens: np.ndarray
    labels: np.ndarray
    mask: np.ndarray


class SyntheticSource:
    """Long-tail document lengths (a preset or a lengths file) with token ids that are a function
    of (seed, global document id) only. Tokens follow a fixed first-order rule with 20% noise
    (next = 7 * token + 3 mod vocab, else uniform), so a model has something to learn and the
    loss falls below ln(vocab)."""

    def __init__(self, cfg: TrainConfig):
        d = cfg.data
        self.src = LengthSource(preset=d.workload, lengths_file=d.lengths_file)
        self.gbs, self.context, self.seed, self.vocab = d.gbs, d.context, d.seed, cfg.model.vocab

    def step(self, step: int) -> list[list[int]]:
        return self.src.step(self.gbs, self.context, self.seed, step)

    def piece(self, doc_id: int, length: int) -> Piece:
        rng = np.random.default_rng([self.seed, int(doc_id)])
        n = int(length) + 1
        noise = rng.integers(0, self.vocab, size=n)
        keep = rng.random(n) < 0.8
        t = np.empty(n, dtype=np.int64)
        t[0] = noise[0]
        for i in range(1, n):
            t[i] = (7 * t[i - 1] + 3) % self.vocab if keep[i] else noise[i]
        return Piece(t[:-1], t[1:], np.ones(int(length), dtype=np.float32))


class IndexedSource:
    """Documents of a Megatron indexed dataset, production-packed into the step's sequences
    (documents split at sequence boundaries; a document's last token has no label). With
    `data.shuffle` the documents are visited in a seeded random order, a new one each pass over
    the dataset (epoch); otherwise in index order. Either way a step's documents are a function
    of (seed, step) only, so a resumed run reads exactly what the uninterrupted one read."""

    def __init__(self, cfg: TrainConfig):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset
        self.ds = IndexedDataset(cfg.data.path)
        self.lengths = np.asarray(self.ds.sequence_lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError(f"data.path {cfg.data.path} holds no documents")
        self.gbs, self.context = cfg.data.gbs, cfg.data.context
        self.shuffle, self.seed = cfg.data.shuffle, cfg.data.seed
        self.total = int(self.lengths.sum())
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}

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

    def step(self, step: int) -> list[list[int]]:
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
        self._pieces[step] = flat
        return [s.doc_lengths for s in seqs]

    def piece_of(self, step: int, index: int) -> Piece:
        doc, off, length = self._pieces[step][index]
        arr = np.asarray(
            self.ds.get(doc, offset=off, length=min(length + 1, int(self.lengths[doc]) - off))
        )
        tokens = arr[:length]
        labels = np.zeros(length, dtype=tokens.dtype)
        labels[: len(arr) - 1] = arr[1:]
        mask = np.ones(length, dtype=np.float32)
        if len(arr) == length:  # the document ends here: its last token has no next token
            mask[-1] = 0.0
        return Piece(tokens, labels, mask)


@dataclass
class StepBatch:
    step: int
    plan: StepPlan
    pieces: dict  # executed document index in the plan -> Piece
    planner_state: dict  # planner state after planning this step (checkpointed with it)
    doc_base: int  # global id of this step's first input document
    n_inputs: int  # input documents this step consumed


class StepSampler:
    """Plans step k+1 in a background thread while step k trains."""

    def __init__(self, cfg: TrainConfig, planner: Planner, start_step: int = 0, doc_base: int = 0):
        self.cfg, self.planner = cfg, planner
        self.source = SyntheticSource(cfg) if cfg.data.source == "synthetic" else IndexedSource(cfg)
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._next, self._doc_base = start_step, doc_base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _plan(self, step: int) -> StepBatch:
        seqs = self.source.step(step)
        plan = self.planner.plan(seqs)
        n_in = sum(len(s) for s in seqs)
        pieces = {}
        if self.cfg.system.name == "wlb":  # ids are global already (the planner's counter)
            ids = plan.doc_ids
        else:
            ids = plan.doc_ids + self._doc_base
        for i in range(len(plan.doc_lengths)):
            if isinstance(self.source, SyntheticSource):
                pieces[i] = self.source.piece(int(ids[i]), int(plan.doc_lengths[i]))
            else:
                pieces[i] = self.source.piece_of(step, int(plan.doc_ids[i]))
        batch = StepBatch(step, plan, pieces, self.planner.state_dict(), self._doc_base, n_in)
        self._doc_base += n_in
        return batch

    def _run(self) -> None:
        step = self._next
        try:
            while not self._stop.is_set() and step < self.cfg.schedule.train_steps:
                self._queue.put(self._plan(step))
                step += 1
        except BaseException as e:  # surfaced to the training loop on the next get()
            self._queue.put(e)

    def next(self) -> StepBatch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the planning thread and wait for it (it may be inside a plan or a put)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread.join()
