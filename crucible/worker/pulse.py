"""The pulse: a worker's liveness, sent from a small process of its own.

Why. A worker's heartbeat thread shares the interpreter lock with its
training loop. On an oversubscribed host (more runnable threads than cores)
the thread that holds the lock waits for a core before it can hand the lock
over, and a heartbeat waits behind it: a healthy worker goes silent for
seconds and is declared dead. The pulse is a separate process without torch
that sleeps between beats; the kernel's scheduler runs a sleeper promptly
when it wakes, and no other thread can hold its interpreter lock. So no
training work, import, snapshot or garbage collection of the worker can delay
a beat.

What it says. Every ``fault.heartbeat_interval_s`` it sends a ``Heartbeat``
with state ``pulse`` for the worker's id: the coordinator takes it as
liveness only (the worker's own heartbeat thread still carries its step,
state and commands). It beats only while its worker is running: it reads the
worker's state from ``/proc`` before each beat and stays silent while the
worker is stopped (SIGSTOP: the coordinator then declares it dead within
``fault.heartbeat_timeout_s``, as it should), and exits when the worker is gone
(it also asks the kernel to kill it with its parent: ``PR_SET_PDEATHSIG``).
Where ``/proc`` does not exist the worker starts no pulse.

Like every beat, it carries the registration's secret (the coordinator
refuses a beat without it: the token alone must not keep a dead worker
alive). The secret reaches it in its environment, not on its command line
(which anyone on the host can read).

    python -m crucible.worker.pulse --coordinator HOST:PORT --worker-id ID --parent PID
        --interval S --timeout S          (the token comes from $CRUCIBLE_TOKEN,
                                           the secret from $CRUCIBLE_PULSE_SECRET, hex)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from crucible import procs

SECRET_ENV = "CRUCIBLE_PULSE_SECRET"


def start(coordinator: str, worker_id: str, secret: bytes, interval: float,
          timeout: float) -> subprocess.Popen | None:
    """Start the pulse of this process (the worker, registered as ``worker_id``
    with ``secret``); None where there is no /proc."""
    if not procs.has_proc():
        return None
    argv = [sys.executable, "-m", "crucible.worker.pulse", "--coordinator", coordinator, "--worker-id", worker_id,
            "--parent", str(os.getpid()), "--interval", str(interval), "--timeout", str(timeout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{SECRET_ENV: secret.hex()})
    env.pop("CRUCIBLE_ERROR_FILE", None)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, close_fds=True)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="crucible.worker.pulse")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--interval", type=float, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    args = ap.parse_args(argv)
    procs.die_with_parent(args.parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    import grpc

    from crucible import rpc
    from crucible._pb import crucible_pb2 as pb
    from crucible._pb import crucible_pb2_grpc as pbg

    md = rpc.metadata(rpc.read_token())
    stub = pbg.CoordinatorStub(rpc.make_channel(args.coordinator))
    beat = pb.HeartbeatRequest(worker_id=args.worker_id, state="pulse",
                               secret=bytes.fromhex(os.environ.pop(SECRET_ENV, "")))
    while True:
        t0 = time.monotonic()
        state = procs.state(args.parent)
        if state is None or state == "Z" or os.getppid() != args.parent:
            return 0                      # the worker is gone
        if state not in ("T", "t"):       # stopped (SIGSTOP, a debugger): silence
            try:
                stub.Heartbeat(beat, metadata=md, timeout=args.timeout)
            except grpc.RpcError:
                pass                      # the worker's own heartbeat thread deals with refusals
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))


if __name__ == "__main__":
    sys.exit(main())
