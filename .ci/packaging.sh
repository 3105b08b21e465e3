#!/usr/bin/env bash
# CI: the built wheel, installed without the source tree, with every
# dependency at its declared minimum, runs a job and the fast tests.
#
#   1. builds the wheel from the files git sees (a copy: the tree stays clean)
#      and checks what it holds (.ci/check_wheel.py);
#   2. makes a fresh venv, installs the CPU build of torch that launch/setup.sh
#      uses, then the wheel with its extras under a constraints file pinning
#      every other dependency to its minimum in pyproject.toml
#      (.ci/min_constraints.py), and checks that is what got installed;
#   3. from an empty directory (no source tree on sys.path): `crucible
#      --version`, a short `crucible launch`, the optional extras used at their
#      minimums (.ci/check_extras.py), and the fast tests on a copy of tests/.
#
# Environment: PYTHON (default python3), CRUCIBLE_TORCH_VERSION (default
# 2.13.0), CRUCIBLE_PKG_TESTS (the test files to run), CRUCIBLE_PKG_KEEP=1
# keeps the temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
PY=${PYTHON:-python3}
TORCH=${CRUCIBLE_TORCH_VERSION:-2.13.0}
EXTRAS=test,report,cluster
TESTS=${CRUCIBLE_PKG_TESTS:-"tests/test_packaging.py tests/test_proto.py tests/test_config.py tests/test_interval.py
  tests/test_data_model.py tests/test_activation_codecs.py tests/test_sparseloco.py tests/test_ckpt_storage.py
  tests/test_checkpoint_units.py"}
PIP=(--disable-pip-version-check --no-input -q)
T0=$(date +%s)
step() { echo "packaging [$(( $(date +%s) - T0 ))s] $*"; }
# pip, without the warnings about this machine's index locations it skips
pipq() { "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; }; }

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    { echo "packaging: $PY is Python $("$PY" -V 2>&1); Crucible needs 3.11+" >&2; exit 2; }

T=$(mktemp -d "${TMPDIR:-/tmp}/crucible-packaging.XXXXXX")
LPID=
cleanup() {
    if [ -n "$LPID" ]; then kill -KILL -- "-$LPID" 2>/dev/null || true; fi
    if [ "${CRUCIBLE_PKG_KEEP:-0}" = 1 ]; then echo "packaging: kept $T"; else rm -rf "$T"; fi
}
trap cleanup EXIT

step "building the wheel"
mkdir -p "$T/src" "$T/dist" "$T/work"
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$T/src"
pipq "$PY" -m pip wheel "${PIP[@]}" --no-deps -w "$T/dist" "$T/src"
WHEEL=$(ls "$T"/dist/crucible-*.whl)
"$PY" .ci/check_wheel.py "$WHEEL" "$T/src"

step "fresh venv, torch==$TORCH (the CPU build launch/setup.sh installs)"
"$PY" -m venv "$T/venv"
V=$T/venv/bin
pipq "$V/pip" install "${PIP[@]}" "torch==$TORCH"
step "the wheel [$EXTRAS], every other dependency at its declared minimum"
"$PY" .ci/min_constraints.py --extras "$EXTRAS" --pin "torch==$TORCH" > "$T/min.txt"
pipq "$V/pip" install "${PIP[@]}" -c "$T/min.txt" "$WHEEL[$EXTRAS]"
"$V/pip" check
"$V/python" - "$T/min.txt" <<'EOF'
import sys
from importlib.metadata import version
from packaging.version import Version
bad, pins = [], [line.strip().split("==") for line in open(sys.argv[1]) if line.strip()]
for name, want in pins:
    got = version(name)
    if Version(Version(got).public) != Version(want):  # 1.26.0 is 1.26; 2.13.0+cpu is 2.13.0
        bad.append(f"{name} {got} (want {want})")
print("packaging: installed at the minimum: " + ", ".join(f"{n}=={version(n)}" for n, _ in pins))
sys.exit(f"packaging: not at the minimum: {', '.join(bad)}" if bad else 0)
EOF

# From here on, nothing of the source tree is importable: an empty working
# directory with copies of tests/, .ci/ and pyproject.toml (for the tests
# that read the declared bounds), and no crucible/ beside them.
cp -r tests .ci pyproject.toml "$T/work/"
cd "$T/work"
"$V/python" - "$T/venv" <<'EOF'
import os, sys
import crucible
where = os.path.realpath(crucible.__file__)
print(f"packaging: import crucible -> {where}")
sys.exit(0 if where.startswith(os.path.realpath(sys.argv[1]) + os.sep) else "packaging: crucible is not the installed one")
EOF
"$V/crucible" --version

step "crucible launch (1 replica x 2 stages, 5 steps)"
setsid "$V/crucible" launch --replicas 1 --stages 2 --steps 5 --run-dir "$T/run" \
    model.n_layer=2 model.d_model=32 model.n_head=2 train.seq_len=32 train.batch_size=8 \
    train.microbatches=2 train.eval_every=0 data.max_bytes=200000 fault.heartbeat_timeout_s=30 fault.rpc_timeout_s=30 \
    > "$T/launch.out" 2>&1 < /dev/null &
LPID=$!
deadline=$(( $(date +%s) + 300 ))
while kill -0 "$LPID" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 1; done
if kill -0 "$LPID" 2>/dev/null; then
    kill -KILL -- "-$LPID" 2>/dev/null || true
    tail -n 30 "$T/launch.out" "$T"/run/logs/* >&2 || true
    echo "packaging: crucible launch did not finish in 300s" >&2; exit 1
fi
rc=0; wait "$LPID" || rc=$?
kill -KILL -- "-$LPID" 2>/dev/null || true; LPID=
if [ "$rc" != 0 ]; then
    tail -n 30 "$T/launch.out" "$T"/run/logs/* >&2 || true
    echo "packaging: crucible launch exited $rc" >&2; exit 1
fi
"$V/python" - "$T/run/metrics.jsonl" <<'EOF'
import json, sys
evs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = sorted({e["step"] for e in evs if e.get("event") == "step"})
kinds = {e.get("event") for e in evs}
loss = [e["loss"] for e in evs if e.get("event") == "step"]
print(f"packaging: launch ran steps {steps}, loss {loss[0]:.3f} -> {loss[-1]:.3f}, job_done: {'job_done' in kinds}")
sys.exit(0 if steps == [0, 1, 2, 3, 4] and "job_done" in kinds else "packaging: the launch did not train 5 steps")
EOF

step "optional extras at their minimums"
"$V/python" .ci/check_extras.py report cluster 2>"$T/extras.err" || { cat "$T/extras.err" >&2; exit 1; }

step "fast tests against the installed package"
# Left to the README's test command: test_generated_code_is_fresh (it
# regenerates crucible/_pb from the source tree's proto/) and the SIGKILL
# stress of checkpoint storage (80 s of repeated kills, nothing install-specific).
# shellcheck disable=SC2086
"$V/python" -m pytest -q -p no:cacheprovider --durations=5 $TESTS \
    --deselect tests/test_proto.py::test_generated_code_is_fresh \
    --deselect tests/test_ckpt_storage.py::test_sigkill_leaves_only_verifiable_checkpoints
step "done"
