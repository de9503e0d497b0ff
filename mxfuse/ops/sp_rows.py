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

from torch import Tensor

from mxfuse.ops.process_groups import rank_in_group
from mxfuse.ops.registry import Impls, OpSpec


def _rank_in_group(op: str, group_name: str, vllm: bool) -> int:
    rank = rank_in_group(group_name, vllm)
    if rank is None:
        family = "vLLM group" if vllm else "torch process group"
        raise RuntimeError(f"mxfuse::{op}: no {family} named {group_name!r} in this process")
    return rank


def _local_rows(op: str, *, x: Tensor, world_size: int, group_name: str, vllm: bool) -> Tensor:
    if x.dim() < 1 or x.shape[0] % world_size:
        raise ValueError(f"mxfuse::{op}: {tuple(x.shape)} rows do not split over {world_size} ranks")
    rows = x.shape[0] // world_size
    rank = _rank_in_group(op, group_name, vllm)
    return x.narrow(0, rank * rows, rows).clone()


def _local_rows_fake(op: str, *, x: Tensor, world_size: int, **_: object) -> Tensor:
    return x.new_empty((x.shape[0] // world_size, *x.shape[1:]))


OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "sp_local_rows(Tensor x, SymInt world_size, str group_name, bool vllm=False) -> Tensor",
        Impls(cpu=_local_rows, fake=_local_rows_fake),
        "Rows `[r*M/W, (r+1)*M/W)` of `x` `[M, ...]` for this rank r of the group (a copy); on every device.",
    ),
)
