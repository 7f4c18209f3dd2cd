"""Counted collectives and the runtime's cached process groups.

The operator (exchange.py) issues every collective inside its autograd Functions, forward and
mirrored backward, in one fixed order on every rank.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ByteCounter:
    """Bytes this rank sent, by kind (forward and backward counted separately)."""

    sent: dict = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + int(nbytes)

    def total(self, prefix: str = "") -> int:
        return sum(v for k, v in self.sent.items() if k.startswith(prefix))

    def reset(self) -> None:
        self.sent.clear()


LAST_COLLECTIVE: list = [None]
"""(kind, group) of the last collective the operator entered on this rank (names the group when a
collective times out; reset by the caller)."""


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    counter: ByteCounter | None,
    kind: str,
    async_op: bool = False,
):
    """all_to_all_single over flat buffers, counting the bytes this rank sends to others."""
    LAST_COLLECTIVE[0] = (kind, group)
    if counter is not None:
        me = dist.get_rank(group)
        sent = sum(n for i, n in enumerate(in_splits) if i != me)
        counter.add(kind, sent * inp.element_size())
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


class Posted:
    """The point-to-point transfers of one `send_recv`, waited on together."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def send_recv(transfers: list, group, counter: ByteCounter | None, async_op: bool = False):
    """Point-to-point messages of one exchange step, in one batch: `transfers` holds (kind,
    sends, receives), sends and receives as (member of `group`, tensor) with contiguous
    tensors (views of the buffers they are read from or land in: nothing is packed). Both
    ends list their transfers in one order (the program's), so the messages between two
    members match in order. Counts the bytes this rank sends by kind."""
    ops = []
    for kind, sends, recvs in transfers:
        LAST_COLLECTIVE[0] = (kind, group)
        if counter is not None:
            counter.add(kind, sum(t.numel() * t.element_size() for _, t in sends))
        ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(group, j), group)
                for j, t in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, j), group)
                for j, t in recvs]
    if not ops:
        return None
    posted = Posted(dist.batch_isend_irecv(ops))
    if async_op:
        return posted
    posted.wait()
    return None


def all_gather_rows(
    x: torch.Tensor, group, counter: ByteCounter | None, kind: str
) -> torch.Tensor:
    """[n, ...] -> [world * n, ...]: every rank's rows, in rank order (equal sizes)."""
    world = dist.get_world_size(group)
    out = x.new_empty(world * x.shape[0], *x.shape[1:])
    inp = x.contiguous()
    LAST_COLLECTIVE[0] = (kind, group)
    if counter is not None:
        counter.add(kind, (world - 1) * inp.numel() * inp.element_size())
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, inp, group=group)
    else:
        dist.all_gather(list(out.chunk(world)), inp, group=group)
    return out


