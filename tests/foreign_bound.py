"""The bound stated for foreign norms (docs/design.md "Fidelity", README "Numerics"), as a test helper.

The replacement computes the norm in mxfuse's reduction order, so its `y` may differ from
the replaced kernel's by one ulp. What that allows downstream, precisely:

- bf16/fp16 tensors (`y`, `residual_out`): within one ulp (+0 and -0 are neighbours, NaN
  where the other is NaN);
- E8M0 scales: equal, or one apart where the block's amax sits at an exact power-of-two
  boundary: the block of the finer scale then has a largest code of exactly 448 and the
  block of the coarser one exactly 224 (one ulp of bf16 around `448 * 2**k` decides);
- fp8 codes: the decoded values `code * 2**(scale - 127)` within one e4m3 step at the
  coarser of the two scales. With equal scales that is "codes within one step"; where the
  scales differ, the codes of that block differ by a whole exponent (8 code points) while
  their values agree within that step.
"""

from __future__ import annotations

import torch

from mxfuse.ops import reference

FP8 = torch.float8_e4m3fn


def assert_within_foreign_bound(actual, expected, *, swizzled: bool | None = None):
    """Compare output tuples: each fp8 codes tensor with the scales tensor right after it.

    `swizzled` says the scales' layout where the shapes cannot (M a multiple of 128 and
    K/32 of 4 give row-major and F8_128x4 scales one shape)."""
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected)
    i = 0
    while i < len(actual):
        a, e = actual[i], expected[i]
        assert a.shape == e.shape and a.dtype == e.dtype, (i, a.shape, e.shape, a.dtype, e.dtype)
        if a.dtype == FP8:
            sa, se = actual[i + 1], expected[i + 1]
            assert sa.shape == se.shape and sa.dtype == se.dtype == torch.uint8
            assert_codes_within_bound(a, sa, e, se, swizzled)
            i += 2
            continue
        if a.dtype == torch.uint8:
            raise AssertionError(f"output {i}: scales without codes before them")
        assert_within_one_ulp(a, e)
        i += 1


def assert_within_one_ulp(a: torch.Tensor, e: torch.Tensor, ulps: int = 1):
    """bf16/fp16: within `ulps` ulps (one unless a bound says more), ordering values by their
    bits (so -0 and +0 are one apart)."""
    assert a.element_size() == 2, a.dtype
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(e)), "NaN positions differ"
    oa, oe = _ordered(a.view(torch.int16).int()), _ordered(e.view(torch.int16).int())
    diff = (oa - oe).abs()[~nan]
    assert diff.numel() == 0 or int(diff.max()) <= ulps, f"{int(diff.max())} ulps apart"


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_codes_within_bound(codes_a, scales_a, codes_e, scales_e, swizzled: bool | None = None):
    k = codes_a.shape[-1]
    ca, ce = codes_a.reshape(-1, k // 32, 32), codes_e.reshape(-1, k // 32, 32)
    m = ca.shape[0]
    sa, se = (_row_major(s, m, k // 32, swizzled).int() for s in (scales_a, scales_e))
    assert int((sa - se).abs().max()) <= 1 if sa.numel() else True, "scales more than one apart"
    va, ve = ca.float(), ce.float()
    nan = torch.isnan(va)
    assert torch.equal(nan, torch.isnan(ve)), "NaN codes differ in position"
    coarse = torch.maximum(sa, se)
    # values in units of the coarser scale (exact: powers of two)
    ua = va * torch.exp2((sa - coarse).float()).unsqueeze(-1)
    ue = ve * torch.exp2((se - coarse).float()).unsqueeze(-1)
    step = _e4m3_step(torch.maximum(ua.abs(), ue.abs()))
    off = ((ua - ue).abs() > step) & ~nan
    assert not off.any(), f"{int(off.sum())} codes more than one e4m3 step apart"
    moved = sa != se
    if moved.any():
        fine = torch.where(sa < se, va.abs().nan_to_num(0).amax(-1), ve.abs().nan_to_num(0).amax(-1))[moved]
        coarse_max = torch.where(sa < se, ve.abs().nan_to_num(0).amax(-1), va.abs().nan_to_num(0).amax(-1))[moved]
        assert bool((fine == 448).all() and (coarse_max == 224).all()), (
            "scales differ at a block whose amax is not at a power-of-two boundary",
            fine.tolist(),
            coarse_max.tolist(),
        )


def _e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values at magnitude `v` (subnormal below 2**-6: 2**-9)."""
    exponent = torch.floor(torch.log2(v.clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3)


def _row_major(scales: torch.Tensor, m: int, s: int, swizzled: bool | None) -> torch.Tensor:
    """Row-major `[M, S]` scales from row-major `[..., S]`, F8_128x4 `[pad128(M), pad4(S)]` or flat."""
    mp, sp = (m + 127) // 128 * 128, (s + 3) // 4 * 4
    row_major = scales.numel() == m * s and scales.shape[-1] == s
    if swizzled is None:
        assert not (row_major and scales.numel() == mp * sp), "scales layout ambiguous: pass swizzled="
        swizzled = not row_major
    if not swizzled:
        return scales.reshape(m, s)
    return reference.unswizzle_scales(scales.reshape(mp, sp), m, s)
