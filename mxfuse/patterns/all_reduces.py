"""Recognizers for the all-reduces of tensor parallelism, in both collective families.

- vLLM: `vllm::all_reduce(tensor, group_name)`: one node (RowParallelLinear's reduction);
- PyTorch functional collectives: `_c10d_functional.all_reduce(x, reduce_op, group_name)`
  then `_c10d_functional.wait_tensor(...)`: the reduced tensor is the wait's output.

Neither carries the world size: :func:`world_size_of` finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch._inductor.pattern_matcher import get_arg_value

from mxfuse.ops.process_groups import group_size
from mxfuse.patterns.fx_utils import fake, is_call, static_int, vllm_op


@dataclass(frozen=True)
class AllReduce:
    """An all-reduce in either family: vLLM's one node, or c10d's collective + wait."""

    family: str  # "vllm" or "c10d"
    start: fx.Node
    out: fx.Node
    x: fx.Node
    group_name: object
    reduce_op: object


def match_all_reduce(node: fx.Node) -> AllReduce | None:
    c10d = torch.ops._c10d_functional
    if is_call(node, c10d.all_reduce.default):
        waits = [u for u in node.users if is_call(u, c10d.wait_tensor.default)]
        if len(waits) != 1 or len(node.users) != 1:
            return None
        return AllReduce(
            "c10d",
            node,
            waits[0],
            get_arg_value(node, 0, "input"),
            get_arg_value(node, 2, "group_name"),
            get_arg_value(node, 1, "reduce_op"),
        )
    if is_call(node, vllm_op("all_reduce")):
        return AllReduce(
            "vllm", node, node, get_arg_value(node, 0, "tensor"), get_arg_value(node, 1, "group_name"), "sum"
        )
    return None


def is_all_reduce(node: fx.Node) -> bool:
    return is_call(node, torch.ops._c10d_functional.all_reduce.default, vllm_op("all_reduce"))


def all_reduce_reason(ar: AllReduce | None) -> str | None:
    if ar is None:
        return "a c10d all_reduce whose only user is not one wait_tensor"
    if ar.reduce_op != "sum":
        return f"all_reduce {ar.start.name} reduces with {ar.reduce_op!r}, not 'sum'"
    if not isinstance(ar.group_name, str):
        return f"all_reduce {ar.start.name}: group {ar.group_name!r} is not a constant group name"
    x = fake(ar.x)
    if x is None or x.dim() != 2:
        what = "no fake tensor" if x is None else f"{x.dim()}-D input"
        return f"all_reduce {ar.start.name}: {what}; only 2-D token rows [T, K] are sharded by this rewrite"
    if static_int(x.shape[1]) is None:
        return f"all_reduce {ar.start.name}: hidden size {x.shape[1]} is symbolic"
    return None


def world_size_of(graph: fx.Graph, family: str, group_name: str) -> int | None:
    """The group's world size: from a collective of the graph that carries it, else the group itself.

    vLLM's and c10d's all_reduce carry only the group name. The size is the same on
    every rank, so reading it from the process's group registry keeps the decision
    identical on all ranks.
    """
    for node in graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        schema = node.target._schema
        names = [a.name for a in schema.arguments]
        if "group_name" not in names or not ({"world_size", "group_size"} & set(names)):
            continue
        if get_arg_value(node, names.index("group_name"), "group_name") != group_name:
            continue
        key = "world_size" if "world_size" in names else "group_size"
        size = static_int(get_arg_value(node, names.index(key), key))
        if size is not None:
            return size
    return group_size(group_name, vllm=family == "vllm")
