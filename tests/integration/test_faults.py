"""Faults end cleanly: a signal to the launcher alone stops every worker and exits 128 + signal;
a worker that dies leaves nothing behind (workers, async checkpoint writers)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.libra.launch import _below, _process_tree

pytestmark = pytest.mark.slow  # spawns training or multi-rank processes

CPU_TINY = "configs/train/cpu_tiny.yaml"
LONG = ["schedule.train_steps=400", "schedule.warmup_steps=1", "parallel.cp=1",
        "parallel.pool_size=2"]


def _start(tmp_path: Path, extra: list[str]) -> tuple[subprocess.Popen, Path]:
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-c", "from megatron.libra.cli import main; raise SystemExit(main())"]
    cmd += ["train", "--config", CPU_TINY, "--nproc", "2", *LONG,
            f"logging.metrics_file={metrics}", *extra]
    out = open(tmp_path / "stdout.txt", "w")  # the run's own lines (a file: never blocks)
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=out, stderr=subprocess.PIPE,
                            text=True)
    out.close()
    return proc, metrics


def _wait_for_steps(proc, metrics: Path, n: int) -> None:
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_alone_stops_every_worker(tmp_path, sig, code):
    proc, metrics = _start(tmp_path, [])
    try:
        _wait_for_steps(proc, metrics, 1)
        started = _below([proc.pid], _process_tree())
        assert started, "no workers found"
        os.kill(proc.pid, sig)  # the launcher only, as a scheduler or wrapper does
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == code, err[-2000:]
    assert f"stopped by {signal.Signals(sig).name}" in err and "Traceback" not in err
    time.sleep(0.5)
    assert _alive(started) == [], "workers outlived the launcher"
    steps = len(metrics.read_text().splitlines())
    time.sleep(3)
    assert len(metrics.read_text().splitlines()) == steps  # nobody trains on


def _start_saving_every_step(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A run that saves asynchronously after every step (workers with checkpoint writers)."""
    return _start(tmp_path, [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.save_interval=1",
                             "checkpoint.async_save=true"])


def _workers(proc) -> list[int]:
    """The launcher's workers: the children of its fork server, or its spawned children where
    a GPU is visible (megatron.libra.launch)."""
    tree = _process_tree()

    def started(what: bytes) -> list[int]:
        return [p for p in tree.get(proc.pid, [])
                if what in Path(f"/proc/{p}/cmdline").read_bytes()]

    servers = started(b"multiprocessing.forkserver")
    assert len(servers) <= 1, f"{len(servers)} fork servers below the launcher"
    return sorted(tree.get(servers[0], []) if servers else started(b"spawn_main"))


def _described(pids) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = "(gone)"
        out.append(f"{pid}: {cmd[:200]}")
    return out


def _gather_run(proc) -> set[int]:
    """Every process below the launcher, seen over a second (writers come and go)."""
    seen: set[int] = set()
    for _ in range(20):
        seen |= set(_below([proc.pid], _process_tree()))
        time.sleep(0.05)
    return seen


def test_a_dead_worker_leaves_no_checkpoint_writers_behind(tmp_path):
    proc, metrics = _start_saving_every_step(tmp_path)
    seen: set[int] = set()
    try:
        _wait_for_steps(proc, metrics, 2)
        seen |= _gather_run(proc)  # the workers and their background writers
        workers = _workers(proc)
        os.kill(workers[-1], signal.SIGKILL)
        seen |= _gather_run(proc)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc != 0
    time.sleep(0.5)
    assert len(seen) >= 2
    assert _alive(seen) == [], f"processes of the run outlived it: {_described(_alive(seen))}"


def test_a_launcher_killed_mid_save_takes_every_process_of_the_run_with_it(tmp_path):
    # SIGKILL to the launcher alone (nothing it can handle) while its workers save
    # asynchronously: the workers notice their parent is gone and end, and so do their
    # checkpoint writers and resource trackers (megatron.libra.lifetime)
    proc, metrics = _start_saving_every_step(tmp_path)
    seen: set[int] = set()
    try:
        _wait_for_steps(proc, metrics, 2)
        seen |= _gather_run(proc)  # the workers and their background writers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        time.sleep(3)
        left = _alive(seen)
    finally:
        for pid in _alive(seen):
            os.kill(pid, signal.SIGKILL)
    assert len(seen) >= 3  # (two workers and at least one writer)
    assert left == [], "processes of the run outlived its launcher"


def test_a_stalled_rank_ends_the_run_with_a_timeout_not_a_hang(tmp_path):
    # parallel.timeout_minutes = 0.1: six seconds after one worker stops, the other's next
    # collective times out and the run ends with one line saying so
    proc, metrics = _start(tmp_path, ["parallel.timeout_minutes=0.1"])
    try:
        _wait_for_steps(proc, metrics, 1)
        workers = _workers(proc)
        os.kill(workers[0], signal.SIGSTOP)
        rc = proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 1, err[-2000:]
    assert "failed:" in err and "parallel.timeout_minutes = 0.1" in err, err[-2000:]
    # the message names where the rank waited: the step's phase and its group
    assert re.search(r"during (the|forward/backward) .*group", err), err[-2000:]
    assert _alive(workers) == []


def test_save_on_signal_checkpoints_the_next_iteration_and_stops(tmp_path):
    ck = tmp_path / "ck"
    proc, metrics = _start(tmp_path, [f"checkpoint.dir={ck}", "checkpoint.save_on_signal=true"])
    try:
        _wait_for_steps(proc, metrics, 2)
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=300)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143, err[-2000:]
    trained = len(metrics.read_text().splitlines())
    tracker = ck / "latest_checkpointed_iteration.txt"
    assert tracker.is_file() and int(tracker.read_text()) == trained  # the last one trained
    assert "stopping after iteration" in (tmp_path / "stdout.txt").read_text()
