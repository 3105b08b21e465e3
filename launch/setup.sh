#!/usr/bin/env bash
# Sets up .venv for Crucible on a machine that has nothing but Python 3.10+.
# Idempotent: a second run installs nothing new.
#
# torch: where the venv has no torch yet, the pinned CPU build (torch==2.13.0)
# is installed first, so that the project's `torch>=2.4` range never pulls a
# multi-GB CUDA build. GPU users: create .venv yourself, install the torch
# build for your CUDA version into it, then run this script; it keeps yours.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install -q --disable-pip-version-check "torch==${CRUCIBLE_TORCH_VERSION:-2.13.0}"
fi
stamp=.venv/.crucible-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
    touch "$stamp"
fi
