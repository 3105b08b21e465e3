"""The `crucible` command. Only `worker` and the benchmarks import torch."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def _common_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with the job's configuration")
    p.add_argument("--replicas", type=int, help="data-parallel replicas (job.replicas)")
    p.add_argument("--stages", type=int, help="pipeline stages per replica (job.stages)")
    p.add_argument("--steps", type=int, help="inner steps to train (train.steps)")
    p.add_argument("--resume", action="store_true", help="continue from the latest committed checkpoint")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides, e.g. train.lr=1e-3")


def build_parser() -> argparse.ArgumentParser:
    from crucible.version import VersionAction

    ap = argparse.ArgumentParser(prog="crucible", description="Fault-tolerant pipelined, data-parallel training.")
    ap.add_argument("--version", action=VersionAction)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("launch", help="run a coordinator and R x S workers on this machine")
    _common_job_args(p)
    p.add_argument("--run-dir", help="run directory (default runs/run-<time>)")
    p.add_argument("--respawn-delay", type=float, default=1.0,
                   help="seconds before a dead worker is started again; negative = never")
    p.add_argument("--chaos", help="fault-injection spec (see README)")

    p = sub.add_parser("coordinator", help="run the coordinator")
    _common_job_args(p)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--bind", default="127.0.0.1:0", help="host:port (port 0 = any free port)")

    p = sub.add_parser("worker", help="run one stage worker")
    p.add_argument("--coordinator", required=True, help="coordinator host:port")
    p.add_argument("--replica", type=int, default=-1)
    p.add_argument("--stage", type=int, default=-1)
    p.add_argument("--bind", default="127.0.0.1:0", help="data-plane host:port (port 0 = any free port)")
    p.add_argument("--advertise", default="", help="host:port other workers dial (default: the bound one)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")

    p = sub.add_parser("status", help="show a running job")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--run-dir")
    g.add_argument("--coordinator")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true")

    p = sub.add_parser("kill", help="SIGKILL one worker of a local job (fault injection)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("worker", help="like r1s2, or 'coordinator'")

    p = sub.add_parser("ckpt", help="list, verify or inspect a job's checkpoints")
    p.add_argument("action", choices=["list", "verify", "inspect"])
    p.add_argument("dir", metavar="D", help="run directory, its checkpoints/ directory, or one step_<N>")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("interval", help="Young/Daly checkpoint interval and expected overhead")
    p.add_argument("--cost", type=float, help="checkpoint cost C in seconds (the snapshot stall)")
    p.add_argument("--mtbf", type=float, help="node mean time between failures, seconds")
    p.add_argument("--nodes", type=int, help="nodes in the job (M = mtbf / nodes)")
    p.add_argument("--restart", type=float, help="restart time R in seconds")
    p.add_argument("--persist", type=float, help="background write time W in seconds")
    p.add_argument("--run-dir", help="take C (and M, when faults were logged) from a run's metrics.jsonl")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("bench", help="benchmarks that print JSON")
    p.add_argument("what", choices=["pipeline", "outer", "activations", "ckpt", "chaos"])
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--quick", action="store_true", help="a short run (for smoke tests)")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--size-mb", type=float, help="bench ckpt: state size in MB (default: the job's)")
    return ap


def _setup_logging(name: str) -> None:
    logging.basicConfig(level=os.environ.get("CRUCIBLE_LOG", "INFO"),
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def _die_with_parent() -> None:
    """Under `crucible launch`: be killed when the launcher dies (Linux)."""
    parent = os.environ.get("CRUCIBLE_PDEATHSIG")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the launcher died before prctl
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    from crucible.config import ConfigError

    try:
        return _run(args)
    except ConfigError as e:
        print(f"crucible: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.cmd == "launch":
        from crucible.launch import Launcher

        return Launcher(args, args.overrides).run()

    if args.cmd == "coordinator":
        _setup_logging("coordinator")
        _die_with_parent()
        from crucible import rpc
        from crucible.config import Config
        from crucible.coordinator.server import serve

        overrides = list(args.overrides)
        for key, val in (("job.replicas", args.replicas), ("job.stages", args.stages), ("train.steps", args.steps)):
            if val is not None:
                overrides.append(f"{key}={val}")
        cfg = Config.load(args.config, overrides)
        os.makedirs(args.run_dir, exist_ok=True)
        token = rpc.read_token(args.run_dir)
        if not token:
            token = rpc.new_token()
            path = rpc.write_token(args.run_dir, token)
            print(f"crucible: no CRUCIBLE_TOKEN given; generated one in {path}", file=sys.stderr)
        return serve(cfg, args.run_dir, args.bind, token, resume=args.resume)

    if args.cmd == "worker":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _setup_logging(f"worker r{args.replica}s{args.stage}")
        _die_with_parent()
        if os.environ.get("CRUCIBLE_PDEATHSIG"):
            # Under `launch`, Ctrl-C reaches the whole process group: let the
            # coordinator take its final checkpoint and stop us.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        from crucible import rpc

        token = rpc.read_token()
        if not token:
            print("crucible worker: set CRUCIBLE_TOKEN to the job's token", file=sys.stderr)
            return 2
        from crucible.worker.runtime import Worker

        return Worker(args.coordinator, token, args.replica, args.stage, args.bind, args.advertise,
                      args.device).run()

    if args.cmd == "status":
        from crucible.status import main as status_main

        return status_main(args)

    if args.cmd == "kill":
        from crucible.kill import kill

        return kill(args.run_dir, args.worker)

    if args.cmd == "ckpt":
        from crucible.ckpt_cli import main as ckpt_main

        return ckpt_main(args)

    if args.cmd == "interval":
        from crucible.ckpt_cli import interval_main

        return interval_main(args)

    if args.cmd == "bench":
        import importlib

        mod = importlib.import_module(f"crucible.bench.{args.what}")
        return mod.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
