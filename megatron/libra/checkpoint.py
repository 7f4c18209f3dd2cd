"""Checkpoints in megatron-core's distributed format (`dist_checkpointing`, torch_dist backend).

Layout, as Megatron-LM writes it:

    DIR/latest_checkpointed_iteration.txt     the newest complete step
    DIR/iter_0000100/                         one dist checkpoint per saved step
    DIR/iter_0000100/libra_manifest.json      its files' sizes and CRC-32s (Libra's addition)

A checkpoint holds the model and optimizer as sharded tensors (so it loads under another TP / DP
layout of the same model), the LR scheduler, each rank's RNG state, and the data position: the
next step, the global id of its first document, and the planner's carried state (WLB-LLM's delay
queue) as it was right after planning the saved step. A resumed run therefore continues with
exactly the samples the uninterrupted run would have seen.

A damaged iteration (a missing, empty, truncated or changed file) is refused in one line naming
it and the newest intact earlier iteration; a save that fails (a full disk) removes its partial
directory and says so. The tracker only ever names a complete, summed iteration.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint import FileSystemReader

from megatron.libra.config import SCHEDULE_FIELDS

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


def checkpoint_bytes(cfg) -> int:
    """About how many bytes one checkpoint of `cfg`'s model takes: each parameter once (replicas
    are stored once) in its dtype, with Adam's two fp32 moments and, under bf16, the fp32 main
    copy; plus 5 % and 1 MiB for metadata, the common state and file framing."""
    elem = {"fp32": 4, "fp64": 8, "bf16": 2}[cfg.dtype]
    per = elem + 2 * 4 + (4 if cfg.dtype == "bf16" else 0)
    return int(cfg.model.param_count() * per * 1.05) + (1 << 20)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_writable(root, cfg=None, need: int | None = None) -> None:
    """Refuse a checkpoint directory this run could not save into, before any worker starts:
    one that cannot be created, is not writable, or has less free space than one checkpoint
    (`need` bytes, else estimated from `cfg`); each named in one line."""

    root = Path(root)
    made = [p for p in [root, *root.parents] if not p.exists()]  # removed again on a refusal
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"checkpoint.dir {root} cannot be created: {e.strerror or e}") from None
    try:
        _check_room(root, cfg, need)
    except ValueError:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _check_room(root: Path, cfg, need: int | None) -> None:
    probe = root / f".libra_write_probe.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(f"checkpoint.dir {root} is not writable: {e.strerror or e}") from None
    finally:
        probe.unlink(missing_ok=True)
    need = space_needed(root, checkpoint_bytes(cfg)) if need is None else need
    free = shutil.disk_usage(root).free
    if free < need:
        raise ValueError(
            f"checkpoint.dir {root} has {_mb(free)} free; one checkpoint of this model takes "
            f"about {_mb(need)}: free space or choose another checkpoint.dir"
        )


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def space_needed(root, estimate: int) -> int:
    """Bytes the next checkpoint in `root` takes: the newest saved one's size (and 2 % more),
    or `estimate` while there is none."""
    try:
        last = latest_step(root)
    except ValueError:
        last = None
    if last is None or not iteration_dir(root, last).is_dir():
        return estimate
    return int(_dir_bytes(iteration_dir(root, last)) * 1.02) + (64 << 10)


def _no_space(exc: BaseException) -> bool:
    """Whether a save failed for want of space: ENOSPC anywhere in the exception, its causes or
    the per-rank failures of a distributed checkpoint, or PyTorch's writer's short write."""

    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        text = str(e)
        if "No space left on device" in text or "unexpected pos" in text:
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # rank -> (exception, stack) of a dist save
        if isinstance(failures, dict):
            for f in failures.values():
                f = f[0] if isinstance(f, tuple) and f else f
                if isinstance(f, BaseException):
                    todo.append(f)
    return False


MANIFEST = "libra_manifest.json"
"""Each file of an iteration directory with its size and CRC-32, written once every rank's files
are on disk and before the tracker names the iteration; checked before its shards are read."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _share(names: list[str]) -> list[str]:
    """This rank's part of a sorted list of file names (every world-th one), so the ranks read
    a checkpoint's files once between them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return sorted(names)[rank::world]


def _write_manifest(path: Path) -> None:
    """Collective: each rank sums its share of the directory's files, rank 0 writes the list."""

    names = [f.name for f in path.iterdir() if f.is_file() and f.name != MANIFEST]
    mine = {n: [(path / n).stat().st_size, _crc32(path / n)] for n in _share(names)}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() == 0:
        files = {k: v for part in parts for k, v in part.items()}
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"format_version": 1, "files": dict(sorted(files.items()))}))
        tmp.replace(path / MANIFEST)


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(file -> [size, crc32], None), (None, None) for a checkpoint saved without a manifest,
    or (None, what is wrong)."""

    f = path / MANIFEST
    if not f.is_file():
        return None, None
    try:
        files = json.loads(f.read_text())["files"]
        return {str(k): [int(v[0]), int(v[1])] for k, v in files.items()}, None
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        return None, f"{MANIFEST} does not load: {_first_line(e)}"


def _verify_manifest(path: Path) -> str | None:
    """Collective: what is wrong with the iteration's files against its manifest (None: every
    file has its recorded size and CRC-32), each rank reading its share of them."""
    files, problem = _read_manifest(path)
    if problem is not None or files is None:
        return problem
    mine = []
    for name in _share(list(files)):
        f, (size, crc) = path / name, files[name]
        if not f.is_file():
            mine.append(f"{name} is missing")
        elif f.stat().st_size != size:
            mine.append(f"{name} holds {f.stat().st_size} bytes, {size} were saved")
        elif _crc32(f) != crc:
            mine.append(f"{name} does not match its saved checksum (its bytes changed)")
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    found = sorted(p for part in parts for p in part)
    return found[0] if found else None



def _async_save_options(dist_checkpointing) -> dict:
    """Arguments of a background save through megatron-core's own queue (`AsyncCallsQueue`):
    megatron-core 0.19 also offers NVIDIA Resiliency Extension's writer and makes it the default
    (`async_strategy="nvrx"`, which needs nvidia-resiliency-ext); the queue here is megatron-core's,
    so its strategy is asked for by name where there is a choice."""

    options = {"async_sharded_save": True}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        options["async_strategy"] = "mcore"
    return options

class CheckpointError(RuntimeError):
    """A checkpoint could not be saved; the message is one line naming the directory, the
    iteration and what to do."""


@dataclass
class Resumed:
    next_step: int
    doc_base: int
    planner_state: dict
    recent_bases: dict  # step -> first document id, of the steps WLB-LLM may still draw from
    cost_model: dict | None = None  # steps.CostModels.state_dict() (libra train)


def _rng_object(rank: int, world: int):
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
        need: int = 0,
    ):
        self.root = Path(root)
        self.model_config = model_config or {}
        self.run_config = run_config or {}
        self.need = need  # bytes one checkpoint takes, until one is saved and measured
        self._pending: int | None = None  # the step of the background save in flight
        self._queue = None
        if async_save:

            self._queue = AsyncCallsQueue()

    def save(self, step: int, model, opt, sched, batch, cost_model: dict | None = None) -> Path:
        """Save step `step` (collective: every rank calls it with the same step)."""

        rank, world = dist.get_rank(), dist.get_world_size()
        path = iteration_dir(self.root, step)
        self._finish(blocking=True)  # one save in flight at a time
        self._check_space(step, path)
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
            "cost_model": cost_model,
            "model_config": self.model_config,
            "run_config": self.run_config,
        }
        state["rng_state"] = _rng_object(rank, world)
        t0 = time.perf_counter()
        if self._queue is None:
            try:
                dist_checkpointing.save(state, str(path))
            except BaseException as e:  # megatron-core's CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise self._failed(step, e) from None
            _write_manifest(path)
            self._advance(step)
            if rank == 0:
                logger.info("saved checkpoint at iteration %d to %s in %.2f s", step, self.root,
                            time.perf_counter() - t0)
            return path
        request = dist_checkpointing.save(state, str(path), **_async_save_options(dist_checkpointing))

        def finished() -> None:  # runs on every rank once all ranks are done
            _write_manifest(path)
            self._advance(step)
            if rank == 0:
                logger.info("saved checkpoint at iteration %d to %s in %.2f s (in the background)",
                            step, self.root, time.perf_counter() - t0)

        request.add_finalize_fn(finished)
        self._pending = step
        self._queue.schedule_async_request(request)
        return path

    def poll(self) -> None:
        """Finish background saves that are done on every rank (collective; call every step)."""
        self._finish(blocking=False)

    def close(self) -> None:
        """Wait for background saves and stop the writer (collective)."""
        if self._queue is not None:
            self._finish(blocking=True)
            self._queue.close()
            self._queue = None

    def _finish(self, blocking: bool) -> None:
        if self._queue is None:
            return
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or self._pending is None:
                raise
            raise self._failed(self._pending, e) from None

    def _check_space(self, step: int, path: Path) -> None:
        """Refuse, on every rank alike, a save the directory has no room for: rank 0 compares
        the free space with one checkpoint's size (the last one saved, once there is one)."""

        verdict = [None]
        if dist.get_rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            need = space_needed(self.root, self.need)
            free = shutil.disk_usage(self.root).free
            if free < need:
                verdict[0] = (
                    f"checkpoint.dir {self.root}: no space left for iteration {step} "
                    f"({_mb(free)} free, a checkpoint takes about {_mb(need)}); nothing of "
                    f"it was written{self._newest_hint()}"
                )
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise CheckpointError(verdict[0])

    def _newest_hint(self) -> str:
        last = latest_step(self.root)
        return (f"; the newest saved iteration is {iteration_dir(self.root, last).name}"
                if last is not None else "; no iteration is saved")

    def _failed(self, step: int, exc: BaseException) -> CheckpointError:
        """The one-line error of a save that failed part-way; rank 0 removes the partial
        iteration directory (the tracker still names the newest complete one)."""

        path = iteration_dir(self.root, step)
        self._pending = None
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        if _no_space(exc):
            free = shutil.disk_usage(self.root).free
            return CheckpointError(
                f"checkpoint.dir {self.root}: no space left on device saving iteration {step} "
                f"({_mb(free)} free); the partial {path.name} was removed{self._newest_hint()}"
            )
        return CheckpointError(
            f"checkpoint.dir {self.root}: saving iteration {step} failed "
            f"({_first_line(exc)}); the partial {path.name} was removed{self._newest_hint()}"
        )

    def _advance(self, step: int) -> None:
        if dist.get_rank() == 0:
            tmp = self.root / (TRACKER + ".tmp")
            tmp.write_text(str(step))
            tmp.replace(self.root / TRACKER)


