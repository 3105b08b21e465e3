"""Codecs for tensors that cross a pipeline stage boundary.

What crosses a boundary is the residual stream ``[B, T, d_model]`` float32 on
the way forward and its gradient (same shape) on the way back. A run picks one
codec per direction (``compress.forward`` / ``compress.backward``)::

    codec = make_codec("int4:group=32", d_model=768, seed=cfg.train.seed)
    payload = codec.encode(t)                       # bytes, header included
    t_hat = codec.decode(payload, expected_shape=(B, T, 768))   # fp32, contiguous

Codecs (spec string ``name[:key=value,key=value...]``)
------------------------------------------------------

``none``
    Raw little-endian float32. Lossless: ``decode(encode(t))`` is bitwise
    ``t.float()`` (NaN payloads and signed zeros included).
``bf16[:level=1]``
    Round to bfloat16 (round-to-nearest-even), split into a high-byte plane
    (sign + exponent, very compressible) and a low-byte plane, zstd. Bound,
    per element: ``|x - x_hat| <= 2**-8 * |x|`` for normal values (bf16 has 8
    significant bits), and ``<= 2**-134`` absolute in the subnormal range.
    Non-finite values are carried as they are; finite values of magnitude
    ``>= 2**128 * (1 - 2**-9)`` overflow to inf (bf16 has fp32's range, minus
    that last half ulp).
``int8[:zstd=1,level=1]``
    Symmetric per-row (last dim) absmax quantisation to ``[-127, 127]`` with a
    float32 step per row, zstd over steps and codes (``zstd=0``: no zstd,
    the payload is the steps and codes as they are, 1 byte per value plus 4
    per row; on a GPU only the quantisation runs then, on the device). The
    step ``s`` is the smallest float32 with ``127 * s >= rowabsmax`` (that is
    ``rowabsmax/127`` rounded up, so nothing is ever clipped). Bound, per element:
    ``|x - x_hat| <= s/2 * (1 + 2**-15)`` (the slack is the float32 rounding of
    ``x / s`` on encode and of ``q * s`` on decode). A row of zeros is exact.
``int4[:group=32,zstd=0,level=1]``
    Symmetric absmax quantisation to ``[-7, 7]`` per group of ``group``
    consecutive elements of the last dim (the last dim is zero-padded to a
    multiple of ``group``; the padding is not returned). Codes are stored as
    ``q + 8`` in nibbles, two per byte (even element in the low nibble). Steps
    are bfloat16, rounded *up* from ``groupabsmax/7`` (``s >= groupabsmax/7``
    and ``s <= groupabsmax/7 * (1 + 2**-7)``), 2 bytes per group, which keeps
    the codec at ~7.1x against float32 for ``group=32``. Bound, per element:
    ``|x - x_hat| <= s/2 * (1 + 2**-20)`` (``q * s`` is exact in float32; the
    slack is the float32 rounding of ``x / s``). ``zstd=1``
    compresses codes and steps too (usually a few percent on activations).
``subspace[:rank=d_model//16,dtype=bf16]``
    A fixed orthonormal basis ``P`` of ``rank`` columns (``projection``; the
    same for every boundary of a run, so a skipped stage changes nothing for
    the next one). Sends the coefficients ``c = x @ P`` as ``dtype`` (bf16,
    fp16 or fp32), returns ``c_hat @ P.T``. This returns the orthogonal
    projection of ``x`` onto ``span(P)``: it is exact only for a model whose
    residual stream lives in ``span(P)`` (see "Models for the subspace codec"
    below), and drops everything else silently (``SubspaceCodec.out_of_span``
    measures how much). For ``x`` in ``span(P)``, per row (last dim) in the
    Euclidean norm: ``||x - x_hat|| <= (u + 1e-5) * ||x||`` with ``u`` the
    unit roundoff of ``dtype`` (``2**-8`` bf16, ``2**-11`` fp16, ``2**-24``
    fp32); the ``1e-5`` covers float32 matmuls and ``P`` being orthonormal
    only to float32 accuracy. The default rank ``max(1, d_model // 16)`` sends
    ``2 * d_model / 16`` bytes per row with bf16: ~32x against float32.
    ``fp16`` coefficients are more precise but overflow above 65504 (encode
    then refuses) and flush gradients below ~6e-8, hence bf16 by default.

``level`` is the zstd level (-7..22, default 1; it only affects the encoder,
so it is not part of the wire format and peers may differ in it).

Every codec accepts float32, bfloat16 and float16 input (converted to float32
first, exactly) on any device: the arithmetic of encode runs on the tensor's
device and only the compact result is copied to host. ``decode(...,
device=...)`` likewise moves the compact data first and expands it there.
Lossy codecs (``int8``, ``int4``, ``subspace``) refuse non-finite input with
``CodecError`` (they have no representation for it, and a NaN activation means
training has already diverged); ``none`` and ``bf16`` carry it through.

Raw size and ratios
-------------------
The uncompressed reference is ``t.numel() * 4`` bytes (the float32 boundary
contract), whatever the input dtype: ``raw_nbytes(t)``, and ``wire_stats(t,
payload)`` gives ``(raw_nbytes, wire_nbytes, ratio)`` with the whole payload,
header and steps included, on the wire side. On ``[4, 128, 256]`` Gaussian
data: none 1.0x, bf16 ~2.9x, int8 ~4.2x, int4 7.1x, subspace (rank 16, bf16)
32x.

Gradient semantics (backward through a compressed boundary)
-----------------------------------------------------------
Forward, the sender encodes its output ``y`` (detached), the receiver decodes
``x_hat`` and runs its stage on it (``x_hat.requires_grad_()``). Backward, the
receiver encodes ``g = dL/dx_hat`` with the backward codec, and the sender
calls ``y.backward(g_hat)`` with the decoded ``g_hat``. That is a
straight-through estimator: the forward quantiser is treated as the identity,
so the sender's gradient is ``g_hat`` (what was computed at ``x_hat``, itself
compressed), not the gradient at ``y``. Both are exact only with ``none``
(bf16 costs one bf16 rounding each way). Rounding is to nearest, so the
quantisation error is deterministic (not zero-mean per element).

``subspace`` is the exception that makes the straight-through exact: when the
sender's model keeps its output in ``span(P)`` (all of its dependence on its
parameters and input goes through ``P P^T``), the gradient it would compute
from the full ``g`` is ``P P^T g``, and the decoded gradient *is* ``P P^T g``
(to coefficient rounding), because ``P P^T`` is idempotent. Forward is exact
too, so a subspace boundary costs nothing but the constraint on the model.

Models for the subspace codec
-----------------------------
The codec is exact only for a model whose residual stream stays in
``span(P)`` for ``P = projection(d_model, rank, seed)`` (``crucible.subspace``,
the run's seed): ``crucible.model`` builds such a model for
``model.subspace_rank > 0`` (its docstring says how), and the codec's ``rank``
must equal ``model.subspace_rank``.

Payload layout (version 1, all little-endian)
---------------------------------------------
::

    offset  size   field
    0       4      magic  b"CRAC"
    4       1      version (1)
    5       1      codec id: 0 none, 1 bf16, 2 int8, 3 int4, 4 subspace
    6       1      source dtype: 0 float32, 1 bfloat16, 2 float16 (informational;
                   decode always returns float32)
    7       1      ndim (1..8)
    8       4      p0  u32  codec parameter: int4 group, subspace rank, else 0
    12      4      p1  u32  codec parameter: int4 zstd flag, int8 1 = no zstd
                            (0 = zstd), subspace dtype (0 bf16, 1 fp16,
                            2 fp32), else 0
    16      8      p2  u64  codec parameter: subspace seed (mod 2**64), else 0
    24      8      body length in bytes
    32      4      CRC-32 (zlib) of bytes [0, 32) + shape + body
    36      4*ndim shape, u32 per dim
    36+4n   ...    body

Bodies: ``none`` float32 values; ``bf16`` zstd(low-byte plane ‖ high-byte
plane); ``int8`` zstd(f32 steps [rows] ‖ i8 codes [rows, d]), without the
zstd when ``zstd=0``; ``int4`` bf16
steps [rows, groups] ‖ packed codes [rows, groups*group/2], zstd'd as one
frame when ``zstd=1``; ``subspace`` coefficients [rows, rank] in ``dtype``.
``rows`` is ``numel / d_model``. A 3-d payload has a 48-byte header.

``decode`` refuses, with ``CodecError`` (a ``ValueError``) naming the reason:
a buffer shorter than its header, bad magic or version, an unknown codec id or
dtype, a length that disagrees with the header (truncated or trailing bytes),
a CRC mismatch, another codec's or other parameters' payload, a shape other
than ``expected_shape`` (never a silent reshape), an invalid zstd frame or one
whose declared size is not the expected one (checked before decompressing, so
a hostile frame cannot make it allocate), non-finite or negative steps, codes
outside the range the encoder produces, and non-finite subspace coefficients.

Codecs are immutable and safe to share between threads (zstd contexts are per
thread).
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import zstandard

from crucible.compress.specs import CODECS, COEF_DTYPES, check_int4_group, parse_spec  # noqa: F401
from crucible.wire import _nbytes, _pinned, _to_host, copies_queued
from crucible.subspace import shared_projection, projection, validate_rank as _validate_rank  # noqa: F401

__all__ = [
    "CODECS",
    "Codec",
    "CodecError",
    "PayloadHeader",
    "SubspaceCodec",
    "make_codec",
    "projection",
    "raw_nbytes",
    "read_header",
    "wire_stats",
    "WireStats",
]


class CodecError(ValueError):
    """A payload (or a tensor to encode) that this codec cannot accept."""


MAGIC = b"CRAC"
VERSION = 1
MAX_NDIM = 8
_FIXED = struct.Struct("<4sBBBBIIQQ")  # everything before the CRC
_CRC = struct.Struct("<I")
FIXED_HEADER_NBYTES = _FIXED.size + _CRC.size  # 36

_CODEC_IDS = {"none": 0, "bf16": 1, "int8": 2, "int4": 3, "subspace": 4}
_CODEC_NAMES = {v: k for k, v in _CODEC_IDS.items()}
assert tuple(_CODEC_IDS) == CODECS

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}

# subspace coefficient dtypes: name -> (code, torch dtype, bits dtype for numpy, unit roundoff)
_COEF = {
    "bf16": (0, torch.bfloat16, 2, 2.0**-8),
    "fp16": (1, torch.float16, 2, 2.0**-11),
    "fp32": (2, torch.float32, 4, 2.0**-24),
}
_COEF_BY_CODE = {v[0]: k for k, v in _COEF.items()}
assert tuple(_COEF) == COEF_DTYPES
_U64 = (1 << 64) - 1


def _check_host() -> None:
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("crucible activation codecs need a little-endian host")


# ----------------------------------------------------------------- zstd helpers

_tls = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    d = getattr(_tls, "cctx", None)
    if d is None:
        d = _tls.cctx = {}
    c = d.get(level)
    if c is None:
        c = d[level] = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                                write_checksum=False)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def _zstd_compress(buf, level: int) -> bytes:
    return _cctx(level).compress(buf)


def _zstd_decompress(body: memoryview, expected: int) -> bytes:
    """Decompress one complete frame that must hold exactly `expected` bytes."""
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise CodecError(f"invalid zstd frame: {e}") from None
    if declared != expected:
        raise CodecError(f"zstd frame declares {declared} bytes, expected {expected}")
    try:
        out = _dctx().decompress(body, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CodecError(f"invalid zstd frame: {e}") from None
    if len(out) != expected:
        raise CodecError(f"zstd frame holds {len(out)} bytes, expected {expected}")
    return out


# ------------------------------------------------------------- buffer helpers

def _np_view(buf, dtype, count: int, offset: int = 0) -> np.ndarray:
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _tensor(buf, np_dtype, torch_dtype, count: int, offset: int = 0, device=None) -> torch.Tensor:
    """A fresh writable torch tensor holding `count` items of `buf` (one memcpy),
    on `device` (default: the CPU). For a GPU, through this thread's reused
    pinned buffer (``crucible.wire``), its copy to the device queued on the
    current stream, not waited for here (``Codec.decode`` says who waits)."""
    cuda = device is not None and device.type == "cuda"
    out = _pinned((count,), torch_dtype) if cuda else torch.empty(count, dtype=torch_dtype)
    if count:
        out.numpy()[:] = _np_view(buf, np_dtype, count, offset)
    if not cuda:
        return out
    t = out.to(device, non_blocking=True)
    copies_queued(device)            # the buffer is not reused before this copy is done
    return t


def _host_parts(*ts: torch.Tensor) -> list[memoryview]:
    """The bytes of contiguous tensors of one device, in order, on host: on a
    CPU views of their memory; from a GPU one copy of them all, joined there
    first (one wait for the device, not one a tensor), through this thread's
    reused pinned buffer (see ``_host_bytes``)."""
    if ts[0].device.type == "cpu":
        return [_host_bytes(t) for t in ts]
    flat = [t.detach().reshape(-1).view(torch.uint8) for t in ts]
    whole = _host_bytes(torch.cat(flat))
    out, pos = [], 0
    for f in flat:
        out.append(whole[pos:pos + f.numel()])
        pos += f.numel()
    return out


def _finite(buf, dtype: torch.dtype, count: int, offset: int = 0) -> bool:
    """Whether `count` values of `dtype` in host memory `buf` are all finite
    (read where they are: on the host, without a wait for a GPU)."""
    if dtype == torch.bfloat16:             # numpy has no bf16: an exponent of all ones
        bits = _np_view(buf, np.uint16, count, offset)
        return not bool(((bits & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(_np_view(buf, _NP_FLOATS[dtype], count, offset)).all())


_NP_FLOATS = {torch.float32: np.float32, torch.float16: np.float16}


def _has_zero_nibble(a: np.ndarray) -> bool:
    """Whether any of the bytes of uint8 array `a` has a zero nibble: 8 bytes
    at a time, ``(v - 0x11..) & ~v & 0x88..`` (nonzero where a nibble is zero;
    a borrow only ever sets a bit above a nibble that is zero itself)."""
    n8 = a.size // 8 * 8
    v = a[:n8].view(np.uint64) if a[:n8].flags.aligned else a[:n8].copy().view(np.uint64)
    if bool(((v - np.uint64(0x1111111111111111)) & ~v & np.uint64(0x8888888888888888)).any()):
        return True
    tail = a[n8:]
    return bool(((tail & 0x0F) == 0).any() or ((tail & 0xF0) == 0).any())


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, on host, without a copy when possible.
    From a GPU, through this thread's reused pinned buffer of that shape
    (``crucible.wire``): valid until this thread's next copy of the same shape,
    which is after ``encode`` has joined them (or its caller, ``encode_parts``'s)."""
    t = t.detach()
    t = _to_host(t) if t.device.type != "cpu" else t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _bits_to_f32(bits16: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int16) -> float32 values."""
    return bits16.view(torch.bfloat16).float()


# ------------------------------------------------------------------- header

@dataclass(frozen=True)
class PayloadHeader:
    codec: str
    codec_id: int
    params: tuple[int, int, int]
    src_dtype: torch.dtype
    shape: tuple[int, ...]
    body_nbytes: int
    crc32: int
    header_nbytes: int

    def describe(self) -> str:
        return _describe(self.codec_id, self.params)


def _describe(codec_id: int, params: tuple[int, int, int]) -> str:
    name = _CODEC_NAMES.get(codec_id, f"<codec {codec_id}>")
    p0, p1, p2 = params
    if name == "int8" and params == (0, 1, 0):
        return "int8:zstd=0"
    if name == "int4":
        return f"int4:group={p0},zstd={p1}"
    if name == "subspace":
        dt = _COEF_BY_CODE.get(p1, f"<{p1}>")
        return f"subspace:rank={p0},dtype={dt},seed={p2}"
    if params != (0, 0, 0):
        return f"{name}:<params {p0},{p1},{p2}>"
    return name


def _assemble(codec_id: int, src_dtype_code: int, params: tuple[int, int, int],
              shape: tuple[int, ...], body) -> list:
    """[header, *body]: `body` is a bytes-like object or a list of them, not
    joined here (the caller joins them once, with whatever goes around them)."""
    parts = body if isinstance(body, (list, tuple)) else [body]
    body_len = _nbytes(parts)
    fixed = _FIXED.pack(MAGIC, VERSION, codec_id, src_dtype_code, len(shape),
                        params[0], params[1], params[2], body_len)
    dims = struct.pack(f"<{len(shape)}I", *shape)
    crc = zlib.crc32(dims, zlib.crc32(fixed))
    for p in parts:
        crc = zlib.crc32(p, crc)
    return [fixed + _CRC.pack(crc) + dims, *parts]


def read_header(payload) -> PayloadHeader:
    """Parse and structurally validate a payload's header (not its CRC or body)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    n = memoryview(payload).nbytes
    if n < FIXED_HEADER_NBYTES:
        raise CodecError(f"truncated payload: {n} bytes, a header needs at least {FIXED_HEADER_NBYTES}")
    magic, version, codec_id, dtype_code, ndim, p0, p1, p2, body_len = _FIXED.unpack_from(payload, 0)
    if magic != MAGIC:
        raise CodecError(f"not an activation payload (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"payload format version {version}, this build reads version {VERSION}")
    if codec_id not in _CODEC_NAMES:
        raise CodecError(f"unknown codec id {codec_id} in payload")
    if dtype_code not in _DTYPES:
        raise CodecError(f"unknown source dtype code {dtype_code} in payload")
    if not 1 <= ndim <= MAX_NDIM:
        raise CodecError(f"payload has ndim {ndim}, must be 1..{MAX_NDIM}")
    hdr_len = FIXED_HEADER_NBYTES + 4 * ndim
    if n < hdr_len:
        raise CodecError(f"truncated payload: {n} bytes, its header needs {hdr_len}")
    (crc,) = _CRC.unpack_from(payload, _FIXED.size)
    shape = struct.unpack_from(f"<{ndim}I", payload, FIXED_HEADER_NBYTES)
    total = hdr_len + body_len
    if n < total:
        raise CodecError(f"truncated payload: {n} bytes, header says {total}")
    if n > total:
        raise CodecError(f"payload has {n - total} trailing bytes after its {total} declared bytes")
    return PayloadHeader(codec=_CODEC_NAMES[codec_id], codec_id=codec_id, params=(p0, p1, p2),
                         src_dtype=_DTYPES[dtype_code], shape=tuple(shape), body_nbytes=body_len,
                         crc32=crc, header_nbytes=hdr_len)


def _payload_crc(mv: memoryview) -> int:
    crc = zlib.crc32(mv[:_FIXED.size])
    return zlib.crc32(mv[FIXED_HEADER_NBYTES:], crc)


# ------------------------------------------------------------- size helpers

def raw_nbytes(t_or_shape) -> int:
    """The uncompressed float32 size a boundary tensor stands for: numel * 4."""
    if isinstance(t_or_shape, torch.Tensor):
        return t_or_shape.numel() * 4
    return math.prod(int(d) for d in t_or_shape) * 4


@dataclass(frozen=True)
class WireStats:
    raw_nbytes: int
    wire_nbytes: int

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.wire_nbytes if self.wire_nbytes else float("inf")


def wire_stats(t_or_shape_or_raw, payload) -> WireStats:
    """Raw float32 bytes vs the payload's bytes (header and steps included)."""
    raw = t_or_shape_or_raw if isinstance(t_or_shape_or_raw, int) else raw_nbytes(t_or_shape_or_raw)
    return WireStats(raw_nbytes=raw, wire_nbytes=memoryview(payload).nbytes)


# ---------------------------------------------------------------------- codecs

def _div_exact(a: torch.Tensor, b: int) -> torch.Tensor:
    """``a / b`` correctly rounded (IEEE division) on every device.

    Not ``a / b`` with a Python number: PyTorch's CUDA kernel then computes
    ``a * fp32(1/b)``, which can be one ulp off the quotient (the same tensor
    encoded on a GPU and on a CPU gave different int4 steps for bf16 input).
    A divisor tensor on ``a``'s own device gets a true division there; on the
    CPU the result is what ``a / b`` always gave."""
    return a / a.new_full((), b)


def _ceil_step_f32(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """Smallest-ish float32 s with qmax * s >= absmax (absmax >= 0, finite)."""
    s = _div_exact(absmax, qmax)     # not absmax / qmax: see _div_exact (CUDA)
    short = s.double() * qmax < absmax.double()       # exact in float64
    return torch.where(short, torch.nextafter(s, torch.full_like(s, math.inf)), s)


def _ceil_step_bf16(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """bf16 bit patterns (int16) of s >= absmax / qmax, rounded up to bf16."""
    s = _div_exact(absmax, qmax)     # not absmax / qmax: see _div_exact (CUDA)
    bits = s.view(torch.int32)
    hi = (bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)
    short = (hi << 16).view(torch.float32).double() * qmax < absmax.double()
    hi = hi + short.to(torch.int32)        # one more bf16 ulp (also lifts 0 to 2**-133)
    return hi.to(torch.int16)


class Codec:
    """Base class: see the module docstring. Build codecs with ``make_codec``."""

    kind: str = ""          # codec family: none | bf16 | int8 | int4 | subspace
    lossless: bool = False

    def __init__(self, d_model: int):
        _check_host()
        if not (isinstance(d_model, int) and d_model >= 1):
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        self.d_model = d_model

    # -- identity ------------------------------------------------------------
    @property
    def codec_id(self) -> int:
        return _CODEC_IDS[self.kind]

    @property
    def params(self) -> tuple[int, int, int]:
        """The wire parameters (header fields p0, p1, p2) decode insists on."""
        return (0, 0, 0)

    @property
    def name(self) -> str:
        """Canonical spec of what is on the wire, e.g. ``int4:group=32,zstd=0``.

        Two codecs with equal ``name`` (and d_model) read each other's payloads.
        Encoder-only settings (zstd ``level``) are not part of it; see ``spec``.
        """
        return _describe(self.codec_id, self.params)

    @property
    def spec(self) -> str:
        """``name`` plus encoder-only settings; ``make_codec(c.spec, ...)`` rebuilds c."""
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec} d_model={self.d_model}>"

    # -- encode --------------------------------------------------------------
    def encode(self, t: torch.Tensor) -> bytes:
        """Compress `t` [..., d_model] into a self-describing payload."""
        return b"".join(self.encode_parts(t))

    def encode_parts(self, t: torch.Tensor) -> list:
        """``encode``'s payload as bytes-like parts to join, in order: the
        caller copies them once, where they go (``crucible.wire.encode_frame``:
        into the frame). Parts may view this thread's reused host buffers: join
        them before this thread encodes again."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"encode needs a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_CODES:
            raise CodecError(f"cannot encode dtype {t.dtype}; float32, bfloat16 or float16 only")
        shape = tuple(t.shape)
        if not 1 <= len(shape) <= MAX_NDIM:
            raise CodecError(f"cannot encode a {len(shape)}-d tensor; 1..{MAX_NDIM} dims")
        if shape[-1] != self.d_model:
            raise CodecError(f"last dim is {shape[-1]}, this codec is for d_model={self.d_model}")
        if any(s >= 1 << 32 for s in shape):
            raise CodecError(f"dimension too large for the wire format: {list(shape)}")
        x = t.detach()
        if x.dtype != torch.float32:
            x = x.float()
        x = x.reshape(-1, self.d_model)
        if not x.is_contiguous():
            x = x.contiguous()
        body = self._encode_body(x)
        return _assemble(self.codec_id, _DTYPE_CODES[t.dtype], self.params, shape, body)

    def _encode_body(self, x: torch.Tensor):
        raise NotImplementedError

    # -- decode --------------------------------------------------------------
    def decode(self, payload, expected_shape, *, device=None, wait: bool = True) -> torch.Tensor:
        """Payload -> float32 contiguous tensor of exactly `expected_shape`.

        Raises ``CodecError`` for anything but a well-formed payload of this
        codec, with these parameters, of this shape (checked on the host,
        before anything is copied). `device` (default CPU) is where the result
        is built; compact data is moved there first. On a GPU the copy and
        the kernels are queued on the current stream; with `wait` (the
        default) the decode waits for them, else not (this thread's pinned
        buffers then wait for the copy before their next use: ``crucible.wire``).
        """
        hdr = read_header(payload)
        mv = memoryview(payload).cast("B") if not isinstance(payload, bytes) else memoryview(payload)
        crc = _payload_crc(mv)
        if crc != hdr.crc32:
            raise CodecError(f"payload CRC mismatch (computed {crc:#010x}, header {hdr.crc32:#010x}): corrupted")
        if hdr.codec_id != self.codec_id or hdr.params != self.params:
            raise CodecError(f"payload was encoded with {hdr.describe()!r}, this codec is {self.name!r}")
        try:
            expected = tuple(int(s) for s in expected_shape)
        except TypeError:
            raise CodecError(f"expected_shape must be a sequence of ints, got {expected_shape!r}") from None
        if hdr.shape != expected:
            raise CodecError(f"payload shape {list(hdr.shape)}, expected {list(expected)}")
        if expected[-1] != self.d_model:
            raise CodecError(f"expected shape {list(expected)} does not end in d_model={self.d_model}")
        rows = math.prod(expected[:-1])
        body = mv[hdr.header_nbytes:]
        dev = torch.device(device) if device is not None else None
        try:
            out = self._decode_body(body, rows, dev)
        finally:
            if wait and dev is not None and dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()   # the one wait: its copies and kernels are done
        return out.view(expected)

    def _decode_body(self, body: memoryview, rows: int, device) -> torch.Tensor:
        raise NotImplementedError

    def _need(self, body: memoryview, n: int, what: str) -> None:
        if body.nbytes != n:
            raise CodecError(f"{self.kind} body is {body.nbytes} bytes, {what} needs {n}")


class NoneCodec(Codec):
    """Raw float32: lossless, bitwise."""

    kind = "none"
    lossless = True

    def _encode_body(self, x):
        return _host_bytes(x)

    def _decode_body(self, body, rows, device):
        n = rows * self.d_model
        self._need(body, 4 * n, f"{n} float32 values")
        return _tensor(body, np.float32, torch.float32, n, device=device).view(rows, self.d_model)


class _ZstdCodec(Codec):
    def __init__(self, d_model: int, level: int = 1):
        super().__init__(d_model)
        self.level = level

    @property
    def spec(self) -> str:
        sep = "," if ":" in self.name else ":"
        return f"{self.name}{sep}level={self.level}"


class Bf16Codec(_ZstdCodec):
    """bf16 (round to nearest even) + byte planes + zstd: |err| <= 2**-8 |x|."""

    kind = "bf16"

    def _encode_body(self, x):
        u = x.to(torch.bfloat16).view(torch.int16).view(-1)
        # low-byte plane then high-byte plane (shifts: fast on any device,
        # unlike a strided uint8 transpose)
        planes = torch.cat([(u & 0xFF).to(torch.uint8), ((u >> 8) & 0xFF).to(torch.uint8)])
        return _zstd_compress(_host_bytes(planes), self.level)

    def _decode_body(self, body, rows, device):
        n = rows * self.d_model
        raw = _zstd_decompress(body, 2 * n)
        planes = _tensor(raw, np.uint8, torch.uint8, 2 * n, device=device).view(2, n)
        # the planes joined by shifts where they are (a strided interleave of
        # the bytes on the CPU made the decode twice as slow)
        bits = planes[1].to(torch.int16).bitwise_left_shift_(8).bitwise_or_(planes[0].to(torch.int16))
        return bits.view(torch.bfloat16).float().view(rows, self.d_model)


class Int8Codec(_ZstdCodec):
    """Per-row absmax int8 (+ zstd unless zstd=0): |err| <= s/2 (1 + 2**-15), s = rowabsmax/127 rounded up."""

    kind = "int8"

    def __init__(self, d_model: int, zstd: bool = True, level: int = 1):
        super().__init__(d_model, level)
        self.zstd = bool(zstd)

    @property
    def params(self):
        # p1 = 1: no zstd. The default (zstd) keeps the header of the codec
        # before it had the option: (0, 0, 0), name "int8".
        return (0, 0 if self.zstd else 1, 0)

    def _encode_body(self, x):
        absmax = x.abs().amax(dim=1) if x.numel() else x.new_zeros(x.shape[0])
        step = _ceil_step_f32(absmax, 127)      # non-finite exactly where absmax is
        div = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.round(x / div[:, None]).clamp_(-127, 127).to(torch.int8)
        # steps then codes (from a GPU: one copy to host, the only wait), the
        # steps checked there
        parts = _host_parts(step, q)
        if not _finite(parts[0], torch.float32, x.shape[0]):
            raise CodecError("int8 cannot encode non-finite values (NaN/inf in the tensor)")
        return _zstd_compress(b"".join(parts), self.level) if self.zstd else parts

    def _decode_body(self, body, rows, device):
        d = self.d_model
        if self.zstd:
            raw = _zstd_decompress(body, rows * 4 + rows * d)
        else:
            self._need(body, rows * 4 + rows * d, f"{rows} float32 steps + {rows * d} int8 codes")
            raw = body
        # checked on the host before the copy (from a GPU nothing is read
        # back); min() == -128, not (q == -128).any(): one pass
        steps = _np_view(raw, np.float32, rows)
        if not (_finite(raw, torch.float32, rows) and bool((steps >= 0).all())):
            raise CodecError("int8 payload has non-finite or negative steps")
        if rows * d and int(_np_view(raw, np.int8, rows * d, offset=rows * 4).min()) == -128:
            raise CodecError("int8 payload has code -128 (the encoder uses -127..127)")
        # steps and codes in one copy to the device
        t = _tensor(raw, np.uint8, torch.uint8, rows * 4 + rows * d, device=device)
        step, q = t[:rows * 4].view(torch.float32), t[rows * 4:].view(torch.int8)
        return q.view(rows, d).float().mul_(step[:, None])


class Int4Codec(_ZstdCodec):
    """Per-group absmax int4, nibble-packed, bf16 steps: |err| <= s/2 (1 + 2**-20), s >= groupabsmax/7."""

    kind = "int4"

    def __init__(self, d_model: int, group: int = 32, zstd: bool = False, level: int = 1):
        super().__init__(d_model, level)
        check_int4_group(group)
        self.group = group
        self.zstd = bool(zstd)
        self.groups = -(-d_model // group)
        self.padded = self.groups * group

    @property
    def params(self):
        return (self.group, int(self.zstd), 0)

    @property
    def spec(self):
        return f"{self.name},level={self.level}"

    def _encode_body(self, x):
        rows, d = x.shape
        if self.padded != d:
            x = F.pad(x, (0, self.padded - d))
        xg = x.view(rows, self.groups, self.group)
        absmax = xg.abs().amax(dim=2) if x.numel() else x.new_zeros(rows, self.groups)
        bits = _ceil_step_bf16(absmax, 7)       # non-finite exactly where absmax is
        step = _bits_to_f32(bits)
        div = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.round(xg / div[..., None]).clamp_(-7, 7).add_(8).to(torch.uint8).view(-1, 2)
        packed = q[:, 0] | (q[:, 1] << 4)
        parts = _host_parts(bits, packed)       # checked on the host, as int8's
        if not _finite(parts[0], torch.bfloat16, rows * self.groups):
            raise CodecError("int4 cannot encode non-finite values (NaN/inf in the tensor)")
        if self.zstd:
            return _zstd_compress(b"".join(parts), self.level)
        return parts

    def _decode_body(self, body, rows, device):
        ns, nb = rows * self.groups, rows * self.padded // 2
        if self.zstd:
            body = memoryview(_zstd_decompress(body, 2 * ns + nb))
        else:
            self._need(body, 2 * ns + nb, f"{ns} bf16 steps + {nb} packed bytes")
        # checked on the host before the copy, as int8's (a code -8 is a zero nibble)
        if not (_finite(body, torch.bfloat16, ns) and bool((_np_view(body, np.int16, ns) >= 0).all())):
            raise CodecError("int4 payload has non-finite or negative steps")
        if nb and _has_zero_nibble(_np_view(body, np.uint8, nb, offset=2 * ns)):
            raise CodecError("int4 payload has code -8 (the encoder uses -7..7)")
        t = _tensor(body, np.uint8, torch.uint8, 2 * ns + nb, device=device)   # one copy to the device
        step = _bits_to_f32(t[:2 * ns].view(torch.int16))
        packed = t[2 * ns:]
        lo, hi = packed & 0xF, packed >> 4
        q = torch.stack([lo, hi], dim=1).view(rows, self.groups, self.group)
        out = q.float().sub_(8).mul_(step.view(rows, self.groups, 1)).view(rows, self.padded)
        if self.padded != self.d_model:
            out = out[:, :self.d_model].contiguous()
        return out


class SubspaceCodec(Codec):
    """Coefficients in a fixed orthonormal basis P (see ``projection``)."""

    kind = "subspace"

    def __init__(self, d_model: int, rank: int | None = None, dtype: str = "bf16", seed: int = 0):
        super().__init__(d_model)
        rank = max(1, d_model // 16) if rank is None else rank
        _validate_rank(d_model, rank)
        if dtype not in _COEF:
            raise ValueError(f"subspace dtype must be one of {', '.join(_COEF)}, got {dtype!r}")
        if not (isinstance(seed, int) and -(1 << 63) <= seed <= _U64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
        self.rank, self.dtype, self.seed = rank, dtype, seed
        self._code, self._tdtype, self._width, self.unit_roundoff = _COEF[dtype]
        self._P = {}   # device -> P there

    @property
    def params(self):
        return (self.rank, self._code, self.seed & _U64)

    @property
    def spec(self):
        return f"subspace:rank={self.rank},dtype={self.dtype}"

    def basis(self, device=None) -> torch.Tensor:
        """P on `device` (cached; do not modify)."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        p = self._P.get(dev)
        if p is None:
            p = shared_projection(self.d_model, self.rank, self.seed).to(dev)
            if dev.type == "cuda":
                # made on this thread's stream, read from others' (without record_stream: it is never freed)
                torch.cuda.current_stream(dev).synchronize()
            p = self._P.setdefault(dev, p)
        return p

    def out_of_span(self, t: torch.Tensor) -> float:
        """||t - P P^T t|| / ||t|| (Frobenius): what this codec would drop."""
        x = t.detach().float().reshape(-1, self.d_model)
        p = self.basis(x.device)
        den = float(torch.linalg.vector_norm(x))
        if den == 0.0:
            return 0.0
        return float(torch.linalg.vector_norm(x - (x @ p) @ p.T)) / den

    def _encode_body(self, x):
        c = (x @ self.basis(x.device)).to(self._tdtype)
        buf = _host_bytes(c)                    # checked on the host (from a GPU: one wait, the copy's)
        if not _finite(buf, self._tdtype, c.numel()):
            raise CodecError(f"subspace coefficients are not finite in {self.dtype} "
                             "(NaN/inf input, or overflow: use dtype=bf16)")
        return buf

    def _decode_body(self, body, rows, device):
        n = rows * self.rank
        self._need(body, n * self._width, f"{n} {self.dtype} coefficients")
        if not _finite(body, self._tdtype, n):   # on the host, before the copy
            raise CodecError("subspace payload has non-finite coefficients")
        if self._width == 2:
            c = _tensor(body, np.int16, torch.int16, n, device=device).view(self._tdtype)
        else:
            c = _tensor(body, np.float32, torch.float32, n, device=device)
        return c.float().view(rows, self.rank) @ self.basis(c.device).T


# ------------------------------------------------------------------ make_codec

def make_codec(spec: str, d_model: int, seed: int = 0) -> Codec:
    """Build the codec named by `spec` for boundaries of width `d_model`.

    `seed` is the run's seed; only ``subspace`` uses it (for ``projection``).
    Raises ValueError naming an unknown codec or parameter and the valid ones.
    """
    name, params = parse_spec(spec)
    if name == "none":
        return NoneCodec(d_model)
    if name == "bf16":
        return Bf16Codec(d_model, **params)
    if name == "int8":
        return Int8Codec(d_model, **params)
    if name == "int4":
        return Int4Codec(d_model, **params)
    return SubspaceCodec(d_model, seed=seed, **params)
