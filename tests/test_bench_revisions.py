"""`crucible bench revisions --base REV`: the CPU pipeline at a git revision and
at this checkout, interleaved, with the head's paired gap to the base.

The smoke run (opt-in, CRUCIBLE_BENCH_TESTS=1) compares HEAD~1 with the
checkout: two quick `bench pipeline` runs, about a minute on an idle 2-core
machine; each side's run must report its own commit (the base ran from the
worktree, not from this tree), and the worktree is gone afterwards.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import ROOT, bench_smoke, child_env, crucible_cmd, positive, run_bench
from crucible.bench import revisions

TIMEOUT_S = 420


def test_summary_pairs_the_rounds_and_says_within_noise_when_it_is():
    same = [{"base": {"S1": 100.0 + i, "S2": 200.0}, "head": {"S1": 100.0 - i, "S2": 300.0 + 5 * i}}
            for i in (-2, 0, 2)]
    s = revisions.summarise(same)
    s1, s2 = s["variants"]["S1"], s["variants"]["S2"]
    assert s1["base"] == [98.0, 100.0, 102.0] and s1["head"] == [102.0, 100.0, 98.0]
    assert s1["base_median"] == s1["head_median"] == 100.0
    assert s1["head_vs_base"]["difference"] == "within noise"        # mean 0, the rounds disagree
    assert s2["head_vs_base"]["difference"] == "higher"              # +50 % every round
    assert s2["head_vs_base"]["mean"] == pytest.approx(0.5)
    assert s["verdict"] == "higher"
    lower = revisions.summarise([{"base": {"S1": 100.0}, "head": {"S1": 80.0 + i}} for i in range(3)])
    assert lower["verdict"] == "lower"
    assert revisions.summarise([])["verdict"] is None


@pytest.mark.parametrize("args,says", [((), "--base REV is required"),
                                       (("--base", "no-such-rev"), "'no-such-rev' is not a commit")])
def test_a_bad_base_is_one_line_and_exit_2(args, says):
    t0 = time.monotonic()
    p = subprocess.run(crucible_cmd("bench", "revisions", *args), cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL, start_new_session=True)
    assert p.returncode == 2 and time.monotonic() - t0 < 30
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], p.stderr
    assert p.stdout == ""


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


@bench_smoke
def test_revisions_runs_each_side_from_its_own_tree(tmp_path):
    base, head = _git("rev-parse", "HEAD~1"), _git("rev-parse", "HEAD")
    before = _git("worktree", "list")
    r = run_bench("revisions", tmp_path / "revisions.json", TIMEOUT_S, extra=("--base", "HEAD~1"))
    assert r["errors"] == []
    assert r["base"] == {"rev": "HEAD~1", "commit": base} and r["head"]["commit"].startswith(head)
    assert r["settings"]["rounds"] == 1 and r["environment"]["commit"].startswith(head)
    by_side = {run["side"]: run for run in r["runs"]}
    assert by_side["base"]["commit"] == base                 # ran from the worktree at the base
    assert by_side["head"]["commit"].startswith(head)
    v = r["summary"]["variants"]
    assert set(v) >= {"S1", "S2", "plain"}
    for k, x in v.items():
        assert positive(x["base_median"]) and positive(x["head_median"]), k
        assert x["head_vs_base"]["difference"] == "within noise"     # one round: nothing to tell them apart
    assert _git("worktree", "list") == before                # the base's worktree is gone
    assert "head vs base" in revisions.readme_part(r)


def test_codec_rows_flatten_the_codec_childs_result_and_render_in_ms():
    child = {"kept": True, "codecs": {"int8/float32": {"send_ms": 10.5, "recv_ms": 5.25, "payload_bytes": 1,
                                                       "raw_bytes": 8}}}
    assert revisions.codec_times(child) == {"int8/float32 send_ms": 10.5, "int8/float32 recv_ms": 5.25}
    rounds = [{"base": {"int8/float32 recv_ms": 6.0 + i}, "head": {"int8/float32 recv_ms": 3.0 + i / 2}}
              for i in range(3)]
    r = {"base": {"rev": "abc", "commit": "abc1234567"}, "environment": {"commit": "def", "date": "2026-12-06"},
         "settings": {"compare": "codecs", "unit": "ms", "shape": [4, 512, 1024], "frames": 20, "rounds": 3},
         "summary": revisions.summarise(rounds)}
    assert r["summary"]["verdict"] == "lower"
    part = revisions.readme_part(r, "revisions_codecs")
    assert "--compare codecs" in part and "| codec/dtype, side | base ms | head ms |" in part
    assert "| int8/float32 recv_ms | 7.00 | 3.50 |" in part and "bench/results/revisions_codecs.json" in part


@bench_smoke
def test_revisions_compares_the_codecs_from_each_tree(tmp_path):
    base, head = _git("rev-parse", "HEAD~1"), _git("rev-parse", "HEAD")
    before = _git("worktree", "list")
    r = run_bench("revisions", tmp_path / "codecs.json", TIMEOUT_S, extra=("--base", "HEAD~1", "--compare", "codecs"))
    assert r["errors"] == [] and r["settings"]["compare"] == "codecs" and r["settings"]["unit"] == "ms"
    by_side = {run["side"]: run for run in r["runs"]}
    assert by_side["base"]["commit"] == base and by_side["head"]["commit"].startswith(head)
    v = r["summary"]["variants"]
    assert set(v) == {f"{c}/{d} {side}" for c in ("raw", "int8") for d in ("float32", "bfloat16")
                      for side in ("send_ms", "recv_ms")}
    for k, x in v.items():
        assert positive(x["base_median"]) and positive(x["head_median"]), k
    assert _git("worktree", "list") == before


def test_startup_rows_render_in_seconds():
    rounds = [{"base": {"cpu_s": 3.0 + i / 10, "wall_s": 3.1}, "head": {"cpu_s": 1.8 + i / 10, "wall_s": 1.9}}
              for i in range(3)]
    r = {"base": {"rev": "abc", "commit": "abc1234567"}, "environment": {"commit": "def", "date": "2026-12-06"},
         "settings": {"compare": "startup", "unit": "s", "rounds": 3}, "summary": revisions.summarise(rounds)}
    assert r["summary"]["verdict"] == "lower"
    part = revisions.readme_part(r, "revisions_startup")
    assert "--compare startup" in part and "| measure | base s | head s |" in part
    assert "| cpu_s | 3.10 | 1.90 |" in part and "bench/results/revisions_startup.json" in part


def test_the_startup_child_runs_from_this_tree_and_reports_its_seconds():
    """The child `--compare startup` runs from each tree, from this one: a
    worker's imports, a stage of the default model, its optimizer and one step."""
    r = revisions.run_startup(ROOT, "start-up")
    assert "error" not in r, r
    assert 0 < r["cpu_import_s"] < r["cpu_s"] and r["wall_s"] > 0


@bench_smoke
def test_revisions_compares_the_startup_from_each_tree(tmp_path):
    base, head = _git("rev-parse", "HEAD~1"), _git("rev-parse", "HEAD")
    r = run_bench("revisions", tmp_path / "startup.json", TIMEOUT_S, extra=("--base", "HEAD~1", "--compare", "startup"))
    assert r["errors"] == [] and r["settings"]["compare"] == "startup" and r["settings"]["unit"] == "s"
    assert r["settings"]["rounds"] == 1
    by_side = {run["side"]: run for run in r["runs"]}
    assert by_side["base"]["commit"] == base and by_side["head"]["commit"].startswith(head)
    v = r["summary"]["variants"]
    assert set(v) == {"cpu_s", "cpu_import_s", "wall_s"}
    for k, x in v.items():
        assert positive(x["base_median"]) and positive(x["head_median"]), k
