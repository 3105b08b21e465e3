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

from crucible.bench.common import ROOT, fmt_mean_sd, fmt_rel

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
    ] + _startup_line(s.get("startup_p50_s"), r["settings"].get("overrides", []))) + "\n"


def _startup_line(split: dict | None, overrides: list) -> list[str]:
    """A replacement's start-up, phase by phase (medians over the resubmitted jobs)."""
    if not split:
        return []
    phases = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in split.items()
                       if k not in ("total", "cpu_s", "loadavg"))
    paced = [o for o in overrides if o.startswith("net.link_mbps=")]
    return ["", f"A resubmitted worker's start-up, medians: {split.get('total', 0):.1f} s from process start to "
                f"ready ({phases}), {split.get('cpu_s', 0):.1f} CPU-seconds, load average "
                f"{split.get('loadavg', 0):.1f}" + (f"; the job's data plane paced with `{paced[0]}`" if paced else "")
                + "."]


def _spread(x) -> str:
    return "" if x is None else f" (±{x * 50:.1f}%)"     # max/min − 1 over the repeats, as ± half of it


def pipeline(r: dict, name: str = "pipeline") -> str:
    s, st, m = r["summary"], r["settings"], r["model"]
    tps, spr, rel = s["tokens_per_s"], s["tokens_per_s_spread"], s["relative_to_plain"]
    label = {"S1": "S = 1 (one worker)", "S2": "S = 2", "S2_pinned": "S = 2, one core per worker (pinned)",
             "S4": "S = 4 (4 workers on 2 cores)" if r["runs"].get("S4", {}).get("oversubscribed") else "S = 4"}
    rows = [f"| one plain process (no gRPC) | {tps['plain']:,.0f}{_spread(spr.get('plain'))} | 1.00 |"]
    rows += [f"| {label.get(k, k)} | {tps[k]:,.0f}{_spread(spr.get(k))} | {rel[k]:.2f} |" for k in rel]
    frac = s["pinned_S2_ser_transport_fraction"]
    return "\n".join([
        f"`crucible bench pipeline --json` (1 replica of the default model, {m['params'] / 1e6:.2f} M parameters, "
        f"{m['activation_bytes_per_microbatch'] // 1024} KiB of activations per microbatch boundary; {st['steps']} "
        f"steps, the first {st['warmup_steps_skipped']} not counted; every variant {st.get('repeats', 1)} times, "
        f"interleaved: median tokens/s, ± half the spread between repeats; {_provenance(r)}; "
        f"`bench/results/{name}.json`):",
        "",
        "| | tokens/s | vs one plain process |",
        "|---|---|---|",
        *rows,
        "",
        f"S = 1 against the plain process: {s.get('S1_vs_plain', 'n/a')} (the repeats of either differ by up to "
        f"{_pct(s.get('S1_vs_plain_noise'))}). At S = 2 pinned one core per worker, serialization + transport "
        f"is {frac * 100:.1f}% of the step time at most (target ≤ {s['pinned_S2_target'] * 100:.0f}%: "
        f"{_verdict(s['pinned_S2_meets_target'])}). Loopback: {s['loopback_MBps']:,.0f} MB/s one way on one "
        f"stream ({s['loopback_pingpong_ms']:.2f} ms ping-pong of a microbatch frame).",
    ]) + "\n"


