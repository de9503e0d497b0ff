"""GPU tests of the Triton norm / quant kernels (`mxfuse/ops/triton_norm_quant.py`).

What is asserted (docs/design.md "Fidelity"):

- fused vs. unfused project ops on the GPU: BITWISE equal (codes viewed as uint8, scales,
  residual_out, y), plain and fused-add, both scale layouts, emit_y, round_sum,
  weight_offset; on zeros, FLT_MIN blocks, 1 + w = 2**-8, huge values, NaN / Inf rows and
  a dominant block.
- batch invariance: a row gives the same bits inside batches of M = 1 .. 16384.
- quant vs. the CPU reference: bitwise on finite inputs (NaN positions and +-448 for Inf
  on non-finite ones).
- norm vs. the CPU reference: residual_out bitwise; y within ONE ulp of x's dtype
  (the two values are equal or adjacent representable numbers), and at most 2% of the
  elements differ (measured on random data: well under 1%, see the printed fractions).
  The only difference is the summation order of the sum of squares.

All GPU tests are marked `gpu` and skipped without CUDA; the module is safe to collect
on a CPU-only machine. The ops are called through `torch.ops.mxfuse.*`.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

import mxfuse.ops  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops import reference

HAS_CUDA = torch.cuda.is_available()
# MXFUSE_TEST_DEVICE=cpu runs the same assertions on the CPU reference impls: a self-check
# of this file's logic on a machine without a GPU (it proves nothing about the kernels).
DEVICE = os.environ.get("MXFUSE_TEST_DEVICE", "cuda")


def gpu_test(fn):
    """Mark a test `gpu` and skip it without CUDA."""
    skip = DEVICE == "cuda" and not HAS_CUDA
    return pytest.mark.gpu(pytest.mark.skipif(skip, reason="needs a CUDA GPU")(fn))


def kparams(*ks):
    """K values; with pytest-xdist each K is its own group (one worker compiles one K's kernels)."""
    if importlib.util.find_spec("xdist") is None:
        return list(ks)
    return [pytest.param(k, marks=pytest.mark.xdist_group(f"k{k}")) for k in ks]


ops = torch.ops.mxfuse
EPS = 1e-6
FLT_MIN = torch.finfo(torch.float32).tiny


def kernel_variants():
    """tools/kernel_variants.py (the benchmarked configs), imported from tools/."""
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import kernel_variants

    return kernel_variants


# ------------------------------------------------------------------ inputs

N_KINDS = 8


def special_rows(m: int, k: int, dtype=torch.bfloat16, seed: int = 0, device=DEVICE, start_kind: int = 0):
    """x, residual `[m, k]` whose row i is of kind (start_kind + i) % N_KINDS.

    0 random, 1 all zero (x and residual), 2 a block of +-FLT_MIN (and a few fp32
    subnormals in the residual), 3 huge but finite squares (x ~ 1e18), 4 overflowing
    squares (x ~ 1e38; some round to Inf in bf16), 5 one NaN, 6 one +Inf and one -Inf,
    7 one dominant block (1e4) over tiny values (1e-3).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device)
    r = torch.randn(m, k, generator=g, device=device)
    kinds = (torch.arange(m, device=device) + start_kind) % N_KINDS
    b0 = 32 if k >= 64 else 0
    blk = slice(b0, b0 + 32)

    def rows(kind):
        return (kinds == kind).nonzero().flatten()

    x[rows(1)] = 0.0
    r[rows(1)] = 0.0
    i2 = rows(2)
    x[i2, blk] = FLT_MIN * torch.sign(x[i2, blk])
    r[i2, blk] = 0.0
    r[i2, b0 : b0 + 4] = FLT_MIN / 8
    x[rows(3)] *= 1e18
    x[rows(4)] *= 1e38
    r[rows(4)] = 0.0
    x[rows(5), k // 2] = float("nan")
    x[rows(6), 3] = float("inf")
    x[rows(6), k - 1] = float("-inf")
    i7 = rows(7)
    x[i7] *= 1e-3
    r[i7] *= 1e-3
    x[i7, blk] *= 1e7
    return x.to(dtype), r.to(dtype)


def gemma_weight(k: int, dtype=torch.bfloat16, seed: int = 1, device=DEVICE):
    """Random Gemma weight with a block where 1 + w = 2**-8 and one where 1 + w = 0."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = 0.5 * torch.randn(k, generator=g)
    w[:32] = -1.0 + 2.0**-8
    if k >= 96:
        w[64:96] = -1.0
    return w.to(device=device, dtype=dtype)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    a8, b8 = u8(a).contiguous(), u8(b).contiguous()
    if a8.is_floating_point():  # compare bits (NaN == NaN, -0 != +0)
        a8 = a8.view(torch.int16 if a8.element_size() == 2 else torch.int32)
        b8 = b8.view(torch.int16 if b8.element_size() == 2 else torch.int32)
    if not torch.equal(a8, b8):
        bad = (a8 != b8).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} of {a8.numel()} elements differ, first at {bad[:5].tolist()}")


