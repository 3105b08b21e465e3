#!/usr/bin/env bash
# Downloads, into .gpu-wheels/ (not committed), the wheels a bare GPU machine
# needs to run Crucible from this source tree with its own python3 and CUDA
# torch: grpcio and protobuf at the versions crucible/_pb needs, zstandard,
# grpcio-health-checking, prometheus-client, typing-extensions, and pytest for
# the GPU suite. PY_VER is that machine's Python (default 3.12).
# Then: launch/gpu-check.sh there (see its header).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VER=${PY_VER:-3.12}
mkdir -p .gpu-wheels
.venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d .gpu-wheels \
    --python-version "$PY_VER" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    grpcio==1.85.1 protobuf==7.36.2 zstandard==0.25.0 typing_extensions==4.16.0 \
    grpcio-health-checking==1.85.1 prometheus-client==0.21.1 \
    pytest==8.3.5 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2
ls -1 .gpu-wheels
