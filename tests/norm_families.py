"""The two norm families of the suite, and the one fused / unfused pair of the CPU op tests.

- "gemma": `normalize(x) * (1 + w)`, the `gemma_*` ops (weight offset 1);
- "standard": `normalize(x) * w`, the `rms_norm` / `fused_add_rms_norm` ops (no offset argument: 0).

On CPU a fused op's impl calls the same reference functions as the unfused pair
(`ops/library.py`, `_norm_quant`), so `fused == unfused` there checks the plumbing only: which
output goes where, shapes, the scale layout, `emit_y`, and that each op hands its family's
arguments (weight offset, `round_normalized`, `round_sum`) to the reference. The arithmetic of the
kernels is checked on the GPU (tests/test_gpu_norms.py) and, where exact, under Triton's
interpreter (tests/test_triton_interpreted.py).
"""

from __future__ import annotations

import torch

import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.testing import assert_bitwise

mx = torch.ops.mxfuse
FAMILIES = ["gemma", "standard"]
FLT_MIN = torch.finfo(torch.float32).tiny


def special_rows(m: int, k: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Random rows with the hard cases of the contract planted in the first rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    cases = [
        lambda r: r.zero_(),  # all-zero row
        lambda r: r[:32].fill_(FLT_MIN).mul_(torch.sign(torch.randn(32, generator=g))),  # smallest normal
        lambda r: r.mul_(3e37),  # huge values
        lambda r: r.__setitem__(3, float("nan")),  # NaN
        lambda r: r.__setitem__(5, float("inf")),  # +Inf
        lambda r: r.__setitem__(7, float("-inf")),  # -Inf
        lambda r: r[:32].mul_(1e4),  # one block dominates
        lambda r: r.mul_(1e-30),  # tiny values
    ]
    for row, case in zip(x, cases):
        case(row)
    return x.to(dtype)


def family_weight(family: str, k: int, dtype=torch.bfloat16, seed: int = 2) -> torch.Tensor:
    """A weight with the family's hard cases: Gemma's `1 + w = 2**-8` block; the standard norm's small
    block and -0 weights (the sign of y's zeros)."""
    g = torch.Generator().manual_seed(seed)
    if family == "gemma":
        w = (0.1 * torch.randn(k, generator=g)).to(dtype)
        w[:32] = 2.0**-8 - 1
    else:
        w = torch.randn(k, generator=g).to(dtype)
        w[:32], w[32:40] = 2.0**-8, -0.0
    return w


def unfused(family, x, residual, weight, eps, swizzled, *, round_sum=False, round_normalized=False):
    """The project's unfused pair: the family's norm op (or its fused-add form), then the quant;
    `(codes, scales[, residual_out], y)`. `round_sum`: the add rounded to the model dtype first."""
    norm, add_norm = (
        (mx.gemma_rmsnorm, mx.gemma_fused_add_rmsnorm) if family == "gemma" else (mx.rms_norm, mx.fused_add_rms_norm)
    )
    if residual is None:
        y = norm(x, weight, eps, round_normalized)
        return (*mx.mxfp8_quantize(y, swizzled), y)
    if round_sum:
        residual_out = (x + residual).to(x.dtype)
        y = norm(residual_out, weight, eps, round_normalized)
    else:
        y, residual_out = add_norm(x, residual, weight, eps, round_normalized)
    return (*mx.mxfp8_quantize(y, swizzled), residual_out, y)


def fused(family, x, residual, weight, eps, swizzled, *, round_sum=False, round_normalized=False, emit_y=True):
    """The family's fused op. The standard ops are also checked against the Gemma-named ones with
    `weight_offset=0.0` (the same impls: one arithmetic)."""
    kw = {"emit_y": emit_y, "round_normalized": round_normalized}
    if residual is not None:
        kw["round_sum"] = round_sum
    if family == "gemma":
        if residual is None:
            return mx.gemma_rmsnorm_mxfp8(x, weight, eps, swizzled, **kw)
        return mx.gemma_fused_add_rmsnorm_mxfp8(x, residual, weight, eps, swizzled, **kw)
    if residual is None:
        out = mx.rms_norm_mxfp8(x, weight, eps, swizzled, **kw)
        assert_bitwise(out, mx.gemma_rmsnorm_mxfp8(x, weight, eps, swizzled, weight_offset=0.0, **kw))
        return out
    out = mx.fused_add_rms_norm_mxfp8(x, residual, weight, eps, swizzled, **kw)
    assert_bitwise(out, mx.gemma_fused_add_rmsnorm_mxfp8(x, residual, weight, eps, swizzled, weight_offset=0.0, **kw))
    return out
