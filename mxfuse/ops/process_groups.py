"""Process groups by the name a graph's collectives carry: the one place mxfuse looks them up.

vLLM's collectives (`torch.ops.vllm.all_reduce`, `all_gather`, ...) carry a `GroupCoordinator`'s
`unique_name`, found in vLLM's private registry `vllm.distributed.parallel_state._groups`
(weak references); PyTorch's functional collectives carry a process group's `group_name`,
resolved by `torch.distributed`. A recognizer reads a group's size at compile time, and
`mxfuse::sp_local_rows` this process's rank when the graph runs, both here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


def group_size(group_name: str, vllm: bool) -> int | None:
    """The size of the group named `group_name`, None when this process has no such group."""
    group = _find(group_name, vllm)
    if group is None:
        return None
    return int(group.world_size if vllm else group.size())


def rank_in_group(group_name: str, vllm: bool) -> int | None:
    """This process's rank in the group named `group_name`, None when it has no such group."""
    group = _find(group_name, vllm)
    if group is None:
        return None
    return int(group.rank_in_group if vllm else group.rank())


def _find(group_name: str, vllm: bool) -> Any:
    """A vLLM `GroupCoordinator` (`vllm=True`) or a torch `ProcessGroup` by name, None when this
    process has none (or vLLM is not importable)."""
    try:
        if vllm:
            from vllm.distributed import parallel_state

            ref = parallel_state._groups.get(group_name)
            return ref() if ref is not None else None
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(cast("GroupName", group_name))  # torch's NewType of str
    except Exception:  # noqa: BLE001 - no such group in this process (or no vLLM): the caller decides
        return None
