"""SparseLoCo outer-sync math on flat fp32 tensors (one flat vector per stage).

See docs/architecture.md, "Outer rounds"::

    Δ = θ_global − θ_local;  e ← β·e + Δ;  Δ̂ = Q(TopK_chunk(e));  e ← e − Δ̂

This module holds the pure math: the wire codec (:func:`encode` /
:func:`decode`), error feedback (:func:`ef_compress`, :func:`ef_restore`), the
aggregate of a round (:func:`aggregate`), the outer update
(:func:`outer_sgd`) and the dense DiLoCo baseline (:class:`NesterovOuter`).

Codec
=====
The vector of ``n`` elements is cut into ``C = ceil(n / chunk)`` chunks (the
last one may be shorter). In every chunk the ``k_c = min(k, len_c)`` entries
of largest magnitude are *selected*; ties are broken by the lower index
(exactly: the set is the first ``k_c`` entries of the chunk sorted by
``(-|x|, index)``). Each selected entry gets a quantised value ``q``
(see below) and is then *sent* or *left unsent* (``q`` treated as 0):

* ``value_bits=32``: ``q = x`` (raw fp32); every selected entry is sent,
  zeros (and -0.0) included, so ``k == chunk`` is lossless bit for bit.
* ``value_bits=8``: per chunk ``step = fp32(absmax / 127)`` (fp32 division),
  ``code = round_half_even(|x| / step)`` clamped to 0..127, signed;
  ``q = fp32(code) * step`` (one fp32 multiply).
* ``value_bits=2`` (default): 1 sign bit + 1 level bit per entry, two fp32
  magnitudes per chunk, ``lo`` and ``hi``. The non-zero selected magnitudes,
  in decreasing order, are split in two halves (the larger half gets the
  extra one when their count is odd); ``hi`` = fp32(mean of the upper half),
  ``lo`` = fp32(mean of the lower half) (``lo = hi`` when the lower half is
  empty); if that ``hi`` is below half the chunk's largest selected
  magnitude (an outlier), ``hi`` is that largest magnitude instead, so the
  largest entry of every chunk is always sent (no starvation of outliers).
  Each entry takes the level nearer to it in ratio
  (``hi`` iff ``|x|² >= lo·hi``), and ``q = ±level``. Code =
  ``(negative << 1) | is_hi``.

Exactness rule (Sterbenz). A selected entry is sent only if its ``q`` has
the sign of ``x`` and ``|x|/2 <= |q| <= 2|x|`` (checked exactly, in float64).
By the Sterbenz lemma ``x − q`` is then exact in fp32, hence
``(x − q) + q == x`` exactly; this is what makes error feedback lossless by
construction. For 2-bit, when the preferred level violates the rule the other
level is tried; when both violate it (a middle entry more than a factor 2
from both levels), the entry is left unsent: ``q = 0`` there and the whole value stays in
the error buffer for a later round. For 8-bit the rule can only fail for
code 0 (``|x| < step/2``), but it is checked all the same; for 2-bit and 8-bit, entries with ``q == 0``
(including x == 0) are never sent. The number of sent entries per chunk is
therefore ``<= k_c`` and is carried on the wire.

Wire format (all little endian)::

    header (24 bytes, not compressed):
        magic b"SLC0" | u8 version=1 | u8 value_bits | u16 reserved=0 |
        u64 n | u32 chunk | u32 k
    zstd frame (content size and checksum written) of the body:
        u16 count[C]                      sent entries per chunk
        fp32 scales[C * s]                s = 2 (lo, hi) | 1 (step) | 0
        idx: ceil(T/2)*3 bytes            12-bit indices within the chunk,
                                          two per 3 bytes (a | b << 12),
                                          ascending within each chunk
        codes: ceil(T/4) | T | 4T bytes   2-bit (4 per byte, LSB first) |
                                          int8 | fp32
    (T = sum(count); padding bits are zero; scales of chunks that send
     nothing are 0.)

The decoder is strict: anything malformed raises :class:`CodecError` (a
``ValueError``) — bad magic/version/parameters, ``n != expected_numel``,
truncation, a zstd frame whose declared size is missing or larger than the
header allows (checked *before* decompressing), zstd failures, bytes after
the frame, counts above ``k_c``, indices out of range or not strictly
increasing, non-zero padding bits, negative or non-finite scales, int8 code
-128, and non-finite decoded values.

Bytes at the defaults (chunk 4096, k 64, 2-bit): 2 (count) + 8 (scales) +
96 (indices) + 16 (codes) = 122 bytes per full chunk before zstd, i.e. about
0.030 bytes per element (~134x smaller than dense fp32), plus the 24-byte
header and ~16 bytes of zstd framing; zstd wins back a little (measured on
Gaussian data: 0.0293 bytes/element, ~136x). Random 12-bit indices hardly
compress.

Error feedback
==============
:func:`ef_compress` computes ``a = e * fp32(beta) + delta`` as two fp32 ops
(``e.mul(beta).add_(delta)``: one rounding for the product, one for the sum;
never a fused multiply-add), encodes ``a``, and writes
``e ← a − a_hat`` in place. By the rule above, ``e_new + a_hat == a``
exactly, element by element. The only caveat is the sign of zero: where
``a`` is -0.0 and nothing is sent, ``e_new + a_hat`` is +0.0 (``==`` holds,
the bit pattern differs). :func:`ef_restore` (``e += a_hat``) gives a
replica left out of a round its ``a`` back exactly.

Aggregation
===========
``clip="median"``: the squared L2 norm of every contribution is computed
*exactly* (integer arithmetic on the fp32 bit patterns), so every replica,
whatever its hardware or thread count, picks the same median and the same
scale factors. The median is the lower middle element of the norms sorted by
(norm, replica position). A contribution whose norm is ``<=`` the median is
used unchanged; one above it is multiplied (one fp32 multiply) by
``f = fp32(float64(floor(2**64 * sqrt(S_med / S_i)) / 2**64))``.
Then ``acc = c_0.clone(); acc += c_1; ...; acc += c_{R-1}`` (sequential
fp32 adds in the given order, starting from the first element, not from
zeros) and ``acc /= R`` (one fp32 division).

:func:`outer_sgd`: ``theta -= agg * fp32(lr)`` (product rounded to fp32 first,
then an fp32 subtraction), i.e. ``theta.sub_(agg.mul(lr))``.
"""

