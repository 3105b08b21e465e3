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
    for path in sorted(set(re.findall(r"bench/results/[a-z0-9_]+\.json", _readme()))):
        assert os.path.exists(os.path.join(ROOT, path)), f"README names {path}, which is not in the repo"


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
