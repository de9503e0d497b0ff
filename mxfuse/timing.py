"""Timing shared by the `mxfuse demo` command and the GPU benchmarks in `tools/` (docs: "Measuring").

The L2 size comes from the device (`l2_bytes`), so the flush and the input-set count fit any GPU.

`time_cuda_graph(fn, inputs_list)` captures ONE CUDA graph of `calls` back-to-back calls
`fn(inputs_list[j % len(inputs_list)])` (a tuple is splatted: `fn(*inputs)`), replays it
`replays` times and returns the median microseconds per call. Before each timed replay
the L2 is flushed by writing a buffer larger than it (outside the timed region), so the
first call of a replay does not find its inputs in L2 either; give enough input sets that
`calls` consecutive calls do not fit in L2 together (`n_input_sets`).

`before_replay` runs before the warm replay and each timed one, outside the timed region:
the SP benchmark passes a barrier there so that every rank's replay starts together.

`copy_bandwidth_tbs()` is a large device-to-device copy (bytes read + written) timed the
same way: the ceiling for memory-bound kernels, measured in the same run.

`wall_clock_ms` is the fallback where a graph cannot be captured (CPU, collectives that
are not graph-safe, a host sync inside the step).
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

CALLS = 64
REPLAYS = 7


def l2_bytes(device=None) -> int:
    """The L2 size of `device` (default: the current CUDA device), as the driver reports it."""
    return torch.cuda.get_device_properties(torch.device(device or "cuda")).L2_cache_size


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(4 * l2_bytes(device), dtype=torch.uint8, device=device)


def flush_l2(device=None):
    """Write 4x the L2 size so nothing of the benchmark's inputs stays cached."""
    _flush_buffer(torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())).fill_(1)


def n_input_sets(bytes_per_set: int, calls: int = CALLS, factor: float = 3.0, device=None) -> int:
    """Input sets to cycle through so `calls` calls touch >= factor x L2 (at least 2, at most `calls`)."""
    return int(min(calls, max(2, math.ceil(factor * l2_bytes(device) / max(1, bytes_per_set)))))


def _call(fn, inp):
    if isinstance(inp, tuple):
        return fn(*inp)
    return fn(inp)


def time_cuda_graph(
    fn, inputs_list, calls: int = CALLS, replays: int = REPLAYS, flush: bool = True, before_replay=None
) -> float:
    """Median µs per call of a CUDA graph of `calls` calls of `fn` cycling through `inputs_list`."""
    before_replay = before_replay or (lambda: None)
    inputs_list = list(inputs_list) or [()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / autotune / allocate outside the capture
        for inp in inputs_list[: min(len(inputs_list), 3)]:
            _call(fn, inp)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(calls):
            _call(fn, inputs_list[j % len(inputs_list)])
    torch.cuda.synchronize()
    before_replay()
    graph.replay()  # warm replay
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        if flush:
            flush_l2()
        before_replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000.0 / calls)
    del graph
    torch.cuda.synchronize()
    return statistics.median(times)


def copy_bandwidth_tbs(nbytes: int = 2**30) -> float:
    """TB/s of a large device-to-device copy (bytes read + bytes written), the better of a
    copy kernel running on the SMs (`torch.neg` into another buffer) and `copy_` (a memcpy
    node in a graph, which may run on a copy engine)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").fill_(3)
    dst = torch.empty_like(src)
    us_sm = time_cuda_graph(lambda: torch.neg(src, out=dst), [()], calls=8, replays=REPLAYS)
    us_cp = time_cuda_graph(lambda: dst.copy_(src), [()], calls=8, replays=REPLAYS)
    return 2 * nbytes / (min(us_sm, us_cp) * 1e-6) / 1e12


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_clock_ms(fn: Callable, x, steps: int, device: torch.device, warmup: int = 2) -> float:
    """Median wall time of one call in ms over `steps` calls (each synchronized), after `warmup` calls."""
    times = []
    for _ in range(warmup):
        fn(x)
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        fn(x)
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_time_ms(fn: Callable, x, steps: int, device: torch.device, graphs: bool = True) -> tuple[float, str]:
    """(ms per step, how it was measured): one step captured as a CUDA graph and replayed `steps`
    times on CUDA when `graphs` (the kernels the step launches, not the host), else (CPU,
    collectives, or a step that cannot be captured) the synchronized wall clock."""
    with torch.inference_mode():
        if graphs and device.type == "cuda":
            try:
                with torch.cuda.device(device):
                    us = time_cuda_graph(fn, [x], calls=1, replays=steps, flush=False)
                return us / 1e3, "cuda graph"
            except Exception as error:  # noqa: BLE001 - e.g. a host sync inside the step
                torch.cuda.synchronize(device)
                log.debug("CUDA-graph timing failed (%s); wall clock instead", error)
        return wall_clock_ms(fn, x, steps, device), "wall clock"
