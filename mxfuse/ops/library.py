"""The `mxfuse::` operators: schemas, input checks, fake impls, CPU and CUDA impls.

Each op is a `torch.library.custom_op`, so it stays ONE opaque node in the post-grad
graph (passes can match it) and is functional (no mutation, no aliasing). The CPU
impl is the reference in :mod:`mxfuse.ops.reference`; the CUDA impl launches Triton
kernels imported on first call, so importing mxfuse needs no GPU.

Optional outputs keep fixed positions (a schema cannot vary its arity): `y` of the
fused ops is an empty tensor unless `emit_y=True`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, SCALE_DTYPE, scale_columns, scale_shape, swizzled_scale_shape
from mxfuse.ops.reference import QuantRule

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class MxfuseInputError(ValueError):
    """Bad input to an mxfuse op; the message names the op, the shapes and dtypes."""


def _fail(op: str, message: str):
    raise MxfuseInputError(f"mxfuse::{op}: {message}")


def _describe(t: Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device.type}"


def _check_rows(op: str, x: Tensor, dtypes=ACTIVATION_DTYPES, name: str = "x") -> int:
    if x.dim() < 1:
        _fail(op, f"{name} must have a last (hidden) dimension, got a scalar")
    k = x.shape[-1]
    if k % BLOCK:
        _fail(op, f"hidden size K={k} of {name} {_describe(x)} is not a multiple of {BLOCK}")
    if k == 0:
        _fail(op, f"hidden size K=0 of {name} {_describe(x)}: rows must hold at least one block of {BLOCK}")
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(op, f"{name} {_describe(x)} has dtype {x.dtype}; expected one of {allowed}")
    return k


def _check_same_device(op: str, **tensors: Tensor):
    devices = {name: t.device for name, t in tensors.items()}
    if len({d.type for d in devices.values()}) > 1 or len(set(devices.values())) > 1:
        _fail(op, "inputs are on different devices: " + ", ".join(f"{n} on {d}" for n, d in devices.items()))


def _check_norm(op: str, x: Tensor, weight: Tensor, residual: Tensor | None = None, *, eps: float) -> int:
    if not eps >= 0:  # also rejects NaN
        _fail(op, f"eps={eps} must be >= 0 (it is added to the mean square before the rsqrt)")
    k = _check_rows(op, x)
    if weight.shape != (k,):
        _fail(op, f"weight {_describe(weight)} must have shape ({k},) to match x {_describe(x)}")
    if not weight.is_floating_point():
        _fail(op, f"weight {_describe(weight)} must be floating point")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            _fail(op, f"residual {_describe(residual)} must match x {_describe(x)} in shape and dtype")
        tensors["residual"] = residual
    _check_same_device(op, **tensors)
    return k


def _check_rule(op: str, rule: int) -> QuantRule:
    if rule not in set(QuantRule):
        _fail(op, f"rule={rule!r} is not a QuantRule ({', '.join(f'{r.value}={r.name}' for r in QuantRule)})")
    return QuantRule(rule)


def _rows(x: Tensor, k: int) -> Tensor:
    """`[M, K]` view of `[..., K]` with a unit last stride (copies only when it must)."""
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _empty_y(x: Tensor) -> Tensor:
    return x.new_empty(0)


def _runtime_eps(op: str, eps: float, eps_tensor: Tensor | None) -> float | Tensor:
    """The eps to use: `eps_tensor` (a 0-d float tensor on the host, e.g. the graph input
    `torch.compile(dynamic=True)` makes of a float attribute) when given, else `eps`."""
    if eps_tensor is None:
        return eps
    if eps_tensor.dim() != 0 or not eps_tensor.is_floating_point() or eps_tensor.device.type != "cpu":
        _fail(op, f"eps_tensor {_describe(eps_tensor)} must be a 0-d floating-point tensor on the cpu")
    return eps_tensor.float()


def _host_eps(eps: float | Tensor) -> float:
    """A Python float for the Triton launch (a host tensor: no device sync)."""
    return float(eps)


# ------------------------------------------------------ the unfused norms
#
# Two forms of one arithmetic (reference.gemma_norm_rows): the Gemma norm multiplies by
# `1 + w` (`weight_offset` 1.0), the standard RMSNorm by `w` (offset 0.0). Both take
# `round_normalized`: round `normalize(x)` to x's dtype before the weight multiply.


def _norm(op: str, x: Tensor, weight: Tensor, eps: float, weight_offset: float, round_normalized: bool) -> Tensor:
    k = _check_norm(op, x, weight, eps=eps)
    return reference.gemma_rmsnorm(_rows(x, k), weight, eps, weight_offset, round_normalized).reshape(x.shape)


def _norm_cuda(op: str, x: Tensor, weight: Tensor, eps: float, weight_offset: float, round_normalized: bool) -> Tensor:
    from mxfuse.ops import triton_norm_quant

    k = _check_norm(op, x, weight, eps=eps)
    y, _ = triton_norm_quant.gemma_norm(
        _rows(x, k), None, weight, eps, weight_offset=_kernel_offset(weight_offset), round_normalized=round_normalized
    )
    return y.reshape(x.shape)


def _add_norm(op: str, x, residual, weight, eps, weight_offset: float, round_normalized: bool) -> tuple[Tensor, Tensor]:
    k = _check_norm(op, x, weight, residual, eps=eps)
    y, res = reference.gemma_fused_add_rmsnorm(
        _rows(x, k), _rows(residual, k), weight, eps, weight_offset=weight_offset, round_normalized=round_normalized
    )
    return y.reshape(x.shape), res.reshape(x.shape)


def _add_norm_cuda(op: str, x, residual, weight, eps, weight_offset: float, round_normalized: bool):
    from mxfuse.ops import triton_norm_quant

    k = _check_norm(op, x, weight, residual, eps=eps)
    y, res = triton_norm_quant.gemma_norm(
        _rows(x, k),
        _rows(residual, k),
        weight,
        eps,
        weight_offset=_kernel_offset(weight_offset),
        round_normalized=round_normalized,
    )
    return y.reshape(x.shape), res.reshape(x.shape)


def _kernel_offset(weight_offset: float) -> float:
    """The offset as the kernels add it: 0 as -0.0, the identity (as in the reference)."""
    return weight_offset or -0.0


def _fake_norm(op: str, x, weight, eps, residual=None):
    _check_norm(op, x, weight, residual, eps=eps)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y if residual is None else (y, torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.custom_op("mxfuse::gemma_rmsnorm", mutates_args=())
def gemma_rmsnorm(x: Tensor, weight: Tensor, eps: float, round_normalized: bool = False) -> Tensor:
    """Gemma RMSNorm: `normalize(x) * (1 + weight)` in fp32, rounded to x's dtype."""
    return _norm("gemma_rmsnorm", x, weight, eps, 1.0, round_normalized)


