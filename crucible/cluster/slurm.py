"""`crucible slurm up | supervise | status | down`: a job on a Slurm cluster.

The unit of scheduling is the unit of failure: one worker slot. The
coordinator is one batch job and every slot ``r{R}s{S}`` its own
``sbatch --requeue`` job; nothing is ever gang-restarted.

Layout (the run directory must be on storage every node reads and writes):

* ``token``: the shared secret, mode 0600. Each job script exports
  ``CRUCIBLE_TOKEN`` from it; it is never on a command line.
* ``slurm/state.json``: the run's settings and, per slot, its current job
  id, submissions, consecutive failures and next submission time. Written by
  ``up``, then only by the supervisor (atomically).
* ``slurm/jobs/<slot>.sh``: the job script of each slot (``exec`` of
  ``python -m crucible.cluster.slurm_job``, which binds the node's address
  and ``exec``\\s the coordinator or the worker: Slurm's signals reach it).
* ``slurm/stop``: present once ``down`` started; the supervisor then stops
  resubmitting and exits. ``slurm/supervisor.lock`` is held (flock) by the
  running supervisor, ``slurm/supervisor.pid`` names it.
* ``logs/slurm/<slot>-<jobid>.out``: each job's output.

The coordinator's address. The first coordinator binds ``HOST:PORT`` (HOST =
its node's name, PORT from ``--port``, default any free one) and writes
``coordinator.addr``; every later coordinator of the run binds the same port
again (it waits up to 30 s for the old one to let it go), so a restarted
coordinator on the same node has the same address and every worker
carries on with it (it restores its predecessor's saved state; a worker it
does not know re-registers). A worker job
reads ``coordinator.addr`` when it starts. If the coordinator comes back on
another node, running workers keep dialling the old address: the supervisor's
stuck check (below) then cancels their jobs and their resubmissions, reading
the new address, join as replacements. Pin the coordinator to a node with
``--coordinator-sbatch=--nodelist=NODE`` where that matters.

The supervisor (``supervise``; ``up`` starts it in the background unless
``--foreground``) polls ``squeue --json --states=all`` for the run's jobs
(by job name; ``sacct`` is not used: it fails without ``slurmdbd``; where
``squeue --json`` is missing it reads ``scontrol show job -o``). A slot
whose job ended for any reason (completed, failed, cancelled, timeout, node
failure, preempted, or gone from the queue) is submitted again after a
delay: ``--resubmit-delay`` x 2^(n-1) for the n-th consecutive failure,
at most ``--max-delay``; a job that ran ``--healthy-after`` seconds or more
resets n, so a slot that keeps failing at start is backed off while a slot
lost after an hour comes back at once. A job that Slurm requeued itself
(node failure with ``--requeue``) keeps its id; its hold (``BeginTime``)
is lifted with ``scontrol update StartTime=now`` once it has been held
``REQUEUE_SETTLE_S`` (a requeued coordinator job
that had started a coordinator runs it as a restart: ``slurm_job``). The stuck check: a
worker job RUNNING for ``--stuck-after`` seconds whose slot the coordinator
has not shown alive for as long is cancelled (then resubmitted). The
coordinator is resubmitted with ``--resume`` when no worker job is running
and a committed checkpoint exists (the whole job was lost), else as a
restart (it restores its predecessor's saved state and live workers
re-register); the first coordinator of ``up`` starts ``--fresh`` (or
``--resume`` with ``up --resume``). Once the job has finished
(``job_done`` in ``metrics.jsonl``) nothing is resubmitted and the
supervisor exits when the last job has ended.

Signals. The coordinator runs with ``--on-sigterm leave``: SIGTERM, what
Slurm sends on ``scancel``, preemption or a time limit, ends that one job
only; the workers keep training and carry on with the next coordinator
(a worker's own SIGTERM ends that worker only: a replacement). Stopping the
whole job is ``down``'s alone: the stop file, then ``scancel --batch
--signal=INT`` to the coordinator's job: the coordinator takes a final
checkpoint and tells every worker to stop (their jobs end by themselves);
then every job of the run still in the queue is cancelled, and ``down``
waits until none is left.

Events appended to ``metrics.jsonl``: ``slurm_submit`` (slot, job_id,
start), ``slurm_job_end`` (slot, job_id, state, exit_code, run_s,
failures, resubmit_in_s), ``slurm_job_start`` (written by the job itself:
slot, job_id, node), ``slurm_stuck``, ``slurm_down``.
"""

from __future__ import annotations

from crucible import exits, procs
from crucible.files import atomic_write
from crucible.metrics import append_event, each, follow
from crucible.slots import slot_of

import dataclasses
import fcntl
import json
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("crucible.slurm")

COORD = "coordinator"
# Job states (Slurm's names) in which the job still holds, or will hold, a slot.
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "POWER_UP_NODE"}


# Why a job pends (squeue's reason) where it can never start as asked: Slurm (without
# EnforcePartLimits) accepts it and leaves it pending for ever.
NEVER_STARTS = {"PartitionConfig": "asks for more than the partition has (CPUs, memory or nodes)",
                "PartitionNodeLimit": "asks for more nodes than the partition allows",
                "PartitionTimeLimit": "asks for more time than the partition allows",
                "BadConstraints": "asks for a feature (--constraint) no node of the partition has"}