def unfused(x, r, w, swizzled, round_sum=False):
    """Norm op then quant op (the graph before the rewrite)."""
    if r is None:
        y = ops.gemma_rmsnorm(x, w, EPS)
        res = None
    else:
        y, res = ops.gemma_fused_add_rmsnorm(x, r, w, EPS)
        if round_sum:  # Hugging Face order: norm of the dtype-rounded sum
            y = ops.gemma_rmsnorm(res, w, EPS)
    codes, scales = ops.mxfp8_quantize(y, swizzled)
    return codes, scales, res, y


def fused(x, r, w, swizzled, emit_y=True, round_sum=False, weight_offset=1.0):
    if r is None:
        codes, scales, y = ops.gemma_rmsnorm_mxfp8(x, w, EPS, swizzled, emit_y, weight_offset)
        res = None
    else:
        codes, scales, res, y = ops.gemma_fused_add_rmsnorm_mxfp8(
            x, r, w, EPS, swizzled, emit_y, round_sum, weight_offset
        )
    return codes, scales, res, y


def compare_all(a, b, what):
    names = ("codes", "scales", "residual_out", "y")
    for name, ta, tb in zip(names, a, b):
        if ta is None or tb is None:
            assert ta is None and tb is None, f"{what} {name}"
            continue
        assert_bitwise(ta, tb, f"{what} {name}")


