"""The norm, quant and fused norm + quant ops of `mxfuse::`: their impls and table entries.

Each op is one :class:`~mxfuse.ops.registry.OpSpec` in :data:`OPS`; how to add one (one entry
per op) is in the docstring of :mod:`mxfuse.ops.registry`. The CPU impls are the references
of :mod:`mxfuse.ops.reference`; the CUDA impls launch the Triton kernels of
`triton_norm_quant`, imported on the first call. The input checks are those of
:mod:`mxfuse.ops.inputs`; they and :class:`MxfuseInputError` are re-exported here. Sibling
modules of ops: `linear.py` (the GEMM), `packed.py` (the SP all-gather's), `sp_rows.py`.

Outputs are shaped by :mod:`mxfuse.ops.outputs`: `y` of the fused ops is an empty tensor
unless `emit_y=True` (a schema cannot vary its arity).

The norms are two forms of one arithmetic (`reference.gemma_norm_rows`): the Gemma norm
multiplies by `1 + w`, the standard RMSNorm by `w`. The `gemma_*` ops are the first (the
fused ones take `weight_offset`: 1.0, or 0.0 when the graph already holds `1 + w`), the
`rms_norm*` ops the second (offset 0, no offset argument), so a dump says which norm was
fused. One set of impls serves both forms, with the residual add and without.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.autograd import NORM_BACKWARD
from mxfuse.ops.errors import MxfuseInputError, describe, fail
from mxfuse.ops.inputs import (
    ACTIVATION_DTYPES,
    QUANT_INPUT_DTYPES,
    as_rows,
    check_norm,
    check_rows,
    check_rule,
    check_same_device,
    host_eps,
    kernel_offset,
    runtime_eps,
)
from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, SCALE_DTYPE, scale_shape, swizzled_scale_shape
from mxfuse.ops.outputs import empty_y, kernel_scales, norm_outputs, reference_scales
from mxfuse.ops.reference import QuantRule
from mxfuse.ops.registry import Impls, OpSpec

__all__ = [
    "ACTIVATION_DTYPES",
    "OPS",
    "QUANT_INPUT_DTYPES",
    "MxfuseInputError",
    "check_norm",
    "check_rows",
    "check_rule",
    "check_same_device",
    "kernel_arithmetic",
    "reference_norm",
    "residual_rows",
]

GEMMA_NORM = MappingProxyType({"weight_offset": 1.0})
"""The `constants` of the Gemma norm ops without a `weight_offset` argument: `1 + w`."""
STANDARD_NORM = MappingProxyType({"weight_offset": 0.0})
"""The `constants` of the standard RMSNorm ops: `w`."""


def reference_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float | Tensor,
    k: int,
    *,
    weight_offset: float,
    round_normalized: bool,
    round_sum: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The reference norm of the rows of x, after adding the residual when there is one:
    `(y, residual_out)`, both `[M, K]`; residual_out is None without a residual."""
    if residual is None:
        return reference.gemma_rmsnorm(as_rows(x, k), weight, eps, weight_offset, round_normalized), None
    return reference.gemma_fused_add_rmsnorm(
        as_rows(x, k), as_rows(residual, k), weight, eps, round_sum, weight_offset, round_normalized
    )


# ------------------------------------------------------ the unfused norms
#
# `y`, or `(y, residual_out)` with the residual add. The norm's arithmetic (`weight_offset`,
# `round_normalized`; `round_sum` in the fused add) is passed on by name, `**arithmetic`.


def kernel_arithmetic(arithmetic: dict[str, Any]) -> dict[str, Any]:
    """A norm's arithmetic as the kernels take it: the offset 0 as -0.0 (:func:`kernel_offset`)."""
    return {**arithmetic, "weight_offset": kernel_offset(arithmetic["weight_offset"])}


def residual_rows(residual: Tensor | None, k: int) -> Tensor | None:
    """The residual as `[M, K]` rows, or None without one."""
    return None if residual is None else as_rows(residual, k)


