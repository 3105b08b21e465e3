"""`crucible launch`: a coordinator and R x S workers on this machine, supervised.

The launcher plays the cluster scheduler: it starts every process with
``subprocess`` (never a fork of a process that imported grpc), restarts a
worker that dies (after ``--respawn-delay``; it comes back as a replacement)
and a coordinator that dies, shows live progress per replica, and on Ctrl-C
or SIGTERM stops everything it started: SIGTERM, then SIGKILL after a grace
period. Workers also ask the kernel to kill them if the launcher dies
(PR_SET_PDEATHSIG), so no orphan outlives a SIGKILLed launcher.

Before it starts or writes anything it runs the pre-flight checks
(``crucible check``, in a child process: the launcher never imports torch),
the memory of every worker it would start first (``crucible.sizing``); a
job too big for this host ends there, exit status 2. ``--no-check`` skips
them, and tells its workers not to compare their own stage's memory either
(``sizing.SKIP_ENV``). Only ``launch.lock`` comes first: the launcher holds it
for as long as it lives, and logs ``launch_start``, so that ``crucible
status`` says a launch is starting instead of how the previous job in the run
directory ended (a resume's pre-flight and coordinator start-up take seconds);
a second launch into the same run directory meanwhile is refused.

No crash loops. A process that dies of an exception leaves its one-line cause
in ``logs/<name>.error`` (``crucible.exits``); the launcher prints it with the
exit. A slot that fails with the same error twice within
``CRASH_LOOP_WINDOW_S`` stops the job (a final checkpoint first) with that
error and exit status 1. Restarts of a slot that keeps dying, for any reason,
back off: ``--respawn-delay`` doubles with each death that follows a short
life (under ``STABLE_S``), up to ``MAX_BACKOFF_S``.

Endings (``crucible.exits``): 0 when every replica finished, 1 when the job
failed (the cause is printed), 128 + N when stopped by signal N (130 Ctrl-C,
143 SIGTERM).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

from crucible import exits, extras, metrics, procs, rpc, sizing
from crucible.config import Config
from crucible.files import (atomic_write, checkpoints_holder, checkpoints_in_use, dir_problem, hold_checkpoints,
                            lock_held)
from crucible.slots import slot_name, slot_of

CRASH_LOOP_WINDOW_S = 120.0   # the same error twice within this: the job stops
STABLE_S = 10.0               # a process that lived this long resets its back-off
MAX_BACKOFF_S = 30.0
CHECK_TIMEOUT_S = 300.0
END_WAIT_S = 40.0             # the job is done: the coordinator's end (a save in flight commits first)
JOB_DONE_WAIT_S = 3.0         # every worker exited (no respawn): how long job_done may take to reach the file
END_GRACE_S = 10.0            # ... and then the workers' exits, before the rest is stopped
STARTING_STOP_S = 2.0         # the job is done: a replacement still starting gets this after its SIGTERM, then SIGKILL


OOM_KILLED = "out of memory (the kernel's OOM killer killed it; `dmesg` says more)"


def _stamp(path: str) -> tuple | None:
    """What changes when a file is written (a new one, or in place), or None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class LaunchFailed(Exception):
    """The job cannot go on; the message is the cause to show."""


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("run-%Y%m%d-%H%M%S"))


