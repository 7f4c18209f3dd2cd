"""Checkpoints in megatron-core's distributed format (`dist_checkpointing`, torch_dist backend).

Layout, as Megatron-LM writes it:

    DIR/latest_checkpointed_iteration.txt     the newest complete step
    DIR/iter_0000100/                         one dist checkpoint per saved step

A checkpoint holds the model and optimizer as sharded tensors (so it loads under another TP / DP
layout of the same model), the LR scheduler, each rank's RNG state, and the data position: the
next step, the global id of its first document, and the planner's carried state (WLB-LLM's delay
queue) as it was right after planning the saved step. A resumed run therefore continues with
exactly the samples the uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("libra.train")  # the iteration lines' logger (stderr, message only)
TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


def iteration_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def latest_step(root: str | Path | None) -> int | None:
    """The newest complete checkpoint's step in `root`, or None when there is none."""
    if not root:
        return None
    f = Path(root) / TRACKER
    if not f.is_file():
        return None
    text = f.read_text().strip()
    try:
        step = int(text)
    except ValueError:
        raise ValueError(f"checkpoint.dir: {f} should hold a step number, found {text!r}") from None
    if not iteration_dir(root, step).is_dir():
        raise ValueError(
            f"checkpoint.dir: {f} names step {step}, but {iteration_dir(root, step)} is missing"
        )
    return step


@dataclass
class Resumed:
    next_step: int
    doc_base: int
    planner_state: dict
    recent_bases: dict  # step -> first document id, of the steps WLB-LLM may still draw from


def _rng_object(rank: int, world: int):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "libra.rng_state",
        {"torch": torch.get_rng_state()},
        global_shape=(world,),
        global_offset=(rank,),
        replica_id=0,
    )


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_state(model) -> dict:
    """The model's sharded state: "model", or "model0", "model1", ... for virtual pipeline
    chunks (as Megatron-LM names them). Tensors are keyed by their global names and layer
    numbers, so a checkpoint loads under another tp / pp / vpp layout of the same model."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _load_model(model, loaded: dict) -> None:
    chunks = _chunks(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[f"model{i}"])


def _sharded(model, opt, is_loading: bool) -> dict:
    msd = _model_state(model)
    return {**msd, "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading)}


class Checkpointer:
    """Saves checkpoints, synchronously or in the background (megatron-core's async save: each
    rank copies its shards to host memory, a writer process stores them while training goes
    on). The tracker file names a step only once every rank's shards of it are on disk."""

    def __init__(
        self,
        root,
        async_save: bool = False,
        model_config: dict | None = None,
        run_config: dict | None = None,
    ):
        self.root = Path(root)
        self.model_config = model_config or {}
        self.run_config = run_config or {}
        self._queue = None
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()

    def save(self, step: int, model, opt, sched, batch) -> Path:
        """Save step `step` (collective: every rank calls it with the same step)."""
        from megatron.core import dist_checkpointing

        rank, world = dist.get_rank(), dist.get_world_size()
        path = iteration_dir(self.root, step)
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = _sharded(model, opt, is_loading=False)
        state["scheduler"] = sched.state_dict()
        state["libra"] = {
            "format_version": FORMAT_VERSION,
            "world_size": world,
            "next_step": step,
            "doc_base": batch.doc_base + batch.n_inputs,
            "planner": batch.planner_state,
            "recent_doc_bases": batch.recent_bases,
            "model_config": self.model_config,
            "run_config": self.run_config,
        }
        state["rng_state"] = _rng_object(rank, world)
        t0 = time.perf_counter()
        if self._queue is None:
            dist_checkpointing.save(state, str(path))
            dist.barrier()
            self._advance(step)
            if rank == 0:
                logger.info("saved checkpoint at iteration %d to %s in %.2f s", step, self.root,
                            time.perf_counter() - t0)
            return path
        self._queue.maybe_finalize_async_calls(blocking=True)  # one save in flight at a time
        request = dist_checkpointing.save(state, str(path), async_sharded_save=True)

        def finished() -> None:  # runs once all ranks are done
            self._advance(step)
            if rank == 0:
                logger.info("saved checkpoint at iteration %d to %s in %.2f s (in the background)",
                            step, self.root, time.perf_counter() - t0)

        request.add_finalize_fn(finished)
        self._queue.schedule_async_request(request)
        return path

    def poll(self) -> None:
        """Finish background saves that are done on every rank (collective; call every step)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def close(self) -> None:
        """Wait for background saves and stop the writer (collective)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)
            self._queue.close()
            self._queue = None

    def _advance(self, step: int) -> None:
        if dist.get_rank() == 0:
            tmp = self.root / (TRACKER + ".tmp")
            tmp.write_text(str(step))
            tmp.replace(self.root / TRACKER)


def _load_common(path: Path) -> tuple[dict | None, str | None]:
    """(common state, None) of an intact-looking iteration directory, or (None, what is wrong):
    missing or empty directory, no .metadata, an empty file, a common state that does not load."""
    from megatron.core import dist_checkpointing

    if not path.is_dir() or not any(path.iterdir()):
        return None, "the directory is empty" if path.is_dir() else "no such directory"
    if not (path / ".metadata").is_file():
        return None, ".metadata is missing"
    empty = sorted(f.name for f in path.iterdir() if f.is_file() and f.stat().st_size == 0)
    if empty:
        return None, f"{empty[0]} is empty"
    try:
        return dist_checkpointing.load_common_state_dict(str(path)), None
    except Exception as e:  # a truncated or garbled common state
        return None, f"its common state does not load: {_first_line(e)}"


