"""Recognizers for every form a Gemma or a standard RMSNorm takes in a post-grad graph.

A recognizer is anchored at the node that holds the norm's output `y` and returns a
:class:`NormMatch` (what a replacement needs: inputs, eps, numerics mode, the nodes
holding `y` and `residual_out`) or None. Gemma norms multiply by `1 + w`, standard ones
(`standard=True`) by `w`. Forms:

- ``mxfuse``: `mxfuse::gemma_rmsnorm` / `gemma_fused_add_rmsnorm` and the standard
  `mxfuse::rms_norm` / `fused_add_rms_norm` (getitem 0 is y), `round_normalized` as called;
- ``flashinfer``: `flashinfer::gemma_rmsnorm` / `gemma_fused_add_rmsnorm` and the standard
  `flashinfer::rmsnorm` / `fused_add_rmsnorm`, in place, under `auto_functionalized` (v1,
  vLLM) or `auto_functionalized_v2` (torch default); fp32 throughout, one rounding;
- ``vllm_ir``: `vllm_ir::rms_norm` / `fused_add_rms_norm`: with an fp32 weight (vLLM's
  `GemmaRMSNorm` passes `weight.float() + 1.0`: one rounding), or with a weight of x's dtype
  (vLLM's `RMSNorm`: the native impl `x.to(w.dtype) * w`, `round_normalized=True`); refused
  when vLLM's dispatch priority puts its oink or ROCm AITER kernel first (not reproduced);
- ``hf``: the decomposed ATen of Hugging Face's `GemmaRMSNorm` / `MiniMaxM3VLRMSNorm` and
  `LlamaRMSNorm` & co., and of `torch.nn.RMSNorm`, in each spelling of
  :mod:`mxfuse.patterns.hf_norm`, with a residual add in front of it folded in.

A recognized norm whose arithmetic differs from the fused op's carries that
`difference`; :func:`reject_reason` returns it first, so it is reported, never fused.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._inductor.pattern_matcher import get_arg_value
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import Argument

from mxfuse.ops.mx_layout import BLOCK
from mxfuse.patterns.allreduce_norm import match_allreduce_norm
from mxfuse.patterns.fx_utils import constant_float, fake, fake_dtype, is_call, single_getitem
from mxfuse.patterns.hf_norm import match_hf
from mxfuse.patterns.results import Reason, SharedCode

aten, prims = torch.ops.aten, torch.ops.prims


@dataclass(frozen=True)
class NormMatch:
    """A Gemma or standard norm found in a graph, in the terms of the mxfuse fused ops."""

    form: str
    x: fx.Node
    residual: fx.Node | None
    weight: fx.Node
    eps: float | fx.Node | None  # a node: a 0-d tensor read at run time; None: unusable (a SymFloat)
    y: fx.Node
    residual_out: fx.Node | None
    anchor: fx.Node  # first node of the norm; replacements are inserted before it
    round_sum: bool = False
    weight_offset: float = 1.0
    difference: Reason | None = None  # why its arithmetic is not the fused op's (never fused then)
    round_normalized: bool = False  # round `normalize(s)` to the dtype before the weight multiply
    standard: bool = False  # the standard RMSNorm (`normalize(x) * w`, offset 0), not Gemma's `1 + w`

    @property
    def has_residual(self) -> bool:
        return self.residual is not None

    @property
    def kind(self) -> str:
        """`form:plain` / `form:fused_add` for a Gemma norm; `form:rms_norm` / `form:fused_add_rms_norm`
        for a standard one."""
        if self.difference is not None and self.difference.code is SharedCode.NORM_CENTERED:
            return f"{self.form}:{'fused_add_layer_norm' if self.has_residual else 'layer_norm'}"
        if self.standard:
            return f"{self.form}:{'fused_add_rms_norm' if self.has_residual else 'rms_norm'}"
        return f"{self.form}:{'fused_add' if self.has_residual else 'plain'}"


def reject_reason(norm: NormMatch, *, runtime_eps: bool = False) -> Reason | None:
    """Why the fused kernel cannot stand in for this norm (None: it can).

    `runtime_eps`: the caller's fused op takes eps as a 0-d tensor operand (the
    unpacked ops do); otherwise an eps that is a graph input is a reason.
    """
    if norm.difference is not None:
        return norm.difference
    x = fake(norm.x)
    if x is None:
        return Reason(SharedCode.NO_SHAPES, "no fake tensor on the norm input (graph not traced with shapes)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        return Reason(
            SharedCode.ACTIVATION_DTYPE, f"activation dtype {x.dtype} (the fused kernel takes bfloat16/float16)"
        )
    k = x.shape[-1]
    if not statically_known_true(k % BLOCK == 0):
        text = (
            f"hidden size K={k} is not a multiple of {BLOCK}" if isinstance(k, int) else f"hidden size {k} is symbolic"
        )
        return Reason(SharedCode.HIDDEN_SIZE, text)
    eps_reason = _eps_reason(norm.eps, runtime_eps)
    if eps_reason is not None:
        return eps_reason
    w = fake(norm.weight)
    if w is None or w.dim() != 1 or not statically_known_true(w.shape[0] == k):
        return Reason(SharedCode.WEIGHT_SHAPE, f"weight shape {None if w is None else tuple(w.shape)} is not ({k},)")
    if norm.residual is not None:
        r = fake(norm.residual)
        if r is None or r.dtype != x.dtype or not same_shape(r.shape, x.shape):
            return Reason(SharedCode.RESIDUAL_MISMATCH, "residual does not match the input in shape and dtype")
    if x.device != w.device:
        return Reason(SharedCode.DEVICE_MISMATCH, f"input on {x.device}, weight on {w.device}")
    return None


def _eps_reason(eps, runtime_eps: bool) -> Reason | None:
    if isinstance(eps, float):
        if not eps >= 0:  # the fused ops refuse it (it is added to the mean square before the rsqrt)
            return Reason(SharedCode.EPS_INVALID, f"eps={eps} is not a valid norm epsilon; left unfused")
        return None
    what = "eps is not a graph constant (a float attribute made a graph input, e.g. by dynamic=True)"
    if eps is None:
        return Reason(SharedCode.EPS_NOT_CONSTANT, what)
    val = fake(eps)
    if not runtime_eps:
        return Reason(SharedCode.EPS_NOT_CONSTANT, f"{what}; this rewrite's fused op takes a constant eps")
    if val is None or val.dim() != 0 or not val.is_floating_point():
        shape = None if val is None else tuple(val.shape)
        return Reason(SharedCode.EPS_NOT_CONSTANT, f"eps is a tensor of shape {shape}, not a 0-d float scalar")
    if val.device.type != "cpu":
        text = f"eps is a 0-d tensor on {val.device}; the fused op reads a runtime eps on the host"
        return Reason(SharedCode.EPS_NOT_CONSTANT, text)
    return None


def same_shape(a, b) -> bool:
    """Shapes provably equal (dims may be symbolic)."""
    return len(a) == len(b) and all(statically_known_true(p == q) for p, q in zip(a, b))


# --------------------------------------------------------------------- mxfuse ops


def _match_mxfuse(y: fx.Node) -> NormMatch | None:
    ops = torch.ops.mxfuse
    if is_call(y, ops.gemma_rmsnorm.default, ops.rms_norm.default):
        x, w, eps, rounded = (get_arg_value(y, i, n) for i, n in enumerate(_MXFUSE_ARGS))
        return _mxfuse_match(y.target is ops.rms_norm.default, x, None, w, eps, rounded, y, None, y)
    add_ops = (ops.gemma_fused_add_rmsnorm.default, ops.fused_add_rms_norm.default)
    if is_call(y, operator.getitem) and y.args[1] == 0 and is_call(y.args[0], *add_ops):
        norm = y.args[0]
        x, r, w, eps, rounded = (get_arg_value(norm, i, n) for i, n in enumerate(("x", "residual", *_MXFUSE_ARGS[1:])))
        standard = norm.target is ops.fused_add_rms_norm.default
        return _mxfuse_match(standard, x, r, w, eps, rounded, y, single_getitem(norm, 1), norm)
    return None


_MXFUSE_ARGS = ("x", "weight", "eps", "round_normalized")


def _mxfuse_match(standard, x, r, w, eps, rounded, y, residual_out, anchor) -> NormMatch:
    return NormMatch(
        "mxfuse",
        x,
        r,
        w,
        constant_float(eps),
        y,
        residual_out,
        anchor,
        weight_offset=0.0 if standard else 1.0,
        round_normalized=bool(rounded),
        standard=standard,
    )


# ---------------------------------------------------------------- flashinfer ops


_FLASHINFER_NORMS = {  # op name -> (standard, fused_add); the standard kernels add weight_bias 0
    "gemma_rmsnorm": (False, False),
    "gemma_fused_add_rmsnorm": (False, True),
    "rmsnorm": (True, False),
    "fused_add_rmsnorm": (True, True),
}


def _flashinfer_op(target) -> tuple[bool, bool] | None:
    """`(standard, fused_add)` when `target` is one of FlashInfer's norm ops (registered only once
    something defined `torch.ops.flashinfer.*`: FlashInfer 0.7.2 itself registers none)."""
    ns = torch.ops.flashinfer
    for name, what in _FLASHINFER_NORMS.items():
        if hasattr(ns, name) and target is getattr(ns, name).default:  # hasattr tries to load the op
            return what
    return None


def _match_flashinfer(y: fx.Node) -> NormMatch | None:
    if not (is_call(y, operator.getitem) and is_call(y.args[0], auto_functionalized, auto_functionalized_v2)):
        return None
    af = y.args[0]
    op, kw = af.args[0], af.kwargs
    v2 = af.target is auto_functionalized_v2
    what = _flashinfer_op(op)
    if what is None or y.args[1] != 1:
        return None
    standard, fused_add = what
    if v2 and any(k.endswith(("_size", "_stride", "_storage_offset", "_slice_dim")) for k in kw):
        return None  # mutated views of a base: not the plain case we can replace
    offset = 0.0 if standard else 1.0
    eps, weight = constant_float(kw["eps"]), kw["weight"]
    if not isinstance(weight, fx.Node):
        return None
    if not fused_add:  # outputs: (None, out); `out` is the mutated buffer
        x = kw["input"]
        if not isinstance(x, fx.Node):
            return None
        return NormMatch("flashinfer", x, None, weight, eps, y, None, af, weight_offset=offset, standard=standard)
    # the fused-add ops mutate input (-> y) and residual (-> input + residual)
    if v2:
        x, r = _mutated_base(af, "input"), _mutated_base(af, "residual")
    else:
        x, r = kw["input"], kw["residual"]
    if not isinstance(x, fx.Node) or not isinstance(r, fx.Node):
        return None
    res_out = single_getitem(af, 2)
    return NormMatch("flashinfer", x, r, weight, eps, y, res_out, af, weight_offset=offset, standard=standard)


def _mutated_base(af: fx.Node, name: str) -> Argument:
    """The tensor `auto_functionalized_v2` mutates as argument `name`: `_all_bases[_<name>_base_index]`."""
    bases, index = af.kwargs["_all_bases"], af.kwargs[f"_{name}_base_index"]
    return bases[index] if isinstance(bases, (list, tuple)) and isinstance(index, int) else None


# --------------------------------------------------------------------- vLLM IR


def _gemma_weight(weight: fx.Node) -> tuple[fx.Node, float]:
    """`(w, offset)` with the norm's multiplier = `w.f32 + offset`, for an fp32 weight node."""
    if is_call(weight, aten.add.Tensor) and constant_float(weight.args[1]) == 1.0:
        inner = weight.args[0]
        if is_call(inner, prims.convert_element_type.default) and not _is_alpha(weight):
            source = inner.args[0]
            if isinstance(source, fx.Node):
                return source, 1.0
    return weight, 0.0


