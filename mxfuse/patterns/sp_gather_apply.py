"""Rewrite 2's graph edits (:mod:`.sp_gather` plans them): the packed quant, the new gather, the views."""

from __future__ import annotations

import torch
from torch import fx

from mxfuse.ops.mx_layout import FP8_DTYPE, packed_width, padded_scale_columns
from mxfuse.patterns.collectives import GatherMatch
from mxfuse.patterns.fx_utils import call, fake, getitem, redirect_uses, refresh_eager_input_vals, static_int
from mxfuse.patterns.gather_checks import shape_reads
from mxfuse.patterns.norm_quant import insert_fused_norm
from mxfuse.patterns.norms import NormMatch, match_norm
from mxfuse.patterns.quants import match_quant
from mxfuse.patterns.sp_gather import GatheredQuant, PackedGather

aten = torch.ops.aten


def _rewire_shape_reads(gather: GatherMatch, new: fx.Node):
    """Row-count reads of the old gather read the new one (same rows: W x local rows)."""
    for u in shape_reads(gather):
        u.replace_input_with(u.args[0], new)
        refresh_eager_input_vals(u)


def _emit_packed(graph: fx.Graph, norm: NormMatch | None, x: fx.Node, fuse: bool, keep_y: bool) -> fx.Node:
    """Insert the op that quantizes the local rows into a packed buffer; rewire the norm's outputs."""
    mx = torch.ops.mxfuse
    if not fuse:
        with graph.inserting_after(x):
            return call(graph, mx.mxfp8_quantize_packed.default, (x,))
    out = insert_fused_norm(graph, norm, packed=True, emit_y=keep_y)
    if keep_y:
        redirect_uses(norm.y, out["y"])
    return out["packed"]


def _new_gather(graph: fx.Graph, like: GatherMatch, x: fx.Node) -> fx.Node:
    """A gather of `x` of the same family, group and world size as `like`; returns the gathered node."""
    start = call(graph, like.start.target, (x, *like.start.args[1:]), dict(like.start.kwargs))
    start.meta["stack_trace"] = like.start.meta.get("stack_trace")
    if like.form == "c10d":
        return call(graph, like.out.target, (start,), dict(like.out.kwargs))
    return start


def _views(graph: fx.Graph, gathered: fx.Node, k: int) -> tuple[fx.Node, fx.Node]:
    codes = call(graph, aten.slice.Tensor, (gathered, 1, 0, k))
    codes = call(graph, aten.view.dtype, (codes, FP8_DTYPE))
    scales = call(graph, aten.slice.Tensor, (gathered, 1, k, packed_width(k)))
    return codes, scales


def _scales_for(graph: fx.Graph, rowmajor: fx.Node, swizzled: bool, flat: bool, cache: dict) -> fx.Node:
    key = (swizzled, flat)
    if key not in cache:
        node = rowmajor
        if swizzled:
            node = call(graph, torch.ops.mxfuse.mxfp8_swizzle_scales.default, (node,))
            if flat:
                node = call(graph, aten.view.default, (node, [-1]))
        cache[key] = node
    return cache[key]


def apply_packed_gather(graph: fx.Graph, action: PackedGather) -> fx.Node | None:
    norm = match_norm(action.norm.y)
    if norm is None or action.gather.start not in norm.y.users:
        return None
    gather = action.gather
    k = static_int(fake(norm.y).shape[-1])
    others = [u for u in norm.y.users if u is not gather.start]
    packed = _emit_packed(graph, norm, norm.y, action.fuse_norm, action.keep_bf16_gather or bool(others))
    with graph.inserting_before(gather.out):
        gathered = _new_gather(graph, gather, packed)
        codes, scales = _views(graph, gathered, k)
        if not action.keep_bf16_gather:
            _rewire_shape_reads(gather, gathered)
        cache: dict = {}
        for q in action.quants:
            if q.codes is not None:
                redirect_uses(q.codes, codes)
            if q.scales is not None:
                redirect_uses(q.scales, _scales_for(graph, scales, q.swizzled, q.flat_swizzled_scales, cache))
    return gathered


def apply_gathered_quant(graph: fx.Graph, action: GatheredQuant) -> fx.Node | None:
    quant = match_quant(action.quant.node)
    if quant is None:
        return None
    k = static_int(fake(quant.x).shape[-1])
    swizzled = quant.swizzled
    flat = fake(action.scales_out).dim() == 1
    if action.to == "mxfp8":
        norm = action.norm if action.fuse_norm else None
        if norm is not None:
            norm = match_norm(norm.y)
        if norm is not None:
            others = [u for u in norm.y.users if u is not quant.node]
            packed = _emit_packed(graph, norm, norm.y, True, bool(others))
        else:
            packed = _emit_packed(graph, None, quant.x, False, True)
        with graph.inserting_before(action.codes_gather.start):
            gathered = _new_gather(graph, action.codes_gather, packed)
            codes, scales = _views(graph, gathered, k)
            scales = _scales_for(graph, scales, swizzled, flat, {})
        new_codes, new_scales = codes, scales
        result = gathered
    else:  # bf16: gather the quant's input, quantize after the gather with the quant's own op and flags
        with graph.inserting_before(action.codes_gather.start):
            gathered = _new_gather(graph, action.codes_gather, quant.x)
            new_quant = call(graph, quant.node.target, (gathered, *quant.node.args[1:]), dict(quant.node.kwargs))
            new_codes, new_scales = getitem(graph, new_quant, 0), getitem(graph, new_quant, 1)
            if fake(new_scales).dim() != fake(action.scales_out).dim():  # flattened (or unflattened) around the gather
                shape = [-1] if flat else [-1, padded_scale_columns(k)]
                new_scales = call(graph, aten.view.default, (new_scales, shape))
        result = new_quant
    _rewire_shape_reads(action.codes_gather, new_codes)
    redirect_uses(action.codes_out, new_codes)
    redirect_uses(action.scales_out, new_scales)
    return result
