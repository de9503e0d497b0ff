"""The mxfuse ops on CPU: contracts of docs/design.md, the fused ops' plumbing (fused == unfused, which on
CPU is the same reference on both sides: tests/norm_families.py), schemas, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from norm_families import FAMILIES, family_weight, fused, special_rows, unfused
from torch._subclasses.fake_tensor import FakeTensorMode

import mxfuse  # noqa: F401
from mxfuse.ops import MxfuseInputError, reference
from mxfuse.testing import assert_bitwise, bits

mx = torch.ops.mxfuse
FLT_MIN = torch.finfo(torch.float32).tiny


# --------------------------------------------------------------- the fused ops' plumbing
#
# On CPU the fused ops and the unfused pair compute with the same reference functions
# (tests/norm_families.py): these tests check the plumbing, not the arithmetic.

PLUMBING_SHAPES = [(0, 64), (1, 64), (3, 96), (37, 160), (130, 160), (5, 6144)]  # 130: two 128-row scale tiles


@pytest.mark.parametrize("m,k", PLUMBING_SHAPES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused_add"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_ops_route_outputs_shapes_and_layouts_as_the_unfused_pair(family, m, k, residual, swizzled):
    x = special_rows(m, k)
    r = special_rows(m, k, seed=1).roll(1, 0) if residual else None
    w = family_weight(family, k)
    expected = unfused(family, x, r, w, 1e-6, swizzled)
    assert_bitwise(fused(family, x, r, w, 1e-6, swizzled), expected)
    no_y = fused(family, x, r, w, 1e-6, swizzled, emit_y=False)
    assert no_y[-1].numel() == 0
    assert_bitwise(no_y[:-1], expected[:-1])


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused_add"])
@pytest.mark.parametrize("round_normalized", [False, True], ids=["fp32", "round_normalized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_ops_pass_round_normalized_and_the_dtype_on(family, residual, round_normalized, dtype):
    x = special_rows(37, 160, dtype)
    r = special_rows(37, 160, dtype, seed=1).roll(1, 0) if residual else None
    w = family_weight(family, 160, dtype)
    expected = unfused(family, x, r, w, 1e-6, True, round_normalized=round_normalized)
    assert_bitwise(fused(family, x, r, w, 1e-6, True, round_normalized=round_normalized), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_sum_mode_equals_add_then_norm(family, dtype):
    x, r = special_rows(64, 160, dtype), special_rows(64, 160, dtype, seed=3)
    w = torch.zeros(160, dtype=dtype)
    expected = unfused(family, x, r, w, 1e-5, False, round_sum=True)
    assert_bitwise(fused(family, x, r, w, 1e-5, False, round_sum=True), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_3d_and_row_strided_inputs(family):
    base = special_rows(24, 256)
    x = base[:, :192]  # a view with a row stride of 256
    assert x.stride() == (256, 1)
    w = torch.zeros(192, dtype=torch.bfloat16)
    assert_bitwise(fused(family, x, None, w, 1e-6, False), unfused(family, x.contiguous(), None, w, 1e-6, False))
    x3, r3 = special_rows(12, 64).view(2, 6, 64), special_rows(12, 64, seed=4).view(2, 6, 64)
    out = fused(family, x3, r3, w[:64], 1e-6, False)
    assert out[0].shape == (2, 6, 64) and out[1].shape == (2, 6, 2)
    assert_bitwise(out, unfused(family, x3, r3, w[:64], 1e-6, False))


def test_weight_offset_zero_takes_one_plus_w_in_fp32():
    x, w = special_rows(9, 64), torch.randn(64).to(torch.bfloat16)
    gemma = mx.gemma_rmsnorm_mxfp8(x, w, 1e-6, False, True)
    explicit = mx.gemma_rmsnorm_mxfp8(x, w.float() + 1.0, 1e-6, False, True, 0.0)
    assert_bitwise(explicit, gemma)


def test_round_normalized_is_one_rounding_before_the_weight_multiply():
    """`round_normalized`: y = (n.to(dtype) * w).to(dtype); the default rounds once, after the multiply."""
    x, w = special_rows(16, 256)[8:], torch.randn(256).to(torch.bfloat16)
    s = x.float()
    n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_bitwise(mx.rms_norm(x, w, 1e-6, True), n.to(torch.bfloat16) * w)
    assert_bitwise(mx.rms_norm(x, w, 1e-6), (n * w.float()).to(torch.bfloat16))
    assert not torch.equal(mx.rms_norm(x, w, 1e-6, True), mx.rms_norm(x, w, 1e-6))


def test_zero_offset_keeps_the_sign_of_negative_zero_weights():
    """An offset of 0 is no add at all: `-0.0 + 0.0` would make a -0 weight +0 and flip y's zero signs."""
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.full((64,), -0.0, dtype=torch.bfloat16)
    for y in (mx.rms_norm(x, w, 1e-6), mx.gemma_rmsnorm_mxfp8(x, w, 1e-6, False, True, 0.0)[2]):
        assert torch.equal(torch.signbit(y), ~torch.signbit(x))