def _is_alpha(node: fx.Node) -> bool:
    return "alpha" in node.kwargs


def _match_vllm_ir(y: fx.Node) -> NormMatch | None:
    ns = torch.ops.vllm_ir
    if not (hasattr(ns, "rms_norm") and hasattr(ns, "fused_add_rms_norm")):
        return None
    if is_call(y, ns.rms_norm.default):
        norm, x, r, out_res = y, get_arg_value(y, 0, "x"), None, None
        w, eps, vsize = (
            get_arg_value(y, 1, "weight"),
            get_arg_value(y, 2, "epsilon"),
            get_arg_value(y, 3, "variance_size"),
        )
    elif is_call(y, operator.getitem) and y.args[1] == 0 and is_call(y.args[0], ns.fused_add_rms_norm.default):
        norm = y.args[0]
        x, r = get_arg_value(norm, 0, "x"), get_arg_value(norm, 1, "x_residual")
        w, eps, vsize = (
            get_arg_value(norm, 2, "weight"),
            get_arg_value(norm, 3, "epsilon"),
            get_arg_value(norm, 4, "variance_size"),
        )
        out_res = single_getitem(norm, 1)
    else:
        return None
    w_dtype, x_dtype = fake_dtype(w), fake_dtype(x)
    if vsize is not None or w is None or w_dtype is None or x_dtype is None:
        return None
    eps = constant_float(eps)
    if w_dtype == torch.float32:  # `x.f32 * w`: one rounding (vLLM's Gemma layer passes `w.float() + 1`)
        weight, offset = _gemma_weight(w)  # native impl: oink and AITER take a weight of x's dtype only
        return NormMatch("vllm_ir", x, r, weight, eps, y, out_res, norm, weight_offset=offset)
    difference = _vllm_ir_kernel_reason(norm.target)
    if w_dtype != x_dtype and difference is None:
        text = (
            f"the weight is {w_dtype} on {x_dtype} activations: vLLM rounds `normalize(x)` to {w_dtype}, multiplies "
            f"in {w_dtype}, then casts to {x_dtype}; the fused op rounds to the activation dtype only"
        )
        difference = Reason(SharedCode.NORM_DTYPES, text)
    # vLLM's RMSNorm: `normalize(x).to(w.dtype) * w`, the product of two values of x's dtype
    return NormMatch(
        "vllm_ir",
        x,
        r,
        w,
        eps,
        y,
        out_res,
        norm,
        weight_offset=0.0,
        difference=difference,
        round_normalized=True,
        standard=True,
    )


