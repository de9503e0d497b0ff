"""GPU tests of the standard RMSNorm form of the norm kernels (docs/design.md, "The standard
RMSNorm, source by source").

What is asserted, on CUDA, through `torch.ops.mxfuse.*`:

- fused vs. unfused project ops: BITWISE (codes, scales, residual_out, y). The fused ops
  with `weight_offset=0.0` against `rms_norm` / `fused_add_rms_norm` then
  `mxfp8_quantize`; plain and fused-add, both scale layouts, with and without emit_y,
  `round_normalized` both ways, bf16 and fp16; on the hard rows of test_gpu_kernels.py
  (zeros, FLT_MIN blocks, huge and overflowing squares, NaN / Inf rows, a dominant
  block), with -0 weights and a 2**-10 weight block. Every K class of the default
  dispatch (`triton_norm_quant.norm_config`: one to four chunks, 1 or more rows per
  tile) and every M regime (split rows at M <= 16, evict_first up to 1024, two rows per
  tile for the plain fused kernel at K 2049..3072 from 4096 rows).
- `round_sum` (a Hugging Face decoder's bf16 add before the norm) with the standard form.
- norm vs. the CPU reference with `round_normalized`: residual_out bitwise, y within one
  ulp (the sum of squares is added in another order).

Runs without vLLM (the GPU image has none). Marked `gpu`, skipped without CUDA;
MXFUSE_TEST_DEVICE=cpu runs the same assertions on the CPU reference (a self-check of
this file, nothing about the kernels).
"""

from __future__ import annotations

import pytest
import torch
from foreign_bound import assert_within_one_ulp
from test_gpu_kernels import DEVICE, EPS, gpu_test, kparams, special_rows

import mxfuse.ops  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.testing import assert_bitwise

ops = torch.ops.mxfuse

# K classes of norm_config: (row padded to block_k, chunks of CH, rows per tile)
#   64: 128 / 1 chunk / 16 rows;  160: 256 / 2 chunks / 8 rows;  1000: 1024 / 4 chunks / 2 rows;
#   3072: 4096 / 3 chunks / 1 row (2 rows for the plain fused kernel from M = 4096);
#   4096: 4096 / 4 chunks;  6144: 8192 / 3 chunks of 2048.
KS = kparams(64, 160, 1024 - 32, 3072, 4096, 6144)
MS = (1, 16, 17, 1024, 1025, 4096)


def standard_weight(k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(3)
    w = torch.randn(k, generator=g)
    w[:8], w[32:64] = -0.0, 2.0**-10
    return w.to(device=DEVICE, dtype=dtype)


def unfused(x, r, w, swizzled, round_normalized):
    if r is None:
        y, res = ops.rms_norm(x, w, EPS, round_normalized), None
    else:
        y, res = ops.fused_add_rms_norm(x, r, w, EPS, round_normalized)
    return (*ops.mxfp8_quantize(y, swizzled), res, y)


def fused(x, r, w, swizzled, round_normalized, emit_y):
    kw = {"weight_offset": 0.0, "round_normalized": round_normalized}
    if r is None:
        codes, scales, y = ops.gemma_rmsnorm_mxfp8(x, w, EPS, swizzled, emit_y, **kw)
        return codes, scales, None, y
    return ops.gemma_fused_add_rmsnorm_mxfp8(x, r, w, EPS, swizzled, emit_y, **kw)


def compare(actual, expected, emit_y: bool, what: str):
    for name, a, e in zip(("codes", "scales", "residual_out"), actual, expected):
        assert (a is None) == (e is None), f"{what} {name}"
        if a is not None:
            assert_bitwise(a, e, f"{what} {name}")
    if emit_y:
        assert_bitwise(actual[3], expected[3], f"{what} y")
    else:
        assert actual[3].numel() == 0, f"{what}: y written without emit_y"


@gpu_test
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused_add"])
@pytest.mark.parametrize("round_normalized", [False, True], ids=["fp32", "round_normalized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_standard_fused_equals_unfused_bitwise(k, residual, round_normalized, dtype):
    w = standard_weight(k, dtype)
    for m in MS:
        x, r = special_rows(m, k, dtype, seed=m)
        r = r if residual else None
        for swizzled in (False, True):
            expected = unfused(x, r, w, swizzled, round_normalized)
            for emit_y in (True, False):
                what = f"K={k} M={m} swizzled={swizzled} emit_y={emit_y}"
                compare(fused(x, r, w, swizzled, round_normalized, emit_y), expected, emit_y, what)


@gpu_test
@pytest.mark.parametrize("k", kparams(160, 3072))
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_standard_round_sum_equals_add_then_norm(k, swizzled):
    """Hugging Face's decoder: `h = residual + x` in bf16, then `weight * normalize(h).to(bf16)`."""
    w = standard_weight(k, torch.bfloat16)
    for m in (1, 37, 4096):
        x, r = special_rows(m, k, seed=m)
        h = ops.fused_add_rms_norm(x, r, w, EPS)[1]  # `r + x` rounded once, the kernel's NaN
        y = ops.rms_norm(h, w, EPS, True)
        expected = (*ops.mxfp8_quantize(y, swizzled), h, y)
        got = ops.gemma_fused_add_rmsnorm_mxfp8(x, r, w, EPS, swizzled, True, True, 0.0, round_normalized=True)
        compare(got, expected, True, f"K={k} M={m}")


@gpu_test
@pytest.mark.parametrize("k", kparams(160, 6144))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused_add"])
def test_round_normalized_norm_against_the_cpu_reference(k, residual):
    x, r = special_rows(300, k, seed=k)
    w = standard_weight(k, torch.bfloat16)
    if residual:
        y, res = ops.fused_add_rms_norm(x, r, w, EPS, True)
        y_ref, res_ref = ops.fused_add_rms_norm(x.cpu(), r.cpu(), w.cpu(), EPS, True)
        nan = torch.isnan(res_ref)  # the GPU returns the canonical NaN, the CPU keeps payloads
        assert torch.equal(torch.isnan(res.cpu()), nan)
        assert_bitwise(res.cpu()[~nan], res_ref[~nan], "residual_out")
    else:
        y, y_ref = ops.rms_norm(x, w, EPS, True), ops.rms_norm(x.cpu(), w.cpu(), EPS, True)
    # Two roundings: the normalized value is within one ulp (sum order, approximate rsqrt), and
    # one ulp of it times w (|w| < 2 ulp-binades) is under two ulps of y (docs/design.md, Fidelity).
    assert_within_one_ulp(y.cpu(), y_ref, ulps=2)
