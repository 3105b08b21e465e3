"""`crucible ckpt (list | verify | inspect) D` and `crucible interval` (no torch).

D is a run directory, its ``checkpoints/`` directory, or (``verify`` and
``inspect``) one checkpoint ``step_<N>``.

* ``list``     the committed checkpoints (only directories with a manifest;
               saves in progress or interrupted are counted apart, never listed);
* ``verify``   re-reads every byte of every shard and checks its size and
               SHA-256 against the manifest; exit 0 when all are good, 1 when
               one is damaged (or none exists); says which one a resume would use;
* ``inspect``  the manifest (replicas' steps and rounds, topology, vacant
               slots, config hash, timings) and each shard's contents (from its
               header, without loading it), of the newest checkpoint or the one given.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from crucible import exits
from crucible.checkpoint import shard, store

_STEP = re.compile(r"^step_(\d+)$")


def _resolve(d: str) -> tuple[Path, Path | None]:
    """(checkpoint root, one checkpoint or None)."""
    p = Path(d)
    if not p.exists():
        raise exits.UsageError(f"{d}: no such directory")
    if not p.is_dir():
        raise exits.UsageError(f"{d}: not a directory (give a run directory, its checkpoints/ or one step_<N>)")
    if (p / store.MANIFEST).exists() or _STEP.match(p.name):
        return p.parent, p
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    return p, None


def _leftovers(root: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(root) if e.name.startswith((".tmp-", ".deleting-")))
    except FileNotFoundError:
        return []


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _summary(info) -> dict:
    out = {"step": info.step, "path": info.path, "time": info.time}
    try:
        m = store.read_manifest(info.path)
    except store.CheckpointCorrupt as e:
        out["error"] = str(e)
        return out
    out.update(shards=len(m["shards"]), bytes=sum(s["bytes"] for s in m["shards"]),
               replicas=m.get("replicas") or {}, vacant=m.get("vacant") or [], final=bool(m.get("final")), end=bool(m.get("end")),
               config_hash=m.get("config_hash"))
    return out


def cmd_list(args) -> int:
    root, one = _resolve(args.dir)
    infos = store.list_checkpoints(root)
    if one is not None:
        infos = [i for i in infos if Path(i.path) == one]
    rows = [_summary(i) for i in infos]
    left = _leftovers(root)
    if args.json:
        print(json.dumps({"root": str(root), "checkpoints": rows, "not_checkpoints": left}, indent=1))
        return 0
    print(f"checkpoints in {root}")
    if not rows:
        print("  (none committed)")
    else:
        print(f"  {'step':>8}  {'committed':19}  {'shards':>6}  {'size':>9}  replicas (step/round)")
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"]))
            if "error" in r:
                print(f"  {r['step']:>8}  {when}  unreadable manifest: {r['error']}")
                continue
            reps = ", ".join(f"r{k} {v.get('step')}/{v.get('round')}" + ("" if v.get("state") in (None, "training")
                                                                         else f" {v['state']}")
                             for k, v in sorted(r["replicas"].items(), key=lambda kv: int(kv[0])))
            extra = (f"  vacant {','.join(r['vacant'])}" if r["vacant"] else "") + ("  (final)" if r["final"] else "") \
                + ("  (end of the job)" if r.get("end") else "")
            print(f"  {r['step']:>8}  {when}  {r['shards']:>6}  {_size(r['bytes']):>9}  {reps}{extra}")
    if left:
        print(f"  not checkpoints: {len(left)} save(s) in progress or interrupted ({', '.join(left)})")
    return 0


def cmd_verify(args) -> int:
    root, one = _resolve(args.dir)
    infos = store.list_checkpoints(root)
    if one is not None:
        infos = [i for i in infos if Path(i.path) == one]
        if not infos:
            print(f"{one}: not a committed checkpoint (no {store.MANIFEST})")
            return 1
    results = []
    bar = _verify_progress(infos)
    deleted = []
    for info in reversed(infos):
        bar.label = f"verifying step {info.step}"
        problems = store.verify(info.path, on_shard=lambda s: bar.advance(s["bytes"]))
        if problems and not os.path.lexists(info.path):
            # A running job's preservation policy deleted it while we read it
            # (deletion renames it away first): gone, not damaged. (A file or a
            # symlink loop where the directory was is damage.)
            deleted.append(info.step)
            continue
        results.append({"step": info.step, "path": info.path, "problems": problems})
    bar.close()
    good = [r for r in results if not r["problems"]]
    usable = good[0]["step"] if good else None
    if args.json:
        print(json.dumps({"root": str(root), "checkpoints": results, "resume_step": usable,
                          "deleted_meanwhile": deleted}, indent=1))
    else:
        if not results and not deleted:
            print(f"no committed checkpoint in {root}")
        for r in results:
            if r["problems"]:
                print(f"step {r['step']}: DAMAGED ({r['path']})")
                for p in r["problems"]:
                    print(f"    {p}")
            else:
                print(f"step {r['step']}: ok")
        for step in deleted:
            print(f"step {step}: deleted by the job's preservation policy while being verified")
        if one is None and results:
            print(f"resume would use step {usable}" if usable is not None else "no checkpoint to resume from")
    return 0 if results and len(good) == len(results) else 1


def _verify_progress(infos):
    """A live line of bytes checked so far (only on a terminal: see crucible.progress)."""
    from crucible.progress import Progress

    total = 0
    for info in infos:
        try:
            total += sum(s["bytes"] for s in store.read_manifest(info.path)["shards"])
        except store.CheckpointCorrupt:
            pass
    return Progress("verifying", total=total or None, unit=" MB", scale=1e6)


def _tree_scalars(tree) -> dict:
    out = {}
    if isinstance(tree, dict) and "$dict" in tree:
        for k, v in tree["$dict"]:
            if isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))):
                out[k] = v
            elif isinstance(k, str):
                out[k] = "..."
    return out


def _shard_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            header, _ = shard.read_header(f, path.stat().st_size, path.name)
    except (OSError, store.CheckpointCorrupt) as e:
        return {"error": str(e)}
    blobs = header["blobs"]
    return {"tensors": sum(1 for b in blobs if b.get("kind") == "tensor"),
            "tensor_bytes": sum(b.get("nbytes", 0) for b in blobs if b.get("kind") == "tensor"),
            "state": _tree_scalars(header["tree"])}


def cmd_inspect(args) -> int:
    root, one = _resolve(args.dir)
    if one is None:
        infos = store.list_checkpoints(root)
        if not infos:
            print(f"no committed checkpoint in {root}")
            return 1
        one = Path(infos[-1].path)
    try:
        m = store.read_manifest(one)
    except store.CheckpointCorrupt as e:
        print(store.gone(one, "inspected") or f"{one}: {e}", file=sys.stderr)
        return 1
    shards = []
    for s in m["shards"]:
        shards.append({**s, **_shard_header(one / s["name"])})
    gone = any("error" in s for s in shards) and store.gone(one, "inspected")
    if gone:
        # (a running job's preservation policy deleted it between the manifest and a shard: half an
        # inspection was printed, each shard it missed "No such file", exit 0)
        print(gone, file=sys.stderr)
        return 1
    if args.json:
        m = dict(m)
        m["shards"] = shards
        print(json.dumps(m, indent=1))
        return 0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("time", 0)))
    print(f"checkpoint {one}")
    print(f"  step {m['step']}, committed {when}" + (" (final, on a preemption notice)" if m.get("final") else ""))
    topo = m.get("topology") or {}
    print(f"  topology {topo.get('replicas')} replicas x {topo.get('stages')} stages; config hash "
          f"{m.get('config_hash')}; checksums {m.get('checksum')}")
    for r, v in sorted((m.get("replicas") or {}).items(), key=lambda kv: int(kv[0])):
        print(f"  replica {r}: {v.get('state')}, step {v.get('step')}, outer round {v.get('round')}, "
              f"route {v.get('route')}")
    print(f"  vacant slots: {', '.join(m.get('vacant') or []) or 'none'}")
    if m.get("metrics"):
        print("  metrics: " + ", ".join(f"{k} {v:.4g}" for k, v in m["metrics"].items()))
    info = m.get("shard_info") or {}
    print(f"  {'shard':12} {'size':>9}  {'sha256':16}  {'tensors':>7}  {'stall':>8}  {'persist':>8}  state")
    for s in shards:
        si = info.get(s["name"], {})
        state = s.get("error") or ", ".join(f"{k}={v}" for k, v in s.get("state", {}).items() if v != "...")
        stall = f"{si['stall_s'] * 1e3:.1f} ms" if "stall_s" in si else "-"
        persist = f"{si['persist_s']:.2f} s" if "persist_s" in si else "-"
        print(f"  {s['name']:12} {_size(s['bytes']):>9}  {s['checksum'][:16]}  {s.get('tensors', '-'):>7}  "
              f"{stall:>8}  {persist:>8}  {state}")
    return 0


def main(args) -> int:
    try:
        return {"list": cmd_list, "verify": cmd_verify, "inspect": cmd_inspect}[args.action](args)
    except exits.UsageError as e:
        print(f"crucible ckpt: {e}", file=sys.stderr)
        return exits.USAGE
    except exits.OutputFailed:
        raise
    except OSError as e:    # (a folder it cannot list: another user's checkpoints/, mode 0700; unreadable files are
        #                      said per checkpoint or shard)
        print(f"crucible ckpt: cannot read {e.filename or args.dir}: {e.strerror or e}", file=sys.stderr)
        return exits.USAGE if isinstance(e, PermissionError) else exits.ERROR


def interval_main(args) -> int:
    from crucible import interval, metrics

    if args.nodes is not None and args.nodes < 1:     # (not taken as 1 node: 0 is refused as -3 is)
        print(f"crucible interval: --nodes must be >= 1, got {args.nodes}", file=sys.stderr)
        return 2
    nodes = 1 if args.nodes is None else args.nodes
    try:
        if args.run_dir:
            d = interval.from_run_dir(args.run_dir, node_mtbf_s=args.mtbf, nodes=nodes,
                                      restart_s=args.restart)     # (None: measured from the run)
        else:
            if args.cost is None or args.mtbf is None:
                print("crucible interval: give --cost and --mtbf, or --run-dir", file=sys.stderr)
                return 2
            d = interval.plan(args.cost, args.mtbf, nodes=nodes, restart_s=args.restart or 0.0,
                              persist_s=args.persist)
    except (ValueError, FileNotFoundError, metrics.Unreadable) as e:
        print(f"crucible interval: {e}", file=sys.stderr)
        return 2
    print(json.dumps(d, indent=1) if args.json else interval.format_report(d))
    return 0