# A requeued job's hold is lifted this long after it was first seen held, not at once:
# its earlier run's credential is revoked as of the requeue's second, and a job started
# again within that second was killed as "non-startable: Job credential revoked" (FAILED).
REQUEUE_SETTLE_S = 2.0


class SlurmError(RuntimeError):
    """A Slurm command failed; the message says which and why, on one line."""


# ---- scheduler facts ------------------------------------------------------------------------------

@dataclass
class JobInfo:
    job_id: int
    name: str
    state: str
    node: str = ""
    reason: str = ""
    exit_code: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    restarts: int = 0

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def never_starts(self) -> str:
        """Why this pending job can never start as asked, or ""."""
        return NEVER_STARTS.get(self.reason, "") if self.state == "PENDING" else ""


def run_cmd(argv: list[str], timeout: float = 30.0) -> str:
    """Run a Slurm command; its stdout, or SlurmError naming the command."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: command not found (is this a Slurm submit host?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:2])}: no answer in {timeout:.0f}s") from None
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(argv[:2])} failed ({p.returncode}): {msg[-1] if msg else 'no output'}")
    return p.stdout


def _number(v) -> float | None:
    """A number in squeue's JSON: plain (Slurm <= 22.05) or {"set", "infinite", "number"} (23.02+)."""
    if isinstance(v, dict):
        if not v.get("set", True) or v.get("infinite"):
            return None
        v = v.get("number")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


def _exit_code(v) -> int | None:
    if isinstance(v, dict):   # 23.02+: {"status": [...], "return_code": {...}, "signal": {...}}
        sig = _number((v.get("signal") or {}).get("id")) if isinstance(v.get("signal"), dict) else None
        rc = _number(v.get("return_code"))
        if sig:
            return 128 + int(sig)
        return None if rc is None else int(rc)
    n = _number(v)
    if n is None:
        return None
    n = int(n)   # Slurm <= 22.05: the raw wait status
    return 128 + (n & 0x7F) if n & 0x7F else n >> 8


def parse_squeue_json(text: str) -> dict[int, JobInfo]:
    doc = json.loads(text)
    errors = doc.get("errors") or []
    if errors and not doc.get("jobs"):
        # squeue --json exits 0 with no job and an error where it cannot reach slurmctld (restarting):
        # taken as an empty queue, every job of the run was "gone" and submitted a second time (an
        # error beside jobs is no failed query)
        e = errors[0] if isinstance(errors[0], dict) else {"error": str(errors[0])}
        raise SlurmError(f"squeue --json failed: {e.get('description') or e.get('error') or e}")
    out = {}
    for j in doc.get("jobs", []):
        state = j.get("job_state")
        if isinstance(state, list):
            state = state[0] if state else ""
        start, end = _number(j.get("start_time")), _number(j.get("end_time"))
        jid = int(_number(j.get("job_id")))
        out[jid] = JobInfo(job_id=jid, name=j.get("name", ""), state=str(state or ""),
                           node=j.get("nodes") or j.get("batch_host") or "", reason=str(j.get("state_reason", "")),
                           exit_code=_exit_code(j.get("exit_code")), start_time=start or None,
                           end_time=end or None, restarts=int(_number(j.get("restart_cnt")) or 0))
    return out


_KV = re.compile(r"(\S+?)=(\S*)")


