"""Bad input gets a clear gRPC status, never UNKNOWN, and the job keeps running.

One job (1 replica x 2 stages) serves every test in this module.
"""

from __future__ import annotations

import subprocess
import threading
import time

import grpc
import pytest
import torch

from conftest import ROOT, TINY, Job, crucible_cmd, child_env
from crucible import PROTOCOL_VERSION, rpc
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg
from crucible.wire import to_wire

GARBAGE = [b"\xff\xff\xff\xff\xff", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x0a\xff\x01abc"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("bad") / "run", ["--replicas", "1", "--stages", "2", "--steps", "100000",
                                                      "--respawn-delay", "-1"], TINY)
    try:
        j.wait_for(lambda st: st["replicas"][0]["step"] >= 2, 90, "training to start")
        yield j
    finally:
        j.kill()


def _status(job) -> dict:
    """The job's status, asked again while a loaded machine makes a call fail."""
    return job.wait_for(lambda st: st, 30, "the job's status")


def assert_still_training(job):
    before = _status(job)["replicas"][0]["step"]
    job.wait_for(lambda st: st["replicas"][0]["step"] > before, 30, "more steps after bad input")
    assert all(w["state"] == "alive" for w in _status(job)["workers"])


def _worker_addr(job, stage):
    return next(w["address"] for w in _status(job)["workers"] if w["stage"] == stage)


def _raw(channel, method, kind="unary_unary"):
    return getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)


COORD_METHODS = [("Register", "unary_unary"), ("Heartbeat", "unary_unary"), ("WatchRoutes", "unary_stream"),
                 ("Report", "unary_unary"), ("Status", "unary_unary"), ("OuterExchange", "unary_unary"),
                 ("ReportShard", "unary_unary")]
STAGE_METHODS = [("Pipe", "stream_stream"), ("Probe", "unary_unary")]


def _call(channel, service, method, kind, payload, md):
    fn = _raw(channel, f"/crucible.v1.{service}/{method}", kind)
    if kind == "unary_unary":
        return fn(payload, metadata=md, timeout=10)
    if kind == "unary_stream":
        return list(fn(payload, metadata=md, timeout=10))
    return list(fn(iter([payload]), metadata=md, timeout=10))


def test_unauthenticated_calls_are_refused(job):
    for service, addr, methods in (("Coordinator", job.address(), COORD_METHODS),
                                   ("Stage", _worker_addr(job, 1), STAGE_METHODS)):
        with rpc.make_channel(addr) as ch:
            for method, kind in methods:
                for md in ((), rpc.metadata("wrong-token")):
                    with pytest.raises(grpc.RpcError) as e:
                        _call(ch, service, method, kind, b"", md)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, e.value.details())
    assert_still_training(job)


def test_garbage_bytes_to_every_rpc(job):
    md = rpc.metadata(job.token())
    for service, addr, methods in (("Coordinator", job.address(), COORD_METHODS),
                                   ("Stage", _worker_addr(job, 1), STAGE_METHODS),
                                   ("Stage", _worker_addr(job, 0), STAGE_METHODS)):
        with rpc.make_channel(addr) as ch:
            for method, kind in methods:
                for junk in GARBAGE:
                    with pytest.raises(grpc.RpcError) as e:
                        _call(ch, service, method, kind, junk, md)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (service, method, e.value.details())
                    assert "not a valid" in e.value.details()
    assert_still_training(job)


def _pipe(job, frames):
    with rpc.make_channel(_worker_addr(job, 1)) as ch:
        stub = pbg.StageStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Pipe(iter(frames), metadata=rpc.metadata(job.token()), timeout=10))
    return e.value


def _forward(t: torch.Tensor, targets=None, **kw):
    targets = targets if targets is not None else torch.zeros(2, 32, dtype=torch.uint8)
    return pb.Frame(kind=pb.Frame.FORWARD, step=0, micro=0, tensor=to_wire(t), targets=to_wire(targets), **kw)


