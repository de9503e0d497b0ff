"""Row-packed MXFP8 ops for the sequence-parallel all-gather (rewrite 2, `sp_gather`).

One uint8 buffer `[M, K + K/32]` per rows `[M, K]`: each row holds its K e4m3 code
bytes, then its K/32 E8M0 scale bytes (row-major scales). Rows are independent, so
an all-gather along dim 0 of per-rank packed buffers is the packed buffer of the
gathered rows: ONE collective carries codes and scales. After the gather the graph
takes zero-copy views (`aten.slice.Tensor` + `aten.view.dtype`)::

    codes  = gathered[:, :K].view(float8_e4m3fn)    # [M, K], row stride K + K/32
    scales = gathered[:, K:]                        # [M, K/32] uint8, row-major

Ops (all functional; the optional `y` is empty unless `emit_y`, as in library.py):

- `gemma_rmsnorm_mxfp8_packed(x, weight, eps, emit_y, weight_offset, round_normalized) -> (packed, y)`
- `gemma_fused_add_rmsnorm_mxfp8_packed(x, residual, weight, eps, emit_y, round_sum,
  weight_offset, round_normalized) -> (packed, residual_out, y)`
- `mxfp8_quantize_packed(x) -> packed` (the quant alone, for a quant whose input is no norm)

Bitwise: `packed[:, :K].view(e4m3)` and `packed[:, K:]` equal the codes and row-major
scales of the unpacked ops (`gemma_*_mxfp8`, `mxfp8_quantize`) on the same device.

CUDA impl: the packed buffer is allocated here and the Triton kernels
(`triton_norm_quant.fused_norm_quant` / `quantize` with `out_codes` / `out_scales`)
write the codes (row stride K + K/32) and the row-major scales (column offset K)
straight into its two views: one launch, no copy. Same kernels and arithmetic as the
unpacked ops, so the same bits (tests/test_gpu_kernels.py::test_packed_ops_equal_unpacked).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.library import (
    QUANT_INPUT_DTYPES,
    _check_norm,
    _check_rows,
    _empty_y,
    _kernel_offset,
    _rows,
)
from mxfuse.ops.mx_layout import FP8_DTYPE, SCALE_DTYPE, packed_width


def _n_rows(x: Tensor):
    m = 1
    for d in x.shape[:-1]:
        m = m * d
    return m


def pack(codes: Tensor, scales: Tensor) -> Tensor:
    """`[M, K]` e4m3 codes and row-major `[M, K/32]` scales -> packed uint8 `[M, K + K/32]`."""
    return torch.cat((codes.view(SCALE_DTYPE), scales), dim=1)  # one copy kernel


def unpack(packed: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Zero-copy `(codes, scales)` views of a packed buffer (what the graph takes after the gather)."""
    return packed[:, :k].view(FP8_DTYPE), packed[:, k:]