def _scontrol_time(s: str) -> float | None:
    if not s or s in ("Unknown", "None", "N/A"):
        return None
    try:
        return time.mktime(time.strptime(s, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_scontrol(text: str) -> dict[int, JobInfo]:
    """``scontrol show job -o``: one job a line of key=value pairs."""
    out = {}
    for line in text.splitlines():
        kv = dict(_KV.findall(line))
        if "JobId" not in kv:
            continue
        jid = int(kv["JobId"])
        code = kv.get("ExitCode", "0:0").split(":")
        exit_code = 128 + int(code[1]) if len(code) == 2 and code[1].isdigit() and int(code[1]) else \
            (int(code[0]) if code[0].isdigit() else None)
        node = kv.get("BatchHost") or kv.get("NodeList") or ""
        out[jid] = JobInfo(job_id=jid, name=kv.get("JobName", ""), state=kv.get("JobState", ""),
                           node="" if node == "(null)" else node, reason=kv.get("Reason", ""),
                           exit_code=exit_code, start_time=_scontrol_time(kv.get("StartTime", "")),
                           end_time=_scontrol_time(kv.get("EndTime", "")), restarts=int(kv.get("Restarts", 0) or 0))
    return out


def query_jobs(names: list[str]) -> dict[int, JobInfo]:
    """Every job (pending, running, or ended and still known to slurmctld) with one of these names."""
    try:
        jobs = parse_squeue_json(run_cmd(["squeue", "--json", "--states=all", "--name=" + ",".join(names)]))
    except (SlurmError, ValueError, TypeError, KeyError) as e:
        if isinstance(e, SlurmError) and "not found" in str(e):
            raise
        # Older Slurm (no --json) or another JSON layout: scontrol's one-line records.
        try:
            jobs = parse_scontrol(run_cmd(["scontrol", "show", "job", "-o"]))
        except SlurmError as e2:
            if "No jobs in the system" in str(e2):
                return {}
            raise
    wanted = set(names)
    return {jid: j for jid, j in jobs.items() if j.name in wanted}


def sbatch(argv: list[str]) -> int:
    out = run_cmd(["sbatch", "--parsable", *argv]).strip()
    try:
        return int(out.split(";")[0])
    except ValueError:
        raise SlurmError(f"sbatch printed {out!r}, not a job id") from None


def scancel(job_ids: list[int], signal_name: str | None = None, batch: bool = False) -> None:
    if not job_ids:
        return
    argv = ["scancel"]
    if batch:
        argv.append("--batch")
    if signal_name:
        argv.append(f"--signal={signal_name}")
    try:
        run_cmd(argv + [str(j) for j in job_ids])
    except SlurmError as e:
        if "already completing or completed" not in str(e) and "Invalid job id" not in str(e):
            raise


# ---- the run's state ------------------------------------------------------------------------------

@dataclass
class Slot:
    name: str
    job_id: int | None = None
    submits: int = 0
    failures: int = 0             # consecutive jobs that ran less than healthy_after
    next_submit: float = 0.0      # wall time of the next submission (when job_id is None)
    last_state: str = ""          # how the previous job ended
    last_exit: int | None = None
    node: str = ""
    started: float | None = None  # start time of the current job (when running)
    start: str = ""               # coordinator: how its current job starts: fresh | resume | restart


@dataclass
class SlurmRun:
    run_dir: str
    run_id: str
    python: str
    replicas: int
    stages: int
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    resume: bool = False
    sbatch: list[str] = field(default_factory=list)
    coordinator_sbatch: list[str] = field(default_factory=list)
    worker_sbatch: list[str] = field(default_factory=list)
    device: str = "cpu"
    port: int = 0
    resubmit_delay: float = 1.0
    max_delay: float = 300.0
    healthy_after: float = 60.0
    stuck_after: float = 120.0
    poll: float = 0.5
    preemption_timeout: float = 60.0
    metrics_offset: int = 0
    metrics_start: int = 0      # bytes in metrics.jsonl at `slurm up`: what came before is an earlier run's
    created: float = 0.0
    slots: dict[str, Slot] = field(default_factory=dict)

    # paths
    @property
    def dir(self) -> str:
        return os.path.join(self.run_dir, "slurm")

    @property
    def state_path(self) -> str:
        return os.path.join(self.dir, "state.json")

    @property
    def stop_path(self) -> str:
        return os.path.join(self.dir, "stop")

    def script(self, slot: str) -> str:
        return os.path.join(self.dir, "jobs", f"{slot}.sh")

    def job_name(self, slot: str) -> str:
        return f"crucible-{self.run_id}-{slot}"

    def names(self) -> list[str]:
        return [self.job_name(s) for s in self.slots]

    def worker_slots(self) -> list[str]:
        return [s for s in self.slots if s != COORD]

    def save(self) -> None:
        atomic_write(self.state_path, json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: str) -> "SlurmRun":
        path = os.path.join(os.path.abspath(run_dir), "slurm", "state.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise SystemExit(f"crucible slurm: no Slurm run in {run_dir} (no {path}): start one with "
                             f"`crucible slurm up`") from None
        except (OSError, ValueError) as e:
            raise SystemExit(f"crucible slurm: cannot read {path}: {e}") from None
        slots = {k: Slot(**v) for k, v in d.pop("slots").items()}
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}, slots=slots)


def slot_names(replicas: int, stages: int) -> list[str]:
    return [COORD] + [f"r{r}s{s}" for r in range(replicas) for s in range(stages)]


def parse_slot(name: str) -> tuple[int, int]:
    return slot_of(name)


JOB_SCRIPT = """#!/bin/bash
# crucible slurm: slot {slot} of run {run_id} ({run_dir}).
# Submitted by `crucible slurm up`, resubmitted by its supervisor. The token is
# read from the run directory's 0600 file: never on a command line.
set -eu
CRUCIBLE_TOKEN="$(cat {token})"
export CRUCIBLE_TOKEN
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
exec {python} -m crucible.cluster.slurm_job {run_dir} {slot}
"""


def write_scripts(run: SlurmRun) -> None:
    os.makedirs(os.path.join(run.dir, "jobs"), exist_ok=True)
    q = shlex.quote
    for slot in run.slots:
        path = run.script(slot)
        with open(path, "w") as f:
            f.write(JOB_SCRIPT.format(slot=slot, run_id=run.run_id, run_dir=q(run.run_dir),
                                      token=q(os.path.join(run.run_dir, "token")), python=q(run.python)))
        os.chmod(path, 0o755)


def submit(run: SlurmRun, slot: Slot, start: str = "restart") -> int:
    """Submit the slot's job. The coordinator's ``start``: ``fresh`` (the first of a
    new run), ``resume`` (the whole job from its latest checkpoint) or ``restart``
    (continue from the previous coordinator's saved state; live workers carry on)."""
    logs = os.path.join(run.run_dir, "logs", "slurm")
    os.makedirs(logs, exist_ok=True)
    extra = run.coordinator_sbatch if slot.name == COORD else run.worker_sbatch
    argv = [f"--job-name={run.job_name(slot.name)}", f"--output={logs}/{slot.name}-%j.out", "--requeue",
            "--open-mode=append", f"--chdir={run.run_dir}", *run.sbatch, *extra, run.script(slot.name)]
    if slot.name == COORD:
        slot.start = start
        run.save()   # the job reads how to start from the state
    jid = sbatch(argv)
    slot.job_id, slot.submits, slot.started, slot.node = jid, slot.submits + 1, None, ""
    run.save()
    append_event(run.run_dir, {"event": "slurm_submit", "slot": slot.name, "job_id": jid,
                               "submits": slot.submits, "start": start if slot.name == COORD else None})
    return jid


