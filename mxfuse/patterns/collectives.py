"""The collectives of sequence parallelism in both families: all-gather recognizers and the one emitter.

- vLLM: `vllm::all_gather(tensor, dim, world_size, group_name)`: one node;
- PyTorch functional collectives: `_c10d_functional.all_gather_into_tensor(x,
  group_size, group_name)` then `_c10d_functional.wait_tensor(...)`: the gathered
  tensor is the wait's output; always along dim 0 (another dim adds split/cat after).

Both are `CallFunction` patterns (as Inductor's `micro_pipeline_tp.find_all_gather_patterns`),
matched at the node that holds the gathered tensor. :func:`emit_collective` and
:func:`collective_result` are where a rewrite writes a collective of either family (the one
place the two families' calls differ).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import fx
from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, KeywordArg

from mxfuse.patterns.fx_utils import call, is_call, vllm_op


@dataclass(frozen=True)
class GatherMatch:
    form: str  # "vllm" or "c10d"
    start: fx.Node  # the collective
    out: fx.Node  # the node holding the gathered tensor
    x: fx.Node
    world_size: object  # int, or whatever the graph holds
    group_name: object
    dim: object


def _vllm_all_gather() -> torch._ops.OpOverload | None:
    return vllm_op("all_gather")


def emit_collective(
    graph: fx.Graph, family: str, collective: str, x: fx.Node, world_size: int, group_name: str
) -> fx.Node:
    """Insert `collective` ("all_gather", or "reduce_scatter": a sum) of `x` along dim 0 over the group,
    in `family` ("vllm": its one node; "c10d": the functional collective, then its wait); returns the
    node holding the result."""
    if family == "vllm":
        op = vllm_op(collective)
        assert op is not None, f"a vLLM {collective} is emitted only where vLLM's all-reduces were found"
        return call(graph, op, (x, 0, world_size, group_name))
    c10d = torch.ops._c10d_functional
    if collective == "reduce_scatter":
        start = call(graph, c10d.reduce_scatter_tensor.default, (x, "sum", world_size, group_name))
    else:
        start = call(graph, c10d.all_gather_into_tensor.default, (x, world_size, group_name))
    return collective_result(graph, family, start)


def collective_result(graph: fx.Graph, family: str, start: fx.Node) -> fx.Node:
    """The node holding the result of the collective `start` just inserted: c10d's `wait_tensor` of it
    (inserted here), or vLLM's node itself."""
    return call(graph, torch.ops._c10d_functional.wait_tensor.default, (start,)) if family == "c10d" else start


@functools.cache
def _c10d_pattern() -> CallFunction:
    c10d = torch.ops._c10d_functional
    start = CallFunction(
        c10d.all_gather_into_tensor.default,
        KeywordArg("x"),
        KeywordArg("world_size"),
        KeywordArg("group_name"),
        _users=MULTIPLE,  # besides the wait, shape reads (dynamic shapes: `sym_size(gathered, 0)`)
    )
    return CallFunction(c10d.wait_tensor.default, start)


def _vllm_pattern(op) -> CallFunction:
    return CallFunction(op, KeywordArg("x"), KeywordArg("dim"), KeywordArg("world_size"), KeywordArg("group_name"))


def match_gathered(out: fx.Node) -> GatherMatch | None:
    """The all-gather whose gathered tensor `out` holds (the wait, or vLLM's collective)."""
    c10d = torch.ops._c10d_functional
    if is_call(out, c10d.wait_tensor.default):
        m = _c10d_pattern().match(out)
        if not m:
            return None
        start = out.args[0]
        if not isinstance(start, fx.Node):
            return None
        if not all(u is out or is_call(u, torch.ops.aten.sym_size.int) for u in start.users):
            return None
        return GatherMatch("c10d", start, out, m.kwargs["x"], m.kwargs["world_size"], m.kwargs["group_name"], 0)
    vllm_op = _vllm_all_gather()
    if vllm_op is not None and is_call(out, vllm_op):
        m = _vllm_pattern(vllm_op).match(out)
        if not m:
            return None
        kw = m.kwargs
        return GatherMatch("vllm", out, out, kw["x"], kw["world_size"], kw["group_name"], kw["dim"])
    return None


def match_all_gather(node: fx.Node) -> GatherMatch | None:
    """The all-gather that `node` starts (the collective node itself), if it is one."""
    c10d = torch.ops._c10d_functional
    if is_call(node, c10d.all_gather_into_tensor.default):
        waits = [u for u in node.users if is_call(u, c10d.wait_tensor.default)]
        return match_gathered(waits[0]) if len(waits) == 1 else None
    return match_gathered(node)


def collective_ops() -> list:
    """The collective overloads that start an all-gather (vLLM's once registered)."""
    ops = [torch.ops._c10d_functional.all_gather_into_tensor.default]
    vllm_op = _vllm_all_gather()
    return ops + ([vllm_op] if vllm_op is not None else [])
