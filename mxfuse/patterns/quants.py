"""Recognizers for MXFP8 activation-quantization nodes: mxfuse's op and vLLM's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch._inductor.pattern_matcher import get_arg_value

from mxfuse.patterns.fx_utils import fake, has_live_users, is_call, single_getitem
from mxfuse.patterns.results import Reason, SkipCode


@dataclass(frozen=True)
class QuantMatch:
    """An MXFP8 quant node: its input, the scale layout it asked for, its output getitems."""

    form: str  # "mxfuse" or "vllm"
    node: fx.Node
    x: fx.Node
    swizzled: bool
    codes: fx.Node | None
    scales: fx.Node | None
    flat_swizzled_scales: bool = False  # vLLM returns swizzled scales as a 1-D tensor


def _vllm_quant_op():
    ns = torch.ops.vllm
    return ns.mxfp8_quantize.default if hasattr(ns, "mxfp8_quantize") else None


def match_quant(node: fx.Node) -> QuantMatch | None:
    if is_call(node, torch.ops.mxfuse.mxfp8_quantize.default):
        x, swizzled = get_arg_value(node, 0, "x"), bool(get_arg_value(node, 1, "swizzled"))
        return QuantMatch("mxfuse", node, x, swizzled, single_getitem(node, 0), single_getitem(node, 1))
    vllm_op = _vllm_quant_op()
    if vllm_op is not None and is_call(node, vllm_op):
        x = get_arg_value(node, 0, "x")
        swizzled = bool(get_arg_value(node, 1, "is_sf_swizzled_layout"))
        return QuantMatch(
            "vllm", node, x, swizzled, single_getitem(node, 0), single_getitem(node, 1), flat_swizzled_scales=swizzled
        )
    return None


def quant_reject_reason(quant: QuantMatch) -> Reason | None:
    """Why the fused op's outputs cannot replace this quant's (None: they can)."""
    x = fake(quant.x)
    if quant.form != "vllm" or x is None:
        return None
    alignment = get_arg_value(quant.node, 2, "alignment")
    alignment = 0 if alignment is None else alignment
    if not isinstance(alignment, int) or (alignment > 0 and x.shape[-1] % alignment):
        return Reason(SkipCode.QUANT_UNSUPPORTED, f"vLLM quant pads K={x.shape[-1]} to alignment {alignment}")
    if quant.swizzled and x.dim() != 2:
        return Reason(
            SkipCode.QUANT_UNSUPPORTED, "vLLM swizzles the scales of a 3-D input per batch; the fused op tiles all rows"
        )
    return None


def quant_ops() -> list:
    """The quant op overloads this module recognizes (vLLM's only once vLLM registered it)."""
    ops = [torch.ops.mxfuse.mxfp8_quantize.default]
    vllm_op = _vllm_quant_op()
    return ops + ([vllm_op] if vllm_op is not None else [])


def find_quants(graph: fx.Graph) -> list[QuantMatch]:
    """Every MXFP8 quant of the graph, in graph order."""
    found = {n for op in quant_ops() for n in graph.find_nodes(op="call_function", target=op)}
    return [match_quant(n) for n in graph.nodes if n in found]


def quant_users(node: fx.Node) -> list[QuantMatch]:
    """The quant nodes that read `node`, in graph order."""
    found = (match_quant(u) for u in node.users)
    return [q for q in found if q is not None and q.x is node and has_live_users(q.node)]