@gemma_rmsnorm.register_fake
def _(x, weight, eps, round_normalized=False):
    return _fake_norm("gemma_rmsnorm", x, weight, eps)


@gemma_rmsnorm.register_kernel("cuda")
def _(x, weight, eps, round_normalized=False):
    return _norm_cuda("gemma_rmsnorm", x, weight, eps, 1.0, round_normalized)


@torch.library.custom_op("mxfuse::gemma_fused_add_rmsnorm", mutates_args=())
def gemma_fused_add_rmsnorm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, round_normalized: bool = False
) -> tuple[Tensor, Tensor]:
    """`s = x + residual` in fp32; returns `(gemma_norm(s), s.to(dtype))`. Functional."""
    return _add_norm("gemma_fused_add_rmsnorm", x, residual, weight, eps, 1.0, round_normalized)


@gemma_fused_add_rmsnorm.register_fake
def _(x, residual, weight, eps, round_normalized=False):
    return _fake_norm("gemma_fused_add_rmsnorm", x, weight, eps, residual)


@gemma_fused_add_rmsnorm.register_kernel("cuda")
def _(x, residual, weight, eps, round_normalized=False):
    return _add_norm_cuda("gemma_fused_add_rmsnorm", x, residual, weight, eps, 1.0, round_normalized)


