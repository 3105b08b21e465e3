"""Crucible run where CI never runs it: an ASCII-only terminal, a path that
is not ASCII and has spaces, standard streams closed or unwritable. Each
command must still do its work, or end on one line, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, child_env, crucible_cmd, run_bounded

CKPT = [o for o in TINY if not o.startswith("checkpoint.")] + ["checkpoint.enable_checkpointing=true"]


def _launch(run_dir: str, env: dict | None = None, shell_redirects: str = "", stdout=subprocess.PIPE):
    """A 1 x 2 launch of 4 steps; its redirects as a shell writes them (``>&-``)."""
    argv = crucible_cmd("launch", "--no-check", "--run-dir", run_dir, "--replicas", "1", "--stages", "2",
                        "--steps", "4", *CKPT)
    if shell_redirects:
        argv = ["sh", "-c", 'exec "$@" ' + shell_redirects, "sh", *argv]
    return run_bounded(argv, timeout=120, env=env, stderr=subprocess.STDOUT) if stdout is subprocess.PIPE else \
        _run_to(argv, stdout, env)


def _run_to(argv, stdout, env):
    proc = subprocess.Popen(argv, cwd=ROOT, env=env or child_env(), stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    return proc.returncode, "", err, 0.0


def test_an_ascii_terminal_gets_every_path_and_help_escaped(tmp_path):
    """PYTHONIOENCODING=ascii (or a Latin-1 locale) and a run directory named
    'rün dir é': the launch ended on a UnicodeEncodeError printing its run
    directory, before its job started; `ckpt list`, `report`, `interval`
    did the same, and `export --help` on its θ. Now what the terminal cannot
    spell is written escaped, as Python's own stderr does."""
    env = dict(child_env(), PYTHONIOENCODING="ascii")
    run = str(tmp_path / "rün dir é")
    code, out, _, _ = _launch(run, env)
    assert code == 0 and "Traceback" not in out, out
    assert "crucible: run directory " + str(tmp_path) + "/r\\xfcn dir \\xe9\n" in out, out
    assert os.path.isdir(os.path.join(run, "checkpoints", "step_00000004"))
    for cmd in (["ckpt", "list", run], ["report", run], ["interval", "--run-dir", run], ["export", "--help"]):
        code, out, err, _ = run_bounded(crucible_cmd(*cmd), timeout=120, env=env)
        assert code == 0 and "Traceback" not in err, (cmd, code, out, err)
        assert "\\xfc" in out or "\\u03b8_global" in out, (cmd, out)


@pytest.mark.slow   # (three launches, about 16 s: the main suite keeps under 10 minutes)
def test_a_launch_whose_output_is_closed_or_refused_trains_and_saves(tmp_path):
    """stdout or stderr closed (`>&-`), or stdout on /dev/full: the launcher
    ended on a traceback at its first line (sys.stdout None: AttributeError;
    ENOSPC), and the job with it, or at exit (status 120). Now the job
    trains and saves, exit 0; a refused output goes on in logs/launcher.log."""
    for name, redirects in (("stdout", ">&-"), ("stderr", "2>&-"), ("both", ">&- 2>&-")):
        run = str(tmp_path / name)
        code, out, _, _ = _launch(run, shell_redirects=redirects)
        assert code == 0, (name, code, out)
        assert "Traceback" not in out, (name, out)
        assert os.path.isdir(os.path.join(run, "checkpoints", "step_00000004")), name
    run = str(tmp_path / "full")
    with open("/dev/full", "w") as full:
        code, _, err, _ = _launch(run, stdout=full)
    assert code == 0 and err == "", (code, err)
    assert os.path.isdir(os.path.join(run, "checkpoints", "step_00000004"))
    with open(os.path.join(run, "logs", "launcher.log")) as f:
        said = f.read()
    assert said.startswith("crucible: the launcher's output could not be written (No space left on device): "
                           "it goes on here\ncrucible: run directory "), said
    assert "crucible: finished." in said, said


def test_a_short_command_whose_output_is_refused_ends_on_one_line(tmp_path):
    """`crucible ckpt list` (and every command that prints) with stdout on
    /dev/full: a traceback ending in 'OSError: [Errno 28] No space left on
    device'. Now one line on stderr, exit 1; with stdout closed, a clean
    exit 0."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with open("/dev/full", "w") as full:
        code, _, err, _ = _run_to(crucible_cmd("ckpt", "list", str(run)), full, None)
    assert code == 1 and err == "crucible: cannot write the output: No space left on device\n", (code, err)
    code, out, err, _ = run_bounded(["sh", "-c", 'exec "$@" >&-', "sh", *crucible_cmd("ckpt", "list", str(run))],
                                    timeout=60)
    assert code == 0 and err == "", (code, err)


def test_a_launcher_whose_log_refuses_its_output_too_goes_on(tmp_path):
    """The launcher's output moved to logs/launcher.log (a hangup; or its
    terminal refused it); when that log's disk refuses it as well, the next
    write's OSError ended the launcher, and with it the job (its finally
    stops every process, with no final checkpoint). What it still says goes
    to /dev/null now; it goes on."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "launcher.log").symlink_to("/dev/full")      # (a log whose every write is ENOSPC)
    code = ("import os, sys, types\n"
            "from crucible import exits, launch\n"
            "exits.usable_output()\n"
            "it = types.SimpleNamespace(output_in_log=False, run_dir=sys.argv[1])\n"
            "to_log = lambda e=None: launch.Launcher._output_to_log(it, e)\n"
            "sys.stdout = launch.TerminalOrLog(sys.stdout, to_log)\n"
            "to_log()\n"                       # (a hangup moved the output to the log first)
            "for i in range(3):\n"
            "    print('progress', i, flush=True)\n"
            "open(os.path.join(sys.argv[1], 'went-on'), 'w').close()\n")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", code, str(run)],
                              cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 0 and (run / "went-on").exists(), proc.stderr
