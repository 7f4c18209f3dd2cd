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
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
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
    )


def _run(script: str, args: list, tmp_path: Path) -> subprocess.CompletedProcess:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm" / script), *args],
        cwd=tmp_path,
        env=_slurm(tmp_path),
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
