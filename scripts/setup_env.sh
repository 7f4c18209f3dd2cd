#!/usr/bin/env bash
# Create (or update) .venv/ at the repository root and install this package into it.
# Idempotent: a second run only rebuilds the C++ extension if its sources changed.
# torch 2.13.0 is installed explicitly when no torch is present, so that pip never resolves a
# plain `torch` requirement to a multi-GB CUDA build on CPU-only machines.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
vpy=.venv/bin/python
"$vpy" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0"
  "$vpy" -m pip install -q "torch==2.13.0"
fi
"$vpy" -m pip install -q "setuptools>=64" wheel "pybind11>=2.12" numpy pyyaml tqdm matplotlib \
  "megatron-core>=0.15" psutil pytest hypothesis ninja
# Build the extension in place and expose the sources to the venv (editable, compat mode: the
# repository root goes on sys.path, so `megatron.libra` joins the installed `megatron` namespace).
"$vpy" -m pip install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat
echo "[setup] ok: $("$vpy" -c 'import libra_ext, libra_ext._planner as p; print("libra_ext", libra_ext.__version__)')"
