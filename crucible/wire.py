"""Tensors on the wire: torch.Tensor <-> crucible.v1.Tensor, with validation.

Every incoming tensor is checked against its declared dtype, shape and byte
count, and against the shape the receiver expects, before any byte of it is
used: a mismatch raises ``WireError`` (a ValueError; the RPC layer answers
INVALID_ARGUMENT). Nothing is ever silently reshaped.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from crucible._pb import crucible_pb2 as pb

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "uint16": torch.uint16,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_DIMS = 8


class WireError(ValueError):
    """An incoming tensor does not match what it declares or what is expected."""


_local = threading.local()


def _per_thread(kind: str, key, make):
    """This thread's own `kind` object for `key`, made once by `make()`."""
    cache = getattr(_local, kind, None)
    if cache is None:
        cache = {}
        setattr(_local, kind, cache)
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer of this shape and dtype, reused by this thread
    (a GPU copies to and from pinned memory about 4x faster than pageable).
    Not handed out while a copy this thread queued from its buffers without
    waiting (``copies_queued``) may still read them."""
    pending = _queued()
    for ev in pending:
        ev.synchronize()             # (long done, as a rule: the frame before's)
    pending.clear()
    shape = tuple(shape)
    return _per_thread("pinned", (shape, dtype), lambda: torch.empty(shape, dtype=dtype, pin_memory=True))


def copies_queued(device: torch.device) -> None:
    """A copy from this thread's pinned buffers to `device` was just queued on
    the current stream, maybe not waited for: this thread's next ``_pinned``
    waits for it (an event recorded now)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    _queued().append(ev)


def _queued() -> list:
    q = getattr(_local, "queued", None)
    if q is None:
        q = _local.queued = []
    return q


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.cpu()
    buf = _pinned(tuple(t.shape), t.dtype)
    buf.copy_(t)             # waits for the copy (the buffer is read right after)
    return buf


def _payload(t: torch.Tensor, codec) -> tuple[pb.Tensor, list]:
    """A tensor's header (everything but its bytes) and its bytes, as parts to
    join: a codec's payload (``encode_parts``), or a view of the host tensor's
    memory (no copy on a CPU; on a GPU this thread's pinned buffer). Views are
    valid until this thread's next copy: join them first."""
    t = t.detach()
    raw = t.numel() * t.element_size()
    if codec is not None:
        return pb.Tensor(dtype=NAMES[t.dtype], shape=list(t.shape), codec=codec.name, raw_nbytes=raw), \
            codec.encode_parts(t)
    if t.device.type != "cpu":
        t = _to_host(t)
    t = t.contiguous()
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return pb.Tensor(dtype=NAMES[t.dtype], shape=list(t.shape), raw_nbytes=raw), [data]


def _nbytes(parts: list) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def to_wire(t: torch.Tensor, codec=None) -> pb.Tensor:
    """A codec encodes where `t` is (on a GPU: quantize there, copy the compact
    payload); a raw tensor is copied to host whole."""
    msg, parts = _payload(t, codec)
    msg.data = b"".join(parts)
    return msg


# ---- frames serialized once ----------------------------------------------------------
#
# A protobuf message built field by field copies a tensor's bytes three times
# before gRPC's own copy: into a bytes object, into the message, and out again
# as it serializes (four, when the Tensor is built apart and put into its Frame).
# A data frame is instead serialized in two parts joined once: the frame with
# its tensor's header, then the tensor's bytes as a second occurrence of the
# same field, ``tensor { data: ... }``. The protobuf encoding merges repeated
# occurrences of a message field, so any parser reads the one Frame it would
# read from ``SerializeToString`` (``tests/test_proto.py`` checks it).

