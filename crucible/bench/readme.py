"""`crucible bench readme [--check]`: the README's benchmark figures, generated
from ``bench/results/*.json``.

A generated part of README.md sits between two markers::

    <!-- bench:network -->
    ... (written by this command: edit the renderer, not the text) ...
    <!-- /bench:network -->

Each name has a renderer here that reads its result file and writes the
part: the figures, the settings they were measured with, the commit, and a
verdict per target. ``crucible bench readme`` rewrites every part;
``--check`` changes nothing and exits 1, naming the part, when a figure in
the README differs from what its result file gives (a test runs it, so a
README figure never drifts from its file).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PART = re.compile(r"(<!-- bench:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def load(name: str, root: str = ROOT) -> dict:
    with open(os.path.join(root, "bench", "results", f"{name}.json")) as f:
        return json.load(f)


def _s(x, nd: int = 2, unit: str = " s") -> str:
    return "n/a" if x is None else f"{x:.{nd}f}{unit}"


def _pct(x, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x * 100:+.{nd}f}%"


def _verdict(ok) -> str:
    """A check: True/False/None, or a verdict string of ``common.verdict``."""
    if isinstance(ok, str):
        return "**missed**" if ok == "missed" else ok
    return {True: "met", False: "**missed**", None: "not measured"}[ok]


def _provenance(r: dict) -> str:
    env = r.get("environment", {})
    commit = (env.get("commit") or r.get("commit") or "?")[:10]
    load_ = env.get("loadavg_start") or env.get("loadavg")
    load_s = f", load average {load_[0]:.1f} at the start" if load_ else ""
    return f"commit `{commit}`, {env.get('date', '')[:10] or 'date not recorded'}{load_s}"


# ---- renderers ------------------------------------------------------------------------------


def network(r: dict, name: str = "network") -> str:
    s, t = r["summary"], r["targets"]
    rc, nc = s["route_change_s"], s["next_commit_s"]
    tab = s["step_s_p50"]
    rows = []
    for codec, v in tab.items():
        rows.append(f"| {codec} | {_s(v.get('unshaped'), 3)} | {_s(v.get('100mbit'), 3)} "
                    f"({v.get('100mbit_vs_unshaped') or 0:.2f}x) | {_s(v.get('10mbit'), 3)} "
                    f"({v.get('10mbit_vs_unshaped') or 0:.2f}x) |")
    runs = r.get("tls", {}).get("runs", [])
    n_on, n_off = sum(1 for x in runs if x["tls"]), sum(1 for x in runs if not x["tls"])
    cost, noise = s.get("tls_step_cost"), s.get("tls_noise")
    c = s["checks"]
    lines = [
        f"`crucible bench network --json` ({_provenance(r)}; `bench/results/{name}.json`):",
        "",
        f"* **Silent partitions**: {s['partitions']} partitions of a random inner worker, one every "
        f"{r['settings'].get('every_s', 30)} s, each {r['settings'].get('down_s', '?')} s down: partition → "
        f"route change p50 {_s(rc['p50'])} (max {_s(rc['max'])}; target ≤ heartbeat timeout + 0.5 s = "
        f"{t['route_change_p50_max_s']} s: {_verdict(c['route_change_p50'])}); → next committed step p50 "
        f"{_s(nc['p50'])} (max {_s(nc['max'])}). False evictions {s['false_evictions']}, lost commits "
        f"{s['lost_commits']}, processes or namespaces left {s['processes_left']} (targets 0: "
        f"{_verdict(c['false_evictions'] and c['lost_commits'] and c['processes_left'])}); goodput against the "
        f"failure-free run {s['goodput_vs_failure_free']:.2f}.",
        "* **Shaped link** (one inner link of the default 2 x 4 job, `tc htb`), step time p50 and against the "
        "same codec unshaped:",
        "",
        "| codec | unshaped | 100 Mbit/s | 10 Mbit/s |",
        "|---|---|---|---|",
        *rows,
        "",
        f"  Best codec at 10 Mbit/s: {s['best_codec_10mbit']}, {s['best_codec_10mbit_vs_unshaped']:.2f}x its "
        f"unshaped step (target ≤ {t['best_codec_10mbit_vs_unshaped_max']}x: {_verdict(c['best_codec_10mbit'])}).",
        f"* **TLS on the data plane**: step time {_pct(cost)} with mutual TLS ({n_on} runs with, {n_off} "
        f"without, interleaved; runs of the same setting differ by up to {_pct(noise)}); target ≤ "
        f"{t['tls_step_cost_max'] * 100:.0f}%: {_verdict(c['tls_step_cost'])}."
        + (f" Encryption alone costs {s['tls_data_plane_share_of_step'] * 100:.2f}% of a step (a stream of "
           f"the step's bytes, with and without TLS)." if s.get("tls_data_plane_share_of_step") is not None else ""),
    ]
    return "\n".join(lines) + "\n"


def soak(r: dict, name: str = "soak") -> str:
    x, t = r["soak"], r["targets"]
    st = r["settings"]
    inj = ", ".join(f"{k} {v}" for k, v in x["injected"].items())
    det = ", ".join(f"{k} {v}" for k, v in x["detected"].items())
    h = r.get("heldout") or {}
    ck = x["checkpoints"]
    return "\n".join([
        f"`crucible bench soak --minutes {st['minutes']:g} --gap {st['mean_gap_s']:g}` ({_provenance(r)}; "
        f"`bench/results/{name}.json`), {st['stress_processes']} spinning processes next to the job:",
        "",
        f"* faults injected {x['injected_total']} ({inj}); detected: {det};",
        f"* false evictions {x['false_evictions']}, commits lost {x['commits_lost']}, checkpoints committed "
        f"and still on disk {ck.get('on_disk', ck.get('checked', '?'))} of which failing `ckpt verify` "
        f"{ck['failing_verify']}, processes left {x['processes_left']};",
        f"* longest time without a committed step {_s(x['longest_without_commit_s'], 1)}; held-out loss at "
        f"step {h.get('step', '?')}: {h.get('soak', 0):.3f} against {h.get('failure_free', 0):.3f} "
        f"failure-free ({_pct(h.get('delta'))}).",
        "",
        "Targets: " + "; ".join(f"{k.replace('_', ' ')}: {_verdict(v)}" for k, v in t.items()) + ".",
    ]) + "\n"


def soak_memory(r: dict, name: str = "soak_memory") -> str:
    st = r["settings"]
    rows = [f"| {pid} | {v['seconds']:.0f} s | {v['after_1min_mb']:.1f} MB | {v['last_mb']:.1f} MB | "
            f"{v['growth_after_1min_mb']:+.1f} MB | {v['max_mb']:.1f} MB |" for pid, v in r["coordinator_rss"].items()]
    return "\n".join([
        f"`crucible bench soak --outer {next(o for o in st['overrides'] if o.startswith('outer.mode')).split('=')[1]}"
        f" --kinds none --minutes {st['minutes']:g}` (the default job, no faults; {_provenance(r)}; "
        f"`bench/results/{name}.json`), the coordinator's resident memory:",
        "",
        "| coordinator pid | sampled over | after 1 min | at the end | growth | max |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Target (flat: at most max(10 MB, 5%) of growth after the first minute): "
        f"{_verdict(r['targets'].get('coordinator_memory_flat'))}.",
    ]) + "\n"


def slurm(r: dict, name: str = "slurm") -> str:
    s = r["summary"]
    c = s["checks"]
    return "\n".join([
        f"`crucible bench slurm --json` ({r['settings']['scancels']} random `scancel`s of a "
        f"{r['settings']['replicas']} x {r['settings']['stages']} job's slots on the single-node dev cluster; "
        f"{_provenance(r)}; `bench/results/{name}.json`):",
        "",
        "| measure | p50 | max | target |",
        "|---|---|---|---|",
        f"| `scancel` of an inner slot → route change | {_s(s['route_change_inner_s']['p50'])} | "
        f"{_s(s['route_change_inner_s']['max'])} | ≤ {r['settings']['heartbeat_timeout_s'] + 0.5:g} s: "
        f"{_verdict(c['route_change_inner_le_hb_plus_0_5'])} |",
        f"| `scancel` of any slot → route change (or pause) | {_s(s['route_change_any_s']['p50'])} | "
        f"{_s(s['route_change_any_s']['max'])} | |",
        f"| `scancel` → supervisor's resubmission | {_s(s['resubmit_s']['p50'])} | {_s(s['resubmit_s']['max'])} | |",
        f"| resubmitted job starts → slot back in its route | {_s(s['job_start_to_route_s']['p50'])} | "
        f"{_s(s['job_start_to_route_s']['max'])} | ≤ 15 s: {_verdict(c['back_in_route_le_15s'])} |",
        "",
        f"Lost commits {s['lost_commits']} (target 0: {_verdict(c['no_lost_commit'])}), jobs left after "
        f"`crucible slurm down` {s['jobs_left_after_down']} (target 0: {_verdict(c['no_job_left'])}), "
        f"{s['checkpoints_committed']} checkpoints committed, the final one (step {s['final_checkpoint']}) "
        f"{'verifies' if s['final_checkpoint_verifies'] else 'does **not** verify'}.",
    ]) + "\n"


RENDERERS: dict[str, Callable[[dict, str], str]] = {
    "network": network, "soak": soak, "soak_memory": soak_memory, "slurm": slurm, "slurm_full_load": slurm,
}


def render_readme(text: str, root: str = ROOT) -> tuple[str, list[str]]:
    """The README with every generated part rewritten; the names of the parts that changed."""
    changed = []

    def one(m: re.Match) -> str:
        name = m.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"crucible bench readme: README part {name!r} has no renderer "
                             f"(known: {', '.join(RENDERERS)})")
        body = RENDERERS[name](load(name, root), name)
        if body != m.group("body"):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return PART.sub(one, text), changed


def main(args) -> int:
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    new, changed = render_readme(text)
    if getattr(args, "check", False):
        if changed:
            print(f"crucible bench readme: README figures differ from bench/results for: {', '.join(changed)} "
                  f"(run `crucible bench readme` to regenerate)", file=sys.stderr)
            return 1
        print("README figures match bench/results", file=sys.stderr)
        return 0
    if changed:
        with open(path, "w") as f:
            f.write(new)
    print(f"regenerated: {', '.join(changed) or 'nothing changed'}", file=sys.stderr)
    return 0
