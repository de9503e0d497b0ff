"""`mxfuse::sp_local_rows`: this rank's rows of a tensor every rank holds in full.

The sequence-parallel rewrite needs the local rows of a replicated tensor (the first
layer's residual is the full embedding output). The rank must be read when the graph
RUNS, not baked in when it is compiled: the graph before the pass is the same on every
rank, so a compiled artifact (Inductor's FX graph cache, keyed on that graph) may be
served to another rank. The op resolves the rank from the group name the graph's
collectives carry, in their family:

- ``vllm=True``: a vLLM `GroupCoordinator` by its `unique_name` (what
  `torch.ops.vllm.all_reduce` is given);
- ``vllm=False``: a torch process group by its `group_name` (what
  `_c10d_functional.*` ops are given).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxfuse.ops.process_groups import rank_in_group


def _rank_in_group(group_name: str, vllm: bool) -> int:
    rank = rank_in_group(group_name, vllm)
    if rank is None:
        family = "vLLM group" if vllm else "torch process group"
        raise RuntimeError(f"mxfuse::sp_local_rows: no {family} named {group_name!r} in this process")
    return rank


@torch.library.custom_op("mxfuse::sp_local_rows", mutates_args=())
def sp_local_rows(x: Tensor, world_size: int, group_name: str, vllm: bool = False) -> Tensor:
    """Rows `[r*M/W, (r+1)*M/W)` of `x` `[M, ...]` for this rank r of the group (a copy)."""
    if x.dim() < 1 or x.shape[0] % world_size:
        raise ValueError(f"mxfuse::sp_local_rows: {tuple(x.shape)} rows do not split over {world_size} ranks")
    rows = x.shape[0] // world_size
    rank = _rank_in_group(group_name, vllm)
    return x.narrow(0, rank * rows, rows).clone()


@sp_local_rows.register_fake
def _(x, world_size, group_name, vllm=False):
    return x.new_empty((x.shape[0] // world_size, *x.shape[1:]))
