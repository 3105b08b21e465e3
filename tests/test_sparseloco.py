"""SparseLoCo outer-sync math (crucible.compress.sparseloco)."""

import struct
import time
from fractions import Fraction

import numpy as np
import pytest
import torch
import zstandard

from crucible.compress import sparseloco as slc
from crucible.compress.sparseloco import (
    CodecError,
    NesterovOuter,
    aggregate,
    decode,
    dense_nbytes,
    ef_compress,
    ef_restore,
    encode,
    outer_sgd,
)

torch.set_num_threads(1)


# ---------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_bits_mod_zero_sign(a: torch.Tensor, b: torch.Tensor) -> bool:
    # x + 0.0 maps -0.0 to +0.0 and leaves every other value unchanged
    return same_bits(a + 0.0, b + 0.0)


def ref_topk_positions(x: torch.Tensor, chunk: int, k: int) -> set:
    """Per-chunk top-k by magnitude, ties -> lower index (plain loop)."""
    xa = x.abs().numpy()
    out = set()
    for start in range(0, xa.shape[0], chunk):
        seg = xa[start:start + chunk]
        order = np.lexsort((np.arange(seg.shape[0]), -seg.astype(np.float64)))
        out.update(int(start + i) for i in order[:k])
    return out


def nonzero_positions(t: torch.Tensor) -> set:
    return set(torch.nonzero(t).flatten().tolist())


def split_payload(p: bytes):
    hdr = p[:slc.HEADER_SIZE]
    body = zstandard.ZstdDecompressor().decompress(p[slc.HEADER_SIZE:])
    return hdr, body


def wrap(hdr: bytes, body: bytes, **kw) -> bytes:
    kw.setdefault("write_checksum", True)
    return hdr + zstandard.ZstdCompressor(**kw).compress(body)


def header(n, chunk=4096, k=64, value_bits=2, magic=slc.MAGIC, version=slc.VERSION, reserved=0):
    return struct.pack("<4sBBHQII", magic, version, value_bits, reserved, n, chunk, k)


