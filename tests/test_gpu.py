"""The GPU suite (``pytest -m gpu``): every feature on the device.

Skipped where torch sees no CUDA GPU. ``CRUCIBLE_GPU_TESTS_DEVICE=cpu`` runs
the same tests on the CPU (how this suite is checked on machines without a
GPU before a GPU run; ``launch/gpu-check.sh`` runs it on one).

* the activation codecs encode on the device exactly as on the CPU;
* a pipeline on the device (fp32, and bf16 with activation checkpointing)
  computes bitwise what one process on the same device does
  (``debug.deterministic``: deterministic kernels);
* SIGKILL, then resume from a checkpoint, ends bitwise where a straight run ends;
* ``crucible launch --device``: outer sync (SparseLoCo and DiLoCo), a killed
  inner worker skipped then replaced from its peer, and both replicas'
  θ_global equal at the end; ``status`` shows each worker's device;
* every copy of a stage lost: rebuilt from a checkpoint and the outer rounds since;
* ``job.mps=on`` (where the MPS binary is): a killed stage's neighbours on the
  same MPS server train on, and the daemon ends with the job.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import threading

import pytest
import torch

import test_checkpoint_resume as resume
from conftest import TINY
from test_equivalence import M, _cfg_overrides, _dumped, split_reference
from test_replacement_checkpoint import every_copy_lost_is_rebuilt
from test_sparseloco import restored_diloco


def _device() -> str | None:
    forced = os.environ.get("CRUCIBLE_GPU_TESTS_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else None


DEVICE = _device()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE is None, reason="no CUDA GPU (CRUCIBLE_GPU_TESTS_DEVICE=cpu runs these on "
                                                        "the CPU)")]
# net.overlap_copies=on: boundary sends off the compute thread (on side CUDA
# streams), the default on a GPU, and on a CPU the same thread logic
ON = (f"job.device={DEVICE}", "debug.deterministic=true", "net.overlap_copies=on")


def _first_device() -> str:
    return "cuda:0" if DEVICE == "cuda" else str(DEVICE)


@pytest.mark.parametrize("spec", ["none", "bf16", "int8", "int8:zstd=0", "int4", "subspace:rank=4"])
def test_codecs_on_the_device_match_the_cpu(spec):
    from crucible.compress.activations import make_codec

    dev = _first_device()
    codec = make_codec(spec, 64, seed=3)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(4, 16, 64, generator=g) * 3).to(dtype)
        on_cpu = codec.encode(x)
        assert codec.encode(x.to(dev)) == on_cpu, (spec, dtype)     # the same bytes, encoded on the device
        back = codec.decode(on_cpu, x.shape, device=dev)
        assert back.device.type == torch.device(dev).type
        assert torch.equal(back.cpu(), codec.decode(on_cpu, x.shape)), (spec, dtype)


def _sleep_on(stream, cycles: int) -> None:
    """Hold a CUDA stream up (about 10 ms per 20M cycles); nothing on a CPU."""
    if stream is not None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)


def test_token_copies_to_the_device_do_not_wait_for_its_queued_work():
    """devices.to_device (a stage's token ids and targets): with the compute
    stream held up for about 0.5 s, the copy is queued behind it and returns at
    once (a copy from pageable memory waits for the stream), with the right values."""
    import time

    from crucible import devices

    dev = torch.device(_first_device())
    ids = torch.randint(0, 256, (4, 512), generator=torch.Generator().manual_seed(0))
    devices.to_device(ids, dev)                        # (the first page-locked block allocated)
    devices.synchronize(dev)
    if dev.type == "cuda":
        torch.cuda._sleep(1_000_000_000)
    t0 = time.perf_counter()
    got = devices.to_device(ids, dev)
    queued_s = time.perf_counter() - t0
    devices.synchronize(dev)
    held_s = time.perf_counter() - t0
    assert got.device == dev and torch.equal(got.cpu(), ids)
    assert queued_s < 0.2 * held_s or dev.type == "cpu", (queued_s, held_s)


@pytest.mark.parametrize("spec", ["none", "int8", "int8:zstd=0", "int4", "bf16", "subspace"])
def test_sends_and_receives_on_side_streams_see_the_compute_stream_s_data(spec):
    """The outbox (overlap on) waits for the compute stream's kernels before it
    copies on its side stream, and receives on another thread's side stream,
    queued there without a wait, are ordered before the compute stream's use
    of them and not freed under it: the bytes and tensors equal the CPU's (the
    subspace codec's matmuls: the same device's, synchronously, since a GPU
    sums in another order than the CPU)."""
    from crucible._pb import crucible_pb2 as pb
    from crucible.compress.activations import make_codec
    from crucible import wire
    from crucible.wire import encode_frame, from_wire, to_wire
    from crucible.worker.outbox import Outbox

    dev = torch.device(_first_device())
    cuda = dev.type == "cuda"
    compute = torch.cuda.default_stream(dev) if cuda else None
    codec = None if spec == "none" else make_codec(spec, 256, seed=3)
    exact = spec != "subspace"
    box = Outbox(dev, overlap=True)
    try:
        g = torch.Generator().manual_seed(2)
        a = torch.randn(512, 256, generator=g).to(dev)
        b = (torch.randn(256, 256, generator=g) / 16).to(dev)
        sent, ys = [], []
        for k in range(6):
            # the compute stream held up, then kernels the outbox's copy must
            # wait for (nothing here synchronizes: no copy from the host)
            _sleep_on(compute, 20_000_000)
            x = a
            for _ in range(20):
                x = torch.tanh(x @ b)
            ys.append(x.view(2, 256, 256) + k)
            # as Links sends: serialized on the outbox's thread, through its pinned buffer
            box.submit(lambda y=ys[-1]: sent.append(
                pb.Frame.FromString(encode_frame(pb.Frame(kind=pb.Frame.FORWARD), y, codec).data).tensor))
        assert box.flush(timeout=60)
    finally:
        box.close()
    want = [to_wire(y.cpu() if exact else y, codec) for y in ys]
    assert [m.SerializeToString() for m in sent] == [m.SerializeToString() for m in want]
    # as a receiving thread does: frame after frame through its pinned buffers,
    # nothing waited for on the host. On a GPU the receiver's side stream is
    # held up before each frame's copy, and each tensor is read on the compute
    # stream as soon as it is handed over (streams are the device's, not the
    # thread's): without the compute stream's wait for the copy it reads the
    # tensor before it is written. Every other frame the compute stream is
    # held up longer before that read and the tensor is dropped at once:
    # without record_stream its memory would go to the next frame's copy first.
    got = []

    def receive():
        side = wire._per_thread("streams", dev, lambda: torch.cuda.Stream(dev)) if cuda else None
        for k, m in enumerate(sent):
            with torch.cuda.device(dev) if cuda else contextlib.nullcontext():
                _sleep_on(side, 20_000_000)
                t = from_wire(m, torch.float32, (2, 256, 256), codec=codec, device=dev, side_stream=True)
                if k % 2:
                    _sleep_on(compute, 60_000_000)
                with torch.cuda.stream(compute) if cuda else contextlib.nullcontext():
                    got.append(t * 1)
                del t
    receiver = threading.Thread(target=receive)
    receiver.start()
    receiver.join(60)
    assert not receiver.is_alive() and len(got) == len(sent)
    for m, t in zip(sent, got):
        assert t.device.type == dev.type
        ref = from_wire(m, torch.float32, (2, 256, 256), codec=codec, device=None if exact else dev)
        assert torch.equal(t.cpu(), ref.cpu())


@pytest.mark.parametrize("extra", [(), ("train.precision=bf16", "train.activation_checkpointing=true")],
                         ids=["fp32", "bf16-recompute"])
def test_pipeline_on_the_device_equals_one_process(extra, start_job):
    torch.manual_seed(0)
    from crucible import devices

    devices.setup_deterministic(torch.device(_first_device()))
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "1", "--respawn-delay", "-1"],
                    _cfg_overrides(2, (*extra, *ON)), name="eq")
    assert job.wait(300) == 0, job.output()
    losses, grads = _dumped(job, 2)
    ref_losses, ref_grads = split_reference(2, extra, device=_first_device())
    assert len(losses) == M and losses == ref_losses
    assert sorted(grads) == sorted(ref_grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name].cpu(), g.cpu()), f"{name} differs on {DEVICE} with {extra}"


def test_diloco_momentum_restored_from_a_shard_steps_on_the_device():
    """A shard is read into host memory: a DiLoCo stage restored from one keeps
    its outer momentum on the device of θ_global, and its next round runs
    (on a GPU it failed: a CPU buffer added to a device tensor)."""
    dev = torch.device(_first_device())
    src, dst = restored_diloco(dev)
    assert dst.nesterov.buf.device == dst.theta_global.device == dev
    g = torch.full_like(src.theta_global, 0.25)
    src.nesterov.step(src.theta_global, g)
    dst.nesterov.step(dst.theta_global, g.to(dev))
    assert torch.equal(dst.theta_global.cpu(), src.theta_global)


def test_a_cpu_stages_adamw_state_resumes_fused_on_the_device():
    """A checkpoint taken by a CPU stage (Crucible's AdamW: fused None, step
    counts on the host) loaded by a stage on the device: make_optimizer's
    optimizer stays fused there, its step counts float32 beside the
    parameters, and it steps; on the CPU (CRUCIBLE_GPU_TESTS_DEVICE=cpu) the
    per-parameter AdamW loads it instead."""
    from crucible.config import Config
    from crucible.worker import optim

    dev = torch.device(_first_device())
    train = Config().train
    torch.manual_seed(0)
    cpu_m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    cpu_opt = optim.make_optimizer(cpu_m, train)
    cpu_m(torch.randn(3, 8)).sum().backward()
    optim.apply_step(cpu_m, cpu_opt, 1.0, 1e-3)
    m = copy.deepcopy(cpu_m).to(dev)
    opt = optim.make_optimizer(m, train)
    opt.load_state_dict(copy.deepcopy(cpu_opt.state_dict()))
    if dev.type == "cuda":
        assert isinstance(opt, optim.FusedAdamW) and all(g["fused"] is True for g in opt.param_groups)
        assert all(st["step"].device == p.device and st["step"].dtype == torch.float32
                   for p, st in opt.state.items())
    m(torch.randn(3, 8, device=dev)).sum().backward()
    optim.apply_step(m, opt, 1.0, 1e-3)
    assert all(st["step"].item() == 2.0 for st in opt.state.values())


@pytest.mark.parametrize("mode", ["sparseloco", "diloco"])
def test_sigkill_then_resume_on_the_device_is_bitwise_exact(mode, tmp_path):
    overrides = resume.CKPT + list(ON) + [f"outer.mode={mode}"]
    reference = resume.straight_run(str(tmp_path / "straight"), overrides=overrides, timeout=600)
    run_dir = str(tmp_path / "killed")
    resume.sigkill_then_resume(run_dir, overrides=overrides + resume.PACED, timeout=600, commit_timeout=300)
    assert resume._events(run_dir, "ckpt_resume")
    resume._same_final_state(run_dir, reference)


@pytest.mark.parametrize("mode", ["sparseloco", "diloco"])
def test_launch_on_the_device_with_a_killed_inner_worker(mode, start_job):
    """The issue's fault scenario: a 2 x 3 job with outer sync on the device, an
    inner worker SIGKILLed and respawned; both replicas' θ_global equal at the end."""
    steps = 150      # paced (4 Mbit/s: ~0.13 s a step) so that the kill lands mid-run on a fast device
    job = start_job(["--replicas", "2", "--stages", "3", "--steps", str(steps), "--respawn-delay", "0.5",
                     "--device", DEVICE],
                    TINY + [f"outer.mode={mode}", "outer.H=5", "debug.dump_final=true", "net.link_mbps=4",
                            "net.overlap_copies=on", "fault.heartbeat_timeout_s=10", "fault.rpc_timeout_s=20"], name=mode)
    st = job.wait_for(lambda s: s if all(r["step"] >= 8 for r in s["replicas"]) else None, 300, "both replicas training")
    want = "cuda" if DEVICE == "cuda" else DEVICE
    assert all(str(w.get("device", "")).startswith(want) for w in st["workers"]), st["workers"]
    if DEVICE == "cuda":
        assert all(w.get("mem_total_mb", 0) > 0 for w in st["workers"]), st["workers"]
    victim = next(w for w in st["workers"] if w["replica"] == 0 and w["stage"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    job.wait_for(lambda s: [e for e in job.events("route_change") if e["routes"].get("0") == [0, 2]], 60,
                 "replica 0 skipping stage 1")
    assert job.wait(600) == 0, job.output()
    assert [e for e in job.events("replacement_ready") if e["replica"] == 0 and e["stage"] == 1]
    finals = resume._dumps(job.run_dir)
    assert sorted(finals) == [f"r{r}s{s}" for r in range(2) for s in range(3)]
    for s in range(3):
        a, b = finals[f"r0s{s}"]["outer"], finals[f"r1s{s}"]["outer"]
        assert a["round"] == b["round"] == steps // 5
        assert torch.equal(a["theta_global"].cpu(), b["theta_global"].cpu()), f"stage {s}: θ_global differs"
    assert [e for e in job.events("outer_round")], "no outer round closed"


def test_every_copy_of_a_stage_lost_on_the_device_is_rebuilt_from_a_checkpoint(start_job):
    every_copy_lost_is_rebuilt(start_job, (f"job.device={DEVICE}",))


@pytest.mark.skipif(DEVICE != "cuda" or not __import__("shutil").which("nvidia-cuda-mps-control"),
                    reason="CUDA MPS needs a GPU and nvidia-cuda-mps-control on PATH")
def test_mps_job_survives_a_killed_stage_and_quits_its_daemon(start_job):
    """job.mps=on: three stages on one GPU through the launch's own MPS daemon;
    an inner worker SIGKILLed is skipped and replaced while its neighbours,
    clients of the same MPS server (every worker is one), train on (no other
    worker declared dead);
    the daemon and its directory are gone when the job ends."""
    steps = 120
    job = start_job(["--replicas", "1", "--stages", "3", "--steps", str(steps), "--respawn-delay", "0.5",
                     "--device", "cuda:0"],
                    TINY + ["job.mps=on", "net.link_mbps=4", "fault.heartbeat_timeout_s=10",
                            "fault.rpc_timeout_s=20"], name="mps")
    st = job.wait_for(lambda s: s if s["replicas"][0]["step"] >= 8 else None, 300, "training under MPS")
    pids = {w["stage"]: w["pid"] for w in st["workers"]}
    # every worker is a client of the launch's MPS server
    pipe = job.output().split("pipe directory ", 1)[1].split(")", 1)[0]

    def ask(cmd: str) -> list[str]:
        return subprocess.run(["nvidia-cuda-mps-control"], input=cmd + "\n", capture_output=True, text=True,
                              timeout=10, env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe)).stdout.split()

    servers = ask("get_server_list")
    raw = {server: ask(f"get_client_list {server}") for server in servers}
    clients = {int(c) for got in raw.values() for c in got if c.isdigit()}
    # (pids as the daemon sees them: the same namespace here; if not, at least as many clients as workers)
    assert servers and (set(pids.values()) <= clients or len(clients) >= len(pids)), (pids, raw)
    os.kill(pids[1], signal.SIGKILL)
    job.wait_for(lambda s: [e for e in job.events("route_change") if e["routes"].get("0") == [0, 2]], 60,
                 "stage 1 skipped")
    assert job.wait(600) == 0, job.output()
    out = job.output()
    assert "CUDA MPS on for the workers" in out, out
    assert [e for e in job.events("replacement_ready") if e["stage"] == 1]
    # the one fault is the killed worker's: its neighbours on the same MPS server lived on
    dead = [(e["stage"], e["pid"]) for e in job.events("fault") if e.get("kind") == "worker_dead"]
    assert dead == [(1, pids[1])], dead
    assert not os.path.exists(pipe), f"the MPS pipe directory {pipe} outlived the job"
