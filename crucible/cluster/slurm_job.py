"""What runs inside a Slurm job of `crucible slurm`: ``python -m crucible.cluster.slurm_job RUN_DIR SLOT``.

It reads the run's ``slurm/state.json``, records ``slurm_job_start`` in
``metrics.jsonl``, and ``exec``\\s (same process, so Slurm's signals reach
it) one of:

* ``coordinator``: ``crucible coordinator --bind HOST:PORT`` where HOST is
  this node's name (``$CRUCIBLE_SLURM_HOST`` to override) and PORT the port
  of the run's previous coordinator (from ``coordinator.addr``), else the
  run's ``--port`` (0 = any free one). Before binding an old port it waits up
  to 30 s for the port and ``coordinator.lock`` to be free. ``--fresh`` for
  the first coordinator of a run, ``--resume`` when the supervisor submitted
  it so (the whole job was lost) or for ``up --resume``, else neither (a
  restart: it restores its predecessor's saved state). A job Slurm
  requeued (``scontrol requeue``, a node failure, preemption by requeue:
  the same job id, run again) that had started a coordinator before is a
  restart whatever it was submitted as: its own earlier coordinator's state
  is what to continue from. ``--on-sigterm
  leave``: Slurm's SIGTERM (scancel, preemption, time limit) ends this
  coordinator only, the workers go on with the next one;
  ``crucible slurm down`` sends SIGINT (final checkpoint, every worker stops).
* ``r{R}s{S}``: ``crucible worker --coordinator ADDR --replica R --stage S
  --bind HOST:0`` with ADDR read from ``coordinator.addr`` (waiting for it
  for up to 10 minutes while the coordinator's job is pending).

The token comes from the environment (the job script exports it from the run
directory's 0600 file). No torch here: the worker imports it after the exec.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from crucible.cluster.slurm import COORD, SlurmRun, append_event, parse_slot
from crucible.files import lock_held
from crucible.metrics import each


def _say(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} crucible slurm job: {msg}", flush=True)


def node_host() -> str:
    return os.environ.get("CRUCIBLE_SLURM_HOST") or socket.gethostname()


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _read_addr(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, "coordinator.addr")) as f:
            return f.read().strip()
    except OSError:
        return ""


def coordinator_start(run: SlurmRun, job_id: str, restarts: int) -> str:
    """How this coordinator starts: as the supervisor submitted it (``fresh``,
    ``resume`` or ``restart``), except in a job Slurm requeued after it had
    started a coordinator: that is a restart. (Run again as submitted, the
    requeued first coordinator of `up` or of `up --resume` started ``--fresh``
    or ``--resume`` under live workers: it forgot every outer round closed
    since the start, which a worker whose reply was lost asks again, and
    dropped the save in flight.)"""
    start = run.slots[COORD].start
    if start == "restart" or restarts <= 0 or not job_id.isdigit():
        return start
    ran = False   # this job has started before: a coordinator_start after that is its earlier run's
    for e in each(run.run_dir, ("slurm_job_start", "coordinator_start"), offset=run.metrics_start):
        if e["event"] == "slurm_job_start" and e.get("slot") == COORD and e.get("job_id") == int(job_id):
            ran = True
        elif e["event"] == "coordinator_start" and ran:
            return "restart"
    return start


def coordinator_argv(run: SlurmRun, host: str, start: str | None = None) -> list[str]:
    port = run.port
    prev = _read_addr(run.run_dir)
    if prev:
        port = int(prev.rpartition(":")[2])
    if port:
        t_end = time.monotonic() + 30
        lock = os.path.join(run.run_dir, "coordinator.lock")
        while not (_port_free(host, port) and not lock_held(lock)) and time.monotonic() < t_end:
            time.sleep(0.2)
    argv = [run.python, "-m", "crucible", "coordinator", "--run-dir", run.run_dir, "--bind", f"{host}:{port}",
            "--on-sigterm", "leave"]
    if run.config:
        argv += ["--config", run.config]
    start = run.slots[COORD].start if start is None else start
    if start in ("fresh", "resume"):
        argv.append(f"--{start}")
    return argv + list(run.overrides)


def worker_argv(run: SlurmRun, slot: str, host: str) -> list[str]:
    r, s = parse_slot(slot)
    t_end = time.monotonic() + 600
    addr = _read_addr(run.run_dir)
    while not addr and time.monotonic() < t_end:
        time.sleep(0.5)
        addr = _read_addr(run.run_dir)
    if not addr:
        raise SystemExit(f"crucible slurm job: no {run.run_dir}/coordinator.addr after 600s")
    return [run.python, "-m", "crucible", "worker", "--coordinator", addr, "--replica", str(r), "--stage", str(s),
            "--bind", f"{host}:0", "--device", run.device]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m crucible.cluster.slurm_job RUN_DIR SLOT", file=sys.stderr)
        return 2
    run_dir, slot = os.path.abspath(argv[0]), argv[1]
    run = SlurmRun.load(run_dir)
    if slot not in run.slots:
        raise SystemExit(f"crucible slurm job: no slot {slot!r} in {run.state_path}")
    if not os.environ.get("CRUCIBLE_TOKEN"):
        raise SystemExit("crucible slurm job: CRUCIBLE_TOKEN is not set (the job script exports it from "
                         f"{run_dir}/token)")
    host = node_host()
    job_id = os.environ.get("SLURM_JOB_ID", "")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    append_event(run_dir, {"event": "slurm_job_start", "slot": slot, "job_id": int(job_id) if job_id.isdigit() else None,
                           "node": os.environ.get("SLURMD_NODENAME", host), "restart_count": restarts})
    if slot == COORD:
        start = coordinator_start(run, job_id, restarts)
        if start != run.slots[COORD].start:
            _say(f"job {job_id} was requeued after it had started a coordinator: a restart, not "
                 f"--{run.slots[COORD].start}")
        cmd = coordinator_argv(run, host, start)
    else:
        cmd = worker_argv(run, slot, host)
    _say(f"job {job_id} slot {slot} on {host}: {json.dumps(cmd)}")
    os.execv(cmd[0], cmd)
    return 1   # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
