"""Recognizers for the all-gathers of sequence parallelism, in both collective families.

- vLLM: `vllm::all_gather(tensor, dim, world_size, group_name)`: one node;
- PyTorch functional collectives: `_c10d_functional.all_gather_into_tensor(x,
  group_size, group_name)` then `_c10d_functional.wait_tensor(...)`: the gathered
  tensor is the wait's output; always along dim 0 (another dim adds split/cat after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from mxfuse.patterns.fx_utils import arg, is_call


@dataclass(frozen=True)
class GatherMatch:
    form: str  # "vllm" or "c10d"
    start: fx.Node  # the collective
    out: fx.Node  # the node holding the gathered tensor
    x: fx.Node
    world_size: object  # int, or whatever the graph holds
    group_name: object
    dim: object


def _c10d():
    return torch.ops._c10d_functional


def _vllm_all_gather():
    ns = torch.ops.vllm
    return ns.all_gather.default if hasattr(ns, "all_gather") else None


def match_all_gather(node: fx.Node) -> GatherMatch | None:
    """The all-gather that `node` starts (the collective node itself), if it is one."""
    c10d = _c10d()
    if is_call(node, c10d.all_gather_into_tensor.default):
        waits = [u for u in node.users if is_call(u, c10d.wait_tensor.default)]
        others = [u for u in node.users if u not in waits]
        if len(waits) != 1 or not all(is_call(u, torch.ops.aten.sym_size.int) for u in others):
            return None  # besides the wait, only shape reads (dynamic shapes: `sym_size(gathered, 0)`)
        x, size, group = arg(node, 0, "input"), arg(node, 1, "group_size"), arg(node, 2, "group_name")
        return GatherMatch("c10d", node, waits[0], x, size, group, 0)
    vllm_op = _vllm_all_gather()
    if vllm_op is not None and is_call(node, vllm_op):
        x, dim = arg(node, 0, "tensor"), arg(node, 1, "dim")
        size, group = arg(node, 2, "world_size"), arg(node, 3, "group_name")
        return GatherMatch("vllm", node, node, x, size, group, dim)
    return None
