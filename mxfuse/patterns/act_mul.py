"""act·mul producers: `act(gate) * up` feeding an MXFP8 quant (down_proj's input), from every source.

Before (vLLM's native `SiluAndMul` as Inductor's post-grad graph holds it; the gate and up are
the two halves of the gate_up GEMM's output)::

    gate = slice(gate_up, -1, 0, I);   up = slice(gate_up, -1, I, 2I)
    g32  = convert(gate, f32);         a = convert(g32 * sigmoid(g32), bf16)     # F.silu
    y    = mul(a, up)                                                           # bf16
    q, s = vllm.mxfp8_quantize(y.view(-1, I), True)

After (rewrite 1, :mod:`.producer_quant`, with this module's match)::

    q, s, _ = mxfuse.act_mul_mxfp8(gate_up, "silu", gate_first=True, swizzled=True)

Recognized (each returns an :class:`ActMulMatch`, a
:class:`~mxfuse.patterns.producers.ProducerMatch` of family ACT_MUL; the match and its refusal
codes live in :mod:`.act_mul_match`):

- decomposed ATen (vLLM's native `SiluAndMul` / `GeluAndMul(approximate="tanh")` /
  `SwigluStepAndMul`, Hugging Face's MLPs, gpt-oss / MiniMax-M3's clamped SwiGLU, mxfuse's own
  `swiglu_oai_native` in fp32): :mod:`.act_mul_aten`, Inductor pattern trees traced from each
  source's formula. Two halves of one `[..., 2I]` tensor -> `act_mul_mxfp8` with `gate_first`;
  two other tensors -> `act_mul_pair_mxfp8`.
- vLLM's `_C.silu_and_mul` / `_C.gelu_tanh_and_mul` under `auto_functionalized` (a user who
  enables the custom op): the CUDA kernel rounds the activation to the dtype, then multiplies
  in the dtype (`round_each_op=True`).
- the project's `mxfuse_models::swiglu_oai` (mxfuse/models.py): fp32 throughout, one rounding.

torchao's MX activation quant needs nothing here: its quant side is :mod:`.torchao_quant`'s and
the producer in front of it is one of the forms above.

Refused with :class:`ActMulCode` (the site is left exactly as it was): a gate / up that are not
`[..., I]` tensors of one shape, bf16 / fp16, `I` static and a multiple of 32; `alpha` / `limit`
that are not constants; gate and up interleaved (vLLM's `SwigluOAIAndMul`); vLLM's
`SiluAndMulWithClamp` with `beta != 1`; the packed op of rewrite 2 (an activation is local to a
rank: it never crosses the SP all-gather, so there is no packed act·mul op).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from mxfuse.ops.activations import SWIGLU_LIMIT, SWIGLU_OAI_ALPHA
from mxfuse.patterns.act_mul_aten import CONVERTS, as_float, match_decomposed
from mxfuse.patterns.act_mul_match import ActMulCode, ActMulMatch

__all__ = ["ActMulCode", "ActMulMatch", "act_mul_candidates", "match_act_mul"]

aten = torch.ops.aten


# ------------------------------------------------------------------ the opaque forms

_VLLM_C = {"silu_and_mul": "silu", "gelu_tanh_and_mul": "gelu_tanh"}
"""vLLM's `_C` act·mul kernels whose arithmetic the fused op reproduces (activation rounded to the
dtype, then a dtype multiply; `[gate | up]` halves)."""


def _functionalized_op(node: fx.Node):
    """`(op, kwargs)` of an `auto_functionalized(op, **kwargs)` node (v1 or v2), else None."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    if node.op != "call_function" or node.target not in (auto_functionalized, auto_functionalized_v2):
        return None
    return node.args[0], node.kwargs


def _match_vllm_c(y: fx.Node) -> ActMulMatch | None:
    """`getitem(auto_functionalized(_C.silu_and_mul, result=..., input=x), 1)`: the written result."""
    if y.target is not operator.getitem or not isinstance(y.args[0], fx.Node):
        return None
    found = _functionalized_op(y.args[0])
    if found is None:
        return None
    op, kwargs = found
    name = getattr(op, "_schema", None) and op._schema.name
    if not name or not name.startswith("_C::") or name.removeprefix("_C::") not in _VLLM_C:
        return None
    x = kwargs.get("input")
    if not isinstance(x, fx.Node) or y.args[1] != 1:  # output 1: the mutated `result` (v1) / its base (v2)
        return None
    activation = _VLLM_C[name.removeprefix("_C::")]
    return ActMulMatch("vllm_c", activation, y, y, gate_up=x, gate_first=True)


def _match_mxfuse_models(y: fx.Node) -> ActMulMatch | None:
    """mxfuse/models.py's opaque `mxfuse_models::swiglu_oai(gate_up, alpha, limit)` (fp32, one rounding)."""
    ns = getattr(torch.ops, "mxfuse_models", None)
    op = getattr(ns, "swiglu_oai", None) if ns is not None else None
    if op is None or y.target is not getattr(op, "default", None):
        return None
    args: list[Any] = [*y.args, None, None]
    alpha = y.kwargs.get("alpha", args[1] if args[1] is not None else SWIGLU_OAI_ALPHA)
    limit = y.kwargs.get("limit", args[2] if args[2] is not None else SWIGLU_LIMIT)
    alpha, limit = as_float(alpha), as_float(limit)
    ok = alpha is not None and limit is not None
    return ActMulMatch(
        "mxfuse_models",
        "swiglu_oai",
        y,
        y,
        gate_up=y.args[0],  # type: ignore[arg-type]
        alpha=alpha if ok else None,
        limit=limit if ok else None,
        round_each_op=False,
    )


def match_act_mul(y: fx.Node) -> ActMulMatch | None:
    """The act·mul whose output `y` is, in any form; None if `y` is not one."""
    if y.op != "call_function":
        return None
    for recognize in (_match_mxfuse_models, _match_vllm_c, match_decomposed):
        found = recognize(y)
        if found is not None:
            return found
    return None


_CANDIDATE_TARGETS = (aten.mul.Tensor, operator.getitem, *CONVERTS)


def act_mul_candidates(graph: fx.Graph) -> list[fx.Node]:
    """The nodes :func:`match_act_mul` can return a match for (a superset)."""
    ns = getattr(torch.ops, "mxfuse_models", None)
    swiglu = getattr(getattr(ns, "swiglu_oai", None), "default", None) if ns is not None else None
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and (n.target in _CANDIDATE_TARGETS or (swiglu is not None and n.target is swiglu))
    ]
