"""The shell entry points around the package: scripts/setup_env.sh rebuilds the extension only
when something it depends on changed, the Slurm scripts pass every argument through intact from
any submit setting, and the Docker build context leaves local environments and outputs out."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


# A stand-in interpreter for setup_env.sh: it records every pip install it is asked for, and
# answers the version probe with what FAKE_VERSIONS holds.
FAKE_PYTHON = """#!/bin/bash
case "$*" in
  *"-m pip install"*" -e ."*) echo build >> "$FAKE_LOG" ;;
  *"-m pip install"*) echo deps >> "$FAKE_LOG" ;;
  *"print(sys.version"*) echo "$FAKE_VERSIONS" ;;
  *"libra_ext.__version__"*) echo "libra_ext test" ;;
esac
exit 0
"""


def _setup_tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup_env.sh", root / "scripts")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, root)
    (root / "cpp" / "src").mkdir(parents=True)
    (root / "cpp" / "include").mkdir()
    (root / "cpp" / "src" / "a.cpp").write_text("int a() { return 1; }\n")
    (root / "cpp" / "include" / "a.h").write_text("int a();\n")
    bindir = root / ".venv" / "bin"
    bindir.mkdir(parents=True)
    _executable(bindir / "python", FAKE_PYTHON)
    _executable(bindir / "libra", "#!/bin/bash\n")
    return root


def _run_setup(root: Path, versions: str = "3.11 torch-2.13 pybind11-2.13") -> list[str]:
    log = root / "calls.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, FAKE_LOG=str(log), FAKE_VERSIONS=versions)
    out = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=root, env=env, check=True,
                         capture_output=True, text=True).stdout
    calls = log.read_text().split() if log.exists() else []
    return calls + (["skipped"] if "up to date" in out else [])


def test_setup_rebuilds_the_extension_only_when_its_inputs_change(tmp_path):
    root = _setup_tree(tmp_path)
    assert _run_setup(root).count("build") == 1  # first run: builds
    assert "build" not in _run_setup(root) and "skipped" in _run_setup(root)  # nothing changed
    (root / "cpp" / "include" / "a.h").write_text("int a(); // changed\n")
    assert _run_setup(root).count("build") == 1  # a header changed
    assert "skipped" in _run_setup(root)
    assert _run_setup(root, "3.11 torch-2.14 pybind11-2.13").count("build") == 1  # new torch
    (root / "setup.py").write_text((root / "setup.py").read_text() + "\n# changed\n")
    assert _run_setup(root, "3.11 torch-2.14 pybind11-2.13").count("build") == 1
    (root / ".venv" / "bin" / "libra").unlink()  # a broken install is repaired, not skipped
    assert _run_setup(root, "3.11 torch-2.14 pybind11-2.13").count("build") == 1


def _slurm_tree(tmp_path: Path) -> tuple[Path, dict]:
    """The repository's Slurm scripts beside stand-ins for srun and scontrol on PATH and an
    environment (LIBRA_VENV) whose torchrun and libra are stand-ins; the stand-in torchrun writes
    the arguments it got, one per line. Returns the environment's bin folder and the variables."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _executable(bindir / "srun", '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    # the node list arrives in two writes (a long list is many): a reader that stops after the
    # first line must not turn the second write's SIGPIPE into the job's exit status
    _executable(bindir / "scontrol", "#!/bin/bash\necho node001\nsleep 0.2\necho node002\n")
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    _executable(venv_bin / "torchrun", '#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    _executable(venv_bin / "libra", "#!/bin/bash\n")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", ARGS_OUT=str(tmp_path / "args"),
               SLURM_JOB_NODELIST="node[001-002]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="42",
               LIBRA_VENV=str(tmp_path / "venv"))
    return venv_bin, env


def test_slurm_scripts_keep_each_argument_whole_from_a_spool_copy(tmp_path):
    bindir, env = _slurm_tree(tmp_path)
    spool = tmp_path / "spool"  # sbatch runs a copy of the script from its spool directory
    spool.mkdir()
    for name in ("train.sbatch", "ab.sbatch"):
        shutil.copy(ROOT / "scripts" / "slurm" / name, spool / name)
    env["SLURM_SUBMIT_DIR"] = str(ROOT)
    note = "logging.run_name=long run 1"  # an override that holds spaces
    subprocess.run(["bash", str(spool / "train.sbatch"), "configs/x.yaml", note], env=env,
                   cwd=tmp_path, check=True)
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:4] == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-id=42", "--rdzv-backend=c10d"]
    assert args[4] == "--rdzv-endpoint=node001:29500"
    assert args[5:] == [str(bindir / "libra"), "train", "--config", "configs/x.yaml", note]
    subprocess.run(["bash", str(spool / "ab.sbatch"), "c.yaml", "7", "libra,wlb", note],
                   env=env, cwd=tmp_path, check=True)
    args = (tmp_path / "args").read_text().splitlines()
    assert args[6:] == ["ab", "--config", "c.yaml", "--systems", "libra,wlb", "--steps", "7",
                        "--out", "out/ab", note]
    env["SLURM_SUBMIT_DIR"] = str(tmp_path)  # submitted from elsewhere: one clear line
    r = subprocess.run(["bash", str(spool / "train.sbatch"), "c.yaml"], env=env, cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "submit from the repository root or set LIBRA_ROOT" in r.stderr


def test_slurm_log_paths_need_no_directory_made_first():
    for name in ("train.sbatch", "ab.sbatch"):
        for line in (ROOT / "scripts" / "slurm" / name).read_text().splitlines():
            if line.startswith("#SBATCH --output=") or line.startswith("#SBATCH --error="):
                assert "/" not in line.split("=", 1)[1], line  # opened before the script runs


def _docker_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Docker reads it: anchored at the context root, `*` and `?`
    within one path element, `**/` any number of directories."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _ignored(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` out: the last pattern that matches it or a directory above
    it decides (a leading `!` brings it back)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pat in patterns:
        negate = pat.startswith("!")
        rx = _docker_regex(pat.lstrip("!").strip("/"))
        if any(rx.match(p) for p in prefixes):
            result = not negate
    return result


def test_docker_context_leaves_out_environments_and_outputs_but_not_the_build():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for path in (".venv/lib/python3.11/site-packages/torch/__init__.py", "out/ab/report.md",
                 ".venv-compat/lib/python3.11/site-packages/torch/__init__.py",
                 ".whl/megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "build/temp/planner.o", "libra_ext/_planner.cpython-311-x86_64-linux-gnu.so",
                 ".git/objects/pack/x.pack", "libra_ext/__pycache__/x.pyc"):
        assert _ignored(patterns, path), path
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked and not [p for p in tracked if _ignored(patterns, p)]
