"""Benchmark the Triton norm / quant kernels on a CUDA GPU (DESIGN.md "Measuring").

For K in {6144, 3072} and M in {1 .. 16384}, per call (CUDA graph of 64 back-to-back
calls cycling through enough input sets to not sit in L2, L2 flushed before each replay,
median of 7 replays):

- fused add-norm+quant (`mxfuse::gemma_fused_add_rmsnorm_mxfp8`) and fused plain
  norm+quant (`mxfuse::gemma_rmsnorm_mxfp8`), row-major and swizzled scales;
- unfused: the Triton norm op then the Triton quant op (same layouts);
- `torch.compile` of the plain PyTorch reference (reference.gemma_fused_add_rmsnorm /
  gemma_rmsnorm + reference.quantize_rows), row-major;
- a large device-to-device copy (the bandwidth ceiling), in the same run.

Effective TB/s = bytes that must move (x [+ residual in, residual out] + codes + scales;
bf16) / time. Prints markdown tables; `--out DIR` writes kernels_bench.md, .json, .png.

    PYTHONPATH=. python3 tools/bench_kernels.py [--out DIR] [--sweep] [--ms 1,64] [--ks 6144]
    PYTHONPATH=. python3 tools/bench_kernels.py --gemm [--gemm-args "--quick"]

`--sweep` also times launch-shape variants (num_warps, rows per program) and naive
baselines (a one-row-per-program norm, a 64x32-tile quant) to show the unfused kernels
are honest. `--gemm` then runs tools/bench_gemm.py (GEMM rows live there).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import copy_bandwidth_tbs, n_input_sets, time_cuda_graph  # noqa: E402

KS = [6144, 3072]
MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
EPS = 1e-6
DT = torch.bfloat16


def _pad(n, m):
    return (n + m - 1) // m * m


def needed_bytes(m, k, add, swizzled, elem=2):
    scales = _pad(m, 128) * _pad(k // 32, 4) if swizzled else m * (k // 32)
    return (3 if add else 1) * elem * m * k + m * k + scales


# ------------------------------------------------------------------ the compiled reference


def _ref_add(x, r, w):
    from mxfuse.ops import reference

    y, res = reference.gemma_fused_add_rmsnorm(x, r, w, EPS)
    q, s = reference.quantize_rows(y)
    return q, s, res


def _ref_plain(x, w):
    from mxfuse.ops import reference

    y = reference.gemma_rmsnorm(x, w, EPS)
    return reference.quantize_rows(y)


_compiled = {}


def compiled(name):
    if name not in _compiled:
        _compiled[name] = torch.compile(_ref_add if name == "add" else _ref_plain)
    return _compiled[name]


def _mark(t, m):
    torch._dynamo.mark_static(t, 1)
    if m > 1:
        torch._dynamo.mark_dynamic(t, 0)  # one compile for all M > 1 per K (M = 1 specializes)
    return t


# ------------------------------------------------------------------ naive baselines (for --sweep)


def _naive_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def naive_norm(x_ptr, r_ptr, w_ptr, ro_ptr, y_ptr, K, eps, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_K)
        m = c < K
        s = tl.load(x_ptr + row * K + c, mask=m, other=0.0).to(tl.float32)
        s += tl.load(r_ptr + row * K + c, mask=m, other=0.0).to(tl.float32)
        tl.store(ro_ptr + row * K + c, s.to(tl.bfloat16), mask=m)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / K + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32) + 1.0
        tl.store(y_ptr + row * K + c, (s * rstd * w).to(tl.bfloat16), mask=m)

    @triton.jit
    def naive_quant(x_ptr, q_ptr, s_ptr, M, K, BM: tl.constexpr):
        # one program per 64 rows x 32 columns (one scale column)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * 32 + tl.arange(0, 32)
        mask = (rows < M)[:, None]
        v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.abs(v)
        a = tl.where(a != a, 0.0, a)
        amax = tl.maximum(tl.max(a, axis=1), 1.1754943508222875e-38)
        bits = amax.to(tl.int32, bitcast=True)
        be = bits >> 23
        sb = be - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        sb = tl.where(be == 255, 254, sb)
        sb = tl.minimum(tl.maximum(sb, 0), 254)
        e = 254 - sb
        mult = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)
        q = v * mult[:, None]
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + rows * (K // 32) + tl.program_id(1), sb.to(tl.uint8), mask=rows < M)

    def norm(x, r, w):
        m, k = x.shape
        ro, y = torch.empty_like(x), torch.empty_like(x)
        naive_norm[(m,)](x, r, w, ro, y, k, EPS, BLOCK_K=triton.next_power_of_2(k), num_warps=8)
        return y, ro

    def quant(x):
        m, k = x.shape
        q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty((m, k // 32), dtype=torch.uint8, device=x.device)
        naive_quant[(triton.cdiv(m, 64), k // 32)](x, q, s, m, k, BM=64, num_warps=4)
        return q, s

    return norm, quant


# ------------------------------------------------------------------ one (K, M) point


def make_sets(m, k, seed=0):
    per_set = 2 * 2 * m * k
    n = n_input_sets(per_set)
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(n):
        x = torch.randn(m, k, device="cuda", dtype=DT, generator=g)
        r = torch.randn(m, k, device="cuda", dtype=DT, generator=g)
        sets.append((x, r))
    return sets


def bench_point(k, m, with_compiled=True, log=print):
    import mxfuse.ops  # noqa: F401

    ops = torch.ops.mxfuse
    w = (0.5 * torch.randn(k, device="cuda")).to(DT)
    sets = make_sets(m, k, seed=k + m)
    res = {"K": k, "M": m, "sets": len(sets)}

    def t(name, fn, inputs=sets):
        t0 = time.time()
        try:
            res[name] = time_cuda_graph(fn, inputs)
        except Exception as e:  # report and carry on: one failing variant must not lose the table
            log(f"  {name} K={k} M={m} FAILED: {type(e).__name__}: {e}")
            res[name] = float("nan")
        res.setdefault("wall", {})[name] = round(time.time() - t0, 2)

    for swz in (False, True):
        sfx = "_swz" if swz else ""
        t("fused_add" + sfx, lambda x, r, s=swz: ops.gemma_fused_add_rmsnorm_mxfp8(x, r, w, EPS, s))
        t("unfused_add" + sfx, lambda x, r, s=swz: ops.mxfp8_quantize(ops.gemma_fused_add_rmsnorm(x, r, w, EPS)[0], s))
        t("fused_plain" + sfx, lambda x, r, s=swz: ops.gemma_rmsnorm_mxfp8(x, w, EPS, s))
        t("unfused_plain" + sfx, lambda x, r, s=swz: ops.mxfp8_quantize(ops.gemma_rmsnorm(x, w, EPS), s))
    if with_compiled:
        csets = [(_mark(x, m), _mark(r, m)) for x, r in sets]
        t("compiled_add", lambda x, r: compiled("add")(x, r, w), csets)
        t("compiled_plain", lambda x, r: compiled("plain")(x, w), csets)
    del sets
    return res


# ------------------------------------------------------------------ sweep (development aid)


def sweep(ks, ms, log=print):
    import mxfuse.ops  # noqa: F401
    from mxfuse.ops import triton_norm_quant as tnq

    ops = torch.ops.mxfuse
    naive_norm, naive_quant = _naive_kernels()
    rows = []
    for k in ks:
        w = (0.5 * torch.randn(k, device="cuda")).to(DT)
        for m in ms:
            sets = make_sets(m, k, seed=7)
            r = {"K": k, "M": m, "default_row": tnq.row_config(tnq._block_k(k), m), "default_quant": tnq.quant_config(k, m)}
            for rpp, nw in ((1, 4), (1, 8), (1, 16), (4, 4), (4, 8)):
                tnq.CONFIG_OVERRIDE["row"] = (1, rpp, nw)
                r[f"fused_add rpp{rpp} nw{nw}"] = time_cuda_graph(
                    lambda x, rr: ops.gemma_fused_add_rmsnorm_mxfp8(x, rr, w, EPS), sets
                )
                r[f"norm_add rpp{rpp} nw{nw}"] = time_cuda_graph(lambda x, rr: ops.gemma_fused_add_rmsnorm(x, rr, w, EPS), sets)
            tnq.CONFIG_OVERRIDE.clear()
            ys = [(ops.gemma_fused_add_rmsnorm(x, rr, w, EPS)[0],) for x, rr in sets]
            for cfg in ((1, 1024, 4), (4, 1024, 8), (8, 512, 8), (2, 2048, 8)):
                tnq.CONFIG_OVERRIDE["quant"] = cfg
                r["quant bm%d bc%d nw%d" % cfg] = time_cuda_graph(lambda y: ops.mxfp8_quantize(y, False), ys)
            tnq.CONFIG_OVERRIDE.clear()
            r["quant default"] = time_cuda_graph(lambda y: ops.mxfp8_quantize(y, False), ys)
            r["naive norm (1 row/program, tl.sum)"] = time_cuda_graph(lambda x, rr: naive_norm(x, rr, w), sets)
            r["naive quant (64x32 tiles)"] = time_cuda_graph(lambda y: naive_quant(y), ys)
            log(json.dumps(r))
            rows.append(r)
            del sets, ys
    return rows


def sweep_table(rows):
    keys = [k for k in rows[0] if k not in ("K", "M", "default_row", "default_quant")]
    out = ["| K | M | default row / quant cfg | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 3)]
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f}" for k in keys)
        out.append(f"| {r['K']} | {r['M']} | {r['default_row']} / {r['default_quant']} | {cells} |")
    return "\n".join(out)


# ------------------------------------------------------------------ report


def tables(results, copy_tbs):
    out = []
    for kind, title in (("add", "fused add-norm + MXFP8 quant"), ("plain", "plain norm + MXFP8 quant")):
        out.append(f"\n### {title} (bf16 in; µs per call; TB/s = bytes that must move / time; copy = {copy_tbs:.2f} TB/s)\n")
        out.append(
            "| K | M | fused µs | TB/s | % of copy | unfused µs | fused vs unfused | compiled µs | fused vs compiled "
            "| fused swz µs | swz TB/s | unfused swz µs | swz fused vs unfused |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            k, m = r["K"], r["M"]
            f, u, c = r[f"fused_{kind}"], r[f"unfused_{kind}"], r.get(f"compiled_{kind}", float("nan"))
            fs, us = r[f"fused_{kind}_swz"], r[f"unfused_{kind}_swz"]
            tb = needed_bytes(m, k, kind == "add", False) / (f * 1e-6) / 1e12
            tbs = needed_bytes(m, k, kind == "add", True) / (fs * 1e-6) / 1e12
            out.append(
                f"| {k} | {m} | {f:.2f} | {tb:.2f} | {100 * tb / copy_tbs:.0f}% | {u:.2f} | {u / f:.2f}x | {c:.2f} | "
                f"{c / f:.2f}x | {fs:.2f} | {tbs:.2f} | {us:.2f} | {us / fs:.2f}x |"
            )
    return "\n".join(out)


def plot(results, copy_tbs, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot written")
        return None
    ks = sorted({r["K"] for r in results}, reverse=True)
    fig, axes = plt.subplots(1, len(ks), figsize=(6.5 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rs = [r for r in results if r["K"] == k]
        ms = [r["M"] for r in rs]
        for key, label, add in (
            ("fused_add", "fused add-norm+quant", True),
            ("unfused_add", "Triton norm + Triton quant", True),
            ("compiled_add", "torch.compile(reference)", True),
            ("fused_plain", "fused plain norm+quant", False),
            ("unfused_plain", "plain: norm + quant", False),
        ):
            ys = [needed_bytes(r["M"], k, add, False) / (r.get(key, float("nan")) * 1e-6) / 1e12 for r in rs]
            ax.plot(ms, ys, marker="o", label=label, linestyle="-" if add else "--")
        ax.axhline(copy_tbs, color="gray", linestyle=":", label=f"copy {copy_tbs:.2f} TB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("effective TB/s (bytes that must move / time)")
        ax.set_title(f"K = {k}, bf16, H200")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def save(out, md, copy_tbs, results, sweep_rows, plot_it=True):
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernels_bench.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, "kernels_bench.json"), "w") as f:
        json.dump({"copy_tbs": copy_tbs, "results": results, "sweep": sweep_rows}, f, indent=1)
    if plot_it:
        p = plot(results, copy_tbs, os.path.join(out, "kernels_bench.png"))
        if p:
            print(f"wrote {p}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for kernels_bench.md / .json / .png")
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--no-compiled", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--sweep", action="store_true", help="also time launch-shape variants and naive baselines")
    ap.add_argument("--sweep-ms", default="1,16,256,4096,16384")
    ap.add_argument("--gemm", action="store_true", help="then run tools/bench_gemm.py (GEMM rows)")
    ap.add_argument("--gemm-args", default="", help="extra arguments for bench_gemm.py, one string")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU")
        return 1
    ks = [int(v) for v in args.ks.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    import triton

    head = (
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"CUDA graph of 64 calls, median of 7 replays, L2 flushed before each replay"
    )
    print(head, flush=True)
    copy_tbs = copy_bandwidth_tbs()
    print(f"copy bandwidth: {copy_tbs:.3f} TB/s", flush=True)
    results = []
    t0 = time.time()
    for k in ks:
        for m in ms:
            r = bench_point(k, m, with_compiled=not args.no_compiled)
            print(json.dumps(r), flush=True)
            results.append(r)
    print(f"main table took {time.time() - t0:.0f} s", flush=True)
    md = head + f"\n\ncopy bandwidth (same run): {copy_tbs:.3f} TB/s\n" + tables(results, copy_tbs)
    print(md, flush=True)
    save(args.out, md, copy_tbs, results, None)
    if args.sweep:
        sweep_rows = sweep(ks, [int(v) for v in args.sweep_ms.split(",")])
        smd = "\n\n### launch-shape sweep and naive baselines (µs per call)\n\n" + sweep_table(sweep_rows)
        print(smd, flush=True)
        save(args.out, md + smd, copy_tbs, results, sweep_rows, plot_it=False)
    if args.gemm:  # hook: GEMM rows are produced by tools/bench_gemm.py
        try:
            import bench_gemm
        except ImportError as e:
            print(f"--gemm: tools/bench_gemm.py not importable ({e})")
        else:
            gargs = shlex.split(args.gemm_args) + (["--out", args.out] if args.out else [])
            bench_gemm.main(gargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
