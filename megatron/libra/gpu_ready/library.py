"""The fake-CUDA library (`fake_cuda_guard.cpp`): where it is built, building it, and the
environment of a process started with it preloaded. Used by the gate's launching process, which
never imports torch itself: this module reads torch's version and location from its package
metadata, and skips the build (a process that imports torch's extension loader) while the
library built last matches the source and this environment."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_cuda_guard.cpp")
LIB_NAME = "libra_fake_cuda"
PRELOAD_ENV = "LIBRA_FAKE_CUDA_LIB"
"""Set (to the library's path) in the gate's process, which was started with it preloaded."""

ROOT = Path(__file__).resolve().parents[3]


def _torch_version() -> str:
    return importlib.metadata.version("torch")


def build_dir() -> Path:
    """Where the library is built: build/fake_cuda/<python>-<torch> under the checkout
    (LIBRA_BUILD_DIR overrides build/), one per environment that shares the checkout."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{_torch_version()}"
    return Path(os.environ.get("LIBRA_BUILD_DIR") or ROOT / "build") / "fake_cuda" / tag


def _stamp() -> str:
    """What the built library depends on: its source, this interpreter and torch's version."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{sys.executable}\0{_torch_version()}".encode())
    return h.hexdigest()


def build_library(verbose: bool = False) -> Path:
    """Build the library (only what changed is rebuilt) in a process of its own, so that this
    one never loads it; returns its path. A library whose stamp matches is used as it is."""
    out = build_dir()
    lib, stamp, want = out / f"{LIB_NAME}.so", out / f"{LIB_NAME}.stamp", _stamp()
    if lib.exists() and stamp.exists() and stamp.read_text() == want:
        return lib
    out.mkdir(parents=True, exist_ok=True)
    code = (
        "from torch.utils.cpp_extension import load; "
        f"load({LIB_NAME!r}, [{str(SOURCE)!r}], build_directory={str(out)!r}, "
        f"verbose={verbose})"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if p.returncode != 0 or not lib.exists():
        raise RuntimeError(
            f"building the fake-CUDA library failed (a C++ compiler and ninja are needed):\n"
            f"{p.stderr[-3000:]}"
        )
    stamp.write_text(want)
    return lib


def preload_env(lib: Path) -> dict:
    """The environment of a process started with the library preloaded."""
    env = dict(os.environ)
    torch_lib = str(Path(importlib.util.find_spec("torch").origin).parent / "lib")
    env["LD_LIBRARY_PATH"] = torch_lib + (":" + env["LD_LIBRARY_PATH"]
                                          if env.get("LD_LIBRARY_PATH") else "")
    env["LD_PRELOAD"] = str(lib) + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env[PRELOAD_ENV] = str(lib)
    return env