@pytest.mark.parametrize("case", ["dtype", "shape", "bytes", "targets", "targets_dtype", "declared"])
def test_bad_tensors_are_invalid_argument(job, case):
    good = torch.zeros(2, 32, 32)  # microbatch 2 (= 8 / 4), seq 32, d 32
    if case == "dtype":
        frame = _forward(good.double())
    elif case == "shape":
        frame = _forward(torch.zeros(2, 32, 31))
    elif case == "bytes":
        frame = _forward(good)
        frame.tensor.data = frame.tensor.data[:-4]
    elif case == "targets":
        frame = _forward(good, targets=torch.zeros(2, 33, dtype=torch.uint8))
    elif case == "targets_dtype":  # token ids travel as uint8 for a 256-token vocabulary
        frame = _forward(good, targets=torch.zeros(2, 32, dtype=torch.int64))
    else:  # the declared shape does not match the byte count
        frame = _forward(good)
        frame.tensor.shape[:] = [2, 32, 64]
    err = _pipe(job, [frame])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert_still_training(job)


def test_impostor_and_stale_streams_are_refused(job):
    st = _status(job)
    epoch = st["replicas"][0]["epoch"]
    hello = pb.Frame(kind=pb.Frame.HELLO, src_replica=0, src_stage=0, epoch=epoch - 1)
    assert _pipe(job, [hello]).code() == grpc.StatusCode.FAILED_PRECONDITION
    hello = pb.Frame(kind=pb.Frame.HELLO, src_replica=7, src_stage=0, epoch=epoch)
    assert _pipe(job, [hello]).code() == grpc.StatusCode.PERMISSION_DENIED
    hello = pb.Frame(kind=pb.Frame.HELLO, src_replica=0, src_stage=1, epoch=epoch)
    assert _pipe(job, [hello]).code() == grpc.StatusCode.PERMISSION_DENIED
    assert_still_training(job)


@pytest.mark.slow   # (about 10-20 s: the main suite keeps under 10 minutes)
def test_streams_that_never_say_hello_cannot_hold_the_worker(job):
    """Twenty Pipe streams opened with the token that never send a frame: past
    MAX_UNANNOUNCED at once they are refused (RESOURCE_EXHAUSTED), so they
    cannot take every server thread: the worker answers probes all along (a
    failed probe would have it evicted). Those let in are ended
    (DEADLINE_EXCEEDED) once HELLO_WAIT_S is over."""
    from crucible.worker.dataplane import HELLO_WAIT_S, MAX_UNANNOUNCED

    hold = threading.Event()

    def silent():
        hold.wait(90)
        yield from ()

    md = rpc.metadata(job.token())
    codes = []
    try:
        with rpc.make_channel(_worker_addr(job, 1)) as ch:
            stub = pbg.StageStub(ch)
            t0 = time.monotonic()
            calls = [stub.Pipe(silent(), metadata=md, timeout=60) for _ in range(20)]
            for _ in range(3):
                assert stub.Probe(pb.ProbeRequest(), metadata=md, timeout=2).stage == 1
                time.sleep(0.5)
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    list(call)
                codes.append(e.value.code())
            elapsed = time.monotonic() - t0
    finally:
        hold.set()
    exhausted, expired = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED), codes.count(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert exhausted + expired == 20 and exhausted >= 20 - MAX_UNANNOUNCED and expired >= 1, codes
    assert elapsed < HELLO_WAIT_S + 15, elapsed
    assert_still_training(job)
    assert not job.events("fault"), job.events("fault")


def test_hellos_from_a_future_epoch_cannot_hold_the_worker(job):
    """Twenty Pipe streams whose HELLO names an epoch far ahead of the
    route's: each waits (seconds) for that epoch to arrive over WatchRoutes.
    They held a server thread each, uncounted, so the worker's 16 were all
    taken and its Probe went unanswered (the coordinator evicts a worker whose
    probe fails). Until a HELLO is taken its stream counts against
    MAX_UNANNOUNCED: the rest are RESOURCE_EXHAUSTED at once, the worker
    answers probes all along, and the waiting ones end FAILED_PRECONDITION."""
    from crucible.worker.dataplane import MAX_UNANNOUNCED

    md = rpc.metadata(job.token())
    hello = pb.Frame(kind=pb.Frame.HELLO, epoch=2 ** 64 - 1, src_replica=0, src_stage=0)
    with rpc.make_channel(_worker_addr(job, 1)) as ch:
        stub = pbg.StageStub(ch)
        calls = [stub.Pipe(iter([hello]), metadata=md, timeout=30) for _ in range(20)]
        time.sleep(0.5)
        for _ in range(3):
            assert stub.Probe(pb.ProbeRequest(), metadata=md, timeout=2).stage == 1
            time.sleep(0.5)
        codes = []
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            codes.append(e.value.code())
    waited = codes.count(grpc.StatusCode.FAILED_PRECONDITION)
    assert waited + codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 20 and 1 <= waited <= MAX_UNANNOUNCED, codes
    assert_still_training(job)
    assert not job.events("fault"), job.events("fault")


def test_a_refusal_that_echoes_a_huge_field_still_travels(job):
    """A refusal quoting what it refuses (a tensor of 100,000 dimensions, an
    address of 100,000 characters) made a status message over gRPC's 16 KiB
    header limit: the caller got RESOURCE_EXHAUSTED "Stream removed" instead
    of INVALID_ARGUMENT, and the worker logged 300 kB in one line. The
    message is cut to rpc.MAX_DETAILS."""
    frame = _forward(torch.zeros(2, 32, 32))
    frame.tensor.shape[:] = [1] * 100_000
    err = _pipe(job, [frame])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()[:300]
    assert "invalid shape" in err.details() and len(err.details()) < rpc.MAX_DETAILS + 100
    with rpc.make_channel(job.address()) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pbg.CoordinatorStub(ch).Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, replica=-1,
                                                                stage=-1, address="x" * 100_000),
                                             metadata=rpc.metadata(job.token()), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()[:300]
    assert "must be host:port" in e.value.details()
    assert_still_training(job)


