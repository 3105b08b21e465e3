"""``crucible bench revisions --base REV``: the CPU pipeline at two revisions
of the code, interleaved (``--compare codecs``: the activation codecs' frame
times instead).

What a change to the worker's data path owes the CPU path (issue 12: "the CPU
stays as it is, its benchmarks within noise"). Each round runs ``crucible
bench pipeline --json --repeats 1`` once from a git worktree of the base
revision and once from this checkout (the head, as it is), in rotated order,
so that drifting load hits both alike. Per variant of that benchmark (S = 1,
2, 4 stages, S = 2 pinned, one plain process): each side's median tokens/s
over the rounds and the head's gap to the base, paired round by round
(``common.paired_gap``: the mean relative difference ± its 95 % half-width;
"within noise" when the interval holds 0). Both sides run with this
checkout's Python and packages, so the base must take the same ``bench
pipeline`` command line; the worktree is removed at the end.

``--compare startup`` runs a fresh process from each tree, one a round per
side (default 8 rounds), that does what a worker does on a CPU before its
first step, less the network: imports the worker (torch included), builds the
default model's stage 1 of 4 and its optimizer, and runs one microbatch
forward and backward and one optimizer step, on one thread; it reports its CPU
seconds (``cpu_s``; ``cpu_import_s`` up to the imports) and its wall seconds
(``wall_s``). A replacement's start-up and a job's restart are this, on the
cores the job trains on (restart time in the cost model).

``--compare codecs`` runs ``crucible bench wire``'s codec child instead (a
``[4, 512, 1024]`` frame per codec and input dtype, sent with
``wire.encode_frame`` and received with ``wire.parse_frame`` and
``wire.from_wire``, one thread, the median of 20 frames) from both trees, in
the same rotated rounds (default 4), and pairs each codec's send and receive
milliseconds; the base must have that child (``python -m crucible.bench.wire
--codecs``, since a585742).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Callable

from crucible.bench import common, wire

ROOT = common.ROOT
PIPELINE_TIMEOUT_S = 900.0      # one full `bench pipeline --repeats 1` takes about 2 minutes on 2 cores
STARTUP_MEASURES = ("cpu_s", "cpu_import_s", "wall_s")
STARTUP_TIMEOUT_S = 120.0
# The --compare startup child, run with `python -c` from each tree: only names
# both trees have (Config, build_stage, make_optimizer, apply_step).
STARTUP_CHILD = """
import json, time
w0 = time.monotonic()
import torch
torch.set_num_threads(1)
from crucible.config import Config
from crucible.model import build_stage
from crucible.worker import optim, runtime  # noqa: F401  (a worker's imports)
cpu_import = time.process_time()
cfg = Config()
t = cfg.train
stage = build_stage(cfg, 1, 4)
opt = optim.make_optimizer(stage, t)
x = torch.randn(t.batch_size // t.microbatches, t.seq_len, cfg.model.d_model, requires_grad=True)
stage(x).float().pow(2).mean().backward()
optim.apply_step(stage, opt, 1.0, t.lr)
print(json.dumps({"cpu_s": time.process_time(), "cpu_import_s": cpu_import, "wall_s": time.monotonic() - w0}))
"""
CODEC_FRAMES = {False: 20, True: 5}          # by --quick
QUICK_CODECS = ("raw", "int8")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=60)


def resolve(rev: str) -> str | None:
    """The commit `rev` names in this checkout, or None."""
    try:
        r = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def run_pipeline(tree: str, quick: bool, what: str) -> dict:
    """``bench pipeline`` from the source tree `tree` (its package first on the
    path, for the bench and every process it starts)."""
    argv = [sys.executable, "-m", "crucible", "bench", "pipeline", "--json", "--repeats", "1",
            *(["--quick"] if quick else [])]
    return common.child_json(argv, PIPELINE_TIMEOUT_S, what, env=_tree_env(tree), cwd=tree)


def run_startup(tree: str, what: str) -> dict:
    """The start-up child (STARTUP_CHILD) from the source tree `tree`."""
    return common.child_json([sys.executable, "-c", STARTUP_CHILD], STARTUP_TIMEOUT_S, what, env=_tree_env(tree),
                             cwd=tree)


def _tree_env(tree: str) -> dict:
    """A child's environment with the source tree `tree` first on the path."""
    return common.tree_first(common.child_env(), tree)


def codec_times(r: dict) -> dict:
    """The codec child's result as one flat row: ``<codec>/<dtype> send_ms``
    and ``... recv_ms`` -> milliseconds."""
    return {f"{k} {side}": v[side] for k, v in (r.get("codecs") or {}).items() for side in ("send_ms", "recv_ms")}


@dataclasses.dataclass(frozen=True)
class Mode:
    """What ``--compare NAME`` runs from each tree and what it keeps of it."""
    rounds: int                                  # default --repeats (--quick: 1)
    settings: Callable[[bool], dict]             # by --quick; "unit" is the unit of every measure
    run: Callable[[str, bool, str], dict]        # (tree, quick, what) -> the child's result ("error": it failed)
    measures: Callable[[dict], dict]             # the child's result -> {row: number}
    row_label: str                               # the README table's first column
    what: Callable[[dict], str]                  # what a round runs, for the README (from the settings)
    definitions: dict | None = None


def _codec_specs(quick: bool) -> tuple[str, ...]:
    return QUICK_CODECS if quick else wire.CODECS


MODES = {
    "pipeline": Mode(
        rounds=3,
        settings=lambda quick: {"bench": "pipeline --json --repeats 1" + (" --quick" if quick else ""),
                                "unit": "tokens/s"},
        run=run_pipeline,
        measures=lambda r: (r.get("summary") or {}).get("tokens_per_s") or {},
        row_label="variant", what=lambda s: "`bench pipeline` on the CPU"),
    "codecs": Mode(
        rounds=4,
        settings=lambda quick: {
            "bench": f"python -m crucible.bench.wire --codecs {','.join(_codec_specs(quick))} "
                     f"--frames {CODEC_FRAMES[quick]}",
            "unit": "ms", "codecs": list(_codec_specs(quick)), "dtypes": list(wire.CODEC_DTYPES),
            "shape": list(wire.CODEC_SHAPE), "frames": CODEC_FRAMES[quick], "threads": 1},
        run=lambda tree, quick, what: wire.run_codecs(_codec_specs(quick), CODEC_FRAMES[quick], what, tree=tree),
        measures=codec_times,
        row_label="codec/dtype, side",
        what=lambda s: (f"a `{s.get('shape')}` frame sent and received with each codec on the CPU, one thread, "
                        f"the median of {s.get('frames')} frames a round,"),
        definitions={"send_ms, recv_ms": "per round, the median over the frames of wire.encode_frame / "
                                         "wire.parse_frame + wire.from_wire with the codec (CPU)"}),
    "startup": Mode(
        rounds=8,
        settings=lambda quick: {"bench": "python -c STARTUP_CHILD (crucible/bench/revisions.py)", "unit": "s",
                                "stage": [1, 4], "model": "default", "threads": 1},
        run=lambda tree, quick, what: run_startup(tree, what),
        measures=lambda r: {k: r[k] for k in STARTUP_MEASURES if k in r},
        row_label="measure",
        what=lambda s: ("a fresh process doing on the CPU what a worker does before its first step: its imports, "
                        "the default model's stage 1 of 4, the optimizer, one microbatch and one step, one thread,"),
        definitions={
            "cpu_s": "CPU seconds of a fresh process (user + system, time.process_time) from its start to after "
                     "the optimizer step: a worker's imports, the default model's stage 1 of 4, the optimizer, one "
                     "microbatch forward and backward, one step (one thread)",
            "cpu_import_s": "the same, up to the end of the imports",
            "wall_s": "wall seconds from the first line of the child to after the step (interpreter start-up "
                      "not included)"}),
}
COMPARE = tuple(MODES)


def summarise(rounds: list[dict]) -> dict:
    """Per variant: both sides' tokens/s by round, their medians, and the head's
    paired gap to the base. `rounds`: [{"base": tokens_per_s, "head": tokens_per_s}]."""
    names = [k for k in rounds[0]["base"] if all(k in r["base"] and k in r["head"] for r in rounds)] \
        if rounds else []
    out = {}
    for k in names:
        base = [r["base"][k] for r in rounds]
        head = [r["head"][k] for r in rounds]
        gap = common.paired_gap(head, base)
        out[k] = {"base": base, "head": head, "base_median": statistics.median(base),
                  "head_median": statistics.median(head), "head_vs_base": gap}
    diffs = {v["head_vs_base"]["difference"] for v in out.values()}
    verdict = None if not out else ("within noise" if diffs == {"within noise"} else
                                    "lower" if "lower" in diffs and "higher" not in diffs else
                                    "higher" if "higher" in diffs and "lower" not in diffs else "mixed")
    return {"variants": out, "verdict": verdict}


def main(args) -> int:
    common.exit_on_sigterm()
    from crucible import exits

    base_rev = getattr(args, "base", None)
    if not base_rev:
        print("crucible bench revisions: --base REV is required (the revision to compare this checkout with)",
              file=sys.stderr)
        return exits.USAGE
    base = resolve(base_rev)
    if base is None:
        print(f"crucible bench revisions: {base_rev!r} is not a commit of this checkout ({ROOT})", file=sys.stderr)
        return exits.USAGE
    quick = bool(getattr(args, "quick", False))
    compare = getattr(args, "compare", None) or "pipeline"
    mode = MODES[compare]
    n = getattr(args, "repeats", None) or (1 if quick else mode.rounds)
    settings = {"compare": compare, **mode.settings(quick)}
    result: dict = {
        "bench": "revisions", "quick": quick, "environment": common.environment(),
        "settings": {**settings, "rounds": n, "order": "rotated each round"},
        "base": {"rev": base_rev, "commit": base}, "head": {"commit": common.git_commit(), "tree": ROOT},
    }
    if mode.definitions:
        result["definitions"] = mode.definitions
    errors: list[str] = []
    rounds, runs = [], []
    tree = tempfile.mkdtemp(prefix="crucible-base-")
    try:
        added = _git("worktree", "add", "--detach", "--force", tree, base)
        if added.returncode != 0:
            print(f"crucible bench revisions: cannot check out {base[:10]}: {added.stderr.strip()}", file=sys.stderr)
            return exits.ERROR
        trees = {"base": tree, "head": ROOT}
        commits = {"base": _tree_commit(tree), "head": result["head"]["commit"]}
        for i in range(n):
            got = {}
            for side in common.rotated(["base", "head"], i):
                common.progress(f"round {i + 1}/{n}: {compare} at the {side} ({trees[side]})")
                load = os.getloadavg()
                r = mode.run(trees[side], quick, f"round {i + 1} {side}: {compare}")
                if "error" in r:
                    errors.append(r["error"])
                    continue
                got[side] = mode.measures(r)
                runs.append(_run_record(i, side, commits[side], load, r, settings["unit"], got[side]))
            if len(got) == 2:
                rounds.append(got)
    finally:
        _git("worktree", "remove", "--force", tree)
        shutil.rmtree(tree, ignore_errors=True)
        _git("worktree", "prune")
    result["runs"] = runs
    result["summary"] = summarise(rounds)
    return common.finish(result, errors, args, print_table=_table, round_nd=4)


def _run_record(i: int, side: str, commit: str | None, load: tuple, r: dict, unit: str, measured: dict) -> dict:
    """One side of one round: where it ran (a child that reports its own
    environment, ``bench pipeline``, is taken at its word), the load around
    it, and what it measured, keyed by the unit."""
    env = r.get("environment") or {}
    rec = {"round": i + 1, "side": side, "commit": env.get("commit") or commit,
           "loadavg_start": env.get("loadavg_start") or [round(x, 2) for x in load],
           "loadavg_end": env.get("loadavg_end") or [round(x, 2) for x in os.getloadavg()],
           unit: measured}
    contended = (r.get("summary") or {}).get("contended")
    if contended is not None:
        rec["contended"] = contended
    return rec


def _tree_commit(tree: str) -> str | None:
    """The commit a source tree is at (the codec child does not say)."""
    try:
        r = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def _rows(s: dict) -> list[tuple[str, dict, str, str]]:
    """Per variant of a summary: its name, its entry, the head's gap (mean ±
    half-width) and whether it is told apart from noise."""
    return [(k, v, common.fmt_rel(v["head_vs_base"]["mean"], v["head_vs_base"]["ci95_halfwidth"], 1),
             v["head_vs_base"]["difference"]) for k, v in s["variants"].items()]


def _unit(r: dict) -> str:
    return r["settings"].get("unit", "tokens/s")


def _num(x: float, unit: str) -> str:
    return f"{x:,.2f}" if unit in ("ms", "s") else f"{x:,.0f}"


def _table(r: dict, f) -> None:
    s, unit = r["summary"], _unit(r)
    print(f"head {str(r['head']['commit'])[:10]} against base {r['base']['commit'][:10]} "
          f"({r['settings']['rounds']} rounds):", file=f)
    for k, v, gap, diff in _rows(s):
        print(f"  {k:24s} base {_num(v['base_median'], unit):>10s}  head {_num(v['head_median'], unit):>10s} {unit}"
              f"  {gap} ({diff})", file=f)
    print(f"verdict: {s['verdict']}", file=f)


def readme_part(r: dict, name: str = "revisions") -> str:
    from crucible.bench.readme import _provenance

    s, unit = r["summary"], _unit(r)
    rows = [f"| {k} | {_num(v['base_median'], unit)} | {_num(v['head_median'], unit)} | {gap} | {diff} |"
            for k, v, gap, diff in _rows(s)]
    compare = r["settings"].get("compare", "pipeline")
    what = MODES[compare].what(r["settings"])
    flag = "" if compare == "pipeline" else f" --compare {compare}"
    return "\n".join([
        f"`crucible bench revisions --base {r['base']['rev']}{flag}` ({what} at "
        f"`{r['base']['commit'][:10]}` and at the head, {r['settings']['rounds']} interleaved rounds; the gap is "
        f"paired round by round, mean ± 95 % half-width; {_provenance(r)}; `bench/results/{name}.json`):",
        "",
        f"| {MODES[compare].row_label} | base {unit} | head {unit} | head vs base | |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Verdict: {s['verdict']}.",
    ]) + "\n"
