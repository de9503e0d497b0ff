"""act·mul ops: the gated activation of an MLP (`act(gate) * up`), alone and fused with MXFP8.

A dense decoder layer's down_proj reads `act(gate) * up` of the gate_up GEMM's output.
Without a fused op the activation writes bf16 `[M, I]` and the MXFP8 quant reads it back:
the largest round trip of the layer (4·I bytes per token). These ops compute it in one
pass and write the e4m3 codes and E8M0 scales the MXFP8 GEMM reads (and `y` when
something else reads it).

Activations (`activation`, a string; `alpha` and `limit` are read only by the ones that
name them)::

    silu          a = silu(g)
    gelu_tanh     a = gelu(g, approximate="tanh")                 (torch's constants)
    swiglu_step   a = min(silu(g), limit);      u = clamp(u, -limit, limit)
                  (vLLM's SwigluStepAndMul, Step-3.5)
    swiglu_oai    g = min(g, limit);            u = clamp(u, -limit, limit) + 1
                  a = g * sigmoid(alpha * g)    (gpt-oss, MiniMax-M3; alpha 1.702, limit 7)
    y = a * u

Where the sources differ is where they round, an explicit argument (`round_each_op`) set
from the match, never guessed:

- `round_each_op=True` (default): every torch op of the formula rounds to the input dtype,
  what a graph of bf16 ops computes eagerly. vLLM's native `SiluAndMul` (`F.silu(x[..., :d])
  * x[..., d:]`: the SiLU in fp32, `.to(bf16)`, then a bf16 multiply), its CUDA
  `silu_and_mul` kernel (`(T)silu(x)` then a `T` multiply), Hugging Face eager
  (`ACT2FN[act](gate_proj(x)) * up_proj(x)`; gpt-oss's `gate * torch.sigmoid(gate *
  alpha)`, `(up + 1) * glu`: five rounded ops).
- `round_each_op=False`: fp32 throughout, one rounding of the product: mxfuse's own
  `swiglu_oai` (`mxfuse/models.py`, `gate_up.float()` then `.to(dtype)`), vLLM's ROCm
  `swiglu_oai_quantize_mxfp8`.

The quant reads the ROUNDED y, so `act_mul_mxfp8 == mxfp8_quantize(act_mul)` bitwise (the
contract of docs/design.md's norms, "the quant reads the rounded y").

Inputs: `act_mul` / `act_mul_mxfp8` take the `[..., 2I]` output of a merged gate_up GEMM
(`gate_first`: the gate is the first half, vLLM's and Hugging Face's order; False: the
second); `act_mul_pair` / `act_mul_pair_mxfp8` take gate and up as two `[..., I]` tensors
(Hugging Face's `act(gate_proj(x)) * up_proj(x)`). `I % 32 == 0`; bf16 or fp16.

Ops (functional; `y` of the fused ops is empty unless `emit_y`, as in library.py):

- `act_mul(gate_up, activation, gate_first, alpha, limit, round_each_op) -> y`
- `act_mul_pair(gate, up, activation, alpha, limit, round_each_op) -> y`
- `act_mul_mxfp8(gate_up, activation, gate_first, swizzled, emit_y, rule, alpha, limit,
  round_each_op) -> (codes, scales, y)`
- `act_mul_pair_mxfp8(gate, up, activation, swizzled, emit_y, rule, alpha, limit,
  round_each_op) -> (codes, scales, y)`

CPU impl: :func:`act_mul_rows` (torch's own fp32 ops: `F.silu`, `F.gelu(approximate=
"tanh")`, `torch.sigmoid`, so it is each source's eager arithmetic bit for bit on CPU).
CUDA impl: `triton_act_quant` (one kernel, the unfused op with `QUANT` off: fused ==
unfused bitwise on the device by construction; vs. torch's CUDA functions within the
bound of docs/design.md, "act·mul producers").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.errors import describe as _describe, fail as _fail
from mxfuse.ops.inputs import ACTIVATION_DTYPES, check_rule as _check_rule
from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, SCALE_DTYPE, scale_shape
from mxfuse.ops.outputs import empty_y as _empty_y, kernel_scales, reference_scales
from mxfuse.ops.registry import Impls, OpSpec

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_step", "swiglu_oai")
"""The activations the ops compute (the `activation` argument)."""
SWIGLU_OAI_ALPHA = 1.702
"""gpt-oss / MiniMax-M3's `alpha` (the sigmoid's slope)."""
SWIGLU_LIMIT = 7.0
"""gpt-oss / MiniMax-M3 / Step-3.5's clamp limit."""
_USES_LIMIT = ("swiglu_step", "swiglu_oai")