def has_checkpoint(run_dir: str) -> bool:
    """A committed checkpoint to resume from. checkpoints/ unreadable just now
    (its mode changed): True, so that the coordinator is started with
    --resume and says what it cannot read, where a supervisor that took it
    for none would start the job over (and this one died on the traceback)."""
    from crucible.checkpoint.store import list_checkpoints

    try:
        return bool(list_checkpoints(os.path.join(run_dir, "checkpoints")))
    except FileNotFoundError:
        return False
    except OSError:
        return True


# ---- the supervisor -------------------------------------------------------------------------------

class Supervisor:
    def __init__(self, run: SlurmRun, say=None, told: set[int] | None = None):
        self.run = run
        self.say = say or (lambda msg: print(f"{time.strftime('%H:%M:%S')} crucible slurm: {msg}", flush=True))
        self.finished = False
        self.offset = run.metrics_offset
        self.unhealthy_since: dict[str, float] = {}
        self.last_status = 0.0
        self._status_client = None
        self._status_addr = ""
        self.clock = procs.SteadyClock()    # (resubmission delays, the stuck check: no wall-clock step moves them)
        self.told: set[int] = set(told or ())   # jobs said to be unable to start (by `up`, too), while queued
        self.held_since: dict[tuple[int, int], float] = {}   # (job, restarts) -> when first seen held

    def stopping(self) -> bool:
        return os.path.exists(self.run.stop_path)

    def _scan_metrics(self) -> None:
        """Has the job finished since `up`? (``job_done`` in metrics.jsonl, read incrementally)."""
        done, self.offset = follow(self.run.run_dir, ("job_done",), self.offset)
        self.finished = self.finished or bool(done)

    def _coordinator_status(self) -> dict | None:
        from crucible import rpc
        from crucible.status import StatusClient

        try:
            with open(os.path.join(self.run.run_dir, "coordinator.addr")) as f:
                addr = f.read().strip()
        except OSError:
            return None
        if addr != self._status_addr or self._status_client is None:
            self._status_client = StatusClient(addr, rpc.read_token(self.run.run_dir))
            self._status_addr = addr
        return self._status_client.get(timeout=2.0)

    def _delay(self, failures: int) -> float:
        if failures <= 0:
            return self.run.resubmit_delay
        return min(self.run.resubmit_delay * 2 ** (failures - 1), self.run.max_delay)

    def _ended(self, slot: Slot, info: JobInfo | None, now: float) -> None:
        state = info.state if info else "GONE"
        start = info.start_time if info and info.start_time else slot.started
        end = info.end_time if info and info.end_time else now
        run_s = (end - start) if start else 0.0
        if run_s >= self.run.healthy_after:
            slot.failures = 0
        else:
            slot.failures += 1
        delay = self._delay(slot.failures)
        slot.last_state, slot.last_exit = state, info.exit_code if info else None
        old, slot.job_id, slot.started = slot.job_id, None, None
        slot.next_submit = now + delay
        resubmit = not (self.finished or self.stopping())
        append_event(self.run.run_dir, {"event": "slurm_job_end", "slot": slot.name, "job_id": old, "state": state,
                                        "exit_code": slot.last_exit, "run_s": round(run_s, 3),
                                        "failures": slot.failures, "resubmit_in_s": delay if resubmit else None})
        self.say(f"{slot.name}: job {old} ended ({state}, exit {slot.last_exit}, ran {run_s:.0f}s)"
                 + (f"; resubmitting in {delay:.1f}s" if resubmit else ""))

    def tick(self, now: float | None = None) -> None:
        run = self.run
        now = self.clock() if now is None else now
        self._scan_metrics()
        jobs = query_jobs(run.names())
        changed = False
        for slot in run.slots.values():
            if slot.job_id is None:
                continue
            info = jobs.get(slot.job_id)
            if info is None or not info.active:
                self._ended(slot, info, now)
                changed = True
                continue
            if info.state == "RUNNING" and (slot.started is None or slot.node != info.node):
                slot.started, slot.node = info.start_time or now, info.node
                changed = True
            if info.never_starts and info.job_id not in self.told:
                self.told.add(info.job_id)
                self.say(f"{slot.name}: job {info.job_id} may never start as asked: pending for {info.reason} "
                         f"(it {info.never_starts}); `crucible slurm down`, then `up` with other options")
            held = info.state == "PENDING" and info.restarts > 0 and info.reason == "BeginTime"
            if held and now - self.held_since.setdefault((info.job_id, info.restarts), now) >= REQUEUE_SETTLE_S:
                # Requeued by Slurm (node failure, preemption): held for the credential's
                # lifetime; it can start now.
                try:
                    run_cmd(["scontrol", "update", f"jobid={info.job_id}", "StartTime=now"])
                except SlurmError as e:
                    log.debug("releasing requeued job %s: %s", info.job_id, e)
        # (what is known of jobs no longer queued goes: a supervisor of a week's resubmissions kept it all)
        self.told &= set(jobs)
        self.held_since = {k: t for k, t in self.held_since.items() if k[0] in jobs}
        if not (self.finished or self.stopping()):
            self._check_stuck(jobs, now)
            running_workers = any(jobs.get(run.slots[s].job_id) is not None
                                  and jobs[run.slots[s].job_id].state == "RUNNING" for s in run.worker_slots())
            for slot in run.slots.values():
                if slot.job_id is None and now >= slot.next_submit:
                    resume = slot.name == COORD and not running_workers and has_checkpoint(run.run_dir)
                    try:
                        jid = submit(run, slot, start="resume" if resume else "restart")
                        self.say(f"{slot.name}: submitted job {jid}" + (" (--resume)" if resume else ""))
                    except SlurmError as e:
                        slot.failures += 1
                        slot.next_submit = now + self._delay(slot.failures)
                        self.say(f"{slot.name}: {e}; trying again in {slot.next_submit - now:.0f}s")
                    changed = True
        if changed:
            run.metrics_offset = self.offset
            run.save()

    def _check_stuck(self, jobs: dict[int, JobInfo], now: float) -> None:
        """A worker job RUNNING for stuck_after seconds whose slot the coordinator has
        not shown alive for as long (e.g. it dials a coordinator that moved): cancel it."""
        run = self.run
        if run.stuck_after <= 0 or now - self.last_status < 2.0:
            return
        self.last_status = now
        st = self._coordinator_status()
        if st is None:
            return
        state = {f"r{w['replica']}s{w['stage']}": w["state"] for w in st.get("workers", [])}
        for name in run.worker_slots():
            slot = run.slots[name]
            info = jobs.get(slot.job_id) if slot.job_id is not None else None
            if info is None or info.state != "RUNNING" or state.get(name) in ("alive", "joining", "done"):
                self.unhealthy_since.pop(name, None)
                continue
            since = self.unhealthy_since.setdefault(name, now)
            if now - since >= run.stuck_after and now - (slot.started or now) >= run.stuck_after:
                self.say(f"{name}: job {slot.job_id} running but the slot is {state.get(name)} for "
                         f"{now - since:.0f}s: cancelling it")
                append_event(run.run_dir, {"event": "slurm_stuck", "slot": name, "job_id": slot.job_id,
                                           "worker_state": state.get(name)})
                scancel([slot.job_id])
                self.unhealthy_since.pop(name, None)

    def all_ended(self) -> bool:
        return all(s.job_id is None for s in self.run.slots.values())

    def loop(self) -> int:
        lock = open(os.path.join(self.run.dir, "supervisor.lock"), "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"crucible slurm: a supervisor already runs for {self.run.run_dir}", file=sys.stderr)
            return 1
        with open(os.path.join(self.run.dir, "supervisor.pid"), "w") as f:
            f.write(f"{os.getpid()}\n")
        stop = {"now": False}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: stop.update(now=True))
        self.say(f"supervising {len(self.run.slots)} slots of {self.run.run_dir} (pid {os.getpid()})")
        errors = 0
        while not stop["now"]:
            try:
                self.tick()
                errors = 0
            except SlurmError as e:   # slotctld down for a moment: try again, say it once in a while
                errors += 1
                if errors in (1, 10) or errors % 100 == 0:
                    self.say(f"{e} (try {errors})")
            if self.stopping():
                self.say("stop requested (crucible slurm down): not resubmitting anything")
                break
            if self.finished and self.all_ended():
                self.say("the job finished and every job has ended")
                break
            time.sleep(self.run.poll)
        self.run.metrics_offset = self.offset
        self.run.save()
        return 0


