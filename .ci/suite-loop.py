#!/usr/bin/env python3
"""Run the whole test suite N times back to back next to a CPU stressor; exit 1
on any failure. Flakiness check (not part of CI: it takes N suite lengths).

    .venv/bin/python .ci/suite-loop.py --times 3 --stress 2 [-- extra pytest args]

--stress is the number of spinning processes (one per core: 2x the job's own
load on this 2-core machine). Prints one JSON line per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from crucible.testing.stress import cpu_hogs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--times", type=int, default=3)
    ap.add_argument("--stress", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--log-dir", help="where each run's whole output goes (default: a new temporary directory)")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="suite-loop-")
    os.makedirs(log_dir, exist_ok=True)
    runs = []
    with cpu_hogs(args.stress, max_seconds=args.times * 3600):
        for i in range(args.times):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *args.pytest_args],
                                  cwd=ROOT, capture_output=True, text=True)
            log = os.path.join(log_dir, f"run{i + 1}.log")
            with open(log, "w") as f:
                f.write(proc.stdout + proc.stderr)
            tail = [line for line in proc.stdout.splitlines() if line.strip()][-15:]
            failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
            run = {"run": i + 1, "exit": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
                   "summary": tail[-1] if tail else "", "failed": failed, "log": log}
            runs.append(run)
            print(json.dumps(run), flush=True)
    bad = [r for r in runs if r["exit"] != 0]
    print(json.dumps({"runs": len(runs), "failed_runs": len(bad), "stress_processes": args.stress,
                      "loadavg": os.getloadavg()}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
