"""`crucible bench soak --minutes N`: every fault the project handles, at random,
for N minutes, on a machine kept busy by a CPU stressor.

The job: ``crucible launch`` of 2 replicas x 4 stages (the chaos benchmark's
small model), continuous checkpointing at most every 5 s, SparseLoCo outer
rounds every 5 steps (``--outer diloco`` for the dense baseline), held-out
evaluation every 20 steps, default fault timeouts, ``--respawn-delay 1``.
Next to it, ``--stress`` spinning processes (default: one per core).

Faults, one every ``--gap`` seconds on average (exponential gaps, seeded),
each kind equally likely:

* ``kill``: SIGKILL of a random worker (any stage);
* ``stop``: SIGSTOP of a random worker for 4 s, then SIGCONT (it is declared
  dead while stopped and comes back as a replacement);
* ``coordinator``: SIGKILL of the coordinator (the launcher restarts it);
* ``persister``: SIGKILL of a random worker's checkpoint persister process;
* ``in_round``: SIGKILL of a worker of a replica that just reached an outer
  round's step (inside the exchange);
* ``in_save``: SIGKILL of a random worker while a checkpoint save is open.

A worker fault (kill, stop, in_round, in_save) is drawn among the
registered workers whose stage has another live copy (in a training or a
paused replica): a fault that would take a stage's *last* copy is not
injected (``last_copy_spared`` counts them). That loss is rebuilt from the
latest checkpoint and the outer rounds kept since, or, when those are gone,
rolled back (tests/test_replacement_checkpoint.py); with no checkpoint yet it
is lost outright, which a soak must not draw at random.
An ``in_round`` fault waits at most ``ROUND_WAIT_S`` for a replica to cross
a round's step (``in_round_not_reached`` counts the ones given up).

Then a failure-free run of the same job to the step the soak reached gives
the reference held-out loss (at the last evaluation step both reached).

Measures (the JSON's ``definitions`` say the same):

* ``injected`` / ``detected`` per kind. Detected: a worker's kill or stop by
  its ``fault`` event (same pid) within 30 s; a coordinator's by the next
  ``coordinator_start``; a persister's by its worker's next
  ``ckpt_shard_failed``, ``ckpt_persister`` (a new persister) or ``ckpt_error``
  event, or by no save failing silently (a commit needs every shard).
* ``false_evictions``: ``fault`` events of a pid the soak did not kill or stop.
* ``longest_without_commit_s``: the longest gap between committed steps of
  the job (any replica).
* ``commits_lost``: committed steps committed again later (a roll-back).
* ``checkpoints``: committed during the soak, still on disk, and how many of
  those fail ``crucible ckpt verify``.
* ``processes_left``: processes of the launch's session still alive after the
  launcher exited on SIGTERM (before the bench kills the group).
* ``coordinator_rss_mb``: the coordinator's resident memory, sampled every 5 s
  (per incarnation: a restart starts a new process); ``coordinator_rss``:
  per incarnation, after its first minute: the peak of the first half and of
  the second (growth = their difference), the slope in MB per minute.

``--kinds`` picks the fault kinds (default all). ``--kinds none`` is a
fault-free run that only watches memory (issue 10: a 10-minute
``--outer diloco`` run keeps the coordinator's memory flat, at most
max(10 MB, 5%) more at the peak of the second half than at the peak of the
first, after its first minute), of the default job's model
(not the small one above); it is its own reference.

Targets over at least 200 injected faults: 0 false evictions, 0 lost commits,
0 checkpoints failing verify, 0 processes left behind.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time

from crucible import procs
from crucible.bench import common
from crucible.config import Config
from crucible.kill import recorded_start, signal_if_ours
from crucible.bench.common import progress
from crucible.slots import slot_name, slot_of
from crucible.testing.stress import cpu_hogs, oversubscribe

KINDS = ("kill", "stop", "coordinator", "persister", "in_round", "in_save")
ROUND_WAIT_S = 20.0   # an in_round fault waits this long for a replica to reach a round
RSS_SLACK_MB, RSS_SLACK = 10.0, 0.05   # "flat": the later peak above the earlier by at most this
MODEL = ["model.n_layer=4", "model.d_model=64", "model.n_head=4", "train.seq_len=64", "train.batch_size=16",
         "train.microbatches=4", "train.eval_every=20", "train.eval_batches=4", "data.max_bytes=8000000",
         "checkpoint.minimum_interval_s=5", "outer.H=5", "train.warmup_steps=20"]
QUICK_MODEL = ["model.n_layer=4", "model.d_model=32", "model.n_head=2", "train.seq_len=32", "train.batch_size=8",
               "train.microbatches=4", "train.eval_every=10", "train.eval_batches=2", "data.max_bytes=2000000",
               "checkpoint.minimum_interval_s=2", "outer.H=3"]
DEFINITIONS = {
    "injected": "faults sent, per kind",
    "detected": "a worker kill/stop: its fault event (same pid) within 30 s; a coordinator kill: the next "
                "coordinator_start; a persister kill: its worker's next ckpt_shard_failed / ckpt_persister / "
                "ckpt_error event within 60 s",
    "false_evictions": "fault events of a pid the soak did not kill or stop",
    "longest_without_commit_s": "longest gap between committed steps of the job (any replica)",
    "commits_lost": "committed steps committed again later (a roll-back to a checkpoint)",
    "checkpoints_failing_verify": "committed checkpoints on disk at the end that `crucible ckpt verify` rejects",
    "processes_left": "processes of the launch's session alive after the launcher exited on SIGTERM",
    "last_copy_spared": "worker faults not injected because the target held its stage's last live copy",
    "in_round_not_reached": "in_round faults given up: no replica crossed a round's step within 20 s",
    "heldout_delta": "soak held-out loss / failure-free held-out loss - 1, at the last evaluation step both reached",
}


def _sessions_members(sid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


class Soak:
    def __init__(self, run_dir: str, overrides: list[str], seed: int, gap_s: float, kinds: tuple[str, ...] = KINDS):
        self.run_dir = run_dir
        self.launch = common.Launch(run_dir, 2, 4, 1_000_000, overrides + ["--respawn-delay", "1"])
        self.rng = random.Random(seed)
        self.gap_s = gap_s
        self.kinds = kinds
        self.injected: list[dict] = []
        self.rss: list[dict] = []
        self.stopped: dict[int, float] = {}       # pid -> when to SIGCONT
        self._stopped_as: dict[int, tuple[str, int | None]] = {}   # pid -> (name, start ticks) it was stopped as
        self.last_steps: dict[int, int] = {}
        self.signalled: set[int] = set()    # pids we killed or stopped
        self._tail = common.EventTail(os.path.join(run_dir, "metrics.jsonl"))
        self._pers: dict[str, tuple[int, int | None]] = {}   # slot -> its persister's (pid, start ticks)
        self.last_copy_spared = 0      # faults not drawn: they would have taken a stage's last live copy
        self.armed_at = 0.0
        self.rounds_missed = 0         # in_round faults given up: no round reached within ROUND_WAIT_S

    def _status(self) -> dict | None:
        from crucible.status import StatusClient, resolve

        try:
            addr, token = resolve(self.run_dir, None)
        except SystemExit:
            return None
        if getattr(self, "_client_addr", None) != addr:
            self._client, self._client_addr = StatusClient(addr, token), addr
        return self._client.get(timeout=1.0)

    def _workers(self) -> dict[str, int]:
        return {n: p for n, p in self.launch.pids().items() if n.startswith("r") and isinstance(p, int)}

    def _persisters(self) -> dict[str, int]:
        """Each slot's live persister (from the new lines of metrics.jsonl),
        with the start time its pid had when the line was read (the event
        records none): a later process given that pid is not taken for it."""
        for ev in self._tail.new(b"ckpt_persister"):
            try:
                self._pers[slot_name(ev["replica"], ev["stage"])] = (ev["pid"], procs.start_ticks(ev["pid"]))
            except (KeyError, TypeError):
                pass
        return {n: pid for n, (pid, start) in self._pers.items()
                if start is not None and procs.start_ticks(pid) == start}

    def _signal(self, kind: str, target: str, pid: int, sig: int, start: int | None = None) -> None:
        """Signal `target` only while `pid` is still that process: a pid read
        from pids.json (or a persister's event) may since have been given to
        another process, here or anywhere on the machine. The check is
        `crucible kill`'s: the start time the launcher recorded with the pid
        (`start`, a persister's: the one seen with its event), else the
        command line. A pid that fails it is skipped, not counted."""
        if start is None:
            start = recorded_start(self.run_dir, target, pid)
        if signal_if_ours(target, pid, start, sig) is not None:
            return
        self.injected.append({"kind": kind, "target": target, "pid": pid, "time": time.time()})
        self.signalled.add(pid)
        if sig == signal.SIGSTOP:
            self.stopped[pid] = time.monotonic() + 4.0
            self._stopped_as[pid] = (target, start)

    def _cont(self, pid: int) -> None:
        """SIGCONT a worker we stopped, checked as it was when stopped."""
        self.stopped.pop(pid, None)
        name, start = self._stopped_as.pop(pid, ("", None))
        if name:
            signal_if_ours(name, pid, start, signal.SIGCONT)

    def _killable(self, st: dict | None) -> dict[str, int]:
        """Workers whose loss a replacement can make good from a live peer:
        another replica holds the same stage in a live worker (not joining,
        not stopped by us; training or paused). A stage's last copy is rebuilt
        from a checkpoint and the outer rounds kept since, or rolled back when
        those are gone: not drawn here (counted in ``last_copy_spared``);
        tests/test_replacement_checkpoint.py covers it."""
        workers = {n: p for n, p in self._workers().items() if p not in self.stopped and p not in self.signalled}
        if not st:
            return {}
        live = {(w["replica"], w["stage"]) for w in st.get("workers", [])        # (not yet seen dead: skip ours)
                if w["state"] == "alive" and w.get("pid") not in self.stopped and w.get("pid") not in self.signalled}
        # A peer a replacement can pull from (Links.peers): alive, in its replica's route.
        serving = {(rep["id"], stage) for rep in st.get("replicas", []) for stage in rep["route"]}
        members = {w.get("pid") for w in st.get("workers", []) if w["state"] in ("alive", "joining")}
        out = {}
        for name, pid in workers.items():
            if pid not in members:
                continue        # still starting (not registered): not a member yet, nothing to detect
            r, stage = slot_of(name)
            if any(o != r and (o, s_) in serving for o, s_ in live if s_ == stage):
                out[name] = pid
        return out

    def inject(self, kind: str, st: dict | None) -> bool:
        workers = self._killable(st)
        if kind in ("kill", "stop", "in_save") and not workers:
            self.last_copy_spared += 1
            return False
        if kind in ("kill", "stop") and workers:
            name = self.rng.choice(sorted(workers))
            self._signal(kind, name, workers[name], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        elif kind == "coordinator":
            pid = self.launch.pids().get("coordinator")
            if not isinstance(pid, int):
                return False
            self._signal(kind, "coordinator", pid, signal.SIGKILL)
        elif kind == "persister":
            pers = self._persisters()
            if not pers:
                return False
            name = self.rng.choice(sorted(pers))
            self._signal(kind, name, pers[name], signal.SIGKILL, start=self._pers[name][1])
        elif kind == "in_save":
            if not st or st["checkpoint"].get("pending_step") is None or not workers:
                return False
            name = self.rng.choice(sorted(workers))
            self._signal(kind, name, workers[name], signal.SIGKILL)
        elif kind == "in_round":
            return False        # fired by watch_rounds when a replica reaches a round's step
        else:
            return False
        return True

    def watch_rounds(self, st: dict | None, H: int, armed: bool) -> bool:
        """A replica just committed a round's step: kill one of its workers
        (inside the exchange), never the last live copy of its stage."""
        if not st:
            return False
        fired = False
        for rep in st["replicas"]:
            step, before = rep["step"], self.last_steps.get(rep["id"], rep["step"])
            self.last_steps[rep["id"]] = step
            # Crossed a round's step since the last look (every 0.1-1 s): its workers
            # are in the exchange, or just past it.
            if armed and not fired and step // H > before // H and rep["route"]:
                workers = self._killable(st)
                names = [slot_name(rep["id"], s) for s in rep["route"] if slot_name(rep["id"], s) in workers]
                if names:
                    name = self.rng.choice(names)
                    self._signal("in_round", name, workers[name], signal.SIGKILL)
                    fired = True
        return fired

    def run(self, seconds: float, H: int, startup_s: float) -> None:
        t_start = time.monotonic()
        while not self.launch.events("route_change") or not any(
                all(v == "training" for v in (e.get("states") or {}).values())
                for e in self.launch.events("route_change")):
            if time.monotonic() - t_start > startup_s:
                raise RuntimeError(f"no training {startup_s:.0f}s after the launch")
            if self.launch.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited with {self.launch.proc.returncode} before training")
            time.sleep(0.5)
        progress(f"training; injecting faults for {seconds:.0f}s")
        t0 = time.monotonic()
        next_fault = t0 + self.rng.expovariate(1.0 / self.gap_s)
        want_round = False
        last_rss = 0.0
        while time.monotonic() - t0 < seconds:
            if self.launch.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited with {self.launch.proc.returncode} during the soak")
            now = time.monotonic()
            for pid, t in list(self.stopped.items()):
                if now >= t:
                    self._cont(pid)
            st = self._status()
            if self.watch_rounds(st, H, want_round):
                want_round = False
            elif want_round and now - self.armed_at > ROUND_WAIT_S:
                want_round = False          # no replica reached a round meanwhile: draw again
                self.rounds_missed += 1
            if now >= next_fault and self.kinds:    # (an armed in_round waits beside the others)
                kind = self.rng.choice(self.kinds)
                if kind == "in_round":
                    if not want_round:        # (one armed at a time; else draw again)
                        want_round, self.armed_at = True, now
                        next_fault = now + self.rng.expovariate(1.0 / self.gap_s)
                elif self.inject(kind, st):
                    next_fault = now + self.rng.expovariate(1.0 / self.gap_s)
            if now - last_rss >= 5.0:
                last_rss = now
                pid = self.launch.pids().get("coordinator")
                if isinstance(pid, int):
                    self.rss.append({"t": round(now - t0, 1), "pid": pid, "rss_mb": _rss_mb(pid)})
            if len(self.injected) and len(self.injected) % 25 == 0 and self.injected[-1].get("_said") is None:
                self.injected[-1]["_said"] = True
                progress(f"{len(self.injected)} faults injected, {now - t0:.0f}s")
            time.sleep(0.1)
        for pid in list(self.stopped):
            self._cont(pid)

    def stop(self, grace: float = 90.0) -> int:
        """SIGTERM the launcher, wait for it; count what of its session outlived it."""
        proc = self.launch.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(1.0)
        left = [p for p in _sessions_members(self.launch.pgid) if p != proc.pid]
        self.launch.close()
        return len(left)


def analyze(events: list[dict], injected: list[dict]) -> dict:
    faults = [e for e in events if e.get("event") == "fault"]
    ours = {i["pid"] for i in injected if i["kind"] != "persister" and i["kind"] != "coordinator"}
    detected: dict[str, int] = {k: 0 for k in KINDS}
    for inj in injected:
        t, kind = inj["time"], inj["kind"]
        if kind == "coordinator":
            ok = any(e.get("event") == "coordinator_start" and t < e["time"] < t + 60 for e in events)
        elif kind == "persister":
            slot = inj["target"]
            ok = any(e.get("event") in ("ckpt_shard_failed", "ckpt_persister", "ckpt_error") and t < e["time"] < t + 60
                     and slot_name(e.get("replica", -1), e.get("stage", -1)) == slot for e in events)
        else:
            ok = any(e.get("pid") == inj["pid"] and t - 0.5 < e["time"] < t + 30 for e in faults)
        detected[kind] += bool(ok)
    false_evictions = [e for e in faults if e.get("pid") not in ours]
    steps = sorted(float(e["time"]) for e in events if e.get("event") == "step")
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    lost = 0
    best: dict[int, int] = {}
    for e in events:
        if e.get("event") == "step":
            r, s = e["replica"], int(e["step"])
            if s <= best.get(r, -1):
                lost += 1
            best[r] = max(best.get(r, -1), s)
    return {
        "injected": {k: sum(1 for i in injected if i["kind"] == k) for k in KINDS},
        "injected_total": len(injected),
        "detected": detected,
        "false_evictions": len(false_evictions),
        "false_eviction_events": false_evictions[:20],
        "longest_without_commit_s": max(gaps) if gaps else None,
        "commits_lost": lost,
        "steps_reached": {str(r): s + 1 for r, s in sorted(best.items())},
        "rollbacks": [e for e in events if e.get("event") == "job_rollback"],
        "checkpoints_committed": sum(1 for e in events if e.get("event") == "ckpt_commit"),
        "checkpoints_aborted": sum(1 for e in events if e.get("event") == "ckpt_abort"),
        "replacements": sum(1 for e in events if e.get("event") == "replacement_ready"),
    }


def verify_checkpoints(run_dir: str) -> dict:
    from crucible.checkpoint import store

    root = os.path.join(run_dir, "checkpoints")
    ckpts = store.list_checkpoints(root) if os.path.isdir(root) else []
    bad = {c.step: store.verify(c.path) for c in ckpts}
    return {"on_disk": len(ckpts), "failing_verify": sum(1 for p in bad.values() if p),
            "problems": {str(k): v for k, v in bad.items() if v}}


def heldout(events: list[dict]) -> dict[int, float]:
    """Mean held-out loss over the replicas at each evaluated step (the last evaluation of a step wins)."""
    per: dict[int, dict[int, float]] = {}
    for e in events:
        if e.get("event") == "eval":
            per.setdefault(int(e["step"]), {})[e["replica"]] = float(e["loss"])
    return {s: sum(v.values()) / len(v) for s, v in per.items() if len(v) == 2}


def reference_run(workdir: str, overrides: list[str], steps: int, timeout_s: float) -> dict:
    run_dir = os.path.join(workdir, "failure_free")
    progress(f"failure-free reference run to step {steps}")
    with common.Launch(run_dir, 2, 4, steps, overrides) as launch:
        code = launch.wait(timeout_s)
        return {"exit_code": code, "heldout": heldout(launch.events("eval"))}


def _kinds(spec: str | None) -> tuple[str, ...]:
    if not spec:
        return KINDS
    if spec.strip() == "none":
        return ()
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"crucible bench soak: unknown fault kind(s) {bad}; known: {', '.join(KINDS)}, or none")
    return kinds


def rss_summary(samples: list[dict]) -> dict:
    """The coordinator's memory over the run, per incarnation (pid): after its
    first minute, the peak of the first half against the peak of the second
    (RSS rises and falls with the rounds in flight, so a last-minus-first
    difference says little), and the least-squares slope in MB per minute."""
    out = {}
    for pid in dict.fromkeys(x["pid"] for x in samples):
        xs = [x for x in samples if x["pid"] == pid and x.get("rss_mb") is not None]
        if not xs:
            continue
        warm = [x for x in xs if x["t"] >= xs[0]["t"] + 60] or xs[-1:]
        half = len(warm) // 2
        first, second = warm[:max(1, half)], warm[half:]
        peak1, peak2 = max(x["rss_mb"] for x in first), max(x["rss_mb"] for x in second)
        n = len(warm)
        mt, mr = sum(x["t"] for x in warm) / n, sum(x["rss_mb"] for x in warm) / n
        var = sum((x["t"] - mt) ** 2 for x in warm)
        slope = sum((x["t"] - mt) * (x["rss_mb"] - mr) for x in warm) / var * 60 if var else 0.0
        out[str(pid)] = {"seconds": round(xs[-1]["t"] - xs[0]["t"], 1), "max_mb": max(x["rss_mb"] for x in xs),
                         "after_1min_mb": warm[0]["rss_mb"], "last_mb": xs[-1]["rss_mb"],
                         "peak_first_half_mb": peak1, "peak_second_half_mb": peak2,
                         "growth_after_1min_mb": round(peak2 - peak1, 1), "slope_mb_per_min": round(slope, 2)}
    return out


def main(args) -> int:
    common.exit_on_sigterm()
    quick = bool(getattr(args, "quick", False))
    minutes = float(getattr(args, "minutes", None) or (1.5 if quick else 15.0))
    gap = float(getattr(args, "gap", None) or (5.0 if quick else 3.0))
    seed = int(getattr(args, "seed", None) or 1)
    stress = getattr(args, "stress", None)
    stress = oversubscribe(1.0) if stress is None else int(stress)
    outer = getattr(args, "outer", None) or "sparseloco"
    kinds = _kinds(getattr(args, "kinds", None))
    # The memory run is about the default job (its closed DiLoCo rounds once kept 850 MB).
    model = QUICK_MODEL if quick else MODEL if kinds else []
    overrides = model + [f"outer.mode={outer}"]
    H = Config.load(None, {**dict(o.split("=", 1) for o in model), "job.stages": 4}).outer.H
    result: dict = {"bench": "soak", "quick": quick, "environment": common.environment(),
                    "settings": {"minutes": minutes, "mean_gap_s": gap, "seed": seed, "stress_processes": stress,
                                 "replicas": 2, "stages": 4, "overrides": overrides, "respawn_delay_s": 1.0,
                                 "kinds": list(kinds)},
                    "definitions": DEFINITIONS,
                    }
    errors: list[str] = []
    workdir = tempfile.mkdtemp(prefix="crucible-bench-soak-")
    soak = None
    try:
        with cpu_hogs(stress, max_seconds=minutes * 60 + 1800):
            soak = Soak(os.path.join(workdir, "soak"), overrides, seed, gap, kinds)
            try:
                soak.run(minutes * 60, H, startup_s=300)
            except RuntimeError as e:
                errors.append(str(e))
            left = soak.stop()
            events = soak.launch.events()
            res = analyze(events, soak.injected)
            res["processes_left"] = left
            res["checkpoints"] = verify_checkpoints(soak.run_dir)
            res["coordinator_rss_mb"] = soak.rss
            res["last_copy_spared"] = soak.last_copy_spared
            res["in_round_not_reached"] = soak.rounds_missed
            res["faults"] = [{k: v for k, v in i.items() if not k.startswith("_")} for i in soak.injected]
            result["soak"] = res
            reached = min(int(v) for v in res["steps_reached"].values()) if res["steps_reached"] else 0
            if not kinds:      # fault-free already: its own reference
                ref = {"heldout": heldout(events)}
            else:
                ref = reference_run(workdir, overrides, reached, timeout_s=minutes * 60 + 600)
        ours, theirs = heldout(events), ref["heldout"]
        common_steps = sorted(set(ours) & set(theirs))
        if common_steps:
            s = common_steps[-1]
            result["heldout"] = {"step": s, "soak": ours[s], "failure_free": theirs[s],
                                 "delta": ours[s] / theirs[s] - 1.0}
        else:
            errors.append("no evaluation step reached by both runs")
        res = result["soak"]
        result["coordinator_rss"] = rss_summary(res["coordinator_rss_mb"])
        result["targets"] = {
            "no_false_evictions": res["false_evictions"] == 0,
            "no_lost_commits": res["commits_lost"] == 0,
            "no_checkpoint_failing_verify": res["checkpoints"]["failing_verify"] == 0,
            "no_process_left": res["processes_left"] == 0,
        }
        if kinds:
            result["targets"]["faults_at_least_200"] = res["injected_total"] >= 200
        else:     # the fault-free run is about memory: flat after its first minute
            result["targets"]["coordinator_memory_flat"] = all(
                x["growth_after_1min_mb"] <= max(RSS_SLACK_MB, RSS_SLACK * x["peak_first_half_mb"])
                for x in result["coordinator_rss"].values()) and bool(result["coordinator_rss"])
    except Exception as e:  # noqa: BLE001 - a benchmark reports what failed, in its JSON
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        if soak is not None:
            soak.launch.close()
        if errors or os.environ.get("CRUCIBLE_BENCH_KEEP"):
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return common.finish(result, errors, args, round_nd=4)