# ------------------------------------------------------------------ fused == unfused


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("has_res", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("m", [0, 1, 3, 37, 4096])
@pytest.mark.parametrize("k", kparams(64, 96, 160, 3072, 6144))
def test_fused_equals_unfused(k, m, has_res, swizzled):
    x, r = special_rows(m, k, seed=k + m)
    r = r if has_res else None
    w = gemma_weight(k)
    ref = unfused(x, r, w, swizzled)
    out = fused(x, r, w, swizzled, emit_y=True)
    compare_all(out, ref, f"K={k} M={m}")
    # emit_y=False: same codes / scales / residual, y is empty
    out2 = fused(x, r, w, swizzled, emit_y=False)
    compare_all(out2[:3], ref[:3], f"K={k} M={m} emit_y=False")
    assert out2[3].numel() == 0
    # the fused op's codes are the quant op applied to the fused op's y
    compare_all(ops.mxfp8_quantize(out[3], swizzled), ref[:2], f"K={k} M={m} quant(y_fused)")
    if has_res:
        ref_rs = unfused(x, r, w, swizzled, round_sum=True)
        out_rs = fused(x, r, w, swizzled, emit_y=True, round_sum=True)
        compare_all(out_rs, ref_rs, f"K={k} M={m} round_sum")
    # weight_offset: (w.f32 + 1) supplied as an fp32 weight with offset 0 gives the same bits
    w1 = w.float() + 1.0
    out_wo = fused(x, r, w1, swizzled, emit_y=True, weight_offset=0.0)
    compare_all(out_wo, ref, f"K={k} M={m} weight_offset=0")
    if swizzled and m:
        s = k // 32
        assert_bitwise(ops.mxfp8_swizzle_scales(ops.mxfp8_quantize(ref[3], False)[1]), ref[1], "swizzle op")
        assert out[1].shape == ((m + 127) // 128 * 128, (s + 3) // 4 * 4)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", kparams(160, 3072))
def test_fused_equals_unfused_dtypes_and_weights(k, dtype):
    """fp16 activations, fp32 and fp16 weights; 3-D input; a non-contiguous row slice."""
    x, r = special_rows(37, k, dtype=dtype, seed=7)
    for wdt in (torch.float32, dtype):
        w = gemma_weight(k, dtype=wdt)
        for swz in (False, True):
            compare_all(fused(x, r, w, swz), unfused(x, r, w, swz), f"{dtype} w={wdt} swz={swz}")
            compare_all(fused(x, None, w, swz), unfused(x, None, w, swz), f"{dtype} plain w={wdt} swz={swz}")
    # 3-D [2, 5, K] (rows flattened) agrees with the 2-D op on the same rows
    x3, r3 = special_rows(10, k, dtype=dtype, seed=3)
    w = gemma_weight(k, dtype=dtype)
    for swz in (False, True):
        a = fused(x3.view(2, 5, k), r3.view(2, 5, k), w, swz)
        b = fused(x3, r3, w, swz)
        assert a[0].shape == (2, 5, k) and a[2].shape == (2, 5, k) and a[3].shape == (2, 5, k)
        assert a[1].shape == ((128, (k // 32 + 3) // 4 * 4) if swz else (2, 5, k // 32))
        compare_all([t.reshape(b_.shape) for t, b_ in zip(a, b)], b, f"3-D swz={swz}")
        u = unfused(x3.view(2, 5, k), r3.view(2, 5, k), w, swz)
        compare_all(a, u, f"3-D fused vs unfused swz={swz}")
    # non-contiguous rows: x[:, :K] of a wider tensor (row stride K + 64)
    wide_x, wide_r = special_rows(37, k + 64, dtype=dtype, seed=11)
    xs, rs = wide_x[:, :k], wide_r[:, 16 : 16 + k]
    assert not xs.is_contiguous() and xs.stride(-1) == 1
    for swz in (False, True):
        a = fused(xs, rs, w, swz)
        b = fused(xs.contiguous(), rs.contiguous(), w, swz)
        compare_all(a, b, f"row slice swz={swz}")
        compare_all(a, unfused(xs, rs, w, swz), f"row slice fused vs unfused swz={swz}")
        assert_bitwise(ops.mxfp8_quantize(xs, swz)[1], ops.mxfp8_quantize(xs.contiguous(), swz)[1], "quant row slice")


# ------------------------------------------------------------------ batch invariance

PROBES = 16


def _row_outputs(out, rows, m, k, swizzled):
    """Per-row (codes, row-major scales, residual, y) of the given rows of a batch result."""
    codes, scales, res, y = out
    s = k // 32
    if swizzled:
        scales = reference.unswizzle_scales(scales, m, s)
    return tuple(None if t is None else t[rows] for t in (codes, scales, res, y))


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("has_res", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("k", kparams(6144, 3072, 160))
def test_batch_invariance(k, has_res, swizzled):
    probes_x, probes_r = special_rows(PROBES, k, seed=99)
    w = gemma_weight(k)
    # reference: each probe row alone (M = 1)
    alone = []
    for i in range(PROBES):
        o = fused(probes_x[i : i + 1], probes_r[i : i + 1] if has_res else None, w, swizzled)
        alone.append(_row_outputs(o, slice(0, 1), 1, k, swizzled))
    alone = [torch.cat(ts) if ts[0] is not None else None for ts in zip(*alone)]
    for m in (1, 7, 64, 257, 4096, 16384):
        n = min(m, PROBES)
        fill_x, fill_r = special_rows(m, k, seed=m, start_kind=3)
        # the probes sit at the END of the batch, so their row index inside a 128-row
        # scale tile (and inside a multi-row program tile) changes with M
        fill_x[m - n :] = probes_x[:n]
        fill_r[m - n :] = probes_r[:n]
        r = fill_r if has_res else None
        rows = slice(m - n, m)
        out = fused(fill_x, r, w, swizzled)
        got = _row_outputs(out, rows, m, k, swizzled)
        exp = tuple(None if t is None else t[:n] for t in alone)
        compare_all(got, exp, f"K={k} M={m} batch vs alone")
        # unfused at this M: bitwise equal to fused at this M
        compare_all(out, unfused(fill_x, r, w, swizzled), f"K={k} M={m} fused vs unfused")
        del out, fill_x, fill_r


# ------------------------------------------------------------------ vs the CPU reference


def quant_inputs(m, k, dtype, seed=0, device=DEVICE):
    """Finite values exercising the scale formula: zeros, FLT_MIN and subnormals, exact
    powers of two and 448 * 2**e boundaries, the dtype's largest values, random scales."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(
        torch.randint(-20, 20, (m, k // 32, 1), generator=g).float()
    ).repeat_interleave(32, 1).reshape(m, k)
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    nb = k // 32
    for i in range(m):
        b = (i * 7) % nb
        c = slice(32 * b, 32 * b + 32)
        kind = i % 7
        if kind == 0:
            x[i, c] = 0.0
        elif kind == 1:
            x[i, c] = tiny * torch.randint(-3, 4, (32,), generator=g).float()
            x[i, c.start] = tiny / 4  # subnormal in the input dtype
        elif kind == 2:
            x[i, c] = 448.0 * 2.0 ** torch.randint(-10, 10, (1,), generator=g).item()  # amax exactly at a boundary
        elif kind == 3:
            e = 2.0 ** torch.randint(-10, 10, (1,), generator=g).item()
            x[i, c] = torch.rand(32, generator=g) * 448.0 * e
            x[i, c.start] = 449.0 * e  # just above the boundary
        elif kind == 4:
            x[i, c] = fmax * (torch.rand(32, generator=g) * 2 - 1)
            x[i, c.start] = -fmax
        elif kind == 5:
            x[i, c] = 2.0 ** torch.randint(-30, 30, (32,), generator=g).float()
    return x.clamp(-fmax, fmax).to(dtype).to(device)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m,k", [(1, 64), (37, 160), (300, 6144), (129, 96)])
def test_quant_matches_cpu_reference(m, k, dtype):
    x = quant_inputs(m, k, dtype, seed=m * k)
    for swz in (False, True):
        codes, scales = ops.mxfp8_quantize(x, swz)
        rc, rs = ops.mxfp8_quantize(x.cpu(), swz)
        assert_bitwise(codes.cpu(), rc, f"codes swz={swz}")
        assert_bitwise(scales.cpu(), rs, f"scales swz={swz}")
    # non-finite: NaN ignored by the amax and encoded as NaN; +-Inf encoded as +-448
    x[0, 5] = float("nan")
    x[-1, 7] = float("inf")
    x[-1, 40 % k] = float("-inf")
    codes, scales = ops.mxfp8_quantize(x, False)
    rc, rs = ops.mxfp8_quantize(x.cpu(), False)
    assert_bitwise(scales.cpu(), rs, "scales non-finite")
    cf, rf = codes.cpu().float(), rc.float()
    assert torch.equal(cf.isnan(), rf.isnan())
    fin = ~rf.isnan()
    assert torch.equal(u8(codes.cpu())[fin], u8(rc)[fin])
    assert cf[-1, 7] == 448.0 and cf[-1, 40 % k] == -448.0


@gpu_test
@pytest.mark.parametrize("m,s", [(1, 1), (2, 192), (37, 2), (128, 3), (300, 5), (129, 192), (130, 201), (4096, 96)])
def test_swizzle_matches_cpu_reference(m, s):
    sc = torch.randint(0, 255, (m, s), dtype=torch.uint8, device=DEVICE)
    out = ops.mxfp8_swizzle_scales(sc)
    assert_bitwise(out.cpu(), reference.swizzle_scales(sc.cpu()), "swizzle")
    assert_bitwise(reference.unswizzle_scales(out, m, s), sc, "unswizzle")


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in representable steps between same-dtype 16-bit floats (finite, same sign or zero)."""
    ia = a.contiguous().view(torch.int16).to(torch.int32)
    ib = b.contiguous().view(torch.int16).to(torch.int32)
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


NORM_MAX_ULP = 1
NORM_MAX_DIFF_FRACTION = 0.02


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k", kparams(64, 160, 3072, 6144))
def test_norm_matches_cpu_reference(k, dtype):
    """Triton norm vs. the CPU reference: y within 1 ulp of dtype, <= 2% of elements differ."""
    m = 64
    x, r = special_rows(m, k, dtype=dtype, seed=5)
    if dtype == torch.float16:  # keep the fp16 data finite except the planted NaN / Inf rows
        x = torch.where(x.abs() > 1e4, x.sign() * 1e4, x)
    w = gemma_weight(k, dtype=dtype)
    y, res = ops.gemma_fused_add_rmsnorm(x, r, w, EPS)
    ry, rres = ops.gemma_fused_add_rmsnorm(x.cpu(), r.cpu(), w.cpu(), EPS)
    # residual_out: bitwise except NaN payloads (the GPU add returns the canonical NaN)
    nan = rres.isnan()
    assert torch.equal(res.cpu().isnan(), nan)
    assert_bitwise(res.cpu()[~nan], rres[~nan], "residual_out")
    yp = ops.gemma_rmsnorm(x, w, EPS)
    ryp = ops.gemma_rmsnorm(x.cpu(), w.cpu(), EPS)
    for got, exp, what in ((y.cpu(), ry, "add"), (yp.cpu(), ryp, "plain")):
        nan = exp.isnan()
        assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
        d = _ulp_distance(got[~nan], exp[~nan])
        frac = (d > 0).float().mean().item() if d.numel() else 0.0
        print(f"K={k} {dtype} {what}: max ulp {int(d.max()) if d.numel() else 0}, differing fraction {frac:.2e}")
        assert int(d.max()) <= NORM_MAX_ULP, f"{what}: {int(d.max())} ulp"
        assert frac <= NORM_MAX_DIFF_FRACTION, f"{what}: {frac:.3%} of elements differ"
    # the fused op's y obeys the same bound
    _codes, _scales, _res, y_f = ops.gemma_fused_add_rmsnorm_mxfp8(x, r, w, EPS, False, True, False, 1.0)
    nan = ry.isnan()
    assert int(_ulp_distance(y_f.cpu()[~nan], ry[~nan]).max()) <= NORM_MAX_ULP


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("k", kparams(160, 3072, 6144))
def test_round_normalized_kernels(k, swizzled):
    """`round_normalized` (the standard Hugging Face order, `w * (s * rstd).to(dtype)`):
    fused == the same norm kernel then the quant kernel, bitwise, for the default dispatch
    and the split config, plain and add, weight offsets 0 and 1; and with a weight of ones
    (offset 0, so y is the rounded normalized value itself) y obeys the norm's CPU bound
    against `(s * rsqrt(mean(s*s) + eps)).to(dtype)` computed here in fp32."""
    if not HAS_CUDA:
        pytest.skip("the Triton kernels need CUDA")
    from mxfuse.ops import triton_norm_quant as tnq

    split = kernel_variants().variant("native-split", k)
    for m in (1, 37, 300):
        x, r = special_rows(m, k, seed=5 * k + m)
        for res, w, offset in ((r, gemma_weight(k), 1.0), (None, gemma_weight(k).float() + 1.0, 0.0)):
            for cfg in (None, split):
                kw = dict(weight_offset=offset, round_normalized=True, config=cfg)
                got = tnq.fused_norm_quant(x, res, w, EPS, swizzled=swizzled, emit_y=True, **kw)
                y, res_n = tnq.gemma_norm(x, res, w, EPS, **kw)
                what = f"K={k} M={m} res={res is not None} offset={offset} split={cfg is not None}"
                compare_all(got, (*tnq.quantize(y, swizzled), res_n, y), what)
                plain = tnq.gemma_norm(x, res, w, EPS, weight_offset=offset, config=cfg)[0]
                assert not torch.equal(plain.view(torch.int16), y.view(torch.int16)), (
                    what + ": the flag changed nothing"
                )
        ones = torch.ones(k, device=DEVICE, dtype=torch.bfloat16)
        y = tnq.gemma_norm(x, None, ones, EPS, weight_offset=0.0, round_normalized=True)[0].cpu()
        s = x.cpu().float()
        want = (s * torch.rsqrt((s * s).mean(dim=-1, keepdim=True) + EPS)).to(x.dtype)
        nan = want.isnan() | want.isinf()
        assert torch.equal(y.isnan() | y.isinf(), nan)
        assert int(_ulp_distance(y[~nan], want[~nan]).max()) <= NORM_MAX_ULP, f"K={k} M={m}"


@gpu_test
def test_empty_batches():
    for k in (64, 160):
        x = torch.empty(0, k, dtype=torch.bfloat16, device=DEVICE)
        w = gemma_weight(k)
        for swz in (False, True):
            got = fused(x, x, w, swz)
            exp = fused(x.cpu(), x.cpu(), w.cpu(), swz)
            for a, b in zip(got, exp):
                assert a.shape == b.shape and a.dtype == b.dtype
            c, s = ops.mxfp8_quantize(x, swz)
            assert c.shape == (0, k) and s.shape == ((0, (k // 32 + 3) // 4 * 4) if swz else (0, k // 32))
        assert ops.mxfp8_swizzle_scales(torch.empty(0, 5, dtype=torch.uint8, device=DEVICE)).shape == (0, 8)


# ------------------------------------------------------------------ row-packed outputs


@gpu_test
@pytest.mark.parametrize("has_res", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("m", [0, 1, 37, 4096])
@pytest.mark.parametrize("k", kparams(160, 6144))
def test_packed_ops_equal_unpacked(k, m, has_res):
    """The packed ops (kernels writing codes + row-major scales straight into the halves of
    a `[M, K + K/32]` byte buffer) give the unpacked ops' bits, on the special rows."""
    from mxfuse.ops import packed

    x, r = special_rows(m, k, seed=3 * k + m)
    w = gemma_weight(k)
    for emit_y in (False, True):
        if has_res:
            p, res, y = ops.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, EPS, emit_y)
            ref = ops.gemma_fused_add_rmsnorm_mxfp8(x, r, w, EPS, False, emit_y)
            got = (*packed.unpack(p, k), res, y)
        else:
            p, y = ops.gemma_rmsnorm_mxfp8_packed(x, w, EPS, emit_y)
            c, s, y_ref = ops.gemma_rmsnorm_mxfp8(x, w, EPS, False, emit_y)
            ref = (c, s, None, y_ref)
            got = (*packed.unpack(p, k), None, y)
        assert p.shape == (m, k + k // 32) and p.dtype == torch.uint8
        compare_all(got, ref, f"K={k} M={m} res={has_res} emit_y={emit_y} packed")
    if has_res:  # round_sum and weight_offset reach the kernel too
        p, res, y = ops.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w.float() + 1.0, EPS, True, True, 0.0)
        ref = ops.gemma_fused_add_rmsnorm_mxfp8(x, r, w.float() + 1.0, EPS, False, True, True, 0.0)
        compare_all((*packed.unpack(p, k), res, y), ref, f"K={k} M={m} round_sum packed")
    # the quant alone (on the norm output, and on the raw special rows with NaN / Inf)
    for src in (x, r):
        p = ops.mxfp8_quantize_packed(src)
        compare_all(packed.unpack(p, k), ops.mxfp8_quantize(src, False), f"K={k} M={m} quant packed")


@gpu_test
def test_out_views_are_written_in_place():
    from mxfuse.ops import triton_norm_quant as tnq

    m, k = 37, 160
    x, r = special_rows(m, k, seed=5)
    w = gemma_weight(k)
    buf = torch.full((m, k + k // 32 + 8), 0xAB, dtype=torch.uint8, device=DEVICE)  # wider: bytes past the scales stay
    oc, os_ = buf[:, :k].view(torch.float8_e4m3fn), buf[:, k : k + k // 32]
    c, s, res, _ = tnq.fused_norm_quant(x, r, w, EPS, out_codes=oc, out_scales=os_)
    assert c.data_ptr() == oc.data_ptr() and s.data_ptr() == os_.data_ptr()
    ref = fused(x, r, w, False, emit_y=False)
    compare_all((c, s, res), ref[:3], "out views")
    assert bool((buf[:, k + k // 32 :] == 0xAB).all())
    c2, s2 = tnq.quantize(x, out_codes=oc, out_scales=os_)
    compare_all((c2, s2), ops.mxfp8_quantize(x, False), "quantize out views")
    with pytest.raises(ValueError):
        tnq.fused_norm_quant(x, r, w, EPS, swizzled=True, out_scales=os_)
    with pytest.raises(ValueError):
        tnq.quantize(x, out_codes=oc[:5])


# ------------------------------------------------------------------ kernel variants (tools/bench_kernels.py)


def _variant_outputs(tnq, cfg, x, r, w, swizzled):
    """(fused outputs, unfused outputs) of one variant: the fused kernel, and the same
    variant's norm kernel followed by the quant kernel."""
    fused_out = tnq.fused_norm_quant(x, r, w, EPS, swizzled=swizzled, emit_y=True, config=cfg)
    y, res = tnq.gemma_norm(x, r, w, EPS, config=cfg)
    codes, scales = tnq.quantize(y, swizzled)
    return fused_out, (codes, scales, res, y)


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("has_res", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("k", kparams(160, 3072, 6144))
def test_variants_bitwise(k, has_res, swizzled):
    """Every benchmarked variant: fused == its unfused norm + quant, bitwise; a row gives
    the same bits alone and inside a batch; variants with the same arithmetic (`tree`,
    `rsqrt`) and row layout (warps) give the same bits whatever else differs (quant_ops "hw" vs "explicit", the
    in-place vs tl.store scale store, evict_first, the persistent grid, a row split over
    programs, two rows per tile); y is within the CPU-reference bound."""
    if not HAS_CUDA:
        pytest.skip("the Triton kernels need CUDA (no CPU path for the variants)")
    from mxfuse.ops import triton_norm_quant as tnq

    kv = kernel_variants()
    w = gemma_weight(k)
    failures = []  # every variant is checked (one failing variant must not hide the others)
    for m in (1, 37, 4096):
        x, r = special_rows(m, k, seed=17 * k + m)
        r = r if has_res else None
        by_arith = {}
        for name in kv.VARIANTS:
            cfg = kv.variant(name, k)
            try:
                got, want = _variant_outputs(tnq, cfg, x, r, w, swizzled)
                compare_all(got, want, f"{name} K={k} M={m} fused vs unfused")
                # without y (the bf16x2 variant rounds y in registers only then)
                no_y = tnq.fused_norm_quant(x, r, w, EPS, swizzled=swizzled, config=cfg)
                compare_all(no_y[:3], want[:3], f"{name} K={k} M={m} fused (no y) vs unfused")
                first = by_arith.setdefault((cfg.tree, cfg.rsqrt, cfg.num_warps), (name, got))
                compare_all(got, first[1], f"{name} vs {first[0]} K={k} M={m}")
                if m == 37:  # y vs the CPU reference: the bound of test_norm_matches_cpu_reference
                    want_y = (reference.gemma_fused_add_rmsnorm(x.cpu(), r.cpu(), w.cpu(), EPS)[0] if r is not None
                              else reference.gemma_rmsnorm(x.cpu(), w.cpu(), EPS))  # fmt: skip
                    nan = want_y.isnan()
                    assert torch.equal(got[3].cpu().isnan(), nan), f"{name} K={k}: NaN positions of y"
                    d = _ulp_distance(got[3].cpu()[~nan], want_y[~nan])
                    assert int(d.max()) <= NORM_MAX_ULP, f"{name} K={k}: y {int(d.max())} ulp from the CPU reference"
                    assert (d > 0).float().mean().item() <= NORM_MAX_DIFF_FRACTION, f"{name} K={k}: y differs too often"
                if m > 1:  # the last row alone (M = 1) gives the row's bits in the batch
                    alone = tnq.fused_norm_quant(x[-1:], None if r is None else r[-1:], w, EPS, swizzled=swizzled,
                                                 emit_y=True, config=cfg)  # fmt: skip
                    got_rows = _row_outputs(got, slice(m - 1, m), m, k, swizzled)
                    compare_all(got_rows, _row_outputs(alone, slice(0, 1), 1, k, swizzled), f"{name} K={k} M={m} alone")
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_config_values_are_checked():
    """A config field outside its allowed strings is refused when the config is built (the
    kernels compare the strings as constexprs: an unknown one would fall through silently)."""
    from mxfuse.ops.norm_quant_config import NormConfig, QuantConfig

    for field, bad in (("tree", "halves"), ("rsqrt", "fast"), ("quant_ops", "hw2"), ("scale_store", "smem"),
                       ("scale_padding", "zero")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            NormConfig(**{field: bad})
    with pytest.raises(ValueError, match="quant_ops"):
        QuantConfig(quant_ops="fast")
    with pytest.raises(ValueError, match="persistent"):
        NormConfig(persistent=1, split=2)
    kv = kernel_variants()
    for name in kv.VARIANTS:  # every variant keeps the default row layout of its K
        for k in (160, 3072, 6144):
            cfg = kv.variant(name, k)
            warps = kv.norm_config(k).num_warps * kv.WARPS_FACTOR.get(name, 1)
            assert cfg.num_warps == warps and kv.variant_of(cfg, k) is not None, (name, k)


# ------------------------------------------------------------------ swizzled padding


@gpu_test
@pytest.mark.parametrize("padding", ["fill", "norm"])
@pytest.mark.parametrize("m", [1, 37, 128, 130])
def test_swizzled_padding_is_written_zero(m, padding):
    """The F8_128x4 padding rows (M .. pad128(M)) hold zero scale bytes even when the
    buffer was full of garbage: the fill programs (or the padding rows' norm) write them."""
    if not HAS_CUDA:
        pytest.skip("the Triton kernels need CUDA")
    from mxfuse.ops import triton_norm_quant as tnq

    k = 160  # S = 5: pad4 makes 3 padding columns too
    x, r = special_rows(m, k, seed=m)
    w = gemma_weight(k)
    mp, sp = (m + 127) // 128 * 128, 8
    for split in (1, 2):
        cfg = kernel_variants().variant("native-split" if split > 1 else "native", k).replace(scale_padding=padding)
        poison = torch.full((mp, sp), 0xAB, dtype=torch.uint8, device="cuda")
        del poison  # the caching allocator hands this block to the next allocation of this size
        _, scales, _, _ = tnq.fused_norm_quant(x, r, w, EPS, swizzled=True, config=cfg)
        assert scales.shape == (mp, sp)
        want = reference.swizzle_scales(reference.quantize_rows(tnq.gemma_norm(x, r, w, EPS, config=cfg)[0].cpu())[1])
        assert_bitwise(scales.cpu(), want, f"M={m} {padding} split={split} scales")


# ------------------------------------------------------------------ the TORCHAO quant rule


def quant_rule():
    """`reference.QuantRule` (from the torchao branch's reference impl), or skip."""
    rule = getattr(reference, "QuantRule", None)
    if rule is None:
        pytest.skip("reference.QuantRule is not in this tree (the torchao branch's reference.py)")
    return rule


def rule_blocks(m: int, k: int, dtype, seed: int = 0, device=DEVICE):
    """Rows whose 32-blocks are of kind (block + row + seed) % 9: random, one NaN, NaN and
    +-Inf, +-Inf, all zero, tiny (scale byte 0: amax < 2**-119 * 448; fp16 cannot get
    there), subnormals of the dtype, -0.0, all NaN."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb = k // 32
    v = (torch.randn(m, nb, 32, generator=g) * 4).clone()
    kind = (torch.arange(nb)[None, :] + torch.arange(m)[:, None] + seed) % 9
    tiny = torch.finfo(dtype).tiny
    lane = torch.arange(32)
    nan, inf = float("nan"), float("inf")

    def put(kd, values):
        sel = (kind == kd)[:, :, None]
        v.copy_(torch.where(sel, values, v))

    put(1, torch.where(lane == 3, nan, v))
    put(2, torch.where(lane == 0, nan, torch.where(lane == 1, inf, torch.where(lane == 2, -inf, v))))
    put(3, torch.where(lane == 5, inf, torch.where(lane == 6, -inf, v)))
    put(4, torch.zeros_like(v))
    put(5, torch.randn(m, nb, 32, generator=g) * (2.0**-125 if dtype == torch.float32 else tiny))
    put(6, torch.randint(-3, 4, (m, nb, 32), generator=g).float() * tiny / 8)  # subnormal in dtype
    put(7, torch.full_like(v, -0.0))
    put(8, torch.full_like(v, nan))
    return v.reshape(m, k).to(dtype).to(device)


def nan_free_bits(codes: torch.Tensor) -> torch.Tensor:
    """Code bytes with every NaN as 0x7F (which NaN's sign survives a multiply differs
    between x86 and the GPU; NaN-ness is compared)."""
    b = u8(codes).clone()
    b[codes.float().isnan()] = 0x7F
    return b


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m,k", [(1, 288), (37, 160), (130, 6144)])
def test_torchao_rule_quant_matches_cpu_reference(m, k, dtype):
    """The quant kernel's TORCHAO branch == reference.quantize_rows(x, TORCHAO) on NaN,
    NaN+Inf, Inf, zero, tiny (scale byte 0: multiplied by 1.0), subnormal, -0 and all-NaN
    blocks: scales bitwise (255 for NaN blocks), codes bitwise but for NaN signs; and the
    default rule still differs only where the rules do."""
    QuantRule = quant_rule()
    from mxfuse.ops import triton_norm_quant as tnq

    x = rule_blocks(m, k, dtype, seed=m + k)
    rc, rs = reference.quantize_rows(x.cpu(), QuantRule.TORCHAO)
    assert (rs == 255).any() and ((rs == 0).any() or dtype == torch.float16)  # both rule-specific cases
    for swz in (False, True):
        codes, scales = tnq.quantize(x, swz, rule=QuantRule.TORCHAO)
        want_s = reference.swizzle_scales(rs) if swz else rs
        assert_bitwise(scales.cpu(), want_s, f"scales swz={swz}")
        assert_bitwise(nan_free_bits(codes.cpu()), nan_free_bits(rc), f"codes swz={swz}")
    _, ds = tnq.quantize(x, False, rule=QuantRule.DEFAULT)
    assert_bitwise(ds.cpu(), reference.quantize_rows(x.cpu())[1], "default rule scales")


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("has_res", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("k", kparams(160, 6144))
def test_torchao_rule_fused_equals_unfused(k, has_res, swizzled):
    """Fused norm + quant with the TORCHAO rule == the norm kernel then the quant kernel
    with the rule, bitwise (NaN codes included: same GPU arithmetic), for the default
    dispatch and the split / pad variants; and == the CPU reference rule applied to the
    fused kernel's own y (NaN signs aside)."""
    QuantRule = quant_rule()
    from mxfuse.ops import triton_norm_quant as tnq

    w = gemma_weight(k)
    rule = QuantRule.TORCHAO
    for m in (1, 37, 300):
        x, r = special_rows(m, k, seed=3 * k + m)
        # a few rows scaled into the scale-byte-0 range of the rule (y ~ 2**-125 needs 1 + w tiny:
        # the weight's first block has 1 + w = 2**-8; rows of kind 2 carry FLT_MIN blocks)
        r = r if has_res else None
        kv = kernel_variants()
        for cfg in (None, kv.variant("native-split", k), kv.variant("native-padnorm", k)):
            codes, scales, res, y = tnq.fused_norm_quant(x, r, w, EPS, swizzled=swizzled, emit_y=True, config=cfg,
                                                         rule=rule)  # fmt: skip
            y_n, res_n = tnq.gemma_norm(x, r, w, EPS, config=cfg)
            uc, us = tnq.quantize(y_n, swizzled, rule=rule)
            what = f"K={k} M={m} cfg={cfg and kv.variant_of(cfg, k)}"
            compare_all((codes, scales, res, y), (uc, us, res_n, y_n), what)
            no_y = tnq.fused_norm_quant(x, r, w, EPS, swizzled=swizzled, config=cfg, rule=rule)
            compare_all(no_y[:3], (uc, us, res_n), what + " no y")
            rc, rs = reference.quantize_rows(y.cpu(), rule)
            assert_bitwise(scales.cpu(), reference.swizzle_scales(rs) if swizzled else rs, what + " scales vs CPU rule")
            assert_bitwise(nan_free_bits(codes.cpu()), nan_free_bits(rc), what + " codes vs CPU rule")


def test_rule_values_are_checked():
    pytest.importorskip("triton")
    from mxfuse.ops import triton_norm_quant as tnq

    assert tnq.rule_name(0) == "default" and tnq.rule_name(reference.QuantRule.TORCHAO) == "torchao"
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="rule"):
            tnq.rule_name(bad)