class GroupCache:
    """Process groups of the runtime, created once, in the same order on every rank.

    Rank order is Megatron's tp-cp-(ep)-dp-pp: global rank = t + T * (c + C * (r + D * s)) for
    tp rank t, cp rank c, replica r and pipeline stage s. The CP group of (t, r, s) holds its C
    cp ranks; the pool group of (t, c, s, pool k of size P) holds the P ranks of that tp rank,
    cp index and stage in the pool's replicas. Every stage runs the same plan on its own layers,
    so a stage only ever exchanges with the same stage of other replicas.
    """

    def __init__(
        self, tp: int, cp: int, dp: int, timeout_s: float = 600.0, pp: int = 1, cp_group=None
    ):
        """`cp_group`: an existing CP group of this rank to use (megatron-core's
        parallel_state.get_context_parallel_group(), same rank order); checked against the
        layout's ranks. Every rank must pass one, or none."""
        if dist.get_world_size() != tp * cp * dp * pp:
            raise ValueError(
                f"world size {dist.get_world_size()} != tp*cp*dp*pp = {tp * cp * dp * pp}"
            )
        self.tp, self.cp, self.dp, self.pp = tp, cp, dp, pp
        # A rank that stops early (bad input on that rank only) turns into a timeout error on the
        # others instead of a hang.
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pool: dict = {}
        # For the per-step plan-hash check and step statistics: all ranks, host tensors (gloo,
        # also when the default backend is NCCL, so no device sync), short timeout.
        self.check_group = dist.new_group(
            timeout=datetime.timedelta(seconds=min(60.0, timeout_s)), backend="gloo"
        )
        me = dist.get_rank()
        self.t, rest = me % tp, me // tp
        self.c, rest = rest % cp, rest // cp
        self.r, self.s = rest % dp, rest // dp
        self.labels: dict = {self.check_group: f"all {dist.get_world_size()} ranks (gloo)"}
        # The plan-hash check as a stage's micro-batches are served: the ranks of this pipeline
        # stage (every exchange stays inside a stage), whose data a schedule reads at the same
        # point - a stage reads its first micro-batch only once the previous stage's
        # activation has arrived, so a check across stages there would wait on itself.
        self.stage_check_group = self.check_group
        if pp > 1:
            per_stage = tp * cp * dp
            for s in range(pp):
                ranks = list(range(s * per_stage, (s + 1) * per_stage))
                g = dist.new_group(ranks, timeout=datetime.timedelta(
                    seconds=min(60.0, timeout_s)), backend="gloo")
                if s == self.s:
                    self.stage_check_group = g
                    self.labels[g] = f"pipeline stage {s}'s {per_stage} ranks (gloo)"
        if cp_group is not None:
            want = [self._rank(self.t, c, self.r, self.s) for c in range(cp)]
            have = dist.get_process_group_ranks(cp_group)
            if have != want:
                raise ValueError(
                    f"cp_group holds ranks {have}, the layout's CP group of rank {me} is {want} "
                    f"(rank order tp-cp-dp-pp)"
                )
            self._cp_group = cp_group
        else:
            for s in range(pp):
                for r in range(dp):
                    for t in range(tp):
                        ranks = [self._rank(t, c, r, s) for c in range(cp)]
                        g = dist.new_group(ranks, timeout=self.timeout)
                        if t == self.t and r == self.r and s == self.s:
                            self._cp_group = g
        cp_ranks = [self._rank(self.t, c, self.r, self.s) for c in range(cp)]
        self.labels[self._cp_group] = f"context-parallel group {cp_ranks}"

    def label(self, group) -> str:
        """Which group this is, in words, for error messages."""
        return self.labels.get(group, "a megatron-core group")

    def _rank(self, t: int, c: int, r: int, s: int) -> int:
        return t + self.tp * (c + self.cp * (r + self.dp * s))

    def cp_group(self):
        return self._cp_group

    def pool_group(self, pool: int):
        """This rank's pool communicator for pools of `pool` replicas (created on first use,
        collectively: every rank must ask for the same pool sizes in the same order)."""
        if pool not in self._pool:
            mine = None
            for s in range(self.pp):
                for k in range(self.dp // pool):
                    for c in range(self.cp):
                        for t in range(self.tp):
                            ranks = [
                                self._rank(t, c, r, s) for r in range(k * pool, (k + 1) * pool)
                            ]
                            g = dist.new_group(ranks, timeout=self.timeout) if pool > 1 else None
                            if t == self.t and c == self.c and s == self.s and k == self.r // pool:
                                mine = g
                                self.labels[g] = f"exchange pool {k} (P={pool}) group {ranks}"
            if mine is not None:
                # one collective with every member first: the exchange's point-to-point
                # batches involve only the members with transfers, which NCCL allows only
                # once a group's communicator exists (its first call must include every rank)
                nccl = dist.get_backend(mine) == "nccl"
                dist.barrier(group=mine, **({"device_ids": [torch.cuda.current_device()]}
                                            if nccl else {}))
            self._pool[pool] = mine
        return self._pool[pool]
