"""GPU tests of the norm producers' kernels (`mxfuse/ops/triton_norm_quant.py`), both norm families.

The families (tests/norm_families.py): "gemma", `normalize(x) * (1 + w)` (the `gemma_*` ops), and
"standard", `normalize(x) * w` (`rms_norm`, `fused_add_rms_norm`, `rms_norm_mxfp8`,
`fused_add_rms_norm_mxfp8`). Every op is called by name through `torch.ops.mxfuse`; each call of a
standard fused op is also compared with the Gemma op at `weight_offset=0.0` (one kernel, one
arithmetic). What is asserted (docs/design.md "Fidelity"):

- fused vs. unfused ops on the GPU: BITWISE (codes and scales bytes, residual_out, y), plain and
  fused-add, both scale layouts, both quant rules, emit_y, round_sum, round_normalized, the Gemma
  weight_offset, bf16 and fp16, fp32 weights, 3-D and row-strided inputs; on zeros, FLT_MIN
  blocks, huge and overflowing squares, NaN / Inf rows and a dominant block (tests/gpu_helpers.py),
  with the families' hard weights (Gemma's `1 + w` = 2**-8 and 0 blocks; -0 and 2**-10 standard
  weights). Every K class of the default dispatch (`norm_config`: one to four chunks, one or more
  rows a tile) and every M regime (split rows at M <= 16, evict_first up to 1024, paired bf16
  rounding, two rows a tile or the pipelined loop from 4096).
- batch invariance: a row gives the same bits inside batches of M = 1 .. 16384.
- the quant and swizzle kernels vs. the CPU reference: bitwise on finite inputs (NaN positions and
  +-448 for Inf on non-finite ones; NaN signs aside under the TORCHAO rule).
- the norm vs. the CPU reference (only the sum of squares is added in another order):
  residual_out bitwise but NaN payloads; y within ONE ulp of x's dtype, at most 2% of the elements
  differing (measured on random data: well under 1%, see the printed fractions); with
  `round_normalized` (two roundings) within two ulps.
- the row-packed SP ops and written-in-place output views: the unpacked ops' bits; the F8_128x4
  padding written zero; every benchmarked kernel variant bitwise (tools/kernel_variants.py).
- bad input: every norm op refuses it on the device with `MxfuseInputError` naming the op.

All GPU tests are marked `gpu` and skipped without CUDA; the module collects on a CPU-only machine
and imports no vLLM (the GPU image has none). MXFUSE_TEST_DEVICE=cpu runs the op-level tests on the
CPU reference impls (tests/gpu_helpers.py), a self-check of this file.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from foreign_bound import assert_within_one_ulp
from gpu_helpers import DEVICE, HAS_CUDA, gpu_test, kparams, special_rows
from norm_families import FAMILIES

import mxfuse.ops  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops import MxfuseInputError, reference
from mxfuse.ops.reference import QuantRule
from mxfuse.testing import assert_bitwise, bits

ops = torch.ops.mxfuse
EPS = 1e-6
DEFAULT, TORCHAO = QuantRule.DEFAULT, QuantRule.TORCHAO

NORM_OPS = {  # the ops by name: (norm, fused-add norm, norm + quant, fused-add norm + quant)
    "gemma": ("gemma_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm_mxfp8", "gemma_fused_add_rmsnorm_mxfp8"),
    "standard": ("rms_norm", "fused_add_rms_norm", "rms_norm_mxfp8", "fused_add_rms_norm_mxfp8"),
}
WEIGHT_OFFSET = {"gemma": 1.0, "standard": 0.0}
"""What the kernels add to the weight for each family."""


def norm_ops(family: str) -> list:
    return [getattr(torch.ops.mxfuse, name) for name in NORM_OPS[family]]


def kernel_variants():
    """tools/kernel_variants.py (the benchmarked configs), imported from tools/."""
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import kernel_variants

    return kernel_variants


def needs_kernels():
    """Skip a test that calls the Triton launchers themselves (no CPU impl behind them)."""
    if not HAS_CUDA:
        pytest.skip("the Triton kernels need CUDA")


# ------------------------------------------------------------------ one helper each


def weight(family: str, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    """The family's weight with its hard cases, on DEVICE: Gemma's blocks where `1 + w` is 2**-8
    and 0; the standard norm's -0 weights (the sign of y's zeros) and a 2**-10 block."""
    if family == "gemma":
        w = 0.5 * torch.randn(k, generator=torch.Generator().manual_seed(1))
        w[:32] = -1.0 + 2.0**-8
        if k >= 96:
            w[64:96] = -1.0
    else:
        w = torch.randn(k, generator=torch.Generator().manual_seed(3))
        w[:8], w[32:64] = -0.0, 2.0**-10
    return w.to(device=DEVICE, dtype=dtype)


def unfused(family, x, r, w, swizzled, *, rule=DEFAULT, round_sum=False, round_normalized=False):
    """The graph before the rewrite: the family's norm (fused-add with a residual), then the quant:
    `(codes, scales, residual_out or None, y)`. `round_sum`: Hugging Face's order, the norm of the
    dtype-rounded sum (the fused add's residual_out: `r + x` rounded once, the kernel's NaN)."""
    norm, add_norm = norm_ops(family)[:2]
    if r is None:
        y, res = norm(x, w, EPS, round_normalized), None
    else:
        y, res = add_norm(x, r, w, EPS, round_normalized)
        if round_sum:
            y = norm(res, w, EPS, round_normalized)
    return (*ops.mxfp8_quantize(y, swizzled, rule), res, y)


def fused(family, x, r, w, swizzled, *, emit_y=True, rule=DEFAULT, round_sum=False, round_normalized=False,
          weight_offset=None):  # fmt: skip
    """The family's fused op: `(codes, scales, residual_out or None, y)`; `weight_offset` (Gemma's
    ops only): the offset argument, 1.0 when None. A standard op's outputs are also compared with
    the Gemma op's at `weight_offset=0.0`."""
    plain, add = norm_ops(family)[2:]
    kw = dict(emit_y=emit_y, rule=rule, round_normalized=round_normalized)
    if weight_offset is not None:
        assert family == "gemma", "only the Gemma ops take weight_offset"
        kw["weight_offset"] = weight_offset
    if r is None:
        codes, scales, y = plain(x, w, EPS, swizzled, **kw)
        out = (codes, scales, None, y)
    else:
        out = tuple(add(x, r, w, EPS, swizzled, round_sum=round_sum, **kw))
    if family == "standard":
        as_gemma = fused("gemma", x, r, w, swizzled, **kw, round_sum=round_sum, weight_offset=0.0)
        assert_outputs(out, as_gemma, "the standard op vs the Gemma op at weight_offset=0")
    return out