def _load_common(path: Path) -> tuple[dict | None, str | None]:
    """(common state, None) of an intact-looking iteration directory, or (None, what is wrong):
    missing or empty directory, no .metadata or one that does not load, an empty file, a shard
    file the metadata names that is missing or shorter than the bytes it names in it, a common
    state that does not load. (Bytes changed inside a shard show only when it loads.)"""

    if not path.is_dir() or not any(path.iterdir()):
        return None, "the directory is empty" if path.is_dir() else "no such directory"
    if not (path / ".metadata").is_file():
        return None, ".metadata is missing"
    empty = sorted(f.name for f in path.iterdir() if f.is_file() and f.stat().st_size == 0)
    if empty:
        return None, f"{empty[0]} is empty"
    problem = _shard_files_problem(path) or _manifest_sizes_problem(path)
    if problem is not None:
        return None, problem
    try:
        with warnings.catch_warnings():  # read here in one process, on purpose (megatron-core
            # 0.19 reads it through torch.distributed.checkpoint, which warns of that)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, "
                                    "unavailable or uninitialized", category=UserWarning)
            return dist_checkpointing.load_common_state_dict(str(path)), None
    except Exception as e:  # a truncated or garbled common state
        return None, f"its common state does not load: {_first_line(e)}"


def _shard_files_problem(path: Path) -> str | None:
    """What is wrong with the shard files `.metadata` lists (None: each is there and holds at
    least the bytes it names), or that `.metadata` itself does not load."""
    try:

        md = FileSystemReader(str(path)).read_metadata()
    except BaseException as e:  # truncated or garbled (pickle errors, EOF)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f".metadata does not load: {_first_line(e)}"
    ends: dict[str, int] = {}
    for info in (getattr(md, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel in sorted(ends):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size < ends[rel]:
            return f"{rel} is truncated ({size} of {ends[rel]} bytes)"
    return None


def _manifest_sizes_problem(path: Path) -> str | None:
    """A file the manifest lists that is missing or of another size (sizes only: the sums are
    checked by the ranks as they load)."""
    files, problem = _read_manifest(path)
    if problem is not None or files is None:
        return problem
    for name, (size, _) in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} holds {f.stat().st_size} bytes, {size} were saved"
    return None


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

    saved = dict(meta.get("run_config") or {})
    if finetune or not run_config:
        return
    if "schedule.decay_steps" not in saved and "schedule.train_steps" in saved:
        saved["schedule.decay_steps"] = saved["schedule.train_steps"]  # saved before decay_steps
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
        keep = next((old for k, old, _ in schedule if k == "schedule.decay_steps"), None)
        extend = (
            f" (or, after a longer schedule.train_steps, schedule.decay_steps={keep} to keep "
            "the saved one)" if keep is not None and len(schedule) == 1 else ""
        )
        raise ValueError(
            f"checkpoint.dir: {path} was saved with another learning-rate schedule "
            f"({words(schedule)}); set checkpoint.override_scheduler=true to continue with this "
            f"config's schedule{extend}"
        )


@dataclass
class LoadPlan:
    """Where a run loads from: `root`'s iteration `step`, in full or (finetune) weights only."""

    root: Path
    step: int
    finetune: bool
    own: bool  # checkpoint.dir (this run's own checkpoints), not checkpoint.load_dir
    meta: dict  # the checkpoint's Libra metadata

    @property
    def path(self) -> Path:
        return iteration_dir(self.root, self.step)

    def saved_decay_steps(self) -> int | None:
        rc = self.meta.get("run_config") or {}
        return rc.get("schedule.decay_steps", rc.get("schedule.train_steps"))


def load_plan(ck, model_config: dict | None = None, run_config: dict | None = None):
    """The checkpoint a run with checkpoint settings `ck` starts from (None: from scratch), as
    Megatron-LM's --load / --save: checkpoint.dir once it holds a checkpoint (an exact resume of
    this run), else checkpoint.load_dir (a full resume into checkpoint.dir, or with finetune its
    weights). Refuses what would overwrite a run: checkpoint.dir holding iterations while
    checkpoint.resume is false. The checkpoint must be intact, hold this model and, unless
    overridden, this run's settings (check_resume); needs no process group."""
    own = latest_step(ck.dir) if ck.dir else None
    if own is not None and not ck.resume:
        raise ValueError(
            f"checkpoint.dir {ck.dir} already holds a run (latest iteration {own}) and "
            "checkpoint.resume is false: this run would overwrite its iterations; set a new "
            "checkpoint.dir, or checkpoint.resume=true to continue it"
        )
    if ck.dir and ck.resume and (own is not None or ck.load_dir is None):
        root, finetune, is_own = ck.dir, False, True
    elif ck.load_dir is not None:
        root, finetune, is_own = ck.load_dir, ck.finetune, False
    else:
        return None
    step = latest_step(root) if ck.load_iteration is None else int(ck.load_iteration)
    if step is None:
        if not is_own:
            raise ValueError(
                f"checkpoint.load_dir {root} holds no checkpoint ({TRACKER} is missing)"
            )
        return None
    if ck.load_iteration is not None and not iteration_dir(root, step).is_dir():
        raise ValueError(f"checkpoint.load_iteration: {iteration_dir(root, step)} does not exist")
    _, meta = _checked_meta(iteration_dir(root, step), model_config)
    check_resume(iteration_dir(root, step), meta, run_config, ck.override_scheduler, finetune)
    return LoadPlan(Path(root), step, finetune, is_own, meta)


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
    problem = _verify_manifest(path)
    if problem is not None:
        raise damaged(path, problem)
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except BaseException as e:  # a damaged shard (CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
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
        cost_model=meta.get("cost_model"),
    )
