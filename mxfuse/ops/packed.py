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
unpacked ops, so the same bits (tests/test_gpu_norms.py::test_packed_ops_equal_unpacked).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.inputs import QUANT_INPUT_DTYPES, as_rows, check_norm, check_rows
from mxfuse.ops.library import kernel_arithmetic, reference_norm, residual_rows
from mxfuse.ops.mx_layout import FP8_DTYPE, SCALE_DTYPE, packed_width
from mxfuse.ops.outputs import empty_y, norm_outputs
from mxfuse.ops.registry import Impls, OpSpec


def _n_rows(x: Tensor) -> int:
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


def _empty_packed(m: int, k: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """New packed `[m, K + K/32]` uint8 buffer and its `(codes, scales)` views for the kernels to fill."""
    packed = torch.empty((m, packed_width(k)), dtype=SCALE_DTYPE, device=device)
    codes, scales = unpack(packed, k)
    return packed, codes, scales


def _fake_packed(x: Tensor, k: int) -> Tensor:
    return x.new_empty((_n_rows(x), packed_width(k)), dtype=SCALE_DTYPE)


# ------------------------------------- the norm + quant ops: `(packed, [residual_out,] y)`


def _norm_quant_packed(
    op: str, *, x: Tensor, weight: Tensor, eps: float, emit_y: bool, residual: Tensor | None = None, **arithmetic: Any
) -> tuple[Tensor, ...]:
    k = check_norm(op, x, weight, residual, eps=eps)
    y, res = reference_norm(x, residual, weight, eps, k, **arithmetic)
    return _packed_outputs(x, pack(*reference.quantize_rows(y)), res, y, emit_y)


def _norm_quant_packed_fake(
    op: str, *, x: Tensor, weight: Tensor, eps: float, emit_y: bool, residual: Tensor | None = None, **_: Any
) -> tuple[Tensor, ...]:
    k = check_norm(op, x, weight, residual, eps=eps)
    res = None if residual is None else x.new_empty(x.shape)
    return _packed_outputs(x, _fake_packed(x, k), res, x.new_empty(x.shape), emit_y)


def _norm_quant_packed_cuda(
    op: str, *, x: Tensor, weight: Tensor, eps: float, emit_y: bool, residual: Tensor | None = None, **arithmetic: Any
) -> tuple[Tensor, ...]:
    from mxfuse.ops import triton_norm_quant

    k = check_norm(op, x, weight, residual, eps=eps)
    rows = as_rows(x, k)
    packed, codes, scales = _empty_packed(rows.shape[0], k, x.device)
    _, _, res, y = triton_norm_quant.fused_norm_quant(
        rows,
        residual_rows(residual, k),
        weight,
        eps,
        swizzled=False,
        emit_y=emit_y,
        out_codes=codes,
        out_scales=scales,
        **kernel_arithmetic(arithmetic),
    )
    return _packed_outputs(x, packed, res, y, emit_y)


def _packed_outputs(
    x: Tensor, packed: Tensor, residual_out: Tensor | None, y: Tensor | None, emit_y: bool
) -> tuple[Tensor, ...]:
    """`(packed, [residual_out,] y)`: residual_out in x's shape, y too or empty without emit_y."""
    return norm_outputs(
        (packed,),
        None if residual_out is None else residual_out.reshape(x.shape),
        y.reshape(x.shape) if emit_y and y is not None else empty_y(x),
    )


# ---------------------------------------------------------------- the quant alone


def _quantize_packed(op: str, *, x: Tensor) -> Tensor:
    k = check_rows(op, x, QUANT_INPUT_DTYPES)
    return pack(*reference.quantize_rows(as_rows(x, k)))


def _quantize_packed_fake(op: str, *, x: Tensor) -> Tensor:
    return _fake_packed(x, check_rows(op, x, QUANT_INPUT_DTYPES))


def _quantize_packed_cuda(op: str, *, x: Tensor) -> Tensor:
    from mxfuse.ops import triton_norm_quant

    k = check_rows(op, x, QUANT_INPUT_DTYPES)
    rows = as_rows(x, k)
    packed, codes, scales = _empty_packed(rows.shape[0], k, x.device)
    triton_norm_quant.quantize(rows, False, out_codes=codes, out_scales=scales)
    return packed


# -------------------------------------------------------------------- the table

NORM_QUANT_PACKED = Impls(cpu=_norm_quant_packed, fake=_norm_quant_packed_fake, cuda=_norm_quant_packed_cuda)

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "gemma_rmsnorm_mxfp8_packed(Tensor x, Tensor weight, float eps, bool emit_y=False,"
        " float weight_offset=1.0, bool round_normalized=False) -> (Tensor, Tensor)",
        NORM_QUANT_PACKED,
        "Gemma norm + MXFP8 quant of the rows of x into one packed buffer: `(packed, y)`.",
    ),
    OpSpec(
        "gemma_fused_add_rmsnorm_mxfp8_packed(Tensor x, Tensor residual, Tensor weight, float eps,"
        " bool emit_y=False, bool round_sum=False, float weight_offset=1.0, bool round_normalized=False)"
        " -> (Tensor, Tensor, Tensor)",
        NORM_QUANT_PACKED,
        "Residual add + Gemma norm + MXFP8 quant into one packed buffer: `(packed, residual_out, y)`.",
    ),
    OpSpec(
        "mxfp8_quantize_packed(Tensor x) -> Tensor",
        Impls(cpu=_quantize_packed, fake=_quantize_packed_fake, cuda=_quantize_packed_cuda),
        "MXFP8 quant of the rows of x into one packed buffer `[M, K + K/32]`.",
    ),
)
