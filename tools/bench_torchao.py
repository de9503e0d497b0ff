"""Benchmark: the fused Gemma norm + MXFP8 quant in torchao's encoding vs the norm plus torchao's
compiled quant chain (issue 16), on a CUDA GPU. No vLLM; torchao is carried as a wheel.

For K in {6144, 3072}, M in {1 .. 16384}, bf16, both scale layouts torchao reads (row-major:
what `to_mx` returns and the EMULATED kernel dequantizes; blocked: `to_blocked`, what AUTO
feeds `_scaled_mm`), per call (mxfuse/timing.py: CUDA graph of 64 calls over enough input
sets not to sit in L2, L2 flushed before each replay, median of 7 replays):

- ``fused``: `mxfuse::gemma_rmsnorm_mxfp8(x, w, eps, swizzled, rule=QuantRule.TORCHAO)`, what
  the rewrite emits (and `gemma_fused_add_rmsnorm_mxfp8(..., round_sum=True)` for the
  Hugging Face `residual + hidden` -> norm order);
- ``norm+torchao``: the project's Triton norm op, then `torch.compile` of torchao's own
  `to_mx(y, float8_e4m3fn, 32, RCEIL)` (+ `to_blocked`): what the graph runs where the
  norm is the project's and the quant torchao's;
- ``compiled``: `torch.compile` of Hugging Face's Gemma norm math and torchao's quant in
  one function (Inductor's own fusion: what a torchao user gets without mxfuse);
- a large device-to-device copy, the bandwidth ceiling, in the same run.

First, per K, a bitwise check on the GPU (rows with NaN, +-Inf, zeros, tiny values): the
fused op == the Triton norm then torchao's `to_mx`, eager and compiled (a NaN code's sign
bit aside: torchao's eager and compiled quants disagree on it on CPU). Effective TB/s =
bytes that must move (x [+ residual in and out] + codes + scales) / time. Prints markdown;
`--out DIR` writes torchao_bench.md / .json / .png.

    PYTHONPATH=. python3 tools/bench_torchao.py [--out DIR] [--ms 1,64] [--ks 6144]
    PYTHONPATH=. python3 tools/bench_torchao.py --dry-run     # CPU: builds and runs every variant once
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, scale_columns, swizzled_scale_shape
from mxfuse.timing import copy_bandwidth_tbs, n_input_sets, time_cuda_graph

KS = [6144, 3072]
MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
EPS = 1e-6
DT = torch.bfloat16
LAYOUTS = (("rowmajor", False), ("blocked", True))


def needed_bytes(m: int, k: int, add: bool, blocked: bool) -> int:
    rows, columns = swizzled_scale_shape(m, k) if blocked else (m, scale_columns(k))
    return (3 if add else 1) * 2 * m * k + m * k + rows * columns


# ------------------------------------------------------------------ torchao's side


def torchao_quant(y: torch.Tensor, blocked: bool):
    """torchao's activation quant of `[M, K]` rows, as `_addmm_mx_dispatch` runs it: codes and
    scale bytes (row-major `[M, K/32]`, or `to_blocked`'s flat F8_128x4)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.utils import to_blocked

    scales, codes = to_mx(y, FP8_DTYPE, BLOCK, ScaleCalculationMode.RCEIL)
    if blocked:
        scales = to_blocked(scales.view(y.shape[0], -1))
    return codes, scales.view(torch.uint8)


def hf_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Hugging Face's GemmaRMSNorm / MiniMaxM3VLRMSNorm math."""
    s = x.float()
    s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
    return (s * (1.0 + weight.float())).type_as(x)


def _hf_plain(x, weight, blocked):
    return torchao_quant(hf_norm(x, weight), blocked)


def _hf_add(x, residual, weight, blocked):
    s = residual + x
    return (*torchao_quant(hf_norm(s, weight), blocked), s)


_compiled: dict = {}


def compiled(fn):
    """One `torch.compile` per function (dynamic M through `_mark`)."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


def _mark(t: torch.Tensor, m: int) -> torch.Tensor:
    torch._dynamo.mark_static(t, 1)
    if m > 1:
        torch._dynamo.mark_dynamic(t, 0)  # one compile for all M > 1 per K (M = 1 specializes)
    return t


# ------------------------------------------------------------------ the variants


def variants(weight: torch.Tensor):
    """`{name: fn(x, residual)}` for every timed variant (add and plain, both layouts)."""
    import mxfuse.ops  # noqa: F401
    from mxfuse.ops.reference import QuantRule

    ops, rule = torch.ops.mxfuse, int(QuantRule.TORCHAO)
    out = {}
    for layout, blocked in LAYOUTS:
        out[f"fused_plain_{layout}"] = lambda x, r, b=blocked: ops.gemma_rmsnorm_mxfp8(x, weight, EPS, b, rule=rule)[:2]
        out[f"fused_add_{layout}"] = lambda x, r, b=blocked: ops.gemma_fused_add_rmsnorm_mxfp8(
            x, r, weight, EPS, b, round_sum=True, rule=rule
        )[:3]
        out[f"norm+torchao_plain_{layout}"] = lambda x, r, b=blocked: compiled(torchao_quant)(
            ops.gemma_rmsnorm(x, weight, EPS), b
        )
        out[f"norm+torchao_add_{layout}"] = lambda x, r, b=blocked: _norm_add_then_torchao(x, r, weight, b)
        out[f"compiled_plain_{layout}"] = lambda x, r, b=blocked: compiled(_hf_plain)(x, weight, b)
        out[f"compiled_add_{layout}"] = lambda x, r, b=blocked: compiled(_hf_add)(x, r, weight, b)
    return out


def _norm_add_then_torchao(x, residual, weight, blocked):
    y, res = torch.ops.mxfuse.gemma_fused_add_rmsnorm(x, residual, weight, EPS)
    return (*compiled(torchao_quant)(y, blocked), res)


# ------------------------------------------------------------------ bitwise check


def special_rows(m: int, k: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 9] = -float("inf")
    x[3] = 0.0
    x[4, : k // 2] = 1e-30  # a row of tiny blocks and normal ones: scale bytes near 0
    x[5] = torch.linspace(-1, 1, k) * 2**-120
    return x.to(DT).to(device)


def bitwise_check(k: int, device) -> dict:
    """Mismatching bytes: fused vs the project's norm then torchao's `to_mx` (eager and compiled)."""
    import mxfuse.ops  # noqa: F401
    from mxfuse.ops.reference import QuantRule

    ops, rule = torch.ops.mxfuse, int(QuantRule.TORCHAO)
    g = torch.Generator().manual_seed(1)
    weight = (0.3 * torch.randn(k, generator=g)).to(DT).to(device)
    x, residual = special_rows(300, k, device), special_rows(300, k, device, seed=2)
    report = {}
    for layout, blocked in LAYOUTS:
        y = ops.gemma_rmsnorm(x, weight, EPS)
        yadd, res = ops.gemma_fused_add_rmsnorm(x, residual, weight, EPS)
        fused = ops.gemma_rmsnorm_mxfp8(x, weight, EPS, blocked, rule=rule)
        fused_add = ops.gemma_fused_add_rmsnorm_mxfp8(x, residual, weight, EPS, blocked, rule=rule)
        for name, quant in (("eager", torchao_quant), ("compiled", compiled(torchao_quant))):
            for kind, got, want in (
                ("plain", fused[:2], quant(y, blocked)),
                ("add", (*fused_add[:2], fused_add[2]), (*quant(yadd, blocked), res)),
            ):
                report[f"{kind}_{layout}_vs_{name}"] = sum(_mismatches(a, b) for a, b in zip(got, want))
    return report


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Differing elements, bit for bit, except the sign of a NaN code (0x7F vs 0xFF): torchao's
    own eager and compiled quants disagree on it on CPU (which NaN operand x86 keeps)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.numel() != b.numel():
        return max(a.numel(), b.numel())
    if a.dtype == FP8_DTYPE:
        a, b = (torch.where(t.isnan(), float("nan"), t.float()).to(t.dtype) for t in (a, b))
    view = torch.uint8 if a.element_size() == 1 else torch.int16
    return int((a.view(view) != b.view(view)).sum())


# ------------------------------------------------------------------ timing


def make_sets(m: int, k: int, seed: int = 0, device="cuda") -> list:
    n = n_input_sets(needed_bytes(m, k, True, False))
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        (torch.randn(m, k, device=device, generator=g).to(DT), torch.randn(m, k, device=device, generator=g).to(DT))
        for _ in range(n)
    ]


def bench_point(k: int, m: int) -> dict:
    weight = (0.3 * torch.randn(k, device="cuda")).to(DT)
    sets = [(_mark(x, m), _mark(r, m)) for x, r in make_sets(m, k, seed=k + m)]
    result = {"K": k, "M": m}
    for name, fn in variants(weight).items():
        result[name] = time_cuda_graph(fn, sets)
    return result


def tables(results: list, copy_tbs: float) -> str:
    out = []
    for kind, title in (("plain", "plain Gemma norm"), ("add", "residual add + Gemma norm (HF order)")):
        for layout, blocked in LAYOUTS:
            out.append(
                f"\n### {title} + torchao MXFP8 quant, {layout} scales (µs per call; TB/s = bytes that must "
                f"move / time; copy = {copy_tbs:.2f} TB/s)\n"
            )
            out.append("| K | M | fused µs | TB/s | % of copy | norm+torchao µs | vs fused | compiled µs | vs fused |")
            out.append("|---|---|---|---|---|---|---|---|---|")
            for r in results:
                f = r[f"fused_{kind}_{layout}"]
                u, c = r[f"norm+torchao_{kind}_{layout}"], r[f"compiled_{kind}_{layout}"]
                tb = needed_bytes(r["M"], r["K"], kind == "add", blocked) / (f * 1e-6) / 1e12
                out.append(
                    f"| {r['K']} | {r['M']} | {f:.2f} | {tb:.2f} | {100 * tb / copy_tbs:.0f}% | {u:.2f} | "
                    f"{u / f:.2f}x | {c:.2f} | {c / f:.2f}x |"
                )
    return "\n".join(out)


def plot(results: list, copy_tbs: float, path: str):
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
        for prefix, label, style in (
            ("fused", "fused norm+quant (torchao rule)", "-"),
            ("norm+torchao", "Triton norm + compiled torchao quant", "--"),
            ("compiled", "torch.compile(HF norm + torchao quant)", ":"),
        ):
            for kind in ("add", "plain"):
                key = f"{prefix}_{kind}_rowmajor"
                ys = [needed_bytes(r["M"], k, kind == "add", False) / (r[key] * 1e-6) / 1e12 for r in rs]
                ax.plot([r["M"] for r in rs], ys, marker="o" if kind == "add" else "x", linestyle=style,
                        label=f"{label}, {kind}")  # fmt: skip
        ax.axhline(copy_tbs, color="gray", linestyle=":", label=f"copy {copy_tbs:.2f} TB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("effective TB/s (row-major scales)")
        ax.set_title(f"K = {k}, bf16, {torch.cuda.get_device_name()}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def dry_run() -> int:
    """CPU: the bitwise check through the reference impls, and every variant called once."""
    for k in (256,):
        print("bitwise (CPU reference):", json.dumps(bitwise_check(k, "cpu")))
        weight = (0.3 * torch.randn(k)).to(DT)
        x, r = special_rows(9, k, "cpu"), special_rows(9, k, "cpu", seed=3)
        for name, fn in variants(weight).items():
            shapes = [tuple(t.shape) for t in fn(_mark(x, 9), _mark(r, 9))]
            print(f"{name}: {shapes}")
    print(tables([{"K": 256, "M": 9, **dict.fromkeys(variants(weight), 1.0)}], 4.0))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for torchao_bench.md / .json / .png")
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--dry-run", action="store_true", help="CPU: check and call every variant once, no timing")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        print("bench_torchao: needs a CUDA GPU (or --dry-run)")
        return 1
    import torchao
    import triton

    head = (
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"torchao {torchao.__version__}  CUDA graph of 64 calls, median of 7 replays, L2 flushed before each replay"
    )
    print(head, flush=True)
    ks, ms = [int(v) for v in args.ks.split(",")], [int(v) for v in args.ms.split(",")]
    checks = {k: bitwise_check(k, "cuda") for k in ks}
    print("bitwise mismatches (0 = equal):", json.dumps(checks), flush=True)
    copy_tbs = copy_bandwidth_tbs()
    print(f"copy bandwidth: {copy_tbs:.3f} TB/s", flush=True)
    results, t0 = [], time.time()
    for k in ks:
        for m in ms:
            results.append(bench_point(k, m))
            print(json.dumps(results[-1]), flush=True)
    print(f"table took {time.time() - t0:.0f} s", flush=True)
    md = f"{head}\n\nbitwise mismatches (0 = equal): {json.dumps(checks)}\n\ncopy bandwidth (same run): "
    md += f"{copy_tbs:.3f} TB/s\n" + tables(results, copy_tbs)
    print(md, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "torchao_bench.md"), "w") as f:
            f.write(md + "\n")
        with open(os.path.join(args.out, "torchao_bench.json"), "w") as f:
            json.dump({"copy_tbs": copy_tbs, "bitwise": checks, "results": results}, f, indent=1)
        path = plot(results, copy_tbs, os.path.join(args.out, "torchao_bench.png"))
        if path:
            print(f"wrote {path}")
    return 0 if all(v == 0 for c in checks.values() for v in c.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