@torch.library.custom_op("mxfuse::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, round_normalized: bool = False) -> Tensor:
    """Standard RMSNorm: `normalize(x) * weight` in fp32, rounded to x's dtype.

    `round_normalized=True`: Hugging Face's `weight * normalize(x).to(dtype)` (and vLLM
    IR's reference with a weight of x's dtype).
    """
    return _norm("rms_norm", x, weight, eps, 0.0, round_normalized)


@rms_norm.register_fake
def _(x, weight, eps, round_normalized=False):
    return _fake_norm("rms_norm", x, weight, eps)


@rms_norm.register_kernel("cuda")
def _(x, weight, eps, round_normalized=False):
    return _norm_cuda("rms_norm", x, weight, eps, 0.0, round_normalized)


@torch.library.custom_op("mxfuse::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, round_normalized: bool = False
) -> tuple[Tensor, Tensor]:
    """`s = x + residual` in fp32; returns `(rms_norm(s), s.to(dtype))`. Functional."""
    return _add_norm("fused_add_rms_norm", x, residual, weight, eps, 0.0, round_normalized)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, round_normalized=False):
    return _fake_norm("fused_add_rms_norm", x, weight, eps, residual)


@fused_add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps, round_normalized=False):
    return _add_norm_cuda("fused_add_rms_norm", x, residual, weight, eps, 0.0, round_normalized)


# -------------------------------------------------------------- mxfp8_quantize


@torch.library.custom_op("mxfuse::mxfp8_quantize", mutates_args=())
def mxfp8_quantize(x: Tensor, swizzled: bool = False, rule: int = 0) -> tuple[Tensor, Tensor]:
    """MXFP8 codes (e4m3, shape of x) and E8M0 scales (`[..., K/32]`, or F8_128x4 when swizzled).

    `rule`: a :class:`QuantRule` value (NaN and scale-byte-0 encoding; 0 = the rule of docs/design.md).
    """
    k = _check_rows("mxfp8_quantize", x, QUANT_INPUT_DTYPES)
    rule = _check_rule("mxfp8_quantize", rule)
    codes, scales = reference.quantize_rows(_rows(x, k), rule)
    return codes.reshape(x.shape), _layout(scales, x.shape[:-1], k, swizzled)


@mxfp8_quantize.register_fake
def _(x, swizzled=False, rule=0):
    k = _check_rows("mxfp8_quantize", x, QUANT_INPUT_DTYPES)
    _check_rule("mxfp8_quantize", rule)
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(scale_shape(x.shape[:-1], k, swizzled), dtype=SCALE_DTYPE)


@mxfp8_quantize.register_kernel("cuda")
def _(x, swizzled=False, rule=0):
    from mxfuse.ops import triton_norm_quant

    k = _check_rows("mxfp8_quantize", x, QUANT_INPUT_DTYPES)
    codes, scales = triton_norm_quant.quantize(_rows(x, k), swizzled, rule=_check_rule("mxfp8_quantize", rule))
    return codes.reshape(x.shape), scales if swizzled else scales.reshape(*x.shape[:-1], scale_columns(k))


def _layout(scales: Tensor, lead, k: int, swizzled: bool) -> Tensor:
    return reference.swizzle_scales(scales) if swizzled else scales.reshape(*lead, scale_columns(k))


# ------------------------------------------------------- the fused norm + quant ops
#
# Two pairs of ops over one arithmetic: `gemma_*_mxfp8` (the Gemma norm, `weight_offset`
# chosen by the caller) and `rms_norm_mxfp8` / `fused_add_rms_norm_mxfp8` (the standard
# RMSNorm: offset 0, no offset argument), so a dump says which norm was fused. The shared
# impls below take the op name for the messages.


