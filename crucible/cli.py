"""The `crucible` command. Only `worker`, `export`, `sample` and the benchmarks import torch."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from crucible import procs
from crucible.exits import UsageError, interrupted


def _common_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with the job's configuration")
    p.add_argument("--replicas", type=int, help="data-parallel replicas (job.replicas)")
    p.add_argument("--stages", type=int, help="pipeline stages per replica (job.stages)")
    p.add_argument("--steps", type=int, help="inner steps to train (train.steps)")
    p.add_argument("--resume", action="store_true", help="continue from the latest committed checkpoint")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides, e.g. train.lr=1e-3")


def _tls_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (README, 'TLS'; also $CRUCIBLE_TLS_DIR, $CRUCIBLE_TLS_HOST, ...)")
    g.add_argument("--tls-dir", help="mutual TLS: directory of `crucible certs` (ca.pem, HOST.pem, HOST.key)")
    g.add_argument("--tls-host", help="this host's name in --tls-dir (default: the machine's name)")
    g.add_argument("--tls-ca", help="mutual TLS: the job's CA certificate (with --tls-cert, --tls-key)")
    g.add_argument("--tls-cert", help="this host's certificate")
    g.add_argument("--tls-key", help="this host's private key")


def _add_launch(sub) -> None:
    p = sub.add_parser("launch", help="run a coordinator and R x S workers on this machine")
    _common_job_args(p)
    p.add_argument("--run-dir", help="run directory (default runs/run-<time>)")
    p.add_argument("--respawn-delay", type=float, default=procs.RESPAWN_DELAY_S,
                   help="seconds before a dead worker is started again (default %(default)g); negative = never")
    p.add_argument("--chaos", help="fault-injection spec (see README)")
    p.add_argument("--device", help="where the workers compute: cpu, cuda (GPUs round-robin) or cuda:N "
                                    "(job.device; README, 'GPUs')")
    p.add_argument("--no-check", action="store_true", help="skip the pre-flight checks (crucible check)")
    _tls_flags(p)


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="pre-flight: check the configuration, data and model without training")
    _common_job_args(p)
    p.add_argument("--run-dir", help="also check the run directory (refused if it holds checkpoints "
                                     "and --resume is not given)")
    p.add_argument("--device", default="", help="where to run the test microbatch (default: job.device's first slot)")
    p.add_argument("--quiet", action="store_true", help="print nothing when every check passes")
    p.add_argument("--no-verify", action="store_true",
                   help="with --resume: read the checkpoints' manifests, not every byte of their shards (the "
                        "coordinator verifies those as it resumes; launch's pre-flight runs this)")


def _add_coordinator(sub) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator")
    _common_job_args(p)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--fresh", action="store_true",
                   help="a new job: ignore the saved state of a previous coordinator of this run directory")
    p.add_argument("--bind", default="127.0.0.1:0", help="host:port (port 0 = any free port)")
    p.add_argument("--on-sigterm", choices=["stop", "leave"], default="stop",
                   help="stop: final checkpoint, then every worker stops; leave: exit, workers wait for the next")
    _tls_flags(p)


def _add_worker(sub) -> None:
    p = sub.add_parser("worker", help="run one stage worker")
    p.add_argument("--coordinator", required=True, help="coordinator host:port")
    p.add_argument("--replica", type=int, default=-1)
    p.add_argument("--stage", type=int, default=-1)
    p.add_argument("--bind", default="127.0.0.1:0", help="data-plane host:port (port 0 = any free port)")
    p.add_argument("--advertise", default="", help="host:port other workers dial (default: the bound one)")
    p.add_argument("--device", default="", help="cpu, cuda (round-robin by slot) or cuda:N (default: job.device)")
    _tls_flags(p)


def _add_inspection(sub) -> None:
    """status, certs, kill, ckpt, interval."""
    p = sub.add_parser("status", help="show a running job")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--run-dir")
    g.add_argument("--coordinator")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true")
    _tls_flags(p)

    p = sub.add_parser("certs", help="make a CA and a TLS certificate per host (mutual TLS)")
    p.add_argument("--out", required=True, help="directory to write ca.pem, ca.key, HOST.pem, HOST.key into")
    p.add_argument("--hosts", required=True, help="comma-separated host names or addresses, as others dial them")
    p.add_argument("--days", type=int, default=365, help="validity of the certificates")
    p.add_argument("--force", action="store_true", help="make new certificates for hosts that have one")

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
    p.add_argument("--restart", type=float,
                   help="restart time R in seconds (with --run-dir: used instead of the R measured from the run)")
    p.add_argument("--persist", type=float, help="background write time W in seconds")
    p.add_argument("--run-dir", help="take C (and M and R, when faults were logged) from a run's metrics.jsonl")
    p.add_argument("--json", action="store_true")


def _add_results(sub) -> None:
    """report, export, sample."""
    p = sub.add_parser("report", help="write RUN_DIR/report.html with plots of a run (finished or running)")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", help="the HTML file to write (default RUN_DIR/report.html; figures go next to it)")
    p.add_argument("--json", action="store_true", help="print a summary as JSON")

    p = sub.add_parser("export", help="assemble a checkpoint's stages into one model (safetensors + config.json)")
    p.add_argument("ckpt", metavar="CKPT", help="run directory, its checkpoints/, or one step_<N>")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--force", action="store_true",
                   help="replace the model.safetensors and config.json DIR already holds")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--replica", type=int, help="the replica whose weights to export (default: the first complete one)")
    g.add_argument("--global", dest="use_global", action="store_true",
                   help="export θ_global (the weights every replica agreed on at the last outer round)")

    p = sub.add_parser("sample", help="generate text from a checkpoint or an export")
    p.add_argument("model", metavar="CKPT_OR_EXPORT", help="an export directory, or what `export` takes")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--replica", type=int, help="with a checkpoint: which replica (default: as export)")
    g.add_argument("--global", dest="use_global", action="store_true", help="with a checkpoint: θ_global")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    p.add_argument("what", choices=["launch", "pipeline", "outer", "activations", "ckpt", "chaos", "soak",
                                          "slurm", "network", "gpu", "revisions", "wire", "readme"],
                   help="a benchmark, or readme: regenerate the README's figures from bench/results")
    p.add_argument("--check", action="store_true",
                   help="bench readme: change nothing; exit 1 when a README figure differs from its result file")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--quick", action="store_true", help="a short run (for smoke tests)")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--size-mb", type=float, help="bench ckpt: state size in MB (default: the job's)")
    p.add_argument("--repeats", type=int, help="bench ckpt, pipeline, chaos, launch, gpu: runs of each variant, "
                                               "interleaved (default: ckpt 2, pipeline 5, chaos 3, launch 5, gpu 1; "
                                               "--quick 1); bench revisions: rounds (default 3; 4 with --compare codecs, "
                                               "8 with --compare startup)")
    p.add_argument("--base", help="bench revisions: the git revision to compare this checkout's CPU pipeline with")
    p.add_argument("--compare", choices=["pipeline", "codecs", "startup"],
                   help="bench revisions: what runs at both revisions: bench pipeline (default), the activation "
                        "codecs' send and receive times (bench wire's codec child; default 4 rounds), or a "
                        "worker's start-up CPU and wall seconds on the CPU (default 8 rounds)")
    p.add_argument("--device", help="bench gpu: cuda (default: every stage on GPU 0), cuda:N or cpu (with --quick: "
                                    "a CPU smoke test)")
    p.add_argument("--peak-tflops", help="bench gpu: the GPU's dense peak TFLOP/s for MFU: 989 (bf16), or "
                                         "bf16=989,fp32=67 (default: a table by the GPU's name)")
    p.add_argument("--minutes", type=float, help="bench soak: how long to inject faults (default 15)")
    p.add_argument("--gap", type=float, help="bench soak: mean seconds between faults (default 3)")
    p.add_argument("--seed", type=int, help="bench soak, slurm: the faults' random seed (default 1)")
    p.add_argument("--stress", type=int, help="bench soak: spinning processes next to the job (default: one a core)")
    p.add_argument("--outer", choices=["sparseloco", "diloco"], help="bench soak: outer mode (default sparseloco)")
    p.add_argument("--kinds", help="bench soak: the fault kinds, comma-separated (default: all); 'none': a "
                                   "fault-free run that only samples the coordinator's memory")


def build_parser() -> argparse.ArgumentParser:
    from crucible.cluster import add_parsers   # crucible slurm ..., crucible k8s render

    from crucible.version import VersionAction

    ap = argparse.ArgumentParser(prog="crucible", description="Fault-tolerant pipelined, data-parallel training.")
    ap.add_argument("--version", action=VersionAction)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_add_launch, _add_check, _add_coordinator, _add_worker, _add_inspection, _add_results,
                _add_bench, add_parsers):
        add(sub)
    return ap


def _setup_logging(name: str) -> None:
    import faulthandler

    logging.basicConfig(level=os.environ.get("CRUCIBLE_LOG", "INFO"),
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` writes every thread's stack to the log: what a stuck process is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _stopped_during_startup(signum, frame) -> None:
    """A worker's SIGTERM before Worker.run installs its own handler: the stop
    convention (128 + N, one line), not a silent death by the signal. os._exit:
    nothing half-imported to unwind; and no error file (a stop is no error, and
    two alike would look like a crash loop to the launcher)."""
    os.write(2, f"crucible worker: stopped during start-up ({signal.Signals(signum).name})\n".encode())
    os._exit(interrupted(signum))


def main(argv: list[str] | None = None) -> int:
    from crucible import exits

    exits.usable_output()        # (before the parser: --help writes too)
    if argv is None and sys.argv[1:2] == ["worker"]:
        # First thing, before the parser and the heavy imports (grpc, torch alone
        # 1-2 s): a worker may be SIGTERMed at any moment (the launcher stopping,
        # a pod evicted). Only a worker process's own main (argv from sys.argv;
        # the command is always the first word): a caller keeps its handlers.
        signal.signal(signal.SIGTERM, _stopped_during_startup)
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    _expand_home(args)
    from crucible.config import ConfigError
    from crucible.tls import TlsError

    try:
        code = _run(args)
        sys.stdout.flush()      # (here, not at exit: an output that cannot be written is said in one line)
        return code
    except exits.OutputFailed as e:
        return exits.output_failed(e)
    except (ConfigError, TlsError, UsageError) as e:
        exits.write_error(str(e))          # under `launch`: the cause it shows, and its crash-loop rule's
        print(f"crucible: {e}", file=sys.stderr)
        return exits.USAGE
    except KeyboardInterrupt:
        print("crucible: interrupted", file=sys.stderr)
        return exits.interrupted(signal.SIGINT)
    except BrokenPipeError as e:
        if not _reader_gone():
            print(f"crucible: {exits.last_line(e)}", file=sys.stderr)
            return exits.ERROR
        return exits.quiet_after_broken_pipe()       # (`crucible status --watch | head`: quietly, as other tools)


# The arguments that are paths on this host.
_PATHS = ("run_dir", "config", "out", "dir", "ckpt", "model", "tls_dir", "tls_ca", "tls_cert", "tls_key")


def _expand_home(args) -> None:
    """A leading ``~`` in a path argument is the home directory, as in
    ``data.path``: no shell expands it in ``--run-dir=~/runs/a`` (nor in a
    script that quotes it), and the run directory was a folder named ``~``
    in the current one."""
    for name in _PATHS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError):
        return False


def _job_config(args):
    """The job's Config from --config, the --replicas/--stages/--steps flags and key=value overrides."""
    from crucible.config import Config

    overrides = list(args.overrides)
    for key, val in (("job.replicas", args.replicas), ("job.stages", args.stages), ("train.steps", args.steps)):
        if val is not None:
            overrides.append(f"{key}={val}")
    return Config.load(args.config, overrides)


