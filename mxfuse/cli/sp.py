"""`mxfuse demo --sp N`: the sequence-parallel demo on N local processes (gloo on CPU, NCCL on N GPUs)."""

from __future__ import annotations

import os
import sys
import warnings
from typing import TextIO

import torch

from mxfuse.cli.devices import sp_backend
from mxfuse.cli.progress import ProgressFromEvents, RankProgress, quiet_torch_imports
from mxfuse.cli.report import print_header, print_report
from mxfuse.cli.variants import DemoResult, run_variants
from mxfuse.models import Model, ModelConfig, example_inputs, local_rows
from mxfuse.passes.options import PassOptions
from mxfuse.testing import RankFailed, run_ranks


def _sp_rank(rank, world, port, backend, config, tokens, steps, pass_options, events):
    """One rank: build the SP model, run every variant on its rows; rank 0 returns the variants."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    quiet_torch_imports()  # a spawned rank imports afresh: no "No CUDA runtime is found" in the parent's lines
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    with RankProgress(events, f"building the SP model on {world} ranks", rank == 0):
        model = Model(config, sp_group=dist.group.WORLD, device=device).eval()
        x = local_rows(example_inputs(config, tokens, device), rank, world)
    variants = run_variants(  # wall clock: NCCL collectives are not captured into graphs here
        model, x, device, steps, lambda label: RankProgress(events, label, rank == 0), pass_options, graphs=False
    )
    checks = {}
    for v in variants:
        v.output = None  # tensors stay in the worker
        if v.bitwise_vs_eager is not None:
            checks[f"{v.name} == eager"] = v.bitwise_vs_eager
        if v.bitwise_vs_compiled is not None:
            checks[f"{v.name} == compiled"] = v.bitwise_vs_compiled
    dist.barrier()
    dist.destroy_process_group()
    return variants if rank == 0 else None, checks


def run_demo_sp(
    config: ModelConfig,
    tokens: int,
    world: int,
    device_name: str = "auto",
    steps: int = 5,
    out: TextIO | None = None,
    pass_options: PassOptions | None = None,
    timeout_s: float = 900,
) -> DemoResult:
    """The demo on `world` local processes with the SP model; rank 0 prints, every rank checks its bits."""
    out = out or sys.stdout
    pass_options = pass_options or PassOptions()
    if tokens % world:
        raise SystemExit(f"mxfuse demo --sp {world}: --tokens {tokens} is not a multiple of {world}")
    backend, device = sp_backend(world, device_name)  # checked by `mxfuse demo` already: here for other callers
    print_header(config, tokens, device, steps, out, sp=(world, f"{backend} on {device.type}", pass_options.sp_gather))
    progress = ProgressFromEvents(out, starting=f"starting {world} processes")
    args = (backend, config, tokens, steps, pass_options)
    try:
        results = run_ranks(_sp_rank, world, timeout_s, args=args, on_event=progress)
    except RankFailed as failure:
        progress.close(failed=True)
        raise SystemExit(f"mxfuse demo --sp {world}: {failure}") from None
    except BaseException:  # Ctrl-C: the line ends before the command says so
        progress.close(failed=True)
        raise
    result = DemoResult(device, config, tokens, world=world, sp_gather=pass_options.sp_gather, steps=steps)
    result.variants = results[0][0]
    result.rank_checks = [results[r][1] for r in range(world)]
    print_report(result, out)
    return result
