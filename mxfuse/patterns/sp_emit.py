"""Graph-building helpers of the sequence-parallel rewrite: row counts, padding, its collectives.

Every node gets its fake value (`meta["val"]`), computed in the graph's fake mode, so the
rewrites after it (sp_gather, producer_quant) read shapes as they read a traced graph's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from mxfuse.patterns.collectives import emit_collective
from mxfuse.patterns.fx_utils import call, fake, fake_mode_of, refresh_eager_input_vals, static_int

aten = torch.ops.aten


@dataclass(frozen=True)
class Collectives:
    """The family, group and world size every emitted collective uses (those of the all-reduces found)."""

    family: str  # "vllm" or "c10d"
    group_name: str
    world_size: int

    @property
    def vllm(self) -> bool:
        return self.family == "vllm"


@dataclass
class Rows:
    """Graph nodes (or ints) for T, the padded row count and the pad amount."""

    t: int | fx.Node
    padded: int | fx.Node
    pad: int | fx.Node


def row_nodes(graph: fx.Graph, rows, w: int, first: fx.Node) -> Rows:
    """T, ceil(T/W)*W and the pad: ints for a static T, else SymInt nodes computed right after
    `first` (the earliest `[T, K]` tensor the rewrite reads)."""
    t = static_int(rows)
    if t is not None:
        total = -(-t // w) * w
        return Rows(t, total, total - t)
    with graph.inserting_after(first):
        t_node = call(graph, aten.sym_size.int, (first, 0))
    with graph.inserting_after(t_node):
        up = _sym(graph, operator.add, t_node, w - 1)
    with graph.inserting_after(up):
        blocks = _sym(graph, operator.floordiv, up, w)
    with graph.inserting_after(blocks):
        total_node = _sym(graph, operator.mul, blocks, w)
    with graph.inserting_after(total_node):
        pad = _sym(graph, operator.sub, total_node, t_node)
    return Rows(t_node, total_node, pad)


def _value(v):
    return v.meta["val"] if isinstance(v, fx.Node) else v


def _sym(graph: fx.Graph, op, a, b) -> fx.Node:
    node = graph.call_function(op, (a, b))
    node.meta["val"] = op(_value(a), _value(b))
    return node


def padded(graph: fx.Graph, x: fx.Node, rows: Rows) -> fx.Node:
    if isinstance(rows.pad, int) and rows.pad == 0:
        return x
    val = fake(x)  # `constant_pad_nd` takes no symbolic pad; zeros + cat do (Inductor fuses them)
    assert val is not None, "the rewrite pads only tensors whose fake value it read"
    shape = [rows.pad, *val.shape[1:]]
    zeros = graph.call_function(aten.full.default, (shape, 0.0), {"dtype": val.dtype, "device": val.device})
    with fake_mode_of(x):
        zeros.meta["val"] = torch.full([_value(d) for d in shape], 0.0, dtype=val.dtype, device=val.device)
    cat = graph.call_function(aten.cat.default, ([x, zeros], 0))
    with fake_mode_of(x):
        cat.meta["val"] = torch.cat([val, zeros.meta["val"]])
    return cat


def reduce_scatter(graph: fx.Graph, action: Collectives, x: fx.Node) -> fx.Node:
    return emit_collective(graph, action.family, "reduce_scatter", x, action.world_size, action.group_name)


def all_gather(graph: fx.Graph, action: Collectives, x: fx.Node) -> fx.Node:
    return emit_collective(graph, action.family, "all_gather", x, action.world_size, action.group_name)


def cut(graph: fx.Graph, x: fx.Node, rows: Rows) -> fx.Node:
    return call(graph, aten.slice.Tensor, (x, 0, 0, rows.t))


def refresh(node: fx.Node) -> None:
    """Re-derive the fake value of a node whose inputs now hold local rows."""

    def vals(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args, kwargs = fx.node.map_arg(node.args, vals), fx.node.map_arg(node.kwargs, vals)
    target = node.target
    if target is operator.getitem:
        node.meta["val"] = operator.getitem(*args)
    else:
        assert callable(target), "only call_function nodes hold local rows"
        with fake_mode_of(*node.all_input_nodes):
            node.meta["val"] = target(*args, **kwargs)
    node.meta.pop("tensor_meta", None)
    refresh_eager_input_vals(node)


def comes_before(a: fx.Node, b: fx.Node) -> bool:
    """Whether `a` comes before `b` in the graph (FX orders nodes by position, kept current on insert)."""
    return a is b or a < b
