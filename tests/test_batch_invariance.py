"""Batch invariance on CPU: a row's bits never depend on how many rows share the call.

The same rows are computed inside batches of M = 1 ... 16384 (other rows random), and
every output (codes, scales, residual_out, y) of those rows must be identical; fused
and unfused must agree at every M. The Triton kernels get the same test on the GPU
(tests/test_gpu_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

import mxfuse  # noqa: F401
from mxfuse.ops import reference
from mxfuse.ops.mx_layout import scale_columns
from mxfuse.testing import assert_bitwise

mx = torch.ops.mxfuse
BATCHES = (1, 7, 64, 257, 4096, 16384)
PROBE_ROWS = 1  # the rows followed through every batch size (batch 1 holds only them)


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16) * 3


def outputs(x, residual, weight, swizzled, fused):
    """(codes, row-major scales, residual_out, y) of every row."""
    if fused:
        if residual is None:
            codes, scales, y = mx.gemma_rmsnorm_mxfp8(x, weight, 1e-6, swizzled, True)
            residual_out = None
        else:
            codes, scales, residual_out, y = mx.gemma_fused_add_rmsnorm_mxfp8(x, residual, weight, 1e-6, swizzled, True)
    else:
        if residual is None:
            y, residual_out = mx.gemma_rmsnorm(x, weight, 1e-6), None
        else:
            y, residual_out = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        codes, scales = mx.mxfp8_quantize(y, swizzled)
    if swizzled:
        scales = reference.unswizzle_scales(scales, x.shape[0], scale_columns(x.shape[1]))
    return [t for t in (codes, scales, residual_out, y) if t is not None]


@pytest.mark.parametrize("k", [6144, 3072, 160])
@pytest.mark.parametrize("add", [True, False], ids=["fused_add", "plain"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_rows_get_the_same_bits_in_every_batch(k, add, swizzled):
    weight = (0.1 * torch.randn(k, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    assert_probe_rows_invariant(k, add, lambda x, residual, fused: outputs(x, residual, weight, swizzled, fused=fused))


def assert_probe_rows_invariant(k, add, run):
    """The probe rows, last in batches of every size in BATCHES, get the same bits each time, and
    `run(x, residual, fused=True)` equals `run(..., fused=False)` bitwise at every size."""
    probe, probe_res = rows(PROBE_ROWS, k, 1), rows(PROBE_ROWS, k, 2)
    expected = None
    for m in BATCHES:
        x = torch.cat([rows(m - PROBE_ROWS, k, 10 + m), probe]) if m > PROBE_ROWS else probe
        residual = torch.cat([rows(m - PROBE_ROWS, k, 20 + m), probe_res]) if m > PROBE_ROWS else probe_res
        residual = residual if add else None
        fused = run(x, residual, fused=True)
        assert_bitwise(fused, run(x, residual, fused=False))
        probe_out = [t[-PROBE_ROWS:] for t in fused]
        if expected is None:
            expected = probe_out
        assert_bitwise(probe_out, expected)


def standard_outputs(x, residual, weight, round_normalized, fused):
    """(codes, scales, residual_out, y) of every row through the standard-norm ops (row-major scales)."""
    if fused:
        if residual is None:
            codes, scales, y = mx.rms_norm_mxfp8(x, weight, 1e-6, emit_y=True, round_normalized=round_normalized)
            return [codes, scales, y]
        out = mx.fused_add_rms_norm_mxfp8(x, residual, weight, 1e-6, emit_y=True, round_normalized=round_normalized)
        return list(out)
    if residual is None:
        y = mx.rms_norm(x, weight, 1e-6, round_normalized)
        return [*mx.mxfp8_quantize(y), y]
    y, residual_out = mx.fused_add_rms_norm(x, residual, weight, 1e-6, round_normalized)
    return [*mx.mxfp8_quantize(y), residual_out, y]


@pytest.mark.parametrize("add", [True, False], ids=["fused_add", "plain"])
@pytest.mark.parametrize("round_normalized", [False, True], ids=["fp32", "round_normalized"])
def test_standard_norm_rows_get_the_same_bits_in_every_batch(add, round_normalized):
    """The standard RMSNorm: the same reduction tree, so the same invariance."""
    k = 3072
    weight = torch.randn(k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert_probe_rows_invariant(
        k, add, lambda x, residual, fused: standard_outputs(x, residual, weight, round_normalized, fused=fused)
    )