def ckpt(r: dict, name: str = "ckpt") -> str:
    sv, ru = r["saves"], r["runs"]
    med = {k: sv[k]["median"] for k in ("floor_copy_s", "snapshot_stall_s", "dcp_async_save_stall_s",
                                        "dcp_cached_staging_stall_s", "persist_s")}
    best = "cached staging" if sv["dcp_best"] == "dcp_cached_staging_stall_s" else "as it comes"
    rows = []
    for n, x in ru["runs"].items():
        label = "off" if n == "off" else (f"continuous, `minimum_interval_s = {x['minimum_interval_s']:g}`"
                                          + (" (default)" if n.endswith("default") else ""))
        st = x["step_s"]
        rows.append(
            f"| {label} | {st['p50'] * 1e3:.1f} / {st['p95'] * 1e3:.1f} / {st['p99'] * 1e3:.1f} ms | "
            + ("— | — | — | — |" if n == "off" else
               f"{_pct(x['slowdown_vs_off'])} / {_pct(x['p95_slowdown_vs_off'])} / {_pct(x['p99_slowdown_vs_off'])}"
               f" | {_pct(x['wall_slowdown_vs_off'])} | {x['commits']} | "
               f"{_s(x['median_stall_s'] * 1e3 if x['median_stall_s'] is not None else None, 1, ' ms')} |"))
    from crucible.bench.ckpt import default_run   # (ckpt imports torch only inside its functions)

    dflt = default_run(ru["runs"])
    return "\n".join([
        f"`{r['command']}` ({_provenance(r)}; `bench/results/{name}.json`). Part 1, one process, a shard of "
        f"{sv['state_bytes'] / 1e6:.0f} MB ({sv['tensors']} tensors), median of {sv['saves']} saves after a "
        f"warm-up:",
        "",
        "| | median |",
        "|---|---|",
        f"| plain copy into preallocated buffers (the floor) | {med['floor_copy_s'] * 1e3:.1f} ms |",
        f"| **Crucible's snapshot stall** | **{med['snapshot_stall_s'] * 1e3:.1f} ms** "
        f"({sv['stall_over_floor']:.2f}x the floor) |",
        f"| `torch.distributed.checkpoint.async_save` as it comes, until it returns | "
        f"{med['dcp_async_save_stall_s'] * 1e3:.1f} ms (done after {sv['dcp_async_save_total_s']['median']:.2f} s) |",
        f"| the same with its staging reused (one `DefaultStager`), warmed | "
        f"{med['dcp_cached_staging_stall_s'] * 1e3:.1f} ms (done after "
        f"{sv['dcp_cached_staging_total_s']['median']:.2f} s) |",
        f"| Crucible's background persist (header, data, SHA-256, fsync, rename) | {med['persist_s']:.2f} s "
        f"({sv['persist_GBps']:.1f} GB/s) |",
        "",
        f"Targets: stall ≤ 1.5x the floor ({sv['stall_over_floor']:.2f}x: "
        f"{_verdict(sv['targets']['stall_le_1.5x_floor'])}) and below DCP's at its best ({best}; "
        f"{sv['stall_over_dcp_stall']:.2f}x of it: {_verdict(sv['targets']['stall_below_dcp_async_save'])}).",
        "",
        f"Part 2, real jobs ({ru['replicas']} replicas x {ru['stages']} stages, {ru['steps']} steps, the first "
        f"{ru['warmup_steps']} not counted; {ru['repeats']} runs per setting, interleaved):",
        "",
        "| checkpointing | step p50 / p95 / p99 | slowdown vs off, p50 / p95 / p99 | total wall vs off | "
        "checkpoints | median stall |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Target: continuous checkpointing at the default interval slows steps by ≤ 5%: median step "
        f"{_pct(dflt['slowdown_vs_off'])}, {_verdict(ru.get('verdict_default_slowdown_le_5pct'))}; total wall "
        f"time {_pct(dflt['wall_slowdown_vs_off'])}, {_verdict(ru.get('verdict_default_wall_slowdown_le_5pct'))} "
        f"(runs of one setting differ by up to {_pct(ru.get('noise_step'))} in median step and "
        f"{_pct(ru.get('noise_wall'))} in wall time).",
    ]) + "\n"


def outer(r: dict, name: str = "outer") -> str:
    st, s, b = r["settings"], r["summary"], r["bytes"]
    stage = s["codec_MBps"]["stage"]
    big = s["codec_MBps"]["10M"]
    tuning = []
    for mode, label in (("sparseloco", "SparseLoCo"), ("diloco", "DiLoCo (Nesterov 0.9)")):
        by_lr = s["tuning_validation_loss_by_lr"].get(mode) or {}
        best = s["tuned_lr"].get(mode)
        cells = " / ".join((f"**{v:.3f}**" if float(lr) == best else f"{v:.3f}") if v is not None else "failed"
                           for lr, v in by_lr.items())
        edge = " (at the grid's edge)" if s["tuned_lr_at_grid_edge"].get(mode) else ""
        tuning.append(f"| {label} | {' / '.join(by_lr)} | {cells} | {best:g}{edge} |")
    g = s.get("sparseloco_vs_diloco") or {}
    hw = g.get("ci95_halfwidth")
    seeds = ", ".join(str(x) for x in st["seeds"])
    return "\n".join([
        f"`crucible bench outer --json` (default model, {st['replicas']} replicas x {st['stages']} stages, "
        f"{st['steps']} inner steps, H = {st['outer_H']} ({st['outer_rounds']} rounds); {_provenance(r)}; "
        f"{r['elapsed_s'] / 60:.0f} minutes; `bench/results/{name}.json`):",
        "",
        f"* Bytes per outer step per replica: SparseLoCo {b['sparseloco']['bytes_sent_per_replica_step']:,.0f} "
        f"vs dense fp32 {b['dense_fp32_bytes']:,}: **{b['ratio']:.0f}x fewer** (target ≥ 100x: "
        f"{_verdict(b['meets_target'])}). Codec, one thread, one stage "
        f"({r['codec']['sizes']['stage']['numel'] / 1e3:,.0f} K values): error feedback + encode "
        f"{stage['encode']:,.0f} MB/s, decode {stage['decode']:,.0f} MB/s of dense fp32 input; 10 M values: "
        f"{big['encode']:,.0f} / {big['decode']:,.0f} MB/s.",
        f"* Tuning: the same number of outer learning rates for each method, each run at seed "
        f"{st['tuning']['seed']} and judged on the validation half of the held-out tail "
        f"({st['eval_windows']} windows):",
        "",
        "| method | outer.lr tried | validation loss | kept |",
        "|---|---|---|---|",
        *tuning,
        "",
        f"* Reported: each method at its kept lr, seeds {seeds}, on the test half (mean ± sd over the seeds): "
        f"SparseLoCo {fmt_mean_sd(s['sparseloco_loss'])}, DiLoCo {fmt_mean_sd(s['diloco_loss'])}. Seed by seed "
        f"SparseLoCo is {fmt_rel(g.get('mean'), hw)}" + (" (95%)" if hw is not None else "")
        + f" against DiLoCo: {g.get('difference', 'n/a')}; target within 2%: {_verdict(s.get('loss_verdict'))}. "
        f"For reference: one replica with the batch of both (equal tokens) {fmt_mean_sd(s['single_replica_loss'])}; "
        f"two independent replicas (no outer sync, each on its own half of the data, seed {st['seeds'][0]}) "
        f"{s['independent_replicas_loss']:.3f}.",
    ]) + "\n"