def _norm_quant(op, x, weight, eps, swizzled, emit_y, weight_offset, rule, eps_tensor, round_normalized):
    k = _check_norm(op, x, weight, eps=eps)
    rule = _check_rule(op, rule)
    eps = _runtime_eps(op, eps, eps_tensor)
    y = reference.gemma_rmsnorm(_rows(x, k), weight, eps, weight_offset, round_normalized)
    codes, scales = reference.quantize_rows(y, rule)
    return (
        codes.reshape(x.shape),
        _layout(scales, x.shape[:-1], k, swizzled),
        y.reshape(x.shape) if emit_y else _empty_y(x),
    )


def _norm_quant_fake(op, x, weight, eps, swizzled, emit_y, rule, eps_tensor):
    k = _check_norm(op, x, weight, eps=eps)
    _check_rule(op, rule)
    _runtime_eps(op, eps, eps_tensor)
    return (
        x.new_empty(x.shape, dtype=FP8_DTYPE),
        x.new_empty(scale_shape(x.shape[:-1], k, swizzled), dtype=SCALE_DTYPE),
        x.new_empty(x.shape) if emit_y else _empty_y(x),
    )


def _norm_quant_cuda(op, x, weight, eps, swizzled, emit_y, weight_offset, rule, eps_tensor, round_normalized):
    from mxfuse.ops import triton_norm_quant

    k = _check_norm(op, x, weight, eps=eps)
    rule = _check_rule(op, rule)
    eps = _host_eps(_runtime_eps(op, eps, eps_tensor))
    codes, scales, _, y = triton_norm_quant.fused_norm_quant(
        _rows(x, k),
        None,
        weight,
        eps,
        swizzled=swizzled,
        emit_y=emit_y,
        weight_offset=_kernel_offset(weight_offset),
        round_normalized=round_normalized,
        rule=rule,
    )
    return (
        codes.reshape(x.shape),
        scales if swizzled else scales.reshape(*x.shape[:-1], scale_columns(k)),
        y.reshape(x.shape) if emit_y else _empty_y(x),
    )


def _add_norm_quant(
    op, x, residual, weight, eps, swizzled, emit_y, round_sum, weight_offset, rule, eps_tensor, round_normalized
):
    k = _check_norm(op, x, weight, residual, eps=eps)
    rule = _check_rule(op, rule)
    eps = _runtime_eps(op, eps, eps_tensor)
    y, res = reference.gemma_fused_add_rmsnorm(
        _rows(x, k), _rows(residual, k), weight, eps, round_sum, weight_offset, round_normalized
    )
    codes, scales = reference.quantize_rows(y, rule)
    return (
        codes.reshape(x.shape),
        _layout(scales, x.shape[:-1], k, swizzled),
        res.reshape(x.shape),
        y.reshape(x.shape) if emit_y else _empty_y(x),
    )


def _add_norm_quant_fake(op, x, residual, weight, eps, swizzled, emit_y, rule, eps_tensor):
    k = _check_norm(op, x, weight, residual, eps=eps)
    _check_rule(op, rule)
    _runtime_eps(op, eps, eps_tensor)
    return (
        x.new_empty(x.shape, dtype=FP8_DTYPE),
        x.new_empty(scale_shape(x.shape[:-1], k, swizzled), dtype=SCALE_DTYPE),
        x.new_empty(x.shape),
        x.new_empty(x.shape) if emit_y else _empty_y(x),
    )


def _add_norm_quant_cuda(
    op, x, residual, weight, eps, swizzled, emit_y, round_sum, weight_offset, rule, eps_tensor, round_normalized
):
    from mxfuse.ops import triton_norm_quant

    k = _check_norm(op, x, weight, residual, eps=eps)
    rule = _check_rule(op, rule)
    eps = _host_eps(_runtime_eps(op, eps, eps_tensor))
    codes, scales, res, y = triton_norm_quant.fused_norm_quant(
        _rows(x, k),
        _rows(residual, k),
        weight,
        eps,
        swizzled=swizzled,
        emit_y=emit_y,
        round_sum=round_sum,
        weight_offset=_kernel_offset(weight_offset),
        round_normalized=round_normalized,
        rule=rule,
    )
    return (
        codes.reshape(x.shape),
        scales if swizzled else scales.reshape(*x.shape[:-1], scale_columns(k)),
        res.reshape(x.shape),
        y.reshape(x.shape) if emit_y else _empty_y(x),
    )


