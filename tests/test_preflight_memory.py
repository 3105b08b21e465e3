"""A model too big for the machine is one line naming the key, within
seconds, before anything is allocated (crucible/sizing.py): Config.validate
refuses the absurd, `crucible check` and `crucible launch`'s pre-flight
compare the workers a launch would start with this host's memory, and a
worker compares its own stage before building it.

The arithmetic is compared with built stages (sum(p.numel())), and the
grouped sums with the stage-by-stage ones; the host's memory is passed in
(host=(bytes, "test")) wherever the outcome would otherwise depend on this
machine. The processes started here need a model no machine holds (~TBs),
so they are refused anywhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, child_env, crucible_cmd, run_bounded
from crucible import sizing
from crucible.config import Config, ConfigError

GiB = 1 << 30
SMALL = ["model.d_model=16", "model.n_head=2", "train.seq_len=8", "train.batch_size=8", "train.microbatches=4"]


def _cfg(*overrides: str) -> Config:
    return Config.load(None, [*SMALL, *overrides])


# ---- the parameters: exact ----------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    ["job.stages=1", "model.n_layer=3"],
    ["job.stages=2", "model.n_layer=5"],
    ["job.stages=3", "model.n_layer=7"],
    ["job.stages=4", "model.n_layer=4"],
    ["job.stages=4", "model.n_layer=6", "model.vocab_size=100"],
    ["job.stages=3", "model.n_layer=5", "model.subspace_rank=4"],
    ["job.stages=2", "model.n_layer=3", "model.subspace_rank=4", "model.subspace_token_shift=0"],
    ["job.stages=2", "model.n_layer=4", "train.precision=bf16", "train.activation_checkpointing=true"],
], ids=lambda o: ",".join(x.split(".")[-1] for x in o))
def test_stage_params_are_those_of_the_built_stages(overrides):
    from crucible.model import build_stage, count_params

    cfg = _cfg(*overrides)
    S = cfg.job.stages
    for s in range(S):
        built = sum(p.numel() for p in build_stage(cfg, s, S).parameters())
        assert sizing.stage_params(cfg, s) == built, (overrides, s)
    assert sizing.total_params(cfg) == count_params(cfg)


def test_split_layers_is_the_models():
    from crucible import model

    assert model.split_layers is sizing.split_layers
    for n, S in ((7, 3), (8, 4), (5, 5), (100, 7)):
        parts = sizing.split_layers(n, S)
        assert [len(p) for p in parts] == [sizing.stage_blocks(n, S, s) for s in range(S)]
        assert sum(len(p) for p in parts) == n and parts[0].start == 0 and parts[-1].stop == n


# ---- stage classes: the grouped sum is the stage-by-stage sum -------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 7, 9, 16])
def test_stage_classes_sum_to_the_stage_by_stage_sum(schedule, S):
    for M in (1, 2, 3, 4, 8, 16):
        for extra in (0, 1, 2, S - 1):
            for ckpt in ("false", "true"):
                cfg = Config.load(None, ["model.d_model=16", "model.n_head=2", "train.seq_len=8",
                                         f"job.stages={S}", f"model.n_layer={2 * S + max(extra, 0)}",
                                         f"train.microbatches={M}", f"train.batch_size={2 * M}",
                                         f"train.schedule={schedule}", f"train.activation_checkpointing={ckpt}"])
                classes = sizing.stage_classes(cfg)
                where = (schedule, S, M, extra, ckpt, classes)
                assert sum(n for _, n in classes) == S, where
                assert len(classes) <= min(M, S) + 4, where
                firsts = [s for s, _ in classes]
                assert firsts == sorted(firsts) and firsts[0] == 0, where
                for (s, n), nxt in zip(classes, firsts[1:] + [S]):
                    assert s + n == nxt, where      # contiguous runs
                    need = sizing.stage_need(cfg, s).terms
                    for t in range(s, s + n):
                        assert sizing.stage_need(cfg, t).terms == need, (where, t)
                grouped = sum(sizing.stage_need(cfg, s).total * n for s, n in classes)
                assert grouped == sum(sizing.stage_need(cfg, s).total for s in range(S)), where


def test_many_stages_are_summed_quickly():
    cfg = Config.load(None, ["job.stages=200000", "model.n_layer=200000", "train.microbatches=4"])
    t0 = time.perf_counter()
    assert len(sizing.stage_classes(cfg)) <= 8
    assert sizing.absurd(cfg) is None
    assert time.perf_counter() - t0 < 1.0


def test_round_robin_gpus_count_every_worker_once():
    """job.device=cuda over 3 GPUs: slot r*S+s on GPU (r*S+s) mod 3, as crucible.devices.resolve."""
    cfg = _cfg("job.replicas=3", "job.stages=5", "model.n_layer=11")
    slots = sizing.launch_slots("cuda", 3)(cfg)
    R, S = 3, 5
    assert sum(n for _, _, n in slots) == R * S
    for g in range(3):
        want = sum(sizing.stage_need(cfg, s, "cuda:0").on_device for r in range(R) for s in range(S)
                   if (r * S + s) % 3 == g)
        got = sum(sizing.stage_need(cfg, s, "cuda:0").on_device * n for s, dev, n in slots if dev == f"cuda:{g}")
        assert got == want, g
    assert {dev for _, dev, _ in sizing.launch_slots("cuda:1")(cfg)} == {"cuda:1"}


# ---- the refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("override, key, why", [
    ("model.n_layer=10000000000000", "model.n_layer", "more than 10**13"),
    ("model.d_model=1099511627776", "model.d_model", "more than 10**13"),
    ("train.seq_len=1125899906842624", "train.seq_len", "more than 10**13"),
    ("train.batch_size=35184372088832", "train.batch_size", "past 64 bits"),
])
def test_absurd_sizes_are_refused_by_validate_naming_the_key(override, key, why):
    overrides = [override, "model.n_head=1", "train.microbatches=1", "train.batch_size=1"]
    if override.startswith("train.batch_size"):
        overrides = ["model.n_head=1", "train.microbatches=1", override]
    with pytest.raises(ConfigError) as e:
        Config.load(None, overrides)
    assert f"bad value for '{key}'" in str(e.value) and why in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_large_but_possible_model_passes_validate():
    cfg = Config.load(None, ["model.n_layer=100000"])      # (20 G parameters: for a pre-flight to weigh)
    assert sizing.absurd(cfg) is None


def test_check_names_n_layer_for_a_giant_n_layer():
    cfg = _cfg("model.n_layer=100000")
    with pytest.raises(sizing.TooBig) as e:
        sizing.check(cfg, sizing.launch_slots(), sizing.workers_here(cfg), process=True, host=(8 * GiB, "test"),
                     hint="crucible launch --no-check starts it anyway")
    line = str(e.value)
    assert line.startswith("model.n_layer=100000: the job's 8 workers"), line
    assert "this host has 8.0 GiB available (test)" in line and line.endswith("--no-check starts it anyway"), line
    assert isinstance(e.value, ConfigError) and "\n" not in line


def test_check_names_the_keys_set_away_from_their_defaults_only():
    cfg = _cfg("model.d_model=8192", "model.n_head=1", "job.replicas=4")
    with pytest.raises(sizing.TooBig) as e:
        sizing.check(cfg, sizing.launch_slots(), sizing.workers_here(cfg), process=True, host=(16 * GiB, "test"))
    assert str(e.value).startswith("model.d_model=8192"), str(e.value)
    assert "model.n_layer" not in str(e.value)


def test_a_small_job_passes_and_the_summary_says_what_was_compared():
    cfg = _cfg("model.n_layer=4")
    line = sizing.check(cfg, sizing.launch_slots(), sizing.workers_here(cfg), process=True, host=(8 * GiB, "test"))
    assert line.startswith("memory: ~") and "8 workers" in line and "8.0 GiB available (test)" in line, line
    # (each worker process counts: 8 of them need more than 1 GiB however small the model)
    with pytest.raises(sizing.TooBig):
        sizing.check(cfg, sizing.launch_slots(), sizing.workers_here(cfg), process=True, host=(GiB, "test"))


def test_a_gpus_free_memory_is_compared_and_named():
    cfg = _cfg("model.n_layer=40", "model.d_model=1024", "model.n_head=8", "job.replicas=1")
    slots = sizing.launch_slots("cuda:0")
    sizing.check(cfg, slots, "w", process=True, device_free={"cuda:0": 80 * GiB}, host=(64 * GiB, "test"))
    with pytest.raises(sizing.TooBig) as e:
        sizing.check(cfg, slots, "w", process=True, device_free={"cuda:0": 2 * GiB}, host=(64 * GiB, "test"))
    assert "on cuda:0" in str(e.value) and "cuda:0 has 2.0 GiB free" in str(e.value)
    assert str(e.value).startswith("model.n_layer=40, model.d_model=1024") or \
        str(e.value).startswith("model.d_model=1024"), str(e.value)


def test_a_workers_refusal_reads_the_same_whatever_the_host_has():
    """The launcher's crash-loop rule stops a slot that fails twice with the same line."""
    cfg = Config.load(None, ["model.n_layer=100000"])
    lines = []
    for have in (8 * GiB, 9 * GiB + 12345):
        with pytest.raises(sizing.TooBig) as e:
            sizing.check(cfg, lambda c: [(0, "cpu", 1)], "stage 0 (r0s0)", process=False, host=(have, "test"),
                         stable=True)
        lines.append(str(e.value))
        assert "GiB available" in e.value.have
    assert lines[0] == lines[1] and "more than this host has available (test)" in lines[0], lines