def supervisor_alive(run: SlurmRun) -> int | None:
    """The pid of the run's supervisor when one holds its lock, else None."""
    path = os.path.join(run.dir, "supervisor.lock")
    if not os.path.exists(path):
        return None
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                with open(os.path.join(run.dir, "supervisor.pid")) as p:
                    return int(p.read().strip() or 0) or -1
            except (OSError, ValueError):
                return -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


# ---- commands -------------------------------------------------------------------------------------

def _refuse_if_up(run_dir: str, shown: str) -> None:
    if not os.path.exists(os.path.join(run_dir, "slurm", "state.json")):
        return
    old = SlurmRun.load(run_dir)
    pid = supervisor_alive(old)
    active = [j for j in query_jobs(old.names()).values() if j.active]
    if pid or active:
        # (jobs without a supervisor: its host rebooted, it was killed; supervising them again is what goes on)
        again = "" if pid else f"`crucible slurm supervise --run-dir {shlex.quote(shown)}` to go on with it, or "
        raise SystemExit(f"crucible slurm: {run_dir} is up already ({len(active)} jobs in the queue, "
                         f"supervisor {pid or 'not running'}): {again}"
                         f"`crucible slurm down --run-dir {shlex.quote(shown)}` first")


def _prepare_run_dir(run_dir: str, resume: bool) -> None:
    """Folders, the token (kept on --resume), no stale address or stop file."""
    from crucible import rpc

    os.makedirs(os.path.join(run_dir, "logs", "slurm"), exist_ok=True)
    os.makedirs(os.path.join(run_dir, "slurm"), exist_ok=True)
    token = rpc.read_token(run_dir) if resume else ""
    rpc.write_token(run_dir, token or rpc.new_token())
    for stale in ("coordinator.addr", os.path.join("slurm", "stop")):
        try:
            os.unlink(os.path.join(run_dir, stale))
        except FileNotFoundError:
            pass