# ---------------------------------------------------------- gemma_rmsnorm_mxfp8


@torch.library.custom_op("mxfuse::gemma_rmsnorm_mxfp8", mutates_args=())
def gemma_rmsnorm_mxfp8(
    x: Tensor,
    weight: Tensor,
    eps: float,
    swizzled: bool = False,
    emit_y: bool = False,
    weight_offset: float = 1.0,
    rule: int = 0,
    eps_tensor: Tensor | None = None,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gemma norm and MXFP8 quant in one pass: `(codes, scales, y)`; y is empty unless emit_y.

    Bitwise equal to `mxfp8_quantize(gemma_rmsnorm(x, weight, eps), swizzled)`.
    `weight_offset` is the constant added to the weight (1.0 for Gemma weights, 0.0
    when the graph already holds `1 + w`). `eps_tensor` (0-d, on the host) replaces `eps`
    when given: an eps only known at run time. `rule`: as in `mxfp8_quantize`.
    `round_normalized`: as in `rms_norm` (round `normalize(x)` to x's dtype before the weight
    multiply).
    """
    args = (x, weight, eps, swizzled, emit_y, weight_offset, rule, eps_tensor, round_normalized)
    return _norm_quant("gemma_rmsnorm_mxfp8", *args)


@gemma_rmsnorm_mxfp8.register_fake
def _(x, weight, eps, swizzled=False, emit_y=False, weight_offset=1.0, rule=0, eps_tensor=None, round_normalized=False):
    return _norm_quant_fake("gemma_rmsnorm_mxfp8", x, weight, eps, swizzled, emit_y, rule, eps_tensor)


@gemma_rmsnorm_mxfp8.register_kernel("cuda")
def _(x, weight, eps, swizzled=False, emit_y=False, weight_offset=1.0, rule=0, eps_tensor=None, round_normalized=False):
    args = (x, weight, eps, swizzled, emit_y, weight_offset, rule, eps_tensor, round_normalized)
    return _norm_quant_cuda("gemma_rmsnorm_mxfp8", *args)


# ------------------------------------------------ gemma_fused_add_rmsnorm_mxfp8


@torch.library.custom_op("mxfuse::gemma_fused_add_rmsnorm_mxfp8", mutates_args=())
def gemma_fused_add_rmsnorm_mxfp8(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    swizzled: bool = False,
    emit_y: bool = False,
    round_sum: bool = False,
    weight_offset: float = 1.0,
    rule: int = 0,
    eps_tensor: Tensor | None = None,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Residual add, Gemma norm and MXFP8 quant in one pass: `(codes, scales, residual_out, y)`.

    Bitwise equal to quantizing `gemma_fused_add_rmsnorm`'s y. `round_sum=True`
    normalizes the dtype-rounded sum instead of the fp32 sum: the order of a
    Hugging Face layer (`residual + hidden` in bf16, then the norm). `eps_tensor`,
    `weight_offset` and `round_normalized` as in `gemma_rmsnorm_mxfp8`. `rule`: as in
    `mxfp8_quantize`.
    """
    args = (x, residual, weight, eps, swizzled, emit_y, round_sum, weight_offset, rule, eps_tensor, round_normalized)
    return _add_norm_quant("gemma_fused_add_rmsnorm_mxfp8", *args)


@gemma_fused_add_rmsnorm_mxfp8.register_fake
def _(
    x,
    residual,
    weight,
    eps,
    swizzled=False,
    emit_y=False,
    round_sum=False,
    weight_offset=1.0,
    rule=0,
    eps_tensor=None,
    round_normalized=False,
):
    args = (x, residual, weight, eps, swizzled, emit_y, rule, eps_tensor)
    return _add_norm_quant_fake("gemma_fused_add_rmsnorm_mxfp8", *args)


@gemma_fused_add_rmsnorm_mxfp8.register_kernel("cuda")
def _(
    x,
    residual,
    weight,
    eps,
    swizzled=False,
    emit_y=False,
    round_sum=False,
    weight_offset=1.0,
    rule=0,
    eps_tensor=None,
    round_normalized=False,
):
    args = (x, residual, weight, eps, swizzled, emit_y, round_sum, weight_offset, rule, eps_tensor, round_normalized)
    return _add_norm_quant_cuda("gemma_fused_add_rmsnorm_mxfp8", *args)


# ----------------------------------------------- rms_norm_mxfp8 (the standard norm)


@torch.library.custom_op("mxfuse::rms_norm_mxfp8", mutates_args=())
def rms_norm_mxfp8(
    x: Tensor,
    weight: Tensor,
    eps: float,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = 0,
    eps_tensor: Tensor | None = None,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The standard RMSNorm and MXFP8 quant in one pass: `(codes, scales, y)`.

    Bitwise equal to `mxfp8_quantize(rms_norm(x, weight, eps, round_normalized), swizzled)`;
    `gemma_rmsnorm_mxfp8` with `weight_offset=0.0`. `round_normalized=True` is Hugging Face's
    `LlamaRMSNorm` and vLLM's native RMSNorm with a model-dtype weight.
    """
    args = (x, weight, eps, swizzled, emit_y, 0.0, rule, eps_tensor, round_normalized)
    return _norm_quant("rms_norm_mxfp8", *args)


@rms_norm_mxfp8.register_fake
def _(x, weight, eps, swizzled=False, emit_y=False, rule=0, eps_tensor=None, round_normalized=False):
    return _norm_quant_fake("rms_norm_mxfp8", x, weight, eps, swizzled, emit_y, rule, eps_tensor)


@rms_norm_mxfp8.register_kernel("cuda")
def _(x, weight, eps, swizzled=False, emit_y=False, rule=0, eps_tensor=None, round_normalized=False):
    args = (x, weight, eps, swizzled, emit_y, 0.0, rule, eps_tensor, round_normalized)
    return _norm_quant_cuda("rms_norm_mxfp8", *args)


@torch.library.custom_op("mxfuse::fused_add_rms_norm_mxfp8", mutates_args=())
def fused_add_rms_norm_mxfp8(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    swizzled: bool = False,
    emit_y: bool = False,
    round_sum: bool = False,
    rule: int = 0,
    eps_tensor: Tensor | None = None,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Residual add, the standard RMSNorm and MXFP8 quant: `(codes, scales, residual_out, y)`.

    Bitwise the quant of `fused_add_rms_norm`'s y and its `residual_out`;
    `gemma_fused_add_rmsnorm_mxfp8` with `weight_offset=0.0`. `round_sum` as there.
    """
    args = (x, residual, weight, eps, swizzled, emit_y, round_sum, 0.0, rule, eps_tensor, round_normalized)
    return _add_norm_quant("fused_add_rms_norm_mxfp8", *args)


@fused_add_rms_norm_mxfp8.register_fake
def _(
    x,
    residual,
    weight,
    eps,
    swizzled=False,
    emit_y=False,
    round_sum=False,
    rule=0,
    eps_tensor=None,
    round_normalized=False,
):
    args = (x, residual, weight, eps, swizzled, emit_y, rule, eps_tensor)
    return _add_norm_quant_fake("fused_add_rms_norm_mxfp8", *args)


@fused_add_rms_norm_mxfp8.register_kernel("cuda")
def _(
    x,
    residual,
    weight,
    eps,
    swizzled=False,
    emit_y=False,
    round_sum=False,
    rule=0,
    eps_tensor=None,
    round_normalized=False,
):
    args = (x, residual, weight, eps, swizzled, emit_y, round_sum, 0.0, rule, eps_tensor, round_normalized)
    return _add_norm_quant_cuda("fused_add_rms_norm_mxfp8", *args)


# -------------------------------------------------------- mxfp8_swizzle_scales


def _check_scales_2d(op: str, scales: Tensor):
    if scales.dim() != 2 or scales.dtype != SCALE_DTYPE:
        _fail(op, f"scales {_describe(scales)} must be 2-D uint8 row-major E8M0 scales [M, K/32]")


@torch.library.custom_op("mxfuse::mxfp8_swizzle_scales", mutates_args=())
def mxfp8_swizzle_scales(scales: Tensor) -> Tensor:
    """Row-major `[M, K/32]` E8M0 scales -> F8_128x4 `[pad128(M), pad4(K/32)]` (zero padded)."""
    _check_scales_2d("mxfp8_swizzle_scales", scales)
    return reference.swizzle_scales(scales)


@mxfp8_swizzle_scales.register_fake
def _(scales):
    _check_scales_2d("mxfp8_swizzle_scales", scales)
    m, s = scales.shape
    return scales.new_empty(swizzled_scale_shape(m, s * BLOCK))


@mxfp8_swizzle_scales.register_kernel("cuda")
def _(scales):
    from mxfuse.ops import triton_norm_quant

    _check_scales_2d("mxfp8_swizzle_scales", scales)
    return triton_norm_quant.swizzle_scales(scales)


# ---------------------------------------------------------------- mxfp8_linear


def _check_linear(codes: Tensor, scales: Tensor, weight_codes: Tensor, weight_scales: Tensor, out_dtype) -> int:
    op = "mxfp8_linear"
    if codes.dtype != FP8_DTYPE or weight_codes.dtype != FP8_DTYPE:
        _fail(op, f"codes {_describe(codes)} and weight_codes {_describe(weight_codes)} must be float8_e4m3fn")
    k = _check_rows(op, codes, (FP8_DTYPE,), "codes")
    if weight_codes.dim() != 2 or weight_codes.shape[1] != k:
        _fail(op, f"weight_codes {_describe(weight_codes)} must be [N, {k}] to match codes {_describe(codes)}")
    if scales.dtype != SCALE_DTYPE or tuple(scales.shape) != (*codes.shape[:-1], scale_columns(k)):
        _fail(op, f"scales {_describe(scales)} must be uint8 row-major {(*codes.shape[:-1], scale_columns(k))}")
    n = weight_codes.shape[0]
    if weight_scales.dtype != SCALE_DTYPE or tuple(weight_scales.shape) != (n, scale_columns(k)):
        _fail(op, f"weight_scales {_describe(weight_scales)} must be uint8 row-major ({n}, {scale_columns(k)})")
    if out_dtype not in QUANT_INPUT_DTYPES:
        _fail(op, f"out_dtype {out_dtype} must be bfloat16, float16 or float32")
    _check_same_device(op, codes=codes, scales=scales, weight_codes=weight_codes, weight_scales=weight_scales)
    return k


@torch.library.custom_op("mxfuse::mxfp8_linear", mutates_args=())
def mxfp8_linear(
    codes: Tensor, scales: Tensor, weight_codes: Tensor, weight_scales: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """`dequant(codes) @ dequant(weight).T` in out_dtype; activation scales row-major."""
    k = _check_linear(codes, scales, weight_codes, weight_scales, out_dtype)
    out = reference.mxfp8_linear(
        codes.reshape(-1, k), scales.reshape(-1, scale_columns(k)), weight_codes, weight_scales, out_dtype
    )
    return out.reshape(*codes.shape[:-1], weight_codes.shape[0])


@mxfp8_linear.register_fake
def _(codes, scales, weight_codes, weight_scales, out_dtype):
    _check_linear(codes, scales, weight_codes, weight_scales, out_dtype)
    return codes.new_empty((*codes.shape[:-1], weight_codes.shape[0]), dtype=out_dtype)


@mxfp8_linear.register_kernel("cuda")
def _(codes, scales, weight_codes, weight_scales, out_dtype):
    from mxfuse.ops import triton_gemm

    k = _check_linear(codes, scales, weight_codes, weight_scales, out_dtype)
    out = triton_gemm.mxfp8_linear(
        codes.reshape(-1, k), scales.reshape(-1, scale_columns(k)), weight_codes, weight_scales, out_dtype
    )
    return out.reshape(*codes.shape[:-1], weight_codes.shape[0])
