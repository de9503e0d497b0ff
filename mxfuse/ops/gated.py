"""The gated producers of an MXFP8 activation: their references, their ops, fused and unfused.

Two producers feed an MXFP8 linear in Qwen3.5 / Qwen3-Next layers besides the norms:

- the gated attention output, `attn_out * sigmoid(gate)` before o_proj
  (vLLM `models/qwen3_next.py:466-467`, Hugging Face `qwen3_next/modeling_qwen3_next.py:300`);
- the gated RMSNorm of the Gated DeltaNet layers, `rms(x) * w * silu(z)` per head, before
  out_proj (vLLM `RMSNormGated.forward_static`, `model_executor/layers/layernorm.py:349-396`,
  as Inductor's graph holds it; Hugging Face `Qwen3NextRMSNormGated` / `Qwen3_5RMSNormGated`).

Ops (`torch.ops.mxfuse.*`, functional; `y` is empty unless `emit_y`, as in library.py):

- `sigmoid_gate(x, gate, round_gate=True) -> y`
- `sigmoid_gate_mxfp8(x, gate, swizzled=False, emit_y=False, rule=0, round_gate=True)
  -> (codes, scales, y)`
- `gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate=True, activation="silu",
  round_normalized=False, round_weighted=False) -> y`
- `gated_rms_norm_mxfp8(x, z, weight, eps, group_size, swizzled=False, emit_y=False, rule=0,
  norm_before_gate=True, activation="silu", round_normalized=False, round_weighted=False)
  -> (codes, scales, y)`

Each fused op is bitwise `mxfp8_quantize(<unfused op>(...), swizzled, rule)`: the quant reads
the ROUNDED `y`. Where the sources differ, the difference is an argument (set by the
recognizer from the graph, never guessed):

- `round_gate`: the sigmoid is rounded to x's dtype before the multiply (`torch.sigmoid` of a
  bf16 gate, as both vLLM and Hugging Face write it); False: the fp32 sigmoid times x, one
  rounding.
- `group_size` G: the mean square is taken over groups of G consecutive values of a row (one
  head: vLLM's `[T, H, D]` input with `group_size=None` is G = D over rows of H*D).
- `norm_before_gate`: `rms(x) * w * act(z)` (True, Qwen) or `rms(x * act(z)) * w` (False).
- `activation`: "silu", `z / (1 + exp(-z))` (the decomposition Inductor's graph holds for
  `F.silu`), or "sigmoid" (`torch.sigmoid`, which the graph keeps); both in fp32.
- `round_normalized`: `rms(x)` rounded to the dtype before the weight multiply (Hugging Face's
  `self.weight * hidden_states.to(input_dtype)`); `round_weighted`: that product rounded to
  the dtype before the gate multiply (Hugging Face's bf16 weight times a bf16 tensor). vLLM's
  native form keeps fp32 throughout (both False).

Inputs: x `[..., K]` bf16 or fp16 (K % 32 == 0); gate / z of x's shape and dtype; weight `[G]`
(one head's, repeated over the groups) or `[K]`, floating point; G divides K and is a
multiple of 32. Bad input raises :class:`mxfuse.ops.library.MxfuseInputError` naming the op.

CUDA impls: :mod:`mxfuse.ops.triton_gated_quant` (one kernel per producer; the unfused op is
the same kernel storing `y` instead of quantizing it, so fused == unfused + quant bitwise on
the device by construction).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.errors import describe as _describe, fail as _fail
from mxfuse.ops.inputs import (
    ACTIVATION_DTYPES,
    as_rows as _rows,
    check_rows as _check_rows,
    check_rule as _check_rule,
    check_same_device as _check_same_device,
)
from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, SCALE_DTYPE, scale_shape
from mxfuse.ops.outputs import empty_y as _empty_y, kernel_scales, reference_scales
from mxfuse.ops.registry import Impls, OpSpec

ACTIVATIONS = ("silu", "sigmoid")
"""The gate activations of `gated_rms_norm` (vLLM's `RMSNormGated` takes "swish" as "silu")."""


# ------------------------------------------------------------------ the references


def sigmoid_gate_rows(x: Tensor, gate: Tensor, round_gate: bool = True) -> Tensor:
    """`x * sigmoid(gate)`: fp32 sigmoid, rounded to x's dtype when `round_gate`, times x, one rounding.

    With `round_gate` this is torch's `x * torch.sigmoid(gate)` on bf16 / fp16 tensors bit for
    bit (both ops compute in fp32 and round their result; the product of two bf16 values is
    exact in fp32, so its one rounding is the bf16 multiply's).
    """
    g = torch.sigmoid(gate.float())
    if round_gate:
        g = g.to(x.dtype).float()
    return (x.float() * g).to(x.dtype)


def gate_activation(z: Tensor, activation: str) -> Tensor:
    """fp32 `silu(z)` or `sigmoid(z)` as Inductor's graph holds them: `F.silu` decomposed (neg, exp,
    add 1, div: `z / (1 + exp(-z))`), `torch.sigmoid` kept as `aten.sigmoid` (on CPU its own kernel,
    not the same bits as `1 / (1 + exp(-z))`; on CUDA torch computes that formula for both)."""
    if activation == "silu":
        return z / (torch.exp(-z) + 1)
    return torch.sigmoid(z)


def _full_weight(weight: Tensor, k: int) -> Tensor:
    """The fp32 weight over a whole row: a `[G]` weight repeated over the K / G groups."""
    w = weight.float()
    return w if w.shape[0] == k else w.repeat(k // w.shape[0])


def gated_rms_norm_rows(
    x: Tensor,
    z: Tensor,
    weight: Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool = True,
    activation: str = "silu",
    round_normalized: bool = False,
    round_weighted: bool = False,
) -> Tensor:
    """The gated RMSNorm of `[M, K]` rows, per group of `group_size` values, rounded once to x's dtype
    (plus the roundings `round_normalized` / `round_weighted` ask for; module docstring)."""
    m, k = x.shape
    dtype = x.dtype
    s = x.float()
    act = gate_activation(z.float(), activation)
    if not norm_before_gate:
        s = s * act
    groups = s.reshape(m, k // group_size, group_size)
    variance = groups.pow(2).mean(dim=-1, keepdim=True)
    n = (groups * torch.rsqrt(variance + eps)).reshape(m, k)
    if round_normalized:
        n = n.to(dtype).float()
    out = n * _full_weight(weight, k)
    if round_weighted:
        out = out.to(dtype).float()
    if norm_before_gate:
        out = out * act
    return out.to(dtype)


# ------------------------------------------------------------------ checks


def _check_pair(op: str, x: Tensor, other: Tensor, name: str) -> int:
    k = _check_rows(op, x, ACTIVATION_DTYPES)
    if other.shape != x.shape or other.dtype != x.dtype:
        _fail(op, f"{name} {_describe(other)} must match x {_describe(x)} in shape and dtype")
    return k


def _check_gate(op: str, x: Tensor, gate: Tensor, rule: int | None = None) -> int:
    k = _check_pair(op, x, gate, "gate")
    _check_same_device(op, x=x, gate=gate)
    if rule is not None:
        _check_rule(op, rule)
    return k


def _check_gated_norm(
    op: str, x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, activation: str, rule: int | None = None
) -> int:
    if not eps >= 0:  # also rejects NaN
        _fail(op, f"eps={eps} must be >= 0 (it is added to the mean square before the rsqrt)")
    k = _check_pair(op, x, z, "z")
    if group_size <= 0 or group_size % BLOCK or k % group_size:
        _fail(op, f"group_size={group_size} must be a positive multiple of {BLOCK} dividing K={k} of x {_describe(x)}")
    if weight.dim() != 1 or weight.shape[0] not in (group_size, k):
        _fail(op, f"weight {_describe(weight)} must have shape ({group_size},) (one group) or ({k},) (the row)")
    if not weight.is_floating_point():
        _fail(op, f"weight {_describe(weight)} must be floating point")
    if activation not in ACTIVATIONS:
        _fail(op, f"activation={activation!r} must be one of {', '.join(ACTIVATIONS)}")
    _check_same_device(op, x=x, z=z, weight=weight)
    if rule is not None:
        _check_rule(op, rule)
    return k


def _fake_quant_outputs(x: Tensor, k: int, swizzled: bool, emit_y: bool) -> tuple[Tensor, Tensor, Tensor]:
    return (
        x.new_empty(x.shape, dtype=FP8_DTYPE),
        x.new_empty(scale_shape(x.shape[:-1], k, swizzled), dtype=SCALE_DTYPE),
        x.new_empty(x.shape) if emit_y else _empty_y(x),
    )


def _quant_outputs(x: Tensor, k: int, y: Tensor, swizzled: bool, emit_y: bool, rule: int):
    codes, scales = reference.quantize_rows(y, rule)
    return (
        codes.reshape(x.shape),
        reference_scales(scales, x.shape[:-1], k, swizzled),
        y.reshape(x.shape) if emit_y else _empty_y(x),
    )


def _cuda_outputs(x: Tensor, k: int, codes: Tensor, scales: Tensor, y: Tensor | None, swizzled: bool, emit_y: bool):
    return (
        codes.reshape(x.shape),
        kernel_scales(scales, x.shape[:-1], k, swizzled),
        y.reshape(x.shape) if emit_y and y is not None else _empty_y(x),
    )


# ------------------------------------------------------------------ sigmoid_gate


def _gate(op: str, *, x: Tensor, gate: Tensor, round_gate: bool) -> Tensor:
    k = _check_gate(op, x, gate)
    return sigmoid_gate_rows(_rows(x, k), _rows(gate, k), round_gate).reshape(x.shape)


def _gate_fake(op: str, *, x: Tensor, gate: Tensor, round_gate: bool) -> Tensor:
    _check_gate(op, x, gate)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gate_cuda(op: str, *, x: Tensor, gate: Tensor, round_gate: bool) -> Tensor:
    from mxfuse.ops import triton_gated_quant

    k = _check_gate(op, x, gate)
    _, _, y = triton_gated_quant.sigmoid_gate(_rows(x, k), _rows(gate, k), quant=False, round_gate=round_gate)
    assert y is not None  # the unfused kernel always writes y
    return y.reshape(x.shape)


def _gate_quant(
    op: str, *, x: Tensor, gate: Tensor, swizzled: bool, emit_y: bool, rule: int, round_gate: bool
) -> tuple[Tensor, Tensor, Tensor]:
    k = _check_gate(op, x, gate, rule)
    y = sigmoid_gate_rows(_rows(x, k), _rows(gate, k), round_gate)
    return _quant_outputs(x, k, y, swizzled, emit_y, rule)


def _gate_quant_fake(
    op: str, *, x: Tensor, gate: Tensor, swizzled: bool, emit_y: bool, rule: int, round_gate: bool
) -> tuple[Tensor, Tensor, Tensor]:
    k = _check_gate(op, x, gate, rule)
    return _fake_quant_outputs(x, k, swizzled, emit_y)


def _gate_quant_cuda(
    op: str, *, x: Tensor, gate: Tensor, swizzled: bool, emit_y: bool, rule: int, round_gate: bool
) -> tuple[Tensor, Tensor, Tensor]:
    from mxfuse.ops import triton_gated_quant

    k = _check_gate(op, x, gate, rule)
    codes, scales, y = triton_gated_quant.sigmoid_gate(
        _rows(x, k), _rows(gate, k), quant=True, swizzled=swizzled, emit_y=emit_y, rule=rule, round_gate=round_gate
    )
    return _cuda_outputs(x, k, codes, scales, y, swizzled, emit_y)


# ------------------------------------------------------------------ gated_rms_norm
#
# `variant`: the source's arithmetic, passed on by name (norm_before_gate, round_normalized,
# round_weighted; see the module docstring).


def _gated_norm(
    op: str, *, x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, activation: str, **variant: Any
) -> Tensor:
    k = _check_gated_norm(op, x, z, weight, eps, group_size, activation)
    rows = (_rows(x, k), _rows(z, k), weight, eps, group_size)
    return gated_rms_norm_rows(*rows, activation=activation, **variant).reshape(x.shape)


def _gated_norm_fake(
    op: str, *, x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, activation: str, **variant: Any
) -> Tensor:
    _check_gated_norm(op, x, z, weight, eps, group_size, activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gated_norm_cuda(
    op: str, *, x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, activation: str, **variant: Any
) -> Tensor:
    from mxfuse.ops import triton_gated_quant

    k = _check_gated_norm(op, x, z, weight, eps, group_size, activation)
    rows = (_rows(x, k), _rows(z, k), weight, eps, group_size)
    _, _, y = triton_gated_quant.gated_rms_norm(*rows, quant=False, activation=activation, **variant)
    assert y is not None  # the unfused kernel always writes y
    return y.reshape(x.shape)


def _gated_norm_quant(
    op: str,
    *,
    x: Tensor,
    z: Tensor,
    weight: Tensor,
    eps: float,
    group_size: int,
    swizzled: bool,
    emit_y: bool,
    rule: int,
    activation: str,
    **variant: Any,
) -> tuple[Tensor, Tensor, Tensor]:
    k = _check_gated_norm(op, x, z, weight, eps, group_size, activation, rule)
    rows = (_rows(x, k), _rows(z, k), weight, eps, group_size)
    y = gated_rms_norm_rows(*rows, activation=activation, **variant)
    return _quant_outputs(x, k, y, swizzled, emit_y, rule)


def _gated_norm_quant_fake(
    op: str,
    *,
    x: Tensor,
    z: Tensor,
    weight: Tensor,
    eps: float,
    group_size: int,
    swizzled: bool,
    emit_y: bool,
    rule: int,
    activation: str,
    **variant: Any,
) -> tuple[Tensor, Tensor, Tensor]:
    k = _check_gated_norm(op, x, z, weight, eps, group_size, activation, rule)
    return _fake_quant_outputs(x, k, swizzled, emit_y)


def _gated_norm_quant_cuda(
    op: str,
    *,
    x: Tensor,
    z: Tensor,
    weight: Tensor,
    eps: float,
    group_size: int,
    swizzled: bool,
    emit_y: bool,
    rule: int,
    activation: str,
    **variant: Any,
) -> tuple[Tensor, Tensor, Tensor]:
    from mxfuse.ops import triton_gated_quant

    k = _check_gated_norm(op, x, z, weight, eps, group_size, activation, rule)
    rows = (_rows(x, k), _rows(z, k), weight, eps, group_size)
    codes, scales, y = triton_gated_quant.gated_rms_norm(
        *rows, quant=True, swizzled=swizzled, emit_y=emit_y, rule=rule, activation=activation, **variant
    )
    return _cuda_outputs(x, k, codes, scales, y, swizzled, emit_y)


# -------------------------------------------------------------------- the table

_GATED_NORM_ARGS = "Tensor x, Tensor z, Tensor weight, float eps, SymInt group_size"
_GATED_NORM_FLAGS = (
    'bool norm_before_gate=True, str activation="silu", bool round_normalized=False, bool round_weighted=False'
)
_QUANT_FLAGS = "bool swizzled=False, bool emit_y=False, SymInt rule=0"

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "sigmoid_gate(Tensor x, Tensor gate, bool round_gate=True) -> Tensor",
        Impls(cpu=_gate, fake=_gate_fake, cuda=_gate_cuda),
        "`x * sigmoid(gate)` rounded to x's dtype (the sigmoid rounded first when `round_gate`).",
    ),
    OpSpec(
        f"sigmoid_gate_mxfp8(Tensor x, Tensor gate, {_QUANT_FLAGS}, bool round_gate=True) -> (Tensor, Tensor, Tensor)",
        Impls(cpu=_gate_quant, fake=_gate_quant_fake, cuda=_gate_quant_cuda),
        """`x * sigmoid(gate)` and its MXFP8 quant in one pass: `(codes, scales, y)`; y empty unless emit_y.

        Bitwise `mxfp8_quantize(sigmoid_gate(x, gate, round_gate), swizzled, rule)`.""",
    ),
    OpSpec(
        f"gated_rms_norm({_GATED_NORM_ARGS}, {_GATED_NORM_FLAGS}) -> Tensor",
        Impls(cpu=_gated_norm, fake=_gated_norm_fake, cuda=_gated_norm_cuda),
        "The gated RMSNorm `rms(x) * w * act(z)` per group of `group_size`, rounded to x's dtype.",
    ),
    OpSpec(
        f"gated_rms_norm_mxfp8({_GATED_NORM_ARGS}, {_QUANT_FLAGS}, {_GATED_NORM_FLAGS}) -> (Tensor, Tensor, Tensor)",
        Impls(cpu=_gated_norm_quant, fake=_gated_norm_quant_fake, cuda=_gated_norm_quant_cuda),
        """The gated RMSNorm and its MXFP8 quant in one pass: `(codes, scales, y)`; y empty unless emit_y.

        Bitwise `mxfp8_quantize(gated_rms_norm(x, z, weight, eps, group_size, ...), swizzled, rule)`.""",
    ),
)