def test_a_worker_compares_its_stage_with_what_the_host_has_in_all():
    """A worker's own check (capacity=True, host_total) is against the
    host's (and GPU's) whole memory: a replacement started beside its
    siblings at their peak was refused against what was free at that moment,
    and the crash-loop rule then stopped a job that had only lost a worker."""
    total = sizing.host_total()
    avail = sizing.host_available()
    assert total is not None and total[0] > 0 and total[1] in ("MemTotal", "cgroup memory.max",
                                                               "cgroup memory.limit_in_bytes")
    assert avail is None or avail[0] <= total[0]
    cfg = Config.load(None, ["model.n_layer=100000"])
    with pytest.raises(sizing.TooBig) as e:
        sizing.check(cfg, lambda c: [(0, "cuda:0", 1)], "stage 0 (r0s0)", process=False, host=(4096 * GiB, "test"),
                     device_free={"cuda:0": 80 * GiB}, stable=True, capacity=True)
    assert "more than cuda:0 has in all" in str(e.value) and e.value.have == "cuda:0 has 80.0 GiB in all", e.value
    small = Config.load(None, [])
    line = sizing.check(small, lambda c: [(0, "cpu", 1)], "stage 0 (r0s0)", process=False, host=(8 * GiB, "test"),
                        capacity=True)
    assert line.endswith("this host has 8.0 GiB in all (test)"), line