def assert_outputs(actual, expected, what: str, *, emit_y: bool = True):
    """`(codes, scales, residual_out, y)` bitwise (residual_out None on both sides or bitwise);
    without emit_y, y must be empty or None."""
    for name, a, e in zip(("codes", "scales", "residual_out"), actual, expected):
        assert (a is None) == (e is None), f"{what} {name}"
        if a is not None:
            assert_bitwise(a, e, f"{what} {name}")
    if emit_y:
        assert_bitwise(actual[3], expected[3], f"{what} y")
    else:  # the ops return an empty y, the kernels' launchers None
        assert actual[3] is None or actual[3].numel() == 0, f"{what}: y written without emit_y"


def padded_scales_shape(m: int, k: int) -> tuple[int, int]:
    """The F8_128x4 scales of M rows of K: `[pad128(M), pad4(K/32)]`."""
    return (m + 127) // 128 * 128, (k // 32 + 3) // 4 * 4


# ------------------------------------------------------------------ fused == unfused

# K classes of norm_config: (row padded to block_k, chunks of CH, rows per tile)
#   64: 128 / 1 chunk / 16 rows;  96: 128, 1 chunk, the last block of a chunk padded;
#   160: 256 / 2 chunks / 8 rows;  992: 1024 / 4 chunks / 2 rows;
#   3072: 4096 / 3 chunks / 1 row (2 rows for the plain fused kernel from M = 4096);
#   4096: 4096 / 4 chunks;  6144: 8192 / 3 chunks of 2048 (the pipelined loop from M = 4096).
KS = kparams(64, 96, 160, 1024 - 32, 3072, 4096, 6144)
# M regimes: empty; split rows (<= 16); evict_first (17 .. 1024); paired bf16 rounding (<= 256,
# <= 1024 with a residual); neither (1025); two rows a tile / the pipelined loop (4096)
MS = (0, 1, 3, 16, 17, 37, 1024, 1025, 4096)
ARITHMETIC = [(dtype, rn) for dtype in (torch.bfloat16, torch.float16) for rn in (False, True)]
"""(x's dtype, round_normalized)."""


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused_add"])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_equals_unfused_bitwise(family, k, residual, swizzled):
    for dtype, round_normalized in ARITHMETIC:
        w = weight(family, k, dtype)
        for m in MS:
            x, r = special_rows(m, k, dtype, seed=k + m)
            r = r if residual else None
            what = f"{family} K={k} M={m} {dtype} round_normalized={round_normalized} swizzled={swizzled}"
            expected = unfused(family, x, r, w, swizzled, round_normalized=round_normalized)
            out = fused(family, x, r, w, swizzled, round_normalized=round_normalized)
            assert_outputs(out, expected, what)
            no_y = fused(family, x, r, w, swizzled, emit_y=False, round_normalized=round_normalized)
            assert_outputs(no_y, expected, what + " emit_y=False", emit_y=False)
            # the fused op's codes are the quant op applied to the fused op's y
            assert_bitwise(ops.mxfp8_quantize(out[3], swizzled), expected[:2], what + " quant(y_fused)")
            if family == "gemma" and dtype == torch.bfloat16 and not round_normalized:
                # weight_offset: (w.f32 + 1) supplied as an fp32 weight with offset 0 gives the same bits
                # (with round_normalized: test_round_normalized_kernels)
                w1 = w.float() + 1.0
                out_wo = fused(family, x, r, w1, swizzled, round_normalized=round_normalized, weight_offset=0.0)
                assert_outputs(out_wo, expected, what + " weight_offset=0")
            if swizzled and m:
                swizzled_rowmajor = ops.mxfp8_swizzle_scales(ops.mxfp8_quantize(expected[3], False)[1])
                assert_bitwise(swizzled_rowmajor, expected[1], what + " swizzle op")
                assert out[1].shape == padded_scales_shape(m, k)


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("round_normalized", [False, True], ids=["fp32", "round_normalized"])
@pytest.mark.parametrize("k", kparams(64, 96, 160, 3072, 6144))
@pytest.mark.parametrize("family", FAMILIES)
def test_round_sum_equals_add_then_norm(family, k, round_normalized, swizzled):
    """Hugging Face's decoder: `h = residual + x` in the model dtype, then the norm of h."""
    w = weight(family, k)
    for m in (0, 1, 3, 37, 4096):
        x, r = special_rows(m, k, seed=k + m)
        expected = unfused(family, x, r, w, swizzled, round_sum=True, round_normalized=round_normalized)
        got = fused(family, x, r, w, swizzled, round_sum=True, round_normalized=round_normalized)
        assert_outputs(got, expected, f"{family} K={k} M={m} round_sum round_normalized={round_normalized}")


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", kparams(160, 3072))
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_equals_unfused_weights_3d_and_row_strides(family, k, dtype):
    """fp32 weights and weights of x's dtype; a 3-D input; a non-contiguous row slice."""
    x, r = special_rows(37, k, dtype=dtype, seed=7)
    for wdt in (torch.float32, dtype):
        w = weight(family, k, wdt)
        for swz in (False, True):
            what = f"{family} {dtype} w={wdt} swz={swz}"
            assert_outputs(fused(family, x, r, w, swz), unfused(family, x, r, w, swz), what)
            assert_outputs(fused(family, x, None, w, swz), unfused(family, x, None, w, swz), what + " plain")
    # 3-D [2, 5, K] (rows flattened) agrees with the 2-D op on the same rows
    x3, r3 = special_rows(10, k, dtype=dtype, seed=3)
    w = weight(family, k, dtype)
    for swz in (False, True):
        a = fused(family, x3.view(2, 5, k), r3.view(2, 5, k), w, swz)
        b = fused(family, x3, r3, w, swz)
        assert a[0].shape == (2, 5, k) and a[2].shape == (2, 5, k) and a[3].shape == (2, 5, k)
        assert a[1].shape == (padded_scales_shape(10, k) if swz else (2, 5, k // 32))
        assert_outputs([t.reshape(b_.shape) for t, b_ in zip(a, b)], b, f"3-D swz={swz}")
        assert_outputs(a, unfused(family, x3.view(2, 5, k), r3.view(2, 5, k), w, swz), f"3-D vs unfused swz={swz}")
    # non-contiguous rows: x[:, :K] of a wider tensor (row stride K + 64)
    wide_x, wide_r = special_rows(37, k + 64, dtype=dtype, seed=11)
    xs, rs = wide_x[:, :k], wide_r[:, 16 : 16 + k]
    assert not xs.is_contiguous() and xs.stride(-1) == 1
    for swz in (False, True):
        a = fused(family, xs, rs, w, swz)
        assert_outputs(a, fused(family, xs.contiguous(), rs.contiguous(), w, swz), f"row slice swz={swz}")
        assert_outputs(a, unfused(family, xs, rs, w, swz), f"row slice vs unfused swz={swz}")
        assert_bitwise(ops.mxfp8_quantize(xs, swz)[1], ops.mxfp8_quantize(xs.contiguous(), swz)[1], "quant row slice")


@gpu_test
@pytest.mark.parametrize("family", FAMILIES)
def test_empty_batches(family):
    for k in (64, 160):
        x = torch.empty(0, k, dtype=torch.bfloat16, device=DEVICE)
        w = weight(family, k)
        for swz in (False, True):
            got = fused(family, x, x, w, swz)
            exp = fused(family, x.cpu(), x.cpu(), w.cpu(), swz)
            for a, b in zip(got, exp):
                assert a.shape == b.shape and a.dtype == b.dtype
            c, s = ops.mxfp8_quantize(x, swz)
            assert c.shape == (0, k) and s.shape == ((0, (k // 32 + 3) // 4 * 4) if swz else (0, k // 32))
        assert ops.mxfp8_swizzle_scales(torch.empty(0, 5, dtype=torch.uint8, device=DEVICE)).shape == (0, 8)


# ------------------------------------------------------------------ bad input


def bad_inputs(residual: bool, quant: bool) -> list[tuple[dict, str]]:
    """`(arguments replaced, message)`: each input mxfuse/ops/inputs.py refuses, on DEVICE."""
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    on = f"on {torch.device(DEVICE).type}"
    cases = [
        (dict(x=torch.randn(4, 40, **bf16), r=torch.randn(4, 40, **bf16), w=torch.ones(40, device=DEVICE)),
         rf"hidden size K=40 of x \(4, 40\) bfloat16 {on} is not a multiple of 32"),
        (dict(x=torch.empty(4, 0, **bf16), r=torch.empty(4, 0, **bf16), w=torch.ones(0, device=DEVICE)),
         rf"hidden size K=0 of x \(4, 0\) bfloat16 {on}"),
        (dict(x=torch.randn(4, 64, device=DEVICE), r=torch.randn(4, 64, device=DEVICE)),
         rf"x \(4, 64\) float32 {on} has dtype torch.float32; expected one of bfloat16, float16"),
        (dict(w=torch.ones(32, device=DEVICE)), rf"weight \(32,\) float32 {on} must have shape \(64,\)"),
        (dict(w=torch.ones(64, device=DEVICE).int()), rf"weight \(64,\) int32 {on} must be floating point"),
        (dict(eps=-1e-6), r"eps=-1e-06 must be >= 0"),
        (dict(eps=float("nan")), r"eps=nan must be >= 0"),
    ]  # fmt: skip
    if DEVICE != "cpu":
        cases.append((dict(w=torch.ones(64)), r"inputs are on different devices: x on cuda(:\d+)?, weight on cpu"))
    if residual:
        cases += [
            (dict(r=torch.randn(4, 64, device=DEVICE).half()), r"residual \(4, 64\) float16 .* must match x"),
            (dict(r=torch.randn(4, 32, **bf16)), r"residual \(4, 32\) bfloat16 .* must match x"),
        ]  # fmt: skip
    if quant:
        cases += [
            (dict(rule=2), r"rule=2 is not a QuantRule"),
            (dict(eps_tensor=torch.full((1,), 1e-6)), r"eps_tensor \(1,\) float32 on cpu must be a 0-d"),
        ]
        if DEVICE != "cpu":
            cases.append((dict(eps_tensor=torch.tensor(1e-6, device=DEVICE)), r"eps_tensor \(\) float32 on cuda"))
    return cases


@gpu_test
@pytest.mark.parametrize("form", range(4), ids=["norm", "fused_add", "norm_mxfp8", "fused_add_mxfp8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bad_input_is_refused_on_the_device(family, form):
    """Each norm op, called by name on the device, refuses what the op checks refuse (the CUDA impls
    check before they launch): `MxfuseInputError` naming the op, the shapes and the dtypes."""
    name, op = NORM_OPS[family][form], norm_ops(family)[form]
    residual, quant = form % 2 == 1, form >= 2
    good = dict(x=torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE), w=torch.ones(64, device=DEVICE), eps=EPS)
    good["r"] = torch.randn(4, 64, dtype=torch.bfloat16, device=DEVICE)

    def call(x, r, w, eps, **kw):
        return op(x, r, w, eps, **kw) if residual else op(x, w, eps, **kw)

    call(**good)  # the good arguments pass
    for replaced, message in bad_inputs(residual, quant):
        with pytest.raises(MxfuseInputError, match=rf"mxfuse::{name}: .*{message}"):
            call(**{**good, **replaced})


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
@pytest.mark.parametrize("residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("k", kparams(6144, 3072, 160))
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariance(family, k, residual, swizzled):
    probes_x, probes_r = special_rows(PROBES, k, seed=99)
    w = weight(family, k)
    # reference: each probe row alone (M = 1)
    alone = []
    for i in range(PROBES):
        o = fused(family, probes_x[i : i + 1], probes_r[i : i + 1] if residual else None, w, swizzled)
        alone.append(_row_outputs(o, slice(0, 1), 1, k, swizzled))
    alone = [torch.cat(ts) if ts[0] is not None else None for ts in zip(*alone)]
    for m in (1, 7, 64, 257, 4096, 16384):
        n = min(m, PROBES)
        fill_x, fill_r = special_rows(m, k, seed=m, start_kind=3)
        # the probes sit at the END of the batch, so their row index inside a 128-row
        # scale tile (and inside a multi-row program tile) changes with M
        fill_x[m - n :] = probes_x[:n]
        fill_r[m - n :] = probes_r[:n]
        r = fill_r if residual else None
        out = fused(family, fill_x, r, w, swizzled)
        got = _row_outputs(out, slice(m - n, m), m, k, swizzled)
        exp = tuple(None if t is None else t[:n] for t in alone)
        assert_outputs(got, exp, f"{family} K={k} M={m} batch vs alone")
        # unfused at this M: bitwise equal to fused at this M
        assert_outputs(out, unfused(family, fill_x, r, w, swizzled), f"{family} K={k} M={m} fused vs unfused")
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


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


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


def assert_norm_bound(got: torch.Tensor, expected: torch.Tensor, what: str):
    """y of one rounding vs the CPU reference: within NORM_MAX_ULP, at most NORM_MAX_DIFF_FRACTION
    of the elements differing; NaN where the reference is NaN."""
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    d = _ulp_distance(got[~nan], expected[~nan])
    frac = (d > 0).float().mean().item() if d.numel() else 0.0
    print(f"{what}: max ulp {int(d.max()) if d.numel() else 0}, differing fraction {frac:.2e}")
    assert d.numel() == 0 or int(d.max()) <= NORM_MAX_ULP, f"{what}: {int(d.max())} ulp"
    assert frac <= NORM_MAX_DIFF_FRACTION, f"{what}: {frac:.3%} of elements differ"


@gpu_test
@pytest.mark.parametrize("round_normalized", [False, True], ids=["fp32", "round_normalized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k", kparams(64, 160, 3072, 6144))
@pytest.mark.parametrize("family", FAMILIES)
def test_norm_matches_cpu_reference(family, k, dtype, round_normalized):
    """The norm kernels vs. the CPU reference: residual_out bitwise but NaN payloads (the GPU add
    returns the canonical NaN); y (plain, fused-add, and the fused op's) within one ulp, <= 2% of
    the elements differing; with round_normalized, two roundings: the normalized value is within
    one ulp (sum order, approximate rsqrt), and one ulp of it times w is under two ulps of y."""
    x, r = special_rows(300, k, dtype=dtype, seed=5)
    if dtype == torch.float16:  # keep the fp16 data finite except the planted NaN / Inf rows
        x = torch.where(x.abs() > 1e4, x.sign() * 1e4, x)
    w = weight(family, k, dtype)
    norm, add_norm = norm_ops(family)[:2]
    y, res = add_norm(x, r, w, EPS, round_normalized)
    ry, rres = add_norm(x.cpu(), r.cpu(), w.cpu(), EPS, round_normalized)
    nan = rres.isnan()
    assert torch.equal(res.cpu().isnan(), nan)
    assert_bitwise(res.cpu()[~nan], rres[~nan], "residual_out")
    yp, ryp = norm(x, w, EPS, round_normalized), norm(x.cpu(), w.cpu(), EPS, round_normalized)
    y_fused = fused(family, x, r, w, False, round_normalized=round_normalized)[3]
    for got, exp, what in ((y, ry, "add"), (yp, ryp, "plain"), (y_fused, ry, "fused add")):
        what = f"{family} K={k} {dtype} {what}"
        if round_normalized:
            assert_within_one_ulp(got.cpu(), exp, ulps=2)
        else:
            assert_norm_bound(got.cpu(), exp, what)


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("k", kparams(160, 3072, 6144))
@pytest.mark.parametrize("family", FAMILIES)
def test_round_normalized_kernels(family, k, swizzled):
    """`round_normalized` (the standard Hugging Face order, `w * (s * rstd).to(dtype)`): fused == the
    same norm kernel then the quant kernel, bitwise, for the default dispatch and the split config,
    plain and add (Gemma: offset 1, and offset 0 on an fp32 `1 + w`); and with a weight of ones
    (offset 0, so y is the rounded normalized value itself) y obeys the norm's CPU bound against
    `(s * rsqrt(mean(s*s) + eps)).to(dtype)` computed here in fp32."""
    needs_kernels()
    from mxfuse.ops import triton_norm_quant as tnq

    split = kernel_variants().variant("native-split", k)
    w = weight(family, k)
    for m in (1, 37, 300):
        x, r = special_rows(m, k, seed=5 * k + m)
        forms = ((r, w, 1.0), (None, w.float() + 1.0, 0.0)) if family == "gemma" else ((r, w, 0.0), (None, w, 0.0))
        for res, wf, offset in forms:
            for cfg in (None, split):
                kw = dict(weight_offset=offset, round_normalized=True, config=cfg)
                got = tnq.fused_norm_quant(x, res, wf, EPS, swizzled=swizzled, emit_y=True, **kw)
                y, res_n = tnq.gemma_norm(x, res, wf, EPS, **kw)
                what = f"{family} K={k} M={m} res={res is not None} offset={offset} split={cfg is not None}"
                assert_outputs(got, (*tnq.quantize(y, swizzled), res_n, y), what)
                plain = tnq.gemma_norm(x, res, wf, EPS, weight_offset=offset, config=cfg)[0]
                assert not torch.equal(bits(plain), bits(y)), f"{what}: the flag changed nothing"
        if family == "standard":
            ones = torch.ones(k, device=DEVICE, dtype=torch.bfloat16)
            y = tnq.gemma_norm(x, None, ones, EPS, weight_offset=0.0, round_normalized=True)[0].cpu()
            s = x.cpu().float()
            want = (s * torch.rsqrt((s * s).mean(dim=-1, keepdim=True) + EPS)).to(x.dtype)
            nan = want.isnan() | want.isinf()
            assert torch.equal(y.isnan() | y.isinf(), nan)
            assert int(_ulp_distance(y[~nan], want[~nan]).max()) <= NORM_MAX_ULP, f"K={k} M={m}"


# ------------------------------------------------------------------ row-packed outputs


@gpu_test
@pytest.mark.parametrize("residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("m", [0, 1, 37, 4096])
@pytest.mark.parametrize("k", kparams(160, 6144))
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_ops_equal_unpacked(family, k, m, residual):
    """The packed ops (kernels writing codes + row-major scales straight into the halves of a
    `[M, K + K/32]` byte buffer), with the family's weight offset, give the family's fused op's
    bits, on the special rows; round_sum and round_normalized reach the kernel too."""
    from mxfuse.ops import packed

    x, r = special_rows(m, k, seed=3 * k + m)
    w = weight(family, k)
    offset = WEIGHT_OFFSET[family]
    for emit_y in (False, True):
        if residual:
            p, res, y = ops.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, EPS, emit_y, False, offset)
            got = (*packed.unpack(p, k), res, y)
        else:
            p, y = ops.gemma_rmsnorm_mxfp8_packed(x, w, EPS, emit_y, offset)
            got = (*packed.unpack(p, k), None, y)
        assert p.shape == (m, k + k // 32) and p.dtype == torch.uint8
        ref = fused(family, x, r if residual else None, w, False, emit_y=emit_y)
        assert_outputs(got, ref, f"{family} K={k} M={m} residual={residual} emit_y={emit_y} packed")
    if residual:
        # Gemma: an fp32 `1 + w` with offset 0
        wr, ref_kw = (w.float() + 1.0, dict(weight_offset=0.0)) if family == "gemma" else (w, {})
        for rn in (False, True):
            p, res, y = ops.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, wr, EPS, True, True, 0.0, rn)
            ref = fused(family, x, r, wr, False, round_sum=True, round_normalized=rn, **ref_kw)
            assert_outputs((*packed.unpack(p, k), res, y), ref, f"{family} K={k} M={m} round_sum rn={rn} packed")


@gpu_test
@pytest.mark.parametrize("m", [0, 1, 37, 4096])
@pytest.mark.parametrize("k", kparams(160, 6144))
def test_packed_quant_equals_unpacked(k, m):
    """The quant alone into a packed buffer, on the special rows with NaN / Inf (and on the residual rows)."""
    from mxfuse.ops import packed

    for src in special_rows(m, k, seed=3 * k + m):
        p = ops.mxfp8_quantize_packed(src)
        assert_bitwise(packed.unpack(p, k), ops.mxfp8_quantize(src, False), f"K={k} M={m} quant packed")


@gpu_test
def test_out_views_are_written_in_place():
    needs_kernels()
    from mxfuse.ops import triton_norm_quant as tnq

    m, k = 37, 160
    x, r = special_rows(m, k, seed=5)
    w = weight("gemma", k)
    buf = torch.full((m, k + k // 32 + 8), 0xAB, dtype=torch.uint8, device=DEVICE)  # wider: bytes past the scales stay
    oc, os_ = buf[:, :k].view(torch.float8_e4m3fn), buf[:, k : k + k // 32]
    c, s, res, _ = tnq.fused_norm_quant(x, r, w, EPS, out_codes=oc, out_scales=os_)
    assert c.data_ptr() == oc.data_ptr() and s.data_ptr() == os_.data_ptr()
    assert_bitwise((c, s, res), fused("gemma", x, r, w, False, emit_y=False)[:3], "out views")
    assert bool((buf[:, k + k // 32 :] == 0xAB).all())
    c2, s2 = tnq.quantize(x, out_codes=oc, out_scales=os_)
    assert_bitwise((c2, s2), ops.mxfp8_quantize(x, False), "quantize out views")
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
    programs, two rows per tile); y is within the CPU-reference bound. The Gemma weight (the
    weight offset is a value of the kernel, not code: the standard norm runs the same code)."""
    needs_kernels()
    from mxfuse.ops import triton_norm_quant as tnq

    kv = kernel_variants()
    w = weight("gemma", k)
    failures = []  # every variant is checked (one failing variant must not hide the others)
    for m in (1, 37, 4096):
        x, r = special_rows(m, k, seed=17 * k + m)
        r = r if has_res else None
        by_arith = {}
        for name in kv.VARIANTS:
            cfg = kv.variant(name, k)
            try:
                got, want = _variant_outputs(tnq, cfg, x, r, w, swizzled)
                assert_outputs(got, want, f"{name} K={k} M={m} fused vs unfused")
                # without y (the bf16x2 variant rounds y in registers only then)
                no_y = tnq.fused_norm_quant(x, r, w, EPS, swizzled=swizzled, config=cfg)
                assert_outputs(no_y, want, f"{name} K={k} M={m} fused (no y) vs unfused", emit_y=False)
                first = by_arith.setdefault((cfg.tree, cfg.rsqrt, kv.layout_of(name, k)), (name, got))
                assert_outputs(got, first[1], f"{name} vs {first[0]} K={k} M={m}")
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
                    want_rows = _row_outputs(alone, slice(0, 1), 1, k, swizzled)
                    assert_outputs(got_rows, want_rows, f"{name} K={k} M={m} alone")
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
    for name in kv.VARIANTS:  # every variant keeps the default row layout of its K (or the one it names)
        for k in (160, 2048, 3072, 6144):
            cfg = kv.variant(name, k)
            if name in kv.DISPATCH and kv.DISPATCH[name][1] is not None:
                bm, warps, chunk_cols = kv.wide_chunk_layout(k, kv.DISPATCH[name][1])
                assert (cfg.block_rows, cfg.chunk_cols) == (bm, chunk_cols), (name, k)
            else:
                warps = kv.norm_config(k).num_warps * kv.WARPS_FACTOR.get(name, 1)
                assert cfg.chunk_cols == 0, (name, k)
            assert cfg.num_warps == warps and kv.variant_of(cfg, k) is not None, (name, k)
            # the row layout is a function of K only: the same at every M (batch invariance)
            for m in (1, 64, 1024, 16384):
                for plain in (False, True):
                    at_m = kv.variant(name, k, m, plain_quant=plain)
                    assert (at_m.num_warps, at_m.chunk_cols) == (cfg.num_warps, cfg.chunk_cols), (name, k, m)
                    assert at_m.block_rows == cfg.block_rows or name not in kv.DISPATCH, (name, k, m)


# ------------------------------------------------------------------ swizzled padding


@gpu_test
@pytest.mark.parametrize("padding", ["fill", "norm"])
@pytest.mark.parametrize("m", [1, 37, 128, 130])
def test_swizzled_padding_is_written_zero(m, padding):
    """The F8_128x4 padding rows (M .. pad128(M)) hold zero scale bytes even when the
    buffer was full of garbage: the fill programs (or the padding rows' norm) write them."""
    needs_kernels()
    from mxfuse.ops import triton_norm_quant as tnq

    k = 160  # S = 5: pad4 makes 3 padding columns too
    x, r = special_rows(m, k, seed=m)
    w = weight("gemma", k)
    mp, sp = padded_scales_shape(m, k)
    for split in (1, 2):
        cfg = kernel_variants().variant("native-split" if split > 1 else "native", k).replace(scale_padding=padding)
        poison = torch.full((mp, sp), 0xAB, dtype=torch.uint8, device=DEVICE)
        del poison  # the caching allocator hands this block to the next allocation of this size
        _, scales, _, _ = tnq.fused_norm_quant(x, r, w, EPS, swizzled=True, config=cfg)
        assert scales.shape == (mp, sp)
        want = reference.swizzle_scales(reference.quantize_rows(tnq.gemma_norm(x, r, w, EPS, config=cfg)[0].cpu())[1])
        assert_bitwise(scales.cpu(), want, f"M={m} {padding} split={split} scales")


# ------------------------------------------------------------------ the TORCHAO quant rule


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
    needs_kernels()
    from mxfuse.ops import triton_norm_quant as tnq

    x = rule_blocks(m, k, dtype, seed=m + k)
    rc, rs = reference.quantize_rows(x.cpu(), TORCHAO)
    assert (rs == 255).any() and ((rs == 0).any() or dtype == torch.float16)  # both rule-specific cases
    for swz in (False, True):
        codes, scales = tnq.quantize(x, swz, rule=TORCHAO)
        want_s = reference.swizzle_scales(rs) if swz else rs
        assert_bitwise(scales.cpu(), want_s, f"scales swz={swz}")
        assert_bitwise(nan_free_bits(codes.cpu()), nan_free_bits(rc), f"codes swz={swz}")
    _, ds = tnq.quantize(x, False, rule=DEFAULT)
    assert_bitwise(ds.cpu(), reference.quantize_rows(x.cpu())[1], "default rule scales")


@gpu_test
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("k", kparams(160, 6144))
@pytest.mark.parametrize("family", FAMILIES)
def test_torchao_rule_fused_equals_unfused(family, k, residual, swizzled):
    """Fused norm + quant with the TORCHAO rule == the norm then the quant with the rule, bitwise
    (NaN codes included: same GPU arithmetic): the ops by name (the default dispatch), and the
    kernels in the split / pad-norm variants; and == the CPU reference rule applied to the fused
    kernel's own y (NaN signs aside)."""
    needs_kernels()
    from mxfuse.ops import triton_norm_quant as tnq

    w = weight(family, k)
    kv = kernel_variants()
    for m in (1, 37, 300):
        x, r = special_rows(m, k, seed=3 * k + m)
        # rows of kind 2 carry FLT_MIN blocks, and the Gemma weight's first block has 1 + w = 2**-8:
        # y in the rule's scale-byte-0 range
        r = r if residual else None
        outputs = {"ops": fused(family, x, r, w, swizzled, rule=TORCHAO)}
        expected = unfused(family, x, r, w, swizzled, rule=TORCHAO)
        assert_outputs(outputs["ops"], expected, f"{family} K={k} M={m} ops")
        no_y = fused(family, x, r, w, swizzled, emit_y=False, rule=TORCHAO)
        assert_outputs(no_y, expected, f"{family} K={k} M={m} ops no y", emit_y=False)
        for cfg in (kv.variant("native-split", k), kv.variant("native-padnorm", k)):
            what = f"{family} K={k} M={m} cfg={kv.variant_of(cfg, k)}"
            kw = dict(config=cfg, rule=TORCHAO, weight_offset=WEIGHT_OFFSET[family])
            got = tnq.fused_norm_quant(x, r, w, EPS, swizzled=swizzled, emit_y=True, **kw)
            y_n, res_n = tnq.gemma_norm(x, r, w, EPS, config=cfg, weight_offset=WEIGHT_OFFSET[family])
            uc, us = tnq.quantize(y_n, swizzled, rule=TORCHAO)
            assert_outputs(got, (uc, us, res_n, y_n), what)
            no_y = tnq.fused_norm_quant(x, r, w, EPS, swizzled=swizzled, **kw)
            assert_outputs(no_y, (uc, us, res_n, y_n), what + " no y", emit_y=False)
            outputs[what] = got
        for what, (codes, scales, _, y) in outputs.items():
            rc, rs = reference.quantize_rows(y.cpu(), TORCHAO)
            assert_bitwise(scales.cpu(), reference.swizzle_scales(rs) if swizzled else rs, f"{what} scales vs CPU rule")
            assert_bitwise(nan_free_bits(codes.cpu()), nan_free_bits(rc), f"{what} codes vs CPU rule")


def test_rule_values_are_checked():
    pytest.importorskip("triton")
    from mxfuse.ops import triton_norm_quant as tnq

    assert tnq.rule_name(0) == "default" and tnq.rule_name(TORCHAO) == "torchao"
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="rule"):
            tnq.rule_name(bad)