def _norm_outputs(x: Tensor, y: Tensor, residual_out: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    return y.reshape(x.shape) if residual_out is None else (y.reshape(x.shape), residual_out.reshape(x.shape))


def _norm(
    op: str, *, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, **arithmetic: Any
) -> Tensor | tuple[Tensor, Tensor]:
    k = check_norm(op, x, weight, residual, eps=eps)
    return _norm_outputs(x, *reference_norm(x, residual, weight, eps, k, **arithmetic))


def _norm_fake(
    op: str, *, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, **_: Any
) -> Tensor | tuple[Tensor, Tensor]:
    check_norm(op, x, weight, residual, eps=eps)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y if residual is None else (y, torch.empty_like(x, memory_format=torch.contiguous_format))


def _norm_cuda(
    op: str, *, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, **arithmetic: Any
) -> Tensor | tuple[Tensor, Tensor]:
    from mxfuse.ops import triton_norm_quant

    k = check_norm(op, x, weight, residual, eps=eps)
    rows = (as_rows(x, k), residual_rows(residual, k), weight, eps)
    return _norm_outputs(x, *triton_norm_quant.gemma_norm(*rows, **kernel_arithmetic(arithmetic)))


NORM = Impls(cpu=_norm, fake=_norm_fake, cuda=_norm_cuda)


# -------------------------------------------------------------- mxfp8_quantize


def _quantize(op: str, *, x: Tensor, swizzled: bool, rule: int) -> tuple[Tensor, Tensor]:
    k = check_rows(op, x, QUANT_INPUT_DTYPES)
    codes, scales = reference.quantize_rows(as_rows(x, k), check_rule(op, rule))
    return codes.reshape(x.shape), reference_scales(scales, x.shape[:-1], k, swizzled)


def _quantize_fake(op: str, *, x: Tensor, swizzled: bool, rule: int) -> tuple[Tensor, Tensor]:
    k = check_rows(op, x, QUANT_INPUT_DTYPES)
    check_rule(op, rule)
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(scale_shape(x.shape[:-1], k, swizzled), dtype=SCALE_DTYPE)


def _quantize_cuda(op: str, *, x: Tensor, swizzled: bool, rule: int) -> tuple[Tensor, Tensor]:
    from mxfuse.ops import triton_norm_quant

    k = check_rows(op, x, QUANT_INPUT_DTYPES)
    codes, scales = triton_norm_quant.quantize(as_rows(x, k), swizzled, rule=check_rule(op, rule))
    return codes.reshape(x.shape), kernel_scales(scales, x.shape[:-1], k, swizzled)


# ------------------------------------------------------- the fused norm + quant ops
#
# `(codes, scales, y)`, or `(codes, scales, residual_out, y)` with the residual add.


def _check_norm_quant(
    op: str, x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, rule: int, eps_tensor: Tensor | None
) -> tuple[int, QuantRule, float | Tensor]:
    """The checks of a fused norm + quant op: `(K, the rule, the eps to use)`."""
    k = check_norm(op, x, weight, residual, eps=eps)
    return k, check_rule(op, rule), runtime_eps(op, eps, eps_tensor)


def _norm_quant_outputs(
    x: Tensor, codes: Tensor, scales: Tensor, residual_out: Tensor | None, y: Tensor | None, emit_y: bool
) -> tuple[Tensor, ...]:
    return norm_outputs(
        (codes.reshape(x.shape), scales),
        None if residual_out is None else residual_out.reshape(x.shape),
        y.reshape(x.shape) if emit_y and y is not None else empty_y(x),
    )


def _norm_quant(
    op: str,
    *,
    x: Tensor,
    weight: Tensor,
    eps: float,
    swizzled: bool,
    emit_y: bool,
    rule: int,
    eps_tensor: Tensor | None,
    residual: Tensor | None = None,
    **arithmetic: Any,
) -> tuple[Tensor, ...]:
    k, quant_rule, run_eps = _check_norm_quant(op, x, weight, residual, eps, rule, eps_tensor)
    y, res = reference_norm(x, residual, weight, run_eps, k, **arithmetic)
    codes, scales = reference.quantize_rows(y, quant_rule)
    return _norm_quant_outputs(x, codes, reference_scales(scales, x.shape[:-1], k, swizzled), res, y, emit_y)


def _norm_quant_fake(
    op: str,
    *,
    x: Tensor,
    weight: Tensor,
    eps: float,
    swizzled: bool,
    emit_y: bool,
    rule: int,
    eps_tensor: Tensor | None,
    residual: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, ...]:
    k = _check_norm_quant(op, x, weight, residual, eps, rule, eps_tensor)[0]
    return norm_outputs(
        (x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(scale_shape(x.shape[:-1], k, swizzled), dtype=SCALE_DTYPE)),
        None if residual is None else x.new_empty(x.shape),
        x.new_empty(x.shape) if emit_y else empty_y(x),
    )


def _norm_quant_cuda(
    op: str,
    *,
    x: Tensor,
    weight: Tensor,
    eps: float,
    swizzled: bool,
    emit_y: bool,
    rule: int,
    eps_tensor: Tensor | None,
    residual: Tensor | None = None,
    **arithmetic: Any,
) -> tuple[Tensor, ...]:
    from mxfuse.ops import triton_norm_quant

    k, quant_rule, run_eps = _check_norm_quant(op, x, weight, residual, eps, rule, eps_tensor)
    codes, scales, res, y = triton_norm_quant.fused_norm_quant(
        as_rows(x, k),
        residual_rows(residual, k),
        weight,
        host_eps(run_eps),
        swizzled=swizzled,
        emit_y=emit_y,
        rule=quant_rule,
        **kernel_arithmetic(arithmetic),
    )
    return _norm_quant_outputs(x, codes, kernel_scales(scales, x.shape[:-1], k, swizzled), res, y, emit_y)


NORM_QUANT = Impls(cpu=_norm_quant, fake=_norm_quant_fake, cuda=_norm_quant_cuda)


# -------------------------------------------------------- mxfp8_swizzle_scales


def _check_scales_2d(op: str, scales: Tensor) -> None:
    if scales.dim() != 2 or scales.dtype != SCALE_DTYPE:
        fail(op, f"scales {describe(scales)} must be 2-D uint8 row-major E8M0 scales [M, K/32]")


def _swizzle(op: str, *, scales: Tensor) -> Tensor:
    _check_scales_2d(op, scales)
    return reference.swizzle_scales(scales)


def _swizzle_fake(op: str, *, scales: Tensor) -> Tensor:
    _check_scales_2d(op, scales)
    m, s = scales.shape
    return scales.new_empty(swizzled_scale_shape(m, s * BLOCK))


def _swizzle_cuda(op: str, *, scales: Tensor) -> Tensor:
    from mxfuse.ops import triton_norm_quant

    _check_scales_2d(op, scales)
    return triton_norm_quant.swizzle_scales(scales)


# -------------------------------------------------------------------- the table

_NORM_ARGS = "Tensor x, Tensor weight, float eps, bool round_normalized=False"
_ADD_NORM_ARGS = "Tensor x, Tensor residual, Tensor weight, float eps, bool round_normalized=False"

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        f"gemma_rmsnorm({_NORM_ARGS}) -> Tensor",
        NORM,
        "Gemma RMSNorm: `normalize(x) * (1 + weight)` in fp32, rounded to x's dtype.",
        backward=NORM_BACKWARD,
        constants=GEMMA_NORM,
    ),
    OpSpec(
        f"gemma_fused_add_rmsnorm({_ADD_NORM_ARGS}) -> (Tensor, Tensor)",
        NORM,
        "`s = x + residual` in fp32; returns `(gemma_norm(s), s.to(dtype))`. Functional.",
        backward=NORM_BACKWARD,
        constants=GEMMA_NORM,
    ),
    OpSpec(
        f"rms_norm({_NORM_ARGS}) -> Tensor",
        NORM,
        """Standard RMSNorm: `normalize(x) * weight` in fp32, rounded to x's dtype.

        `round_normalized=True`: Hugging Face's `weight * normalize(x).to(dtype)` (and vLLM
        IR's reference with a weight of x's dtype).""",
        backward=NORM_BACKWARD,
        constants=STANDARD_NORM,
    ),
    OpSpec(
        f"fused_add_rms_norm({_ADD_NORM_ARGS}) -> (Tensor, Tensor)",
        NORM,
        "`s = x + residual` in fp32; returns `(rms_norm(s), s.to(dtype))`. Functional.",
        backward=NORM_BACKWARD,
        constants=STANDARD_NORM,
    ),
    OpSpec(
        "mxfp8_quantize(Tensor x, bool swizzled=False, SymInt rule=0) -> (Tensor, Tensor)",
        Impls(cpu=_quantize, fake=_quantize_fake, cuda=_quantize_cuda),
        """MXFP8 codes (e4m3, shape of x) and E8M0 scales (`[..., K/32]`, or F8_128x4 when swizzled).

        `rule`: a :class:`QuantRule` value (NaN and scale-byte-0 encoding; 0 = the rule of docs/design.md).""",
    ),
    OpSpec(
        "gemma_rmsnorm_mxfp8(Tensor x, Tensor weight, float eps, bool swizzled=False, bool emit_y=False,"
        " float weight_offset=1.0, SymInt rule=0, Tensor? eps_tensor=None, bool round_normalized=False)"
        " -> (Tensor, Tensor, Tensor)",
        NORM_QUANT,
        """Gemma norm and MXFP8 quant in one pass: `(codes, scales, y)`; y is empty unless emit_y.

        Bitwise equal to `mxfp8_quantize(gemma_rmsnorm(x, weight, eps), swizzled)`.
        `weight_offset` is the constant added to the weight (1.0 for Gemma weights, 0.0
        when the graph already holds `1 + w`). `eps_tensor` (0-d, on the host) replaces `eps`
        when given: an eps only known at run time. `rule`: as in `mxfp8_quantize`.
        `round_normalized`: as in `rms_norm` (round `normalize(x)` to x's dtype before the weight
        multiply).""",
    ),
    OpSpec(
        "gemma_fused_add_rmsnorm_mxfp8(Tensor x, Tensor residual, Tensor weight, float eps, bool swizzled=False,"
        " bool emit_y=False, bool round_sum=False, float weight_offset=1.0, SymInt rule=0,"
        " Tensor? eps_tensor=None, bool round_normalized=False) -> (Tensor, Tensor, Tensor, Tensor)",
        NORM_QUANT,
        """Residual add, Gemma norm and MXFP8 quant in one pass: `(codes, scales, residual_out, y)`.

        Bitwise equal to quantizing `gemma_fused_add_rmsnorm`'s y. `round_sum=True`
        normalizes the dtype-rounded sum instead of the fp32 sum: the order of a
        Hugging Face layer (`residual + hidden` in bf16, then the norm). `eps_tensor`,
        `weight_offset` and `round_normalized` as in `gemma_rmsnorm_mxfp8`. `rule`: as in
        `mxfp8_quantize`.""",
    ),
    OpSpec(
        "rms_norm_mxfp8(Tensor x, Tensor weight, float eps, bool swizzled=False, bool emit_y=False,"
        " SymInt rule=0, Tensor? eps_tensor=None, bool round_normalized=False) -> (Tensor, Tensor, Tensor)",
        NORM_QUANT,
        """The standard RMSNorm and MXFP8 quant in one pass: `(codes, scales, y)`.

        Bitwise equal to `mxfp8_quantize(rms_norm(x, weight, eps, round_normalized), swizzled)`;
        `gemma_rmsnorm_mxfp8` with `weight_offset=0.0`. `round_normalized=True` is Hugging Face's
        `LlamaRMSNorm` and vLLM's native RMSNorm with a model-dtype weight.""",
        constants=STANDARD_NORM,
    ),
    OpSpec(
        "fused_add_rms_norm_mxfp8(Tensor x, Tensor residual, Tensor weight, float eps, bool swizzled=False,"
        " bool emit_y=False, bool round_sum=False, SymInt rule=0, Tensor? eps_tensor=None,"
        " bool round_normalized=False) -> (Tensor, Tensor, Tensor, Tensor)",
        NORM_QUANT,
        """Residual add, the standard RMSNorm and MXFP8 quant: `(codes, scales, residual_out, y)`.

        Bitwise the quant of `fused_add_rms_norm`'s y and its `residual_out`;
        `gemma_fused_add_rmsnorm_mxfp8` with `weight_offset=0.0`. `round_sum` as there.""",
        constants=STANDARD_NORM,
    ),
    OpSpec(
        "mxfp8_swizzle_scales(Tensor scales) -> Tensor",
        Impls(cpu=_swizzle, fake=_swizzle_fake, cuda=_swizzle_cuda),
        "Row-major `[M, K/32]` E8M0 scales -> F8_128x4 `[pad128(M), pad4(K/32)]` (zero padded).",
    ),
)