from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np
import torch
import zstandard

__all__ = [
    "CodecError",
    "MAGIC",
    "VERSION",
    "HEADER_SIZE",
    "MAX_CHUNK",
    "encode",
    "decode",
    "dense_nbytes",
    "ef_compress",
    "ef_restore",
    "aggregate",
    "outer_sgd",
    "NesterovOuter",
]

MAGIC = b"SLC0"
VERSION = 1
MAX_CHUNK = 4096  # indices are 12-bit
_HEADER = struct.Struct("<4sBBHQII")
HEADER_SIZE = _HEADER.size  # 24
_VALUE_BITS = (2, 8, 32)
_SCALES_PER_CHUNK = {2: 2, 8: 1, 32: 0}
_ZSTD_LEVEL = 3


class CodecError(ValueError):
    """A SparseLoCo payload is malformed."""


def dense_nbytes(n: int) -> int:
    """Bytes of the same vector sent dense in fp32 (for reporting ratios)."""
    return 4 * int(n)


# --------------------------------------------------------------------------
# helpers shared by encoder and decoder


def _check_params(chunk: int, k: int, value_bits: int, exc=ValueError) -> None:
    if not (1 <= chunk <= MAX_CHUNK):
        raise exc(f"chunk must be in 1..{MAX_CHUNK} (12-bit indices), got {chunk}")
    if not (1 <= k <= chunk):
        raise exc(f"k must be in 1..chunk={chunk}, got {k}")
    if value_bits not in _VALUE_BITS:
        raise exc(f"value_bits must be one of {_VALUE_BITS}, got {value_bits}")


def _code_nbytes(value_bits: int, t: int) -> int:
    if value_bits == 2:
        return (t + 3) // 4
    if value_bits == 8:
        return t
    return 4 * t