def _sbatch_options(args) -> tuple[list[str], list[str], str]:
    """(sbatch options of every job, of worker jobs, the workers' device)."""
    sb = list(args.sbatch or [])
    for opt, val in (("--partition", args.partition), ("--account", args.account), ("--time", args.time),
                     ("--cpus-per-task", args.cpus_per_slot)):
        if val:
            sb.append(f"{opt}={val}")
    worker_sb = list(args.worker_sbatch or [])
    if args.gpus_per_slot:
        worker_sb.append(f"--gres=gpu:{args.gpus_per_slot}")
    return sb, worker_sb, args.device or ("cuda:0" if args.gpus_per_slot else "cpu")


def _new_run(args, run_dir: str, cfg, config: str, overrides: list[str]) -> "SlurmRun":
    sb, worker_sb, device = _sbatch_options(args)
    try:
        offset = os.path.getsize(os.path.join(run_dir, "metrics.jsonl"))
    except OSError:
        offset = 0
    return SlurmRun(run_dir=run_dir, run_id=secrets.token_hex(3), python=args.python or sys.executable,
                    replicas=cfg.job.replicas, stages=cfg.job.stages, config=config, overrides=overrides,
                    resume=bool(args.resume), sbatch=sb, coordinator_sbatch=list(args.coordinator_sbatch or []),
                    worker_sbatch=worker_sb, device=device, port=args.port, resubmit_delay=args.resubmit_delay,
                    max_delay=args.max_delay, healthy_after=args.healthy_after, stuck_after=args.stuck_after,
                    poll=args.poll, preemption_timeout=cfg.checkpoint.preemption_timeout_s,
                    metrics_offset=offset, metrics_start=offset, created=time.time(),
                    slots={s: Slot(s) for s in slot_names(cfg.job.replicas, cfg.job.stages)})


def cmd_up(args) -> int:
    from crucible.config import Config

    run_dir = os.path.abspath(args.run_dir)
    overrides = list(args.overrides)
    for key, val in (("job.replicas", args.replicas), ("job.stages", args.stages), ("train.steps", args.steps)):
        if val is not None:
            overrides.append(f"{key}={val}")
    config = os.path.abspath(args.config) if args.config else ""
    cfg = Config.load(config or None, overrides)   # a bad key fails here, named
    if cfg.job.mps == "on":
        raise exits.UsageError("slurm up: job.mps=on is for crucible launch on one machine; under Slurm "
                         "ask the site's MPS for the slots (--worker-sbatch=--gres=mps:N) and leave job.mps off")
    _refuse_if_up(run_dir, args.run_dir)
    _prepare_run_dir(run_dir, args.resume)
    run = _new_run(args, run_dir, cfg, config, overrides)
    os.makedirs(run.dir, exist_ok=True)
    write_scripts(run)
    run.save()
    submitted = []
    try:
        for slot in run.slots.values():
            submitted.append(submit(run, slot, start="resume" if run.resume else "fresh"))
    except SlurmError as e:
        if not submitted:
            # (no job of this run exists: no state that `slurm status` would show as jobs about to be submitted)
            os.unlink(run.state_path)
            raise SystemExit(f"crucible slurm up: {e} (no job was submitted)") from None
        scancel(submitted)
        raise SystemExit(f"crucible slurm up: {e} (cancelled the {len(submitted)} jobs submitted)") from None
    print(f"crucible slurm: run {run.run_id} in {run_dir}: coordinator job {submitted[0]}, "
          f"{len(submitted) - 1} worker slot jobs ({cfg.job.replicas} x {cfg.job.stages})", flush=True)
    # Slurm takes a job that asks for more than the partition has and leaves it pending for ever (the
    # supervisor waited with it, saying nothing); the same reasons can be passing (nodes down or drained):
    # said at once, nothing cancelled
    try:
        never = [j for j in query_jobs(run.names()).values() if j.never_starts]
    except SlurmError:
        never = []        # (the supervisor says it at its next look)
    if never:
        j = min(never, key=lambda j: j.job_id)
        print(f"crucible slurm: job {j.job_id} ({j.name}) may never start as asked: pending for {j.reason} (it "
              f"{j.never_starts}, or the nodes it needs are down); `crucible slurm down --run-dir "
              f"{shlex.quote(args.run_dir)}`, then `up` with other options, unless that passes", file=sys.stderr,
              flush=True)
    if args.foreground:     # (the jobs said above are not said again)
        return Supervisor(run, told={j.job_id for j in never}).loop()
    sup_log = os.path.join(run_dir, "logs", "slurm-supervisor.log")
    with open(sup_log, "ab") as out:
        p = subprocess.Popen([sys.executable, "-m", "crucible", "slurm", "supervise", "--run-dir", run_dir],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True)
    q = shlex.quote(args.run_dir)
    print(f"crucible slurm: supervisor pid {p.pid} (log {sup_log}); `crucible slurm status --run-dir "
          f"{q}`, `crucible slurm down --run-dir {q}`", flush=True)
    return 0


