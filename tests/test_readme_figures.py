"""The README's benchmark figures come from bench/results (crucible bench readme)."""

from __future__ import annotations

import os
import re

from crucible.bench import readme

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_every_generated_part_matches_its_result_file():
    text = _readme()
    names = [m.group("name") for m in readme.PART.finditer(text)]
    assert names, "no generated part in the README"
    _, changed = readme.render_readme(text, ROOT)
    assert not changed, f"README figures differ from bench/results for {changed}: run `crucible bench readme`"


def test_a_figure_edited_by_hand_is_caught():
    text = _readme()
    m = next(readme.PART.finditer(text))
    body = m.group("body")
    digit = re.search(r"\d", body)
    edited = body[:digit.start()] + str((int(digit.group()) + 1) % 10) + body[digit.end():]
    text = text[:m.start("body")] + edited + text[m.end("body"):]
    _, changed = readme.render_readme(text, ROOT)
    assert changed == [m.group("name")]


def test_every_result_file_the_readme_names_exists():
    for path in sorted(set(re.findall(r"bench/results/[a-z0-9_-]+\.json", _readme()))):
        assert os.path.exists(os.path.join(ROOT, path)), f"README names {path}, which is not in the repo"


def _report_demo():
    import importlib.util
    spec = importlib.util.spec_from_file_location("report_demo", os.path.join(ROOT, "docs", "report_demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_report_figure_paragraph_quotes_its_result_file():
    import json
    with open(os.path.join(ROOT, "bench", "results", "report-demo.json")) as f:
        d = json.load(f)
    fig, text = d["figures"], " ".join(_readme().split())
    lo, hi = fig["detected_s_range"]
    joined = [k["replacement_joined_s"] for k in fig["kills"]]
    for quoted in (f"detected {lo:.2f}-{hi:.2f} s later", f"paused it for {fig['paused_s'][0]:.1f} s",
                   f"entered {min(joined):.1f}-{max(joined):.1f} s after their kill",
                   f"{fig['checkpoints_committed']} checkpoints, the last the end save at step "
                   f"{fig['last_checkpoint_step']}", f"held-out loss {fig['heldout_loss_end']['0']:.3f}",
                   f"commit `{d['environment']['commit'][:10]}`",
                   f"measured the restart time R at {d['interval']['restart_measured_s']:.2f} s"):
        assert quoted in text, f"the README's report paragraph does not say {quoted!r} (report-demo.json)"


def test_the_report_demo_reads_kills_detection_and_pauses_off_the_events():
    ev = [{"event": "step", "time": 100.0, "replica": 0, "step": 1},
          {"event": "chaos", "time": 110.0, "target": "r1s3"},
          {"event": "fault", "time": 110.25, "replica": 1, "stage": 3},
          {"event": "route_change", "time": 110.25, "states": {"0": "training", "1": "paused"}},
          {"event": "ckpt_commit", "time": 111.0, "step": 40},
          {"event": "replacement_ready", "time": 114.0, "replica": 1, "stage": 3, "source": "r0s3",
           "startup_s": {"total": 3.5, "loadavg": 2.0}},
          {"event": "worker_joined", "time": 114.5, "replica": 1, "stage": 3},
          {"event": "chaos", "time": 120.0, "target": "r0s1"},
          {"event": "fault", "time": 120.5, "replica": 0, "stage": 1},
          {"event": "route_change", "time": 120.5, "states": {"0": "training", "1": "training"}},
          {"event": "eval", "time": 121.0, "replica": 0, "step": 50, "loss": 2.5},
          {"event": "eval", "time": 121.0, "replica": 1, "step": 50, "loss": 2.5},
          {"event": "ckpt_commit", "time": 122.0, "step": 50}]
    fig = _report_demo().figures(ev)
    assert [(k["target"], k["at_s"], k["detected_s"], k["replica_while_missing"], k["replacement_joined_s"])
            for k in fig["kills"]] == [("r1s3", 10.0, 0.25, "paused", 4.5),
                                      ("r0s1", 20.0, 0.5, "skipped the stage", None)]
    assert fig["paused_s"] == [4.5] and fig["detected_s_range"] == [0.25, 0.5]
    assert (fig["checkpoints_committed"], fig["last_checkpoint_step"]) == (2, 50)
    assert fig["heldout_loss_end"] == {"0": 2.5, "1": 2.5}


def test_the_extras_table_lists_what_pyproject_declares():
    """Each row of the README's install table names exactly the packages that
    pyproject.toml puts in that extra (the base row: the dependencies)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = {"": project["dependencies"], **project["optional-dependencies"]}

    def names(reqs):
        return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower() for r in reqs}

    rows = dict(re.findall(r"^\| (\*\(none\)\*|`[a-z]+`) \| ([^|]+) \|", _readme(), re.M))
    assert rows, "no extras table in the README"
    for extra, reqs in declared.items():
        cell = rows[f"`{extra}`" if extra else "*(none)*"]
        listed = {m.lower() for m in re.findall(r"([A-Za-z][A-Za-z0-9_.-]*) (?:≥|==)", cell)}
        if extra == "test":                     # "and what `cluster` and `report` bring"
            listed |= names(declared["cluster"]) | names(declared["report"])
        assert listed == names(reqs), f"README's row for {extra or 'the base install'}: {cell.strip()}"


def test_the_commands_block_names_every_flag():
    """Every option of every subcommand (but slurm's and k8s's own, in "On a
    cluster") is in the README's Commands block, and every subcommand is."""
    import argparse

    from crucible import cli

    text = _readme()
    block = text[text.index("## Commands"):]
    block = block[block.index("```"):block.index("```", block.index("```") + 3)]
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"crucible {name} " in block, f"`crucible {name}` is not in the README's Commands block"
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", block))
        assert not missing, f"crucible {name}: {missing} not in the README's Commands block"
