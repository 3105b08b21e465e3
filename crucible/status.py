"""`crucible status`: the job at a glance, from the coordinator (no torch)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

import grpc

from crucible import rpc
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg


class StatusClient:
    def __init__(self, address: str, token: str):
        self.channel = rpc.make_channel(address)
        self.stub = pbg.CoordinatorStub(self.channel)
        self.md = rpc.metadata(token)
        self.refused = False          # the last call got UNAUTHENTICATED: it answers, but not to this token

    def get(self, timeout: float = 3.0) -> dict | None:
        try:
            st = json.loads(self.stub.Status(pb.StatusRequest(), metadata=self.md, timeout=timeout).json)
        except grpc.RpcError as e:
            self.refused = e.code() == grpc.StatusCode.UNAUTHENTICATED
            return None
        self.refused = False
        return st


def resolve(run_dir: str | None, coordinator: str | None) -> tuple[str, str]:
    if coordinator:
        return coordinator, rpc.read_token(run_dir)
    path = os.path.join(run_dir, "coordinator.addr")
    try:
        with open(path) as f:
            return f.read().strip(), rpc.read_token(run_dir)
    except OSError:
        # (the launcher removes it as it starts a coordinator, which writes it once it serves)
        raise SystemExit(starting(run_dir) or f"crucible status: no coordinator address in {path}: "
                                              f"is a job running there?") from None


class Ends:
    """What metrics.jsonl says of how the job ended, read on from where the
    last look stopped (for `status --watch`, which asks every second): the
    last of coordinator_start / job_done / job_stopped, the newest committed
    checkpoint's step, and a launcher's launch_start or job_restart logged
    after that last one (it is starting a coordinator: ``launch``)."""

    KINDS = ("job_done", "job_stopped", "coordinator_start", "ckpt_commit", "launch_start", "job_restart")

    def __init__(self, start: int = 0):
        self.start = start            # (bytes of the log before: an earlier run's, not read)
        self.offset = start
        self.last: dict = {}
        self.commit = None
        self.launch: dict = {}

    @property
    def ended(self) -> bool:
        """A job_done or job_stopped came after the latest coordinator_start."""
        return self.last.get("event") in ("job_done", "job_stopped")

    def update(self, run_dir: str) -> "Ends":
        from crucible import metrics

        if metrics.size(run_dir) < self.offset:          # (a new file: read it from the start)
            self.__init__()
        if self.offset == self.start and not self.last and not self.launch and self.commit is None:
            return self._first_look(run_dir)
        events, self.offset = metrics.follow(run_dir, self.KINDS, self.offset)
        for e in events:
            if e["event"] in ("launch_start", "job_restart"):
                self.launch = e
            elif e["event"] != "ckpt_commit":
                self.last, self.launch = e, {}
            elif metrics.whole(e.get("step")):
                self.commit = e.get("step")
        return self

    def _first_look(self, run_dir: str) -> "Ends":
        """What ``update`` finds reading the whole log, read from its end back
        only as far as it takes (``metrics.newest_first``: a long run's log is GBs;
        its end is at its end)."""
        from crucible import metrics

        self.offset, newest = metrics.newest_first(run_dir, self.KINDS, self.start)
        last = launch = None
        for e in newest:
            if e["event"] in ("launch_start", "job_restart"):
                if last is None and launch is None:
                    launch = e          # (the latest one, where no end or start came after it)
            elif e["event"] != "ckpt_commit":
                last = last or e
            elif self.commit is None and metrics.whole(e.get("step")):
                self.commit = e.get("step")
            if last is not None and self.commit is not None:
                break
        self.last, self.launch = last or {}, launch or {}
        return self


def starting(run_dir: str | None, ends: Ends | None = None) -> str | None:
    """The line for a run directory whose launcher is starting a coordinator
    (a new launch in its pre-flight, a coordinator not serving yet; or every
    process restarted from a checkpoint): a launch_start or job_restart after
    the log's latest coordinator_start, job_done or job_stopped, and a
    launcher alive to hold launch.lock. None otherwise: a launch that ended
    before its coordinator started leaves the previous job's end standing."""
    from crucible import files, metrics

    if not run_dir:
        return None
    launch = (ends or Ends()).update(run_dir).launch
    if not launch or not files.lock_held(os.path.join(run_dir, "launch.lock")):
        return None
    if launch["event"] == "job_restart":
        return f"crucible status: {run_dir}: restarting: no coordinator yet (the launcher restarts every process " \
               f"from the latest checkpoint)"
    pid = launch.get("pid")
    by = f"`crucible launch`{f' (pid {pid})' if metrics.whole(pid) else ''}"
    what = "a resume" if launch.get("resume") is True else "a job"
    return f"crucible status: {run_dir}: starting: no coordinator yet ({by} is starting {what} there)"