@pytest.mark.parametrize("round_normalized", [False, True])
def test_packed_standard_form_equals_unpacked(round_normalized):
    x, r = special_rows(9, 128), special_rows(9, 128, seed=7)
    w = torch.randn(128).to(torch.bfloat16)
    kw = {"weight_offset": 0.0, "round_normalized": round_normalized}
    packed, y = mx.gemma_rmsnorm_mxfp8_packed(x, w, 1e-6, True, **kw)
    codes, scales, y_ref = unfused("standard", x, None, w, 1e-6, False, round_normalized=round_normalized)
    assert_bitwise((packed[:, :128].view(torch.float8_e4m3fn), packed[:, 128:], y), (codes, scales, y_ref))
    packed, res, y = mx.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, 1e-6, True, **kw)
    codes, scales, res_ref, y_ref = unfused("standard", x, r, w, 1e-6, False, round_normalized=round_normalized)
    assert_bitwise(
        (packed[:, :128].view(torch.float8_e4m3fn), packed[:, 128:], res, y), (codes, scales, res_ref, y_ref)
    )


# --------------------------------------------------------------- quantization


def float_scale(amax: torch.Tensor) -> torch.Tensor:
    """docs/design.md's formula ("The E8M0 scale of a block") evaluated in exact (float64) arithmetic."""
    a = amax.double().clamp_min(FLT_MIN)
    return (torch.ceil(torch.log2(a / 448)) + 127).clamp(0, 254)


def test_scale_formula_is_exact_at_power_of_two_boundaries():
    e = torch.arange(-126, 127, dtype=torch.float64)
    edges = torch.cat([448 * 2.0**e, 448 * 2.0**e * (1 + 2**-23), 448 * 2.0**e * (1 - 2**-24), 2.0**e])
    edges = edges[(edges < 3.4e38) & (edges >= FLT_MIN)].float()
    expected = float_scale(edges)
    assert torch.equal(reference.e8m0_scale_from_amax(edges).double(), expected)


def test_quantize_special_values():
    x = torch.zeros(4, 64)
    x[1, :32] = FLT_MIN
    x[2, 3], x[2, 40] = float("nan"), 1.0
    x[3, 0], x[3, 1] = float("inf"), -2.0
    codes, scales = mx.mxfp8_quantize(x)
    assert scales[0].tolist() == [0, 0] and not bits(codes[0]).any()  # zeros stay zeros (no NaN)
    assert scales[1, 0] == 0 and codes[1, :32].float().eq(2.0).all()  # FLT_MIN * 2**127 = 2
    assert torch.isnan(codes[2, 3].float()) and scales[2, 0] == 0 and scales[2, 1] == 119
    assert scales[3, 0] == 254 and codes[3, 0].float() == 448


def test_codes_times_scale_reconstruct_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64).unsqueeze(1)
    codes, scales = mx.mxfp8_quantize(x)
    back = reference.dequantize(codes, scales)
    # half an e4m3 ulp of each value (3 mantissa bits), or half the subnormal step 2**-9 of its block
    half_subnormal_step = reference.e8m0_to_float(scales).repeat_interleave(32, dim=1) * 2.0**-10
    assert torch.all((back - x).abs() <= torch.maximum(x.abs() * 2**-4, half_subnormal_step))


