"""The inputs of the `mxfuse::` ops: the shared checks, and the views the impls take of them
(their outputs: :mod:`mxfuse.ops.outputs`).

Every check raises :class:`~mxfuse.ops.errors.MxfuseInputError` as `mxfuse::<op>: ...`,
naming the op it was given (each impl passes its own), the shapes and the dtypes. The
fake impls run the same checks as the CPU and CUDA impls, so a bad call fails the same way
when a graph is traced.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from mxfuse.ops.errors import describe, fail
from mxfuse.ops.mx_layout import BLOCK
from mxfuse.ops.reference import QuantRule

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
"""What a norm (and a fused norm + quant) takes as its rows and residual."""
QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""What a quant takes as its rows."""


def check_rows(op: str, x: Tensor, dtypes: Collection[torch.dtype] = ACTIVATION_DTYPES, name: str = "x") -> int:
    """`[..., K]` rows with `K` a positive multiple of `BLOCK` and a dtype in `dtypes`; returns K."""
    if x.dim() < 1:
        fail(op, f"{name} must have a last (hidden) dimension, got a scalar")
    k = x.shape[-1]
    if k % BLOCK:
        fail(op, f"hidden size K={k} of {name} {describe(x)} is not a multiple of {BLOCK}")
    if k == 0:
        fail(op, f"hidden size K=0 of {name} {describe(x)}: rows must hold at least one block of {BLOCK}")
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        fail(op, f"{name} {describe(x)} has dtype {x.dtype}; expected one of {allowed}")
    return k


def check_same_device(op: str, **tensors: Tensor) -> None:
    """Every tensor on one device (type and index)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len({d.type for d in devices.values()}) > 1 or len(set(devices.values())) > 1:
        fail(op, "inputs are on different devices: " + ", ".join(f"{n} on {d}" for n, d in devices.items()))


def check_norm(op: str, x: Tensor, weight: Tensor, residual: Tensor | None = None, *, eps: float) -> int:
    """The inputs of a norm: rows `x` (:func:`check_rows`), a floating-point weight `[K]`, a residual
    of x's shape and dtype when given, one device, `eps >= 0`; returns K."""
    if not eps >= 0:  # also rejects NaN
        fail(op, f"eps={eps} must be >= 0 (it is added to the mean square before the rsqrt)")
    k = check_rows(op, x)
    if weight.shape != (k,):
        fail(op, f"weight {describe(weight)} must have shape ({k},) to match x {describe(x)}")
    if not weight.is_floating_point():
        fail(op, f"weight {describe(weight)} must be floating point")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            fail(op, f"residual {describe(residual)} must match x {describe(x)} in shape and dtype")
        tensors["residual"] = residual
    check_same_device(op, **tensors)
    return k


def check_rule(op: str, rule: int) -> QuantRule:
    """The op's `rule` argument as a :class:`QuantRule`."""
    if rule not in set(QuantRule):
        fail(op, f"rule={rule!r} is not a QuantRule ({', '.join(f'{r.value}={r.name}' for r in QuantRule)})")
    return QuantRule(rule)


def runtime_eps(op: str, eps: float, eps_tensor: Tensor | None) -> float | Tensor:
    """The eps to use: `eps_tensor` (a 0-d float tensor on the host, e.g. the graph input
    `torch.compile(dynamic=True)` makes of a float attribute) when given, else `eps`."""
    if eps_tensor is None:
        return eps
    if eps_tensor.dim() != 0 or not eps_tensor.is_floating_point() or eps_tensor.device.type != "cpu":
        fail(op, f"eps_tensor {describe(eps_tensor)} must be a 0-d floating-point tensor on the cpu")
    return eps_tensor.float()


def host_eps(eps: float | Tensor) -> float:
    """A Python float for a Triton launch (a host tensor: no device sync)."""
    return float(eps)


def as_rows(x: Tensor, k: int) -> Tensor:
    """`[M, K]` view of `[..., K]` with a unit last stride (copies only when it must)."""
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def kernel_offset(weight_offset: float) -> float:
    """The weight offset as the kernels add it: 0 as -0.0, the identity (as in the reference)."""
    return weight_offset or -0.0
