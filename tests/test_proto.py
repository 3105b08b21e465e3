import subprocess
import sys

import pytest

from conftest import ROOT


def test_generated_code_is_fresh():
    """crucible/_pb is generated from proto/crucible.proto and must match it."""
    out = subprocess.run([sys.executable, "-m", "crucible.gen_proto", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# The wire contract of each protocol version: wire_fingerprint() of the
# messages, enums and methods its proto/crucible.proto declared. A worker and a
# coordinator of the same PROTOCOL_VERSION must read each other's messages
# alike, so a change of the proto changes the fingerprint and fails the test
# below until PROTOCOL_VERSION is bumped and its fingerprint added here.
WIRE = {
    4: "caa6eaf9be29ba04",      # as written at 330d8a2 and f20ded0
    6: "d2393628db375ace",      # as written at ebce930 (7ef1475 then added RegisterReply.outer_origin as 6)
    7: "b7d9fa67d0845744",
}


def wire_fingerprint() -> str:
    """A digest of what the generated proto declares that peers must agree
    on: each message's fields (number, name, type, label, message or enum
    type, oneof), enums and RPC methods; not comments, not options."""
    import hashlib

    from google.protobuf import descriptor_pb2

    from crucible._pb import crucible_pb2 as pb

    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    lines = []

    def enum(e, where):
        lines.append(f"enum {where}{e.name} " + " ".join(f"{v.name}={v.number}" for v in e.value))

    def message(m, where):
        lines.append(f"message {where}{m.name}")
        for f in m.field:
            oneof = f.oneof_index if f.HasField("oneof_index") else ""
            lines.append(f"  {f.number} {f.name} {f.type} {f.label} {f.type_name} {oneof}")
        for e in m.enum_type:
            enum(e, f"{where}{m.name}.")
        for n in m.nested_type:
            message(n, f"{where}{m.name}.")

    for m in fdp.message_type:
        message(m, "")
    for e in fdp.enum_type:
        enum(e, "")
    for s in fdp.service:
        for r in s.method:
            lines.append(f"rpc {s.name}.{r.name} {r.input_type} {r.output_type} {r.client_streaming} "
                         f"{r.server_streaming}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def test_a_change_of_the_wire_bumps_the_protocol_version():
    """RegisterReply.outer_origin was added under protocol version 6: a worker
    of the version before it (ebce930) was let into a job of the version after
    and would number outer rounds without it after a --resume that changed
    outer.H (it was refused only by a config key it did not know)."""
    from crucible import PROTOCOL_VERSION

    got = wire_fingerprint()
    assert WIRE.get(PROTOCOL_VERSION) == got, (
        f"proto/crucible.proto's messages are {got}, not those of protocol version {PROTOCOL_VERSION} "
        f"({WIRE.get(PROTOCOL_VERSION)}): bump crucible.PROTOCOL_VERSION and add its fingerprint to WIRE")
    assert list(WIRE.values()).count(got) == 1


def test_control_plane_never_imports_torch():
    code = ("import sys, crucible.cli, crucible.launch, crucible.status, crucible.coordinator.server, "
            "crucible.config, crucible.rpc, crucible.kill; assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


_FRAME_FAULTS = """
import os, resource, sys
import torch
from crucible import procs, wire
from crucible._pb import crucible_pb2 as pb
torch.set_num_threads(1)
tuned = procs.keep_large_buffers()
t = torch.randn(4, 512, 1024)      # 8 MB, a boundary of a 200M-parameter model in fp32
def frame():                        # the data path of one activation, both ends
    f = pb.Frame(kind=pb.Frame.FORWARD, tensor=wire.to_wire(t))
    g = pb.Frame.FromString(f.SerializeToString())
    return wire.from_wire(g.tensor, torch.float32, (4, 512, 1024))
for _ in range(3):
    frame()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    assert torch.equal(frame(), t)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_frames_of_megabytes_reuse_their_memory():
    """A worker keeps glibc from mapping fresh pages for every frame of a few MB
    (a page fault each 4 KiB, a 7x slower frame); $CRUCIBLE_MALLOC=glibc keeps
    glibc's own behaviour."""
    import os

    if not sys.platform.startswith("linux"):
        return

    def faults(**env):
        out = subprocess.run([sys.executable, "-c", _FRAME_FAULTS], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        tuned, n = out.stdout.split()
        return tuned == "True", int(n)

    tuned, n = faults()
    plain, m = faults(CRUCIBLE_MALLOC="glibc")
    assert tuned and not plain
    assert m > 10 * 2048, m                   # glibc: at least a buffer's pages each frame
    assert n < m / 20, (n, m)


def test_a_frame_serialized_in_two_parts_reads_as_the_frame_built_field_by_field():
    """``wire.encode_frame`` writes the frame with its tensor's header, then the
    tensor's bytes as a second ``tensor`` field: any protobuf parser merges the
    two into the Frame that ``SerializeToString`` of the whole would give (what
    it saves: ``crucible bench wire``)."""
    import torch

    from crucible import wire
    from crucible._pb import crucible_pb2 as pb
    from crucible.compress.activations import make_codec

    g = torch.Generator().manual_seed(0)
    targets = wire.tokens_to_wire(torch.randint(0, 256, (2, 64), generator=g), 256)
    cases = [(torch.randn(2, 64, 32, generator=g), None),
             (torch.randn(2, 64, 32, generator=g).to(torch.bfloat16), None),
             (torch.randn(2, 64, 32, generator=g), make_codec("int8", 32, seed=1)),
             (torch.randn(2, 64, 32, generator=g)[:, ::2], None),        # not contiguous
             (torch.zeros(0, 64, 32), None),
             (None, None)]
    for t, codec in cases:
        f = pb.Frame(kind=pb.Frame.FORWARD, step=7, micro=1, epoch=3, src_replica=1, src_stage=2, targets=targets)
        out = wire.encode_frame(f, t, codec)
        got = pb.Frame.FromString(out.data)
        assert got.sent_at > 0 and got.sent_at == f.sent_at
        want = pb.Frame(kind=pb.Frame.FORWARD, step=7, micro=1, epoch=3, src_replica=1, src_stage=2, targets=targets,
                        sent_at=f.sent_at)
        if t is not None:
            want.tensor.CopyFrom(wire.to_wire(t, codec))
        assert got == want
        assert got.SerializeToString() == want.SerializeToString()
        assert (out.kind, out.nbytes, out.raw_nbytes) == (pb.Frame.FORWARD, *wire.frame_nbytes(want))
        if t is not None and codec is None:
            assert torch.equal(wire.from_wire(got.tensor, t.dtype, tuple(t.shape)), t)


def _frames_to_parse():
    """Serialized Frames as peers send them (encode_frame, field by field) and
    as they might (the data in neither or both of two tensor fields)."""
    import torch

    from crucible import wire
    from crucible._pb import crucible_pb2 as pb
    from crucible.compress.activations import make_codec

    g = torch.Generator().manual_seed(1)
    targets = wire.tokens_to_wire(torch.randint(0, 256, (2, 64), generator=g), 256)
    out = []
    for t, codec in [(torch.randn(2, 64, 32, generator=g), None),
                     (torch.randn(2, 64, 32, generator=g).to(torch.bfloat16), None),
                     (torch.randn(2, 64, 32, generator=g), make_codec("int8", 32, seed=1)),
                     (torch.zeros(0, 64, 32), None), (None, None)]:
        f = pb.Frame(kind=pb.Frame.FORWARD, step=7, micro=1, epoch=3, src_replica=1, src_stage=2, targets=targets,
                     tokens=targets)
        out.append(wire.encode_frame(f, t, codec).data)
        if t is not None:
            out.append(pb.Frame(kind=pb.Frame.BACKWARD, step=2, loss=1.5, tensor=wire.to_wire(t, codec))
                       .SerializeToString())
    a = pb.Frame(kind=pb.Frame.FORWARD, tensor=pb.Tensor(dtype="float32", shape=[2], data=b"\x01" * 8))
    b = pb.Frame(tensor=pb.Tensor(data=b"\x02" * 8), step=9)
    out.append(a.SerializeToString() + b.SerializeToString())        # two data fields: the last one counts
    out.append(pb.Frame(kind=pb.Frame.HELLO, epoch=5, src_stage=1, auth=b"t" * 32).SerializeToString())
    return out


def test_a_frame_parsed_without_copying_its_data_is_the_frame_protobuf_parses(monkeypatch):
    """``wire.parse_frame`` (what a worker's streams parse frames with) gives
    the tensor's data as a view into the received bytes and the frame without
    it: put back together, exactly what ``Frame.FromString`` reads, for every
    way a peer may lay the frame out; a frame without data comes back whole,
    and so does one under SPLIT_MIN_BYTES."""
    from crucible import wire
    from crucible._pb import crucible_pb2 as pb

    small = _frames_to_parse()[0]
    assert len(small) < wire.SPLIT_MIN_BYTES
    frame, data = wire.parse_frame(small)
    assert data is None and frame == pb.Frame.FromString(small)
    monkeypatch.setattr(wire, "SPLIT_MIN_BYTES", 0)     # the frames below are small: split them all
    for raw in _frames_to_parse():
        want = pb.Frame.FromString(raw)
        frame, data = wire.parse_frame(raw)
        if data is None:
            assert not want.tensor.data and frame == want
            continue
        assert isinstance(data, memoryview) and data.obj is raw and frame.tensor.data == b""
        assert bytes(data) == want.tensor.data
        frame.tensor.data = bytes(data)
        assert frame == want and frame.SerializeToString() == want.SerializeToString()


def test_parse_frame_fails_where_protobuf_fails_and_agrees_where_it_reads(monkeypatch):
    """Truncated and corrupted frames: ``parse_frame`` raises protobuf's
    DecodeError exactly where ``Frame.FromString`` does (the Pipe answers
    INVALID_ARGUMENT for both), and reads the same frame where it reads one."""
    import random

    from google.protobuf.message import DecodeError

    from crucible import wire
    from crucible._pb import crucible_pb2 as pb

    monkeypatch.setattr(wire, "SPLIT_MIN_BYTES", 0)
    rng = random.Random(0)
    tried = failed = 0
    for raw in _frames_to_parse():
        cuts = [raw[:n] for n in rng.sample(range(len(raw)), min(len(raw), 40))]
        flips = []
        for _ in range(60):
            b = bytearray(raw)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(min(len(b), 80)) if rng.random() < 0.8 else rng.randrange(len(b))
                b[i] = rng.randrange(256)
            flips.append(bytes(b))
        for bad in cuts + flips:
            tried += 1
            try:
                want = pb.Frame.FromString(bad)
            except DecodeError:
                failed += 1
                with pytest.raises(DecodeError):
                    wire.parse_frame(bad)
                continue
            frame, data = wire.parse_frame(bad)
            if data is not None:
                frame.tensor.data = bytes(data)
            assert frame == want, bad
    assert tried > 500 and 0.1 < failed / tried < 0.9, (tried, failed)