def test_matches_vllm_torch_quantize_away_from_boundaries():
    mxfp8 = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils")
    x = torch.randn(33, 256, dtype=torch.bfloat16)
    ours = mx.mxfp8_quantize(x)
    theirs = mxfp8._mxfp8_e4m3_quantize_torch(x)
    assert_bitwise(ours, theirs)


@pytest.mark.parametrize("m,s", [(1, 1), (37, 5), (130, 6), (256, 8)])
def test_swizzled_layout_is_f8_128x4(m, s):
    scales = torch.randint(1, 255, (m, s), dtype=torch.uint8)
    swizzled = mx.mxfp8_swizzle_scales(scales)
    mp, sp = math.ceil(m / 128) * 128, math.ceil(s / 4) * 4
    assert swizzled.shape == (mp, sp)
    flat = swizzled.flatten()
    for row in range(mp):
        for col in range(sp):
            # F8_128x4: tile (row//128, col//4) of 512 bytes; inside, row r = 32*i + j sits at j*16 + i*4 + col%4
            i, j = (row % 128) // 32, row % 32
            offset = ((row // 128) * (sp // 4) + col // 4) * 512 + j * 16 + i * 4 + col % 4
            value = scales[row, col] if row < m and col < s else 0
            assert flat[offset] == value
    assert torch.equal(reference.unswizzle_scales(swizzled, m, s), scales)


def test_quantize_swizzled_equals_swizzle_of_rowmajor():
    x = special_rows(200, 96)
    codes, scales = mx.mxfp8_quantize(x)
    codes_sw, scales_sw = mx.mxfp8_quantize(x, True)
    assert_bitwise((codes_sw, scales_sw), (codes, mx.mxfp8_swizzle_scales(scales)))


# -------------------------------------------------------------------- linear


@pytest.mark.parametrize("m,n,k", [(0, 16, 64), (1, 16, 64), (37, 48, 160), (64, 96, 512)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_against_float64_reference(m, n, k, out_dtype):
    g = torch.Generator().manual_seed(0)
    codes, scales = mx.mxfp8_quantize(torch.randn(m, k, generator=g))
    wc, ws = mx.mxfp8_quantize(torch.randn(n, k, generator=g) * 0.05)
    out = mx.mxfp8_linear(codes, scales, wc, ws, out_dtype)
    exact = reference.dequantize(codes, scales).double() @ reference.dequantize(wc, ws).double().T
    assert out.dtype == out_dtype and out.shape == (m, n)
    # one rounding to out_dtype plus fp32 accumulation error
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    tolerance = torch.finfo(out_dtype).eps * exact.abs() + 1e-5 * scale
    assert torch.all((out.double() - exact).abs() <= tolerance)


def test_linear_reads_views_of_a_packed_buffer():
    m, k, n = 9, 128, 32
    codes, scales = mx.mxfp8_quantize(torch.randn(m, k))
    wc, ws = mx.mxfp8_quantize(torch.randn(n, k))
    packed = torch.cat([codes.view(torch.uint8), scales], dim=1)
    out = mx.mxfp8_linear(packed[:, :k].view(torch.float8_e4m3fn), packed[:, k:], wc, ws, torch.bfloat16)
    assert_bitwise(out, mx.mxfp8_linear(codes, scales, wc, ws, torch.bfloat16))


# --------------------------------------------------------- schemas and errors


def opcheck_cases():
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(64, dtype=torch.bfloat16)
    codes, scales = mx.mxfp8_quantize(x)
    return [
        (mx.gemma_rmsnorm, (x, w, 1e-6)),
        (mx.gemma_fused_add_rmsnorm, (x, r, w, 1e-6, True)),
        (mx.rms_norm, (x, w, 1e-6, True)),
        (mx.fused_add_rms_norm, (x, r, w, 1e-6)),
        (mx.mxfp8_quantize, (x, True)),
        (mx.gemma_rmsnorm_mxfp8, (x, w, 1e-6, True, True)),
        (mx.gemma_fused_add_rmsnorm_mxfp8, (x, r, w, 1e-6, False, True, True)),
        (mx.gemma_rmsnorm_mxfp8, (x, w, 1e-6, False, True, 0.0, 0, None, True)),
        (mx.mxfp8_swizzle_scales, (scales,)),
        (mx.mxfp8_linear, (codes, scales, codes, scales, torch.bfloat16)),
    ]


@pytest.mark.parametrize("case", range(10))
def test_opcheck_schema_fake_and_functional(case):
    op, args = opcheck_cases()[case]
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    if op is mx.mxfp8_linear:
        utils = utils[1:]  # opcheck's schema check multiplies the fp8 inputs, which CPU torch cannot
    torch.library.opcheck(op.default, args, test_utils=utils)


def test_fake_impls_trace_symbolic_rows():
    def fn(x, r, w):
        codes, scales, res, y = mx.gemma_fused_add_rmsnorm_mxfp8(x, r, w, 1e-6, True, True)
        return codes, scales, res, y

    from torch.fx.experimental.proxy_tensor import make_fx

    args = (torch.randn(200, 64, dtype=torch.bfloat16), torch.randn(200, 64, dtype=torch.bfloat16), torch.zeros(64))
    gm = make_fx(fn, tracing_mode="symbolic")(*args)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert "256" not in str(out[1].meta["val"].shape)  # padded rows stay symbolic
    assert out[1].meta["val"].shape[1] == 4


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: mx.gemma_rmsnorm(torch.randn(4, 48, dtype=torch.bfloat16), torch.zeros(48), 1e-6), r"K=48"),
        (lambda: mx.gemma_rmsnorm(torch.randn(4, 64, dtype=torch.bfloat16), torch.zeros(32), 1e-6), r"weight"),
        (lambda: mx.gemma_rmsnorm(torch.randn(4, 64), torch.zeros(64), 1e-6), r"float32"),
        (
            lambda: mx.gemma_fused_add_rmsnorm(
                torch.randn(4, 64, dtype=torch.bfloat16),
                torch.randn(3, 64, dtype=torch.bfloat16),
                torch.zeros(64),
                1e-6,
            ),
            r"residual \(3, 64\)",
        ),
        (
            lambda: mx.rms_norm(torch.randn(4, 48, dtype=torch.float16), torch.zeros(48), 1e-6),
            r"K=48 of x \(4, 48\) float16",
        ),
        (lambda: mx.rms_norm(torch.randn(4, 64), torch.zeros(64), 1e-6, True), r"x \(4, 64\) float32"),
        (
            lambda: mx.fused_add_rms_norm(
                torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.float16), torch.zeros(64), 1e-6
            ),
            r"residual \(4, 64\) float16",
        ),
        (
            lambda: mx.fused_add_rms_norm(
                torch.randn(4, 64, dtype=torch.bfloat16),
                torch.randn(4, 64, dtype=torch.bfloat16),
                torch.zeros(64, dtype=torch.int32),
                1e-6,
            ),
            r"weight \(64,\) int32 on cpu must be floating point",
        ),
        (lambda: mx.mxfp8_quantize(torch.randn(4, 40)), r"K=40"),
        (lambda: mx.mxfp8_quantize(torch.randint(0, 3, (4, 64))), r"int64"),
        (
            lambda: mx.mxfp8_linear(
                *mx.mxfp8_quantize(torch.randn(4, 64)), *mx.mxfp8_quantize(torch.randn(8, 32)), torch.bfloat16
            ),
            r"weight_codes \(8, 32\)",
        ),
        (
            lambda: mx.mxfp8_linear(
                mx.mxfp8_quantize(torch.randn(4, 64))[0],
                torch.zeros(4, 3, dtype=torch.uint8),
                *mx.mxfp8_quantize(torch.randn(8, 64)),
                torch.bfloat16,
            ),
            r"scales \(4, 3\)",
        ),
        (lambda: mx.mxfp8_swizzle_scales(torch.zeros(4, 2)), r"uint8"),
    ],
)
def test_bad_input_names_the_op_and_shapes(call, message):
    with pytest.raises(MxfuseInputError, match=r"mxfuse::\w+: .*" + message):
        call()