def test_a_call_without_the_workers_secret_is_refused(job):
    """The job's token alone does not speak for a worker: a forged leave (its
    slot given up), "done" or pulse, a forged report (the replica done, the
    job rolled back), a junk outer contribution or a failed-shard report for
    a live worker's id gets PERMISSION_DENIED, and the job goes on as if
    nothing was said."""
    md = rpc.metadata(job.token())
    st = _status(job)
    wid = next(w["worker_id"] for w in st["workers"] if w["stage"] == 1)
    head = next(w["worker_id"] for w in st["workers"] if w["stage"] == 0)
    forged = ['{"event": "replica_done"}', '{"event": "stage_lost", "reason": "forged"}']
    with rpc.make_channel(job.address()) as ch:
        stub = pbg.CoordinatorStub(ch)
        calls = [lambda state=state: stub.Heartbeat(pb.HeartbeatRequest(worker_id=wid, state=state,
                                                                        secret=bytes(32)), metadata=md, timeout=10)
                 for state in ("leaving 143", "done", "pulse")]
        calls += [lambda: stub.Report(pb.ReportRequest(worker_id=head, events_json=forged, secret=bytes(32)),
                                      metadata=md, timeout=10),
                  lambda: stub.OuterExchange(pb.OuterRequest(worker_id=wid, stage=1, round=1, payload=b"junk",
                                                             mode="sparseloco", numel=4), metadata=md, timeout=10),
                  lambda: stub.ReportShard(pb.ShardReport(worker_id=wid, ckpt_step=1, name="r0s1.shard",
                                                          error="forged"), metadata=md, timeout=10)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
            assert "without that registration's secret" in e.value.details()
    assert_still_training(job)
    assert not job.events("fault"), job.events("fault")
    assert not job.events("job_rollback") and _status(job)["replicas"][0]["state"] == "training"


def test_protocol_version_mismatch(job):
    with rpc.make_channel(job.address()) as ch:
        stub = pbg.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION + 1, replica=-1, stage=-1,
                                             address="127.0.0.1:1"), metadata=rpc.metadata(job.token()), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version" in e.value.details()
    assert_still_training(job)


