"""Recognizers for every form a Gemma RMSNorm takes in a post-grad graph.

A recognizer is anchored at the node that holds the norm's output `y` and returns a
:class:`NormMatch` (what a replacement needs: inputs, eps, numerics mode, the nodes
holding `y` and `residual_out`) or None. Forms:

- ``mxfuse``: `mxfuse::gemma_rmsnorm` / `gemma_fused_add_rmsnorm` (getitem 0 is y);
- ``flashinfer``: `flashinfer::gemma_rmsnorm` / `gemma_fused_add_rmsnorm`, in place,
  under `auto_functionalized` (v1, vLLM) or `auto_functionalized_v2` (torch default);
- ``vllm_ir``: `vllm_ir::rms_norm` / `fused_add_rms_norm` called with an fp32 weight
  (vLLM's `GemmaRMSNorm` passes `weight.float() + 1.0`);
- ``hf``: the decomposed ATen of Hugging Face's `GemmaRMSNorm` / `MiniMaxM3VLRMSNorm`,
  in each spelling of :mod:`mxfuse.patterns.hf_norm`, with a residual add in front of it
  folded in.

A recognized norm whose arithmetic differs from the fused op's carries that
`difference`; :func:`reject_reason` returns it first, so it is reported, never fused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._inductor.pattern_matcher import get_arg_value
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxfuse.ops.mx_layout import BLOCK
from mxfuse.patterns.allreduce_norm import match_allreduce_norm
from mxfuse.patterns.fx_utils import constant_float, fake, is_call, single_getitem
from mxfuse.patterns.hf_norm import match_hf
from mxfuse.patterns.results import Reason, SharedCode

aten, prims = torch.ops.aten, torch.ops.prims


@dataclass(frozen=True)
class NormMatch:
    """A Gemma norm found in a graph, in the terms of the mxfuse fused ops."""

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

    @property
    def has_residual(self) -> bool:
        return self.residual is not None

    @property
    def kind(self) -> str:
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
    if is_call(y, ops.gemma_rmsnorm.default):
        x, w, eps = (get_arg_value(y, i, n) for i, n in enumerate(("x", "weight", "eps")))
        return NormMatch("mxfuse", x, None, w, constant_float(eps), y, None, y)
    if is_call(y, operator.getitem) and y.args[1] == 0 and is_call(y.args[0], ops.gemma_fused_add_rmsnorm.default):
        norm = y.args[0]
        x, r, w, eps = (get_arg_value(norm, i, n) for i, n in enumerate(("x", "residual", "weight", "eps")))
        return NormMatch("mxfuse", x, r, w, constant_float(eps), y, single_getitem(norm, 1), norm)
    return None


# ---------------------------------------------------------------- flashinfer ops


def _flashinfer_ops():
    ns = torch.ops.flashinfer
    if not hasattr(ns, "gemma_rmsnorm"):  # hasattr tries to load; False unless flashinfer.norm was imported
        return None, None
    return ns.gemma_rmsnorm.default, ns.gemma_fused_add_rmsnorm.default


def _match_flashinfer(y: fx.Node) -> NormMatch | None:
    if not (is_call(y, operator.getitem) and is_call(y.args[0], auto_functionalized, auto_functionalized_v2)):
        return None
    plain_op, add_op = _flashinfer_ops()
    af = y.args[0]
    op, kw = af.args[0], af.kwargs
    v2 = af.target is auto_functionalized_v2
    if plain_op is None or op not in (plain_op, add_op):
        return None
    if v2 and any(k.endswith(("_size", "_stride", "_storage_offset", "_slice_dim")) for k in kw):
        return None  # mutated views of a base: not the plain case we can replace
    if op is plain_op:
        # outputs: (None, out); `out` is the mutated buffer
        x = kw["input"]
        if y.args[1] != 1:
            return None
        return NormMatch("flashinfer", x, None, kw["weight"], constant_float(kw["eps"]), y, None, af)
    # gemma_fused_add_rmsnorm mutates input (-> y) and residual (-> input + residual)
    if y.args[1] != 1:
        return None
    if v2:
        bases = kw["_all_bases"]
        x, r = bases[kw["_input_base_index"]], bases[kw["_residual_base_index"]]
    else:
        x, r = kw["input"], kw["residual"]
    return NormMatch("flashinfer", x, r, kw["weight"], constant_float(kw["eps"]), y, single_getitem(af, 2), af)


# --------------------------------------------------------------------- vLLM IR


def _gemma_weight(weight: fx.Node) -> tuple[fx.Node, float] | None:
    """`(w, offset)` with the norm's multiplier = `w.f32 + offset`, for an fp32 weight node."""
    w = fake(weight)
    if w is None or w.dtype != torch.float32:
        return None  # a bf16 weight means `x.to(bf16) * w`: Llama numerics, not Gemma
    if is_call(weight, aten.add.Tensor) and constant_float(weight.args[1]) == 1.0:
        inner = weight.args[0]
        if is_call(inner, prims.convert_element_type.default) and not _is_alpha(weight):
            return inner.args[0], 1.0
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
    if vsize is not None or w is None:
        return None
    gemma = _gemma_weight(w)
    if gemma is None:
        return None
    weight, offset = gemma
    return NormMatch("vllm_ir", x, r, weight, constant_float(eps), y, out_res, norm, weight_offset=offset)


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
    """The Gemma norm whose output `y` is, in any known form; None if `y` is not one."""
    for recognize in RECOGNIZERS:
        found = recognize(y)
        if found is not None:
            return found
    return None


def find_norms(graph: fx.Graph) -> list[NormMatch]:
    """Every Gemma norm output in the graph, in graph order."""
    return [m for m in map(match_norm, _candidates(graph)) if m is not None]


def _candidates(graph: fx.Graph) -> list[fx.Node]:
    """The nodes a recognizer can anchor at (getitems, dtype casts, the norm ops), in graph order."""
    targets = [operator.getitem, prims.convert_element_type.default, torch.ops.mxfuse.gemma_rmsnorm.default]
    ns = torch.ops.vllm_ir
    if hasattr(ns, "rms_norm"):
        targets.append(ns.rms_norm.default)
    found = {n for t in targets for n in graph.find_nodes(op="call_function", target=t)}
    return [n for n in graph.nodes if n in found]