_NOT_REPRODUCED = {"oink": "vLLM's oink (Blackwell) norm kernel", "aiter": "ROCm AITER's norm kernel"}


def _vllm_ir_kernel_reason(target) -> Reason | None:
    """Why not, when vLLM's dispatch priority for this IR op (read off the loaded `vllm.ir.ops`, never
    imported here) puts a kernel first whose arithmetic mxfuse does not reproduce (oink, ROCm AITER)."""
    ops = sys.modules.get("vllm.ir.ops")
    ir_op = getattr(ops, target.__name__.split(".")[0], None) if ops is not None else None
    if ir_op is None:
        return None
    priority = ir_op.get_priority()
    if not priority or priority[0] not in _NOT_REPRODUCED:
        return None
    text = (
        f"vLLM lowers this norm to {_NOT_REPRODUCED[priority[0]]} (its IR priority for {ir_op.name}: {priority}), "
        "whose arithmetic mxfuse does not reproduce"
    )
    return Reason(SharedCode.NORM_KERNEL, text)


# ------------------------------------------------------------- Hugging Face ATen


def _match_hf(y: fx.Node) -> NormMatch | None:
    return match_hf(y, NormMatch)


# --------------------------------------------------------------------- registry

RECOGNIZERS = (
    _match_mxfuse,
    _match_flashinfer,
    _match_vllm_ir,
    _match_hf,
    lambda y: match_allreduce_norm(y, NormMatch),
)


def match_norm(y: fx.Node) -> NormMatch | None:
    """The norm whose output `y` is, in any known form; None if `y` is not one."""
    for recognize in RECOGNIZERS:
        found = recognize(y)
        if found is not None:
            return found
    return None


def find_norms(graph: fx.Graph) -> list[NormMatch]:
    """Every norm output in the graph, in graph order."""
    return [m for m in map(match_norm, _candidates(graph)) if m is not None]


def _candidates(graph: fx.Graph) -> list[fx.Node]:
    """The nodes a recognizer can anchor at (getitems, dtype casts, the norm ops), in graph order."""
    mx = torch.ops.mxfuse
    targets: list[Callable[..., Any]] = [
        operator.getitem,
        prims.convert_element_type.default,
        mx.gemma_rmsnorm.default,
        mx.rms_norm.default,
    ]
    targets.append(aten.mul.Tensor)  # Hugging Face's `w * normalize(x).to(dtype)`; a norm computed in fp32
    ns = torch.ops.vllm_ir
    if hasattr(ns, "rms_norm"):
        targets.append(ns.rms_norm.default)
    found = {n for t in targets for n in graph.find_nodes(op="call_function", target=t)}
    return [n for n in graph.nodes if n in found]
