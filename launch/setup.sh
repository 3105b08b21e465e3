#!/usr/bin/env bash
# Sets up .venv for Crucible on a machine that has nothing but Python 3.11+.
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
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        { echo "setup: $PY is $("$PY" -V 2>&1); Crucible needs Python 3.11+ (set PYTHON=python3.11)" >&2; exit 2; }
    "$PY" -m venv .venv
fi
.venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    { echo "setup: .venv has $(.venv/bin/python -V 2>&1); Crucible needs Python 3.11+ (remove .venv, set PYTHON)" >&2; exit 2; }
# A torch older than the project's floor would be replaced by pip with PyPI's
# default (CUDA) build: say so instead.
tv=$(.venv/bin/python -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [ -z "$tv" ]; then
    .venv/bin/pip install -q --disable-pip-version-check "torch==${CRUCIBLE_TORCH_VERSION:-2.13.0}"
elif ! .venv/bin/python -c "import sys; v = sys.argv[1].split('+')[0].split('.'); sys.exit((int(v[0]), int(v[1])) < (2, 4))" "$tv"; then
    echo "setup: .venv has torch $tv; Crucible needs torch>=2.4 (install a newer build for your CUDA into .venv first)" >&2
    exit 2
fi
stamp=.venv/.crucible-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
    touch "$stamp"
fi
