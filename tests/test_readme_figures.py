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
