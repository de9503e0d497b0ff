"""Where the command runs, decided first (before any model is built or compiled): the device, and for
`demo --sp N` the backend and whether this machine has room for N ranks."""

from __future__ import annotations

import os

import torch


def pick_device(name: str, command: str) -> torch.device:
    """`auto` -> cuda when a GPU is usable, else cpu; `cuda` without a GPU is an error of `command`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"mxfuse {command}: --device cuda was asked for but no CUDA GPU is available")
    return torch.device(name)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, which containers and `taskset` narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def sp_backend(world: int, device_name: str) -> tuple[str, torch.device]:
    """NCCL on `world` GPUs when asked for (or `auto` and they exist), else gloo on CPU, one rank per core
    (at least 2): a larger world is refused rather than run for hours on a few cores."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_name == "cuda" and gpus < world:
        raise SystemExit(f"mxfuse demo --sp {world} --device cuda: only {gpus} GPU(s) present")
    if device_name in ("auto", "cuda") and gpus >= world:
        return "nccl", torch.device("cuda", 0)
    cores = cpu_cores()
    if world > max(2, cores):
        gpu_note = f", and {gpus} GPU(s)" if gpus else ""
        raise SystemExit(
            f"mxfuse demo --sp {world}: this machine has {cores} CPU core(s){gpu_note}; gloo on CPU runs one "
            f"rank per core, so use --sp {max(2, cores)} or fewer"
        )
    return "gloo", torch.device("cpu")
