#!/usr/bin/env bash
# The GPU checks of issue 12, as one script for a GPU machine that has python3
# with a CUDA build of torch and nothing else (no registry): run
# launch/gpu-wheels.sh where a registry is reachable first and bring
# .gpu-wheels/ along. Results go to $OUT (default ./gpu-out):
#
#   launch/gpu-check.sh tests   the GPU suite (pytest -m gpu tests/test_gpu.py, in five groups at once):
#                               gpu-tests.log, gpu-tests-N.log and gpu-tests-N.xml per group, and
#                               gpu-suite.json (commit, versions, GPU; each test's outcome: commit it
#                               as bench/results/gpu-suite.json)
#   launch/gpu-check.sh bench   crucible bench gpu --json: gpu.json (commit it as bench/results/gpu.json)
#   launch/gpu-check.sh demo    crucible launch --device cuda, 2 x 3 with outer sync, an inner worker
#                               SIGKILLed by --chaos: demo.log, demo-summary.json, demo-events.jsonl
#   launch/gpu-check.sh all     the three, in that order
#   launch/gpu-check.sh checks  tests and demo at the same time (then run bench alone)
#
# The exit status is nonzero when a phase failed (each says "<phase>: exit N").
# A phase past its bound gets SIGINT (pytest then runs its teardown: the
# tests' jobs are killed) or SIGTERM (the bench writes what it measured, the
# launcher stops its job), and SIGKILL 20 s later.
#
# GPU_CHECK_DEVICE=cpu runs the same phases on the CPU with the quick bench
# (the smoke run before spending GPU time). Every phase is bounded
# (TESTS_TIMEOUT, BENCH_TIMEOUT, DEMO_TIMEOUT seconds). Measured on one H200
# (2026-12-04): the machine started in about 30 s; `checks` took 90-120 s;
# the bench's 12 launches took about 7 minutes (16 now, with S4_bf16_none_mps and
# S4_bf16_int8raw_mps where nvidia-cuda-mps-control is on PATH: about 8.5; fp32 runs
# last and is what a bench stopped at its bound loses). With a
# session's 15 minutes of device time and 10 a command: `bench` as one call
# (BENCH_TIMEOUT=540, the call's timeout 570), then `checks` as the next.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
DEV=${GPU_CHECK_DEVICE:-cuda}
PY=${PY:-python3}
if [ -d .gpu-wheels ] && [ "$DEV" = cuda ]; then
    SITE=${SITE:-/tmp/crucible-site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .gpu-wheels/*.whl >"$OUT/pip.log" 2>&1 || { echo "gpu-check: installing .gpu-wheels failed (see $OUT/pip.log)"; exit 2; }
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif [ -x .venv/bin/python ] && [ "$DEV" = cpu ]; then
    PY=.venv/bin/python
fi
export PYTHONUNBUFFERED=1
"$PY" - >"$OUT/env.json" <<'PYEOF'
import json, platform, shutil, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "mps_control": shutil.which("nvidia-cuda-mps-control")}   # job.mps=on's daemon (bench, suite)
print(json.dumps(info))
PYEOF
cat "$OUT/env.json"
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

phase_tests() {
    # the suite in five groups at once (each its own pytest, log and junit file):
    # the slow tests are jobs of a few processes each, and a GPU machine has
    # the cores and memory for several; TESTS_PARALLEL=0 runs it as one pytest
    echo "== tests ($DEV)"
    # no plugins from the machine's own site-packages: a GPU image's
    # pytest-timeout for a newer pytest than the one carried fails at start-up
    local env=(PYTEST_DISABLE_PLUGIN_AUTOLOAD=1)
    [ "$DEV" = cpu ] && env+=(CRUCIBLE_GPU_TESTS_DEVICE=cpu)
    local groups=("codecs or side_streams or equals_one_process or every_copy or mps or momentum_restored or token_copies or adamw_state"
                  "sigkill_then_resume and sparseloco" "sigkill_then_resume and diloco"
                  "killed_inner_worker and sparseloco" "killed_inner_worker and diloco")
    [ "${TESTS_PARALLEL:-1}" = 0 ] && groups=("gpu")
    rm -f "$OUT"/gpu-tests-*.log "$OUT"/gpu-tests-*.xml     # (an earlier run's groups)
    local i=0 pids=()
    for g in "${groups[@]}"; do
        env "${env[@]}" timeout -s INT -k 20 "${TESTS_TIMEOUT:-480}" "$PY" -m pytest -v -m gpu tests/test_gpu.py -k "$g" \
            -p no:cacheprovider --junitxml="$OUT/gpu-tests-$i.xml" >"$OUT/gpu-tests-$i.log" 2>&1 &
        pids+=($!)
        i=$((i + 1))
    done
    local rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    cat "$OUT"/gpu-tests-*.log >"$OUT/gpu-tests.log"
    # the result file (commit it as bench/results/gpu-suite.json): each test's outcome from the junit files
    "$PY" - "$OUT" "$DEV" "${TESTS_TIMEOUT:-480}" "${groups[@]}" >"$OUT/gpu-suite.json" <<'PYEOF'
import glob, json, os, sys, xml.etree.ElementTree as ET
from crucible.bench import common
out, dev, timeout, groups = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
tests = []
for path in sorted(glob.glob(os.path.join(out, "gpu-tests-*.xml"))):
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        row = {"test": case.get("name"), "outcome": {"failure": "failed", "error": "error", "skipped": "skipped",
                                                     None: "passed"}[None if bad is None else bad.tag],
               "seconds": round(float(case.get("time") or 0), 1)}
        if bad is not None and bad.tag != "skipped":
            row["failure"] = (bad.get("message") or "")[:2000]
        tests.append(row)
count = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
print(json.dumps({"bench": "gpu-suite", "command": f"launch/gpu-check.sh tests (device {dev})",
                  "environment": common.environment(),
                  "config": {"command": "pytest -v -m gpu tests/test_gpu.py -k GROUP -p no:cacheprovider, groups at once",
                             "groups": groups, "timeout_s": timeout,
                             "env": {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}},
                  "summary": count, "tests": tests}, indent=1))
PYEOF
    grep -hE "(PASSED|FAILED|ERROR|SKIPPED)( |$)" "$OUT"/gpu-tests-*.log | grep "::" || true
    grep -hE "^=+ .*(passed|failed|error).* in " "$OUT"/gpu-tests-*.log
    echo "tests: exit $rc"
    return "$rc"
}

phase_bench() {
    echo "== bench ($DEV)"
    local quick=()
    [ "$DEV" = cpu ] && quick=(--quick)
    timeout -k 20 "${BENCH_TIMEOUT:-540}" "$PY" -m crucible bench gpu --device "$DEV" "${quick[@]}" --json --out "$OUT/gpu.json" \
        >"$OUT/bench.log" 2>&1
    local rc=$?
    tail -5 "$OUT/bench.log"
    echo "bench: exit $rc"
    return "$rc"
}

phase_demo() {
    echo "== demo ($DEV)"
    local run="$OUT/demo-run"
    rm -rf "$run"
    # 2 replicas x 3 stages on the device, SparseLoCo every 5 steps; --chaos SIGKILLs r0s1 once
    # at its replica's step 40; the launcher respawns it and it pulls stage 1 from replica 1.
    local model=(model.preset=gpt-50m train.seq_len=256 train.batch_size=16)
    # (the CPU smoke: the small preset, or 200 steps take far longer than the bound)
    [ "$DEV" = cpu ] && model=(model.preset=small train.seq_len=64 train.batch_size=8)
    local overrides=("${model[@]}" train.microbatches=4 train.precision=bf16 outer.H=5 fault.heartbeat_timeout_s=10
                     fault.rpc_timeout_s=20 train.eval_every=0 debug.dump_final=true)
    timeout -k 20 "${DEMO_TIMEOUT:-300}" "$PY" -m crucible launch --device "$DEV" --replicas 2 --stages 3 --steps 200 \
        --run-dir "$run" --chaos "r0s1@step=40" "${overrides[@]}" >"$OUT/demo.log" 2>&1
    local rc=$?
    tail -8 "$OUT/demo.log"
    cp "$run/metrics.jsonl" "$OUT/demo-events.jsonl" 2>/dev/null
    "$PY" - "$run" "$rc" "$DEV" "${overrides[@]}" >"$OUT/demo-summary.json" <<'PYEOF'
import glob, json, os, sys, torch
from crucible.bench import common
run, rc, dev, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
env = common.environment()      # the commit, versions, GPU and driver, load
env["command"] = (f"launch/gpu-check.sh demo: crucible launch --device {dev} --replicas 2 --stages 3 --steps 200 "
                  f"--chaos r0s1@step=40 " + " ".join(overrides))
ev = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
finals = {os.path.basename(p)[6:-3]: torch.load(p, map_location="cpu", weights_only=False)
          for p in glob.glob(os.path.join(run, "debug", "final_r*s*.pt"))}
same = {s: bool(torch.equal(finals[f"r0s{s}"]["outer"]["theta_global"], finals[f"r1s{s}"]["outer"]["theta_global"]))
        for s in range(3) if f"r0s{s}" in finals and f"r1s{s}" in finals}
print(json.dumps({"bench": "gpu-demo", "environment": env, "config": {"overrides": overrides}, "exit": rc,
                  "faults": [e for e in ev if e["event"] == "fault"],
                  "route_changes": [e for e in ev if e["event"] == "route_change"][:6],
                  "replacements": [e for e in ev if e["event"] == "replacement_ready"],
                  "devices": [e for e in ev if e["event"] == "device"][:6],
                  "outer_rounds": sum(1 for e in ev if e["event"] == "outer_round"),
                  "last_steps": [e for e in ev if e["event"] == "step"][-2:],
                  "theta_global_equal_per_stage": same}, default=str, indent=1))
PYEOF
    echo "demo: exit $rc; theta_global equal per stage: $("$PY" -c 'import json, sys
print(json.load(open(sys.argv[1])).get("theta_global_equal_per_stage"))' "$OUT/demo-summary.json" 2>&1)"
    return "$rc"
}

case "${1:-all}" in
    tests) phase_tests ;;
    bench) phase_bench ;;
    demo) phase_demo ;;
    all) rc=0; phase_tests || rc=1; phase_bench || rc=1; phase_demo || rc=1; exit "$rc" ;;
    checks)     # the suite and the demo at once (not the bench: it times)
        phase_tests & t=$!
        phase_demo & d=$!
        rc=0; wait "$t" || rc=1; wait "$d" || rc=1; exit "$rc" ;;
    *) echo "usage: launch/gpu-check.sh tests|bench|demo|all|checks" >&2; exit 2 ;;
esac
