"""Activation codecs at stage boundaries: bounds, exactness, ratios, refusals."""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import pytest
import torch
import zstandard

from crucible.compress import activations as A
from crucible.compress.activations import CodecError, make_codec, projection, read_header, wire_stats

torch.set_num_threads(1)

D = 64
ALL_SPECS = ["none", "bf16", "int8", "int8:zstd=0", "int4", "int4:zstd=1", "int4:group=16", "subspace",
             "subspace:dtype=fp16", "subspace:dtype=fp32"]
LOSSY_QUANT = ["int8", "int8:zstd=0", "int4", "int4:zstd=1", "int4:group=16"]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def rand(shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=gen(seed)) * scale


def adversarial(d=D) -> dict[str, torch.Tensor]:
    """Named [B, T, d] tensors that break naive quantisers."""
    base = rand((2, 8, d), seed=1)
    zeros_rows = base.clone()
    zeros_rows[0, :3] = 0.0                      # whole rows of zeros
    zeros_rows[1, 5, : d // 2] = 0.0             # half a row of zeros (whole int4 groups)
    outlier = base.clone()
    outlier[0, 2, 7] = 1e30                      # one huge outlier in a row
    outlier[1, 1, 0] = -3e4
    negative = -base.abs() - 0.5                 # all negative
    mixed = base * torch.logspace(-30, 30, 16).view(2, 8, 1)   # row scales 1e-30 .. 1e30
    tiny = base * 1e-40                          # subnormal float32
    onehot = torch.zeros(2, 8, d)
    onehot[..., 3] = 1.0
    return {"random": rand((2, 8, d), seed=2), "zero_rows": zeros_rows, "outlier": outlier,
            "negative": negative, "mixed_scales": mixed, "subnormal": tiny,
            "all_zero": torch.zeros(2, 8, d), "onehot": onehot}


# ------------------------------------------------------------------ helpers

def body_of(payload: bytes) -> memoryview:
    h = read_header(payload)
    return memoryview(payload)[h.header_nbytes:]


def rebuild(payload: bytes, body, *, codec_id=None, params=None, shape=None) -> bytes:
    """A payload with a new body (and optionally header fields) and a valid CRC."""
    h = read_header(payload)
    dtype_code = A._DTYPE_CODES[h.src_dtype]
    return b"".join(A._assemble(h.codec_id if codec_id is None else codec_id, dtype_code,
                                h.params if params is None else params,
                                h.shape if shape is None else shape, bytes(body)))


def int8_raw(payload: bytes) -> bytes:
    """The int8 body without its zstd (steps then codes)."""
    body = bytes(body_of(payload))
    return body if read_header(payload).params == (0, 1, 0) else zstandard.ZstdDecompressor().decompress(body)


def int8_steps(payload: bytes, rows: int) -> torch.Tensor:
    raw = int8_raw(payload)
    return torch.from_numpy(np.frombuffer(raw, np.float32, rows).copy())


def int4_steps(payload: bytes, codec) -> torch.Tensor:
    rows = math.prod(read_header(payload).shape[:-1])
    body = bytes(body_of(payload))
    if codec.zstd:
        body = zstandard.ZstdDecompressor().decompress(body)
    bits = torch.from_numpy(np.frombuffer(body, np.int16, rows * codec.groups).copy())
    return bits.view(torch.bfloat16).float().view(rows, codec.groups)


# ------------------------------------------------------------- basic contract

@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("shape", [(2, 8, D), (3, D), (D,), (0, 4, D)])
def test_shape_dtype_preserved(spec, shape):
    c = make_codec(spec, D, seed=3)
    t = rand(shape)
    out = c.decode(c.encode(t), shape)
    assert out.shape == torch.Size(shape)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"
    h = read_header(c.encode(t))
    assert h.shape == shape and h.codec == c.kind and h.src_dtype == torch.float32


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_input_dtypes_and_layouts(spec):
    c = make_codec(spec, D)
    t = rand((4, D, 3)).transpose(1, 2)          # non-contiguous [4, 3, D]
    ref = c.decode(c.encode(t.contiguous()), (4, 3, D))
    assert torch.equal(c.decode(c.encode(t), (4, 3, D)), ref)
    for dt in (torch.bfloat16, torch.float16):
        x = t.to(dt)
        p = c.encode(x)
        assert read_header(p).src_dtype == dt
        assert torch.equal(c.decode(p, (4, 3, D)), c.decode(c.encode(x.float()), (4, 3, D)))
    # requires_grad input is fine (detached)
    c.encode(rand((2, D)).requires_grad_())


def test_none_is_bitwise_exact_including_specials():
    c = make_codec("none", D)
    t = rand((2, 8, D))
    t[0, 0, :6] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45, 3.4e38])
    out = c.decode(c.encode(t), t.shape)
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))
    assert c.lossless