def launch(r: dict, name: str = "launch") -> str:
    """The default job's figures (``crucible bench launch``)."""
    st, s = r["settings"], r["summary"]
    loss0, held = s["loss"]["0"], s["heldout"]
    last = str(st["steps"] - 1)
    held_s = (f"{held['0']['loss']:.2f} on both replicas (identical weights)" if s.get("replicas_agree_heldout")
              else ", ".join(f"r{k} {h['loss']:.3f}" for k, h in held.items() if h))
    return (
        f"`crucible launch` with no arguments trains it as {st['replicas']} replicas x {st['stages']} stages for "
        f"{st['steps']} steps with SparseLoCo outer sync every 10 steps and continuous checkpointing. On this "
        f"2-core machine that takes {s['wall_s'] / 60:.1f} minutes ({st['repeats']} runs: median wall time, "
        f"{s['tokens_per_s_per_replica']:,.0f} tokens/s per replica{_spread(s.get('tokens_per_s_spread'))}); "
        f"the loss goes from {loss0['0']:.2f} (≈ ln 256) to {loss0[last]:.2f} at step {st['steps']}, held-out "
        f"{held_s} (`crucible bench launch`, {_provenance(r)}; `bench/results/{name}.json`; the losses are the "
        f"same in every run: {'yes' if s['identical_across_repeats'] else '**no**'}). Early on the training loss "
        f"jumps up right after each outer round (step 9: {loss0['9']:.2f}, step 10: {loss0['10']:.2f}): a round "
        f"applies only the top ~1.6% of each replica's accumulated update to the global weights and resets the "
        f"replicas to them; error feedback returns the rest over later rounds, and the jumps shrink as training "
        f"goes on (step 99 → 100: {loss0['99']:.2f} → {loss0['100']:.2f}).\n")


def _activations(r: dict, name: str = "activations") -> str:
    from crucible.bench.activations import readme_part    # (it imports this module's helpers)

    return readme_part(r, name)


def _chaos(r: dict, name: str = "chaos") -> str:
    from crucible.bench.chaos import readme_part

    return readme_part(r, name)


def _revisions(r: dict, name: str = "revisions") -> str:
    from crucible.bench.revisions import readme_part

    return readme_part(r, name)


def _gpu(r: dict, name: str = "gpu") -> str:
    from crucible.bench.gpu import readme_part   # gpu imports this module's helpers
    return readme_part(r, name)


def _wire(r: dict, name: str = "wire") -> str:
    from crucible.bench.wire import readme_part

    return readme_part(r, name)


RENDERERS: dict[str, Callable[[dict, str], str]] = {
    "network": network, "soak": soak, "soak_memory": soak_memory, "slurm": slurm, "slurm_full_load": slurm,
    "pipeline": pipeline, "ckpt": ckpt, "outer": outer, "launch": launch,
    "activations": _activations, "chaos": _chaos, "revisions": _revisions, "revisions_codecs": _revisions,
    "revisions_startup": _revisions, "gpu": _gpu,
    "wire": _wire,
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
