"""Local ranks forked from one fork server per process (libra_ext.distributed.run_ranks, and the
launcher's workers): each takes the environment and output of the process that starts it now,
not those of the server's first start, and the server is reused from start to start."""

import os
import sys

import pytest
import torch

from libra_ext import distributed
from libra_ext.distributed import fork_server_pid, run_ranks

pytestmark = pytest.mark.slow  # starts processes


def _report(rank: int, out: str, tag: str) -> None:
    print(f"rank {rank} says {tag}", flush=True)
    print(f"rank {rank} warns {tag}", file=sys.stderr, flush=True)
    with open(os.path.join(out, f"{rank}.txt"), "w") as fh:
        fh.write(f"{os.environ.get('LIBRA_FORK_SERVER_TEST', '-')} {os.getppid()}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU ranks are spawned")
def test_ranks_take_the_starting_processes_environment_and_output_now(tmp_path, capfd,
                                                                       monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    run_ranks(_report, (str(first), "first"), 2)  # (the server may start here)
    server = fork_server_pid()
    assert server is not None
    capfd.readouterr()
    monkeypatch.setenv("LIBRA_FORK_SERVER_TEST", "changed")
    run_ranks(_report, (str(second), "second"), 2)
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} says second" in out and f"rank {rank} warns second" in err
        env, parent = (second / f"{rank}.txt").read_text().split()
        assert env == "changed"
        assert int(parent) == server == fork_server_pid()  # the same server, started once


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")


def test_a_failed_rank_raises_its_error_in_the_starting_process():
    from torch.multiprocessing import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match="rank 1 refuses"):
        run_ranks(_fail, (), 2)


def test_with_a_gpu_ranks_are_spawned_and_keep_their_output(tmp_path, capfd, monkeypatch):
    # a process forked from one whose imports asked for a device cannot initialize CUDA: with
    # a GPU visible, ranks are spawned, and take the parent's environment and output the same
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    assert distributed.start_method(()) == "spawn"
    monkeypatch.setenv("LIBRA_FORK_SERVER_TEST", "spawned")
    server = fork_server_pid()
    run_ranks(_report, (str(tmp_path), "spawned"), 2)
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} says spawned" in out and f"rank {rank} warns spawned" in err
        env, parent = (tmp_path / f"{rank}.txt").read_text().split()
        assert env == "spawned" and int(parent) == os.getpid() != server
