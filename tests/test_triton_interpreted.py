"""Triton kernels that only move bytes, run by Triton's interpreter on CPU.

The interpreter rounds fp8 casts and bf16 arithmetic unlike a GPU (docs/design.md, "Fidelity"),
so it proves nothing about the norm, quant or GEMM kernels; a kernel of uint8 loads and
stores has no rounding, and there it is exact: the index math of the CUDA swizzle kernel
is checked in CI, not only when a GPU is lent. The interpreter is chosen when Triton
decorates a kernel, so the check runs in a fresh interpreter process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK_SWIZZLE = textwrap.dedent(
    """
    import itertools, sys
    import torch
    from mxfuse.ops import reference, triton_mx_quant, triton_norm_quant

    triton_mx_quant.SWIZZLE_BLOCK_COLS = int(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    for m, s in itertools.product([1, 2, 127, 128, 129, 300], [1, 3, 4, 5, 16, 17, 192, 200]):
        packed = torch.randint(0, 255, (m, s + 40), generator=g, dtype=torch.uint8)
        for scales in (packed[:, 40:].contiguous(), packed[:, 40:]):  # dense, and a view of a packed row
            out = triton_norm_quant.swizzle_scales(scales)
            want = reference.swizzle_scales(scales.contiguous())
            assert torch.equal(out, want), (m, s, scales.stride(), (out != want).nonzero()[:4].tolist())
    print("ok")
    """
)


@pytest.mark.parametrize("block_cols", [4, 16])
def test_swizzle_kernel_matches_the_reference(block_cols):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", CHECK_SWIZZLE, str(block_cols)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