def test_unknown_worker_and_taken_slot(job):
    md = rpc.metadata(job.token())
    with rpc.make_channel(job.address()) as ch:
        stub = pbg.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.HeartbeatRequest(worker_id="r9s9-nobody"), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            stub.Report(pb.ReportRequest(worker_id="r9s9-nobody", events_json=['{"event":"x"}']), metadata=md,
                        timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, replica=0, stage=1,
                                             address="127.0.0.1:1"), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, replica=5, stage=0,
                                             address="127.0.0.1:1"), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A real worker's report with a malformed event is refused as a whole.
        wid = next(w["worker_id"] for w in _status(job)["workers"] if w["stage"] == 1)
        for events in (["not json"], ['{"event": "step", "step": "3"}']):
            with pytest.raises(grpc.RpcError) as e:
                stub.Report(pb.ReportRequest(worker_id=wid, secret=job.secret(wid), events_json=events),
                            metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert_still_training(job)


def test_bad_config_key_names_it(tmp_path):
    out = subprocess.run(crucible_cmd("launch", "--run-dir", str(tmp_path / "r"), "train.setps=3"),
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "unknown key 'train.setps'" in out.stderr and "did you mean 'train.steps'" in out.stderr
    out = subprocess.run(crucible_cmd("launch", "--run-dir", str(tmp_path / "r"), "train.lr=fast"),
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "'train.lr'" in out.stderr


def test_token_ids_travel_compact_and_are_range_checked():
    from crucible.wire import WireError, token_dtype, tokens_from_wire, tokens_to_wire

    t = torch.randint(0, 256, (2, 8))
    msg = tokens_to_wire(t, 256)
    assert msg.dtype == "uint8" and len(msg.data) == 16 and msg.raw_nbytes == 16 * 8
    assert torch.equal(tokens_from_wire(msg, (2, 8), 256), t)
    assert token_dtype(50257) == torch.uint16 and token_dtype(100_000) == torch.int32
    big = torch.tensor([[0, 999]])
    with pytest.raises(WireError, match="outside"):
        tokens_from_wire(tokens_to_wire(big, 1000), (1, 2), 999)
    with pytest.raises(WireError, match="dtype"):
        tokens_from_wire(tokens_to_wire(big, 1000), (1, 2), 256)


def test_a_flood_of_waiting_outer_calls_from_one_worker_holds_no_more_than_its_share(job):
    """A worker's outer calls wait (up to 20 s each) for their round: a worker
    that leaked them, or a token holder with its secret, held every one of the
    coordinator's threads with calls for rounds far ahead, which heartbeats
    and everyone's outer rounds need too. Past ``MAX_CALLS_PER_WORKER`` waiting
    calls a worker's next is refused at once (RESOURCE_EXHAUSTED, which a
    worker retries), and the job trains on."""
    from crucible.coordinator.outer import MAX_CALLS_PER_WORKER

    md = rpc.metadata(job.token())
    wid = next(w["worker_id"] for w in _status(job)["workers"] if w["stage"] == 1)
    t0 = time.time()
    with rpc.make_channel(job.address()) as ch:
        stub = pbg.CoordinatorStub(ch)
        req = pb.OuterRequest(worker_id=wid, secret=job.secret(wid), stage=1, round=10**6, mode="sparseloco",
                              step=0)
        # (20: below gRPC's own limit of concurrent calls, whose refusals would not be ours)
        calls = [stub.OuterExchange.future(req, metadata=md, timeout=15) for _ in range(20)]
        try:
            t_end = time.monotonic() + 10
            while sum(c.done() for c in calls) < len(calls) - MAX_CALLS_PER_WORKER and time.monotonic() < t_end:
                time.sleep(0.1)
            refused = [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                       and "outer calls of this worker wait" in c.details()]
            assert len(refused) == len(calls) - MAX_CALLS_PER_WORKER, \
                [(c.code(), c.details()) for c in calls if c.done()][:3]
            assert sum(not c.done() for c in calls) == MAX_CALLS_PER_WORKER
            assert_still_training(job)
        finally:
            for c in calls:
                c.cancel()
    assert [e for e in job.events("fault") if e["time"] >= t0] == []