__all__ = ["ACTIVATIONS", "OPS", "SWIGLU_LIMIT", "SWIGLU_OAI_ALPHA", "act_mul_rows", "split_gate_up"]


# ------------------------------------------------------------------ the reference


def act_mul_rows(
    gate: Tensor,
    up: Tensor,
    activation: str,
    alpha: float = SWIGLU_OAI_ALPHA,
    limit: float = SWIGLU_LIMIT,
    round_each_op: bool = True,
) -> Tensor:
    """`act(gate) * up` of same-shape gate / up (bf16 or fp16), in gate's dtype.

    Computed in fp32 with torch's own functions. `round_each_op`: round every op's result
    to the dtype (a graph of dtype ops, eager); False: one rounding of the product. A clamp
    against a limit the dtype cannot hold rounds to the dtype's neighbour either way,
    exactly as torch's dtype clamp does (a clamped value is representable, and rounding is
    monotonic).
    """
    dtype = gate.dtype

    def rnd(v: Tensor) -> Tensor:
        return v.to(dtype).float() if round_each_op else v

    g, u = gate.float(), up.float()
    if activation == "silu":
        a = rnd(F.silu(g))
    elif activation == "gelu_tanh":
        a = rnd(F.gelu(g, approximate="tanh"))
    elif activation == "swiglu_step":
        a = rnd(rnd(F.silu(g)).clamp(max=limit))
        u = rnd(u.clamp(min=-limit, max=limit))
    elif activation == "swiglu_oai":
        g = rnd(g.clamp(max=limit))
        a = rnd(g * rnd(torch.sigmoid(rnd(g * alpha))))
        u = rnd(rnd(u.clamp(min=-limit, max=limit)) + 1.0)
    else:
        raise ValueError(f"act_mul_rows: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    return (a * u).to(dtype)


def split_gate_up(gate_up: Tensor, gate_first: bool = True) -> tuple[Tensor, Tensor]:
    """`(gate, up)` views of the two halves of `[..., 2I]`."""
    first, second = gate_up.chunk(2, dim=-1)
    return (first, second) if gate_first else (second, first)


# ------------------------------------------------------------------ checks


def _check_params(op: str, activation: str, alpha: float, limit: float):
    if activation not in ACTIVATIONS:
        _fail(op, f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if activation in _USES_LIMIT and not (limit > 0 and math.isfinite(limit)):
        _fail(op, f"limit={limit} of {activation} must be a finite value > 0")
    if activation == "swiglu_oai" and not math.isfinite(alpha):
        _fail(op, f"alpha={alpha} of swiglu_oai must be finite")


def _check_half(op: str, i: int, what: str):
    if i == 0:
        _fail(op, f"{what}: I=0; the activation needs at least one block of {BLOCK} values")
    if i % BLOCK:
        _fail(op, f"{what}: I={i} is not a multiple of {BLOCK} (one MXFP8 scale per {BLOCK} values)")


def _check_dtype(op: str, name: str, t: Tensor):
    if t.dtype not in ACTIVATION_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in ACTIVATION_DTYPES)
        _fail(op, f"{name} {_describe(t)} has dtype {t.dtype}; expected one of {allowed}")


def _check_gate_up(op: str, gate_up: Tensor, activation: str, alpha: float, limit: float) -> int:
    """I of a `[..., 2I]` gate_up."""
    _check_params(op, activation, alpha, limit)
    if gate_up.dim() < 1:
        _fail(op, "gate_up must have a last dimension [..., 2I], got a scalar")
    two_i = gate_up.shape[-1]
    if two_i % 2:
        _fail(op, f"gate_up {_describe(gate_up)} has an odd last dimension {two_i}; expected [..., 2I]")
    _check_half(op, two_i // 2, f"gate_up {_describe(gate_up)}")
    _check_dtype(op, "gate_up", gate_up)
    return two_i // 2


def _check_pair(op: str, gate: Tensor, up: Tensor, activation: str, alpha: float, limit: float) -> int:
    """I of same-shape `[..., I]` gate and up."""
    _check_params(op, activation, alpha, limit)
    if gate.dim() < 1:
        _fail(op, "gate must have a last dimension [..., I], got a scalar")
    _check_dtype(op, "gate", gate)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        _fail(op, f"up {_describe(up)} must match gate {_describe(gate)} in shape and dtype")
    if up.device != gate.device:
        _fail(op, f"inputs are on different devices: gate on {gate.device}, up on {up.device}")
    _check_half(op, gate.shape[-1], f"gate {_describe(gate)}")
    return gate.shape[-1]


def _rows2(t: Tensor) -> Tensor:
    """`[M, W]` rows of `[..., W]` with a unit last stride (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.shape[-1] <= 1 or t2.stride(-1) == 1 else t2.contiguous()


def _halves(gate_up: Tensor, i: int, gate_first: bool) -> tuple[Tensor, Tensor]:
    rows = _rows2(gate_up)
    return split_gate_up(rows, gate_first)


def _out_shape(t: Tensor, i: int) -> tuple[int, ...]:
    return (*t.shape[:-1], i)


# ------------------------------------------------------------------ the shared impls


def _ref(gate, up, activation, alpha, limit, round_each_op, lead, i):
    return act_mul_rows(gate, up, activation, alpha, limit, round_each_op).reshape(*lead, i)


def _ref_quant(gate, up, activation, swizzled, emit_y, rule, alpha, limit, round_each_op, lead, i, op):
    rule = _check_rule(op, rule)
    y = act_mul_rows(gate, up, activation, alpha, limit, round_each_op)
    codes, scales = reference.quantize_rows(y, rule)
    return (
        codes.reshape(*lead, i),
        reference_scales(scales, lead, i, swizzled),
        y.reshape(*lead, i) if emit_y else y.new_empty(0),
    )


def _fake_quant(x: Tensor, i: int, lead, swizzled: bool, emit_y: bool, rule: int, op: str):
    _check_rule(op, rule)
    return (
        x.new_empty((*lead, i), dtype=FP8_DTYPE),
        x.new_empty(scale_shape(lead, i, swizzled), dtype=SCALE_DTYPE),
        x.new_empty((*lead, i)) if emit_y else _empty_y(x),
    )


def _cuda(gate, up, activation, alpha, limit, round_each_op, lead, i):
    from mxfuse.ops import triton_act_quant

    _, _, y = triton_act_quant.act_mul(
        gate, up, activation, alpha=alpha, limit=limit, round_each_op=round_each_op, quant=False
    )
    return y.reshape(*lead, i)


def _cuda_quant(gate, up, activation, swizzled, emit_y, rule, alpha, limit, round_each_op, lead, i, op):
    from mxfuse.ops import triton_act_quant

    rule = _check_rule(op, rule)
    codes, scales, y = triton_act_quant.act_mul(
        gate, up, activation, alpha=alpha, limit=limit, round_each_op=round_each_op, quant=True,
        swizzled=swizzled, emit_y=emit_y, rule=rule,
    )  # fmt: skip
    return (
        codes.reshape(*lead, i),
        kernel_scales(scales, lead, i, swizzled),
        y.reshape(*lead, i) if emit_y else _empty_y(gate),
    )


# ------------------------------------------------------------------ the ops' impls
#
# Each impl is called as `impl(op, **arguments)` (mxfuse/ops/registry.py). The `[..., 2I]`
# gate_up ops and the two-tensor ops differ only in how they reach `[M, I]` gate and up rows:
# `_on_gate_up` / `_on_pair` make an impl that checks the op's inputs, takes the rows and hands
# them to one of the six `_run_*` (reference / fake / CUDA, alone or with the quant).

_Run = Callable[..., Any]


def _on_gate_up(run: _Run) -> _Run:
    """An impl of the `[..., 2I]` ops: checks, the two halves as rows, then `run`."""

    def impl(op: str, *, gate_up: Tensor, activation: str, gate_first: bool, alpha: float, limit: float, **rest: Any):
        gate, up, lead, i = _gate_up_rows(op, gate_up, activation, gate_first, alpha, limit)
        return run(op, gate, up, lead, i, activation=activation, alpha=alpha, limit=limit, **rest)

    return impl


def _on_pair(run: _Run) -> _Run:
    """An impl of the two-tensor ops: checks, gate and up as rows, then `run`."""

    def impl(op: str, *, gate: Tensor, up: Tensor, activation: str, alpha: float, limit: float, **rest: Any):
        i = _check_pair(op, gate, up, activation, alpha, limit)
        rows = (_rows2(gate), _rows2(up), tuple(gate.shape[:-1]), i)
        return run(op, *rows, activation=activation, alpha=alpha, limit=limit, **rest)

    return impl


def _gate_up_rows(op: str, gate_up: Tensor, activation: str, gate_first: bool, alpha: float, limit: float):
    i = _check_gate_up(op, gate_up, activation, alpha, limit)
    gate, up = _halves(gate_up, i, gate_first)
    return gate, up, tuple(gate_up.shape[:-1]), i


def _run_ref(op: str, gate: Tensor, up: Tensor, lead, i: int, *, activation, alpha, limit, round_each_op) -> Tensor:
    return _ref(gate, up, activation, alpha, limit, round_each_op, lead, i)


def _run_fake(op: str, gate: Tensor, up: Tensor, lead, i: int, **_: Any) -> Tensor:
    return gate.new_empty((*lead, i))


def _run_cuda(op: str, gate: Tensor, up: Tensor, lead, i: int, *, activation, alpha, limit, round_each_op) -> Tensor:
    return _cuda(gate, up, activation, alpha, limit, round_each_op, lead, i)


def _run_ref_quant(op: str, gate: Tensor, up: Tensor, lead, i: int, *, activation, swizzled, emit_y, rule, alpha,
                   limit, round_each_op):  # fmt: skip
    return _ref_quant(gate, up, activation, swizzled, emit_y, rule, alpha, limit, round_each_op, lead, i, op)


def _run_fake_quant(op: str, gate: Tensor, up: Tensor, lead, i: int, *, swizzled, emit_y, rule, **_: Any):
    return _fake_quant(gate, i, lead, swizzled, emit_y, rule, op)


def _run_cuda_quant(op: str, gate: Tensor, up: Tensor, lead, i: int, *, activation, swizzled, emit_y, rule, alpha,
                    limit, round_each_op):  # fmt: skip
    return _cuda_quant(gate, up, activation, swizzled, emit_y, rule, alpha, limit, round_each_op, lead, i, op)


# -------------------------------------------------------------------- the table

_PARAMS = f"float alpha={SWIGLU_OAI_ALPHA}, float limit={SWIGLU_LIMIT}, bool round_each_op=True"
_QUANT_FLAGS = "bool swizzled=False, bool emit_y=False, SymInt rule=0"

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        f"act_mul(Tensor gate_up, str activation, bool gate_first=True, {_PARAMS}) -> Tensor",
        Impls(cpu=_on_gate_up(_run_ref), fake=_on_gate_up(_run_fake), cuda=_on_gate_up(_run_cuda)),
        "`act(gate) * up` of the halves of `[..., 2I]` gate_up: `[..., I]` in gate_up's dtype.",
    ),
    OpSpec(
        f"act_mul_pair(Tensor gate, Tensor up, str activation, {_PARAMS}) -> Tensor",
        Impls(cpu=_on_pair(_run_ref), fake=_on_pair(_run_fake), cuda=_on_pair(_run_cuda)),
        "`act(gate) * up` of two `[..., I]` tensors (Hugging Face's `act(gate_proj(x)) * up_proj(x)`).",
    ),
    OpSpec(
        f"act_mul_mxfp8(Tensor gate_up, str activation, bool gate_first=True, {_QUANT_FLAGS}, {_PARAMS})"
        " -> (Tensor, Tensor, Tensor)",
        Impls(cpu=_on_gate_up(_run_ref_quant), fake=_on_gate_up(_run_fake_quant), cuda=_on_gate_up(_run_cuda_quant)),
        """act·mul and MXFP8 quant in one pass: `(codes, scales, y)`; y is empty unless emit_y.

        Bitwise equal to `mxfp8_quantize(act_mul(gate_up, ...), swizzled, rule)`. `swizzled` /
        `rule`: as in `mxfp8_quantize`.""",
    ),
    OpSpec(
        f"act_mul_pair_mxfp8(Tensor gate, Tensor up, str activation, {_QUANT_FLAGS}, {_PARAMS})"
        " -> (Tensor, Tensor, Tensor)",
        Impls(cpu=_on_pair(_run_ref_quant), fake=_on_pair(_run_fake_quant), cuda=_on_pair(_run_cuda_quant)),
        """`act_mul_mxfp8` of two `[..., I]` tensors: `(codes, scales, y)`.

        Bitwise equal to `mxfp8_quantize(act_mul_pair(gate, up, ...), swizzled, rule)`.""",
    ),
)