_FRAME_TENSOR_TAG = bytes([(pb.Frame.TENSOR_FIELD_NUMBER << 3) | 2])
_TENSOR_DATA_TAG = bytes([(pb.Tensor.DATA_FIELD_NUMBER << 3) | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class Outgoing:
    """A frame as the stream hands it to gRPC (``data``, serialized), with what
    the sender accounts for: its kind and its tensors' bytes on the wire and
    raw (``frame_nbytes``)."""

    __slots__ = ("kind", "data", "nbytes", "raw_nbytes")

    def __init__(self, kind: int, data: bytes, nbytes: int, raw_nbytes: int):
        self.kind, self.data, self.nbytes, self.raw_nbytes = kind, data, nbytes, raw_nbytes


def frame_nbytes(f: pb.Frame, tensor_data: bytes | None = None) -> tuple[int, int]:
    """A data frame's tensor bytes (activations or gradient, targets, token ids;
    the unset ones are empty): (on the wire, raw before compression).
    `tensor_data`: ``f.tensor.data`` where the caller has read it already
    (each read copies it out of the message)."""
    first = len(tensor_data if tensor_data is not None else f.tensor.data)
    return first + len(f.targets.data) + len(f.tokens.data), sum(t.raw_nbytes for t in (f.tensor, f.targets, f.tokens))


def encode_frame(frame: pb.Frame, tensor: torch.Tensor | None = None, codec=None) -> Outgoing:
    """Serialize `frame` for a stream, with `tensor` (encoded by `codec`) as its
    ``tensor``: the tensor's bytes are copied once, into the result. Stamps
    ``sent_at`` once the tensor is encoded (the transport time a receiver
    measures starts there: the stream's send queue counts as transport). Sets
    `frame`'s fields as it goes (a header without data): not for reuse."""
    nbytes, raw = frame_nbytes(frame)
    if tensor is None:
        frame.sent_at = time.monotonic()
        return Outgoing(frame.kind, frame.SerializeToString(), nbytes, raw)
    header, parts = _payload(tensor, codec)
    frame.tensor.CopyFrom(header)
    frame.sent_at = time.monotonic()
    n = _nbytes(parts)
    inner = _TENSOR_DATA_TAG + _varint(n)
    prefix = _FRAME_TENSOR_TAG + _varint(len(inner) + n) + inner
    return Outgoing(frame.kind, b"".join((frame.SerializeToString(), prefix, *parts)),
                    nbytes + n, raw + header.raw_nbytes)


def outgoing(frame) -> Outgoing:
    """`frame` as a stream queues it: an Outgoing as it is, a Frame serialized."""
    return frame if isinstance(frame, Outgoing) else encode_frame(frame)


def serialized(item) -> bytes:
    """gRPC's serializer for a stream of frames: an Outgoing's bytes, or a
    Frame's serialization."""
    return item.data if isinstance(item, Outgoing) else item.SerializeToString()


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    n, shift = 0, 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7
    raise _Unsplit


class _Unsplit(Exception):
    """Not the wire format parse_frame splits (left to protobuf's parser)."""


def _fields(buf: bytes, pos: int, end: int):
    """(field number, wire type, start of the field, start of its value, end)
    for each field of the message in buf[pos:end]."""
    while pos < end:
        start = pos
        tag, pos = _read_varint(buf, pos, end)
        number, kind = tag >> 3, tag & 7
        if kind == 0:
            _, pos = _read_varint(buf, pos, end)
            value = pos
        elif kind == 2:
            n, value = _read_varint(buf, pos, end)
            pos = value + n
        elif kind in (1, 5):
            value, pos = pos, pos + (8 if kind == 1 else 4)
        else:
            raise _Unsplit      # groups: never in a Frame
        if pos > end:
            raise _Unsplit
        yield number, kind, start, value, pos


def _split(raw: bytes) -> tuple[bytes, int, int]:
    """raw (a serialized Frame) without its tensor's data, and where that data
    is in raw. Raises _Unsplit where there is no data or raw is not well
    formed."""
    header, data, found = [], (0, 0), False
    for number, kind, start, value, end in _fields(raw, 0, len(raw)):
        if number != pb.Frame.TENSOR_FIELD_NUMBER or kind != 2:
            header.append(raw[start:end])
            continue
        rest, cut = [], False
        for inner, ikind, istart, ivalue, iend in _fields(raw, value, end):
            if inner == pb.Tensor.DATA_FIELD_NUMBER and ikind == 2:
                data, found, cut = (ivalue, iend), True, True   # (the last occurrence counts)
            else:
                rest.append(raw[istart:iend])
        if not cut:
            header.append(raw[start:end])
            continue
        body = b"".join(rest)
        header.append(_FRAME_TENSOR_TAG + _varint(len(body)) + body)
    if not found:
        raise _Unsplit
    return b"".join(header), data[0], data[1]


# Below this many bytes protobuf's parser (in C) is quicker than splitting the
# frame here (about 10 us of Python): measured crossover 128-256 KiB.
SPLIT_MIN_BYTES = 128 << 10


def parse_frame(raw: bytes) -> tuple[pb.Frame, memoryview | None]:
    """A serialized Frame as a receiver takes it: (the frame without its
    tensor's data, that data as a view into `raw`), not copied on its way to
    the tensor (protobuf's parser would copy it into the message, and every
    read of ``tensor.data`` copies it out again). A frame without tensor data:
    (the frame, None), as is a frame under SPLIT_MIN_BYTES. What is not well
    formed is left to protobuf's parser, which raises as it would
    (DecodeError)."""
    if len(raw) < SPLIT_MIN_BYTES:
        return pb.Frame.FromString(raw), None
    try:
        header, start, end = _split(raw)
    except _Unsplit:
        return pb.Frame.FromString(raw), None
    return pb.Frame.FromString(header), memoryview(raw)[start:end]


def from_wire(msg: pb.Tensor, expect_dtype: torch.dtype, expect_shape: tuple[int, ...],
              what: str = "tensor", codec=None, device=None, side_stream: bool = False,
              data: bytes | None = None) -> torch.Tensor:
    """Decode and validate; returns a fresh, writable, contiguous tensor. A
    codec's payload decodes to float32 (whatever the sender's dtype, which must
    still be the expected one), built on `device` (default: the CPU). With
    `side_stream`, a GPU's copy and a codec's kernels run on this thread's own
    CUDA stream (``_beside``), not behind the compute stream's queue. `data`:
    ``msg.data`` where the caller has read it already (each read is a copy)."""
    if msg.dtype not in DTYPES:
        raise WireError(f"{what}: unknown dtype {msg.dtype!r}")
    dtype = DTYPES[msg.dtype]
    if dtype != expect_dtype:
        raise WireError(f"{what}: dtype {msg.dtype}, expected {NAMES[expect_dtype]}")
    shape = tuple(int(d) for d in msg.shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise WireError(f"{what}: invalid shape {list(shape)}")
    if shape != tuple(expect_shape):
        raise WireError(f"{what}: shape {list(shape)}, expected {list(expect_shape)}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if msg.codec:
        if codec is None or msg.codec != codec.name:
            raise WireError(f"{what}: codec {msg.codec!r}, this boundary uses {getattr(codec, 'name', 'none')!r}")
    elif codec is not None and codec.name != "none":
        raise WireError(f"{what}: raw payload, this boundary uses codec {codec.name!r}")
    if data is None:
        data = msg.data             # (a copy out of the message: read once)
    if not msg.codec and len(data) != nbytes:
        raise WireError(f"{what}: {len(data)} bytes for {msg.dtype} {list(shape)} (needs {nbytes})")
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda and side_stream:
        return _beside(torch.device(device),
                       lambda: _decode(msg, data, dtype, shape, nbytes, what, codec, device, wait=False))
    return _decode(msg, data, dtype, shape, nbytes, what, codec, device)


def _decode(msg: pb.Tensor, data: bytes, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, what: str,
            codec, device, wait: bool = True) -> torch.Tensor:
    """`wait` False: on a GPU, the copy and kernels are queued, not waited
    for (``_beside``)."""
    if msg.codec:
        try:
            t = codec.decode(data, shape, device=device, wait=wait)
        except ValueError as e:
            raise WireError(f"{what}: payload does not decode: {e}") from None
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise WireError(f"{what}: decoded to {NAMES.get(t.dtype)} {list(t.shape)}")
        return t
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if device is not None and torch.device(device).type == "cuda":
        # on the receiving thread, off the compute thread: through a pinned buffer to the GPU
        buf = _pinned(shape, dtype)
        buf.view(-1).view(torch.uint8).numpy()[:] = memoryview(data)
        t = buf.to(device, non_blocking=True)
        copies_queued(torch.device(device))
        if wait:
            torch.cuda.current_stream(torch.device(device)).synchronize()
        return t
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


def _beside(device: torch.device, make) -> torch.Tensor:
    """Queue `make` (copies and kernels that build a tensor on `device`) on
    this thread's side stream, without waiting for it: the compute stream
    waits for it on the device (``wait_event``, queued now, before the tensor
    reaches the compute thread, so all that thread queues after it runs after
    the tensor is made), and the tensor is handed to the compute stream
    (``record_stream``: its memory is not reused until the compute stream's
    work queued before it is freed is done). Nothing on this thread waits for
    the GPU, but for the previous frame's copies when it reuses their pinned
    buffers (``_pinned``). The compute thread queues its work on the default
    stream (as the outbox and the stats assume too)."""
    assert device.index is not None, device      # (a bare "cuda" is GPU 0 on a new thread)
    side = _per_thread("streams", device, lambda: torch.cuda.Stream(device))
    with torch.cuda.device(device), torch.cuda.stream(side):
        t = make()
        made = torch.cuda.Event()
        made.record(side)
    compute = torch.cuda.default_stream(device)
    compute.wait_event(made)
    t.record_stream(compute)
    return t


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest dtype that holds token ids below vocab_size."""
    if vocab_size <= 256:
        return torch.uint8
    if vocab_size <= 65536:
        return torch.uint16
    return torch.int32 if vocab_size <= 2**31 else torch.int64


def tokens_to_wire(t: torch.Tensor, vocab_size: int) -> pb.Tensor:
    """Token ids (targets) in the narrowest dtype for the vocabulary: 1 byte a
    token for the built-in byte-level model instead of int64's 8."""
    msg = to_wire(t.to(token_dtype(vocab_size)))
    msg.raw_nbytes = t.numel() * 8   # "before" is int64, as the data loader makes them
    return msg


def tokens_from_wire(msg: pb.Tensor, shape: tuple[int, ...], vocab_size: int,
                     what: str = "targets") -> torch.Tensor:
    """Token ids as int64, refused unless they come in this vocabulary's dtype
    and every id is in [0, vocab_size)."""
    t = from_wire(msg, token_dtype(vocab_size), shape, what)
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise WireError(f"{what}: token ids outside [0, {vocab_size})")
    return t
