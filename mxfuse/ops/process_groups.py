"""Process groups by the name a graph's collectives carry: the one place mxfuse looks them up.

vLLM's collectives (`torch.ops.vllm.all_reduce`, `all_gather`, ...) carry a `GroupCoordinator`'s
`unique_name`, found in vLLM's private registry `vllm.distributed.parallel_state._groups`
(weak references); PyTorch's functional collectives carry a process group's `group_name`,
resolved by `torch.distributed`. A recognizer reads a group's size at compile time, and
`mxfuse::sp_local_rows` this process's rank when the graph runs, both through
:func:`find_group`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupInfo:
    """This process's place in a group."""

    rank: int
    world_size: int


def find_group(group_name: str, vllm: bool) -> GroupInfo | None:
    """The group named `group_name` (a vLLM group with `vllm=True`, else a torch process group) in
    this process, or None when there is none (or vLLM is not importable)."""
    try:
        if vllm:
            from vllm.distributed import parallel_state

            ref = parallel_state._groups.get(group_name)
            group = ref() if ref is not None else None
            return None if group is None else GroupInfo(group.rank_in_group, group.world_size)
        from torch.distributed.distributed_c10d import _resolve_process_group

        process_group = _resolve_process_group(group_name)
        return GroupInfo(process_group.rank(), process_group.size())
    except Exception:  # noqa: BLE001 - no such group in this process (or no vLLM): the caller decides
        return None
