"""Plain-PyTorch reference implementations: the executable form of the op contracts.

These run on any device and are what the CPU ops dispatch to. The Triton kernels
must reproduce them bit for bit where the contract says bitwise (quantization,
fused vs. unfused) and within the stated tolerance where it does not (the norm's
reduction order on GPU vs. CPU).
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

from mxfuse.ops.mx_layout import (
    BLOCK,
    E8M0_BIAS,
    E8M0_MAX,
    FP8_DTYPE,
    FP8_MAX,
    SCALE_DTYPE,
    SWIZZLE_COLUMN_TILE,
    SWIZZLE_ROW_TILE,
    scale_columns,
    swizzled_scale_shape,
)

_FLT_MIN_BITS = 0x00800000  # smallest normal fp32
_E4M3_MAX_EXP_BITS = 0x600000  # mantissa of 448 = 1.75 * 2**8
E8M0_NAN = 255


class QuantRule(enum.IntEnum):
    """How a block with a NaN, and a block whose scale byte is 0, are encoded.

    The ops take it as an int argument (`rule`); a rewrite picks it from the quant it
    replaces. Every other value encodes the same under both rules (the E8M0 scale is
    the exact `ceil(log2(amax / 448))` rule of docs/design.md, "The E8M0 scale of a block", in both).
    """

    DEFAULT = 0
    """docs/design.md's rule: NaN takes no part in the amax (only the NaN element encodes as
    NaN); a block with scale byte 0 is multiplied by 2**127 (its codes keep their bits)."""
    TORCHAO = 1
    """torchao's RCEIL (`_to_mx_rceil`): a NaN makes the whole block NaN (scale byte 255,
    all 32 codes NaN); a block with scale byte 0 is multiplied by 1.0 (codes flush to 0)."""


def e8m0_scale_from_amax(amax: Tensor) -> Tensor:
    """`clamp(ceil(log2(max(amax, FLT_MIN) / 448)) + 127, 0, 254)`, computed exactly.

    Float `log2` is not exact near powers of two (and is approximate on GPUs), so the
    ceiling is derived from the bits of amax: with `amax = m * 2**E`, `m` in [1, 2),
    `amax / 448 = (m / 1.75) * 2**(E - 8)`, whose log2 ceiling is `E - 8` if
    `m <= 1.75`, else `E - 7`. NaN amax must be removed by the caller; +Inf gives 254.
    """
    bits = amax.float().clamp_min(torch.finfo(torch.float32).tiny).view(torch.int32)
    biased_exp = bits >> 23
    above = ((bits & 0x7FFFFF) > _E4M3_MAX_EXP_BITS).to(torch.int32)
    sb = biased_exp - 8 + above
    sb = torch.where(biased_exp == 255, E8M0_MAX, sb)  # +Inf amax
    return sb.clamp(0, E8M0_MAX).to(SCALE_DTYPE)


def e8m0_multiplier(sb: Tensor) -> Tensor:
    """`2**(127 - sb)` as fp32, built from bits (never a division by a subnormal)."""
    e = E8M0_MAX - sb.to(torch.int32)  # biased exponent of 2**(127 - sb)
    normal = (e.clamp_min(1) << 23).view(torch.float32)
    return torch.where(e == 0, torch.full_like(normal, 2.0 ** (E8M0_BIAS - E8M0_MAX)), normal)


def e8m0_to_float(sb: Tensor) -> Tensor:
    """`2**(sb - 127)` as fp32 (exact for sb in [1, 254]; sb = 0 is 2**-127, subnormal)."""
    e = sb.to(torch.int32)
    normal = (e.clamp_min(1) << 23).view(torch.float32)
    return torch.where(e == 0, torch.full_like(normal, 2.0**-E8M0_BIAS), normal)


def quantize_rows(x: Tensor, rule: int = QuantRule.DEFAULT) -> tuple[Tensor, Tensor]:
    """MXFP8-quantize `[M, K]` rows: e4m3 codes `[M, K]` and row-major E8M0 scales `[M, K/32]`.

    Non-finite values (`rule` DEFAULT): NaN is ignored by the block amax and encodes as
    NaN; +-Inf makes the block scale 254 and encodes as +-448 (what the GPU's saturating
    convert does). `rule` TORCHAO: see :class:`QuantRule`.
    """
    if rule == QuantRule.TORCHAO:
        return _quantize_rows_torchao(x)
    m, k = x.shape
    v = x.float().reshape(m, k // BLOCK, BLOCK)
    a = v.abs()
    amax = torch.where(torch.isnan(a), 0.0, a).amax(dim=-1, keepdim=True)
    sb = e8m0_scale_from_amax(amax)
    q = v * e8m0_multiplier(sb)
    q = torch.where(torch.isinf(v), torch.copysign(torch.full_like(q, FP8_MAX), v), q)
    codes = q.to(FP8_DTYPE).reshape(m, k)
    return codes, sb.reshape(m, scale_columns(k))


def _quantize_rows_torchao(x: Tensor) -> tuple[Tensor, Tensor]:
    """torchao's RCEIL encoding: the amax propagates NaN; scale byte 0 multiplies by 1.0.

    A NaN block is multiplied by torchao's own NaN (`amax / 448`, the NaN the amax
    returned) so that on CPU even the sign of each NaN code matches; the clamp keeps NaN
    and maps +-Inf (scale 254, multiplier 2**-127) to +-448.
    """
    m, k = x.shape
    v = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1, keepdim=True)
    nan_block = torch.isnan(amax)
    sb = e8m0_scale_from_amax(torch.where(nan_block, 0.0, amax))
    multiplier = torch.where(sb == 0, 1.0, e8m0_multiplier(sb))
    multiplier = torch.where(nan_block, amax / FP8_MAX, multiplier)
    q = (v * multiplier).clamp(-FP8_MAX, FP8_MAX)
    sb = torch.where(nan_block, E8M0_NAN, sb)
    return q.to(FP8_DTYPE).reshape(m, k), sb.reshape(m, scale_columns(k))


def swizzle_scales(scales: Tensor) -> Tensor:
    """Row-major `[M, S]` E8M0 scales -> the F8_128x4 layout `[pad128(M), pad4(S)]`, zero padded.

    Rows are padded to 128 and scale columns to 4, viewed as `[M/128, 4, 32, S/4, 4]`,
    dims 1 and 3 swapped, flattened; returned 2-D so its size is readable at a glance.
    """
    m, s = scales.shape
    padded_m, padded_s = swizzled_scale_shape(m, s * BLOCK)
    padded = scales.new_zeros(padded_m, padded_s)
    padded[:m, :s] = scales
    tiles = padded.view(padded_m // SWIZZLE_ROW_TILE, 4, 32, padded_s // SWIZZLE_COLUMN_TILE, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(padded_m, padded_s)


def unswizzle_scales(swizzled: Tensor, m: int, s: int) -> Tensor:
    """Inverse of :func:`swizzle_scales` (drops the padding)."""
    padded_m, padded_s = swizzled.shape
    tiles = swizzled.reshape(padded_m // SWIZZLE_ROW_TILE, padded_s // SWIZZLE_COLUMN_TILE, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(padded_m, padded_s)[:m, :s]


def gemma_norm_rows(
    s: Tensor,
    weight: Tensor,
    eps: float | Tensor,
    dtype: torch.dtype,
    weight_offset: float = 1.0,
    round_normalized: bool = False,
) -> Tensor:
    """`(n * (weight.f32 + offset)).to(dtype)` with `n = s * rsqrt(mean(s*s) + eps)`, for fp32 rows `s`.

    `round_normalized` rounds `n` to `dtype` before the weight multiply (Hugging Face's
    `w * n.to(dtype)`, vLLM IR's `n.to(w.dtype) * w`); the product of two bf16 (or fp16)
    values is exact in fp32, so the one rounding after it equals torch's bf16 multiply.
    An offset of 0 is added as -0.0, the identity (`-0.0 + 0.0` would turn a -0 weight
    into +0). eps may be a 0-d fp32 tensor (a runtime eps): the same fp32 add as a Python float.
    """
    variance = (s * s).mean(dim=-1, keepdim=True)
    n = s * torch.rsqrt(variance + eps)
    if round_normalized:
        n = n.to(dtype).float()
    return (n * (weight.float() + (weight_offset or -0.0))).to(dtype)


def gemma_rmsnorm(
    x: Tensor, weight: Tensor, eps: float | Tensor, weight_offset: float = 1.0, round_normalized: bool = False
) -> Tensor:
    return gemma_norm_rows(x.float(), weight, eps, x.dtype, weight_offset, round_normalized)


def gemma_fused_add_rmsnorm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float | Tensor,
    round_sum: bool = False,
    weight_offset: float = 1.0,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor]:
    """Residual add then norm. `round_sum` normalizes the dtype-rounded sum (Hugging Face order)."""
    s = x.float() + residual.float()
    residual_out = s.to(x.dtype)
    if round_sum:
        s = residual_out.float()
    return gemma_norm_rows(s, weight, eps, x.dtype, weight_offset, round_normalized), residual_out


def mxfp8_quantize(x: Tensor, swizzled: bool = False, rule: int = QuantRule.DEFAULT) -> tuple[Tensor, Tensor]:
    k = x.shape[-1]
    codes, scales = quantize_rows(x.reshape(-1, k), rule)
    if swizzled:
        return codes.reshape(x.shape), swizzle_scales(scales)
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], scale_columns(k))


def dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """fp32 values of `[..., K]` codes with row-major `[..., K/32]` scales (exact)."""
    k = codes.shape[-1]
    blocks = codes.float().reshape(*codes.shape[:-1], scale_columns(k), BLOCK)
    return (blocks * e8m0_to_float(scales).unsqueeze(-1)).reshape(codes.shape)


def mxfp8_linear(
    codes: Tensor, scales: Tensor, weight_codes: Tensor, weight_scales: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """`dequant(codes) @ dequant(weight).T` accumulated in fp32, rounded once to out_dtype."""
    return (dequantize(codes, scales) @ dequantize(weight_codes, weight_scales).T).to(out_dtype)
