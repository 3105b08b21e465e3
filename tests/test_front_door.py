"""Bad input at the front door: each ordinary mistake ends a real `crucible launch`
within 30 s, with the cause named on the terminal, a non-zero exit, and a run
directory that already held checkpoints left exactly as it was.

Two lines of defence are tested: the pre-flight checks (the default), and,
with ``--no-check``, the launcher's crash-loop rule (the same error twice from
one slot stops the job).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time

import numpy as np
import pytest

from conftest import ROOT, TINY, Job, child_env, crucible_cmd, free_port, run_bounded, tree_digest
from crucible.metrics import read_events

BUILDERS = textwrap.dedent('''
    """Model builders with mistakes in them (tests of the pre-flight checks)."""
    import torch
    from crucible.model import build_stage


    def _builtin(stage, n_stages, cfg):
        mine, cfg.model.builder = cfg.model.builder, ""
        try:
            return build_stage(cfg, stage, n_stages)
        finally:
            cfg.model.builder = mine


    class Narrow(torch.nn.Module):
        """Wraps a stage and drops half the residual stream's width."""
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, tokens=None):
            return self.inner(x)[..., : self.inner_width // 2]

        def loss(self, h, targets):
            return self.inner.loss(h, targets)


    def wrong_shape(stage, n_stages, cfg):
        m = _builtin(stage, n_stages, cfg)
        if stage == 0:
            w = Narrow(m)
            w.inner_width = cfg.model.d_model
            return w
        return m


    def raise_on_stage_1(stage, n_stages, cfg):
        if stage == 1:
            raise RuntimeError("stage 1 cannot be built on this host")
        return _builtin(stage, n_stages, cfg)
''')

SMALL = [o for o in TINY if not o.startswith("checkpoint.")]


def _env(extra_path: str) -> dict:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH", "")) if p)
    return env



def _launch(args: list[str], env: dict, timeout: float = 60.0) -> tuple[int, str, float]:
    """A real `crucible launch` in its own process group, bounded; returns
    (exit status, everything on the terminal, seconds)."""
    code, out, _, seconds = run_bounded(crucible_cmd("launch", *args), timeout, env, stderr=subprocess.STDOUT,
                                        what="launch")
    return code, out, seconds


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory holding committed checkpoints of a short real job."""
    base = tmp_path_factory.mktemp("front")
    job = Job(base / "run", ["--replicas", "1", "--stages", "2", "--steps", "12"],
              SMALL + ["checkpoint.minimum_interval_s=0"])
    try:
        assert job.wait(120) == 0, job.output()
    finally:
        job.kill()
    assert any(n.startswith("step_") for n in os.listdir(os.path.join(job.run_dir, "checkpoints"))), job.output()
    with open(base / "builders_mod.py", "w") as f:
        f.write(BUILDERS)
    return base


@pytest.fixture
def run_copy(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    before = _checkpoints_digest(run)
    yield str(run)
    assert _checkpoints_digest(run) == before, "the run directory's checkpoints were touched"


def _checkpoints_digest(run) -> dict:
    """tree_digest of checkpoints/ but its .lock (a launch that runs names itself in it)."""
    return {k: v for k, v in tree_digest(str(run / "checkpoints")).items() if k != ".lock"}


def _data_file(tmp_path, name: str, payload: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(payload)
    return str(path)


def _fifo(tmp_path) -> str:
    path = tmp_path / "corpus.fifo"
    os.mkfifo(path)
    return str(path)


MISTAKES = {
    "missing data path": (lambda t: ["data.path=/nonexistent/corpus.txt"],
                          "data.path '/nonexistent/corpus.txt': no such file or folder"),
    "empty corpus": (lambda t: [f"data.path={_data_file(t, 'empty.txt', b'')}"], "empty corpus"),
    "corpus shorter than one sequence": (lambda t: [f"data.path={_data_file(t, 'short.txt', b'def f(): pass')}"],
                                         "too few for train.seq_len 32"),
    "a FIFO (reading it blocked forever)": (lambda t: [f"data.path={_fifo(t)}"],
                                            "corpus.fifo': a FIFO, not a file or a folder of files"),
    ".bin with ids beyond the vocabulary": (
        lambda t: [f"data.path={_data_file(t, 'toks.bin', np.array([1, 2, 4764] * 400, '<u2').tobytes())}"],
        "token id 4764 (at token 2) is beyond model.vocab_size 256"),
    "resume on other data (it went on silently)": (
        lambda t: [f"data.path={_data_file(t, 'other.txt', bytes(range(32, 127)) * 100)}"],
        "it was trained on other data (the built-in corpus, 2,000,000 tokens"),
    "unimportable builder": (lambda t: ["model.builder=nonexist:fn"],
                             "model.builder 'nonexist:fn' does not import: No module named 'nonexist'"),
    "builder that returns the wrong shape": (
        lambda t: ["model.builder=builders_mod:wrong_shape"],
        "stage 0 of 2: forward returned (2, 32, 16) float32; a stage boundary must be (2, 32, 32) float32"),
    "builder that raises on stage 1 only": (
        lambda t: ["model.builder=builders_mod:raise_on_stage_1"],
        "stage 1 of 2: building it raised RuntimeError: stage 1 cannot be built on this host"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_stops_the_launch_with_its_cause(mistake, trained, run_copy, tmp_path):
    make, cause = MISTAKES[mistake]
    args = ["--run-dir", run_copy, "--resume", "--replicas", "1", "--stages", "2", "--steps", "30", *SMALL,
            *make(tmp_path)]
    code, out, secs = _launch(args, _env(str(trained)))
    print(f"{mistake}: exit {code} after {secs:.1f}s: {out.strip()}")
    assert code == 1, out
    assert cause in out, out
    assert secs < 30, f"took {secs:.1f}s:\n{out}"
    assert "Traceback" not in out and "starting a replacement" not in out, out
    assert len([x for x in out.splitlines() if x.strip()]) == 1, out   # one line, nothing else


def test_fresh_launch_into_a_run_with_checkpoints_is_refused(run_copy):
    code, out, secs = _launch(["--run-dir", run_copy, "--replicas", "1", "--stages", "2", *SMALL], child_env())
    assert code == 1 and secs < 30, out
    assert "already holds checkpoints (newest: step" in out and "--resume" in out, out


def test_check_command_alone(trained, tmp_path):
    ok = subprocess.run(crucible_cmd("check", "--replicas", "1", "--stages", "2", *SMALL), cwd=ROOT,
                        env=child_env(), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "check passed" in ok.stdout and "parameters in 2 stage(s)" in ok.stdout
    bad = subprocess.run(crucible_cmd("check", "--replicas", "1", "--stages", "2", *SMALL,
                                      "model.builder=builders_mod:wrong_shape"),
                         cwd=ROOT, env=_env(str(trained)), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "forward returned (2, 32, 16)" in bad.stderr, bad.stderr
    typo = subprocess.run(crucible_cmd("check", "train.setps=3"), cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "did you mean 'train.steps'" in typo.stderr


def test_crash_loop_without_preflight_stops_the_job(trained, run_copy):
    """--no-check: the workers themselves hit the error; the same error twice
    from one slot stops the job, naming it, with exit 1, and no checkpoint is lost."""
    args = ["--no-check", "--run-dir", run_copy, "--resume", "--replicas", "1", "--stages", "2", "--steps", "30",
            "--respawn-delay", "0.5", *SMALL, "model.builder=builders_mod:raise_on_stage_1"]
    t_start = time.time()
    code, out, secs = _launch(args, _env(str(trained)), timeout=90)
    t_end = time.time()
    assert code == 1, out
    assert "r0s1 failed twice within 120s with the same error: RuntimeError: stage 1 cannot be built" in out, out
    assert out.count("starting a replacement") == 1, out   # exactly one retry, then the stop
    # The job stops within seconds of the second failure. (The whole launch also
    # waits for two worker start-ups, each importing torch: about 10 s apiece next to
    # the suite loop's CPU stressor, so its own length says little.)
    errors = [e for e in read_events(run_copy, "worker_error") if e["time"] >= t_start and e.get("stage") == 1]
    assert len(errors) == 2, errors
    assert t_end - errors[1]["time"] < 10, f"stopped {t_end - errors[1]['time']:.1f}s after the second failure"


def test_status_shows_a_slots_last_error(trained, start_job):
    """Without respawn, the failed slot stays vacant and `status` names its error."""
    job = start_job(["--no-check", "--replicas", "1", "--stages", "2", "--steps", "30", "--respawn-delay", "-1"],
                    SMALL + ["model.builder=builders_mod:raise_on_stage_1"], env=_env(str(trained)))
    err = job.wait_for(lambda st: next((w["last_error"] for w in st["workers"]
                                        if w["stage"] == 1 and w.get("last_error")), None), 60,
                       "r0s1's last error in status")
    assert "RuntimeError: stage 1 cannot be built on this host" in err["error"]


# ---- a job with nothing left to train ----------------------------------------------------------------------------

@pytest.fixture
def own_copy(trained, tmp_path):
    """A copy of the trained run that a test may train on (run_copy's must stay untouched)."""
    run = tmp_path / "own"
    shutil.copytree(trained / "run", run)
    return str(run)


def test_resume_with_nothing_left_to_train_is_refused(run_copy):
    """The trained run ended at step 12: a --resume at train.steps 12 (the
    command the launcher prints at the end of a job) or below has nothing to
    train. It used to start and never end (`r0 done step 12/12` forever);
    now the launcher (with or without its pre-flight) and `crucible check`
    refuse it in one line, exit 1, as a failed pre-flight check."""
    want = "crucible: --resume: the checkpoint to resume from is at step 12 and train.steps is {n}: nothing left to " \
           "train; raise train.steps (--steps) above 12 to train on"
    for steps, extra in (("12", ["--no-check"]), ("5", [])):
        code, out, secs = _launch(["--run-dir", run_copy, "--resume", "--replicas", "1", "--stages", "2",
                                   "--steps", steps, *extra, *SMALL], child_env())
        assert code == 1 and secs < 30, (code, out)
        assert [x for x in out.splitlines() if x.strip()] == [want.format(n=steps)], out
    done = subprocess.run(crucible_cmd("check", "--run-dir", run_copy, "--resume", "--replicas", "1", "--stages", "2",
                                       "--steps", "12", *SMALL), cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert [x for x in done.stderr.splitlines() if x.strip()] == [want.format(n=12)], done.stderr


def test_the_resume_hint_of_a_run_with_every_step_trained_says_to_raise_steps(run_copy):
    """The hint printed after a failed or interrupted job whose newest
    checkpoint is already at train.steps is not a command that is refused."""
    from crucible.cli import build_parser
    from crucible.launch import Launcher

    for steps, want in (("12", "crucible: newest checkpoint: step 12, train.steps 12: every step is trained; "
                                "to train on, --resume with a larger --steps"),
                        ("20", "crucible: newest checkpoint: step 12; go on from it with")):
        args = build_parser().parse_args(["launch", "--run-dir", run_copy, "--replicas", "1", "--stages", "2",
                                          "--steps", steps, *SMALL])
        assert Launcher(args, args.overrides)._resume_hint().startswith(want)


def test_every_worker_exits_when_its_replica_is_done_before_it_trained(own_copy, tmp_path):
    """A coordinator started by hand (as on a cluster: no pre-flight) resumes
    at step 12 with train.steps 6: stage 0 has nothing to train. Stage 1's
    upstream stream never opens, so it used to wait for it forever; the
    replica's state "done", which the coordinator now sends to every route
    watcher, ends it too. Stage 1 registers first, so it is watching before
    the replica is done. Stage 0 says its replica is done only once every
    slot registered (else the coordinator could end the job before a later
    stage registered, leaving it retrying a coordinator that is gone). Every
    process exits 0, and the coordinator's log says why the job ended at once."""
    env = dict(child_env(), CRUCIBLE_TOKEN=open(os.path.join(own_copy, "token")).read().strip())
    addr_file = os.path.join(own_copy, "coordinator.addr")
    os.unlink(addr_file)       # (the trained run's coordinator's)
    logs = open(tmp_path / "direct.log", "wb")
    offset = os.path.getsize(os.path.join(own_copy, "metrics.jsonl"))
    common = dict(cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=logs, stderr=subprocess.STDOUT)
    coord = subprocess.Popen(crucible_cmd("coordinator", "--run-dir", own_copy, "--bind", "127.0.0.1:0", "--resume",
                                          "--replicas", "1", "--stages", "2", "--steps", "6", *SMALL),
                             process_group=0, **common)      # (a group of its own, the workers join it)
    procs = {"coordinator": coord}
    try:
        t_end = time.monotonic() + 30
        while not os.path.exists(addr_file) or not open(addr_file).read().strip():
            assert coord.poll() is None and time.monotonic() < t_end, (tmp_path / "direct.log").read_text()
            time.sleep(0.1)
        addr = open(addr_file).read().strip()
        for s in (1, 0):      # stage 1 first: it watches the routes before the replica is done
            procs[f"r0s{s}"] = subprocess.Popen(crucible_cmd("worker", "--coordinator", addr, "--replica", "0",
                                                             "--stage", str(s), "--bind", "127.0.0.1:0"),
                                                process_group=coord.pid, **common)
            if s == 1:        # registered; its route watch starts right after
                t_end = time.monotonic() + 60
                while not [e for e in read_events(own_copy, "worker_registered", offset=offset) if e["stage"] == 1]:
                    assert procs["r0s1"].poll() is None and time.monotonic() < t_end, \
                        (tmp_path / "direct.log").read_text()
                    time.sleep(0.1)
                time.sleep(1.0)
        t_end = time.monotonic() + 90
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < t_end:
            time.sleep(0.2)
        codes = {n: p.poll() for n, p in procs.items()}
        assert codes == {"coordinator": 0, "r0s0": 0, "r0s1": 0}, \
            f"{codes} (None: still running after 90 s)\n{(tmp_path / 'direct.log').read_text()[-6000:]}"
        assert read_events(own_copy, "job_done")
        # (what `launch` and `check` refuse, the coordinator alone says, and ends the job)
        assert "--resume: the checkpoint to resume from is at step 12 and train.steps is 6: nothing left to train; " \
               "raise train.steps (--steps) above 12 to train on; the job ends as soon as its workers register" \
               in (tmp_path / "direct.log").read_text()
    finally:
        try:
            os.killpg(coord.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in procs.values():
            p.wait(10)
        logs.close()


def test_the_summary_counts_this_launchs_faults_only(own_copy):
    """A fault-free --resume printed `1 worker faults` from an earlier launch's
    event in the same metrics.jsonl."""
    from crucible.metrics import append_event

    append_event(own_copy, {"event": "fault", "worker": "w-old", "replica": 0, "stage": 1, "reason": "earlier"})
    code, out, _ = _launch(["--no-check", "--run-dir", own_copy, "--resume", "--replicas", "1", "--stages", "2",
                            "--steps", "14", *SMALL, "checkpoint.minimum_interval_s=0"], child_env(), timeout=120)
    assert code == 0, out
    assert "crucible: finished." in out and "r0: 14 steps" in out, out
    assert "worker fault" not in out, out


# ---- usage errors: one line naming the flag or value, exit status 2, nothing started --------------------------

JOB = ["--replicas", "1", "--stages", "2", "--steps", "20", *SMALL]


def _usage_error(*args: str, env: dict | None = None, cwd: str = ROOT) -> str:
    """`crucible ARGS` that must be refused as a usage error: exit 2 within
    seconds, one line, no traceback; returns that line."""
    t0 = time.monotonic()
    done = subprocess.run(crucible_cmd(*args), cwd=cwd, env=env or child_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    secs, out = time.monotonic() - t0, done.stdout + done.stderr
    assert done.returncode == 2, f"exit {done.returncode}:\n{out}"
    assert "Traceback" not in out, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1, out
    assert secs < 20, f"took {secs:.1f}s:\n{out}"
    return lines[0]


@pytest.mark.parametrize("spec, why", [("garbage", "bad chaos item 'garbage'"),
                                       ("mtbf=1.2.3", "bad chaos item 'mtbf=1.2.3'"),
                                       ("mtbf=0", "bad chaos item 'mtbf=0': must be > 0"),
                                       ("any@every=0", "bad chaos item 'any@every=0': must be > 0"),
                                       ("count=3,r9s9@t=5", "bad chaos item 'r9s9@t=5': no worker r9s9 in this 1x2 job")])
def test_a_bad_chaos_spec_is_refused_before_anything_starts(spec, why, tmp_path):
    run = tmp_path / "run"
    line = _usage_error("launch", "--run-dir", str(run), "--chaos", spec, *JOB)
    assert line.startswith("crucible: --chaos: ") and why in line, line
    assert not run.exists(), "the launch wrote its run directory before refusing --chaos"


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_respawn_delay_that_is_no_number_is_refused(value, tmp_path):
    """--respawn-delay nan was taken as "never" (every comparison with nan is false)."""
    run = tmp_path / "run"
    line = _usage_error("launch", "--run-dir", str(run), "--respawn-delay", value, *JOB)
    assert line == f"crucible: --respawn-delay {value}: must be a finite number of seconds (negative = never)", line
    assert not run.exists()


def test_a_file_where_a_directory_belongs(tmp_path):
    """A run directory, checkpoint or export path that is a file (or lies under
    one) is named in one line, exit 2: not a NotADirectoryError traceback, and
    not a `check` that passes."""
    f = tmp_path / "f"
    f.write_text("")
    cases = [("launch", "--run-dir", str(f), *JOB), ("launch", "--run-dir", str(f / "sub"), *JOB),
             ("check", "--run-dir", str(f), *JOB), ("coordinator", "--run-dir", str(f)),
             ("ckpt", "list", str(f)), ("ckpt", "verify", str(f)), ("ckpt", "inspect", str(f)),
             ("export", "--out", str(tmp_path / "x"), str(f)), ("sample", str(f))]
    for args in cases:
        line = _usage_error(*args)
        assert str(f) in line and "not a directory" in line, (args, line)
    assert not (tmp_path / "x").exists()


def test_export_into_a_file_is_refused(trained, tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"precious")
    for out in (f, f / "sub"):
        line = _usage_error("export", "--out", str(out), str(trained / "run"))
        assert line.startswith(f"crucible export: --out {out}: ") and "not a directory" in line, line
    assert f.read_bytes() == b"precious"


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "h.toml"
    bad.write_bytes(b"\xff\xfe[train]\n")
    for cmd in ("check", "launch"):
        line = _usage_error(cmd, "--config", str(bad), "--run-dir", str(tmp_path / "run"))
        assert line == f"crucible: cannot read config file {bad}: not UTF-8 text (byte 0xff at offset 0); " \
                       "TOML files are UTF-8", line
    assert not (tmp_path / "run").exists()


def test_a_bad_data_max_bytes_is_named(tmp_path):
    line = _usage_error("check", *JOB, "data.max_bytes=-5")
    assert line == "crucible: bad value for 'data.max_bytes': must be >= 1 (bytes of text to read) (got -5)", line


@pytest.mark.parametrize("args, flag, why", [
    (["worker", "--coordinator", "127.0.0.1:notaport", "--replica", "0", "--stage", "0"], "--coordinator",
     "expected host:port"),
    (["worker", "--coordinator", ""], "--coordinator", "expected host:port"),
    (["worker", "--coordinator", "127.0.0.1:99999"], "--coordinator", "port 99999 is out of range (1..65535)"),
    (["worker", "--coordinator", "127.0.0.1:0"], "--coordinator", "port 0 is out of range (1..65535)"),
    (["worker", "--coordinator", "::1:7000"], "--coordinator", "expected host:port"),       # IPv6 needs [ ]
    (["worker", "--coordinator", "127.0.0.1:7000", "--bind", "127.0.0.1:99999"], "--bind", "port 99999"),
    (["worker", "--coordinator", "127.0.0.1:7000", "--advertise", "node2"], "--advertise", "expected host:port"),
    (["status", "--coordinator", ""], "--coordinator", "expected host:port"),
    (["coordinator", "--run-dir", "{tmp}/run", "--bind", "garbage"], "--bind", "expected host:port"),
    (["coordinator", "--run-dir", "{tmp}/run", "--bind", "127.0.0.1:99999"], "--bind",
     "port 99999 is out of range (0..65535)"),
])
def test_a_malformed_address_is_named(args, flag, why, tmp_path):
    """Not a silent 120 s of retries and a gRPC traceback (a port that is no
    number), a TypeError (status --coordinator ''), or a port silently wrapped
    past 65535 (99999 became 34463)."""
    env = dict(child_env(), CRUCIBLE_TOKEN="x")
    line = _usage_error(*[a.replace("{tmp}", str(tmp_path)) for a in args], env=env)
    value = args[args.index(flag) + 1]
    assert line.startswith(f"crucible: {flag} {value!r}: ") and why in line, line
    assert not (tmp_path / "run").exists()


def test_bracketed_ipv6_addresses_pass_the_check(tmp_path):
    """[::1]:PORT is an address: status gets as far as dialing it (nothing there)."""
    done = subprocess.run(crucible_cmd("status", "--coordinator", "[::1]:1"), cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "coordinator at [::1]:1 does not answer" in done.stderr, done.stderr


def _ended_run(tmp_path, *events: dict):
    """A run directory as a job leaves it: coordinator.addr (nothing listens
    there now), token, a coordinator.lock nobody holds, metrics.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "coordinator.addr").write_text(f"127.0.0.1:{free_port()}\n")
    (run / "token").write_text("x\n")
    (run / "coordinator.lock").write_text("")
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


START = {"event": "coordinator_start", "incarnation": 1}


def test_status_of_a_finished_job_says_it_finished(tmp_path):
    """Was `coordinator at 127.0.0.1:PORT does not answer` (exit 1) for a job
    that had finished: as if something were wrong with it."""
    run = _ended_run(tmp_path, START, {"event": "job_done", "elapsed_s": 9.5, "steps": [40, 40]})
    done = subprocess.run(crucible_cmd("status", "--run-dir", str(run)), cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr == (f"crucible status: {run}: the job finished at step 40; its coordinator has exited "
                           f"(`crucible report {run}` shows the run)\n"), done.stderr


def test_status_quotes_a_run_dir_with_a_space_in_the_commands_it_suggests(tmp_path):
    """`crucible report /runs/my run` pasted from status's line is two
    arguments: the commands status suggests quote the run directory."""
    from crucible.status import no_answer

    run = _ended_run(tmp_path, START, {"event": "job_done", "steps": [40]})
    spaced = run.rename(tmp_path / "my run")
    assert no_answer("127.0.0.1:1", str(spaced)) == \
        f"crucible status: {spaced}: the job finished at step 40; its coordinator has exited " \
        f"(`crucible report '{spaced}'` shows the run)"
    with open(spaced / "metrics.jsonl", "a") as f:
        f.write(json.dumps(START) + "\n" + json.dumps({"event": "job_stopped", "signal": "SIGTERM"}) + "\n")
    line = no_answer("127.0.0.1:1", str(spaced))
    assert f"`crucible launch --run-dir '{spaced}' --resume`" in line and f"`crucible ckpt list '{spaced}'`" in line, \
        line


@pytest.mark.parametrize("events, says", [
    ([START, {"event": "ckpt_commit", "step": 8}, {"event": "job_stopped", "signal": "SIGTERM", "steps": {"0": 12}},
      {"event": "ckpt_commit", "step": 14, "final": True}],
     "the job was stopped by SIGTERM before its last step (`crucible launch --run-dir {run} --resume` with the "
     "job's options goes on from its newest checkpoint, step 14; `crucible ckpt list {run}` lists them)"),
    ([START, {"event": "job_done", "steps": [30, 40]}], "the job finished; its coordinator has exited"),
])
def test_status_of_an_ended_job_says_how_it_ended(events, says, tmp_path):
    from crucible.status import no_answer

    run = _ended_run(tmp_path, *events)
    line = no_answer("127.0.0.1:1", str(run))
    assert line.startswith(f"crucible status: {run}: ") and says.format(run=run) in line, line


@pytest.mark.parametrize("events, says", [
    # a coordinator that crashed and that `crucible launch` restarts: no lock held for a while, and no end in
    # the log; nor on a filesystem whose flock is node-local (the lock free on this node): not "ended"
    ([START], "; nothing holds its coordinator.lock: it may be restarting, or the job stopped before the end "
              "(`crucible launch --run-dir {run} --resume` with the job's options goes on from its newest checkpoint; "
              "`crucible ckpt list {run}` lists them)"),
    # a resume after the job finished (more steps), killed or restarting: not "finished"
    ([START, {"event": "job_done", "steps": [40]}, START, {"event": "ckpt_commit", "step": 44}],
     "; nothing holds its coordinator.lock: it may be restarting, or the job stopped before the end "
     "(`crucible launch --run-dir {run} --resume` with the job's options goes on from its newest checkpoint, step 44;"),
    # resumed after a stop: the earlier job_stopped is not this coordinator's end
    ([START, {"event": "job_stopped", "signal": "SIGINT"}, START], "; nothing holds its coordinator.lock"),
    ([], "; nothing holds its coordinator.lock"),
])
def test_status_of_a_job_whose_log_shows_no_end_keeps_the_reason(events, says, tmp_path, monkeypatch):
    """`crucible status` said "the job has ended" wherever nothing held
    coordinator.lock, and dropped the reason the coordinator does not answer."""
    from crucible import rpc
    from crucible.status import no_answer

    run = _ended_run(tmp_path, *events)
    monkeypatch.setattr(rpc, "explain", lambda addr: "its certificate is not for 127.0.0.1")
    line = no_answer("127.0.0.1:1", str(run))
    assert line.startswith("crucible status: coordinator at 127.0.0.1:1 does not answer: its certificate is not "
                           "for 127.0.0.1; ") and says.format(run=run) in line, line


def test_status_watch_reads_the_log_on_from_where_it_stopped(tmp_path, monkeypatch):
    """`status --watch` asks every second: the log is read on from the last
    offset, not again from the start, and what comes later still counts."""
    from crucible import metrics
    from crucible.status import Ends, no_answer

    run = _ended_run(tmp_path, START, {"event": "ckpt_commit", "step": 8})
    ends = Ends()
    assert "does not answer" in no_answer("127.0.0.1:1", str(run), ends)
    assert ends.offset == metrics.size(str(run)) > 0 and ends.commit == 8
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "job_stopped", "signal": "SIGTERM"}) + "\n")
    seen = []
    real = metrics.follow
    monkeypatch.setattr(metrics, "follow", lambda path, kinds, offset: seen.append(offset) or real(path, kinds, offset))
    line = no_answer("127.0.0.1:1", str(run), ends)
    assert seen == [ends.offset - len(json.dumps({"event": "job_stopped", "signal": "SIGTERM"})) - 1], seen
    assert line == (f"crucible status: {run}: the job was stopped by SIGTERM before its last step (`crucible launch "
                    f"--run-dir {run} --resume` with the job's options goes on from its newest checkpoint, step 8; "
                    f"`crucible ckpt list {run}` lists them)"), line


def test_status_of_a_running_job_that_does_not_answer_says_so(tmp_path):
    """coordinator.lock held (the job runs, its coordinator busy or cut off):
    not "ended", whatever metrics.jsonl says."""
    import fcntl

    from crucible.status import no_answer

    run = _ended_run(tmp_path, START, {"event": "job_done", "steps": [40]})
    with open(run / "coordinator.lock", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        # (flock is per open file: lock_held's own open of the file is refused)
        line = no_answer("127.0.0.1:1", str(run))
    assert line == "crucible status: coordinator at 127.0.0.1:1 does not answer", line


LAUNCH = {"event": "launch_start", "pid": 4321, "resume": True}


def test_status_while_a_launch_starts_after_a_finished_job_says_starting(tmp_path):
    """Right after a finished job, a new `crucible launch --resume` in its
    pre-flight, or its coordinator not serving yet (no coordinator.lock, no
    coordinator_start): status said the job had finished. The launcher holds
    launch.lock and logs launch_start first."""
    import fcntl

    from crucible.status import Ends, no_answer, resolve

    run = _ended_run(tmp_path, START, {"event": "job_done", "steps": [40]}, LAUNCH)
    starting = f"crucible status: {run}: starting: no coordinator yet (`crucible launch` (pid 4321) is starting " \
               f"a resume there)"
    finished = f"crucible status: {run}: the job finished at step 40; its coordinator has exited"
    with open(run / "launch.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert no_answer("127.0.0.1:1", str(run)) == starting
        ends = Ends()               # (--watch: read on; the launch's coordinator comes up, then the job ends)
        assert no_answer("127.0.0.1:1", str(run), ends) == starting
        (run / "coordinator.addr").unlink()    # (the launcher removes it as it starts the coordinator)
        with pytest.raises(SystemExit) as e:
            resolve(str(run), None)
        assert str(e.value) == starting
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps(START) + "\n" + json.dumps({"event": "job_done", "steps": [44]}) + "\n")
        assert no_answer("127.0.0.1:1", str(run), ends).startswith(f"crucible status: {run}: the job finished "
                                                                    f"at step 44;")
        # every process restarted from a checkpoint (on_stage_failure = restart): the coordinator's own stop
        # comes first, then the launcher's job_restart
        (tmp_path / "b").mkdir()
        again = _ended_run(tmp_path / "b", START, {"event": "job_stopped", "signal": "SIGTERM"},
                           {"event": "job_restart", "reason": "r0s1 failed"})
        with open(again / "launch.lock", "a+") as held2:
            fcntl.flock(held2, fcntl.LOCK_EX)
            assert no_answer("127.0.0.1:1", str(again)) == (
                f"crucible status: {again}: restarting: no coordinator yet (the launcher restarts every process "
                f"from the latest checkpoint)")
    # A launch that ended before its coordinator started (refused by its checks, killed): no launcher holds
    # launch.lock, and the previous job's end stands. So it does for the launcher of that job itself, still
    # up after its job_done.
    (run / "coordinator.addr").write_text("127.0.0.1:1\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
        START, {"event": "job_done", "steps": [40]}, LAUNCH)))
    assert no_answer("127.0.0.1:1", str(run)).startswith(finished)
    (tmp_path / "c").mkdir()
    ended = _ended_run(tmp_path / "c", LAUNCH, START, {"event": "job_done", "steps": [40]})
    with open(ended / "launch.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert no_answer("127.0.0.1:1", str(ended)).startswith(f"crucible status: {ended}: the job finished at "
                                                               f"step 40;")


def test_status_says_starting_through_a_real_resumes_start_up(own_copy):
    """A real `crucible launch --resume` after the job finished: from its
    launch_start until its coordinator serves, `status` says it is starting
    (or, once the coordinator holds its lock, that it does not answer yet),
    never that the job finished."""
    from crucible.metrics import read_events
    from crucible.status import StatusClient, no_answer, resolve

    def line() -> str:
        try:
            addr, token = resolve(own_copy, None)
        except SystemExit as e:
            return str(e)
        client = StatusClient(addr, token)
        try:
            return "answers" if client.get(timeout=2.0) is not None else no_answer(addr, own_copy)
        finally:
            client.channel.close()

    assert "the job finished" in line()
    before = len(read_events(own_copy))
    job = Job(own_copy, ["--resume", "--replicas", "1", "--stages", "2", "--steps", "14"],
              SMALL + ["checkpoint.minimum_interval_s=0"])
    try:
        t_end = time.monotonic() + 60
        while not [e for e in read_events(own_copy)[before:] if e["event"] == "launch_start"]:
            assert time.monotonic() < t_end and job.proc.poll() is None, job.output()
            time.sleep(0.02)
        seen = []
        while not seen or seen[-1] != "answers":
            assert time.monotonic() < t_end and job.proc.poll() is None, (seen, job.output())
            seen.append(line())
        starting = f"crucible status: {own_copy}: starting: no coordinator yet (`crucible launch` (pid {job.proc.pid}) " \
                   f"is starting a resume there)"
        assert seen[0] == starting, seen
        assert all(x in (starting, "answers") or " does not answer" in x for x in seen), seen
        assert job.wait(120) == 0, job.output()
    finally:
        job.kill()


def test_a_coordinator_that_does_not_answer_is_said_within_seconds(tmp_path):
    """A well-formed address where nothing listens: the worker says so in one
    line within seconds and keeps trying (the coordinator may still be
    starting), instead of a silent wait of up to 120 s."""
    port = free_port()
    proc = subprocess.Popen(crucible_cmd("worker", "--coordinator", f"127.0.0.1:{port}", "--replica", "0",
                                         "--stage", "0"), cwd=ROOT, env=dict(child_env(), CRUCIBLE_TOKEN="x"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        t0, seen = time.monotonic(), b""
        os.set_blocking(proc.stderr.fileno(), False)
        while b"does not answer" not in seen and time.monotonic() - t0 < 30 and proc.poll() is None:
            seen += proc.stderr.read() or b""
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert proc.poll() is None, seen.decode(errors="replace")      # still trying: not an exit
        line = next(x for x in seen.decode().splitlines() if "does not answer" in x)
        assert f"the coordinator at 127.0.0.1:{port} does not answer" in line and "up to 120s" in line, line
        assert took < 20, took     # imports (a few seconds on a loaded machine) + 2 s of refusals
        assert "Traceback" not in seen.decode()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("flag, value, why", [("--temperature", "nan", "--temperature must be a finite number >= 0"),
                                              ("--temperature", "inf", "--temperature must be a finite number >= 0"),
                                              ("--temperature", "-1", "--temperature must be a finite number >= 0"),
                                              ("--top-k", "-3", "--top-k must be >= 0"),
                                              ("--tokens", "-1", "--tokens must be >= 0")])
def test_bad_sampling_flags_are_named(flag, value, why, trained):
    """Was a RuntimeError traceback from torch.multinomial (nan), or a negative
    temperature taken silently as greedy."""
    line = _usage_error("sample", str(trained / "run"), "--tokens", "5", flag, value)
    assert line.startswith(f"crucible sample: {why}") and value in line, line


def test_temperature_zero_is_greedy(trained):
    outs = [subprocess.run(crucible_cmd("sample", str(trained / "run"), "--tokens", "8", "--temperature", "0",
                                        "--seed", seed), cwd=ROOT, env=child_env(), capture_output=True,
                           timeout=60) for seed in ("1", "2")]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr
    assert outs[0].stdout == outs[1].stdout     # no randomness: the seed does not matter


@pytest.mark.parametrize("resume", [False, True])
def test_a_checkpoints_path_that_is_no_directory_is_refused_before_anything_starts(tmp_path, resume):
    """``checkpoints`` in the run directory a file (or a link to one): check
    passed it, and the launch ended with 'the coordinator exited with 1:
    FileExistsError'."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a folder")
    code, out, secs = _launch(["--run-dir", str(run), "--replicas", "1", "--stages", "2", *SMALL,
                               *(["--resume"] if resume else [])], child_env())
    assert code == 1 and secs < 30, out
    assert f"{run / 'checkpoints'} is not a directory (the job's checkpoints go there): move it away" in out, out
    assert "Traceback" not in out and "FileExistsError" not in out, out
