"""`crucible launch`: a coordinator and R x S workers on this machine, supervised.

The launcher plays the cluster scheduler: it starts every process with
``subprocess`` (never a fork of a process that imported grpc), restarts a
worker that dies (after ``--respawn-delay``; it comes back as a replacement)
and a coordinator that dies, shows live progress per replica, and on Ctrl-C
or SIGTERM stops everything it started: SIGTERM, then SIGKILL after a grace
period. Workers also ask the kernel to kill them if the launcher dies
(PR_SET_PDEATHSIG), so no orphan outlives a SIGKILLed launcher.

It never imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from crucible import extras, rpc
from crucible.config import Config

RESTART_EXIT = 75   # a worker's exit code under on_stage_failure = restart


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("run-%Y%m%d-%H%M%S"))


class Proc:
    def __init__(self, name: str, argv: list[str], log_path: str, env: dict):
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.popen: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.died_at: float | None = None
        self.restarts = 0

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self.env, close_fds=True)
        log.close()
        self.exit_code, self.died_at = None, None

    def poll(self) -> int | None:
        if self.popen is None:
            return self.exit_code
        code = self.popen.poll()
        if code is not None and self.exit_code is None:
            self.exit_code, self.died_at = code, time.monotonic()
        return code

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None


class Launcher:
    def __init__(self, args, overrides: list[str]):
        self.args = args
        self.run_dir = os.path.abspath(args.run_dir or default_run_dir())
        self.overrides = list(overrides)
        for key, val in (("job.replicas", args.replicas), ("job.stages", args.stages), ("train.steps", args.steps)):
            if val is not None:
                self.overrides.append(f"{key}={val}")
        self.cfg = Config.load(args.config, self.overrides)   # fail early, naming the bad key
        extras.check_config(self.cfg)                          # ... or the missing optional package
        self.stopping = False
        self.coord: Proc | None = None
        self.workers: dict[str, Proc] = {}

    # ---- processes ------------------------------------------------------

    def _env(self) -> dict:
        env = dict(os.environ)
        env[rpc.TOKEN_ENV] = self.token
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
        env["CRUCIBLE_PDEATHSIG"] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _coordinator_argv(self, resume: bool) -> list[str]:
        # A restarted coordinator binds the port of the one it replaces: workers
        # only know that address.
        bind = self.addr if getattr(self, "addr", None) else "127.0.0.1:0"
        argv = [sys.executable, "-m", "crucible", "coordinator", "--run-dir", self.run_dir, "--bind", bind]
        if self.args.config:
            argv += ["--config", self.args.config]
        if resume:
            argv.append("--resume")
        return argv + self.overrides

    def _start_coordinator(self, resume: bool) -> str:
        addr_file = os.path.join(self.run_dir, "coordinator.addr")
        if os.path.exists(addr_file):
            os.unlink(addr_file)
        if self.coord is None:
            self.coord = Proc("coordinator", self._coordinator_argv(resume),
                              os.path.join(self.run_dir, "logs", "coordinator.log"), self._env())
        else:
            self.coord.argv = self._coordinator_argv(resume)
            self.coord.restarts += 1
        t_end = time.monotonic() + 30
        self.coord.start()
        while time.monotonic() < t_end:
            if os.path.exists(addr_file):
                with open(addr_file) as f:
                    addr = f.read().strip()
                if addr:
                    self._write_pids()
                    return addr
            if self.coord.poll() is not None:
                if self.coord.restarts and time.monotonic() < t_end - 20:
                    time.sleep(0.5)    # its port may still be held for a moment: try again
                    self.coord.start()
                    continue
                raise SystemExit(f"coordinator exited with {self.coord.exit_code}; see {self.coord.log_path}")
            time.sleep(0.05)
        raise SystemExit(f"coordinator did not come up in 30s; see {self.coord.log_path}")

    def _start_worker(self, r: int, s: int) -> None:
        name = f"r{r}s{s}"
        if name not in self.workers:
            argv = [sys.executable, "-m", "crucible", "worker", "--coordinator", self.addr,
                    "--replica", str(r), "--stage", str(s)]
            self.workers[name] = Proc(name, argv, os.path.join(self.run_dir, "logs", f"{name}.log"), self._env())
        w = self.workers[name]
        w.argv[w.argv.index("--coordinator") + 1] = self.addr
        w.start()
        self._write_pids()

    def _write_pids(self) -> None:
        pids = {n: p.pid for n, p in self.workers.items()}
        if self.coord is not None:
            pids["coordinator"] = self.coord.pid
        pids["launcher"] = os.getpid()
        tmp = os.path.join(self.run_dir, "pids.json.tmp")
        with open(tmp, "w") as f:
            json.dump(pids, f)
        os.replace(tmp, os.path.join(self.run_dir, "pids.json"))

    def _stop_all(self, grace: float = 5.0) -> None:
        procs = [p for p in list(self.workers.values()) + [self.coord] if p is not None and p.popen is not None]
        for p in procs:
            if p.poll() is None:
                try:
                    p.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        t_end = time.monotonic() + grace
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()

    # ---- main loop --------------------------------------------------------

    def run(self) -> int:
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        self.token = rpc.read_token(self.run_dir) if self.args.resume else ""
        if not self.token:
            self.token = os.environ.get(rpc.TOKEN_ENV) or rpc.new_token()
        rpc.write_token(self.run_dir, self.token)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        R, S = self.cfg.job.replicas, self.cfg.job.stages
        print(f"crucible: run directory {self.run_dir}", flush=True)
        try:
            self.addr = self._start_coordinator(self.args.resume)
            for r in range(R):
                for s in range(S):
                    self._start_worker(r, s)
            return self._supervise()
        finally:
            if self.stopping:   # SIGTERM/SIGINT: a final checkpoint before everything stops
                from crucible.coordinator.checkpoints import preempt

                preempt(self.coord, list(self.workers.values()), self.cfg.checkpoint)
            self._stop_all()

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def _supervise(self) -> int:
        from crucible.chaos import Chaos
        from crucible.status import StatusClient, format_progress

        client = StatusClient(self.addr, self.token)
        chaos = Chaos.parse(self.args.chaos) if self.args.chaos else None
        t_start = time.monotonic()
        last_print, last_status, st = 0.0, 0.0, None
        tty = sys.stdout.isatty()
        delay = self.args.respawn_delay
        respawn = delay is not None and delay >= 0
        stopped: dict[str, float] = {}
        while not self.stopping:
            time.sleep(0.1)
            if any(w.poll() == RESTART_EXIT for w in self.workers.values()):
                self._restart_all()
                client = StatusClient(self.addr, self.token)
                continue
            for name, w in self.workers.items():
                code = w.poll()
                if code is None or code == 0:
                    continue
                if respawn and time.monotonic() - w.died_at >= delay:
                    print(f"crucible: {name} exited with {code}; starting a replacement", flush=True)
                    w.restarts += 1
                    self._start_worker(int(name[1:name.index("s")]), int(name[name.index("s") + 1:]))
            if self.coord.poll() is not None and not (self.coord.exit_code == 0 and (
                    self._all_done() or (st or {}).get("finished"))):   # finished: the workers are exiting
                print(f"crucible: coordinator exited with {self.coord.exit_code}; restarting it", flush=True)
                self.addr = self._start_coordinator(False)
                client = StatusClient(self.addr, self.token)
            if not respawn and not self._all_done() and all(w.poll() is not None for w in self.workers.values()):
                print("crucible: every worker has exited and --respawn-delay is negative "
                      "(no respawn): stopping", flush=True)
                break
            if self._all_done():
                try:
                    self.coord.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                break
            now = time.monotonic()
            if now - last_status >= 0.5:
                last_status = now
                st = client.get(timeout=1.0) or st
            for name, t in list(stopped.items()):
                if now >= t:
                    self._signal(name, signal.SIGCONT, "CONT")
                    del stopped[name]
            if chaos is not None:
                steps = {r["id"]: r["step"] for r in st["replicas"]} if st else {}
                live = [n for n, w in self.workers.items() if w.poll() is None and n not in stopped]
                for victim, sig in chaos.due(now - t_start, steps, live, self.cfg.job.stages):
                    if sig == "STOP":
                        self._signal(victim, signal.SIGSTOP, "STOP")
                        stopped[victim] = now + 5.0
                    else:
                        self._signal(victim, signal.SIGKILL, "KILL")
            if st is not None and now - last_print >= (1.0 if tty else 5.0):
                last_print = now
                line = format_progress(st)
                print(("\r\033[K" + line) if tty else line, end="" if tty else "\n", flush=True)
        if tty:
            print()
        print(self._summary(), flush=True)
        if self.stopping:
            return 130
        return 0 if self._all_done() else 1

    def _all_done(self) -> bool:
        return all(w.poll() == 0 for w in self.workers.values())

    def _signal(self, name: str, sig: int, what: str) -> None:
        proc = self.coord if name == "coordinator" else self.workers.get(name)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            return
        print(f"crucible: chaos: SIG{what} {name} (pid {proc.pid})", flush=True)
        self._log_event({"event": "chaos", "signal": what, "target": name, "pid": proc.pid,
                         "mono": time.monotonic()})

    def _log_event(self, ev: dict) -> None:
        ev.setdefault("time", time.time())
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(ev) + "\n")

    def _restart_all(self) -> None:
        """on_stage_failure = restart: the classic way. Every process goes; all come
        back and resume from the latest committed checkpoint."""
        print("crucible: a worker asked for a full restart (on_stage_failure = restart)", flush=True)
        t0 = time.monotonic()
        self._stop_all(grace=2.0)
        self._log_event({"event": "job_restart", "reason": "on_stage_failure=restart"})
        self.addr = None
        self.addr = self._start_coordinator(True)
        for name in list(self.workers):
            r, s = int(name[1:name.index("s")]), int(name[name.index("s") + 1:])
            self._start_worker(r, s)
        self._log_event({"event": "job_restarted", "seconds": time.monotonic() - t0})

    def _summary(self) -> str:
        """Final loss per replica, its time ledger, and the faults seen."""
        steps, losses, ledger, faults = {}, {}, {}, 0
        path = os.path.join(self.run_dir, "metrics.jsonl")
        try:
            with open(path) as f:
                for line in f:
                    try:
                        ev = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    kind = ev.get("event")
                    if kind == "step":
                        steps[ev["replica"]] = ev["step"] + 1
                        losses[ev["replica"]] = ev["loss"]
                    elif kind == "eval":
                        losses[f"eval{ev['replica']}"] = ev["loss"]
                    elif kind == "goodput":
                        ledger[ev["replica"]] = ev
                    elif kind == "fault":
                        faults += 1
        except OSError:
            pass
        lines = []
        for r in sorted(steps):
            line = f"r{r}: {steps[r]} steps, loss {losses[r]:.3f}"
            if f"eval{r}" in losses:
                line += f", held-out {losses[f'eval{r}']:.3f}"
            g = ledger.get(r)
            if g and g.get("wall_s"):
                parts = ", ".join(f"{k} {g[k + '_s']:.1f}s" for k in
                                  ("compute", "communication", "checkpoint_stall", "lost", "paused", "recovering")
                                  if g.get(k + "_s"))
                line += f"; goodput {100 * (g.get('goodput') or 0):.0f}% of {g['wall_s']:.0f}s ({parts})"
            lines.append(line)
        out = "crucible: finished.\n" + "\n".join(f"  {x}" for x in lines)
        if faults:
            out += f"\n  {faults} worker faults handled"
        return out + f"\ncrucible: metrics in {path}"