def _norm_calls(eps: float):
    """Every op that takes eps, called with `eps` on valid tensors."""
    x, r = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(64)
    return {
        "gemma_rmsnorm": lambda: mx.gemma_rmsnorm(x, w, eps),
        "gemma_fused_add_rmsnorm": lambda: mx.gemma_fused_add_rmsnorm(x, r, w, eps),
        "rms_norm": lambda: mx.rms_norm(x, w, eps),
        "fused_add_rms_norm": lambda: mx.fused_add_rms_norm(x, r, w, eps, True),
        "gemma_rmsnorm_mxfp8": lambda: mx.gemma_rmsnorm_mxfp8(x, w, eps),
        "gemma_fused_add_rmsnorm_mxfp8": lambda: mx.gemma_fused_add_rmsnorm_mxfp8(x, r, w, eps),
        "rms_norm_mxfp8": lambda: mx.rms_norm_mxfp8(x, w, eps, round_normalized=True),
        "fused_add_rms_norm_mxfp8": lambda: mx.fused_add_rms_norm_mxfp8(x, r, w, eps),
        "gemma_rmsnorm_mxfp8_packed": lambda: mx.gemma_rmsnorm_mxfp8_packed(x, w, eps),
        "gemma_fused_add_rmsnorm_mxfp8_packed": lambda: mx.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, eps),
    }