def _setup_tls(args, cfg=None) -> None:
    """This process's TLS files: the flags, else the environment, else (launch,
    coordinator) the job's net.tls_* keys; every server and channel uses them."""
    from crucible import rpc, tls

    files = tls.resolve(args.tls_dir or "", args.tls_host or "", args.tls_ca or "", args.tls_cert or "",
                        args.tls_key or "")
    if files is None:
        files = tls.from_env()
    if files is None and cfg is not None:
        net = cfg.net
        files = tls.resolve(net.tls_dir, args.tls_host or "", net.tls_ca, net.tls_cert, net.tls_key)
    rpc.use_tls(files)


def _fatal(what: str, exc: BaseException) -> int:
    """A process dying of an exception: the traceback to its log, the one-line
    cause to stderr and to the supervisor's error file; exit status 1."""
    import traceback

    from crucible import exits

    traceback.print_exception(type(exc), exc, exc.__traceback__)
    line = exits.last_line(exc)
    exits.write_error(line)
    print(f"crucible {what}: {line}", file=sys.stderr, flush=True)
    return exits.ERROR


def _check(args) -> int:
    from crucible import exits, preflight
    from crucible.config import ConfigError

    cfg = _job_config(args)
    cfg.validate_here()           # (a ConfigError: exit status 2, as launch's)
    problem = preflight.checkpoints_problem(args.run_dir, cfg)
    if problem:
        raise UsageError(f"--run-dir {args.run_dir}: {problem}")
    try:
        lines = preflight.run(cfg, run_dir=args.run_dir, resume=args.resume, device=args.device,
                              verify=not args.no_verify)
    except preflight.CheckFailed as e:
        print(f"crucible: {e}", file=sys.stderr, flush=True)
        return exits.ERROR
    except ConfigError:           # (sizing.TooBig: the job does not fit this host; exit status 2)
        raise
    except Exception as e:  # noqa: BLE001 - a check must end in one line, never a traceback
        print(f"crucible: the pre-flight check itself failed: {exits.last_line(e)}", file=sys.stderr, flush=True)
        return exits.ERROR
    if not args.quiet:
        for line in lines:
            print(f"  {line}")
        print("crucible: check passed")
    return exits.OK


