"""`crucible status`: the job at a glance, from the coordinator (no torch)."""

from __future__ import annotations

import json
import os
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

    def get(self, timeout: float = 3.0) -> dict | None:
        try:
            return json.loads(self.stub.Status(pb.StatusRequest(), metadata=self.md, timeout=timeout).json)
        except grpc.RpcError:
            return None


def resolve(run_dir: str | None, coordinator: str | None) -> tuple[str, str]:
    if coordinator:
        return coordinator, rpc.read_token(run_dir)
    path = os.path.join(run_dir, "coordinator.addr")
    try:
        with open(path) as f:
            return f.read().strip(), rpc.read_token(run_dir)
    except OSError:
        raise SystemExit(f"crucible status: no coordinator address in {path}: is a job running there?") from None


def no_answer(addr: str, run_dir: str | None) -> str:
    """Why `status` has nothing to show: a run directory whose coordinator is
    gone (nothing holds its ``coordinator.lock``) is a job that has ended, and
    its metrics say how; otherwise the coordinator does not answer (with the
    reason when TLS is it)."""
    from crucible import files, metrics

    if run_dir and not files.lock_held(os.path.join(run_dir, "coordinator.lock")):
        ends, _ = metrics.follow(run_dir, ("job_done", "job_stopped", "coordinator_start", "ckpt_commit"), 0)
        commits = [e.get("step") for e in ends if e["event"] == "ckpt_commit" and metrics.whole(e.get("step"))]
        ends = [e for e in ends if e["event"] != "ckpt_commit"]
        last = ends[-1] if ends else {}
        resume = (f"`crucible launch --run-dir {run_dir} --resume` with the job's options goes on from its newest "
                  f"checkpoint{f', step {commits[-1]}' if commits else ''}; `crucible ckpt list {run_dir}` lists them")
        if last.get("event") == "job_done":
            steps = last.get("steps")      # (one per replica)
            steps = set(steps) if isinstance(steps, list) and steps and all(map(metrics.whole, steps)) else set()
            at = f" at step {steps.pop()}" if len(steps) == 1 else ""
            how = f"the job finished{at}; its coordinator has exited (`crucible report {run_dir}` shows the run)"
        elif last.get("event") == "job_stopped":
            sig = last.get("signal")
            by = f" by {sig}" if isinstance(sig, str) else ""
            how = f"the job was stopped{by} before its last step ({resume})"
        else:
            how = f"no job is running there (nothing holds its coordinator.lock): it stopped before the end ({resume})"
        return f"crucible status: {run_dir}: {how}"
    why = rpc.explain(addr)
    return f"crucible status: coordinator at {addr} does not answer{': ' + why if why else ''}"


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
    while True:
        st = client.get(timeout=3.0 if args.watch else 10.0)
        if st is None:
            print(no_answer(addr, args.run_dir), file=sys.stderr, flush=True)
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