def mixed_data(n: int, seed: int) -> torch.Tensor:
    """Zeros, -0.0, subnormals, tiny, huge-range, negative values."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 6, (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    expo = torch.empty(n).uniform_(-37.0, 36.0, generator=g)
    huge = sign * torch.pow(10.0, expo.double()).float()
    normal = torch.randn(n, generator=g)
    sub = sign * torch.randint(1, 1 << 20, (n,), generator=g).to(torch.int32).view(torch.float32)
    x = torch.where(kind == 0, torch.zeros(n), normal)
    x = torch.where(kind == 1, torch.full((n,), -0.0), x)
    x = torch.where(kind == 2, sub, x)
    x = torch.where(kind == 3, huge, x)
    x = torch.where(kind == 4, normal * 1e-30, x)
    assert torch.isfinite(x).all()
    return x


# ---------------------------------------------------------------- codec


@pytest.mark.parametrize("value_bits", [2, 8, 32])
@pytest.mark.parametrize("n,chunk,k", [
    (4096 * 5, 4096, 64),
    (4096 * 3 + 17, 4096, 64),   # short last chunk
    (4096 * 2 + 40, 4096, 64),   # last chunk shorter than k
    (5, 4096, 64),               # single chunk shorter than k
    (1, 4096, 64),
    (10_000, 1000, 7),
    (3001, 256, 256),            # k == chunk
])
def test_roundtrip_selects_chunk_topk(value_bits, n, chunk, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + value_bits))
    payload, x_hat = encode(x, chunk=chunk, k=k, value_bits=value_bits)
    assert x_hat.dtype == torch.float32 and x_hat.shape == (n,)
    y = decode(payload, n)
    assert same_bits(y, x_hat)
    top = ref_topk_positions(x, chunk, k)
    sent = nonzero_positions(x_hat)
    assert sent <= top
    pos = torch.tensor(sorted(sent), dtype=torch.int64)
    xs, qs = x[pos].double(), x_hat[pos].double()
    # every sent value has x's sign and is within the Sterbenz factor 2
    assert torch.all(torch.sign(xs) == torch.sign(qs))
    assert torch.all(qs.abs() * 2 >= xs.abs()) and torch.all(qs.abs() <= 2 * xs.abs())
    if value_bits == 32:
        assert sent == top
        assert torch.equal(x_hat[pos], x[pos])
    else:
        # Gaussian data: the quantiser should send (nearly) everything selected
        if len(top) >= 64 and 8 * k <= chunk:
            assert len(sent) >= 0.95 * len(top)
        # the largest entry of every chunk is always sent
        for start in range(0, n, chunk):
            assert start + int(x[start:start + chunk].abs().argmax()) in sent
    if value_bits == 8:
        assert torch.all((qs - xs).abs() <= 0.51 * xs.abs().max() / 127 + 1e-12)


def test_tie_break_lower_index_wins():
    g = torch.Generator().manual_seed(1)
    n, chunk, k = 4096 * 3 + 100, 4096, 64
    # few distinct magnitudes: lots of ties at the k-th place
    x = torch.randint(1, 4, (n,), generator=g).float() * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    for value_bits in (32, 8, 2):
        payload, x_hat = encode(x, chunk=chunk, k=k, value_bits=value_bits)
        assert same_bits(decode(payload, n), x_hat)
        assert nonzero_positions(x_hat) <= ref_topk_positions(x, chunk, k)
        if value_bits != 2:  # 2-bit may leave middle entries unsent
            assert nonzero_positions(x_hat) == ref_topk_positions(x, chunk, k)
    # all equal: the first k of every chunk
    x = torch.full((3 * 512,), -2.5)
    _, x_hat = encode(x, chunk=512, k=10, value_bits=32)
    assert nonzero_positions(x_hat) == {c * 512 + i for c in range(3) for i in range(10)}


def test_chunk_with_fewer_nonzeros_than_k():
    x = torch.zeros(8192)
    x[5], x[4000], x[4100] = 3.0, -1.0, 0.5
    for value_bits in (2, 8, 32):
        p, x_hat = encode(x, value_bits=value_bits)
        assert same_bits(decode(p, 8192), x_hat)
        assert nonzero_positions(x_hat) == {5, 4000, 4100}
        assert x_hat[5] > 0 and x_hat[4000] < 0 and x_hat[4100] > 0
    _, x_hat = encode(torch.zeros(100), value_bits=2)
    assert same_bits(x_hat, torch.zeros(100))


def test_2bit_outlier_is_always_sent():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    x[123] = -1e6
    _, x_hat = encode(x)
    assert x_hat[123] == -1e6  # hi level == the outlier itself
    codes_levels = set(x_hat[x_hat != 0].abs().tolist())
    assert len(codes_levels) <= 2


@pytest.mark.parametrize("n,chunk", [(4096 * 3 + 17, 4096), (999, 100), (1, 1), (7, 4096)])
def test_lossless_mode_is_bitwise(n, chunk):
    x = mixed_data(n, seed=n)
    x[: min(n, 3)] = -0.0
    p, x_hat = encode(x, chunk=chunk, k=chunk, value_bits=32)
    assert same_bits(x_hat, x)
    assert same_bits(decode(p, n), x)


def test_empty_tensor():
    p, x_hat = encode(torch.zeros(0))
    assert x_hat.shape == (0,)
    assert decode(p, 0).shape == (0,)
    with pytest.raises(CodecError):
        decode(p, 1)


def test_encode_rejects_bad_input():
    x = torch.randn(100)
    for kw in (dict(chunk=4097), dict(chunk=0), dict(k=0), dict(chunk=64, k=65), dict(value_bits=4)):
        with pytest.raises(ValueError):
            encode(x, **kw)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[50] = bad
        with pytest.raises(ValueError, match="non-finite"):
            encode(y)
    with pytest.raises(ValueError):
        encode(x.double())
    with pytest.raises(ValueError):
        encode(x.view(10, 10))


def test_compression_ratio_at_defaults():
    n = 1_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    p, _ = encode(x)
    ratio = dense_nbytes(n) / len(p)
    print(f"\nSparseLoCo defaults on {n} elements: {len(p)} bytes, "
          f"{len(p) / n:.5f} B/elem, ratio {ratio:.1f}x")
    assert dense_nbytes(n) == 4 * n
    assert len(p) * 100 <= dense_nbytes(n)


def test_encode_decode_speed_10m():
    n = 10_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    p, x_hat = encode(x)
    t1 = time.perf_counter()
    y = decode(p, n)
    t2 = time.perf_counter()
    print(f"\n10M elements: encode {t1 - t0:.3f}s ({4 * n / 1e6 / (t1 - t0):.0f} MB/s), "
          f"decode {t2 - t1:.3f}s ({4 * n / 1e6 / (t2 - t1):.0f} MB/s)")
    assert same_bits(y, x_hat)
    assert t1 - t0 < 5.0  # loose: the target is well under a second


# ---------------------------------------------------------------- malformed


@pytest.fixture(scope="module")
def good():
    n = 4096 * 4 + 300
    x = torch.randn(n, generator=torch.Generator().manual_seed(7))
    out = {}
    for vb in (2, 8, 32):
        p, _ = encode(x, value_bits=vb)
        out[vb] = p
    return n, out


def test_truncated(good):
    n, payloads = good
    for p in payloads.values():
        for cut in [0, 1, 4, 23, 24, 25, 30, len(p) // 2, len(p) - 4, len(p) - 1]:
            with pytest.raises(CodecError):
                decode(p[:cut], n)


def test_flipped_magic_version_reserved(good):
    n, payloads = good
    p = payloads[2]
    for i in range(4):
        q = bytearray(p)
        q[i] ^= 0x20
        with pytest.raises(CodecError, match="magic"):
            decode(bytes(q), n)
    q = bytearray(p)
    q[4] = 9
    with pytest.raises(CodecError, match="version"):
        decode(bytes(q), n)
    q = bytearray(p)
    q[6] = 1
    with pytest.raises(CodecError, match="reserved"):
        decode(bytes(q), n)


def test_bad_header_params(good):
    n, payloads = good
    hdr, body = split_payload(payloads[2])
    for kw in (dict(chunk=4097), dict(chunk=0), dict(k=0), dict(k=5000), dict(value_bits=3)):
        with pytest.raises(CodecError):
            decode(wrap(header(n, **kw), body), n)


def test_wrong_expected_numel(good):
    n, payloads = good
    for p in payloads.values():
        for m in (n - 1, n + 1, 0, 2 ** 40):
            with pytest.raises(CodecError, match="expected"):
                decode(p, m)


def test_trailing_garbage(good):
    n, payloads = good
    for p in payloads.values():
        with pytest.raises(CodecError, match="trailing"):
            decode(p + b"\x00", n)
        with pytest.raises(CodecError):
            decode(p + p[slc.HEADER_SIZE:], n)  # a second frame


def test_random_garbage():
    rng = np.random.default_rng(0)
    for length in [0, 1, 10, 23, 24, 25, 100, 1000, 5000]:
        for _ in range(5):
            junk = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
            with pytest.raises(CodecError):
                decode(junk, 1000)
            # valid header, garbage after it
            with pytest.raises(CodecError):
                decode(header(1000) + junk, 1000)
    with pytest.raises(CodecError):
        decode("not bytes", 10)


def test_single_byte_corruption_never_escapes(good):
    """Any one-byte change either raises CodecError or still decodes to a
    finite tensor of the right size (zstd checksum catches body damage)."""
    n, payloads = good
    rng = np.random.default_rng(1)
    for p in payloads.values():
        for _ in range(150):
            q = bytearray(p)
            i = int(rng.integers(0, len(q)))
            q[i] ^= int(rng.integers(1, 256))
            try:
                y = decode(bytes(q), n)
            except CodecError:
                continue
            assert y.shape == (n,) and torch.isfinite(y).all()


def test_zstd_bombs_and_huge_declared_n():
    # huge declared n that does not match what the caller expects
    with pytest.raises(CodecError, match="expected"):
        decode(header(2 ** 60) + b"\x00" * 32, 4096)
    # huge n that the caller does expect, tiny frame: must fail fast, without
    # allocating anything of size n
    t0 = time.perf_counter()
    with pytest.raises(CodecError):
        decode(wrap(header(2 ** 40), b"\x00" * 100), 2 ** 40)
    assert time.perf_counter() - t0 < 1.0
    # a frame that inflates far beyond what the header allows is refused
    # before decompression
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x00" * (64 << 20))
    assert len(bomb) < 10_000
    t0 = time.perf_counter()
    with pytest.raises(CodecError, match="at most"):
        decode(header(4096) + bomb, 4096)
    assert time.perf_counter() - t0 < 1.0
    # a frame that hides its content size is refused
    hdr, body = split_payload(encode(torch.randn(4096))[0])
    with pytest.raises(CodecError, match="content size"):
        decode(wrap(hdr, body, write_content_size=False), 4096)


def _parse_body(body: bytes, c: int, s: int):
    counts = np.frombuffer(body, "<u2", c).copy()
    scales = np.frombuffer(body, "<f4", c * s, 2 * c).copy()
    rest = body[2 * c + 4 * c * s:]
    return counts, scales, rest


def test_malformed_body_fields():
    n = 4096 * 2 + 100
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    p, _ = encode(x, value_bits=2)
    hdr, body = split_payload(p)
    c, s = 3, 2
    counts, scales, rest = _parse_body(body, c, s)
    t = int(counts.sum())
    idx_bytes = ((t + 1) // 2) * 3

    def rebuild(counts=counts, scales=scales, rest=rest):
        return wrap(hdr, counts.astype("<u2").tobytes() + scales.astype("<f4").tobytes() + rest)

    assert same_bits(decode(rebuild(), n), decode(p, n))  # rebuild is faithful
    # non-finite / negative scales
    for bad in (np.nan, np.inf, -np.inf, -1.0):
        sc = scales.copy()
        sc[1] = bad
        with pytest.raises(CodecError, match="scale"):
            decode(rebuild(scales=sc), n)
    # a count above k
    cn = counts.copy()
    cn[0] = 65
    with pytest.raises(CodecError):
        decode(rebuild(counts=cn), n)
    # the last chunk (100 long) may not have more than 64... nor be claimed
    # with more entries than the body holds
    cn = counts.copy()
    cn[2] = cn[2] - 1
    with pytest.raises(CodecError, match="counts imply"):
        decode(rebuild(counts=cn), n)
    # index out of range in the short last chunk: set its last index to 4000
    idx = slc._unpack12(rest[:idx_bytes], t).copy()
    bad = idx.copy()
    bad[-1] = 4000
    with pytest.raises(CodecError, match="out of range"):
        decode(rebuild(rest=slc._pack12(bad) + rest[idx_bytes:]), n)
    # duplicate / unsorted indices within a chunk
    bad = idx.copy()
    bad[1] = bad[0]
    with pytest.raises(CodecError, match="increasing"):
        decode(rebuild(rest=slc._pack12(bad) + rest[idx_bytes:]), n)
    bad = idx.copy()
    bad[0], bad[1] = idx[1], idx[0]
    with pytest.raises(CodecError, match="increasing"):
        decode(rebuild(rest=slc._pack12(bad) + rest[idx_bytes:]), n)
    # body too long
    with pytest.raises(CodecError):
        decode(rebuild(rest=rest + b"\x00"), n)


def test_malformed_8bit_values():
    n = 4096
    p, _ = encode(torch.randn(n, generator=torch.Generator().manual_seed(2)), value_bits=8)
    hdr, body = split_payload(p)
    counts, scales, rest = _parse_body(body, 1, 1)
    t = int(counts.sum())
    ib = ((t + 1) // 2) * 3
    codes = np.frombuffer(rest[ib:], np.int8).copy()
    codes[0] = -128
    with pytest.raises(CodecError, match="-128"):
        decode(wrap(hdr, body[:6] + rest[:ib] + codes.tobytes()), n)
    # a finite but huge step that makes decoded values overflow
    sc = np.array([3e38], "<f4")
    with pytest.raises(CodecError, match="non-finite"):
        decode(wrap(hdr, body[:2] + sc.tobytes() + rest), n)


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("value_bits", [2, 8, 32])
@pytest.mark.parametrize("beta", [0.9, 1.0, 0.0, 0.37])
def test_ef_invariant_bitwise(value_bits, beta):
    n, chunk, k = 4096 * 3 + 333, 4096, 64
    e = mixed_data(n, seed=11) * 0.5
    for rnd in range(4):
        delta = mixed_data(n, seed=100 * rnd + value_bits)
        e_old = e.clone()
        payload, a_hat = ef_compress(e, delta, beta, chunk=chunk, k=k, value_bits=value_bits)
        a = e_old * beta + delta  # the documented expression: fp32 mul, then fp32 add
        assert same_bits(a, e_old.mul(beta).add_(delta))
        assert same_bits_mod_zero_sign(e + a_hat, a)
        assert same_bits_mod_zero_sign(a_hat + e, a)
        assert torch.equal(e + a_hat, a)
        assert same_bits(decode(payload, n), a_hat)
        assert nonzero_positions(a_hat) <= ref_topk_positions(a, chunk, k)
        # exact residual: e == a - a_hat where sent, e == a where not
        sent = a_hat != 0
        assert same_bits(e[~sent], a[~sent])
        assert torch.isfinite(e).all()
        # a replica left out of the round gets a back exactly
        e_back = e.clone()
        ef_restore(e_back, a_hat)
        assert same_bits_mod_zero_sign(e_back, a)


@pytest.mark.parametrize("value_bits", [2, 8])
def test_ef_invariant_on_small_and_skewed_chunks(value_bits):
    # small chunks with k close to chunk, plus very heavy tails: forces many
    # Sterbenz rejections; the invariant must still hold exactly
    g = torch.Generator().manual_seed(value_bits)
    n = 5000
    e = torch.zeros(n)
    for rnd in range(6):
        delta = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-20, 20, (n,), generator=g).float())
        e_old = e.clone()
        _, a_hat = ef_compress(e, delta, 0.95, chunk=64, k=48, value_bits=value_bits)
        assert same_bits_mod_zero_sign(e + a_hat, e_old * 0.95 + delta)


def test_ef_residual_shrinks_with_beta_one():
    # with beta=1 and no new input, EF drains the buffer chunk by chunk
    x = torch.randn(4096 * 2, generator=torch.Generator().manual_seed(9))
    e = x.clone()
    zero = torch.zeros_like(x)
    total = torch.zeros_like(x)
    for _ in range(200):
        _, a_hat = ef_compress(e, zero, 1.0, value_bits=2)
        total += a_hat
    assert torch.allclose(total + e, x, rtol=0, atol=1e-5)
    assert e.abs().max() < x.abs().max() * 0.5


def test_ef_shape_errors():
    with pytest.raises(ValueError):
        ef_compress(torch.zeros(10), torch.zeros(11), 0.9)
    with pytest.raises(ValueError):
        ef_compress(torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64), 0.9)


# ---------------------------------------------------------------- aggregation


def test_sumsq_exact():
    x = mixed_data(3000, seed=4)
    x[:5] = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45, 0.0])
    ref = sum(Fraction(v) ** 2 for v in x.tolist()) * 2 ** 298
    assert ref.denominator == 1
    assert slc._sumsq_exact(x) == ref.numerator
    sparse = torch.zeros(100_000)
    sparse[::997] = x[: len(sparse[::997])]
    ref = sum(Fraction(v) ** 2 for v in sparse.tolist()) * 2 ** 298
    assert slc._sumsq_exact(sparse) == ref.numerator
    with pytest.raises(ValueError):
        slc._sumsq_exact(torch.tensor([1.0, float("inf")]))


def test_median_clip_outlier():
    g = torch.Generator().manual_seed(2)
    n = 10_000
    cs = [torch.randn(n, generator=g) * (1 + 0.1 * i) for i in range(5)]
    cs[3] = cs[3] * 1000
    norms = [float(c.double().norm()) for c in cs]
    med = sorted(norms)[2]
    out = aggregate(cs, clip="median")
    assert torch.isfinite(out).all()
    expect = sum((c.double() * min(1.0, med / nm)) for c, nm in zip(cs, norms)) / 5
    assert torch.allclose(out.double(), expect, rtol=1e-5, atol=1e-6)
    # the clipped contribution now has (about) the median norm
    f = slc._clip_factor(slc._sumsq_exact(cs[2 if norms[2] == med else 0]), slc._sumsq_exact(cs[3]))
    assert float(cs[3].mul(f).double().norm()) == pytest.approx(med, rel=1e-6)
    # far below the unclipped average
    assert out.norm() < aggregate(cs, clip="none").norm() / 50


def test_median_exact_arithmetic_and_even_count():
    g = torch.Generator().manual_seed(3)
    cs = [torch.randn(1000, generator=g) * s for s in (1.0, 4.0, 2.0, 3.0)]
    # lower middle of 4: the norm of scale 2.0 (cs[2])
    sq = [slc._sumsq_exact(c) for c in cs]
    s_med = sq[2]
    acc = cs[0].clone()
    acc.add_(cs[1].mul(slc._clip_factor(s_med, sq[1])))
    acc.add_(cs[2])
    acc.add_(cs[3].mul(slc._clip_factor(s_med, sq[3])))
    acc.div_(4)
    assert same_bits(aggregate(cs), acc)
    # equal norms: nothing is scaled
    c = torch.randn(1000, generator=g)
    cs = [c, -c, c.flip(0)]
    acc = c.clone()
    acc.add_(-c)
    acc.add_(c.flip(0))
    acc.div_(3)
    assert same_bits(aggregate(cs), acc)
    # a single contribution comes back unchanged
    assert same_bits(aggregate([c]), c)
    # zero median: everything above it is scaled to zero
    z = torch.zeros(1000)
    assert torch.equal(aggregate([z, z, c]), torch.zeros(1000))


@pytest.mark.parametrize("r", [3, 5, 7])
def test_aggregate_divides_correctly_rounded_on_every_device(r):
    """``acc /= R`` is one correctly rounded fp32 division, also where a
    division by a Python number would be ``acc * fp32(1/R)`` (CUDA's kernel):
    aggregate divides by a tensor on acc's device, so replicas agree bitwise
    whatever their device."""
    from crucible.testing.cuda_division import CudaScalarDivision

    g = torch.Generator().manual_seed(8)
    cs = [torch.randn(20_000, generator=g) for _ in range(r)]
    acc = cs[0].double()
    for c in cs[1:]:
        acc = (acc + c.double()).float().double()           # the sequential fp32 adds
    want = (acc / r).float()                                 # one division, rounded once to fp32
    assert same_bits(aggregate(cs, clip="none"), want)
    with CudaScalarDivision() as mode:
        got = aggregate(cs, clip="none")
    assert same_bits(got, want)
    assert mode.count == 0


def test_aggregate_errors():
    with pytest.raises(ValueError):
        aggregate([])
    with pytest.raises(ValueError):
        aggregate([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError):
        aggregate([torch.zeros(3)], clip="mean")
    with pytest.raises(ValueError):
        aggregate([torch.zeros(3), torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError):
        aggregate([torch.zeros(3), torch.tensor([0.0, float("nan"), 1.0])])


def test_lossless_pipeline_equals_plain_averaging():
    g = torch.Generator().manual_seed(8)
    n, r, lr, chunk = 4096 * 2 + 123, 4, 0.7, 4096
    theta = torch.randn(n, generator=g)
    deltas = [torch.randn(n, generator=g) * 1e-2 for _ in range(r)]
    contributions = []
    for d in deltas:
        e = torch.zeros(n)
        payload, a_hat = ef_compress(e, d, 0.9, chunk=chunk, k=chunk, value_bits=32)
        assert same_bits(a_hat, d) and torch.equal(e, torch.zeros(n))
        contributions.append(decode(payload, n))  # what the peers receive
    mine = theta.clone()
    outer_sgd(mine, aggregate(contributions, clip="none"), lr)
    avg = deltas[0].clone()
    for d in deltas[1:]:
        avg += d
    avg /= r
    plain = theta.clone()
    plain -= lr * avg
    assert same_bits(mine, plain)


# ---------------------------------------------------------------- Nesterov


def test_nesterov_matches_torch_sgd_and_resumes():
    g = torch.Generator().manual_seed(6)
    n = 5000
    theta = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(6)]
    ref = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    mine = theta.clone()
    for gr in grads[:3]:
        outer.step(mine, gr)
        ref.grad = gr.clone()
        opt.step()
    assert torch.allclose(mine, ref.detach(), rtol=1e-5, atol=1e-6)
    # resume from a state dict: continues bitwise like the original
    sd = outer.state_dict()
    other = NesterovOuter(lr=0.1, momentum=0.5)
    other.load_state_dict(sd)
    mine2 = mine.clone()
    for gr in grads[3:]:
        outer.step(mine, gr)
        other.step(mine2, gr)
        ref.grad = gr.clone()
        opt.step()
    assert same_bits(mine, mine2)
    assert torch.allclose(mine, ref.detach(), rtol=1e-5, atol=1e-5)
    assert sd["steps"] == 3 and outer.state_dict()["steps"] == 6
    fresh = NesterovOuter(lr=1.0)
    fresh.load_state_dict(NesterovOuter(lr=1.0).state_dict())
    assert fresh.buf is None
    with pytest.raises(ValueError):
        NesterovOuter(lr=0.0)
    with pytest.raises(ValueError):
        outer.step(mine, torch.zeros(3))


def restored_diloco(device):
    """A DiLoCo stage's outer state after one round on the host, and one on
    ``device`` restored from its state dict (as from a shard, read into host
    memory). Also the GPU suite's (tests/test_gpu.py)."""
    from crucible.config import Config
    from crucible.worker.outer import OuterState

    cfg = Config.load(None, ["outer.mode=diloco"])
    src = OuterState(torch.nn.Linear(8, 4), cfg.outer, replicas=2)
    src.nesterov.step(src.theta_global, torch.full_like(src.theta_global, 0.5))
    dst = OuterState(torch.nn.Linear(8, 4).to(device), cfg.outer, replicas=2)
    dst.load_state_dict(src.state_dict())
    return src, dst


def test_diloco_state_restored_from_host_memory_keeps_its_momentum_where_theta_global_is():
    """A shard is read into host memory; on a GPU θ_global is on the device,
    and the momentum buffer must follow it (it stayed on the CPU, and the next
    outer round failed on a GPU). A model on the meta device stands in for one
    off the host."""
    src, dst = restored_diloco("meta")
    assert dst.theta_global.device.type == "meta"
    assert dst.nesterov.buf is not None and dst.nesterov.buf.device == dst.theta_global.device
    # on the host, bitwise the saved buffer
    _, back = restored_diloco("cpu")
    assert same_bits(back.nesterov.buf, src.nesterov.buf)


def test_outer_sgd_expression():
    g = torch.Generator().manual_seed(12)
    theta = torch.randn(1000, generator=g)
    agg = torch.randn(1000, generator=g)
    expect = theta - agg * np.float32(0.3).item()
    out = outer_sgd(theta, agg, 0.3)
    assert out is theta and same_bits(theta, expect)
    with pytest.raises(ValueError):
        outer_sgd(theta, torch.zeros(3), 0.1)
