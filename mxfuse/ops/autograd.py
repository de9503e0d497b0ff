"""Backward formulas of the mxfuse ops, as the op table (:mod:`mxfuse.ops.registry`) registers them.

The passes and kernels are for inference. Without a registered formula, a model
compiled with gradients enabled fails deep inside AOTAutograd ("no autograd formula
was registered"); here every op gets one, by its `OpSpec.backward`:

- the unfused norms (Gemma and standard, with or without the residual add) have their
  real backward, :data:`NORM_BACKWARD` (plain fp32 PyTorch, traceable), so a norm can be
  trained or fine-tuned through the unfused op;
- every other op (those with an MXFP8 output: quantization, the fused norm+quant ops, the
  packed ops, the GEMM; and `sp_local_rows`, which only a rewrite of an inference graph
  inserts) is inference only (`backward=None`): :func:`inference_only` raises
  :class:`MxfuseInputError` naming the op and the fix (`torch.no_grad()` /
  `torch.inference_mode()`): rounding to e4m3 has no useful gradient, and a
  straight-through estimator is a training choice mxfuse does not make.

Eager forward with gradients enabled still runs; the error comes when a backward is
built (`loss.backward()`, or AOTAutograd tracing the joint graph at compile time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from mxfuse.ops.errors import MxfuseInputError

_NO_BACKWARD = (
    "mxfuse::{op} has no backward: MXFP8 quantization and the mxfuse passes are for inference. "
    "Run (or compile) the model under torch.no_grad() or torch.inference_mode()."
)


@dataclass(frozen=True)
class Backward:
    """The derivative of a family of ops, called with the op's arguments by name, as its impls."""

    save: Callable[..., None]
    """`save(ctx, output, **arguments)`: keep what `grads` needs (tensors through `ctx.save_for_backward`)."""
    grads: Callable[..., Mapping[str, Tensor | None]]
    """`grads(ctx, *grad_outputs) -> {argument name: its gradient}`; arguments left out get None."""


def inference_only(op: str) -> Callable[..., NoReturn]:
    """The backward of an op without a derivative: raises, naming the op and the fix."""

    def backward(ctx: Any, *grads: Tensor | None) -> NoReturn:
        raise MxfuseInputError(_NO_BACKWARD.format(op=op))

    return backward


def _norm_grads(
    s: Tensor, weight: Tensor, eps: float, grad_y: Tensor | None, offset: float, rounded: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    """fp32 `(d s, d weight)` of `y = n * (w + offset)`, `n = s * rsqrt(mean(s*s) + eps)`, fp32 rows `s` `[M, K]`.

    With `r = rsqrt(mean(s*s) + eps)` and `g = dy * (w + offset)`:
    `ds = r * (g - n * mean(g * n))`, `dw = sum over rows of dy * n`. `rounded` (the dtype
    of `round_normalized`): `dw` reads the rounded `n` the forward multiplied by, and `g`
    crosses that rounding as autograd takes a gradient through a dtype cast: rounded to it.
    """
    r = torch.rsqrt((s * s).mean(dim=-1, keepdim=True) + eps)
    n = s * r
    if grad_y is None:
        return torch.zeros_like(s), torch.zeros(weight.shape, dtype=torch.float32, device=s.device)
    dy = grad_y.float()
    g = dy * (weight.float() + offset)
    if rounded is not None:
        g = g.to(rounded).float()
    ds = r * (g - n * (g * n).mean(dim=-1, keepdim=True))
    multiplied = n if rounded is None else n.to(rounded).float()
    return ds, (dy * multiplied).sum(dim=0)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _save_norm(
    ctx: Any,
    output: Any,
    *,
    x: Tensor,
    weight: Tensor,
    eps: float,
    weight_offset: float,
    round_normalized: bool,
    residual: Tensor | None = None,
) -> None:
    ctx.save_for_backward(x, weight, residual)
    ctx.eps, ctx.weight_offset, ctx.round_normalized = eps, weight_offset, round_normalized


def _norm_backward(ctx: Any, grad_y: Tensor | None, grad_residual_out: Tensor | None = None) -> dict[str, Tensor]:
    """`y = norm(x)`, or `(y, residual_out) = (norm(s), s.to(dtype))` with `s = x + residual` in fp32."""
    x, weight, residual = ctx.saved_tensors
    s = _rows(x).float() if residual is None else _rows(x).float() + _rows(residual).float()
    grad = None if grad_y is None else _rows(grad_y)
    rounded = x.dtype if ctx.round_normalized else None
    ds, dw = _norm_grads(s, weight, ctx.eps, grad, ctx.weight_offset, rounded)
    if grad_residual_out is not None:
        ds = ds + _rows(grad_residual_out).float()  # residual_out = s.to(dtype)
    d_sum = ds.to(x.dtype).reshape(x.shape)
    if residual is None:
        return {"x": d_sum, "weight": dw.to(weight.dtype)}
    return {"x": d_sum, "residual": d_sum.to(residual.dtype), "weight": dw.to(weight.dtype)}


NORM_BACKWARD = Backward(save=_save_norm, grads=_norm_backward)
"""The unfused norms' derivative (Gemma and standard by `weight_offset`; with a residual or not)."""
