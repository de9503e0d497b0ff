"""Benchmark what the sequence-parallel rewrite changes, on 2+ GPUs (NCCL): per layer boundary,

- ar:        all_reduce(o) [in place] -> gemma_fused_add_rmsnorm (all M rows) -> mxfp8_quantize (all M rows)
- ar_fused:  all_reduce(o) [in place] -> gemma_fused_add_rmsnorm_mxfp8 (all M rows: rewrite 1 applied)
- sp_bf16:   reduce_scatter(o) -> gemma_fused_add_rmsnorm (M/W rows) -> all_gather bf16 -> mxfp8_quantize (M rows)
- sp_packed: reduce_scatter(o) -> gemma_fused_add_rmsnorm_mxfp8_packed (M/W rows) -> ONE all_gather of
             [M/W, K + K/32] uint8 -> zero-copy codes/scales views (what sequence_parallel + sp_gather emit)
- the collectives alone: all_reduce; reduce_scatter + packed all_gather.

M = tokens of the whole batch (every rank holds all M rows before the rewrite), hidden K.
Bytes one rank sends: ring all-reduce 2 (W-1)/W * 2MK; SP (W-1)/W * (2 + (K + K/32)/K) MK (~0.76x).
Target (issue 17): sp_packed faster than ar_fused at every M >= 256, >= 1.25x at M >= 2048.

Timing (docs/design.md "Measuring", mxfuse/timing.py): a CUDA graph of 64 back-to-back calls cycling
input sets that do not fit in L2 together, captured on every rank, replays aligned by a barrier,
median of 7 replays, rank 0. The all-reduce is NCCL's in place (no copy: the baseline's best
case); its input therefore grows W-fold per call, so the partial sums start at 2^-100 (timing does
not depend on the values; the exactness check below runs on fresh inputs before any timing).

Exactness (every M, on fresh inputs, before timing): sp_packed's codes and scales vs ar_fused's
on this rank's rows: bitwise where the two reductions summed alike (always at W = 2: one rounding
of a + b), else the count of differing codes is reported (the order of the sum: docs/sp_notes.md).

    PYTHONPATH=. python3 tools/bench_sp_rewrite.py [--out DIR] [--world 2] [--hidden 6144] [--ms 16,...,16384]
    PYTHONPATH=. python3 tools/bench_sp_rewrite.py --dry-run   # CPU: gloo ranks, tiny shapes, no timing

Writes DIR/bench_sp_rewrite.md (the table) and DIR/bench_sp_rewrite.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch

from mxfuse.timing import n_input_sets, time_cuda_graph

MS = [16, 64, 256, 1024, 2048, 4096, 8192, 16384]
VARIANTS = ["ar", "ar_fused", "sp_bf16", "sp_packed", "all_reduce", "rs_packed_gather"]
EPS = 1e-6


def wire_bytes(m: int, k: int, world: int) -> dict:
    """Bytes one rank sends: ring all-reduce of bf16 [M, K]; reduce-scatter bf16 + all-gather packed."""
    share = (world - 1) / world
    return {"ar": 2 * share * 2 * m * k, "sp": share * (2 * m * k + m * (k + k // 32))}


def variants(k: int, world: int, group):
    """The chains, as functions of (p, residual_full, residual_local, w) -> what the next GEMM reads."""
    import torch.distributed as dist

    mx = torch.ops.mxfuse
    s = k // 32

    def reduce_scatter(p):
        out = p.new_empty((p.shape[0] // world, *p.shape[1:]))
        dist.reduce_scatter_tensor(out, p, group=group)
        return out

    def gather(t):
        out = t.new_empty((world * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t, group=group)
        return out

    def ar(p, r, r_local, w):
        dist.all_reduce(p, group=group)
        y, res = mx.gemma_fused_add_rmsnorm(p, r, w, EPS)
        return (*mx.mxfp8_quantize(y), res)

    def ar_fused(p, r, r_local, w):
        dist.all_reduce(p, group=group)
        q, sc, res, _ = mx.gemma_fused_add_rmsnorm_mxfp8(p, r, w, EPS)
        return q, sc, res

    def sp_bf16(p, r, r_local, w):
        y, res = mx.gemma_fused_add_rmsnorm(reduce_scatter(p), r_local, w, EPS)
        return (*mx.mxfp8_quantize(gather(y)), res)

    def sp_packed(p, r, r_local, w):
        packed, res, _ = mx.gemma_fused_add_rmsnorm_mxfp8_packed(reduce_scatter(p), r_local, w, EPS)
        pg = gather(packed)
        return pg[:, :k].view(torch.float8_e4m3fn), pg[:, k : k + s], res

    def all_reduce(p, r, r_local, w):
        dist.all_reduce(p, group=group)
        return p

    def rs_packed_gather(p, r, r_local, w, packed_local=None):
        return reduce_scatter(p), gather(packed_local)

    return {
        "ar": ar,
        "ar_fused": ar_fused,
        "sp_bf16": sp_bf16,
        "sp_packed": sp_packed,
        "all_reduce": all_reduce,
        "rs_packed_gather": rs_packed_gather,
    }


def inputs(m: int, k: int, rank: int, world: int, dev, scale: float = 1.0, seed: int = 0):
    """(partial sums of this rank, the replicated residual, its local rows, the norm weight)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    p = (scale * torch.randn(m, k, generator=g)).to(torch.bfloat16).to(dev)
    g = torch.Generator().manual_seed(1000 * seed + 999)  # the same on every rank
    r = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
    w = (0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(dev)
    rows = m // world
    return p, r, r[rank * rows : (rank + 1) * rows].contiguous(), w


def exactness(fns, m, k, rank, world, dev) -> dict:
    """sp_packed vs ar_fused on this rank's rows (fresh inputs; the all-reduce runs on a copy)."""
    p, r, r_local, w = inputs(m, k, rank, world, dev, seed=7)
    q_ar, s_ar, res_ar = fns["ar_fused"](p.clone(), r, r_local, w)
    q_sp, s_sp, res_sp = fns["sp_packed"](p.clone(), r, r_local, w)
    mine = slice(rank * (m // world), (rank + 1) * (m // world))
    qa, qs = q_ar.view(torch.uint8), q_sp.view(torch.uint8)
    same_rows = torch.equal(qa, qs) and torch.equal(s_ar, s_sp)  # every row gathered from the owners
    return {
        "bitwise": bool(same_rows and torch.equal(res_ar[mine], res_sp)),
        "codes_differing": int((qa != qs).sum()),
    }


def time_collective_graph(thunks) -> float:
    """Median µs per call of a CUDA graph cycling `thunks`, every replay started on all ranks at once."""
    import torch.distributed as dist

    def align_ranks():
        dist.barrier()
        torch.cuda.synchronize()

    return time_cuda_graph(lambda f: f(), thunks, flush=False, before_replay=align_ranks)


def _worker(rank, world, port, args, queue):
    try:
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        if args.dry_run:
            dev = torch.device("cpu")
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        import mxfuse  # noqa: F401

        k, fns = args.hidden, variants(args.hidden, world, dist.group.WORLD)
        rows = []
        for m in args.ms:
            if m % world:
                raise ValueError(f"M={m} does not split over {world} ranks")
            row = {"m": m, **exactness(fns, m, k, rank, world, dev), **wire_bytes(m, k, world)}
            if not args.dry_run:
                n = min(n_input_sets(2 * m * k * 2), 16)
                sets = [inputs(m, k, rank, world, dev, scale=2.0**-100, seed=i) for i in range(n)]
                packed = [
                    torch.ops.mxfuse.gemma_fused_add_rmsnorm_mxfp8_packed(s[0][: m // world], s[2], s[3], EPS)[0]
                    for s in sets
                ]
                for name in VARIANTS:
                    fn = fns[name]
                    if name == "rs_packed_gather":
                        thunks = [lambda s=s, pk=pk, fn=fn: fn(*s, packed_local=pk) for s, pk in zip(sets, packed)]
                    else:
                        thunks = [lambda s=s, fn=fn: fn(*s) for s in sets]
                    row[name] = time_collective_graph(thunks)
                del sets, packed
                torch.cuda.empty_cache()
            else:  # dry run: every chain once, shapes checked
                for name in VARIANTS:
                    s = inputs(m, k, rank, world, dev)
                    out = (
                        fns[name](*s, packed_local=torch.zeros(m // world, k + k // 32, dtype=torch.uint8))
                        if name == "rs_packed_gather"
                        else fns[name](*s)
                    )
                    row[f"{name}_shapes"] = [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]
            rows.append(row)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, rows, None))
    except BaseException:  # noqa: BLE001 - report to the parent, never hang it
        import traceback

        queue.put((rank, None, traceback.format_exc()))


def table(rows, k, world, device: str) -> str:
    out = [
        (
            f"SP rewrite at one layer boundary, hidden {k}, {world} ranks ({device}), µs per call "
            "(CUDA graph of 64 calls, median of 7 replays, rank 0); M = tokens of the batch"
        ),
        "",
        (
            "| M | ar: AR, norm, quant | ar_fused: AR, fused norm+quant | sp_bf16 | sp_packed | speedup vs ar_fused "
            "| speedup vs ar | all_reduce alone | RS + packed gather alone | bytes AR | bytes SP | ratio | exact |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        timed = "sp_packed" in r

        def cell(name, r=r, timed=timed):
            return f"{r[name]:.1f}" if timed else "n/a"

        def speed(base, r=r, timed=timed):
            return f"{r[base] / r['sp_packed']:.2f}x" if timed else "n/a"

        exact = "yes" if r["bitwise"] else f"{r['codes_differing']} codes differ"
        out.append(
            f"| {r['m']} | {cell('ar')} | {cell('ar_fused')} | {cell('sp_bf16')} | {cell('sp_packed')} | "
            f"{speed('ar_fused')} | {speed('ar')} | {cell('all_reduce')} | {cell('rs_packed_gather')} | "
            f"{r['ar']:.0f} | {r['sp']:.0f} | {r['sp'] / r['ar']:.4f} | {exact} |"
        )
    out += ["", f"Bytes-sent ratio (2 + (K + K/32)/K) / 4 = {(2 + (k + k // 32) / k) / 4:.4f}."]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo ranks, tiny default shapes, no timing")
    args = ap.parse_args(argv)
    if args.dry_run and args.ms == ",".join(map(str, MS)):
        args.ms, args.hidden = "4,16", min(args.hidden, 128)
    args.ms = [int(v) for v in args.ms.split(",")]
    if not args.dry_run and torch.cuda.device_count() < args.world:
        print(
            f"bench_sp_rewrite: needs {args.world} CUDA GPUs, found {torch.cuda.device_count()} (--dry-run runs on CPU)"
        )
        return 1
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(args.world):
            rank, rows, err = queue.get(timeout=900)
            if err:
                print(f"rank {rank} failed:\n{err}")
                return 1
            got[rank] = rows
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    rows = got[0]
    for r in rows:  # exact only if every rank saw exact bits
        r["bitwise"] = all(rr["bitwise"] for g in got.values() for rr in g if rr["m"] == r["m"])
    device = "CPU dry run, gloo" if args.dry_run else torch.cuda.get_device_name(0)
    md = table(rows, args.hidden, args.world, device)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sp_rewrite.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "bench_sp_rewrite.json"), "w") as f:
        json.dump({"hidden": args.hidden, "world": args.world, "device": device, "rows": rows}, f, indent=2)
    print(md)
    print(f"(wall {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