def _idx_nbytes(t: int) -> int:
    return ((t + 1) // 2) * 3


def _chunk_lens(n: int, chunk: int) -> np.ndarray:
    c = -(-n // chunk)
    lens = np.full(c, chunk, dtype=np.int64)
    if c:
        lens[-1] = n - (c - 1) * chunk
    return lens


def _max_body_nbytes(n: int, chunk: int, k: int, value_bits: int) -> int:
    c = -(-n // chunk)
    full = n // chunk
    t_max = full * k + (min(k, n - full * chunk) if c > full else 0)
    return (2 * c + 4 * c * _SCALES_PER_CHUNK[value_bits]
            + _idx_nbytes(t_max) + _code_nbytes(value_bits, t_max))


def _pack12(idx: np.ndarray) -> bytes:
    t = idx.shape[0]
    a = np.zeros(((t + 1) // 2) * 2, dtype=np.uint32)
    a[:t] = idx
    a = a.reshape(-1, 2)
    w = a[:, 0] | (a[:, 1] << 12)  # 24 bits
    out = np.empty((a.shape[0], 3), dtype=np.uint8)
    out[:, 0] = w & 0xFF
    out[:, 1] = (w >> 8) & 0xFF
    out[:, 2] = w >> 16
    return out.tobytes()


def _unpack12(buf: bytes, t: int) -> np.ndarray:
    b = np.frombuffer(buf, dtype=np.uint8).reshape(-1, 3).astype(np.uint32)
    w = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    out = np.empty((b.shape[0], 2), dtype=np.int64)
    out[:, 0] = w & 0xFFF
    out[:, 1] = w >> 12
    out = out.reshape(-1)
    if out.shape[0] > t and out[t] != 0:
        raise CodecError("non-zero padding in the packed index section")
    return out[:t]


def _pack2(codes: np.ndarray) -> bytes:
    t = codes.shape[0]
    a = np.zeros(((t + 3) // 4) * 4, dtype=np.uint8)
    a[:t] = codes
    a = a.reshape(-1, 4)
    return (a[:, 0] | (a[:, 1] << 2) | (a[:, 2] << 4) | (a[:, 3] << 6)).astype(np.uint8).tobytes()


def _unpack2(buf: bytes, t: int) -> np.ndarray:
    b = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty((b.shape[0], 4), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (b >> (2 * j)) & 3
    out = out.reshape(-1)
    if np.any(out[t:]):
        raise CodecError("non-zero padding in the 2-bit code section")
    return out[:t]


def _values(value_bits: int, codes, scales: torch.Tensor, chunk_of: torch.Tensor) -> torch.Tensor:
    """fp32 values of sent entries from their codes (used by encode AND decode).

    codes: 2-bit -> uint8 tensor (0..3); 8-bit -> int8 tensor; 32-bit -> fp32.
    scales: fp32 tensor [C, s]; chunk_of: int64 chunk of each entry.
    """
    if value_bits == 32:
        return codes
    if value_bits == 8:
        return codes.to(torch.float32) * scales[chunk_of, 0]
    level = (codes & 1).to(torch.int64)
    mag = scales[chunk_of, level]
    return torch.where((codes & 2) != 0, -mag, mag)


def _assemble(n: int, chunk: int, pos: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32)
    if pos.numel():
        out[pos] = vals
    return out


# --------------------------------------------------------------------------
# encoder


def _select(x: torch.Tensor, n: int, chunk: int, k: int):
    """Per-chunk top-k by magnitude, ties -> lower index.

    Returns (idx [C, kk] int64 local indices, ascending in each row,
    valid [C, kk] bool) where kk = min(k, chunk)."""
    c = -(-n // chunk)
    mag = torch.empty(c * chunk, dtype=torch.float32)
    torch.abs(x, out=mag[:n])
    if not math.isfinite(float(mag[:n].max())):  # max propagates NaN
        raise ValueError("encode: input has non-finite values")
    mag[n:] = -1.0  # padding of the last chunk: below every real magnitude
    mag = mag.view(c, chunk)
    if k == chunk:
        idx = torch.arange(chunk, dtype=torch.int64).expand(c, chunk).clone()
    else:
        # k+1 so we can see whether the k-th and (k+1)-th tie: only then does
        # the tie-break decide which entries are in the set.
        v, idx = torch.topk(mag, k + 1, dim=1, largest=True, sorted=True)
        tie = (v[:, k - 1] == v[:, k]).nonzero().flatten()
        idx = idx[:, :k]
        if tie.numel():
            rows = mag[tie]
            keys = rows.view(torch.int32).to(torch.int64)  # finite, >= 0 or pad (< 0)
            keys.mul_(MAX_CHUNK).add_(MAX_CHUNK - 1 - torch.arange(chunk, dtype=torch.int64))
            _, tidx = torch.topk(keys, k, dim=1, largest=True, sorted=True)
            idx[tie] = tidx
        idx, _ = torch.sort(idx, dim=1)
    lens = torch.from_numpy(_chunk_lens(n, chunk))
    valid = idx < lens[:, None]
    return idx, valid


def _quantize8(xv: torch.Tensor, valid: torch.Tensor, scales: torch.Tensor, c: int, kk: int):
    """8-bit: symmetric absmax per chunk. Returns (sent, codes)."""
    m = xv.abs().to(torch.float64)
    nz = valid & (m > 0)
    neg = xv < 0
    absmax = torch.where(nz, xv.abs(), torch.zeros((), dtype=torch.float32)).amax(dim=1)
    step = absmax / 127.0
    scales[:, 0] = step
    step64 = step.to(torch.float64)[:, None]
    safe = torch.where(step64 > 0, step64, torch.ones((), dtype=torch.float64))
    mag_code = torch.round(m / safe).clamp_(0, 127)
    mag_code = torch.where(step64 > 0, mag_code, torch.zeros((), dtype=torch.float64))
    codes = torch.where(neg, -mag_code, mag_code).to(torch.int8)
    chunk_of = torch.arange(c, dtype=torch.int64)[:, None].expand(c, kk)
    qa = _values(8, codes, scales, chunk_of).abs().to(torch.float64)
    return nz & (qa > 0) & (2 * qa >= m) & (qa <= 2 * m), codes


def _quantize2(xv: torch.Tensor, valid: torch.Tensor, scales: torch.Tensor):
    """2-bit: sign and one of two magnitudes per chunk (the means of its larger
    and smaller half). Returns (sent, codes)."""
    m = xv.abs().to(torch.float64)
    nz = valid & (m > 0)
    neg = xv < 0
    # rank of each entry by decreasing magnitude within its chunk
    # (nz entries come first: zeros and invalid ones sort last).
    order_key = torch.where(nz, m, torch.full((), -1.0, dtype=torch.float64))
    rank = torch.argsort(torch.argsort(order_key, dim=1, descending=True, stable=True), dim=1)
    cnt = nz.sum(dim=1, keepdim=True)
    h = (cnt + 1) // 2
    hi_mask = rank < h
    lo_mask = nz & ~hi_mask
    zero64 = torch.zeros((), dtype=torch.float64)
    m_hi = torch.where(hi_mask, m, zero64).sum(dim=1, keepdim=True) / h.clamp(min=1)
    m_lo = torch.where(lo_mask, m, zero64).sum(dim=1, keepdim=True) / (cnt - h).clamp(min=1)
    m_lo = torch.where(cnt - h > 0, m_lo, m_hi)
    s_hi = m_hi.to(torch.float32)
    # progress guarantee: the chunk's largest entry must be
    # sendable; if hi < max/2 (an outlier), hi = max exactly.
    mx = torch.where(nz, m, zero64).amax(dim=1, keepdim=True)
    s_hi = torch.where(2 * s_hi.to(torch.float64) < mx, mx.to(torch.float32), s_hi)
    s_lo = m_lo.to(torch.float32)
    scales[:, 0:1] = s_lo
    scales[:, 1:2] = s_hi
    h64 = s_hi.to(torch.float64)
    l64 = s_lo.to(torch.float64)
    ok_hi = (2 * h64 >= m) & (h64 <= 2 * m) & (h64 > 0)
    ok_lo = (2 * l64 >= m) & (l64 <= 2 * m) & (l64 > 0)
    prefer_hi = m * m >= l64 * h64
    is_hi = torch.where(prefer_hi, ok_hi | ~ok_lo, ~ok_lo)
    return nz & (ok_hi | ok_lo), (neg.to(torch.uint8) << 1) | is_hi.to(torch.uint8)


def _sparsify(xc: torch.Tensor, n: int, chunk: int, k: int, value_bits: int):
    """Top-k per chunk, quantized: (counts, scales, loc, codes, chunk_of, pos)."""
    c = -(-n // chunk)
    s = _SCALES_PER_CHUNK[value_bits]
    if not n:
        empty = torch.zeros(0, dtype=torch.int64)
        codes = torch.zeros(0, dtype={2: torch.uint8, 8: torch.int8, 32: torch.float32}[value_bits])
        return empty, torch.zeros((0, s), dtype=torch.float32), empty, codes, empty, empty
    idx, valid = _select(xc, n, chunk, k)
    kk = idx.shape[1]
    base = torch.arange(c, dtype=torch.int64)[:, None] * chunk
    gpos = torch.where(valid, base + idx, torch.zeros((), dtype=torch.int64))
    xv = xc[gpos]  # [C, kk] fp32 (junk where not valid)
    scales = torch.zeros((c, s), dtype=torch.float32)
    if value_bits == 32:
        sent, codes_all = valid, xv
    elif value_bits == 8:
        sent, codes_all = _quantize8(xv, valid, scales, c, kk)
    else:
        sent, codes_all = _quantize2(xv, valid, scales)
    counts = sent.sum(dim=1)
    if s:
        scales[counts == 0] = 0.0
    loc = idx[sent]  # row-major: chunk order, ascending within a chunk
    codes = codes_all[sent]
    chunk_of = torch.repeat_interleave(torch.arange(c, dtype=torch.int64), counts)
    return counts, scales, loc, codes, chunk_of, chunk_of * chunk + loc


def encode(x: torch.Tensor, chunk: int = 4096, k: int = 64, value_bits: int = 2) -> tuple[bytes, torch.Tensor]:
    """Encode flat fp32 ``x``; returns ``(payload, x_hat)``.

    ``x_hat`` (fp32, 1-D, on ``x.device``) is bit for bit what
    ``decode(payload, x.numel())`` returns. Raises ValueError on bad
    parameters, a non-1-D / non-fp32 tensor, or non-finite values."""
    _check_params(chunk, k, value_bits)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError("encode expects a 1-D torch.float32 tensor")
    device = x.device
    xc = x.detach().to("cpu").contiguous()
    n = xc.numel()
    c = -(-n // chunk)
    s = _SCALES_PER_CHUNK[value_bits]
    counts, scales, loc, codes, chunk_of, pos = _sparsify(xc, n, chunk, k, value_bits)
    t = int(loc.numel())
    if value_bits == 2:
        code_bytes = _pack2(codes.numpy())
    elif value_bits == 8:
        code_bytes = codes.numpy().astype(np.int8).tobytes()
    else:
        code_bytes = codes.numpy().astype("<f4").tobytes()
    body = b"".join((
        counts.numpy().astype("<u2").tobytes(),
        scales.numpy().astype("<f4").tobytes(),
        _pack12(loc.numpy()),
        code_bytes,
    ))
    assert len(body) == 2 * c + 4 * c * s + _idx_nbytes(t) + _code_nbytes(value_bits, t)
    cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    payload = _HEADER.pack(MAGIC, VERSION, value_bits, 0, n, chunk, k) + cctx.compress(body)

    x_hat = _assemble(n, chunk, pos, _values(value_bits, codes, scales, chunk_of))
    return payload, x_hat.to(device)


# --------------------------------------------------------------------------
# decoder


def _open(payload: bytes, expected_numel: int) -> tuple[int, int, int, int, bytes]:
    """The header checked, the zstd frame checked and opened: (n, chunk, k, value_bits, body)."""
    try:
        mv = memoryview(payload).cast("B")
    except TypeError as exc:
        raise CodecError(f"payload must be bytes-like, got {type(payload).__name__}") from exc
    if len(mv) < HEADER_SIZE:
        raise CodecError(f"truncated payload: {len(mv)} bytes, header alone is {HEADER_SIZE}")
    magic, version, value_bits, reserved, n, chunk, k = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CodecError(f"unsupported version {version}, expected {VERSION}")
    if reserved != 0:
        raise CodecError(f"reserved header field is {reserved}, expected 0")
    _check_params(chunk, k, value_bits, exc=CodecError)
    if n != expected_numel:
        raise CodecError(f"payload holds n={n} elements, expected {expected_numel}")
    return n, chunk, k, value_bits, _unzstd(bytes(mv[HEADER_SIZE:]), _max_body_nbytes(n, chunk, k, value_bits))


def _unzstd(frame: bytes, max_body: int) -> bytes:
    """One whole zstd frame that declares its size, at most ``max_body`` (checked
    before anything is decompressed)."""
    if len(frame) == 0:
        raise CodecError("truncated payload: no zstd frame after the header")
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CodecError(f"bad zstd frame header: {exc}") from exc
    declared = params.content_size
    if declared == zstandard.CONTENTSIZE_UNKNOWN or declared == zstandard.CONTENTSIZE_ERROR:
        raise CodecError("zstd frame does not declare its content size")
    if declared > max_body:
        raise CodecError(f"zstd frame declares {declared} bytes, header allows at most {max_body}")
    try:
        dobj = zstandard.ZstdDecompressor().decompressobj()
        body = dobj.decompress(frame)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd decompression failed: {exc}") from exc
    if not dobj.eof:
        raise CodecError("truncated payload: zstd frame is incomplete")
    if dobj.unused_data:
        raise CodecError(f"{len(dobj.unused_data)} bytes of trailing garbage after the zstd frame")
    if len(body) != declared:
        raise CodecError(f"zstd frame decoded to {len(body)} bytes, declared {declared}")
    return body


def decode(payload: bytes, expected_numel: int) -> torch.Tensor:
    """Decode a payload into a dense fp32 CPU tensor of ``expected_numel``.

    Raises :class:`CodecError` on anything malformed (see module doc)."""
    n, chunk, k, value_bits, body = _open(payload, expected_numel)
    c = -(-n // chunk)
    s = _SCALES_PER_CHUNK[value_bits]

    # ---- body
    off = 0
    if len(body) < 2 * c + 4 * c * s:
        raise CodecError("truncated body: counts/scales section")
    counts = np.frombuffer(body, dtype="<u2", count=c, offset=off).astype(np.int64)
    off += 2 * c
    lens = _chunk_lens(n, chunk)
    if np.any(counts > np.minimum(lens, k)):
        bad = int(np.argmax(counts > np.minimum(lens, k)))
        raise CodecError(f"chunk {bad} claims {int(counts[bad])} entries, at most {min(int(lens[bad]), k)} allowed")
    scales_np = np.frombuffer(body, dtype="<f4", count=c * s, offset=off).astype(np.float32).reshape(c, s)
    off += 4 * c * s
    if not np.all(np.isfinite(scales_np)):
        raise CodecError("non-finite scale in payload")
    if np.any(np.signbit(scales_np)):
        raise CodecError("negative scale in payload")
    t = int(counts.sum())
    need = off + _idx_nbytes(t) + _code_nbytes(value_bits, t)
    if len(body) != need:
        raise CodecError(f"body is {len(body)} bytes, counts imply {need}")
    loc = _unpack12(body[off:off + _idx_nbytes(t)], t)
    off += _idx_nbytes(t)
    chunk_of_np = np.repeat(np.arange(c, dtype=np.int64), counts)
    if t:
        if np.any(loc >= lens[chunk_of_np]):
            bad = int(np.argmax(loc >= lens[chunk_of_np]))
            raise CodecError(f"index {int(loc[bad])} out of range for chunk {int(chunk_of_np[bad])} "
                             f"of length {int(lens[chunk_of_np[bad]])}")
        same = chunk_of_np[1:] == chunk_of_np[:-1]
        if np.any(same & (loc[1:] <= loc[:-1])):
            raise CodecError("indices within a chunk are not strictly increasing (duplicate or unsorted)")
    cb = body[off:]
    if value_bits == 2:
        codes = torch.from_numpy(_unpack2(cb, t).copy())
    elif value_bits == 8:
        codes_np = np.frombuffer(cb, dtype=np.int8).copy()
        if np.any(codes_np == -128):
            raise CodecError("int8 code -128 is not allowed")
        codes = torch.from_numpy(codes_np)
    else:
        codes = torch.from_numpy(np.frombuffer(cb, dtype="<f4").astype(np.float32))
    chunk_of = torch.from_numpy(chunk_of_np)
    vals = _values(value_bits, codes, torch.from_numpy(scales_np), chunk_of)
    if t and not bool(torch.isfinite(vals).all()):
        raise CodecError("payload decodes to non-finite values")
    pos = chunk_of * chunk + torch.from_numpy(loc)
    return _assemble(n, chunk, pos, vals)


# --------------------------------------------------------------------------
# error feedback


def _check_flat_pair(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    for name, t in (("e", a), (what, b)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D torch.float32 tensor")
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: e {tuple(a.shape)} vs {what} {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"device mismatch: e on {a.device}, {what} on {b.device}")


def ef_compress(e: torch.Tensor, delta: torch.Tensor, beta: float, chunk: int = 4096, k: int = 64,
                value_bits: int = 2) -> tuple[bytes, torch.Tensor]:
    """Error-feedback step: ``a = e*fp32(beta) + delta``; send ``a``; ``e ← a − a_hat``.

    ``e`` is updated in place. Returns ``(payload, a_hat)`` with ``a_hat`` on
    ``e.device``. Guarantees ``e_new + a_hat == e_old.mul(beta).add_(delta)``
    exactly (bitwise except that -0.0 may come back as +0.0)."""
    _check_flat_pair(e, delta, "delta")
    a = e.mul(beta).add_(delta)
    payload, a_hat = encode(a, chunk=chunk, k=k, value_bits=value_bits)
    torch.sub(a, a_hat, out=e)
    return payload, a_hat


def ef_restore(e: torch.Tensor, a_hat: torch.Tensor) -> None:
    """For a replica left out of a round: ``e += a_hat`` in place.

    Right after :func:`ef_compress` this restores ``e`` to exactly the ``a``
    that was encoded (same caveat on -0.0)."""
    _check_flat_pair(e, a_hat, "a_hat")
    e.add_(a_hat)


# --------------------------------------------------------------------------
# aggregation


def _sumsq_exact(t: torch.Tensor) -> int:
    """Exact sum of squares of fp32 ``t``, as an integer scaled by 2**298.

    Each finite fp32 x is M * 2**(b - 149) with b = max(E, 1) - 1 (E the
    biased exponent) and M its 24-bit significand, so
    x**2 * 2**298 = M**2 * 2**(2b): an integer. M**2 < 2**48 is split into
    two 24-bit halves that are summed per b in int64 (no overflow below 2**39
    elements), then combined in Python integers. Integer sums do not depend
    on order, so the result is the same on every machine."""
    bits = t.detach().reshape(-1).to("cpu").contiguous().view(torch.int32)
    absb = bits & 0x7FFFFFFF
    nzm = absb != 0
    nnz = int(nzm.sum())
    if nnz == 0:
        return 0
    if nnz < absb.numel() // 2:
        absb = absb[nzm]
    if int(absb.max()) >= 0x7F800000:
        raise ValueError("aggregate: contribution has non-finite values")
    b = (absb >> 23).sub_(1).clamp_(min=0)
    sig = (absb - (b << 23)).to(torch.int64)  # (1 << 23 | frac), or frac if subnormal
    sq = sig.mul_(sig)
    b = b.to(torch.int64)
    hi = torch.zeros(254, dtype=torch.int64).index_add_(0, b, sq >> 24)
    lo = torch.zeros(254, dtype=torch.int64).index_add_(0, b, sq.bitwise_and_(0xFFFFFF))
    total = 0
    for e2, (h, l) in enumerate(zip(hi.tolist(), lo.tolist())):
        if h or l:
            total += ((h << 24) + l) << (2 * e2)
    return total


def _clip_factor(s_med: int, s_i: int) -> float:
    """fp32(float64(floor(2**64 * sqrt(s_med / s_i)) / 2**64)), s_i > s_med >= 0."""
    r = math.isqrt((s_med << 128) // s_i)
    return float(np.float32(math.ldexp(float(r), -64)))


def aggregate(contributions: Sequence[torch.Tensor], clip: str = "median") -> torch.Tensor:
    """Average of the round's contributions (given in replica-id order).

    See the module doc for the exact arithmetic. Returns a new fp32 tensor."""
    if clip not in ("median", "none"):
        raise ValueError(f"clip must be 'median' or 'none', got {clip!r}")
    contributions = list(contributions)
    if not contributions:
        raise ValueError("aggregate: no contributions")
    first = contributions[0]
    for i, c in enumerate(contributions):
        if not isinstance(c, torch.Tensor) or c.dtype != torch.float32:
            raise ValueError(f"aggregate: contribution {i} is not a torch.float32 tensor")
        if c.shape != first.shape:
            raise ValueError(f"aggregate: contribution {i} has shape {tuple(c.shape)}, expected {tuple(first.shape)}")
        if c.device != first.device:
            raise ValueError(f"aggregate: contribution {i} is on {c.device}, expected {first.device}")
    r = len(contributions)
    factors: list[float | None] = [None] * r
    if clip == "median":
        sq = [_sumsq_exact(c) for c in contributions]
        order = sorted(range(r), key=lambda i: (sq[i], i))
        s_med = sq[order[(r - 1) // 2]]
        for i in range(r):
            if sq[i] > s_med:
                factors[i] = _clip_factor(s_med, sq[i])
    acc = None
    for c, f in zip(contributions, factors):
        if acc is None:
            acc = c.clone() if f is None else c.mul(f)
        elif f is None:
            acc.add_(c)
        else:
            acc.add_(c.mul(f))
    # a divisor tensor on acc's device, not the number r: CUDA divides by a
    # Python number as acc * fp32(1/r), not always the correctly rounded
    # quotient the CPU gives (replicas on different devices would disagree)
    acc.div_(acc.new_full((), r))
    return acc


def outer_sgd(theta_global: torch.Tensor, agg: torch.Tensor, lr: float) -> torch.Tensor:
    """In place: ``theta_global.sub_(agg.mul(lr))`` i.e. θ -= fp32(agg·fp32(lr)).

    Returns ``theta_global``."""
    if theta_global.shape != agg.shape or theta_global.dtype != agg.dtype:
        raise ValueError("outer_sgd: theta_global and agg differ in shape or dtype")
    theta_global.sub_(agg.mul(lr))
    return theta_global


class NesterovOuter:
    """Dense DiLoCo outer optimiser: SGD with Nesterov momentum on a flat tensor.

    Same update as ``torch.optim.SGD(lr, momentum, nesterov=True)`` with no
    dampening / weight decay, written as separate fp32 ops (no fused
    multiply-add)::

        buf = g.clone()                  (first step)
        buf = buf * m + g                (later steps)
        theta -= (buf * m + g) * lr
    """

    def __init__(self, lr: float, momentum: float = 0.9):
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be a positive finite float, got {lr}")
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.buf: torch.Tensor | None = None
        self.steps = 0

    def step(self, theta_global: torch.Tensor, avg_pseudo_grad: torch.Tensor) -> torch.Tensor:
        g = avg_pseudo_grad
        if theta_global.shape != g.shape or theta_global.dtype != g.dtype:
            raise ValueError("NesterovOuter.step: theta_global and avg_pseudo_grad differ in shape or dtype")
        if self.buf is None:
            self.buf = g.detach().clone()
        else:
            if self.buf.shape != g.shape:
                raise ValueError("NesterovOuter.step: gradient shape changed")
            self.buf.mul_(self.momentum).add_(g)
        upd = self.buf.mul(self.momentum).add_(g)
        theta_global.sub_(upd.mul_(self.lr))
        self.steps += 1
        return theta_global

    def state_dict(self) -> dict:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "steps": self.steps,
            "buf": None if self.buf is None else self.buf.detach().clone(),
        }

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        """``device``: where the buffer goes (that of the θ_global it steps; a
        checkpoint is read into host memory); default: where it is."""
        buf = state["buf"]
        if buf is not None and (not isinstance(buf, torch.Tensor) or buf.dtype != torch.float32):
            raise ValueError("NesterovOuter.load_state_dict: buf must be a float32 tensor or None")
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self.steps = int(state["steps"])
        self.buf = None if buf is None else buf.detach().to(buf.device if device is None else device, copy=True)
