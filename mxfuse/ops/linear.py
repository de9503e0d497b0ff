"""`mxfuse::mxfp8_linear`: the MXFP8 x MXFP8 GEMM of the reference models (the consumer the rewrites feed).

Its CUDA impl is the Triton GEMM of `triton_gemm` (the test vehicle on sm_90, where cuBLAS
has no MX scales); the CPU impl dequantizes both sides exactly and multiplies in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.errors import describe, fail
from mxfuse.ops.inputs import QUANT_INPUT_DTYPES, check_rows, check_same_device
from mxfuse.ops.mx_layout import FP8_DTYPE, SCALE_DTYPE, scale_columns
from mxfuse.ops.registry import Impls, OpSpec


def _check_linear(
    op: str, codes: Tensor, scales: Tensor, weight_codes: Tensor, weight_scales: Tensor, out_dtype: torch.dtype
) -> int:
    if codes.dtype != FP8_DTYPE or weight_codes.dtype != FP8_DTYPE:
        fail(op, f"codes {describe(codes)} and weight_codes {describe(weight_codes)} must be float8_e4m3fn")
    k = check_rows(op, codes, (FP8_DTYPE,), "codes")
    if weight_codes.dim() != 2 or weight_codes.shape[1] != k:
        fail(op, f"weight_codes {describe(weight_codes)} must be [N, {k}] to match codes {describe(codes)}")
    if scales.dtype != SCALE_DTYPE or tuple(scales.shape) != (*codes.shape[:-1], scale_columns(k)):
        fail(op, f"scales {describe(scales)} must be uint8 row-major {(*codes.shape[:-1], scale_columns(k))}")
    n = weight_codes.shape[0]
    if weight_scales.dtype != SCALE_DTYPE or tuple(weight_scales.shape) != (n, scale_columns(k)):
        fail(op, f"weight_scales {describe(weight_scales)} must be uint8 row-major ({n}, {scale_columns(k)})")
    if out_dtype not in QUANT_INPUT_DTYPES:
        fail(op, f"out_dtype {out_dtype} must be bfloat16, float16 or float32")
    check_same_device(op, codes=codes, scales=scales, weight_codes=weight_codes, weight_scales=weight_scales)
    return k


def _linear(
    op: str, *, codes: Tensor, scales: Tensor, weight_codes: Tensor, weight_scales: Tensor, out_dtype: torch.dtype
) -> Tensor:
    k = _check_linear(op, codes, scales, weight_codes, weight_scales, out_dtype)
    out = reference.mxfp8_linear(
        codes.reshape(-1, k), scales.reshape(-1, scale_columns(k)), weight_codes, weight_scales, out_dtype
    )
    return out.reshape(*codes.shape[:-1], weight_codes.shape[0])


def _linear_fake(
    op: str, *, codes: Tensor, scales: Tensor, weight_codes: Tensor, weight_scales: Tensor, out_dtype: torch.dtype
) -> Tensor:
    _check_linear(op, codes, scales, weight_codes, weight_scales, out_dtype)
    return codes.new_empty((*codes.shape[:-1], weight_codes.shape[0]), dtype=out_dtype)


def _linear_cuda(
    op: str, *, codes: Tensor, scales: Tensor, weight_codes: Tensor, weight_scales: Tensor, out_dtype: torch.dtype
) -> Tensor:
    from mxfuse.ops import triton_gemm

    k = _check_linear(op, codes, scales, weight_codes, weight_scales, out_dtype)
    out = triton_gemm.mxfp8_linear(
        codes.reshape(-1, k), scales.reshape(-1, scale_columns(k)), weight_codes, weight_scales, out_dtype
    )
    return out.reshape(*codes.shape[:-1], weight_codes.shape[0])


OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "mxfp8_linear(Tensor codes, Tensor scales, Tensor weight_codes, Tensor weight_scales,"
        " ScalarType out_dtype) -> Tensor",
        Impls(cpu=_linear, fake=_linear_fake, cuda=_linear_cuda),
        "`dequant(codes) @ dequant(weight).T` in out_dtype; activation scales row-major.",
    ),
)
