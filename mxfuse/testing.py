"""Checks shared by the `mxfuse` command, `tools/` and `tests/`: exact comparison, and N local ranks.

- `bitwise_equal` / `assert_bitwise`: same shape, dtype and bits (NaN payloads and the sign
  of zero included), the bar of every fused-vs-unfused check.
- `poisoned_allocations()`: every `torch.empty` inside the block filled with 0xAB bytes, so an
  output byte a kernel never writes shows (CPU checks, e.g. under Triton's interpreter).
- `run_ranks(body, world)`: `body(rank, world, port, *args)` on `world` spawned processes
  (MASTER_ADDR/PORT set; the body sets up its own process group), results by rank; rank
  events streamed to the parent as they happen (the demo's progress lines). It waits as
  long as the ranks work (a loaded machine only makes them slower), and ends the wait when
  a rank raises, a rank dies, or no rank has used any CPU for `timeout` seconds (deadlock).
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as an integer tensor of the same element size (contiguous)."""
    if t.element_size() not in _INT_OF_SIZE:
        raise TypeError(f"bits: no integer view for {t.dtype} ({t.element_size()} bytes per element)")
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaNs with equal payloads compare equal, -0 != +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(bits(a), bits(b))


def assert_bitwise(actual: Any, expected: Any, what: str = "tensor") -> None:
    """`bitwise_equal`, for a tensor or (nested) tuples and lists of them; says where the bits differ."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), (what, type(actual))
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise(a, e, f"{what}[{i}]")
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: {tuple(actual.shape)} {actual.dtype} vs expected {tuple(expected.shape)} {expected.dtype}"
    )
    differ = bits(actual) != bits(expected)
    if differ.any():
        first = tuple(int(i) for i in differ.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {differ.numel()} elements differ in their bits; first at {first}: "
            f"{actual[first].item()!r} vs expected {expected[first].item()!r}"
        )


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """`assert_bitwise`, except that two NaN of different payloads count as equal (what a kernel does with a
    payload is no source's arithmetic; the quant encodes every NaN as NaN); NaN positions must agree."""
    nan = actual.isnan() & expected.isnan()
    assert_bitwise(torch.where(nan, 0, actual), torch.where(nan, 0, expected), what)
    assert torch.equal(actual.isnan(), expected.isnan()), what


POISON_BYTE = 0xAB


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Within the block `torch.empty` returns tensors filled with POISON_BYTE: where a kernel leaves an output
    byte unwritten (a padding row, a tail) the comparison that follows sees 0xAB, not whatever memory held."""
    empty = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = empty(*args, **kwargs)
        t.view(torch.uint8).fill_(POISON_BYTE)
        return t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A spawned rank raised; carries its rank and traceback."""

    def __init__(self, rank: int, trace: str):
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank, self.trace = rank, trace


class RankEvents:
    """Handed to a rank's body as `events=` when the parent listens: `events.send(...)` reaches `on_event`."""

    def __init__(self, queue: Any, rank: int):
        self._queue, self.rank = queue, rank

    def send(self, *payload: Any) -> None:
        self._queue.put(("event", self.rank, payload))


def _rank_main(
    body: Callable[..., Any], rank: int, world: int, port: int, queue: Any, args: tuple[Any, ...], with_events: bool
) -> None:
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        kwargs = {"events": RankEvents(queue, rank)} if with_events else {}
        queue.put(("result", rank, body(rank, world, port, *args, **kwargs)))
    except BaseException:  # noqa: BLE001 - report, never hang the parent
        queue.put(("error", rank, traceback.format_exc()))


def _cpu_seconds(pids: list[int]) -> float | None:
    """CPU seconds used so far by `pids` and their descendants, reaped ones included (Linux `/proc`);
    None where there is no `/proc`."""
    if not os.path.isdir("/proc/self/task"):
        return None
    total, stack, seen = 0, list(pids), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
    return total / os.sysconf("SC_CLK_TCK")


def run_ranks(
    body: Callable[..., Any],
    world: int,
    timeout: float = 300,
    args: tuple = (),
    on_event: Callable[[int, tuple], None] | None = None,
) -> dict[int, Any]:
    """`{rank: body(rank, world, port, *args)}` from `world` spawned processes.

    `body` must be a module-level function (spawn pickles it by name). With `on_event`, the
    body also gets `events=` (a `RankEvents`) and the parent calls `on_event(rank, payload)`
    for each event while it waits. The first rank that raises ends the wait: the others are
    killed and `RankFailed` carries its traceback; a rank that dies without a result ends it
    too. `timeout` is how long the ranks may make no progress (no CPU used by them or the
    compilers they start, no message), not a bound on the run: on a loaded machine the work
    takes longer and the wait follows it. Without `/proc` it is wall-clock time without a message.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(body, r, world, port, queue, args, on_event is not None))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    pids = [p.pid for p in procs if p.pid is not None]
    last_progress, cpu = time.monotonic(), _cpu_seconds(pids)
    failed = True
    try:
        while len(results) < world:
            try:
                kind, rank, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    raise RankFailed(dead[0][0], f"exited with code {dead[0][1]} without a result") from None
                now, now_cpu = time.monotonic(), _cpu_seconds(pids)
                # progress: the ranks used at least 5% of a core since the last (idle threads use far less)
                if now_cpu is not None and cpu is not None and now_cpu - cpu >= 0.05 * (now - last_progress):
                    last_progress, cpu = now, now_cpu
                if now - last_progress > timeout:
                    raise TimeoutError(
                        f"run_ranks: {world - len(results)} rank(s) gave no result and made no progress "
                        f"for {timeout:.0f} s (deadlocked?)"
                    ) from None
                continue
            last_progress, cpu = time.monotonic(), _cpu_seconds(pids)
            if kind == "error":
                raise RankFailed(rank, payload)
            if kind == "event":
                assert on_event is not None  # a body gets `events=` (and sends) only when the parent listens
                on_event(rank, payload)
            else:
                results[rank] = payload
        failed = False
    finally:  # also on KeyboardInterrupt: no rank outlives the call
        for p in procs:
            if failed:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        queue.close()
        queue.join_thread()
    return results
