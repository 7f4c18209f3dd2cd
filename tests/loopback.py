"""In-process collectives: the ranks of a layout run as threads of one process, and the
operator's all-to-alls, all-gathers and point-to-point messages move real data between them
(tests only).

Every member of a group posts its part of the n-th collective on that group and reads the
others' when it waits, as NCCL's ordering requires; a member whose splits disagree with what
its peers send or expect fails the call, naming the collective's kind. The autograd Functions
run unchanged (their `all_to_all` / `all_gather_rows` are replaced while `patched()` is
active), so a whole exchange group's forward and backward run in one test process.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from libra_ext.attention import exchange

_ME = threading.local()
_ABORT = threading.Event()
"""Set when a member fails: the others stop waiting for it."""


class Aborted(RuntimeError):
    """Another member failed first."""


class LoopGroup:
    """The members (global ids) of one group; the n-th collective of every member meets in
    `_calls[n]`."""

    live: "weakref.WeakSet[LoopGroup]"

    def __init__(self, members, name: str):
        LoopGroup.live.add(self)
        self.members = tuple(members)
        self.name = name
        self._cond = threading.Condition()
        self._calls: dict = {}
        self._seq = {m: 0 for m in self.members}
        self._mail: dict = {}  # (sender, receiver) -> {number: point-to-point message}
        self._sent: dict = {}  # (sender, receiver) -> messages posted
        self._taken: dict = {}  # (sender, receiver) -> receives posted

    def rank(self) -> int:
        return self.members.index(_ME.id)

    def post(self, payload) -> tuple:
        """Post this member's part of its next collective; returns (call id, my rank)."""
        me = self.rank()
        with self._cond:
            n = self._seq[_ME.id]
            self._seq[_ME.id] += 1
            self._calls.setdefault(n, {})[me] = payload
            self._cond.notify_all()
        return n, me

    def collect(self, n: int, timeout: float = 60.0) -> dict:
        """Every member's part of call n (waits for the last)."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: len(self._calls[n]) == len(self.members) or _ABORT.is_set(), timeout)
            if _ABORT.is_set():
                raise Aborted(f"{self.name}: another member failed")
            if not ok:
                raise TimeoutError(f"{self.name}: collective {n} incomplete after {timeout} s")
            return self._calls[n]

    def abort(self) -> None:
        with self._cond:
            self._cond.notify_all()


LoopGroup.live = weakref.WeakSet()


class _Work:
    def __init__(self, finish):
        self._finish = finish

    def wait(self):
        if self._finish is not None:
            self._finish()
            self._finish = None


def _all_to_all(out, inp, out_splits, in_splits, group: LoopGroup, counter, kind,
                async_op=False):
    if sum(in_splits) != inp.numel() or sum(out_splits) != out.numel():
        raise ValueError(f"{kind}: splits {in_splits} / {out_splits} do not cover the buffers "
                         f"({inp.numel()} / {out.numel()})")
    parts = list(inp.reshape(-1).clone().split(list(in_splits)))
    n, me = group.post((parts, list(out_splits)))
    if counter is not None:
        counter.add(kind, sum(x for j, x in enumerate(in_splits) if j != me) * inp.element_size())

    def finish():
        posted = group.collect(n)
        # through .data: a collective writes memory outside autograd's version counters, as
        # NCCL and gloo do (a kernel may have saved a view of another part of `out`)
        flat = out.data.view(-1)
        off = 0
        for j in range(len(group.members)):
            part = posted[j][0][me]
            if part.numel() != out_splits[j]:
                raise ValueError(f"{kind}: member {me} expects {out_splits[j]} elements from "
                                 f"member {j}, which sends {part.numel()}")
            flat[off : off + part.numel()].copy_(part)
            off += part.numel()

    w = _Work(finish)
    if not async_op:
        w.wait()
        return None
    return w


def _all_gather_rows(x, group: LoopGroup, counter, kind):
    n, me = group.post(x.detach().clone())
    if counter is not None:
        counter.add(kind, (len(group.members) - 1) * x.numel() * x.element_size())
    posted = group.collect(n)
    return torch.cat([posted[j] for j in range(len(group.members))])


def _send_recv(transfers, group: LoopGroup, counter, async_op=False):
    """Point-to-point messages, matched per (sender, receiver) pair in the order they are
    posted, as NCCL matches them: the n-th send a member posts to another (a copy) is the n-th
    receive that one posts from it, which must have its kind and size - whenever either end
    waits."""
    me = group.rank()
    recvs = []
    for kind, sends, rs in transfers:
        if counter is not None:
            counter.add(kind, sum(t.numel() * t.element_size() for _, t in sends))
        with group._cond:
            for j, t in sends:
                n = group._sent.get((me, j), 0)
                group._sent[(me, j)] = n + 1
                group._mail.setdefault((me, j), {})[n] = (kind, t.detach().clone())
            for j, t in rs:
                n = group._taken.get((j, me), 0)
                group._taken[(j, me)] = n + 1
                recvs.append((kind, j, t, n))
            group._cond.notify_all()

    def finish():
        for kind, j, t, n in recvs:
            with group._cond:
                ok = group._cond.wait_for(
                    lambda: n in group._mail.get((j, me), {}) or _ABORT.is_set(), 60.0)
                if _ABORT.is_set():
                    raise Aborted(f"{group.name}: another member failed")
                if not ok:
                    raise TimeoutError(f"{group.name}: {kind} from member {j} not sent in 60 s")
                sent_kind, x = group._mail[(j, me)].pop(n)
            if sent_kind != kind or x.numel() != t.numel():
                raise ValueError(f"{kind}: member {me} expects {t.numel()} elements from member "
                                 f"{j}, whose message {n} is {sent_kind} of {x.numel()}")
            t.data.copy_(x.view_as(t))  # (outside autograd's version counters, as NCCL)

    w = _Work(finish)
    if not async_op:
        w.wait()
        return None
    return w


@contextlib.contextmanager
def patched():
    """The operator's collectives replaced by the in-process ones."""
    saved = exchange.all_to_all, exchange.all_gather_rows, exchange.send_recv
    exchange.all_to_all, exchange.all_gather_rows, exchange.send_recv = (
        _all_to_all, _all_gather_rows, _send_recv)
    try:
        yield
    finally:
        exchange.all_to_all, exchange.all_gather_rows, exchange.send_recv = saved


def run_members(fn, members: list) -> list:
    """fn(member) on one thread per member (member ids must be those the groups name);
    returns the results in member order, raising the first member's error."""

    _ABORT.clear()

    def run(m):
        _ME.id = m
        try:
            return fn(m)
        except BaseException:
            _ABORT.set()
            for g in list(LoopGroup.live):
                g.abort()
            raise

    with patched(), ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(run, m) for m in members]
        errors = [f.exception() for f in futures]
    first = [e for e in errors if e is not None and not isinstance(e, Aborted)]
    if first or any(errors):
        raise (first or [e for e in errors if e is not None])[0]
    return [f.result() for f in futures]
