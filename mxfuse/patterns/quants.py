"""Recognizers for MXFP8 activation-quantization nodes: mxfuse's op and vLLM's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from mxfuse.patterns.fx_utils import arg, fake, has_live_users, is_call, single_getitem


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
        x, swizzled = arg(node, 0, "x"), bool(arg(node, 1, "swizzled", False))
        return QuantMatch("mxfuse", node, x, swizzled, single_getitem(node, 0), single_getitem(node, 1))
    vllm_op = _vllm_quant_op()
    if vllm_op is not None and is_call(node, vllm_op):
        x = arg(node, 0, "x")
        swizzled = bool(arg(node, 1, "is_sf_swizzled_layout", False))
        return QuantMatch(
            "vllm", node, x, swizzled, single_getitem(node, 0), single_getitem(node, 1), flat_swizzled_scales=swizzled
        )
    return None


def quant_reject_reason(quant: QuantMatch) -> str | None:
    """Why the fused op's outputs cannot replace this quant's (None: they can)."""
    x = fake(quant.x)
    if quant.form != "vllm" or x is None:
        return None
    alignment = arg(quant.node, 2, "alignment", 0)
    if not isinstance(alignment, int) or (alignment > 0 and x.shape[-1] % alignment):
        return f"vLLM quant pads K={x.shape[-1]} to alignment {alignment}"
    if quant.swizzled and x.dim() != 2:
        return "vLLM swizzles the scales of a 3-D input per batch; the fused op tiles all rows"
    return None


def quant_users(node: fx.Node) -> list[QuantMatch]:
    """The quant nodes that read `node`, in graph order."""
    found = (match_quant(u) for u in node.users)
    return [q for q in found if q is not None and q.x is node and has_live_users(q.node)]
