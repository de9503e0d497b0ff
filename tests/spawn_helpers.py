"""Run a test body on N spawned processes (one per rank) and collect what each returns."""

from __future__ import annotations

import os
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(body, rank: int, world: int, port: int, queue):
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        queue.put((rank, body(rank, world, port), None))
    except BaseException:  # report, never hang the parent
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(body, world: int, timeout: float) -> dict:
    """`{rank: body(rank, world, port)}` from `world` spawned processes (MASTER_ADDR/PORT set).

    `body` must be a module-level function; it sets up its own process group (gloo,
    NCCL or vLLM's). A rank that raises fails the test with its traceback.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(body, r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [queue.get(timeout=timeout) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, _, error in got:
        assert error is None, f"rank {rank} failed:\n{error}"
    return {rank: results for rank, results, _ in got}