def _empty_packed(m: int, k: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """New packed `[m, K + K/32]` uint8 buffer and its `(codes, scales)` views for the kernels to fill."""
    packed = torch.empty((m, packed_width(k)), dtype=SCALE_DTYPE, device=device)
    codes, scales = unpack(packed, k)
    return packed, codes, scales


def _fake_packed(x: Tensor, k: int) -> Tensor:
    return x.new_empty((_n_rows(x), packed_width(k)), dtype=SCALE_DTYPE)


# ------------------------------------------------------ gemma_rmsnorm_mxfp8_packed


@torch.library.custom_op("mxfuse::gemma_rmsnorm_mxfp8_packed", mutates_args=())
def gemma_rmsnorm_mxfp8_packed(
    x: Tensor,
    weight: Tensor,
    eps: float,
    emit_y: bool = False,
    weight_offset: float = 1.0,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor]:
    """Gemma norm + MXFP8 quant of the rows of x into one packed buffer: `(packed, y)`."""
    k = _check_norm("gemma_rmsnorm_mxfp8_packed", x, weight, eps=eps)
    y = reference.gemma_rmsnorm(_rows(x, k), weight, eps, weight_offset, round_normalized)
    packed = pack(*reference.quantize_rows(y))
    return packed, y.reshape(x.shape) if emit_y else _empty_y(x)


@gemma_rmsnorm_mxfp8_packed.register_fake
def _(x, weight, eps, emit_y=False, weight_offset=1.0, round_normalized=False):
    k = _check_norm("gemma_rmsnorm_mxfp8_packed", x, weight, eps=eps)
    return _fake_packed(x, k), x.new_empty(x.shape) if emit_y else _empty_y(x)


@gemma_rmsnorm_mxfp8_packed.register_kernel("cuda")
def _(x, weight, eps, emit_y=False, weight_offset=1.0, round_normalized=False):
    from mxfuse.ops import triton_norm_quant

    k = _check_norm("gemma_rmsnorm_mxfp8_packed", x, weight, eps=eps)
    rows = _rows(x, k)
    packed, codes, scales = _empty_packed(rows.shape[0], k, x.device)
    _, _, _, y = triton_norm_quant.fused_norm_quant(
        rows, None, weight, eps, swizzled=False, emit_y=emit_y, weight_offset=_kernel_offset(weight_offset),
        round_normalized=round_normalized, out_codes=codes, out_scales=scales,
    )  # fmt: skip
    return packed, y.reshape(x.shape) if emit_y else _empty_y(x)


# ---------------------------------------------- gemma_fused_add_rmsnorm_mxfp8_packed


@torch.library.custom_op("mxfuse::gemma_fused_add_rmsnorm_mxfp8_packed", mutates_args=())
def gemma_fused_add_rmsnorm_mxfp8_packed(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    emit_y: bool = False,
    round_sum: bool = False,
    weight_offset: float = 1.0,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Residual add + Gemma norm + MXFP8 quant into one packed buffer: `(packed, residual_out, y)`."""
    op = "gemma_fused_add_rmsnorm_mxfp8_packed"
    k = _check_norm(op, x, weight, residual, eps=eps)
    y, res = reference.gemma_fused_add_rmsnorm(
        _rows(x, k), _rows(residual, k), weight, eps, round_sum, weight_offset, round_normalized
    )
    packed = pack(*reference.quantize_rows(y))
    return packed, res.reshape(x.shape), y.reshape(x.shape) if emit_y else _empty_y(x)


@gemma_fused_add_rmsnorm_mxfp8_packed.register_fake
def _(x, residual, weight, eps, emit_y=False, round_sum=False, weight_offset=1.0, round_normalized=False):
    k = _check_norm("gemma_fused_add_rmsnorm_mxfp8_packed", x, weight, residual, eps=eps)
    return _fake_packed(x, k), x.new_empty(x.shape), x.new_empty(x.shape) if emit_y else _empty_y(x)


@gemma_fused_add_rmsnorm_mxfp8_packed.register_kernel("cuda")
def _(x, residual, weight, eps, emit_y=False, round_sum=False, weight_offset=1.0, round_normalized=False):
    from mxfuse.ops import triton_norm_quant

    k = _check_norm("gemma_fused_add_rmsnorm_mxfp8_packed", x, weight, residual, eps=eps)
    rows = _rows(x, k)
    packed, codes, scales = _empty_packed(rows.shape[0], k, x.device)
    _, _, res, y = triton_norm_quant.fused_norm_quant(
        rows,
        _rows(residual, k),
        weight,
        eps,
        swizzled=False,
        emit_y=emit_y,
        round_sum=round_sum,
        weight_offset=_kernel_offset(weight_offset),
        round_normalized=round_normalized,
        out_codes=codes,
        out_scales=scales,
    )
    return packed, res.reshape(x.shape), y.reshape(x.shape) if emit_y else _empty_y(x)


# ------------------------------------------------------------ mxfp8_quantize_packed


@torch.library.custom_op("mxfuse::mxfp8_quantize_packed", mutates_args=())
def mxfp8_quantize_packed(x: Tensor) -> Tensor:
    """MXFP8 quant of the rows of x into one packed buffer `[M, K + K/32]`."""
    k = _check_rows("mxfp8_quantize_packed", x, QUANT_INPUT_DTYPES)
    return pack(*reference.quantize_rows(_rows(x, k)))


@mxfp8_quantize_packed.register_fake
def _(x):
    k = _check_rows("mxfp8_quantize_packed", x, QUANT_INPUT_DTYPES)
    return _fake_packed(x, k)


@mxfp8_quantize_packed.register_kernel("cuda")
def _(x):
    from mxfuse.ops import triton_norm_quant

    k = _check_rows("mxfp8_quantize_packed", x, QUANT_INPUT_DTYPES)
    rows = _rows(x, k)
    packed, codes, scales = _empty_packed(rows.shape[0], k, x.device)
    triton_norm_quant.quantize(rows, False, out_codes=codes, out_scales=scales)
    return packed
