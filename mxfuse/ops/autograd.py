"""Backward formulas of the mxfuse ops (`torch.library.register_autograd`).

The passes and kernels are for inference. Without a registered formula, a model
compiled with gradients enabled fails deep inside AOTAutograd ("no autograd formula
was registered"); here every op gets one:

- the unfused norms (Gemma and standard, with or without the residual add) have their
  real backward (plain fp32 PyTorch, traceable), so a norm can be trained or fine-tuned
  through the unfused op;
- every op with an MXFP8 output (quantization, the fused norm+quant ops, the packed
  ops, the GEMM) raises :class:`MxfuseInputError` naming the op and the fix
  (`torch.no_grad()` / `torch.inference_mode()`): rounding to e4m3 has no useful
  gradient, and a straight-through estimator is a training choice mxfuse does not make.

Eager forward with gradients enabled still runs; the error comes when a backward is
built (`loss.backward()`, or AOTAutograd tracing the joint graph at compile time).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxfuse.ops.library import MxfuseInputError

_NO_BACKWARD = (
    "mxfuse::{op} has no backward: MXFP8 quantization and the mxfuse passes are for inference. "
    "Run (or compile) the model under torch.no_grad() or torch.inference_mode()."
)


def _no_backward(op: str):
    def backward(ctx, *grads):
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


def _rounded(x: Tensor, round_normalized: bool) -> torch.dtype | None:
    return x.dtype if round_normalized else None


def _setup_norm(ctx, inputs, output):
    x, weight, eps, round_normalized = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.round_normalized = eps, round_normalized


def _norm_backward(offset: float):
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad = None if grad_y is None else _rows(grad_y)
        ds, dw = _norm_grads(_rows(x).float(), weight, ctx.eps, grad, offset, _rounded(x, ctx.round_normalized))
        return ds.to(x.dtype).reshape(x.shape), dw.to(weight.dtype), None, None

    return backward


def _setup_fused_add_norm(ctx, inputs, output):
    x, residual, weight, eps, round_normalized = inputs
    ctx.save_for_backward(x, residual, weight)
    ctx.eps, ctx.round_normalized = eps, round_normalized


def _fused_add_norm_backward(offset: float):
    def backward(ctx, grad_y, grad_residual_out):
        x, residual, weight = ctx.saved_tensors
        s = _rows(x).float() + _rows(residual).float()
        grad = None if grad_y is None else _rows(grad_y)
        ds, dw = _norm_grads(s, weight, ctx.eps, grad, offset, _rounded(x, ctx.round_normalized))
        if grad_residual_out is not None:
            ds = ds + _rows(grad_residual_out).float()  # residual_out = s.to(dtype)
        d_sum = ds.to(x.dtype).reshape(x.shape)
        return d_sum, d_sum.to(residual.dtype), dw.to(weight.dtype), None, None

    return backward


def register():
    """Register every op's formula; called once, by `import mxfuse.ops` (torch.library keeps them)."""
    for name, offset in (("gemma_rmsnorm", 1.0), ("rms_norm", 0.0)):
        torch.library.register_autograd(f"mxfuse::{name}", _norm_backward(offset), setup_context=_setup_norm)
    for name, offset in (("gemma_fused_add_rmsnorm", 1.0), ("fused_add_rms_norm", 0.0)):
        torch.library.register_autograd(
            f"mxfuse::{name}", _fused_add_norm_backward(offset), setup_context=_setup_fused_add_norm
        )
    for op in (
        "mxfp8_quantize",
        "gemma_rmsnorm_mxfp8",
        "gemma_fused_add_rmsnorm_mxfp8",
        "rms_norm_mxfp8",
        "fused_add_rms_norm_mxfp8",
        "gemma_rmsnorm_mxfp8_packed",
        "gemma_fused_add_rmsnorm_mxfp8_packed",
        "mxfp8_quantize_packed",
        "mxfp8_linear",
    ):
        torch.library.register_autograd(f"mxfuse::{op}", _no_backward(op))
