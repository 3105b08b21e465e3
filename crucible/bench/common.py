"""Helpers shared by the benchmarks (``crucible bench ...``).

* ``Launch``: a ``crucible launch`` in its own process group (its own session),
  with a bounded wait and the whole group killed in ``close`` (SIGTERM, then
  SIGKILL), whatever happened. Nothing is ever killed by name.
* ``Child``: any other helper process, same rules.
* ``read_events`` / ``steady_state``: ``metrics.jsonl`` and the per-stage
  breakdown of the committed steps after a warmup.
* ``pin_tasks``: CPU affinity of every thread of a process (Linux).
* ``environment``: cores, versions, load and date, recorded with every result.
* ``emit``: the result as one JSON object on stdout (and ``--out``).

This module never imports torch: a benchmark imports it only where it needs it
(in a child process, where possible).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable

from crucible.files import atomic_write
from crucible.metrics import read_events  # noqa: F401  (the benchmarks read the run's events)
from crucible.progress import Progress

from crucible.version import version as crucible_version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the source tree

STAGE_FIELDS = ("step_s", "compute_s", "serialize_s", "serialize_cpu_s", "transport_s", "idle_s",
                "bytes_out", "raw_bytes_out", "bytes_in", "raw_bytes_in")


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM (a test's timeout, a user) raises SystemExit in the main
    thread, so that the bench's finally blocks close every job and child it
    started (each in its own session: a signal to the bench's group misses them)."""
    signal.signal(signal.SIGTERM, _terminate)