@pytest.mark.parametrize("name,t", list(adversarial().items()))
def test_bf16_error_bound(name, t):
    c = make_codec("bf16", D)
    out = c.decode(c.encode(t), t.shape)
    # exactly torch's round-to-nearest-even bf16 ...
    assert torch.equal(out.view(torch.int32), t.to(torch.bfloat16).float().view(torch.int32))
    # ... hence the stated bound
    err = (out - t).abs()
    assert bool((err <= torch.maximum(t.abs() * 2.0**-8, torch.full_like(t, 2.0**-134))).all())


def test_bf16_carries_non_finite():
    c = make_codec("bf16", D)
    t = rand((1, D))
    t[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    out = c.decode(c.encode(t), t.shape)
    assert math.isnan(out[0, 0]) and out[0, 1] == math.inf and out[0, 2] == -math.inf


@pytest.mark.parametrize("spec", ["int8", "int8:zstd=0"])
@pytest.mark.parametrize("name,t", list(adversarial().items()))
def test_int8_error_bound(spec, name, t):
    c = make_codec(spec, D)
    p = c.encode(t)
    out = c.decode(p, t.shape)
    x = t.view(-1, D)
    s = int8_steps(p, x.shape[0])
    absmax = x.abs().amax(1)
    # the step is rowabsmax/127 rounded up (never clips), by at most a float32 ulp
    assert bool((s.double() * 127 >= absmax.double()).all())
    assert bool((s.double() <= absmax.double() / 127 * (1 + 2.0**-22) + 2.0**-149).all())
    err = (out.view(-1, D) - x).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 2.0**-15)).all()), float((err / s[:, None]).max())
    assert bool((out.view(-1, D)[absmax == 0] == 0).all())   # zero rows exact


@pytest.mark.parametrize("spec", ["int4", "int4:zstd=1", "int4:group=16", "int4:group=64"])
@pytest.mark.parametrize("name,t", list(adversarial(D).items()) + [("ragged_d40", rand((3, 5, 40), seed=9))])
def test_int4_error_bound(spec, name, t):
    d = t.shape[-1]
    c = make_codec(spec, d)
    p = c.encode(t)
    out = c.decode(p, t.shape)
    x = torch.nn.functional.pad(t.reshape(-1, d), (0, c.padded - d))
    xg = x.view(x.shape[0], c.groups, c.group)
    s = int4_steps(p, c)
    absmax = xg.abs().amax(-1)
    assert bool((s.double() * 7 >= absmax.double()).all())
    assert bool((s.double() <= absmax.double() / 7 * (1 + 2.0**-7) + 2.0**-133).all())
    outg = torch.nn.functional.pad(out.reshape(-1, d), (0, c.padded - d)).view_as(xg)
    err = (outg - xg).abs()
    assert bool((err <= s[..., None] / 2 * (1 + 2.0**-20)).all()), float((err / s[..., None]).max())
    assert bool((outg[absmax == 0] == 0).all())


def _absmax_values(n: int, seed: int = 5) -> np.ndarray:
    """float32 absmax values: random over the whole range, bf16 values that are
    exact multiples of 7 and of 127 (exact quotients: where a quotient one ulp
    off crosses a rounding boundary), subnormal, tiny, zero, huge."""
    g = gen(seed)
    rnd = torch.rand(n, generator=g) * 10.0 ** torch.randint(-37, 37, (n,), generator=g).float()
    scale = 2.0 ** torch.randint(-100, 100, (n,), generator=g).float()
    m7 = (torch.randint(1, 1 << 12, (n,), generator=g).float() * 7 * scale).bfloat16().float()
    m127 = (torch.randint(1, 1 << 10, (n,), generator=g).float() * 127 * scale).bfloat16().float()
    m127f = torch.randint(1, 1 << 16, (n,), generator=g).float() * 127 * scale      # float32-exact multiples
    special = torch.tensor([0.0, 1e-45, 3e-45, 1e-40, 1.1754942e-38, 1.0, 7.0, 127.0, 3.0e38, 3.4028235e38])
    v = torch.cat([rnd, m7, m127, m127f, special]).numpy()
    return v[np.isfinite(v)].astype(np.float32)


def _ceil_step_reference(absmax: np.ndarray, qmax: int, bf16: bool) -> np.ndarray:
    """The smallest float32 (or bfloat16, as float32) s with qmax * s >= absmax:
    absmax / qmax correctly rounded (float64), then rounded up. Products of a
    float32 and qmax are exact in float64, so the checks below are exact."""
    a = absmax.astype(np.float64)
    s = (a / qmax).astype(np.float32)
    s = np.where(s.astype(np.float64) * qmax < a, np.nextafter(s, np.float32(np.inf)), s)
    if bf16:
        u = s.view(np.uint32)
        s = ((u >> 16) + ((u & 0xFFFF) != 0)).astype(np.uint32) << 16
        s = s.view(np.float32)
        lower = (s.view(np.uint32) - (1 << 16)).view(np.float32)
    else:
        lower = np.nextafter(s, np.float32(0))
    s64, lower64 = s.astype(np.float64), lower.astype(np.float64)
    assert (s64 * qmax >= a).all()                                     # never clips
    assert ((s == 0) | (lower64 * qmax < a)).all()                      # and is the smallest such
    return s