def test_check_memory_asks_cuda_only_for_a_job_on_gpus(monkeypatch):
    """crucible check's memory check (preflight.check_memory): a CPU job never
    asks torch about CUDA; a job on job.device=cuda compares each GPU the
    launch would use (round-robin) with its free memory (here faked: no GPU
    needed), and says how to go on anyway."""
    import torch

    from crucible import preflight

    def no_cuda(*a, **k):
        raise AssertionError("CUDA asked about for a CPU job")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    monkeypatch.delenv(sizing.SKIP_ENV, raising=False)
    small = ["job.replicas=1", "job.stages=2", "model.n_layer=2", "checkpoint.enable_checkpointing=false"]
    assert preflight.check_memory(_cfg(*small)).startswith("memory: ~")

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (asked.append(str(d)) or GiB, 80 * GiB))
    gpu = _cfg(*small, "job.device=cuda")
    assert preflight.check_memory(gpu).startswith("memory: ~") and sorted(asked) == ["cuda:0", "cuda:1"]
    big = _cfg("job.replicas=1", "job.stages=2", "checkpoint.enable_checkpointing=false", "job.device=cuda",
               "model.d_model=1024", "model.n_head=8")          # (4 blocks a stage: ~1 GiB and a CUDA context)
    with pytest.raises(sizing.TooBig) as e:
        preflight.check_memory(big)
    line = str(e.value)
    assert line.startswith("model.d_model=1024: ") and "on cuda:0" in line and "cuda:0 has 1.0 GiB free" in line
    assert line.endswith(preflight.NO_CHECK_HINT), line
    monkeypatch.setenv(sizing.SKIP_ENV, "1")
    assert "not compared" in preflight.check_memory(big)


def test_a_builder_model_is_not_estimated():
    cfg = _cfg("model.builder=x:y")
    assert "not estimated" in sizing.check(cfg, sizing.launch_slots(), "w", process=True, host=(1, "test"))