def progress(msg: str) -> None:
    """Progress goes to stderr, so that ``--json`` leaves only the JSON on stdout."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def crucible_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "crucible", *args]


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("CRUCIBLE_TOKEN", None)
    env.update(extra)
    return env


def tree_first(env: dict, tree: str) -> dict:
    """`env` with the source tree `tree` first on PYTHONPATH (a child that runs
    another checkout's code: ``bench revisions``)."""
    env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Child:
    """A process in its own session (so its pgid is its pid); ``close`` ends the group."""

    def __init__(self, argv: list[str], env: dict | None = None, stdout=None, stderr=None,
                 cwd: str | None = None):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=stdout if stdout is not None else subprocess.DEVNULL,
                                     stderr=stderr if stderr is not None else subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, env=env or child_env(), cwd=cwd,
                                     start_new_session=True, close_fds=True)
        self.pgid = self.proc.pid

    def wait(self, timeout: float, poll: Callable[[], None] | None = None, every: float = 0.1) -> int | None:
        """Wait up to `timeout` s for the leader to exit, calling `poll` meanwhile.
        Returns the exit code, or None on timeout (the process is left running)."""
        t_end = time.monotonic() + timeout
        with Progress(self.progress_label()) as bar:   # a live line, only on a terminal
            while True:
                code = self.proc.poll()
                if code is not None:
                    return code
                if time.monotonic() >= t_end:
                    return None
                if poll is not None:
                    poll()
                if bar.enabled:
                    bar.update(None, self.progress_note())
                time.sleep(every)

    def progress_label(self) -> str:
        return " ".join(os.path.basename(a) for a in self.argv[2:5])

    def progress_note(self) -> str:
        return ""

    def close(self, grace: float = 5.0) -> None:
        """SIGTERM the group (the leader's own cleanup runs), then SIGKILL whatever is left."""
        if self.proc.poll() is None:
            _signal_group(self.pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        t_end = time.monotonic() + grace
        while _group_alive(self.pgid) and time.monotonic() < t_end:
            time.sleep(0.05)
        _signal_group(self.pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def child_json(argv: list[str], timeout: float, what: str, env: dict | None = None,
               cwd: str | None = None) -> dict:
    """Run ``argv`` as a ``Child`` (own process group, bounded wait, closed at
    the end) and return the JSON object that is its stdout (a bench's
    ``--json``) or its stdout's last line, or ``{"error": ...}``: what timed
    out or exited non-zero, with its stderr's tail."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = Child(argv, env=env or child_env(), stdout=out, stderr=err, cwd=cwd)
        try:
            code = child.wait(timeout)
        finally:
            child.close()
        out.seek(0)
        err.seek(0)
        text = out.read().decode(errors="replace").strip()
        if code != 0 or not text:
            return {"error": f"{what} {'timed out' if code is None else f'exited with {code}'}: "
                             + err.read().decode(errors="replace")[-1500:]}
    for doc in (text, text.splitlines()[-1]):
        try:
            return json.loads(doc)
        except ValueError:
            pass
    return {"error": f"{what} printed no JSON: {text[-500:]}"}


class EventTail:
    """The events appended to a metrics.jsonl since the last look: each line is
    read once (the file grows to many MB while a benchmark polls it)."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    def new(self, marker: bytes = b"") -> list[dict]:
        """The new complete lines that contain ``marker``, parsed (others skipped)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            if marker in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out


class Launch(Child):
    """``crucible launch --run-dir D ...`` with stdout and stderr in D/launch.out;
    ``args``: more launcher flags (e.g. ``--no-check``), before the overrides."""

    def __init__(self, run_dir: str, replicas: int, stages: int, steps: int, overrides: Iterable[str] = (),
                 env: dict | None = None, args: Iterable[str] = ()):
        self.run_dir = os.path.abspath(run_dir)
        self.steps = steps
        self._seen: dict[int, int] = {}     # replica -> latest step (progress line)
        self._tail = EventTail(os.path.join(self.run_dir, "metrics.jsonl"))
        os.makedirs(self.run_dir, exist_ok=True)
        self.out_path = os.path.join(self.run_dir, "launch.out")
        argv = crucible_argv("launch", "--replicas", str(replicas), "--stages", str(stages), "--steps", str(steps),
                             "--run-dir", self.run_dir, "--respawn-delay", "-1", *args, *overrides)
        with open(self.out_path, "wb") as out:
            super().__init__(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def progress_label(self) -> str:
        return f"run {os.path.basename(self.run_dir)}"

    def progress_note(self) -> str:
        """Each replica's latest step, from the new lines of metrics.jsonl."""
        steps = self._seen
        for ev in self._tail.new(b'"event":"step"'):
            try:
                steps[ev["replica"]] = ev["step"] + 1
            except (KeyError, TypeError):
                pass
        if not steps:
            return "starting"
        return "step " + " | ".join(f"r{r} {s}/{self.steps}" for r, s in sorted(steps.items()))

    def pids(self) -> dict:
        """pids.json as the launcher last wrote it ({} before it exists)."""
        try:
            with open(os.path.join(self.run_dir, "pids.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def events(self, kind: str | None = None) -> list[dict]:
        return read_events(os.path.join(self.run_dir, "metrics.jsonl"), kind)

    def tail(self, n: int = 3000) -> str:
        """The end of the launcher's output and of every log, for error messages."""
        out = []
        paths = [self.out_path]
        logs = os.path.join(self.run_dir, "logs")
        if os.path.isdir(logs):
            paths += [os.path.join(logs, p) for p in sorted(os.listdir(logs))]
        for p in paths:
            try:
                with open(p, "rb") as f:
                    text = f.read().decode(errors="replace")
            except OSError:
                continue
            out.append(f"--- {os.path.basename(p)}\n{text[-n:]}")
        return "\n".join(out)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def stage_breakdown(events: list[dict], replica: int, stages: int, warmup: int) -> list[dict]:
    """Mean per step of each stage's timing and byte fields over the steps >= warmup.

    Stage 0's numbers come from ``step`` events, the other stages' from
    ``stage_step`` events. The last occurrence of a (stage, step) wins (a retried
    step is reported again)."""
    per_stage: list[dict[int, dict]] = [{} for _ in range(stages)]
    for ev in events:
        if ev.get("replica") != replica:
            continue
        if ev.get("event") == "step":
            s = 0
        elif ev.get("event") == "stage_step":
            s = int(ev.get("stage", -1))
        else:
            continue
        if 0 <= s < stages and int(ev.get("step", -1)) >= warmup:
            per_stage[s][int(ev["step"])] = ev
    out = []
    for s, by_step in enumerate(per_stage):
        evs = [by_step[k] for k in sorted(by_step)]
        row = {"stage": s, "steps": len(evs)}
        for f in STAGE_FIELDS:
            row[f] = _mean([float(e.get(f, 0.0)) for e in evs])
        out.append(row)
    return out


def throughput(step_events: list[dict], replica: int, warmup: int) -> dict:
    """Tokens/s of one replica over the committed steps after `warmup`.

    Wall clock: from the report of step warmup-1 to the report of the last step
    (the ``time`` of each ``step`` event is stamped by stage 0 when the step
    commits), so it includes everything between steps."""
    by_step = {}
    for ev in step_events:
        if ev.get("event") == "step" and ev.get("replica") == replica:
            by_step[int(ev["step"])] = ev
    steps = sorted(by_step)
    if not steps:
        return {"steps": 0, "tokens_per_s": 0.0}
    last = steps[-1]
    first = max(warmup - 1, steps[0])
    measured = [k for k in steps if first < k <= last]
    tokens = sum(int(by_step[k].get("tokens", 0)) for k in measured)
    wall = float(by_step[last]["time"]) - float(by_step[first]["time"]) if measured else 0.0
    step_s = _mean([float(by_step[k].get("step_s", 0.0)) for k in measured])
    return {
        "steps": len(steps),
        "measured_steps": len(measured),
        "tokens_per_step": int(by_step[last].get("tokens", 0)),
        "wall_s": wall,
        "t_start": float(by_step[first]["time"]),
        "t_end": float(by_step[last]["time"]),
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "mean_step_s": wall / len(measured) if measured and wall > 0 else 0.0,
        "mean_stage0_step_s": step_s,
        "first_loss": float(by_step[steps[0]].get("loss", float("nan"))),
        "last_loss": float(by_step[last].get("loss", float("nan"))),
    }


def pin_tasks(pid: int, cpus: set[int]) -> int:
    """Pin every thread of `pid` to `cpus` (threads made later inherit it from
    their creator). Returns how many threads were set; 0 if the process is gone."""
    n = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except (ProcessLookupError, PermissionError, OSError):
            pass
    return n


def affinity_of(pid: int) -> list[int] | None:
    """The CPUs every thread of `pid` may run on (their union), or None if gone."""
    cpus: set[int] = set()
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:
            pass
    return sorted(cpus) if cpus else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far (all its threads), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


SYSTEM = "__system__"


def system_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in parts[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


class CpuSampler:
    """Samples the CPU time of named processes against the wall clock (time.time(),
    the clock of metrics events), to tell CPU used per step from wall time."""

    def __init__(self):
        self.samples: dict[str, list[tuple[float, float]]] = {}

    def sample(self, pids: dict) -> None:
        now = time.time()
        busy = system_busy_seconds()
        if busy is not None:
            self.samples.setdefault(SYSTEM, []).append((now, busy))
        for name, pid in pids.items():
            if not isinstance(pid, int):
                continue
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self.samples.setdefault(name, []).append((now, cpu))

    def at(self, name: str, t: float, slack: float = 0.5) -> float | None:
        """CPU seconds of `name` at wall time t, interpolated between samples
        (up to `slack` s outside them: the nearest sample)."""
        xs = self.samples.get(name, [])
        if len(xs) < 2 or not xs[0][0] - slack <= t <= xs[-1][0] + slack:
            return None
        if t <= xs[0][0]:
            return xs[0][1]
        if t >= xs[-1][0]:  # the process exited just after t: its last sample
            return xs[-1][1]
        for (t0, c0), (t1, c1) in zip(xs, xs[1:]):
            if t0 <= t <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
        return None

    def contention(self, t_start: float, t_end: float) -> dict | None:
        """Cores busy between two wall times: in all, with the sampled processes, and
        with everything else on the machine (other jobs: a contaminated measurement)."""
        if t_end <= t_start:
            return None
        a, b = self.at(SYSTEM, t_start), self.at(SYSTEM, t_end)
        if a is None or b is None:
            return None
        ours = 0.0
        for name in self.samples:
            if name == SYSTEM:
                continue
            x, y = self.at(name, t_start), self.at(name, t_end)
            if x is not None and y is not None:
                ours += y - x
        wall = t_end - t_start
        busy = (b - a) / wall
        return {"busy_cores": busy, "ours_cores": ours / wall, "others_cores": max(0.0, busy - ours / wall)}

    def per_step(self, t_start: float, t_end: float, steps: int) -> dict[str, float | None]:
        """Mean CPU seconds per step of each process between two wall times."""
        out: dict[str, float | None] = {}
        for name in sorted(self.samples):
            if name == SYSTEM:
                continue
            a, b = self.at(name, t_start), self.at(name, t_end)
            out[name] = (b - a) / steps if a is not None and b is not None and steps > 0 else None
        return out


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - not installed
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def git_commit() -> str | None:
    """The commit of the source tree the benchmark runs from (+ "-dirty" with
    uncommitted changes), or None outside a git checkout."""
    root = ROOT
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("-dirty" if dirty else "")) if head else None


def environment() -> dict:
    return {
        "commit": git_commit(),
        "command": " ".join(["crucible"] + sys.argv[1:]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "crucible": crucible_version(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        **_gpu(),
        "loadavg_start": loadavg(),
    }


def _gpu() -> dict:
    """The accelerator the benchmark could use, only when torch is already
    loaded: ``gpu`` (name x count), the CUDA version torch was built with and,
    where a GPU is visible, the driver's version, every GPU (``nvidia-smi``,
    when on the PATH) and cuDNN's version."""
    torch = sys.modules.get("torch")
    out: dict = {"gpu": None}
    if torch is None:
        return out
    out.update({"cuda": getattr(torch.version, "cuda", None), "gpu_driver": None})
    try:
        if not torch.cuda.is_available():
            return out
        out["gpu"] = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except Exception:  # noqa: BLE001 - no driver: no GPU
        return out
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        rows = [[x.strip() for x in line.split(",")] for line in smi.stdout.strip().splitlines() if line.strip()]
        if smi.returncode == 0 and rows:
            out["gpu_driver"] = rows[0][1] if len(rows[0]) > 1 else None
            out["gpus"] = [{"name": r[0], "memory": r[2] if len(r) > 2 else None} for r in rows]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - not built with cuDNN
        pass
    return out


def full_config(overrides) -> dict | None:
    """The whole configuration a benchmark's job ran with: the defaults plus
    its overrides (``key=value`` strings), as the job itself loads them."""
    from crucible.config import Config, ConfigError

    try:
        return Config.load(None, dict(o.split("=", 1) for o in overrides)).to_dict()
    except (ConfigError, ValueError, TypeError):
        return None


def verdict(value: float | None, limit: float, noise: float | None = None) -> str | None:
    """The verdict on a figure whose target is ``value <= limit``, given
    ``noise``, how far the same measurement moves when repeated (the spread
    of repeats, or a 95 % half-width): "met" when even ``value + noise`` meets
    the limit, "missed" when even ``value - noise`` misses it, "within noise"
    in between (the repeats cannot tell). Without a noise figure (one run, or
    a count): "met" or "missed" on the value. None when nothing was measured."""
    if value is None:
        return None
    if not noise:
        return "met" if value <= limit else "missed"
    if value + noise <= limit:
        return "met"
    if value - noise > limit:
        return "missed"
    return "within noise"


def spread(xs: list[float]) -> float | None:
    """Relative spread of repeats of one measurement: max / min - 1."""
    xs = [x for x in xs if x]
    return max(xs) / min(xs) - 1 if len(xs) > 1 else None


# two-sided 95 % Student t quantiles by degrees of freedom (1..10); above: 1.96
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def seeds_summary(xs: list[float]) -> dict:
    """Mean, sample standard deviation and the 95 % confidence half-width of the
    mean of one measurement over seeds (sd and half-width None for one seed)."""
    xs = [float(x) for x in xs if x is not None]
    out: dict = {"n": len(xs), "values": xs, "mean": statistics.fmean(xs) if xs else None, "sd": None,
                 "ci95_halfwidth": None}
    if len(xs) > 1:
        out["sd"] = statistics.stdev(xs)
        out["ci95_halfwidth"] = _T95.get(len(xs) - 1, 1.96) * out["sd"] / math.sqrt(len(xs))
    return out


def paired_gap(a: list[float], b: list[float]) -> dict:
    """How much ``a`` exceeds ``b``, relative to ``b``'s mean, seed by seed (the
    same seed gives both methods the same initial weights and data order): the
    mean relative difference, its 95 % confidence half-width over the seeds, and
    whether the two can be told apart ("within noise" when the interval holds 0)."""
    rel = [(x - y) / y for x, y in zip(a, b)]
    s = seeds_summary(rel)
    hw = s["ci95_halfwidth"]
    if s["mean"] is None:
        s["difference"] = None
    elif hw is None or abs(s["mean"]) <= hw:
        s["difference"] = "within noise"
    else:
        s["difference"] = "higher" if s["mean"] > 0 else "lower"
    return s


def rotated(xs: list, i: int) -> list:
    """``xs`` starting at its element i (mod its length): round i's order of an
    interleaved measurement, so that drifting load hits every variant alike."""
    i %= max(1, len(xs))
    return xs[i:] + xs[:i]


def fmt_mean_sd(v: dict | None, spec: str = ".3f", missing: str = "n/a") -> str:
    """``mean ± sd`` of a ``seeds_summary`` (the sd left out for one seed)."""
    if not v or v.get("mean") is None:
        return missing
    return format(v["mean"], spec) + (f" ± {format(v['sd'], spec)}" if v.get("sd") is not None else "")


def fmt_rel(mean: float | None, halfwidth: float | None = None, nd: int = 2, missing: str = "n/a") -> str:
    """A relative difference in percent, ``± its 95 % half-width`` where there is one."""
    if mean is None:
        return missing
    return f"{mean * 100:+.{nd}f}%" + (f" ± {halfwidth * 100:.{nd}f}%" if halfwidth is not None else "")


def round_floats(x, nd: int = 6):
    """``x`` with every float rounded to ``nd`` digits (non-finite ones as
    None, which JSON can hold), through dicts, lists and tuples."""
    if isinstance(x, float):
        return round(x, nd) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: round_floats(v, nd) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [round_floats(v, nd) for v in x]
    return x


def write_out(result: dict, out: str) -> None:
    """The result as JSON in the file ``out`` (atomically: write, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_write(out, json.dumps(result, indent=2) + "\n", fsync=False)


def emit(result: dict, args) -> None:
    """Print the result: with --json only the JSON on stdout; --out also writes it."""
    if getattr(args, "out", None):
        write_out(result, args.out)
    print(json.dumps(result, indent=2), flush=True)


def finish(result: dict, errors: list[str], args, print_table: Callable | None = None,
           round_nd: int | None = None) -> int:
    """The end of a benchmark: the load at the end, the errors, the floats
    rounded (``round_nd``), a table on stderr unless ``--json``, the JSON on
    stdout (and ``--out``); the exit status (1 when anything failed)."""
    env = result["environment"]
    env["loadavg_end"] = loadavg()
    if "elapsed_s" not in result and env.get("date"):     # how long the bench ran (to the second)
        try:
            start = _dt.datetime.fromisoformat(env["date"])
            result["elapsed_s"] = round((_dt.datetime.now(_dt.timezone.utc) - start).total_seconds())
        except ValueError:
            pass
    overrides = (result.get("settings") or {}).get("overrides")
    if isinstance(overrides, list) and "config" not in result:
        result["config"] = full_config(overrides)
    result["errors"] = errors
    if round_nd is not None:
        result = round_floats(result, round_nd)
    if print_table is not None and not getattr(args, "json", False):
        print_table(result, sys.stderr)
    emit(result, args)
    return 1 if errors else 0
