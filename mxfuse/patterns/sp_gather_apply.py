"""Rewrite 2's graph edits (:mod:`.sp_gather` plans them): the packed quant, the new gather, the views.

Each function takes the planned nodes it edits, never the plan's types, so this module
sits below :mod:`.sp_gather` (no cycle), and returns `(the new gathered node, the fused
op's side outputs by name: {"residual_out": node} for a norm with a residual, {} when the
producer was not fused)`.
"""

from __future__ import annotations

import torch
from torch import fx

from mxfuse.ops.mx_layout import FP8_DTYPE, packed_width, padded_scale_columns
from mxfuse.patterns.collectives import GatherMatch, collective_result
from mxfuse.patterns.fx_utils import (
    call,
    getitem,
    known_fake,
    redirect_uses,
    refresh_eager_input_vals,
    static_last_dim,
)
from mxfuse.patterns.gather_checks import shape_reads
from mxfuse.patterns.producers import ProducerMatch, insert_fused
from mxfuse.patterns.quants import QuantMatch, QuantSite

aten = torch.ops.aten


Sides = dict[str, fx.Node]


def _rewire_shape_reads(gather: GatherMatch, new: fx.Node) -> None:
    """Row-count reads of the old gather read the new one (same rows: W x local rows)."""
    for u in shape_reads(gather):
        old = u.args[0]
        assert isinstance(old, fx.Node)  # shape_reads: `sym_size(node, dim)` of the gather's nodes
        u.replace_input_with(old, new)
        refresh_eager_input_vals(u)


def _emit_packed(graph: fx.Graph, producer: ProducerMatch | None, x: fx.Node, keep_y: bool) -> tuple[fx.Node, Sides]:
    """Insert the op that quantizes the local rows into a packed buffer (the producer fused when
    given); rewire the producer's outputs. `(packed, the fused op's side outputs by name)`."""
    if producer is None:
        with graph.inserting_after(x):
            return call(graph, torch.ops.mxfuse.mxfp8_quantize_packed.default, (x,)), {}
    out = insert_fused(graph, producer, packed=True, emit_y=keep_y)
    if keep_y:
        redirect_uses(producer.y, out["y"])
    return out["packed"], {name: out[name] for name in producer.side_outputs()}


def _new_gather(graph: fx.Graph, like: GatherMatch, x: fx.Node) -> fx.Node:
    """A gather of `x` of the same family, group and world size as `like`; returns the gathered node."""
    start = call(graph, like.start.target, (x, *like.start.args[1:]), dict(like.start.kwargs))
    start.meta["stack_trace"] = like.start.meta.get("stack_trace")
    return collective_result(graph, like.form, start)


def _views(graph: fx.Graph, gathered: fx.Node, k: int) -> tuple[fx.Node, fx.Node]:
    codes = call(graph, aten.slice.Tensor, (gathered, 1, 0, k))
    codes = call(graph, aten.view.dtype, (codes, FP8_DTYPE))
    scales = call(graph, aten.slice.Tensor, (gathered, 1, k, packed_width(k)))
    return codes, scales


def _swizzled_for(graph: fx.Graph, rowmajor: fx.Node, swizzled: bool, cache: dict[str, fx.Node]) -> fx.Node:
    """The scales in the layout a quant asked for (one swizzle kernel per gather)."""
    if swizzled and "swizzled" not in cache:
        cache["swizzled"] = call(graph, torch.ops.mxfuse.mxfp8_swizzle_scales.default, (rowmajor,))
    return cache["swizzled"] if swizzled else rowmajor


def apply_packed_gather(
    graph: fx.Graph,
    producer: ProducerMatch,
    gather: GatherMatch,
    quants: tuple[QuantSite, ...],
    fuse: bool,
    keep_bf16_gather: bool,
    keep_y: bool,
) -> tuple[fx.Node, Sides]:
    """Form A: the producer's rows quantized into one packed buffer, gathered once, viewed for `quants`
    (the producer fused when `fuse`)."""
    k = static_last_dim(producer.y)
    packed, sides = _emit_packed(graph, producer if fuse else None, producer.y, keep_y)
    with graph.inserting_before(gather.out):
        gathered = _new_gather(graph, gather, packed)
        codes, scales = _views(graph, gathered, k)
        if not keep_bf16_gather:
            _rewire_shape_reads(gather, gathered)
        cache: dict[str, fx.Node] = {}
        for q in quants:
            q.replace_outputs(graph, codes, _swizzled_for(graph, scales, q.swizzled, cache))
    return gathered, sides


def apply_gathered_quant(
    graph: fx.Graph,
    quant: QuantMatch,
    producer: ProducerMatch | None,
    codes_gathered: tuple[GatherMatch, fx.Node],
    scales_gathered: tuple[GatherMatch, fx.Node],
    to: str,
) -> tuple[fx.Node, Sides]:
    """Form B: codes and scales gathered apart become one packed gather (`to="mxfp8"`, the producer
    fused when given) or a gather of the quant's input quantized after it (`to="bf16"`)."""
    (codes_gather, codes_out), (_, scales_out) = codes_gathered, scales_gathered
    k = static_last_dim(quant.x)
    flat = known_fake(scales_out).dim() == 1
    sides: Sides = {}
    new_codes: fx.Node
    new_scales: fx.Node
    result: fx.Node
    if to == "mxfp8":
        if producer is not None:
            others = [u for u in producer.y.users if u is not quant.node]
            packed, sides = _emit_packed(graph, producer, producer.y, bool(others))
        else:
            packed, _ = _emit_packed(graph, None, quant.x, True)
        with graph.inserting_before(codes_gather.start):
            gathered = _new_gather(graph, codes_gather, packed)
            new_codes, new_scales = _views(graph, gathered, k)
            if quant.swizzled:
                new_scales = call(graph, torch.ops.mxfuse.mxfp8_swizzle_scales.default, (new_scales,))
                if flat:
                    new_scales = call(graph, aten.view.default, (new_scales, [-1]))
        result = gathered
    else:  # bf16: gather the quant's input, quantize after the gather with the quant's own op and flags
        with graph.inserting_before(codes_gather.start):
            gathered = _new_gather(graph, codes_gather, quant.x)
            new_quant = call(graph, quant.node.target, (gathered, *quant.node.args[1:]), dict(quant.node.kwargs))
            new_codes, new_scales = getitem(graph, new_quant, 0), getitem(graph, new_quant, 1)
            # the scales flattened (or unflattened) around the gather: the same view here
            if known_fake(new_scales).dim() != known_fake(scales_out).dim():
                shape = [-1] if flat else [-1, padded_scale_columns(k)]
                new_scales = call(graph, aten.view.default, (new_scales, shape))
        result = new_quant
    _rewire_shape_reads(codes_gather, new_codes)
    redirect_uses(codes_out, new_codes)
    redirect_uses(scales_out, new_scales)
    return result, sides