def damaged(path: Path, problem: str) -> ValueError:
    """One line naming the damaged iteration, what is wrong, and the newest intact earlier one."""
    root, step = path.parent, int(path.name.split("_")[-1])
    earlier = sorted(
        (int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit()), reverse=True
    )
    good = next(
        (s for s in earlier if s < step and _load_common(iteration_dir(root, s))[1] is None), None
    )
    hint = (
        f"; the newest intact earlier iteration is {iteration_dir(root, good).name} "
        f"(checkpoint.load_iteration={good} resumes from it)"
        if good is not None
        else "; no intact earlier iteration"
    )
    return ValueError(f"checkpoint.dir: {path} is damaged ({problem}){hint}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _checked_meta(path: Path, model_config: dict | None) -> tuple[dict, dict]:
    """(common state, Libra metadata) of the checkpoint at `path`; refuses a checkpoint that is
    not Libra's or holds another model shape, naming the fields, and a damaged one naming what
    is missing. Reads no tensor shards and needs no process group."""
    common, problem = _load_common(path)
    if problem is not None:
        raise damaged(path, problem)
    meta = common.get("libra")
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint.dir: {path} is not a Libra training checkpoint")
    saved = meta.get("model_config") or {}
    differ = [
        f"model.{k} = {saved[k]!r} there, {v!r} here"
        for k, v in (model_config or {}).items()
        if k in saved and saved[k] != v
    ]
    if differ:
        raise ValueError(f"checkpoint.dir: {path} holds another model: " + "; ".join(differ))
    return common, meta


def check_resume(
    path: Path, meta: dict, run_config: dict | None, override_scheduler: bool, finetune: bool
) -> None:
    """Refuse a resume whose settings differ from the checkpoint's where that breaks an exact
    continuation, naming the old and new values and the override that allows it."""
    from megatron.libra.config import SCHEDULE_FIELDS

    saved = meta.get("run_config") or {}
    if finetune or not run_config:
        return
    changed = [(k, saved[k], v) for k, v in run_config.items() if k in saved and saved[k] != v]
    schedule = [c for c in changed if c[0] in SCHEDULE_FIELDS]
    stream = [c for c in changed if c[0] not in SCHEDULE_FIELDS]

    def words(items):
        return "; ".join(f"{k} = {old!r} there, {new!r} here" for k, old, new in items)

    if stream:
        raise ValueError(
            f"checkpoint.dir: {path} was saved with other data or system settings "
            f"({words(stream)}); an exact resume needs the same ones (checkpoint.finetune=true "
            "loads only the weights and starts at step 0)"
        )
    if schedule and not override_scheduler:
        raise ValueError(
            f"checkpoint.dir: {path} was saved with another learning-rate schedule "
            f"({words(schedule)}); set checkpoint.override_scheduler=true to continue with this "
            "config's schedule"
        )


def resume_step(
    root,
    model_config: dict | None = None,
    run_config: dict | None = None,
    override_scheduler: bool = False,
    finetune: bool = False,
    load_iteration: int | None = None,
) -> int | None:
    """The step a run in `root` resumes from (None: no checkpoint), after checking that the
    checkpoint is intact, fits this model and, unless overridden, this run's settings;
    callable before any process group exists."""
    step = latest_step(root) if load_iteration is None else int(load_iteration)
    if load_iteration is not None and not iteration_dir(root, step).is_dir():
        raise ValueError(f"checkpoint.load_iteration: {iteration_dir(root, step)} does not exist")
    if step is not None:
        _, meta = _checked_meta(iteration_dir(root, step), model_config)
        check_resume(iteration_dir(root, step), meta, run_config, override_scheduler, finetune)
    return step


def load(
    root,
    step: int,
    model,
    opt,
    sched,
    model_config: dict | None = None,
    finetune: bool = False,
) -> Resumed:
    """Load step `step` into model, optimizer and scheduler; returns the data position. With
    `finetune`, only the model weights: the run starts at step 0 with a fresh optimizer."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, step)
    common, meta = _checked_meta(path, model_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    if finetune:
        state = _model_state(model)
    else:
        state = _sharded(model, opt, is_loading=True)
    same_world = meta["world_size"] == world
    if same_world and not finetune:  # per-rank RNG streams only mean something on one layout
        state["rng_state"] = _rng_object(rank, world)
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except Exception as e:  # a missing or truncated shard
        raise damaged(path, f"its shards do not load: {_first_line(e)}") from None
    _load_model(model, loaded)
    if finetune:
        return Resumed(next_step=0, doc_base=0, planner_state=None, recent_bases={})
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(common["scheduler"])
    if same_world:
        torch.set_rng_state(loaded["rng_state"]["torch"])
    return Resumed(
        next_step=int(meta["next_step"]),
        doc_base=int(meta["doc_base"]),
        planner_state=meta["planner"],
        recent_bases={int(k): int(v) for k, v in meta.get("recent_doc_bases", {}).items()},
    )