def no_answer(addr: str, run_dir: str | None, ends: Ends | None = None) -> str:
    """Why `status` has nothing to show. A launcher starting a coordinator
    says so (``starting``). The job has ended only where its
    metrics say so (a job_done or job_stopped after the latest
    coordinator_start) and nothing holds its ``coordinator.lock``; otherwise
    the coordinator does not answer, with the reason when TLS is it, and
    whether anything holds the lock (a coordinator being restarted holds none
    for a while, and on a filesystem whose flock is node-local the lock is
    free on every other node). ``ends``: what an earlier call read (--watch)."""
    from crucible import files, metrics

    def line() -> str:
        why = rpc.explain(addr)           # (a TLS handshake: only where the line says it)
        return f"crucible status: coordinator at {addr} does not answer{': ' + why if why else ''}"

    if not run_dir or files.lock_held(os.path.join(run_dir, "coordinator.lock")):
        return line()
    ends = ends or Ends()
    launching = starting(run_dir, ends)
    if launching:
        return launching
    last = ends.last
    q = shlex.quote(run_dir)          # (commands to paste: a run directory with a space stays one word)
    resume = (f"`crucible launch --run-dir {q} --resume` with the job's options goes on from its newest "
              f"checkpoint{f', step {ends.commit}' if ends.commit is not None else ''}; "
              f"`crucible ckpt list {q}` lists them")
    if last.get("event") == "job_done":
        steps = last.get("steps")      # (one per replica)
        steps = set(steps) if isinstance(steps, list) and steps and all(map(metrics.whole, steps)) else set()
        at = f" at step {steps.pop()}" if len(steps) == 1 else ""
        return f"crucible status: {run_dir}: the job finished{at}; its coordinator has exited " \
               f"(`crucible report {q}` shows the run)"
    if last.get("event") == "job_stopped":
        return f"crucible status: {run_dir}: the job was stopped{metrics.stopped_by(last)} before its last step " \
               f"({resume})"
    log = metrics.path_of(run_dir)
    try:
        open(log, "rb").close()
    except FileNotFoundError:
        pass
    except OSError as e:      # (another user's, mode 0600: a finished job was said to be restarting, or stopped)
        return f"{line()}; whether its job has ended is not known: cannot read {log}: {e.strerror or e} (run " \
               f"status as the job's owner)"
    return (f"{line()}; nothing holds its coordinator.lock: it may be restarting, or the job stopped before "
            f"the end ({resume})")


def refused(addr: str, run_dir: str | None) -> str:
    """Why a coordinator that answers refused our token: where the token came
    from ($CRUCIBLE_TOKEN first, else the run directory's token file), or why
    there was none (the file is its owner's alone, mode 0600). Not "does not
    answer": nothing is wrong with the job."""
    head = f"crucible status: coordinator at {addr} refused the token"
    if os.environ.get(rpc.TOKEN_ENV):
        instead = f" Unset it to use {os.path.join(run_dir, 'token')}" if run_dir else ""
        return f"{head} in ${rpc.TOKEN_ENV} (another job's?{instead})"
    if not run_dir:
        return f"{head}: none given (set ${rpc.TOKEN_ENV} to the job's token, or give --run-dir)"
    path = os.path.join(run_dir, "token")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        return f"{head}: none given: cannot read {path}: {e.strerror} (run status as the job's owner, or set " \
               f"${rpc.TOKEN_ENV} to the job's token)"
    return f"{head} in {path} (another job's?)"


def _fmt(v, spec=".3f", none="-"):
    return none if v is None else format(v, spec)


def format_progress(st: dict) -> str:
    parts = []
    for r in st["replicas"]:
        tps = r.get("tokens_per_s")
        parts.append(f"r{r['id']} {r['state']:<8} step {r['step']}/{st['steps_target']} "
                     f"loss {_fmt(r['loss'])} {_fmt(tps, '.0f')} tok/s")
    return " | ".join(parts)


def _device(w: dict) -> str:
    """cpu, or cuda:0 with its memory: allocated / peak / total MiB."""
    dev = w.get("device") or "-"
    if "mem_total_mb" in w:
        dev += (f" {w.get('mem_allocated_mb', 0):,}/{w.get('mem_peak_mb', 0):,}/{w['mem_total_mb']:,} MiB "
                "(alloc/peak/total)")
    return dev


def format_table(st: dict) -> str:
    lines = [f"run {st['run_dir']}  epoch {st['epoch']:#x}  elapsed {st['elapsed_s']:.0f}s  "
             f"latest checkpoint step {_fmt(st['checkpoint']['latest_committed_step'], 'd')}"]
    lines.append(f"{'replica':>7} {'state':>9} {'step':>7} {'loss':>7} {'eval':>7} {'tok/s':>8}  route")
    for r in st["replicas"]:
        lines.append(f"{r['id']:>7} {r['state']:>9} {r['step']:>7} {_fmt(r['loss']):>7} {_fmt(r.get('eval_loss')):>7} "
                     f"{_fmt(r.get('tokens_per_s'), '.0f'):>8}  {' -> '.join(map(str, r['route']))}")
    for r in st["replicas"]:
        links = [f"{b['from']}->{b['to']} {_fmt(b.get('down_mbps'), '.1f')}/{_fmt(b.get('up_mbps'), '.1f')}"
                 for b in r.get("links") or []]
        if links:
            lines.append(f"{'r%d' % r['id']:>7} links (Mbit/s down/up over a step): {'  '.join(links)}")
    lines.append(f"{'worker':>7} {'state':>9} {'pid':>7}  {'address':<21} device")
    for w in st["workers"]:
        lines.append(f"{'r%ds%d' % (w['replica'], w['stage']):>7} {w['state']:>9} {_fmt(w['pid'], 'd'):>7}  "
                     f"{w['address'] or '-':<21} {_device(w)}")
    return "\n".join(lines)


def main(args) -> int:
    addr, token = resolve(args.run_dir, args.coordinator)
    client = StatusClient(addr, token)
    ends = Ends()
    while True:
        st = client.get(timeout=3.0 if args.watch else 10.0)
        if st is None and client.refused:
            print(refused(addr, args.run_dir), file=sys.stderr, flush=True)
            return 1                  # (the same token is refused every time: no use watching)
        if st is None:
            print(no_answer(addr, args.run_dir, ends), file=sys.stderr, flush=True)
            if not args.watch:
                return 1
        elif args.json:
            print(json.dumps(st, indent=None if args.watch else 2), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            print(format_table(st), flush=True)
        if not args.watch:
            return 0
        time.sleep(1.0)