def cmd_supervise(args) -> int:
    logging.basicConfig(level=os.environ.get("CRUCIBLE_LOG", "INFO"),
                        format="%(asctime)s slurm-supervisor %(levelname)s %(name)s: %(message)s")
    return Supervisor(SlurmRun.load(args.run_dir)).loop()


def collect_status(run: SlurmRun) -> dict:
    from crucible import rpc
    from crucible.status import StatusClient

    jobs = query_jobs(run.names())
    job_status, addr = None, None
    try:
        with open(os.path.join(run.run_dir, "coordinator.addr")) as f:
            addr = f.read().strip()
        job_status = StatusClient(addr, rpc.read_token(run.run_dir)).get(timeout=2.0)
    except OSError:
        pass
    wstate = {f"r{w['replica']}s{w['stage']}": w for w in (job_status or {}).get("workers", [])}
    now = time.time()
    slots = []
    for name, slot in run.slots.items():
        info = jobs.get(slot.job_id) if slot.job_id is not None else None
        w = wstate.get(name) or {}
        slots.append({"slot": name, "job_id": slot.job_id,
                      "state": info.state if info else ("WAITING" if slot.job_id is None else "GONE"),
                      "node": (info.node if info else "") or slot.node, "reason": info.reason if info else "",
                      "submits": slot.submits, "failures": slot.failures,
                      "resubmit_in_s": round(max(0.0, slot.next_submit - now), 1) if slot.job_id is None else None,
                      "last_end": slot.last_state or None, "worker_state": w.get("state"), "step": w.get("step")})
    return {"run_dir": run.run_dir, "run_id": run.run_id, "supervisor_pid": supervisor_alive(run),
            "stopping": os.path.exists(run.stop_path), "slots": slots, "coordinator_addr": addr, "job": job_status,
            "metrics_start": run.metrics_start}


def no_job_status(st: dict) -> str:
    """The line `slurm status` prints where the coordinator shows no job: none
    has started yet (no coordinator.addr), the job is over, or its
    coordinator does not answer; with the coordinator's Slurm job state."""
    coord = next((s for s in st["slots"] if s["slot"] == COORD), None)
    state = f" (its Slurm job {coord['job_id']}: {coord['state']})" if coord and coord["job_id"] else \
        " (its Slurm job not submitted yet)" if coord else ""
    if not st.get("coordinator_addr"):
        return f"no coordinator has started yet{state}"
    from crucible.status import Ends

    # only an end of this run's latest coordinator: not one written before `slurm up --resume`, nor one
    # before the latest coordinator_start (a coordinator started since, maybe being resubmitted now)
    ends = Ends(st.get("metrics_start", 0)).update(st["run_dir"])
    if ends.ended and (not coord or coord["state"] not in ("RUNNING", "PENDING", "CONFIGURING")):
        return f"the job is over ({ends.last['event']}); its coordinator has exited{state}"
    return f"the coordinator at {st['coordinator_addr']} does not answer{state}"


def cmd_status(args) -> int:
    from crucible.status import format_table

    st = collect_status(SlurmRun.load(args.run_dir))
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"run {st['run_id']} in {st['run_dir']}; supervisor "
          f"{'pid %s' % st['supervisor_pid'] if st['supervisor_pid'] else 'not running'}"
          f"{'; stopping' if st['stopping'] else ''}")
    print(f"{'slot':>11} {'job':>8} {'state':>11} {'node':>10} {'submits':>7} {'fails':>5}  worker")
    for s in st["slots"]:
        extra = s["worker_state"] or "-"
        if s["state"] == "PENDING" and s["reason"] not in ("", "None"):
            extra += f" (pending: {s['reason']})"
        if s["step"] is not None:
            extra += f" step {s['step']}"
        if s["resubmit_in_s"] is not None:
            when = f"in {s['resubmit_in_s']}s" if s["resubmit_in_s"] > 0 else "now"
            extra += f" (resubmit {when} after {s['last_end']})" if s["last_end"] else f" (to be submitted {when})"
        print(f"{s['slot']:>11} {s['job_id'] or '-':>8} {s['state']:>11} {s['node'] or '-':>10} "
              f"{s['submits']:>7} {s['failures']:>5}  {extra}")
    print(format_table(st["job"]) if st["job"] else no_job_status(st))
    return 0