@pytest.mark.parametrize("op", list(_norm_calls(0.0)))
@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_negative_or_nan_eps_is_rejected_by_every_norm_op(op, eps):
    with pytest.raises(MxfuseInputError, match=rf"mxfuse::{op}: eps=(-1e-06|nan) must be >= 0"):
        _norm_calls(eps)[op]()
    with FakeTensorMode(), pytest.raises(MxfuseInputError, match=rf"mxfuse::{op}: eps="):
        _norm_calls(eps)[op]()  # the fake impl checks too: a compile fails at trace time, not in the kernel
    _norm_calls(0.0)[op]()  # eps = 0 stays valid


@pytest.mark.parametrize(
    "op,call",
    [
        ("mxfp8_quantize", lambda: mx.mxfp8_quantize(torch.empty(4, 0))),
        ("mxfp8_quantize", lambda: mx.mxfp8_quantize(torch.empty(0, 0), True)),
        ("mxfp8_quantize_packed", lambda: mx.mxfp8_quantize_packed(torch.empty(4, 0))),
        ("gemma_rmsnorm", lambda: mx.gemma_rmsnorm(torch.empty(4, 0, dtype=torch.bfloat16), torch.empty(0), 1e-6)),
        ("rms_norm", lambda: mx.rms_norm(torch.empty(4, 0, dtype=torch.bfloat16), torch.empty(0), 1e-6)),
        (
            "mxfp8_linear",
            lambda: mx.mxfp8_linear(
                *(torch.empty(4, 0, dtype=torch.float8_e4m3fn), torch.empty(4, 0, dtype=torch.uint8)) * 2,
                torch.bfloat16,
            ),
        ),
    ],
)
def test_empty_hidden_size_is_an_input_error(op, call):
    with pytest.raises(MxfuseInputError, match=rf"mxfuse::{op}: hidden size K=0 of \w+ \(\d+, 0\)"):
        call()


def test_mixed_devices_and_errors_at_trace_time():
    with FakeTensorMode():
        x = torch.empty(4, 64, dtype=torch.bfloat16)
        w = torch.empty(64, device="meta")
        with pytest.raises(MxfuseInputError, match="different devices"):
            mx.gemma_rmsnorm(x, w, 1e-6)
    with pytest.raises(Exception, match="K=48"):
        torch.compile(lambda t: mx.mxfp8_quantize(t), backend="eager")(torch.randn(2, 48))


# ----------------------------------------------------------------- property


@settings(max_examples=20, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    m=st.integers(0, 9),
    blocks=st.integers(1, 6),
    scale=st.sampled_from([1e-38, 1e-20, 1e-3, 1.0, 1e3, 1e30]),
    residual=st.booleans(),
    swizzled=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_property_fused_ops_route_like_the_unfused_pair(family, m, blocks, scale, residual, swizzled, dtype, seed):
    """Plumbing at random small shapes (tests/norm_families.py: the same reference on both sides)."""
    k = 32 * blocks
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * scale).to(dtype)
    r = (torch.randn(m, k, generator=g) * scale).to(dtype) if residual else None
    w = torch.randn(k, generator=g).to(dtype)
    assert_bitwise(fused(family, x, r, w, 1e-6, swizzled), unfused(family, x, r, w, 1e-6, swizzled))


