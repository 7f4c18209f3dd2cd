"""A checkpoint directory that cannot take the run's checkpoints is found before any worker
starts (cannot be created, not writable, too little free space), and a disk that fills during
the run ends it in one line naming the directory and the iteration, with no partial iteration
left behind and the tracker on the newest complete one."""

import errno
import subprocess
import traceback
from pathlib import Path

import pytest

from megatron.libra.cli import main

pytestmark = pytest.mark.slow  # spawns training processes

CPU_TINY = "configs/train/cpu_tiny.yaml"
BASE = ["schedule.train_steps=4", "schedule.warmup_steps=0", "parallel.cp=1"]


def _train(over, capfd):
    try:
        rc = main(["train", "--config", CPU_TINY, "--nproc", "2", *over])
    except SystemExit as e:  # a failed worker: reported in one line, exit 1
        rc = e.code
    return rc, capfd.readouterr().err


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MiB tmpfs (a full disk in miniature: two checkpoints of the tiny model fit, not
    three); skipped, with the reason, where this machine does not allow mounting one."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_directory_that_cannot_be_made_or_written_is_refused_before_launch(tmp_path, capfd):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    rc, err = _train(BASE + [f"checkpoint.dir={blocker / 'ck'}"], capfd)
    assert rc == 2 and f"checkpoint.dir {blocker / 'ck'} cannot be created" in err
    assert err.count("\n") == 1
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (the unwritable-directory case)")
    try:
        rc, err = _train(BASE + [f"checkpoint.dir={locked}"], capfd)
        assert rc == 2 and f"checkpoint.dir {locked} is not writable" in err
        rc, err = _train(BASE + [f"checkpoint.dir={locked / 'sub'}"], capfd)
        assert rc == 2 and "cannot be created: Operation not permitted" in err
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=False)


def test_too_little_space_is_refused_before_launch_and_a_full_disk_ends_in_one_line(
    small_disk, capfd
):
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (4 << 20))  # 1 MiB left: less than one checkpoint (1.8 MiB)
    ck = small_disk / "ck"
    rc, err = _train(BASE + [f"checkpoint.dir={ck}"], capfd)
    assert rc == 2 and err.count("\n") == 1
    assert f"checkpoint.dir {ck} has 1.0 MiB free; one checkpoint of this model takes" in err
    assert not ck.exists()  # the refusal leaves nothing behind
    filler.unlink()  # room for two checkpoints, not three
    rc, err = _train(BASE + [f"checkpoint.dir={ck}", "checkpoint.save_interval=1"], capfd)
    assert rc == 1 and err.count("\n") == 1, err  # the run's own lines are on stdout
    line = err
    assert f"checkpoint.dir {ck}: no space left for iteration 3" in line
    assert "nothing of it was written; the newest saved iteration is iter_0000002" in line
    assert sorted(p.name for p in ck.iterdir()) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_a_save_that_fails_part_way_removes_its_partial_iteration(tmp_path, monkeypatch):
    """A write that runs out of space inside megatron-core's save (the free-space check passed,
    e.g. another job filled the disk): one CheckpointError line, the partial directory gone, the
    tracker unchanged. One rank, in this process."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.libra import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        root = tmp_path / "ck"
        (root / "iter_0000004").mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("4")

        def full_disk(state, path, **kw):
            (Path(path) / "__0_0.distcp").write_bytes(b"partial")
            failure = OSError(errno.ENOSPC, "No space left on device")
            raise CheckpointException("write", {0: (failure, traceback.StackSummary())})

        monkeypatch.setattr(dist_checkpointing, "save", full_disk)
        monkeypatch.setattr(checkpoint, "_sharded", lambda *a, **k: {})
        saver = checkpoint.Checkpointer(root, need=0)

        class Batch:
            doc_base, n_inputs, planner_state, recent_bases = 0, 0, {}, {}

        class Sched:
            def state_dict(self):
                return {}

        with pytest.raises(checkpoint.CheckpointError) as e:
            saver.save(5, None, None, Sched(), Batch())
        msg = str(e.value)
        assert "\n" not in msg and f"checkpoint.dir {root}: no space left on device saving " \
            "iteration 5" in msg
        assert "the partial iter_0000005 was removed; the newest saved iteration is " \
            "iter_0000004" in msg
        assert not (root / "iter_0000005").exists()
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    finally:
        dist.destroy_process_group()