def test_the_host_memory_is_read():
    have = sizing.host_available()
    assert have is None or (have[0] > 0 and have[1])


# ---- the commands ------------------------------------------------------------------------


def _run(argv: list[str], env: dict, timeout: float) -> tuple[int, str, str, float, int]:
    """A command in its own process group through a parent that reports its
    peak resident memory (KiB); (exit status, stdout, stderr, seconds, peak)."""
    wrapper = ("import resource, subprocess, sys\n"
               "code = subprocess.run(sys.argv[1:]).returncode\n"
               "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)\n"
               "sys.exit(code)\n")
    code, out, err, seconds = run_bounded([sys.executable, "-c", wrapper, *argv], timeout, env, what=str(argv[3:5]))
    peak = int(out.strip().splitlines()[-1].split()[1])
    return code, out, err, seconds, peak


def test_check_refuses_a_giant_n_layer_in_one_line_without_allocating():
    code, out, err, secs, peak = _run(crucible_cmd("check", "model.n_layer=100000"), child_env(), timeout=60)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("crucible: model.n_layer=100000: "), err
    assert "available" in lines[0] and "--no-check" in lines[0], err
    assert secs < 30, f"took {secs:.1f}s"
    assert peak < 2 * 1024 * 1024, f"peak RSS {peak} KiB"      # (torch imported; nothing of the model)


def test_launch_refuses_a_giant_n_layer_before_starting_anything(tmp_path):
    run = tmp_path / "run"
    code, out, err, secs, peak = _run(crucible_cmd("launch", "--run-dir", str(run), "model.d_model=65536",
                                                   "model.n_head=1"), child_env(), timeout=60)
    lines = [x for x in (out + err).splitlines() if x.strip() and not x.startswith("PEAK")]
    assert code == 2, out + err
    assert len(lines) == 1 and lines[0].startswith("crucible: model.d_model=65536: the job's 8 workers"), lines
    assert secs < 30 and peak < 2 * 1024 * 1024, (secs, peak)
    assert not (run / "logs").exists()


def test_a_worker_refuses_a_stage_too_big_for_this_host(tmp_path):
    """A coordinator started by hand (as on a cluster: no pre-flight) with a
    stage of ~4 TB: its worker exits 2 before building it, with one line
    naming model.n_layer on stderr and in its error file (which the launcher
    shows, and compares for its crash-loop rule), and says so to the coordinator."""
    run = tmp_path / "run"
    big = ["--replicas", "1", "--stages", "1", "model.n_layer=1000000"]
    env = dict(child_env(), CRUCIBLE_TOKEN="t0ken" * 4)
    env.pop(sizing.SKIP_ENV, None)
    log = open(tmp_path / "coord.log", "wb")
    coord = subprocess.Popen(crucible_cmd("coordinator", "--run-dir", str(run), "--bind", "127.0.0.1:0",
                                          "--fresh", *big), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t_end = time.monotonic() + 30
        addr_file = run / "coordinator.addr"
        while not (addr_file.exists() and addr_file.read_text().strip()):
            assert coord.poll() is None and time.monotonic() < t_end, (tmp_path / "coord.log").read_text()
            time.sleep(0.1)
        addr = addr_file.read_text().strip()
        error_file = tmp_path / "r0s0.error"
        wenv = dict(env, CRUCIBLE_ERROR_FILE=str(error_file))
        code, out, err, secs, peak = _run(crucible_cmd("worker", "--coordinator", addr, "--replica", "0",
                                                       "--stage", "0"), wenv, timeout=60)
        last = [x for x in err.splitlines() if x.strip()][-1]
        assert code == 2, err
        assert last.startswith("crucible: model.n_layer=1000000: stage 0 (r0s0) needs ~"), err
        assert "more than this host has in all" in last and f"{sizing.SKIP_ENV}=1" in last, last
        assert "Traceback" not in err, err
        assert error_file.read_text().strip() == last[len("crucible: "):]
        assert peak < 2 * 1024 * 1024, f"peak RSS {peak} KiB"
        from crucible.metrics import read_events

        t_end = time.monotonic() + 10
        while not read_events(str(run), "worker_error") and time.monotonic() < t_end:
            time.sleep(0.1)
        assert "model.n_layer=1000000" in read_events(str(run), "worker_error")[0]["error"]
    finally:
        try:
            os.killpg(coord.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        coord.wait(10)
        log.close()