def _wait(pred, timeout: float, interval: float = 0.5) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def down(run: SlurmRun, final_checkpoint: bool = True, timeout: float | None = None, say=print) -> dict:
    """Stop the supervisor, take a final checkpoint (SIGINT to the coordinator's
    job), cancel every job of the run; returns what happened. Where slurmctld
    does not answer, SlurmError before anything is stopped: the supervisor
    still runs (no stop file), and the jobs it supervises with it."""
    query_jobs(run.names())
    t0 = time.time()
    with open(run.stop_path, "w") as f:
        f.write(f"{t0}\n")
    pid = supervisor_alive(run)
    if pid and pid > 0:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass   # on another host: it sees the stop file
    _wait(lambda: supervisor_alive(run) is None, 15.0, 0.1)
    result = {"final_checkpoint": None, "coordinator_exit": None}
    jobs = query_jobs(run.names())
    coord = [j for j in jobs.values() if j.name == run.job_name(COORD) and j.state == "RUNNING"]
    if final_checkpoint and coord:
        say(f"crucible slurm: asking the coordinator (job {coord[0].job_id}) for a final checkpoint")
        scancel([coord[0].job_id], signal_name="INT", batch=True)
        limit = timeout if timeout is not None else run.preemption_timeout + 30.0

        def coord_gone() -> bool:
            j = query_jobs([run.job_name(COORD)]).get(coord[0].job_id)
            return j is None or not j.active
        if not _wait(coord_gone, limit):
            say(f"crucible slurm: the coordinator did not exit in {limit:.0f}s; cancelling everything")
        j = query_jobs([run.job_name(COORD)]).get(coord[0].job_id)
        result["coordinator_exit"] = j.exit_code if j else None
        commits = [e for e in each(run.run_dir, ("ckpt_commit",)) if e.get("time", 0) >= t0]
        if commits:
            result["final_checkpoint"] = commits[-1].get("step")
    elif final_checkpoint:
        say("crucible slurm: no coordinator job is running: no final checkpoint")
        # The coordinator told the workers to stop: let their jobs end by themselves.
        _wait(lambda: not any(j.active for j in query_jobs(run.names()).values()), 10.0)
    active = [j.job_id for j in query_jobs(run.names()).values() if j.active]
    if active:
        scancel(active)
    left = lambda: [j.job_id for j in query_jobs(run.names()).values() if j.active]   # noqa: E731
    if not _wait(lambda: not left(), 30.0):
        scancel(left(), signal_name="KILL")
        _wait(lambda: not left(), 30.0)
    result["jobs_left"] = len(left())
    result["seconds"] = round(time.time() - t0, 3)
    append_event(run.run_dir, {"event": "slurm_down", **result})
    return result


def cmd_down(args) -> int:
    run = SlurmRun.load(args.run_dir)
    res = down(run, final_checkpoint=not args.now, timeout=args.timeout)
    if res["final_checkpoint"] is not None:
        print(f"crucible slurm: final checkpoint at step {res['final_checkpoint']}")
    print(f"crucible slurm: down in {res['seconds']:.1f}s; {res['jobs_left']} jobs left")
    return 0 if res["jobs_left"] == 0 else 1


def add_parser(sub) -> None:
    p = sub.add_parser("slurm", help="run the job on a Slurm cluster: one job per worker slot, supervised")
    ss = p.add_subparsers(dest="slurm_cmd", required=True)
    u = ss.add_parser("up", help="submit the coordinator and one job per worker slot, start the supervisor")
    u.add_argument("--run-dir", required=True, help="run directory on storage shared by every node")
    u.add_argument("--config", help="TOML file with the job's configuration")
    u.add_argument("--replicas", type=int)
    u.add_argument("--stages", type=int)
    u.add_argument("--steps", type=int)
    u.add_argument("--resume", action="store_true", help="continue from the run's latest committed checkpoint")
    u.add_argument("--sbatch", action="append", metavar="OPT",
                   help="an sbatch option for every job, e.g. --sbatch=--qos=high (repeatable)")
    u.add_argument("--coordinator-sbatch", action="append", metavar="OPT", help="an sbatch option for the coordinator")
    u.add_argument("--worker-sbatch", action="append", metavar="OPT", help="an sbatch option for every worker slot")
    u.add_argument("--partition")
    u.add_argument("--account")
    u.add_argument("--time", help="time limit of each job (sbatch --time)")
    u.add_argument("--cpus-per-slot", type=int)
    u.add_argument("--gpus-per-slot", type=int, help="GPUs per worker slot (--gres=gpu:N; workers use cuda:0)")
    u.add_argument("--device", help="worker device (default cpu, or cuda:0 with --gpus-per-slot)")
    u.add_argument("--python", help="Python on the compute nodes (default: this one)")
    u.add_argument("--port", type=int, default=0, help="coordinator port (0 = any free one on its node)")
    u.add_argument("--resubmit-delay", type=float, default=1.0, help="seconds before a slot is resubmitted")
    u.add_argument("--max-delay", type=float, default=300.0, help="longest back-off of a slot that keeps failing")
    u.add_argument("--healthy-after", type=float, default=60.0,
                   help="a job that ran this long resets its slot's back-off")
    u.add_argument("--stuck-after", type=float, default=120.0,
                   help="cancel a running worker job whose slot is not alive this long (0 = never)")
    u.add_argument("--poll", type=float, default=0.5, help="seconds between two looks at the queue")
    u.add_argument("--foreground", action="store_true", help="supervise in this process instead of the background")
    u.add_argument("overrides", nargs="*", metavar="key=value")
    u.set_defaults(func=cmd_up)
    s = ss.add_parser("supervise", help="resubmit slots whose job ended (up starts one in the background)")
    s.add_argument("--run-dir", required=True)
    s.set_defaults(func=cmd_supervise)
    s = ss.add_parser("status", help="each slot's job, state and node, and the job's own status")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    d = ss.add_parser("down", help="a final checkpoint, then cancel every job of the run")
    d.add_argument("--run-dir", required=True)
    d.add_argument("--now", action="store_true", help="no final checkpoint: cancel at once")
    d.add_argument("--timeout", type=float, help="longest wait for the final checkpoint (default: "
                                                  "checkpoint.preemption_timeout_s + 30)")
    d.set_defaults(func=cmd_down)