def _launch(args) -> int:
    from crucible.launch import Launcher

    cfg = _job_config(args)
    cfg.validate_here(coordinator=True)     # net.bind and the /metrics port, before anything starts
    _setup_tls(args, cfg)
    return Launcher(args, args.overrides).run()


def _coordinator(args) -> int:
    _setup_logging("coordinator")
    from crucible import exits, rpc
    from crucible.checkpoint.store import CannotResume
    from crucible.config import ConfigError
    from crucible.coordinator.server import serve
    from crucible.procs import die_with_parent

    die_with_parent()
    cfg = _job_config(args)
    _setup_tls(args, cfg)
    try:
        os.makedirs(args.run_dir, exist_ok=True)
        token = rpc.read_token(args.run_dir)
        if not token:
            token = rpc.new_token()
            path = rpc.write_token(args.run_dir, token)
            print(f"crucible: no CRUCIBLE_TOKEN given; generated one in {path}", file=sys.stderr)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and e.filename != args.run_dir else ""
        raise UsageError(f"--run-dir {args.run_dir}: {e.strerror or e}{where}") from None
    try:
        return serve(cfg, args.run_dir, args.bind, token, resume=args.resume, fresh=args.fresh,
                     on_sigterm=args.on_sigterm)
    except CannotResume as e:   # (its message is the line to show: no class path, no traceback)
        exits.write_error(str(e))
        print(f"crucible coordinator: {e}", file=sys.stderr, flush=True)
        return exits.ERROR
    except rpc.BindError as e:   # (a port in use: a usage error naming the flag)
        raise UsageError(f"--bind {e}") from None
    except (ConfigError, UsageError):   # (metrics.prometheus_port in use, checkpoints/ another job's: one line, exit 2)
        raise
    except Exception as e:  # noqa: BLE001
        return _fatal("coordinator", e)


