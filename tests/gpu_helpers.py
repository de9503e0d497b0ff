"""What the GPU test files share: the device, the `gpu` mark, K parameters for pytest-xdist, hard rows.

GPU tests are marked `gpu` and skipped without CUDA; modules using these helpers collect on a
CPU-only machine. MXFUSE_TEST_DEVICE=cpu runs their assertions on the CPU reference impls: a
self-check of a test file's logic on a machine without a GPU (it proves nothing about the kernels).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = os.environ.get("MXFUSE_TEST_DEVICE", "cuda")
FLT_MIN = torch.finfo(torch.float32).tiny
N_KINDS = 8


def gpu_test(fn):
    """Mark a test `gpu` and skip it without CUDA (unless MXFUSE_TEST_DEVICE points elsewhere)."""
    skip = DEVICE == "cuda" and not HAS_CUDA
    return pytest.mark.gpu(pytest.mark.skipif(skip, reason="needs a CUDA GPU")(fn))


def kparams(*ks):
    """K values; with pytest-xdist each K is its own group (one worker compiles one K's kernels)."""
    if importlib.util.find_spec("xdist") is None:
        return list(ks)
    return [pytest.param(k, marks=pytest.mark.xdist_group(f"k{k}")) for k in ks]


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
