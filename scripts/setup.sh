#!/usr/bin/env bash
# Installs what the project needs from the package index, without replacing a torch or a Triton
# that is already there (a ROCm torch ships its own Triton as pytorch-triton-rocm).
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0" || $PY -m pip install -q torch
fi
if ! $PY -c "import triton" 2>/dev/null; then
  $PY -m pip install -q "triton>=3.5,<3.10"
fi
$PY -m pip install -q -e ".[test]"