@pytest.mark.parametrize("emulate_cuda", [False, True], ids=["cpu", "cuda-scalar-division"])
@pytest.mark.parametrize("spec", ["int8", "int8:zstd=0", "int4", "int4:group=2"])
def test_steps_are_the_correctly_rounded_quotient_rounded_up(spec, emulate_cuda):
    """The step each codec writes is absmax/qmax correctly rounded and rounded
    up (float32 for int8, bfloat16 for int4), also with divisions by a Python
    number done as CUDA does them (``a * fp32(1/b)``, one ulp off at times):
    the codecs divide by a tensor on the data's device, so the GPU writes the
    bytes the CPU does (a division by ``qmax`` as a number fails here for
    int4). For int8 the emulated case passes even with such a division:
    ``a * fp32(1/127)`` only ever comes out low, and the step's upward
    correction repairs it; ``test_encode_does_no_division_by_a_python_number``
    is what guards int8."""
    from crucible.testing.cuda_division import CudaScalarDivision

    c = make_codec(spec, D)
    vals = _absmax_values(4000)
    if c.kind == "int8":
        x = torch.zeros(len(vals), D)
        x[:, 0] = torch.from_numpy(vals)
        x[:, 1] = -x[:, 0] * 0.5
        qmax, rows, bf16 = 127, len(vals), False
    else:
        vals = vals[: len(vals) // c.groups * c.groups]
        x = torch.zeros(len(vals) // c.groups, c.groups, c.group)
        x[:, :, 0] = -torch.from_numpy(vals).view(-1, c.groups)      # the absmax of each group, negative
        x = x.view(-1, D)
        qmax, rows, bf16 = 7, x.shape[0], True
    want = _ceil_step_reference(vals, qmax, bf16)
    if emulate_cuda:
        with CudaScalarDivision():
            p = c.encode(x)
        assert p == c.encode(x)
    else:
        p = c.encode(x)
    got = (int8_steps(p, rows) if c.kind == "int8" else int4_steps(p, c)).numpy().reshape(-1)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, [(float(vals[i]), float(got[i]), float(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("spec", ["int8", "int8:zstd=0", "int4", "int4:zstd=1"])
def test_encode_does_no_division_by_a_python_number(spec):
    """Nothing in encode divides by a Python number (CUDA would compute it as
    a reciprocal multiplication), for float32 and bfloat16 input."""
    from crucible.testing.cuda_division import CudaScalarDivision

    c = make_codec(spec, D)
    for dtype in (torch.float32, torch.bfloat16):
        x = (rand((4, 16, D), seed=11) * 3).to(dtype)
        with CudaScalarDivision() as mode:
            p = c.encode(x)
        assert mode.count == 0
        assert p == c.encode(x)


@pytest.mark.parametrize("spec", ["int8", "int4", "subspace"])
def test_lossy_codecs_refuse_non_finite_input(spec):
    c = make_codec(spec, D)
    for bad in (math.nan, math.inf, -math.inf):
        t = rand((2, D))
        t[1, 5] = bad
        with pytest.raises(CodecError, match="finite"):
            c.encode(t)


def test_subspace_fp16_overflow_refused():
    c = make_codec("subspace:dtype=fp16", D)
    P = c.basis()
    with pytest.raises(CodecError, match="finite"):
        c.encode(torch.full((1, c.rank), 1e6) @ P.T)


# ------------------------------------------------------------------- subspace

def test_projection_orthonormal_deterministic():
    P = projection(256, 16, seed=7)
    assert P.shape == (256, 16) and P.dtype == torch.float32 and P.is_contiguous()
    assert torch.allclose(P.T @ P, torch.eye(16), atol=1e-6)
    assert torch.equal(P, projection(256, 16, seed=7))
    assert not torch.allclose(P, projection(256, 16, seed=8))
    P.zero_()                                     # callers get a copy
    assert projection(256, 16, seed=7).abs().sum() > 0
    with pytest.raises(ValueError):
        projection(16, 17)
    with pytest.raises(ValueError):
        projection(16, 0)


def test_model_uses_the_codec_basis():
    """The model constrains its residual stream with the very basis the codec uses."""
    from crucible.config import Config
    from crucible.model import build_stage

    cfg = Config.load(None, ["job.stages=2", "model.n_layer=2", "model.d_model=64", "model.n_head=2",
                             "model.subspace_rank=8", "model.subspace_token_shift=0", "train.seq_len=16"])
    stage = build_stage(cfg, 0, 2)
    assert torch.equal(stage.subspace, projection(64, 8, seed=cfg.train.seed))
    assert stage.shift is None and not build_stage(cfg, 1, 2).needs_tokens
    h = stage(torch.randint(0, 256, (2, 16)))
    P = projection(64, 8, seed=cfg.train.seed)
    assert float((h - (h @ P) @ P.T).abs().max()) < 1e-4


def test_token_shift_model_through_the_codec_matches_the_unsplit_model():
    """With the fixed token shift (outside span(P)) the boundary carries only the
    subspace part; the next stage rebuilds the rest from the token ids, so the
    split model with the fp32 subspace codec computes what one stage computes."""
    from crucible.config import Config
    from crucible.model import build_stage, tokens_needed

    ov = ["model.n_layer=4", "model.d_model=64", "model.n_head=2", "model.subspace_rank=8",
          "model.subspace_token_shift=0.1", "train.seq_len=16"]
    cfg2 = Config.load(None, ov + ["job.stages=2"])
    cfg1 = Config.load(None, ov + ["job.stages=1"])
    assert tokens_needed(cfg2)
    s0, s1, whole = build_stage(cfg2, 0, 2), build_stage(cfg2, 1, 2), build_stage(cfg1, 0, 1)
    assert s1.needs_tokens and not s0.needs_tokens
    P = projection(64, 8, seed=cfg2.train.seed)
    assert float((s0.shift @ P).abs().max()) < 1e-6          # the shift is outside span(P)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    h = s0(x)
    assert float((h - s0.shift[x] - ((h - s0.shift[x]) @ P) @ P.T).abs().max()) < 1e-5
    assert c_out_of_span(h, P) > 0.5                        # so the boundary tensor is NOT in span(P) ...
    codec = make_codec("subspace:rank=8,dtype=fp32", 64, seed=cfg2.train.seed)
    xin = codec.decode(codec.encode(h), h.shape).requires_grad_()   # ... and the codec keeps only s
    loss = s1.loss(s1(xin, tokens=x), y)
    loss.backward()
    h.backward(codec.decode(codec.encode(xin.grad), xin.shape))
    ref = whole.loss(whole(x), y)
    ref.backward()
    assert abs(float(loss) - float(ref)) < 1e-5
    named = dict(whole.named_parameters())
    for name, p in list(s0.named_parameters()) + list(s1.named_parameters()):
        assert torch.allclose(p.grad, named[name].grad, atol=1e-5 * float(named[name].grad.abs().max()) + 1e-9), name
    with pytest.raises(ValueError, match="token ids"):
        s1(xin.detach())


def c_out_of_span(h, P):
    return float(torch.linalg.vector_norm(h - (h @ P) @ P.T) / torch.linalg.vector_norm(h))


@pytest.mark.parametrize("dtype,u", [("bf16", 2.0**-8), ("fp16", 2.0**-11), ("fp32", 2.0**-24)])
def test_subspace_exact_in_span(dtype, u):
    c = make_codec(f"subspace:rank=8,dtype={dtype}", D, seed=5)
    P = projection(D, 8, seed=5)
    coef = rand((3, 7, 8), seed=4) * torch.logspace(-3, 3, 7).view(1, 7, 1)
    t = coef @ P.T
    out = c.decode(c.encode(t), t.shape)
    err = torch.linalg.vector_norm(out - t, dim=-1)
    assert bool((err <= (u + 1e-5) * torch.linalg.vector_norm(t, dim=-1)).all())
    assert c.out_of_span(t) < 1e-5


def test_subspace_out_of_span_is_projected():
    c = make_codec("subspace:rank=8,dtype=fp32", D, seed=5)
    P = c.basis()
    t = rand((4, D), seed=6)
    out = c.decode(c.encode(t), t.shape)
    assert torch.allclose(out, (t @ P) @ P.T, atol=1e-5)
    expect = float(torch.linalg.vector_norm(t - (t @ P) @ P.T) / torch.linalg.vector_norm(t))
    assert c.out_of_span(t) == pytest.approx(expect, rel=1e-5)
    assert c.out_of_span(t) > 0.5     # a random tensor is mostly outside an 8-of-64 subspace


def test_subspace_default_rank_and_shared_basis():
    c = make_codec("subspace", 256, seed=11)
    assert c.rank == 16 and c.dtype == "bf16"
    assert make_codec("subspace", 8).rank == 1
    # two boundaries (or a skipped stage) of the same run use the same basis
    c2 = make_codec("subspace", 256, seed=11)
    t = rand((2, 16)) @ c.basis().T
    assert torch.equal(c2.decode(c.encode(t), t.shape), c.decode(c.encode(t), t.shape))


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_subspace_straight_through_gradient_is_exact(dtype, tol):
    """A sender whose output lives in span(P) gets the true gradient through the codec."""
    d, r = 32, 4
    P = projection(d, r, seed=2)
    fwd = make_codec(f"subspace:rank={r},dtype={dtype}", d, seed=2)
    bwd = make_codec(f"subspace:rank={r},dtype={dtype}", d, seed=2)
    h = rand((3, 5, d), seed=3)
    W1 = (rand((d, d), seed=4) * 0.3).requires_grad_()
    W2 = (rand((d, d), seed=5) * 0.3).requires_grad_()

    def sender(W):        # a residual write, constrained to span(P)
        return (torch.tanh(h @ W) @ P) @ P.T

    def receiver(x, W):
        return (torch.tanh(x @ W) ** 2).sum()

    # reference: no boundary
    receiver(sender(W1), W2).backward()
    g1_ref, g2_ref = W1.grad.clone(), W2.grad.clone()
    W1.grad = W2.grad = None
    # through the codecs, straight-through
    y = sender(W1)
    x = fwd.decode(fwd.encode(y), y.shape).requires_grad_()
    receiver(x, W2).backward()
    g_hat = bwd.decode(bwd.encode(x.grad), x.shape)
    y.backward(g_hat)
    assert torch.allclose(W1.grad, g1_ref, rtol=tol, atol=tol * g1_ref.abs().max())
    assert torch.allclose(W2.grad, g2_ref, rtol=tol, atol=tol * g2_ref.abs().max())


# ------------------------------------------------------------------- ratios

def test_compression_ratios_4x128x256(capsys):
    shape = (4, 128, 256)
    t = rand(shape, seed=0)
    want = {"none": 0.99, "bf16": 2.5, "int8": 3.8, "int8:zstd=0": 3.9, "int4": 7.0, "int4:zstd=1": 7.0,
            "subspace": 16.0}
    lines = []
    for spec, floor in want.items():
        c = make_codec(spec, 256, seed=0)
        x = t if c.kind != "subspace" else (t @ c.basis()) @ c.basis().T
        p = c.encode(x)
        st = wire_stats(x, p)
        assert st.raw_nbytes == t.numel() * 4 == A.raw_nbytes(shape)
        assert st.wire_nbytes == len(p)           # header and steps included
        lines.append(f"{c.spec:<30} {st.wire_nbytes:>8} B  {st.ratio:6.2f}x")
        assert st.ratio >= floor, lines[-1]
    with capsys.disabled():
        print("\n[4,128,256] fp32 Gaussian, payload incl. header vs raw fp32:\n  " + "\n  ".join(lines))


def test_header_size():
    c = make_codec("none", 256)
    p = c.encode(torch.zeros(4, 128, 256))
    assert read_header(p).header_nbytes == 48 == len(p) - 4 * 128 * 256 * 4


# -------------------------------------------------------------- refusals

@pytest.mark.parametrize("spec", ALL_SPECS)
def test_truncated_and_trailing_refused(spec):
    c = make_codec(spec, D)
    t = rand((2, 8, D))
    p = c.encode(t)
    for cut in (0, 1, 20, 35, 36, 40, 47, len(p) - 1):
        with pytest.raises(CodecError, match="truncated"):
            c.decode(p[:cut], t.shape)
    with pytest.raises(CodecError, match="trailing"):
        c.decode(p + b"\0", t.shape)
    with pytest.raises(CodecError, match="trailing"):
        c.decode(p + p, t.shape)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_garbage_and_corruption_refused(spec):
    c = make_codec(spec, D)
    t = rand((2, 8, D))
    p = c.encode(t)
    rng = np.random.default_rng(0)
    with pytest.raises(CodecError, match="magic"):
        c.decode(rng.integers(0, 256, len(p), dtype=np.uint8).tobytes(), t.shape)
    with pytest.raises(CodecError):
        c.decode(b"", t.shape)
    with pytest.raises(CodecError):
        c.decode("not bytes", t.shape)
    # one flipped bit anywhere after the magic: refused (CRC, version, codec id, ...)
    for pos in (4, 5, 9, 30, 37, 50, len(p) // 2, len(p) - 1):
        bad = bytearray(p)
        bad[pos] ^= 0x10
        with pytest.raises(CodecError):
            c.decode(bytes(bad), t.shape)
    # a valid header (CRC recomputed) over a random body
    junk = rng.integers(0, 256, len(body_of(p)), dtype=np.uint8).tobytes()
    # (for `none` and `subspace` random bytes are mostly valid values: no check)
    if spec.split(":")[0] in ("bf16", "int8", "int4"):
        with pytest.raises(CodecError):
            c.decode(rebuild(p, junk), t.shape)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_wrong_expected_shape_refused(spec):
    c = make_codec(spec, D)
    t = rand((2, 8, D))
    p = c.encode(t)
    for shape in [(8, 2, D), (16, D), (2, 8, D, 1), (2, 9, D), (2, 8, 2 * D)]:
        with pytest.raises(CodecError, match="shape"):
            c.decode(p, shape)
    c.decode(p, [2, 8, D])        # a list is as good as a tuple
    c.decode(p, torch.Size([2, 8, D]))


def test_other_codecs_payload_refused():
    t = rand((2, 8, D))
    codecs = {s: make_codec(s, D, seed=1) for s in ALL_SPECS}
    codecs["subspace:rank=8"] = make_codec("subspace:rank=8", D, seed=1)
    codecs["subspace-seed2"] = make_codec("subspace", D, seed=2)
    payloads = {s: c.encode(t) for s, c in codecs.items()}
    for s, c in codecs.items():
        for s2, p in payloads.items():
            if s2 == s:
                continue
            with pytest.raises(CodecError, match="encoded with"):
                c.decode(p, t.shape)
    # zstd level is encoder-only: peers may differ in it
    p = make_codec("int8:level=9", D).encode(t)
    assert torch.equal(make_codec("int8", D).decode(p, t.shape), make_codec("int8", D).decode(
        make_codec("int8", D).encode(t), t.shape))


def test_d_model_mismatch_refused():
    c = make_codec("int8", D)
    with pytest.raises(CodecError, match="d_model"):
        c.encode(rand((2, D + 1)))
    p = make_codec("int8", D + 1).encode(rand((2, D + 1)))
    with pytest.raises(CodecError, match="d_model"):
        c.decode(p, (2, D + 1))
    with pytest.raises(CodecError, match="dtype"):
        c.encode(torch.zeros(2, D, dtype=torch.int64))
    with pytest.raises(TypeError):
        c.encode(np.zeros((2, D), np.float32))


@pytest.mark.parametrize("shape", [(2, 8, D), (3, D), (0, 4, D)])
def test_int8_without_zstd_round_trip_and_byte_count(shape):
    """int8:zstd=0: the body is the float32 steps (one per row) then the int8
    codes, 1 byte per value; it decodes to what the zstd'd default does, and
    the default's body is that same body in one zstd frame (level 1)."""
    t = rand(shape, seed=4)
    raw_c, z_c = make_codec("int8:zstd=0", D), make_codec("int8", D)
    p, pz = raw_c.encode(t), z_c.encode(t)
    rows = math.prod(shape[:-1])
    h = read_header(p)
    assert h.params == (0, 1, 0) and h.describe() == "int8:zstd=0"
    assert read_header(pz).params == (0, 0, 0) and read_header(pz).describe() == "int8"
    assert len(p) == h.header_nbytes + 4 * rows + rows * D
    body = bytes(body_of(p))
    assert body == int8_raw(pz)
    assert bytes(body_of(pz)) == zstandard.ZstdCompressor(level=1, write_content_size=True,
                                                          write_checksum=False).compress(body)
    x = t.reshape(-1, D)
    step = torch.from_numpy(np.frombuffer(body, np.float32, rows).copy())
    q = torch.from_numpy(np.frombuffer(body, np.int8, rows * D, offset=4 * rows).copy()).view(rows, D)
    assert torch.equal(step, int8_steps(pz, rows))
    assert bool((q.abs() <= 127).all()) and (rows == 0 or int(q.abs().max()) == 127)
    out = raw_c.decode(p, shape)
    assert torch.equal(out, z_c.decode(pz, shape))
    assert torch.equal(out.view(rows, D), q.float() * step[:, None])
    assert bool(((out.view(rows, D) - x).abs() <= step[:, None] / 2 * (1 + 2.0**-15)).all())
    # bfloat16 input: the body of the float32 of the same values
    assert bytes(body_of(raw_c.encode(t.bfloat16()))) == bytes(body_of(raw_c.encode(t.bfloat16().float())))


def test_int8_default_payload_layout_is_unchanged():
    """``int8`` (zstd on by default) writes what it wrote before it had the
    zstd option: header p0 = p1 = p2 = 0, name ``int8``, spec ``int8:level=1``,
    body zstd(steps || codes); ``int8:zstd=1`` is the same codec."""
    t = rand((2, 8, D), seed=6)
    c, c1 = make_codec("int8", D), make_codec("int8:zstd=1", D)
    assert (c.name, c.spec, c.params, c.zstd) == ("int8", "int8:level=1", (0, 0, 0), True)
    assert (c1.name, c1.spec) == (c.name, c.spec)
    p = c.encode(t)
    assert p == c1.encode(t)
    fixed = struct.unpack_from("<4sBBBBIIQQ", p)
    assert fixed[:8] == (b"CRAC", 1, 2, 0, 3, 0, 0, 0)
    raw = zstandard.ZstdDecompressor().decompress(bytes(body_of(p)))
    assert len(raw) == 16 * 4 + 16 * D


@pytest.mark.parametrize("spec", ["int8", "int8:zstd=0"])
def test_int8_bad_steps_and_codes_refused(spec):
    c = make_codec(spec, D)
    t = rand((2, 8, D))
    p = c.encode(t)
    raw = bytearray(int8_raw(p))

    def wrap(b):
        return rebuild(p, zstandard.ZstdCompressor().compress(bytes(b)) if c.zstd else bytes(b))

    for val, what in [(math.nan, "non-finite"), (math.inf, "non-finite"), (-1.0, "negative")]:
        bad = raw.copy()
        struct.pack_into("<f", bad, 4 * 3, val)
        with pytest.raises(CodecError, match=what):
            c.decode(wrap(bad), t.shape)
    bad = raw.copy()
    bad[16 * 4 + 5] = 0x80                          # code -128
    with pytest.raises(CodecError, match="-128"):
        c.decode(wrap(bad), t.shape)
    if not c.zstd:
        # a body of the wrong length (truncated or trailing bytes behind a valid header and CRC)
        for cut in (raw[:-1], raw[:-D], raw + b"\0", raw[:16 * 4], b""):
            with pytest.raises(CodecError, match=f"int8 body is {len(cut)} bytes, 16 float32 steps"):
                c.decode(rebuild(p, cut), t.shape)
        # a zstd frame where raw steps and codes belong: refused by its length
        with pytest.raises(CodecError, match="int8 body is"):
            c.decode(rebuild(p, zstandard.ZstdCompressor().compress(bytes(raw))), t.shape)
        return
    # an invalid zstd frame behind a valid header
    with pytest.raises(CodecError, match="zstd"):
        c.decode(rebuild(p, b"\x28\xb5\x2f\xfd" + b"\0" * 40), t.shape)
    # a frame that declares the wrong size (a hostile one would declare gigabytes)
    with pytest.raises(CodecError, match="declares"):
        c.decode(rebuild(p, zstandard.ZstdCompressor().compress(bytes(raw) + b"\0")), t.shape)
    with pytest.raises(CodecError, match="declares"):
        c.decode(rebuild(p, zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))), t.shape)
    # two frames back to back
    with pytest.raises(CodecError):
        c.decode(rebuild(p, bytes(body_of(p)) * 2), t.shape)


@pytest.mark.parametrize("spec", ["int4", "int4:zstd=1"])
def test_int4_bad_steps_and_codes_refused(spec):
    c = make_codec(spec, D)
    t = rand((2, 8, D))
    p = c.encode(t)
    body = bytes(body_of(p))
    raw = bytearray(zstandard.ZstdDecompressor().decompress(body) if c.zstd else body)

    def wrap(b):
        return rebuild(p, zstandard.ZstdCompressor().compress(bytes(b)) if c.zstd else bytes(b))

    for bits, what in [(0x7FC0, "non-finite"), (0x7F80, "non-finite"), (0xBF80, "negative")]:
        bad = raw.copy()
        struct.pack_into("<H", bad, 2 * 5, bits)    # NaN, inf, -1.0 as bf16
        with pytest.raises(CodecError, match=what):
            c.decode(wrap(bad), t.shape)
    for at, byte in [(3, 0x80), (len(raw) - 2 * 16 * c.groups - 1, 0x08)]:   # low, then high nibble 0 = code -8
        bad = raw.copy()
        bad[2 * 16 * c.groups + at] = byte
        with pytest.raises(CodecError, match="-8"):
            c.decode(wrap(bad), t.shape)
    if not c.zstd:
        with pytest.raises(CodecError, match="body"):
            c.decode(rebuild(p, body[:-2]), t.shape)


@pytest.mark.parametrize("dtype,fmt,values", [("bf16", "<H", (0x7FC0, 0x7F80, 0xFF80)),
                                               ("fp16", "<e", (math.nan, math.inf, -math.inf)),
                                               ("fp32", "<f", (math.nan, math.inf, -math.inf))])
def test_subspace_non_finite_coefficients_refused(dtype, fmt, values):
    c = make_codec(f"subspace:dtype={dtype}", D)
    t = rand((2, 8, D))
    p = c.encode(t)
    for v in values:
        bad = bytearray(body_of(p))
        struct.pack_into(fmt, bad, 3 * struct.calcsize(fmt), v)
        with pytest.raises(CodecError, match="non-finite"):
            c.decode(rebuild(p, bad), t.shape)
    c.decode(p, t.shape)


def test_zero_nibble_scan_matches_a_byte_by_byte_scan():
    # int4's decode scans 8 bytes at a time: every byte value at every
    # position, in arrays whose length and start are not multiples of 8
    from crucible.compress.activations import _has_zero_nibble
    for b in range(256):
        want = (b & 0x0F) == 0 or (b & 0xF0) == 0
        for n in (1, 8, 11, 17):
            for pos in range(n):
                a = np.full(n + 1, 0x11, np.uint8)
                a[1 + pos] = b
                assert _has_zero_nibble(a[1:]) == want, (b, n, pos)
    assert not _has_zero_nibble(np.zeros(0, np.uint8))


def test_header_fields_refused():
    c = make_codec("int4", D)
    t = rand((2, 8, D))
    p = c.encode(t)
    with pytest.raises(CodecError, match="codec id"):
        c.decode(rebuild(p, body_of(p), codec_id=9), t.shape)
    with pytest.raises(CodecError, match="encoded with 'int4:group=64"):
        c.decode(rebuild(p, body_of(p), params=(64, 0, 0)), t.shape)
    bad = bytearray(p)
    bad[4] = 2                                      # version
    with pytest.raises(CodecError, match="version"):
        c.decode(bytes(bad), t.shape)
    bad = bytearray(p)
    bad[7] = 0                                      # ndim 0
    with pytest.raises(CodecError, match="ndim"):
        c.decode(bytes(bad), t.shape)


# ------------------------------------------------------------------- specs

def test_spec_parsing_and_names():
    assert make_codec("int4:group=64", D).name == "int4:group=64,zstd=0"
    assert make_codec(" INT4 : Group = 64 , zstd = yes ", D).name == "int4:group=64,zstd=1"
    assert make_codec("subspace:rank=16", 256, seed=3).name == "subspace:rank=16,dtype=bf16,seed=3"
    assert make_codec("none", D).name == "none"
    assert make_codec("bf16", D).name == "bf16"
    assert make_codec("int8:level=3", D).spec == "int8:level=3"
    assert make_codec("int8:zstd=0", D).name == "int8:zstd=0"
    assert make_codec("int8:zstd=no,level=3", D).spec == "int8:zstd=0,level=3"
    assert make_codec("INT8 : ZSTD = on", D).name == "int8"
    assert make_codec("int4:", D).group == 32
    for spec in ["none", "bf16:level=-3", "int8", "int8:zstd=0", "int4:group=16,zstd=1,level=5",
                 "subspace:rank=4,dtype=fp16"]:
        c = make_codec(spec, D, seed=9)
        c2 = make_codec(c.spec, D, seed=9)
        assert (c2.name, c2.spec) == (c.name, c.spec)
        assert c.kind == spec.split(":")[0]


@pytest.mark.parametrize("spec,match", [
    ("lz4", "unknown activation codec 'lz4'; valid codecs: none, bf16, int8, int4, subspace"),
    ("", "unknown activation codec"),
    ("int4:grp=64", "unknown parameter 'grp' for codec 'int4'; valid parameters: group, zstd, level"),
    ("none:level=1", "unknown parameter 'level' for codec 'none'"),
    ("subspace:group=4", "valid parameters: rank, dtype"),
    ("int4:group", "needs a value"),
    ("int4:group=", "needs a value"),
    ("int4:group=abc", "not an integer"),
    ("int4:group=33", "even"),
    ("int4:group=0", "even"),
    ("int4:group=32,group=64", "twice"),
    ("int4:zstd=maybe", "0/1"),
    ("int8:zstd=2", "parameter zstd='2' is not 0/1/true/false"),
    ("int8:zstd=", "needs a value"),
    ("int8:group=32", "unknown parameter 'group' for codec 'int8'; valid parameters: zstd, level"),
    ("bf16:level=99", "level"),
    ("subspace:rank=0", "rank"),
    ("subspace:rank=65", "rank"),
    ("subspace:dtype=int8", "valid values: bf16, fp16, fp32"),
])
def test_bad_specs_refused(spec, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        make_codec(spec, D)


def test_bad_constructor_args():
    with pytest.raises(ValueError):
        make_codec("int8", 0)
    with pytest.raises(ValueError):
        make_codec("subspace", D, seed=-(1 << 64))


# --------------------------------------------------------------- misc

def test_threads_share_a_codec():
    c = make_codec("int4:zstd=1", D)
    t = rand((4, 16, D))
    ref = c.decode(c.encode(t), t.shape)
    bad = []

    def work():
        for _ in range(20):
            if not torch.equal(c.decode(c.encode(t), t.shape), ref):
                bad.append(1)

    ths = [threading.Thread(target=work) for _ in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    assert not bad


def test_decode_device_argument():
    c = make_codec("subspace", D)
    t = rand((2, c.rank)) @ c.basis().T
    out = c.decode(c.encode(t), t.shape, device="cpu")
    assert out.device.type == "cpu"