class Proc:
    def __init__(self, name: str, argv: list[str], log_path: str, env: dict):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.error_path = log_path[:-len(".log")] + ".error" if log_path.endswith(".log") else log_path + ".error"
        self.env = dict(env, **{exits.ERROR_FILE_ENV: self.error_path})
        self.popen: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.died_at: float | None = None
        self.started_at = 0.0
        self.comm: str | None = None        # the kernel's name for it (its OOM killer's log names it so)
        self.restarts = 0
        self.short_lives = 0               # deaths in a row after a short life: the back-off exponent
        self.last_error: tuple[float, str] | None = None   # (when, the one-line cause)
        self.restart_at: float | None = None   # a death was handled: start again at this time

    def start(self) -> None:
        try:
            os.unlink(self.error_path)
        except OSError:
            pass
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self.env, close_fds=True)
        log.close()
        self.exit_code, self.died_at, self.restart_at = None, None, None
        self.started_at = time.monotonic()
        self.comm = procs.comm(self.popen.pid)   # (Popen returns once it has exec'd: the program's name)

    def error(self) -> str | None:
        """The one-line cause of an exit by exception, if the process left one."""
        return exits.read_error(self.error_path)

    def on_death(self, base_delay: float) -> tuple[str | None, bool, float]:
        """Book a death: (its cause, whether it repeats the last one within the
        crash-loop window, the back-off delay before a restart)."""
        err = self.error() if self.exit_code and self.exit_code > 0 else None
        if self.exit_code == -signal.SIGKILL and procs.oom_killed(self.pid, self.started_at - 1.0, self.comm):
            err = OOM_KILLED          # (twice in a row is a crash loop too: it would go on for ever)
        repeated = False
        if err is not None:
            repeated = self.last_error is not None and self.last_error[1] == err \
                and self.died_at - self.last_error[0] <= CRASH_LOOP_WINDOW_S
            self.last_error = (self.died_at, err)
        lived = self.died_at - self.started_at
        self.short_lives = self.short_lives + 1 if lived < STABLE_S else 1
        delay = min(MAX_BACKOFF_S, max(base_delay, 0.0) * 2 ** (self.short_lives - 1))
        return err, repeated, delay

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
    scanned: int | None = None        # how far metrics.jsonl was read (_scan_ends; None: from offset)
    tally: "Tally | None" = None      # this launch's events read so far, for the summary (_scan_ends)

    def __init__(self, args, overrides: list[str]):
        self.args = args
        self.run_dir = os.path.abspath(args.run_dir or default_run_dir())
        problem = dir_problem(self.run_dir, make=True)
        if problem:
            raise exits.UsageError(f"--run-dir {args.run_dir or self.run_dir}: {problem}")
        if lock_held(os.path.join(self.run_dir, "coordinator.lock")):
            # (before anything is written: a second launch replaced the running job's token and
            # removed its coordinator.addr, so that `crucible status` lost it, before it was refused)
            raise exits.UsageError(f"--run-dir {args.run_dir or self.run_dir}: a job is running there (its "
                                   f"coordinator holds coordinator.lock); let it end, or choose another --run-dir")
        holder = checkpoints_holder(self.run_dir)
        if holder is not None:
            # (checkpoints/ a symlink to another run's: its resume, retention and clean-up deleted
            # the running job's checkpoints and saves in flight, and the job's retention its own)
            raise exits.UsageError(checkpoints_in_use(args.run_dir or self.run_dir, self.run_dir, holder))
        delay = getattr(args, "respawn_delay", procs.RESPAWN_DELAY_S)
        if delay is not None and not math.isfinite(delay):
            raise exits.UsageError(f"--respawn-delay {delay:g}: must be a finite number of seconds "
                                   f"(negative = never)")
        self.given = list(overrides)      # the user's key=value, as given (the resume hint repeats them)
        self.given_flags: list[str] = []  # ... and --replicas/--stages/--steps/--device, as flags
        self.overrides = list(overrides)
        for key, flag, val in (("job.replicas", "--replicas", args.replicas), ("job.stages", "--stages", args.stages),
                               ("train.steps", "--steps", args.steps),
                               ("job.device", "--device", getattr(args, "device", None))):
            if val is not None:
                self.overrides.append(f"{key}={val}")
                self.given_flags += [flag, str(val)]
        self.cfg = Config.load(args.config, self.overrides)   # fail early, naming the bad key
        from crucible.preflight import checkpoints_problem

        problem = checkpoints_problem(self.run_dir, self.cfg)
        if problem:
            raise exits.UsageError(f"--run-dir {args.run_dir or self.run_dir}: {problem}")
        extras.check_config(self.cfg)                          # ... or the missing optional package
        self.chaos = None
        if args.chaos:                                         # ... or the bad --chaos item, before anything starts
            from crucible.chaos import Chaos

            try:
                self.chaos = Chaos.parse(args.chaos, self.cfg.job.replicas, self.cfg.job.stages)
            except ValueError as e:
                raise exits.UsageError(f"--chaos: {e}") from None
        self.stopping = 0                 # the signal that asked us to stop
        self.output_in_log = False        # the terminal went away: stdout and stderr are logs/launcher.log
        self.failure = ""                 # why the job failed (the launcher stops it)
        self.finished = False             # every replica trained train.steps steps
        self.came_up = False              # a coordinator came up (else there is no summary or resume hint)
        self.last_status: dict | None = None
        self.offset = 0                   # metrics.jsonl's size when this launch started: its events follow
        self.job_done = False             # job_done seen in this launch's events
        self.stopped_by: signal.Signals | None = None   # job_stopped seen: the signal the coordinator got
        self.ckpt_events: list[dict] = [] # the saves' commits and aborts read since _watch_checkpoints ran
        self.ckpt_failing = ""            # why saves fail, said once until one commits again
        self.pids_unwritten = ""          # why pids.json could not be written (tried again while it is set)
        self.writes_failing = False       # files of the run directory that could not be written: said
        self.coord: Proc | None = None
        self.workers: dict[str, Proc] = {}
        self.mps = None                   # crucible.mps.Mps, with job.mps=on
        self.mps_warned = False           # (its daemon's death, said once)
        self.launch_lock = None           # launch.lock, held while this launcher lives (_hold_launch_lock)
        self.ckpt_lock = None             # checkpoints/.lock, likewise (_hold_checkpoints_lock)

    # ---- processes ------------------------------------------------------

    def _env(self) -> dict:
        env = dict(os.environ)
        env[rpc.TOKEN_ENV] = self.token
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
        env[procs.PARENT_ENV] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        if getattr(self.args, "no_check", False):
            env[sizing.SKIP_ENV] = "1"      # --no-check: the workers do not compare their stage's memory either
        if self.mps is not None:
            env.update(self.mps.env)
        return env

    def _bind_host(self) -> str:
        """net.bind as the host of a host:port (an IPv6 address in brackets)."""
        host = self.cfg.net.bind
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    def _coordinator_argv(self, start: str) -> list[str]:
        """start: "fresh" (a new job), "resume" (the whole job from its latest
        checkpoint) or "restart" (a crashed coordinator, continuing from its
        predecessor's saved state)."""
        # A restarted coordinator binds the port of the one it replaces: workers
        # only know that address.
        bind = self.addr if getattr(self, "addr", None) else f"{self._bind_host()}:0"
        argv = [sys.executable, "-m", "crucible", "coordinator", "--run-dir", self.run_dir, "--bind", bind]
        if self.args.config:
            argv += ["--config", self.args.config]
        if start != "restart":
            argv.append(f"--{start}")
        return argv + self.overrides

    def _start_coordinator(self, start: str) -> str:
        addr_file = os.path.join(self.run_dir, "coordinator.addr")
        before = None
        if start == "restart":
            # (kept: a restart binds the same address and writes it over the old file, in place on a
            # full disk, where removing it left none to write: up is the file changed)
            before = _stamp(addr_file)
        elif os.path.exists(addr_file):
            os.unlink(addr_file)
        if self.coord is None:
            self.coord = Proc("coordinator", self._coordinator_argv(start),
                              os.path.join(self.run_dir, "logs", "coordinator.log"), self._env())
        else:
            self.coord.argv = self._coordinator_argv(start)
            self.coord.restarts += 1
        t_end = time.monotonic() + 30
        self.coord.start()
        while time.monotonic() < t_end:
            if os.path.exists(addr_file) and (before is None or _stamp(addr_file) != before):
                with open(addr_file) as f:
                    addr = f.read().strip()
                if addr:
                    self._write_pids()
                    return addr
            if self.coord.poll() is not None:
                err = self.coord.error()
                if self.coord.restarts and err is None and time.monotonic() < t_end - 20:
                    time.sleep(0.5)    # its port may still be held for a moment: try again
                    self.coord.start()
                    continue
                raise LaunchFailed(f"the coordinator {exits.describe(self.coord.exit_code)}"
                                   f"{': ' + err if err else ''} (log: {self.coord.log_path})")
            time.sleep(0.05)
        raise LaunchFailed(f"the coordinator did not come up in 30s (log: {self.coord.log_path})")

    def _start_worker(self, r: int, s: int) -> None:
        name = slot_name(r, s)
        if name not in self.workers:
            argv = [sys.executable, "-m", "crucible", "worker", "--coordinator", self.addr,
                    "--replica", str(r), "--stage", str(s), "--bind", f"{self._bind_host()}:0"]
            self.workers[name] = Proc(name, argv, os.path.join(self.run_dir, "logs", f"{name}.log"), self._env())
        w = self.workers[name]
        w.argv[w.argv.index("--coordinator") + 1] = self.addr
        w.start()
        self._write_pids()

    def _write_pids(self) -> None:
        """pids.json ({name: pid}) and, first, pids.start.json ({name: [pid,
        start time in clock ticks]}): what lets `crucible kill` tell a recorded
        process from a later one that was given its pid (crucible.kill)."""
        pids = {n: p.pid for n, p in self.workers.items()}
        if self.coord is not None:
            pids["coordinator"] = self.coord.pid
        pids["launcher"] = os.getpid()
        starts = {n: [pid, procs.start_ticks(pid)] for n, pid in pids.items() if pid}
        try:
            atomic_write(os.path.join(self.run_dir, procs.PID_STARTS_FILE),
                         json.dumps({n: v for n, v in starts.items() if v[1] is not None}), fsync=False)
            atomic_write(os.path.join(self.run_dir, "pids.json"), json.dumps(pids), fsync=False)
            self.pids_unwritten = ""
        except OSError as e:
            # (a full disk: a respawn that raised here ended the launch, and with it every
            # worker; the old files name only processes `crucible kill` then refuses as gone)
            self.pids_unwritten = e.strerror or str(e)

    def _stop_all(self, grace: float = 5.0) -> None:
        # (the coordinator first: it learns the job is ending before a worker says it is leaving)
        children = [p for p in [self.coord] + list(self.workers.values()) if p is not None and p.popen is not None]
        for p in children:
            if p.poll() is None:
                try:
                    p.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        t_end = time.monotonic() + grace
        for p in children:
            try:
                p.popen.wait(timeout=max(0.0, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()

    # ---- main loop --------------------------------------------------------

    def preflight(self) -> int:
        """The pre-flight checks, before anything is started or written: the
        run directory (torch-free, here), then `crucible check` in a child."""
        from crucible.preflight import CheckFailed, check_run_dir

        try:
            check_run_dir(self.run_dir, self.args.resume, self.cfg)
        except CheckFailed as e:
            print(f"crucible: {e}", file=sys.stderr, flush=True)
            return exits.ERROR
        if self.args.no_check:
            return exits.OK
        # (--no-verify: the coordinator reads the checkpoint whole as it resumes; once is enough)
        argv = [sys.executable, "-m", "crucible", "check", "--quiet", "--no-verify", "--run-dir", self.run_dir]
        if self.args.config:
            argv += ["--config", self.args.config]
        if self.args.resume:
            argv.append("--resume")
        argv += self.overrides
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env, timeout=CHECK_TIMEOUT_S, text=True)
        except subprocess.TimeoutExpired:
            print(f"crucible: the pre-flight check did not finish in {CHECK_TIMEOUT_S:.0f}s "
                  f"(--no-check skips it)", file=sys.stderr, flush=True)
            return exits.ERROR
        if done.returncode != 0:
            lines = [x for x in done.stderr.splitlines() if x.strip()]
            print(lines[-1] if lines else f"crucible: the pre-flight check {exits.describe(done.returncode)}",
                  file=sys.stderr, flush=True)
            if done.returncode == exits.USAGE:      # a configuration error (the job too big for this host)
                return exits.USAGE
            return exits.ERROR if done.returncode > 0 else exits.interrupted(-done.returncode)
        return exits.OK

    def _hold_launch_lock(self) -> None:
        """Take launch.lock (kept until this process exits; children do not
        inherit it) and log launch_start: until this launch's coordinator logs
        coordinator_start, `crucible status` says that a launch is starting
        (crucible.status.no_answer). Another launcher holding it: refused, as a
        running job is."""
        import fcntl

        if self.launch_lock is not None:
            return
        where = self.args.run_dir or self.run_dir
        try:
            f = open(os.path.join(self.run_dir, "launch.lock"), "a+")
        except OSError as e:
            raise exits.UsageError(f"--run-dir {where}: {e.strerror or e} ({e.filename})") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise exits.UsageError(f"--run-dir {where}: another `crucible launch` runs there (it holds "
                                   f"launch.lock: its coordinator is starting or restarting); let it end, or "
                                   f"choose another --run-dir") from None
        self.launch_lock = f
        try:
            metrics.append_event(self.run_dir, {"event": "launch_start", "pid": os.getpid(),
                                                "resume": bool(self.args.resume)})
        except OSError as e:        # (metrics.jsonl a folder, not writable: the coordinator could not log either)
            raise exits.UsageError(f"--run-dir {where}: {e.filename or metrics.FILE}: {e.strerror or e}") from None

    def _hold_checkpoints_lock(self) -> None:
        """Take checkpoints/.lock (``files.hold_checkpoints``) for as long as
        this launcher lives: held here, not only by the coordinator, so that
        no other job takes it while ours is restarted; our coordinator finds
        it held by its launcher. (A job without checkpoints takes none: its
        coordinator takes it where it can.)"""
        if self.ckpt_lock is not None or not self.cfg.checkpoint.enable_checkpointing:
            return
        where = self.args.run_dir or self.run_dir
        try:
            self.ckpt_lock = hold_checkpoints(self.run_dir)
        except BlockingIOError:
            raise exits.UsageError(checkpoints_in_use(where, self.run_dir,
                                                      checkpoints_holder(self.run_dir) or ("", ""))) from None
        except OSError as e:
            raise exits.UsageError(f"--run-dir {where}: {e.strerror or e} ({e.filename})") from None

    def run(self) -> int:
        if os.path.isdir(self.run_dir):    # (a new one holds no earlier job for status to misread yet)
            self._hold_launch_lock()
        code = self.preflight()
        if code != exits.OK:
            return code
        try:
            os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        except OSError as e:       # (dir_problem tried; the OS may still say no: changed since)
            print(f"crucible: --run-dir {self.run_dir}: {e.strerror or e} ({e.filename})", file=sys.stderr)
            return exits.USAGE
        self._hold_launch_lock()
        self._hold_checkpoints_lock()      # (after the pre-flight: a refused launch leaves checkpoints/ as it was)
        self.token = rpc.read_token(self.run_dir) if self.args.resume else ""
        if not self.token:
            self.token = os.environ.get(rpc.TOKEN_ENV) or rpc.new_token()
        try:
            rpc.write_token(self.run_dir, self.token)
        except OSError as e:       # (dir_problem saw room; the disk may have filled since)
            print(f"crucible: --run-dir {self.run_dir}: {e.strerror or e} (token)", file=sys.stderr)
            return exits.USAGE
        sys.stdout, sys.stderr = TerminalOrLog(sys.stdout, self._output_to_log), \
            TerminalOrLog(sys.stderr, self._output_to_log)
        procs.on_stop(self._on_signal)
        R, S = self.cfg.job.replicas, self.cfg.job.stages
        print(f"crucible: run directory {self.run_dir}", flush=True)
        try:
            if self.cfg.job.mps == "on" and not self._start_mps():
                return exits.interrupted(self.stopping)       # a signal while MPS was being set up
            self.offset = metrics.size(self.run_dir)
            self.addr = self._start_coordinator("resume" if self.args.resume else "fresh")
            self.came_up = True
            if self.args.resume:
                self._say_where_it_resumes(self.offset)
            for r in range(R):
                for s in range(S):
                    self._start_worker(r, s)
            return self._supervise()
        except LaunchFailed as e:
            self.failure = str(e)
            print(f"\ncrucible: failed: {e}", file=sys.stderr, flush=True)
            return exits.ERROR
        except BrokenPipeError:
            # the reader of our output went away (`crucible launch | head`): stopped as by a signal, final
            # checkpoint first, the rest of what we say to nobody, this line to stderr
            code = exits.quiet_after_broken_pipe()
            print("crucible: the reader of the output went away: stopping the job", file=sys.stderr, flush=True)
            self.stopping = signal.SIGPIPE
            return code
        finally:
            if self.stopping or self.failure:   # a final checkpoint before everything stops
                # (the signal the launcher got, where the coordinator takes it: its job_stopped, and
                # with it `status` and the report, then name the one the launcher says it was stopped by)
                sig = self.stopping if self.stopping in (signal.SIGINT, signal.SIGHUP) else signal.SIGTERM
                preempt(self.coord, list(self.workers.values()), self.cfg.checkpoint, sig=sig)
            self._stop_all()
            if self.mps is not None:
                self.mps.stop()
            if (self.failure or self.stopping) and not self.finished and self.came_up:   # after the final checkpoint
                ending = "failed (see above)" if self.failure else \
                    f"interrupted by {signal.Signals(self.stopping).name}"
                print(self._summary(ending), flush=True)
                print(self._resume_hint(), flush=True)

    def _start_mps(self) -> bool:
        """job.mps=on: this launch's own MPS control daemon, checked with one
        CUDA client, before any worker starts (crucible.mps). False when a
        signal asked the launcher to stop meanwhile."""
        from crucible.mps import Mps, MpsError, MpsStopped

        self.mps = Mps()
        try:
            servers = self.mps.start(os.path.join(self.run_dir, "logs", "mps.log"),
                                     stopped=lambda: bool(self.stopping))
        except MpsStopped:
            self.mps = None
            return False
        except MpsError as e:
            self.mps = None
            raise LaunchFailed(str(e)) from None
        print(f"crucible: CUDA MPS on for the workers (server {servers}; pipe directory "
              f"{self.mps.env['CUDA_MPS_PIPE_DIRECTORY']})", flush=True)
        return True

    def _say_where_it_resumes(self, offset: int, wait_s: float = 3.0) -> None:
        """The coordinator's choice of checkpoint, on the terminal: the step it
        resumes from and each newer one it passed over (damaged, incomplete),
        or that there was none (a new run starts from step 0). ``offset``: the
        size of metrics.jsonl before this coordinator started (only its events
        are read, not a long run's whole history)."""
        t_end = time.monotonic() + wait_s
        while True:
            events = metrics.read_events(self.run_dir, offset=offset)
            resumed = [e for e in events if e.get("event") == "ckpt_resume"]
            if resumed or time.monotonic() > t_end:
                break
            time.sleep(0.1)
        for e in events:
            if e.get("event") in ("ckpt_damaged", "ckpt_incomplete"):
                why = "; ".join(e.get("problems", [])) or f"no shard of stage(s) {e.get('stages_missing')}"
                print(f"crucible: checkpoint step {e['step']} passed over: {why}"[:400], flush=True)
        if resumed and resumed[-1].get("step") is not None:
            changed = [str(c) for c in resumed[-1].get("changed") or []]
            note = f" (its configuration differed: {', '.join(changed)})"[:400] if changed else ""
            if resumed[-1].get("corpus_unchecked"):
                note += " (it records no corpus, an older Crucible wrote it: the data is not checked against it)"
            print(f"crucible: resuming from checkpoint step {resumed[-1]['step']}{note}", flush=True)
        elif resumed:
            print(f"crucible: --resume: no checkpoint in {self.run_dir}: starting from step 0", flush=True)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP and not self.stopping:
            self._on_hangup()
        self.stopping = signum

    def _output_to_log(self, failed: OSError | None = None) -> None:
        """The terminal hung up (SIGHUP: an ssh session dropped, the window
        closed; or its writes fail, where a hangup was ignored or the launch
        disowned; or a redirect's disk is full): what we still say (the job's
        progress, the final checkpoint, the summary, the resume hint) goes to
        logs/launcher.log, after the line that says why (``failed``: the
        write refused), or to /dev/null where the log cannot be written
        either. Where the log refuses a write too (its disk full), the rest
        goes to /dev/null: the job goes on (its events are in metrics.jsonl),
        where the write's OSError ended the launcher, and the job with it."""
        if self.output_in_log:
            if failed is not None:
                null = os.open(os.devnull, os.O_WRONLY)
                for out in (1, 2):
                    os.dup2(null, out)
                os.close(null)
            return
        self.output_in_log = True
        path = os.path.join(self.run_dir, "logs", "launcher.log")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            fd = os.open(os.devnull, os.O_WRONLY)
        if failed is not None:
            try:
                os.write(fd, f"crucible: the launcher's output could not be written ({failed.strerror or failed}): "
                             f"it goes on here\n".encode())
            except OSError:
                os.close(fd)
                fd = os.open(os.devnull, os.O_WRONLY)
        for out in (1, 2):
            os.dup2(fd, out)
        os.close(fd)

    def _on_hangup(self) -> None:
        self._output_to_log()
        print("crucible: the terminal hung up (SIGHUP): stopping the job as on Ctrl-C", flush=True)

    def _handle_deaths(self, respawn: bool) -> None:
        """Book every process that died since the last look: print its cause, stop
        the job on a crash loop (LaunchFailed), schedule a backed-off restart."""
        for p in list(self.workers.values()) + [self.coord]:
            code = p.poll()
            if code is None or p.restart_at is not None:
                continue
            if code == 0:
                continue          # a worker whose replica is done; a coordinator that finished the job
            err, repeated, delay = p.on_death(self.args.respawn_delay if p is not self.coord else 0.5)
            cause = exits.describe(code) + (f": {err}" if err else "")
            if repeated:
                raise LaunchFailed(f"{p.name} failed twice within {CRASH_LOOP_WINDOW_S:.0f}s with the same "
                                   f"error: {err} (log: {p.log_path})")
            if p is not self.coord and not respawn:
                print(f"crucible: {p.name} {cause}; not restarted (--respawn-delay < 0)", flush=True)
                p.restart_at = float("inf")
                continue
            what = "restarting it" if p is self.coord else "starting a replacement"
            print(f"crucible: {p.name} {cause}; {what} in {delay:.1f}s", flush=True)
            p.restart_at = p.died_at + delay

    def _supervise(self) -> int:
        from crucible.status import StatusClient

        client = StatusClient(self.addr, self.token)
        self.t_start, self.stopped = time.monotonic(), {}
        last_print, last_status = 0.0, 0.0
        tty = sys.stdout.isatty()
        respawn = self.args.respawn_delay is not None and self.args.respawn_delay >= 0
        exited_at = 0.0         # (respawn off) when every worker was seen exited
        while not self.stopping:
            time.sleep(0.1)
            if any(w.poll() == exits.RESTART for w in self.workers.values()):
                self._restart_all()
                client = StatusClient(self.addr, self.token)
                continue
            if self.coord.poll() == 0 and self._stopped_by_coordinator():
                return self._coordinator_stopped(self.stopped_by)     # (before any worker is restarted)
            self._handle_deaths(respawn)
            if self._restart_due():
                client = StatusClient(self.addr, self.token)
            exited = all(w.poll() is not None for w in self.workers.values())
            if (exited or self.coord.poll() == 0) and self._job_done():
                self._wait_for_the_end()
                break
            if self._all_done():
                # (every worker exits 0 after the coordinator's own stop too: then the job did not finish)
                self._wait_for(lambda: self.coord.poll() is not None, END_WAIT_S)
                if not self._job_done() and self._stopped_by_coordinator():
                    return self._coordinator_stopped(self.stopped_by)
                break
            if not respawn and exited:
                # (job_done may be on its way to the file: the coordinator writes it behind a queue)
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at >= JOB_DONE_WAIT_S:
                    raise LaunchFailed("every worker has exited and --respawn-delay is negative (no respawn)")
            else:
                exited_at = 0.0
            now = time.monotonic()
            if now - last_status >= 0.5:
                last_status = now
                self.last_status = client.get(timeout=1.0) or self.last_status
                self._watch_checkpoints(tty)
                self._watch_writes(tty)
            self._chaos_tick(now)
            if self.mps is not None and not self.mps_warned and not self.mps.alive():
                self.mps_warned = True
                print(f"crucible: the MPS control daemon exited ({exits.describe(self.mps.proc.returncode)}; "
                      f"log: {self.mps.log_path}); workers started from now on run without MPS", flush=True)
            if self.last_status is not None and now - last_print >= (1.0 if tty else 5.0):
                last_print = now
                self._show_progress(tty)
        if tty:
            print()
        if self.stopping and not self.job_done:          # (a signal after job_done: it finished all the same)
            return exits.interrupted(self.stopping)      # the summary follows the final checkpoint
        self.finished = True
        self._watch_checkpoints()
        print(self._summary("finished") + self._end_checkpoint_note(), flush=True)
        return exits.OK

    def _restart_due(self) -> bool:
        """Start the processes whose back-off is over; True when the coordinator was."""
        now = time.monotonic()
        for name, w in self.workers.items():
            if w.restart_at is not None and now >= w.restart_at:
                if self._job_done():
                    continue     # (it finished during the back-off: a replacement would find no job to join)
                w.restarts += 1
                self._start_worker(*slot_of(name))
        if self.coord.restart_at is not None and now >= self.coord.restart_at:
            self.addr = self._start_coordinator("restart")
            return True
        return False

    def _chaos_tick(self, now: float) -> None:
        """--chaos: SIGCONT what is due, then fire the faults that are due."""
        for name, t in list(self.stopped.items()):
            if now >= t:
                self._signal(name, signal.SIGCONT, "CONT")
                del self.stopped[name]
        if self.chaos is None:
            return
        st = self.last_status
        steps = {r["id"]: r["step"] for r in st["replicas"]} if st else {}
        live = [n for n, w in self.workers.items() if w.poll() is None and n not in self.stopped]
        for victim, sig in self.chaos.due(now - self.t_start, steps, live, self.cfg.job.stages):
            self._signal(victim, getattr(signal, "SIG" + sig), sig)
            if sig == "STOP":
                self.stopped[victim] = now + 5.0

    def _show_progress(self, tty: bool) -> None:
        from crucible.status import format_progress

        line = format_progress(self.last_status)
        print(("\r\033[K" + line) if tty else line, end="" if tty else "\n", flush=True)

    def _all_done(self) -> bool:
        return all(w.poll() == 0 for w in self.workers.values())

    def _scan_ends(self, partial: bool = False) -> None:
        """Follow metrics.jsonl (``metrics.follow``: each line once) for the two
        events that say how the job ended, job_done and job_stopped, and the
        saves' commits and aborts (kept for ``_watch_checkpoints``); every
        event is tallied for the summary as it comes (a long launch's log is
        not read again at its end). ``partial``: a last line with no newline
        too (the log's end, once nothing writes to it)."""
        _, self.scanned = metrics.follow(self.run_dir, None, self.offset if self.scanned is None else self.scanned,
                                         feed=self._scanned, partial=partial)

    def _scanned(self, ev: dict) -> None:
        if self.tally is None:
            self.tally = Tally()
        self.tally.feed(ev)
        if ev["event"] in ("job_done", "job_stopped", "ckpt_abort", "ckpt_commit"):
            if ev["event"] in ("ckpt_abort", "ckpt_commit"):
                self.ckpt_events.append(ev)
            elif ev["event"] == "job_done":
                self.job_done = True
            else:
                try:
                    self.stopped_by = signal.Signals[ev.get("signal") or "SIGTERM"]
                except KeyError:
                    self.stopped_by = signal.SIGTERM

    def _stopped_by_coordinator(self) -> signal.Signals | None:
        """The signal that made the coordinator stop this launch's job
        (``job_stopped``, since its last start by ``_restart_all``), or None."""
        self._scan_ends()
        return None if self.job_done else self.stopped_by

    def _job_done(self) -> bool:
        """The coordinator logged job_done in this launch: every replica trained
        train.steps steps, whatever became of each worker (one killed on the
        way, with no respawn, was routed around)."""
        self._scan_ends()
        return self.job_done

    def _coordinator_stopped(self, sig: signal.Signals) -> int:
        """The coordinator stopped the job on a signal of its own (its host
        preempted): the workers exit 0 after that as at the end of a job, but
        the job did not finish. Ends as a stop does (summary, resume command)."""
        start = "\n" if sys.stdout.isatty() else ""      # (after the progress line)
        print(f"{start}crucible: the coordinator got {sig.name}: it stopped the job (after a final checkpoint "
              f"where checkpointing is on)", flush=True)
        self.stopping = sig
        return exits.interrupted(sig)

    def _watch_checkpoints(self, tty: bool = False) -> None:
        """Saves that fail (a full or read-only disk, a shard that cannot be
        written): one line with the cause on the terminal, said again only
        after a save has committed in between; and that line when one does.
        Training goes on meanwhile (the coordinator's log has every abort)."""
        self._scan_ends()
        events, self.ckpt_events = self.ckpt_events, []
        start = "\n" if tty else ""      # (after the progress line)
        for ev in events:
            if ev["event"] == "ckpt_commit":
                if self.ckpt_failing:
                    print(f"{start}crucible: checkpoints commit again (step {ev.get('step')})", flush=True)
                self.ckpt_failing = ""
                continue
            why = str(ev.get("reason") or "")
            if self.ckpt_failing or " failed: " not in f" {why}":   # (a late target, a lost worker: retried)
                continue
            self.ckpt_failing = why
            if not metrics.whole(ev.get("step")) or ev["step"] >= self.cfg.train.steps:
                continue      # (the save of the last step: the summary says it)
            ckpts, unlisted = self._checkpoints()
            newest = f"step {ckpts[-1].step}" if ckpts else f"unknown ({unlisted})" if unlisted else "none"
            print(f"{start}crucible: the checkpoint of step {ev.get('step')} failed: {why[:300]}; training goes "
                  f"on, checkpoints are retried (newest checkpoint: {newest})", flush=True)

    def _watch_writes(self, tty: bool = False) -> None:
        """Files of the run directory that cannot be written (a full disk): one
        line when writes start failing, one when they all succeed again.
        Nothing stops for it (the coordinator keeps its events and state and
        tries again, as does the launcher with pids.json), except an outer
        round, which closes only once its file is written."""
        if self.pids_unwritten:
            self._write_pids()
        failing = dict((self.last_status or {}).get("write_failures") or {})
        if self.pids_unwritten:
            failing["pids.json"] = self.pids_unwritten
        start = "\n" if tty else ""      # (after the progress line)
        if failing and not self.writes_failing:
            why = "; ".join(sorted({f"{', '.join(sorted(n for n in failing if failing[n] == e))}: {e}"
                                    for e in failing.values()}))
            print(f"{start}crucible: cannot write to {self.run_dir} ({why}): kept and tried again every second; "
                  f"training goes on, but an outer round waits for its file", flush=True)
        elif self.writes_failing and not failing:
            print(f"{start}crucible: the run directory is written again", flush=True)
        self.writes_failing = bool(failing)

    def _end_checkpoint_note(self) -> str:
        """A finished job whose save of the last step did not commit: said, with the
        newest checkpoint, so that nobody resumes believing it is at the end."""
        if not self.cfg.checkpoint.enable_checkpointing:
            return ""
        ckpts, unlisted = self._checkpoints()
        if ckpts and ckpts[-1].step >= self.cfg.train.steps:
            return ""
        why = f": its save failed ({self.ckpt_failing[:300]})" if self.ckpt_failing else ""
        newest = f"step {ckpts[-1].step}" if ckpts else f"unknown ({unlisted})" if unlisted else "none"
        return (f"\ncrucible: warning: no checkpoint of the last step ({self.cfg.train.steps}){why}; "
                f"the newest checkpoint is {newest}")

    def _wait_for(self, cond, timeout: float) -> bool:
        """Wait until ``cond()`` or ``timeout`` seconds or a stop signal; whether cond() held."""
        t_end = time.monotonic() + timeout
        while not cond():
            if self.stopping or time.monotonic() >= t_end:
                return False
            time.sleep(0.1)
        return True

    def _wait_for_the_end(self) -> None:
        """The job is done: the coordinator exits once a checkpoint save still in
        flight has committed (``serve``: up to 30 s), every worker once its
        replica is done. Whoever is still running then is stopped (by run's
        ``_stop_all``), said here. A replacement still starting (not among
        the workers the coordinator last listed) has no job to join and no
        state to keep: it is stopped at once (``_stop_starting``), not waited
        for (it sought the coordinator until the END_GRACE_S wait ran out)."""
        self._stop_starting()
        self._wait_for(lambda: self.coord.poll() is not None, END_WAIT_S)
        self._wait_for(lambda: all(w.poll() is not None for w in self.workers.values()), END_GRACE_S)
        left = [n for n, w in self.workers.items() if w.poll() is None]
        if left and not self.stopping:
            start = "\n" if sys.stdout.isatty() else ""      # (after the progress line)
            print(f"{start}crucible: the job is done but {', '.join(left)} did not exit within "
                  f"{END_GRACE_S:.0f}s; stopping {'it' if len(left) == 1 else 'them'}", flush=True)

    def _stop_starting(self) -> None:
        """Stop the replacements that are running but not registered as far as
        the coordinator's last status says (started by ``_restart_due`` just
        before job_done): SIGTERM, then SIGKILL after ``STARTING_STOP_S``."""
        listed = {w.get("pid") for w in ((self.last_status or {}).get("workers") or [])}
        starting = {n: w for n, w in self.workers.items()
                    if w.restarts and w.popen is not None and w.poll() is None and w.pid not in listed}
        if not starting:
            return
        start = "\n" if sys.stdout.isatty() else ""      # (after the progress line)
        print(f"{start}crucible: the job is done: stopping {', '.join(starting)} "
              f"({'a replacement' if len(starting) == 1 else 'replacements'} still starting)", flush=True)
        for w in starting.values():
            try:
                w.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        t_end = time.monotonic() + STARTING_STOP_S
        for w in starting.values():
            try:
                w.popen.wait(timeout=max(0.0, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.popen.kill()
                w.popen.wait()
            w.poll()

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
        metrics.append_event(self.run_dir, ev)

    def _restart_all(self) -> None:
        """on_stage_failure = restart: the classic way. Every process goes; all come
        back and resume from the latest committed checkpoint."""
        why = "; ".join(sorted({e for e in (w.error() for w in self.workers.values()) if e})) or \
            "on_stage_failure = restart, or a stage lost every copy"
        print(f"crucible: the coordinator asked every worker to restart from the latest checkpoint ({why})",
              flush=True)
        t0 = time.monotonic()
        self._stop_all(grace=2.0)
        self._scan_ends()
        self.stopped_by = None            # (the job_stopped of the coordinator this restart stopped)
        self._log_event({"event": "job_restart", "reason": why})
        self.addr = None
        self.addr = self._start_coordinator("resume")
        for name in list(self.workers):
            self._start_worker(*slot_of(name))
        self._log_event({"event": "job_restarted", "seconds": time.monotonic() - t0})

    def _resume_hint(self) -> str:
        """Where a stopped job can go on from, and the command that does it."""
        if not self.cfg.checkpoint.enable_checkpointing:
            return "crucible: no checkpoints (checkpoint.enable_checkpointing = false): nothing to resume"
        from crucible.preflight import CheckFailed, check_steps_left

        ckpts, unlisted = self._checkpoints()
        if not ckpts and not unlisted:
            return "crucible: no checkpoint was committed: a new launch starts from step 0"
        try:
            check_steps_left(ckpts, self.cfg)     # (the pre-flight's rule: the checkpoint a resume would take)
        except CheckFailed:
            return (f"crucible: newest checkpoint: step {ckpts[-1].step}, train.steps {self.cfg.train.steps}: "
                    f"every step is trained; to train on, --resume with a larger --steps")
        argv = ["crucible", "launch", "--run-dir", self.run_dir, "--resume"]
        if self.args.config:
            argv += ["--config", os.path.abspath(self.args.config)]
        if self.args.respawn_delay != procs.RESPAWN_DELAY_S:
            argv += ["--respawn-delay", f"{self.args.respawn_delay:g}"]
        for flag in ("tls_dir", "tls_host", "tls_ca", "tls_cert", "tls_key"):
            value = getattr(self.args, flag, None)
            if value:
                argv += ["--" + flag.replace("_", "-"), value if flag == "tls_host" else os.path.abspath(value)]
        # The options as the user gave them (--steps 40, not train.steps=40; a relative
        # data.path is the user's to keep right).
        argv += self.given_flags + self.given
        if unlisted:
            return f"crucible: newest checkpoint: unknown ({unlisted}); once they can be read, go on from the " \
                   f"newest with\n  {shlex.join(argv)}"
        return f"crucible: newest checkpoint: step {ckpts[-1].step}; go on from it with\n  {shlex.join(argv)}"

    def _checkpoints(self) -> tuple[list, str]:
        """The committed checkpoints, and why they cannot be listed just now
        ("" when they can): a checkpoints/ whose mode changed under the job
        (chmod 000) ended the launcher on a traceback, and the job with it."""
        from crucible.checkpoint.store import list_checkpoints

        root = os.path.join(self.run_dir, "checkpoints")
        try:
            return list_checkpoints(root), ""
        except OSError as e:
            return [], f"cannot list {root}: {e.strerror or e}"

    def _summary(self, ending: str) -> str:
        """How the job ended, then final loss per replica, its time ledger, and the faults seen:
        this launch's events (not earlier ones' in the run), tallied as ``_scan_ends`` read them."""
        from crucible.ledger import KEYS

        self._scan_ends(partial=True)
        tally = self.tally or Tally()
        ledgers = tally.ledger.totals()   # (each stage-0 worker the replica had, and the time between them)
        lines = []
        resumed = getattr(getattr(self, "args", None), "resume", False) is True
        for r in sorted(tally.steps):
            # (a resumed launch's steps go on from its checkpoint's, its ledger is its own: said)
            since = f" (this launch: from step {tally.first[r]})" if resumed and tally.first.get(r) else ""
            line = f"r{r}: {tally.steps[r]} steps{since}, loss {_fmt(tally.losses[r])}"
            if metrics.number(tally.losses.get(f"eval{r}")):
                line += f", held-out {tally.losses[f'eval{r}']:.3f}"
            g = ledgers.get(r)
            if g and g["wall_s"]:
                parts = ", ".join(f"{k.removesuffix('_s')} {g[k]:.1f}s" for k in KEYS if g[k])
                line += f"; goodput {100 * g['compute_s'] / g['wall_s']:.0f}% of {g['wall_s']:.0f}s ({parts})"
            lines.append(line)
        out = f"crucible: {ending}.\n" + "\n".join(f"  {x}" for x in lines)
        if tally.faults:
            out += f"\n  {tally.faults} worker fault{'' if tally.faults == 1 else 's'}"
        return out + f"\ncrucible: metrics in {metrics.path_of(self.run_dir)}"


class Tally:
    """What the launcher's summary says of a launch, from its events fed in
    the order they were written: each replica's last step and loss (and
    held-out loss), the step it began at, its time ledger, the faults. An event without what is
    read from it (a worker's report the coordinator takes as it is: no
    replica, a loss that is not a number) is passed over."""

    def __init__(self):
        from crucible.ledger import Ledgers

        self.steps, self.losses, self.ledger, self.faults = {}, {}, Ledgers(), 0
        self.first: dict[int, int] = {}       # replica -> its first step in the launch

    def feed(self, ev: dict) -> None:
        kind, r = ev.get("event"), ev.get("replica")
        self.ledger.feed(ev)
        if kind == "fault":
            self.faults += 1
        elif not metrics.whole(r):
            return
        elif kind == "step" and metrics.whole(ev.get("step")):
            self.first.setdefault(r, ev["step"])
            self.steps[r] = ev["step"] + 1
            self.losses[r] = ev.get("loss")
        elif kind == "eval":
            self.losses[f"eval{r}"] = ev.get("loss")


def _fmt(x) -> str:
    return f"{x:.3f}" if metrics.number(x) else "-"


class TerminalOrLog(exits.Output):
    """The launcher's stdout or stderr. A write that the terminal refuses
    with EIO (it hung up, and the launch ignored SIGHUP or was disowned: it
    is meant to go on), or that a redirect refuses (its disk full,
    /dev/full), moves the launcher's output to its log (``to_log``) and is
    written there, instead of ending the launch, and with it the job, on a
    traceback at its next progress line. A broken pipe is not moved: its
    reader went away, and the launch stops for it (``Launcher.run``)."""

    def __init__(self, stream, to_log):
        super().__init__(stream)
        self._to_log = to_log

    def _refused(self, e: OSError, what, *args):
        self._to_log(e)               # (file descriptors 1 and 2 now the log: the same stream writes there)
        return what(*args)


def preempt(coord_proc, worker_procs, ckpt_cfg, out=None, sig: int = signal.SIGTERM) -> None:
    """The launcher's side of a preemption notice (SIGTERM/SIGINT): only the
    coordinator is signalled (``sig``); it takes a final checkpoint and then tells the
    workers to stop, so they exit on their own after the commit. Waits for the
    coordinator (``preemption_timeout_s`` plus a margin) and the workers; the
    launcher stops whatever is left afterwards."""
    out = out or sys.stdout
    if not ckpt_cfg.enable_checkpointing or coord_proc is None or coord_proc.popen is None \
            or coord_proc.poll() is not None:
        return
    print("crucible: stopping: taking a final checkpoint first", file=out, flush=True)
    try:
        coord_proc.popen.send_signal(sig)
    except ProcessLookupError:
        return
    try:
        coord_proc.popen.wait(timeout=ckpt_cfg.preemption_timeout_s + 10.0)
    except subprocess.TimeoutExpired:
        print("crucible: the coordinator did not finish its final checkpoint in time", file=out, flush=True)
        return
    t_end = time.monotonic() + 5.0
    for w in worker_procs:
        if w.popen is None:
            continue
        try:
            w.popen.wait(timeout=max(0.0, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
