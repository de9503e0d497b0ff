"""Benchmark the sequence-parallel all-gather forms of rewrite 2 (`sp_gather`) on 2+ GPUs.

Per M_local (rows per rank), hidden K, on every rank of an NCCL group (spawned with
torch.multiprocessing, no torchrun):

- bf16:        y, res = gemma_fused_add_rmsnorm(x, res); g = all_gather(y) (bf16); q, s = mxfp8_quantize(g)
- mxfp8:       p, res = gemma_fused_add_rmsnorm_mxfp8_packed(x, res); pg = all_gather(p) (uint8,
               [M, K + K/32]); q, s = zero-copy views of pg
- mxfp8+swz:   the same, then mxfp8_swizzle_scales(s) (for a GEMM that reads swizzled scales),
               against bf16 with a swizzled quant after the gather
- bf16 gather alone / packed gather alone (the collective's share of each)

Timing (docs/design.md, "Measuring"): a CUDA graph of 64 back-to-back calls cycling through
input sets that do not fit in L2, captured on every rank, replays aligned by a barrier,
median of 7 replays, per call, rank 0's events. Bytes on the wire: what one rank sends.

    PYTHONPATH=. python3 tools/bench_sp.py [--out DIR] [--world 2] [--hidden 6144] [--ms 1,16,...]

Writes DIR/bench_sp.md (the table), DIR/bench_sp.json and DIR/bench_sp.png (if matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mxfuse.ops.mx_layout import packed_width
from mxfuse.ops.packed import unpack
from mxfuse.testing import RankFailed, bitwise_equal, run_ranks
from mxfuse.timing import n_input_sets, time_cuda_graph

MS = [1, 16, 128, 512, 2048, 8192]
VARIANTS = ["bf16", "bf16_swz", "mxfp8", "mxfp8_swz", "gather_bf16", "gather_packed"]


def time_collective_graph(fns) -> float:
    """Median µs per call of a CUDA graph cycling the thunks `fns`, every replay started on all ranks at once."""
    import torch.distributed as dist

    def align_ranks():
        dist.barrier()
        torch.cuda.synchronize()

    return time_cuda_graph(lambda f: f(), fns, flush=False, before_replay=align_ranks)


def _variants(k, world, group):
    import torch.distributed as dist

    mx = torch.ops.mxfuse

    def gather(t):
        out = t.new_empty((world * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t, group=group)
        return out

    def bf16(x, r, w, swizzled=False):
        y, res = mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        return (*mx.mxfp8_quantize(gather(y), swizzled), res)

    def packed(x, r, w, swizzle=False):
        p, res, _ = mx.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, 1e-6)
        codes, scales = unpack(gather(p), k)
        if swizzle:
            scales = mx.mxfp8_swizzle_scales(scales)
        return codes, scales, res

    return {
        "bf16": bf16,
        "bf16_swz": lambda x, r, w: bf16(x, r, w, True),
        "mxfp8": packed,
        "mxfp8_swz": lambda x, r, w: packed(x, r, w, True),
        "gather_bf16": lambda x, r, w: gather(x),
        "gather_packed": None,  # filled per M with a prebuilt packed buffer
    }


def _worker(rank, world, port, args):
    """One rank (spawned by `run_ranks`, MASTER_ADDR/PORT set): its rows of the table."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    group = dist.group.WORLD
    import mxfuse  # noqa: F401

    k = args.hidden
    fns = _variants(k, world, group)
    rows = []
    for m in args.ms:
        set_bytes = 2 * m * k * 2
        n = min(n_input_sets(set_bytes), 16)
        g = torch.Generator().manual_seed(1000 * rank + m)
        sets = []
        for _ in range(n):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
            r = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
            sets.append((x, r))
        w = (0.1 * torch.randn(k, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16).to(dev)
        # exactness first: packed gather == bf16 gather then quant, bit for bit
        q1, s1, _ = fns["bf16"](*sets[0], w)
        q2, s2, _ = fns["mxfp8"](*sets[0], w)
        _, s3, _ = fns["mxfp8_swz"](*sets[0], w)
        _, s4, _ = fns["bf16_swz"](*sets[0], w)
        exact = bitwise_equal(q1, q2) and bitwise_equal(s1, s2) and bitwise_equal(s3, s4)
        packed_bufs = [torch.ops.mxfuse.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, 1e-6)[0] for x, r in sets]
        row = {"m_local": m, "sets": n, "exact": exact}
        for name in VARIANTS:
            if name == "gather_packed":
                gfn = fns["gather_bf16"]
                calls = [lambda p=p: gfn(p, None, None) for p in packed_bufs]
            else:
                fn = fns[name]
                calls = [lambda x=x, r=r, fn=fn: fn(x, r, w) for x, r in sets]
            row[name] = time_collective_graph(calls)
        row["bytes_bf16"] = m * k * 2
        row["bytes_packed"] = m * packed_width(k)
        rows.append(row)
        del sets, packed_bufs
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows


def table(rows, k, world) -> str:
    out = [
        f"SP all-gather + MXFP8 quant, hidden {k}, {world} ranks ({torch.cuda.get_device_name(0)}), µs per call "
        "(CUDA graph of 64 calls, median of 7 replays, rank 0)",
        "",
        "| M_local | bf16: norm, gather, quant | packed: norm+quant, gather | speedup "
        "| bf16, swizzled quant | packed + swizzle | speedup swz "
        "| gather bf16 | gather packed | wire bytes bf16 | wire bytes packed | ratio | exact |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        out.append(
            f"| {r['m_local']} | {r['bf16']:.1f} | {r['mxfp8']:.1f} | {r['bf16'] / r['mxfp8']:.2f}x | "
            f"{r['bf16_swz']:.1f} | {r['mxfp8_swz']:.1f} | {r['bf16_swz'] / r['mxfp8_swz']:.2f}x | "
            f"{r['gather_bf16']:.1f} | "
            f"{r['gather_packed']:.1f} | {r['bytes_bf16']} | {r['bytes_packed']} | "
            f"{r['bytes_packed'] / r['bytes_bf16']:.4f} | {'yes' if r['exact'] else 'NO'} |"
        )
    out.append("")
    out.append(f"Wire-byte ratio target (K + K/32) / 2K = {packed_width(k) / (2 * k):.4f}.")
    return "\n".join(out)


def plot(rows, k, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    ms = [r["m_local"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in (
        ("bf16", "bf16 gather + quant"),
        ("mxfp8", "packed MXFP8 gather"),
        ("bf16_swz", "bf16 gather + swizzled quant"),
        ("mxfp8_swz", "packed + swizzle"),
    ):
        ax[0].plot(ms, [r[name] for r in rows], marker="o", label=label)
    ax[0].set(xscale="log", yscale="log", xlabel="M_local (rows per rank)", ylabel="µs per call", title=f"K={k}")
    ax[0].legend()
    ax[1].plot(ms, [r["bf16"] / r["mxfp8"] for r in rows], marker="o", label="packed")
    ax[1].plot(ms, [r["bf16_swz"] / r["mxfp8_swz"] for r in rows], marker="o", label="packed + swizzle")
    ax[1].axhline(1.0, color="gray", lw=0.8)
    ax[1].axhline(1.8, color="gray", lw=0.8, ls="--")
    ax[1].set(xscale="log", xlabel="M_local", ylabel="speedup over bf16", title="speedup")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args(argv)
    args.ms = [int(v) for v in args.ms.split(",")]
    if torch.cuda.device_count() < args.world:
        print(f"bench_sp: needs {args.world} CUDA GPUs, found {torch.cuda.device_count()}")
        return 1
    t0 = time.time()
    try:
        got = run_ranks(_worker, args.world, timeout=900, args=(args,))
    except RankFailed as failure:
        print(failure)
        return 1
    rows = got[0]
    for r in rows:  # exact only if every rank saw exact bits
        r["exact"] = all(rr["exact"] for g in got.values() for rr in g if rr["m_local"] == r["m_local"])
    os.makedirs(args.out, exist_ok=True)
    md = table(rows, args.hidden, args.world)
    with open(os.path.join(args.out, "bench_sp.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "bench_sp.json"), "w") as f:
        json.dump({"hidden": args.hidden, "world": args.world, "rows": rows}, f, indent=2)
    plotted = plot(rows, args.hidden, os.path.join(args.out, "bench_sp.png"))
    print(md)
    print(f"(wall {time.time() - t0:.0f} s; plot {'written' if plotted else 'skipped: no matplotlib'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