def _worker(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _setup_logging(f"worker r{args.replica}s{args.stage}")
    from crucible import exits, rpc
    from crucible.config import ConfigError
    from crucible.procs import PARENT_ENV, die_with_parent

    die_with_parent()
    if os.environ.get(PARENT_ENV):
        # Under `launch`, Ctrl-C, and a hangup of its terminal, reach the whole
        # process group: let the coordinator take its final checkpoint and stop
        # us (our persister and pulse inherit the ignoring).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    token = rpc.read_token()
    if not token:
        print("crucible worker: set CRUCIBLE_TOKEN to the job's token", file=sys.stderr)
        return exits.USAGE
    _setup_tls(args)
    try:
        from crucible.worker.runtime import Worker

        return Worker(args.coordinator, token, args.replica, args.stage, args.bind, args.advertise,
                      args.device).run()
    except ConfigError:           # (sizing.TooBig: its stage does not fit here; one line, exit status 2)
        raise
    except rpc.BindError as e:   # (a port in use: a usage error naming the flag)
        raise UsageError(f"--bind {e}") from None
    except Exception as e:  # noqa: BLE001
        return _fatal("worker", e)


def _status(args) -> int:
    from crucible.status import main as status_main

    _setup_tls(args)
    return status_main(args)


def _bench(args) -> int:
    import importlib

    return importlib.import_module(f"crucible.bench.{args.what}").main(args)


# The other commands: "module:function", called with the parsed arguments.
_ELSEWHERE = {"certs": "crucible.certs:main", "ckpt": "crucible.ckpt_cli:main",
              "interval": "crucible.ckpt_cli:interval_main", "slurm": "crucible.cluster:main",
              "k8s": "crucible.cluster:main", "report": "crucible.report:main", "export": "crucible.export:main",
              "sample": "crucible.export:main"}


def check_hostport(flag: str, value: str, dial: bool = False) -> None:
    """``host:port`` (``[v6]:port`` for an IPv6 address), the port a number in
    0..65535 (1..65535 for an address to `dial`); UsageError names the flag."""
    from crucible.config import hostport_problem

    problem = hostport_problem(value, dial)
    if problem:
        raise UsageError(f"{flag} {value!r}: {problem}")


def _check_args(args) -> None:
    """What can be refused before anything starts: addresses that are not
    host:port, a --device that is none, a run directory that is a file or
    cannot be made."""
    from crucible.files import dir_problem

    for flag, dial in (("coordinator", True), ("bind", False), ("advertise", True)):
        value = getattr(args, flag, None)
        if value is not None and (value or flag != "advertise"):     # --advertise "" = the bound address
            check_hostport(f"--{flag}", value, dial)
    if args.cmd in ("check", "worker") and args.device:   # (launch's --device is job.device: a config error)
        from crucible.config import _device_ok

        if not _device_ok(args.device):
            raise UsageError(f"--device {args.device!r}: must be cpu, cuda or cuda:N")
    # (launch checks its own, default, run directory: crucible.launch.Launcher)
    if args.cmd in ("check", "coordinator", "status", "kill", "interval") and args.run_dir:
        # (check and coordinator write it; a coordinator that continues its predecessor's job, restarted by
        # the launcher or a scheduler, is not refused for a full disk: it holds what it cannot write yet)
        problem = dir_problem(args.run_dir, make=args.cmd in ("check", "coordinator"),
                              room=args.cmd != "coordinator" or args.fresh or args.resume)
        if problem:
            raise UsageError(f"--run-dir {args.run_dir}: {problem}")


def _run(args) -> int:
    _check_args(args)
    here = {"launch": _launch, "check": _check, "coordinator": _coordinator, "worker": _worker, "bench": _bench,
            "status": _status}
    if args.cmd in here:
        return here[args.cmd](args)
    if args.cmd == "kill":
        from crucible.kill import kill

        return kill(args.run_dir, args.worker)
    import importlib

    module, _, fn = _ELSEWHERE[args.cmd].partition(":")
    return getattr(importlib.import_module(module), fn)(args)


if __name__ == "__main__":
    sys.exit(main())
