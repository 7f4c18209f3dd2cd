"""The Slurm scripts end to end on this machine: `srun` and `scontrol` are stand-ins (run the
command here; name this host), torchrun and the c10d rendezvous are real, ranks use gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from libra_ext.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo stand-in"),
    pytest.mark.slow,  # spawns training processes
]


def _slurm(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: records its options, then runs the command here
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\nwhile [[ "$1" == --* ]]; do echo "$1" >> {tmp_path}/srun_args; '
        'shift; done\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    venv_bin = Path(sys.executable).parent
    return dict(
        os.environ,
        PATH=f"{bin_dir}:{venv_bin}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="node1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_ID="42",
        GPUS_PER_NODE="2",
        OMP_NUM_THREADS="1",
        MASTER_PORT=str(free_port()),
        LIBRA_VENV=str(Path(sys.executable).parent.parent),
    )


def _run(script: str, args: list, tmp_path: Path, env: dict | None = None) \
        -> subprocess.CompletedProcess:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm" / script), *args],
        cwd=tmp_path,
        env=env or _slurm(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_train_sbatch_runs_torchrun_ranks(tmp_path):
    metrics = tmp_path / "train.jsonl"
    config = str(ROOT / "configs" / "train" / "cpu_tiny.yaml")
    over = ["parallel.cp=1", "schedule.train_steps=2", "schedule.warmup_steps=1"]
    _run("train.sbatch", [config, *over, f"logging.metrics_file={metrics}"], tmp_path)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and len(steps[0]["attn_time_per_rank"]) == 2


def test_ab_sbatch_writes_the_report(tmp_path):
    config = str(ROOT / "configs" / "train" / "cpu_tiny.yaml")
    _run("ab.sbatch", [config, "2", "libra,ulysses", "parallel.cp=1", "--repeats", "1",
                       "schedule.warmup_steps=1"], tmp_path)
    r = json.loads((tmp_path / "out" / "ab" / "ab.json").read_text())
    assert set(r["systems"]) == {"libra", "ulysses"} and r["world_size"] == 2
    assert r["systems"]["libra"]["max_rel_loss_diff_vs_ulysses"] <= 1e-4
    assert (tmp_path / "out" / "ab" / "report.md").stat().st_size > 0


def test_pretrain_sbatch_runs_megatron_lms_loop_from_a_clean_environment(tmp_path):
    # env -i: no project environment on PATH; launch.sh calls the venv's torchrun by path and
    # hands the job's cores to srun
    full = _slurm(tmp_path)
    env = {k: full[k] for k in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_JOB_ID",
                                "GPUS_PER_NODE", "OMP_NUM_THREADS", "MASTER_PORT",
                                "LIBRA_VENV")}
    env.update(PATH=f"{tmp_path / 'bin'}:/usr/bin:/bin", HOME=str(tmp_path),
               SLURM_CPUS_PER_TASK="2", LIBRA_ROOT=str(ROOT))
    if os.environ.get("PYTHONPATH"):  # (a checkout run without installing it)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    out = _run("pretrain_gpt_libra.sbatch",
               ["--yaml-cfg", str(ROOT / "configs" / "megatron" / "cpu_tiny.yaml"),
                "--train-iters", "3", "--libra-pool-size", "1", "--log-interval", "1"],
               tmp_path, env)
    assert "iteration        3/       3" in out.stdout
    assert "--cpus-per-task=2" in (tmp_path / "srun_args").read_text().split()
    # without an environment to run in, one line says what to do
    env["LIBRA_VENV"] = str(tmp_path / "nowhere")
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "pretrain_gpt_libra.sbatch")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no torchrun in" in bad.stderr
