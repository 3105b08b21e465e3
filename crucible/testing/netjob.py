"""A Crucible job with a host per process, on a ``netns.Topology`` (tests, benchmarks).

Hosts: ``coord`` (the coordinator, on a fixed port so that a restarted one
keeps its address), ``r{R}s{S}`` (one worker each, ``--bind <its ip>:0``) and
``admin`` (where ``crucible status --watch --json`` runs: the harness reads
the job's status from its output, since the harness itself is in no
namespace). Every process gets the token through ``CRUCIBLE_TOKEN`` (never on a
command line) and, with ``tls_dir``, the TLS files through
``CRUCIBLE_TLS_DIR`` and ``CRUCIBLE_TLS_HOST`` (its own address: the
certificates of ``crucible certs --hosts <the addresses>``).

A small supervisor plays the cluster scheduler, as ``crucible launch`` does:
a worker that exits with a non-zero status is started again after
``respawn_delay`` seconds (it comes back as a replacement); every exit is
recorded in ``exits`` (slot, status, time). ``close()`` kills everything with
the topology.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from crucible.slots import slot_name
from crucible.testing.netns import Topology

COORD_PORT = 7000


class NetJob:
    def __init__(self, topo: Topology, run_dir: str, replicas: int, stages: int, steps: int,
                 overrides: list[str] = (), tls_dir: str | None = None, respawn_delay: float = 1.0,
                 token: str = "netjob-token-0123456789abcdef"):
        self.topo, self.run_dir = topo, os.path.abspath(run_dir)
        self.R, self.S, self.steps = replicas, stages, steps
        self.overrides = list(overrides)
        self.tls_dir = tls_dir
        self.respawn_delay = respawn_delay
        self.token = token
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        self.coord = topo.add_host("coord")
        self.admin = topo.add_host("admin")
        self.slots = [(r, s) for r in range(replicas) for s in range(stages)]
        for r, s in self.slots:
            topo.add_host(slot_name(r, s))
        self.address = f"{self.coord.ip}:{COORD_PORT}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.exits: list[tuple[str, int, float]] = []      # (slot, exit status, time)
        self.respawn = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._status_path = os.path.join(self.run_dir, "status.jsonl")
        self._supervisor: threading.Thread | None = None

    # ---- processes -------------------------------------------------------------

    def env(self, host: str) -> dict:
        env = dict(os.environ, CRUCIBLE_TOKEN=self.token, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for key in [k for k in env if k.startswith("CRUCIBLE_TLS_")]:
            del env[key]
        if self.tls_dir:
            env["CRUCIBLE_TLS_DIR"] = self.tls_dir
            env["CRUCIBLE_TLS_HOST"] = self.topo.host(host).ip
        return env

    def _spawn(self, host: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.run_dir, "logs", f"{host}.log"), "ab")
        try:
            return self.topo.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(host))
        finally:
            log.close()

    def start_coordinator(self, fresh: bool = True) -> None:
        argv = [sys.executable, "-m", "crucible", "coordinator", "--run-dir", self.run_dir,
                "--bind", self.address, "--replicas", str(self.R), "--stages", str(self.S),
                "--steps", str(self.steps), *(["--fresh"] if fresh else []), *self.overrides]
        self.procs["coord"] = self._spawn("coord", argv)

    def start_worker(self, r: int, s: int) -> None:
        name = slot_name(r, s)
        ip = self.topo.host(name).ip
        argv = [sys.executable, "-m", "crucible", "worker", "--coordinator", self.address, "--replica", str(r),
                "--stage", str(s), "--bind", f"{ip}:0"]
        self.procs[name] = self._spawn(name, argv)

    def start(self) -> "NetJob":
        self.start_coordinator()
        for r, s in self.slots:
            self.start_worker(r, s)
        status_argv = [sys.executable, "-m", "crucible", "status", "--coordinator", self.address, "--json",
                       "--watch"]
        out = open(self._status_path, "ab")
        try:
            self.topo.popen("admin", status_argv, stdout=out, stderr=subprocess.DEVNULL, env=self.env("admin"))
        finally:
            out.close()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="netjob-supervisor")
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        due: dict[str, float] = {}
        while not self._stop.wait(0.1):
            with self._lock:
                for r, s in self.slots:
                    name = slot_name(r, s)
                    p = self.procs.get(name)
                    if p is not None and name not in due:
                        code = p.poll()
                        if code is not None:
                            self.exits.append((name, code, time.time()))
                            if code != 0 and self.respawn:
                                due[name] = time.monotonic() + self.respawn_delay
                    if name in due and time.monotonic() >= due[name]:
                        del due[name]
                        self.start_worker(r, s)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def exits_of(self, name: str) -> list[tuple[int, float]]:
        with self._lock:
            return [(code, t) for n, code, t in self.exits if n == name]

    # ---- observing ---------------------------------------------------------------

    def status(self) -> dict | None:
        """The newest status line (at most a couple of seconds old), or None."""
        try:
            with open(self._status_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - (256 << 10)))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
        return None

    def events(self, kind: str | None = None, since: float = 0.0) -> list[dict]:
        out = []
        try:
            with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
                for line in f:
                    try:
                        ev = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if (kind is None or ev.get("event") == kind) and ev.get("time", 0) >= since:
                        out.append(ev)
        except OSError:
            pass
        return out

    def wait_for(self, pred, timeout: float, what: str):
        """Poll `pred(status)` (status may be None) until it returns something true."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            coord = self.procs.get("coord")
            if coord is not None and coord.poll() is not None:
                raise AssertionError(f"the coordinator exited ({coord.returncode}) while waiting for {what}\n"
                                     f"{self.output()}")
            got = pred(self.status())
            if got:
                return got
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.output()}")

    def output(self, tail: int = 2500) -> str:
        out = ""
        logs = os.path.join(self.run_dir, "logs")
        for name in sorted(os.listdir(logs)):
            with open(os.path.join(logs, name), "rb") as f:
                data = f.read()
            out += f"\n--- {name}\n" + data.decode(errors="replace")[-tail:]
        return out

    def close(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        self.topo.close()