# ----------------------------------------------------------------- autograd


@pytest.mark.parametrize("fused_add", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "offset,round_normalized",
    [(1.0, False), (1.0, True), (0.0, False), (0.0, True)],
    ids=["gemma", "gemma_rn", "std", "std_rn"],
)
def test_norm_backward_matches_autograd_of_the_reference(fused_add, weight_dtype, offset, round_normalized):
    """The norms' registered backward == PyTorch autograd through the plain reference (fp32 math;
    the order of the fp32 reductions differs, so bf16-rounded gradients may differ in the last bit)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 5, 96, generator=g) * 3).to(torch.bfloat16)
    r = torch.randn(2, 5, 96, generator=g).to(torch.bfloat16)
    w = (torch.randn(96, generator=g) * 0.1).to(weight_dtype)
    dy, dres = (torch.randn(2, 5, 96, generator=g).to(torch.bfloat16) for _ in range(2))

    def grads(norm):
        leaves = [t.clone().requires_grad_() for t in ((x, r, w) if fused_add else (x, w))]
        out = norm(*leaves)
        outs, cotangents = ((out[0], out[1]), (dy, dres)) if fused_add else ((out,), (dy,))
        return outs, torch.autograd.grad(outs, leaves, cotangents)

    def ref(*args):
        if fused_add:
            return reference.gemma_fused_add_rmsnorm(*args, 1e-6, False, offset, round_normalized)
        return reference.gemma_rmsnorm(*args, 1e-6, offset, round_normalized)

    ops = {
        (False, 1.0): mx.gemma_rmsnorm,
        (True, 1.0): mx.gemma_fused_add_rmsnorm,
        (False, 0.0): mx.rms_norm,
        (True, 0.0): mx.fused_add_rms_norm,
    }
    op = ops[fused_add, offset]
    (outs, got), (ref_outs, expected) = grads(lambda *a: op(*a, 1e-6, round_normalized)), grads(ref)
    for a, b in zip(outs, ref_outs, strict=True):
        assert_bitwise(a.reshape(-1, 96), b.reshape(-1, 96))  # the forward is the contract: bitwise
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    if fused_add:
        assert torch.equal(got[0], got[1])  # x and residual enter only through their sum


def _tiny_linear_block():
    from mxfuse.models import GemmaNorm, MXFP8Linear

    gen = torch.Generator().manual_seed(0)
    norm, lin = GemmaNorm(64, 1e-6, gen), MXFP8Linear(64, 32, gen)
    norm.w.requires_grad_(True)  # a trainable parameter, as in a model built for training
    return norm, lin


def test_compile_with_gradients_names_no_grad():
    """Compiling with gradients enabled (no torch.no_grad()) fails with mxfuse's message, not AOTAutograd's."""
    norm, lin = _tiny_linear_block()
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(lambda t: lin(norm(t)), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"mxfuse::mxfp8_linear has no backward.*torch\.no_grad\(\)"):
        compiled(x)
    eager = lin(norm(x))  # eager forward with gradients enabled still runs; its backward says the same
    with pytest.raises(MxfuseInputError, match=r"torch\.inference_mode\(\)"):
        eager.sum().backward()
    with torch.no_grad():
        assert_bitwise(compiled(x), lin(norm(x)))


def test_compiled_norm_trains():
    """The norms' backward is traceable: a compiled norm gives eager's gradients."""
    norm, _ = _tiny_linear_block()
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)

    def loss(t, res):
        y, res_out = norm(t, res)
        return (y.float() ** 2).sum() + res_out.float().sum()

    expected = torch.autograd.grad(loss(x, r), (x, r, norm.w))
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(x, r), (x, r, norm.w))
    for a, b in zip(got, expected, strict=True):
        assert_bitwise(a, b)
