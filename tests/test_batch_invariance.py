"""Batch invariance of the CPU ops: a row's bits never depend on how many rows share the call.

On CPU this is true by construction (the reference normalizes and quantizes row by row, and the
fused ops call the same reference: tests/norm_families.py), so this is a cheap plumbing check:
the probe row, last in batches of M = 1, 7 and 130 (two 128-row tiles of the swizzled scales), gets
the same codes, scales, residual_out and y each time, in both layouts and both families, and
fused == unfused at every M. The arithmetic claim, at M up to 16384, is the GPU kernels' test
(tests/test_gpu_norms.py, test_batch_invariance).
"""

from __future__ import annotations

import pytest
import torch
from norm_families import FAMILIES, family_weight, fused, unfused

from mxfuse.ops import reference
from mxfuse.ops.mx_layout import scale_columns
from mxfuse.testing import assert_bitwise

BATCHES = (1, 7, 130)
K = 160


def rows(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16) * 3


def row_major(out, m: int, swizzled: bool) -> list[torch.Tensor]:
    """The outputs with the scales in row-major order (a swizzled row's scales sit in its tile)."""
    codes, scales, *rest = out
    if swizzled:
        scales = reference.unswizzle_scales(scales, m, scale_columns(K))
    return [codes, scales, *rest]


@pytest.mark.parametrize("add", [True, False], ids=["fused_add", "plain"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_gets_the_same_bits_in_every_batch(family, add, swizzled):
    weight = family_weight(family, K, seed=3)
    round_normalized = family == "standard"  # vLLM's and Hugging Face's standard form
    probe, probe_res = rows(1, 1), rows(1, 2)
    expected = None
    for m in BATCHES:
        x = torch.cat([rows(m - 1, 10 + m), probe])
        residual = torch.cat([rows(m - 1, 20 + m), probe_res]) if add else None
        out = fused(family, x, residual, weight, 1e-6, swizzled, round_normalized=round_normalized)
        assert_bitwise(out, unfused(family, x, residual, weight, 1e-6, swizzled, round_normalized=round_normalized))
        probe_out = [t[-1:] for t in row_major(out, m, swizzled)]
        if expected is None:
            expected = probe_out
        assert_bitwise(probe_out, expected)
