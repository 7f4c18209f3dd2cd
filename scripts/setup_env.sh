#!/usr/bin/env bash
# Create (or update) .venv/ at the repository root and install this package into it.
# Idempotent: a second run rebuilds the C++ extension only if its sources or toolchain changed.
# torch 2.13.0 is installed explicitly when no torch is present, so that pip never resolves a
# plain `torch` requirement to a multi-GB CUDA build on CPU-only machines (on Python 3.12 the
# registry's 2.13.0 is a CUDA build; it runs on CPU).
#
# VENV (default .venv) and PYTHON (default: a Python 3.12 or 3.13 where one is found, else
# python3) choose another environment. With Python >= 3.12 it gets megatron-core 0.19.2, whose
# wheel ships megatron.training (Megatron-LM's `pretrain`), which pretrain_gpt_libra.py needs;
# with 3.11 megatron-core 0.16 (`libra train` only):
#   VENV=.venv-compat PYTHON=python3.11 bash scripts/setup_env.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-.venv}"
# The Python: $PYTHON, else a 3.12 (then a 3.13) found (python3.12 / python3.13 on PATH, or
# pyenv's versions), else python3. megatron-core 0.19's wheel (megatron.training, which
# pretrain_gpt_libra.py runs on) needs Python >= 3.12; on an older one `libra train` runs on
# megatron-core 0.16.
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
           python3.13 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv' >/dev/null 2>&1; then
      py="$c"
      break
    fi
  done
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv with $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
if ! "$vpy" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "[setup] $venv has Python $("$vpy" -c 'import sys; print(sys.version.split()[0])'):" \
       "megatron-core 0.16 (libra train); pretrain_gpt_libra.py needs Python >= 3.12" \
       "(PYTHON=python3.12 with a new VENV, or remove $venv)"
fi
if "$vpy" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  # megatron.training's HuggingFaceTokenizer (--tokenizer-type) reads tokenizers through
  # transformers' AutoTokenizer
  mcore="megatron-core==0.19.2 transformers>=4.45"
else
  mcore="megatron-core>=0.15"
fi
"$vpy" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0"
  "$vpy" -m pip install -q "torch==2.13.0"
fi
"$vpy" -m pip install -q "setuptools>=64" wheel "pybind11>=2.12" numpy pyyaml tqdm matplotlib \
  $mcore psutil pytest hypothesis ninja "tokenizers>=0.19" tensorboard
# Build the extension in place and expose the sources to the venv (editable, compat mode: the
# repository root goes on sys.path, so `megatron.libra` joins the installed `megatron` namespace).
# Skipped when nothing it depends on changed since the last build: the C++ sources, the build
# files, and the Python, torch and pybind11 it was built with (a digest kept in the venv).
stamp="$venv/.libra_build_digest"
digest="$( { find cpp -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' \) -print0 | sort -z \
             | xargs -0 sha256sum; sha256sum setup.py pyproject.toml;
             "$vpy" -c 'import sys, torch, pybind11; print(sys.version, torch.__version__, pybind11.__version__)';
           } | sha256sum | cut -d' ' -f1 )"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && [ -x "$venv/bin/libra" ] \
   && "$vpy" -c "import libra_ext._planner" >/dev/null 2>&1; then
  echo "[setup] C++ extension up to date (sources unchanged since the last build)"
else
  rm -f "$stamp"
  "$vpy" -m pip install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat
  echo "$digest" > "$stamp"
fi
echo "[setup] ok: $("$vpy" -c 'import sys, libra_ext, libra_ext._planner, megatron.core as m; print(f"libra_ext {libra_ext.__version__} in '"$venv"' (Python {sys.version.split()[0]}, megatron-core {m.__version__})")')"
