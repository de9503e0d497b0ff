"""Benchmark the Triton norm / quant kernels on a CUDA GPU (docs/design.md "Measuring").

For K in {2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192} (`KS`) and M in {1 .. 16384},
per call (CUDA graph of 64 back-to-back calls cycling through enough input sets to not sit
in L2, L2 flushed before each replay, median of 7 replays), all in ONE run:

- for every kernel variant (`tools/kernel_variants.py`, passed to the kernels as an
  explicit `NormConfig`) and `default` (no config: what the ops run, `norm_config(K, M)`):
  fused add-norm+quant and fused plain norm+quant, row-major and swizzled scales;
  unfused = the same variant's norm kernel then the quant kernel;
- baselines: Liger-Kernel's Gemma-mode norms ALONE (`fused_add_rms_norm_forward` /
  `rms_norm_forward`, offset 1.0, casting "gemma"; no quantization at all) and Liger's
  norm followed by the project's quant; `torch.compile` of the plain PyTorch reference
  (reference.gemma_fused_add_rmsnorm / gemma_rmsnorm + reference.quantize_rows);
- a large device-to-device copy (the bandwidth ceiling);
- baselines too: FlashInfer's norms alone (`flashinfer/norm.cuh`: GemmaRMSNorm /
  GemmaFusedAddRMSNorm and RMSNorm / FusedAddRMSNorm, built with torch's `load_inline` from the
  `flashinfer-python` wheel's headers; NaN where they cannot be built), and for the standard
  RMSNorm (offset 0, `round_normalized`, both scale layouts) Liger's Llama-mode norms alone;
- the latency floors at M <= 256 (an empty kernel, a one-row copy, a copy with one reduction).

Liger-Kernel and flashinfer-python are benchmark-only dependencies (the `bench` extra);
without them their columns are NaN. Effective TB/s = bytes that must move (x [+ residual in, residual out] + codes +
scales; bf16) / time. Prints markdown tables, last the ratio of the fastest peer norm alone (Liger,
FlashInfer; no quantization) to the fused op per K x M and form (Gemma / standard, +-residual,
row-major / swizzled); `--out DIR` writes kernels_bench.md, .json, .png and kernels_ratio.png (that
ratio). `--tables JSON` re-renders the tables of a saved run (any machine).

The whole grid fits one device call (~150 s on an H200): `--lean` (no unfused pair, no Liger +
quant), `--no-compiled`, `--variants default`, and `--warm-jobs N` compiles every kernel first in N
processes (Triton's on-disk cache, the FlashInfer extension), so that the timing process loads
instead of compiling some 500 kernels one after another. `--quick`: K 2048 / 4096 / 6144 x M 1, 16,
64, 256, 4096 for exploration; `--calls` / `--replays`: the graph's calls and the replays per point.

    PYTHONPATH=. python3 tools/bench_kernels.py [--out DIR] [--variant NAME] [--ms 1,64] [--ks 6144]
    PYTHONPATH=. python3 tools/bench_kernels.py --lean --no-compiled --variants default --warm-jobs 14 --out DIR
    PYTHONPATH=. python3 tools/bench_kernels.py --tables kernels_bench.json --variant native

The gated producers (`--gated`: a section after the norm tables; `--only-gated`: that section alone):
`sigmoid_gate_mxfp8` and `gated_rms_norm_mxfp8` (groups of 128) at K in `--gated-ks`, fused (both layouts)
against the unfused pair (the producer kernel, then the quant kernel), the producer kernel alone,
`torch.compile` of the plain PyTorch producer (what vLLM's Inductor generates for it) alone and with the
plain-PyTorch quant, and the copy; then the fused op (row-major) in the launch shapes of `gated_variants()`
beside the default's (same bits: tests/test_gpu_gated.py).

The act·mul (`--act-mul also`: after the norm tables; `--act-mul only`): the fused act·mul + MXFP8 of a bf16
gate_up `[M, 2I]` for each activation of `--act-activations` (SiLU at Llama-3.1-8B's and a Qwen3.5-27B-sized
I and their TP-4 / TP-8 shards; GELU-tanh at Gemma 3 27B / 12B / 4B's and the 27B's shards; SwiGLU-OAI, alpha 1.702
and limit 7, at MiniMax-M3.1-Flash's dense I and its shards; M in `--act-ms`),
row-major and swizzled (the default launch; "fused_join" / "fused_swz_join": the same tile with up's bits joined
into the gate's before any arithmetic at every point, `ActMulConfig.join_loads`, which the default sets only where
`join_loads_pays`), against the unfused pair, the activation alone (mxfuse's kernel), `torch.compile` of
vLLM's native form (SwiGLU-OAI: Hugging Face's eager formula on the halves, what the Transformers backend runs) alone
and with the quant, Liger-Kernel's `swiglu` / `geglu` alone and with the quant (none for SwiGLU-OAI), and the
copy; for SiLU also the launch shapes of `act_variants()` (`--act-variants NAMES`: those, for every activation).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch
import triton
import triton.language as tl
from kernel_variants import VARIANTS, variant, variant_of

from mxfuse.ops.mx_layout import padded_rows, padded_scale_columns, scale_columns
from mxfuse.ops.norm_quant_config import norm_config, quant_config
from mxfuse.timing import copy_bandwidth_tbs, n_input_sets, time_cuda_graph

KS = [2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192]
"""The hidden sizes of issue 31 (Qwen3-Next 2048 ... 8192); `--ks 6144,3072` for the models served."""
MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
EPS = 1e-6
DT = torch.bfloat16
KINDS = ("add", "plain")
DEFAULT = "default"  # the ops' own config choice (norm_config(K, M))


def needed_bytes(m, k, add, swizzled, elem=2):
    scales = padded_rows(m) * padded_scale_columns(k) if swizzled else m * scale_columns(k)
    return (3 if add else 1) * elem * m * k + m * k + scales


def tbs(nbytes, us):
    return nbytes / (us * 1e-6) / 1e12


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


def _mark(t, m):
    torch._dynamo.mark_static(t, 1)
    if m > 1:
        torch._dynamo.mark_dynamic(t, 0)  # one compile for all M > 1 per K (M = 1 specializes)
    return t


# ------------------------------------------------------------------ Liger-Kernel (benchmark-only)


def liger_norms():
    """`(add_norm(x, r, w), norm(x, w))` in Liger's Gemma mode, or None without liger-kernel."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
        from liger_kernel.ops.rms_norm import rms_norm_forward
    except ImportError:
        return None

    def add_norm(x, r, w):
        y, s = fused_add_rms_norm_forward(x, r, w, EPS, 1.0, "gemma")[:2]
        return y, s

    def norm(x, w):
        return rms_norm_forward(x, w, EPS, 1.0, "gemma", False)[0]

    return add_norm, norm


# ------------------------------------------------------------------ latency floors (decode sizes)


@triton.jit
def _empty_kernel(x_ptr):
    """Nothing: the launch floor of one kernel in the graph."""


@triton.jit
def _row_copy_kernel(x_ptr, y_ptr, K, BLOCK: tl.constexpr, REDUCE: tl.constexpr):
    """One program per row: load the row, store it (one round trip to memory); REDUCE: store
    the row times the reciprocal of its sum of squares (the round trip plus a block reduction)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    if REDUCE:
        v = v / tl.sum(v * v, axis=0)
    tl.store(y_ptr + row * K + cols, v.to(y_ptr.dtype.element_ty), mask=cols < K)


def latency_floors(t, k):
    """Time the floors at this (K, M) with `t(name, fn)`: an empty kernel, a row copy, a row copy
    with a block reduction (8 warps, the row in one program): what no norm at this size beats."""
    block = triton.next_power_of_2(k)

    def copy(x, reduce):
        y = torch.empty_like(x)
        _row_copy_kernel[(x.shape[0],)](x, y, k, BLOCK=block, REDUCE=reduce, num_warps=8)
        return y

    t("floor_empty", lambda x, r: _empty_kernel[(1,)](x))
    t("floor_copy", lambda x, r: copy(x, False))
    t("floor_reduce", lambda x, r: copy(x, True))


# ------------------------------------------------------------------ FlashInfer (benchmark-only)

FLASHINFER_SOURCE = r"""
#include <flashinfer/norm.cuh>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

using bf16 = __nv_bfloat16;

void gemma_rmsnorm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps) {
  auto err = flashinfer::norm::GemmaRMSNorm<bf16>(
      (bf16*)x.data_ptr(), (bf16*)w.data_ptr(), (bf16*)out.data_ptr(), x.size(0), x.size(1), x.stride(0),
      out.stride(0), eps, false, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
}

void gemma_fused_add_rmsnorm(torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps) {
  auto err = flashinfer::norm::GemmaFusedAddRMSNorm<bf16>(
      (bf16*)x.data_ptr(), (bf16*)r.data_ptr(), (bf16*)w.data_ptr(), x.size(0), x.size(1), x.stride(0),
      r.stride(0), eps, false, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
}

void rmsnorm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps) {
  auto err = flashinfer::norm::RMSNorm<bf16>(
      (bf16*)x.data_ptr(), (bf16*)w.data_ptr(), (bf16*)out.data_ptr(), x.size(0), x.size(1), x.stride(0),
      out.stride(0), eps, false, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
}

void fused_add_rmsnorm(torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps) {
  auto err = flashinfer::norm::FusedAddRMSNorm<bf16>(
      (bf16*)x.data_ptr(), (bf16*)r.data_ptr(), (bf16*)w.data_ptr(), x.size(0), x.size(1), x.stride(0),
      r.stride(0), eps, false, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
}
"""
FLASHINFER_FUNCTIONS = ("gemma_rmsnorm", "gemma_fused_add_rmsnorm", "rmsnorm", "fused_add_rmsnorm")
FLASHINFER_DEFINES_UNDONE = (
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
)


def flashinfer_include(explicit: str | None) -> str | None:
    """The FlashInfer headers: `explicit`, else those of the installed `flashinfer-python` wheel."""
    if explicit:
        return explicit
    try:
        import flashinfer
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(flashinfer.__file__), "data", "include")
    return path if os.path.isdir(path) else None


def _cublas_includes() -> list[str]:
    """Folders holding `cublasLt.h` in the NVIDIA wheels beside torch (FlashInfer's trtllm headers
    include it; a CUDA toolkit without cuBLAS headers lacks it)."""
    import glob

    import torch as t

    site = os.path.dirname(os.path.dirname(t.__file__))
    return sorted({os.path.dirname(p) for p in glob.glob(os.path.join(site, "nvidia", "*", "include", "cublasLt.h"))})


def flashinfer_norms(include: str | None, log=print):
    """`{"add", "plain", "std_add", "std_plain"}` of FlashInfer's norms (`flashinfer/norm.cuh`, bf16,
    in place as vLLM calls them; the plain norms write a new y): Gemma (`1 + w`) and the standard
    RMSNorm (`w`), `add(x, r, w)` / `plain(x, w)`, built with torch's `load_inline`, or None where
    they cannot be built (no headers, no compiler): their columns are then NaN."""
    if include is None:
        log("flashinfer: no headers (pass --flashinfer-include or install flashinfer-python): columns NaN")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        major, minor = torch.cuda.get_device_capability()
        mod = load_inline(
            "mxfuse_bench_flashinfer_norm",
            cpp_sources="void gemma_rmsnorm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps);\n"
            "void gemma_fused_add_rmsnorm(torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps);\n"
            "void rmsnorm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps);\n"
            "void fused_add_rmsnorm(torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps);",
            cuda_sources=FLASHINFER_SOURCE,
            functions=list(FLASHINFER_FUNCTIONS),
            extra_include_paths=[include, *_cublas_includes()],
            extra_cuda_cflags=[
                "-O3",
                f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",
                *FLASHINFER_DEFINES_UNDONE,
            ],
            verbose=False,
        )
    except Exception as e:  # a baseline that cannot be built is reported, never fatal
        log(f"flashinfer: build failed ({type(e).__name__}: {str(e)[-400:]}): columns NaN")
        return None

    def adder(fn):
        def add_norm(x, r, w):
            fn(x, r, w, EPS)
            return x, r

        return add_norm

    def plain(fn):
        def norm(x, w):
            out = torch.empty_like(x)
            fn(out, x, w, EPS)
            return out

        return norm

    return {
        "add": adder(mod.gemma_fused_add_rmsnorm),
        "plain": plain(mod.gemma_rmsnorm),
        "std_add": adder(mod.fused_add_rmsnorm),
        "std_plain": plain(mod.rmsnorm),
    }


def liger_llama_norms():
    """`(add_norm, norm)` of Liger's Llama-mode norms (offset 0.0: `w * (x.f32 * rstd).to(dtype)`,
    the standard RMSNorm of Hugging Face's LlamaRMSNorm), or None without liger-kernel."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
        from liger_kernel.ops.rms_norm import rms_norm_forward
    except ImportError:
        return None

    def add_norm(x, r, w):
        return fused_add_rms_norm_forward(x, r, w, EPS, 0.0, "llama")[:2]

    def norm(x, w):
        return rms_norm_forward(x, w, EPS, 0.0, "llama", False)[0]

    return add_norm, norm


# ------------------------------------------------------------------ one (K, M) point


TIMING = {"calls": 64, "replays": 7}
"""CUDA-graph calls per replay and replays per point (`--calls`, `--replays`: a grid that must fit one
device call takes fewer)."""


def make_sets(m, k, seed=0, n=None):
    per_set = 2 * 2 * m * k
    n = n or n_input_sets(per_set, TIMING["calls"])
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        (
            torch.randn(m, k, device="cuda", dtype=DT, generator=g),
            torch.randn(m, k, device="cuda", dtype=DT, generator=g),
        )
        for _ in range(n)
    ]


def bench_point(k, m, variants, compiled=None, flashinfer=None, log=print, lean=False, warm=False):
    """Times of every variant and baseline at one (K, M): {"K", "M", "sets", name: µs}.

    `compiled`: {"add": fn, "plain": fn} of `torch.compile`d references (None: skipped);
    `flashinfer`: `flashinfer_norms()` (None: its columns are NaN); `lean`: no unfused pair and
    no Liger + quant (the sweep that must fit one device call); `warm`: run every call once
    instead of timing it (fills Triton's cache: `--warm-jobs` processes do this in parallel).
    """
    from mxfuse.ops import triton_norm_quant as tnq

    w = (0.5 * torch.randn(k, device="cuda")).to(DT)
    sets = make_sets(m, k, seed=k + m, n=1 if warm else None)
    res = {"K": k, "M": m, "sets": len(sets)}

    def t(name, fn, inputs=sets):
        try:
            if warm:
                fn(*inputs[0])
                torch.cuda.synchronize()
            else:
                res[name] = time_cuda_graph(fn, inputs, calls=TIMING["calls"], replays=TIMING["replays"])
        except Exception as e:  # report and carry on: one failing variant must not lose the table
            log(f"  {name} K={k} M={m} FAILED: {type(e).__name__}: {e}")
            res[name] = float("nan")

    res["default_is"] = {  # the variants the ops' own dispatch equals at this (K, M)
        f"{part}_{kind}": variant_of(norm_config(k, m, plain_quant=part == "fused" and kind == "plain"), k)
        for part in ("fused", "unfused")
        for kind in KINDS
    }
    for vname in variants:
        # a DISPATCH variant follows the dispatch at this M (the fused plain norm has its own rule)
        cfg = None if vname == DEFAULT else variant(vname, k, m)
        cfg_plain = None if vname == DEFAULT else variant(vname, k, m, plain_quant=True)
        for swz in (False, True):
            sfx = "_swz" if swz else ""
            t(
                f"{vname}/fused_add{sfx}",
                lambda x, r, s=swz, c=cfg: tnq.fused_norm_quant(x, r, w, EPS, swizzled=s, config=c),
            )
            t(
                f"{vname}/fused_plain{sfx}",
                lambda x, r, s=swz, c=cfg_plain: tnq.fused_norm_quant(x, None, w, EPS, swizzled=s, config=c),
            )
            if lean:
                continue
            t(f"{vname}/unfused_add{sfx}",
              lambda x, r, s=swz, c=cfg: tnq.quantize(tnq.gemma_norm(x, r, w, EPS, config=c)[0], s))  # fmt: skip
            t(f"{vname}/unfused_plain{sfx}",
              lambda x, r, s=swz, c=cfg: tnq.quantize(tnq.gemma_norm(x, None, w, EPS, config=c)[0], s))  # fmt: skip
    for kind, res_of in (("add", lambda r: r), ("plain", lambda r: None)):  # the project's norm alone (writes y)
        t(f"norm_{kind}", lambda x, r, f=res_of: tnq.gemma_norm(x, f(r), w, EPS))
    liger = liger_norms()
    if liger is not None:
        add_norm, norm = liger
        t("liger_add", lambda x, r: add_norm(x, r, w))
        t("liger_plain", lambda x, r: norm(x, w))
        if not lean:
            t("liger_add+quant", lambda x, r: tnq.quantize(add_norm(x, r, w)[0], False))
            t("liger_plain+quant", lambda x, r: tnq.quantize(norm(x, w), False))
    # the standard RMSNorm (weight offset 0, the normalized value rounded first: Llama's order)
    w_std = (w.float() + 1.0).to(DT)
    if flashinfer is not None:
        t("flashinfer_add", lambda x, r: flashinfer["add"](x, r, w))
        t("flashinfer_plain", lambda x, r: flashinfer["plain"](x, w))
        t("flashinfer_std_add", lambda x, r: flashinfer["std_add"](x, r, w_std))
        t("flashinfer_std_plain", lambda x, r: flashinfer["std_plain"](x, w_std))
    if m <= 256:
        latency_floors(t, k)
    std = dict(weight_offset=0.0, round_normalized=True)
    for swz in (False, True):
        sfx = "_swz" if swz else ""
        t(f"std/fused_add{sfx}", lambda x, r, s=swz: tnq.fused_norm_quant(x, r, w_std, EPS, swizzled=s, **std))
        t(f"std/fused_plain{sfx}", lambda x, r, s=swz: tnq.fused_norm_quant(x, None, w_std, EPS, swizzled=s, **std))
    llama = liger_llama_norms()
    if llama is not None:
        l_add, l_norm = llama
        t("liger_llama_add", lambda x, r: l_add(x, r, w_std))
        t("liger_llama_plain", lambda x, r: l_norm(x, w_std))
    if compiled and not warm:
        csets = [(_mark(x, m), _mark(r, m)) for x, r in sets]
        t("compiled_add", lambda x, r: compiled["add"](x, r, w), csets)
        t("compiled_plain", lambda x, r: compiled["plain"](x, w), csets)
    del sets
    return res


def _warm_task(task):
    """One `--warm-jobs` task in a worker process: ("flashinfer", include) builds the extension,
    ("point", K, M, variants) runs every call of that point once. Returns its seconds."""
    t0 = time.time()
    if task[0] == "flashinfer":
        flashinfer_norms(task[1], log=lambda *a: None)
    else:
        _, k, m, variants = task
        bench_point(k, m, variants, warm=True, log=lambda *a: None)
    return time.time() - t0


def warm_cache(points, variants, include, jobs, log=print):
    """Compile every kernel the timed points launch in `jobs` processes (Triton's on-disk cache,
    torch's extension cache), so that the timed run loads instead of compiling: the whole grid's
    few hundred compiles would otherwise run one after another in the timing process."""
    import multiprocessing

    t0 = time.time()
    tasks = [("flashinfer", include)] if include else []
    tasks += [("point", k, m, variants) for k, m in points]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        busy = sum(pool.map(_warm_task, tasks, chunksize=1))
    log(f"warm-up: {len(tasks)} tasks in {jobs} processes, {time.time() - t0:.0f} s ({busy:.0f} s of work)")


# ------------------------------------------------------------------ report


def _g(r, key):
    v = r.get(key)
    return float("nan") if v is None else v


def tables(results, copy_tbs, vname):
    """The README table for variant `vname`: fused vs Liger and FlashInfer alone, unfused, compiled,
    copy; then the standard norm (offset 0, round_normalized) vs Liger's Llama mode alone."""
    out = []
    for kind, title, liger_title in (
        ("add", "fused add-norm + MXFP8 quant", "Liger fused_add_rms_norm (Gemma) alone"),
        ("plain", "plain norm + MXFP8 quant", "Liger rms_norm (Gemma) alone"),
    ):
        out.append(
            f"\n### {title}, variant `{vname}` (bf16 in; µs per call; TB/s = bytes that must move / time; "
            f"copy = {copy_tbs:.2f} TB/s; Liger = {liger_title}; FlashInfer = its Gemma norm alone)\n"
        )
        out.append(
            "| K | M | fused µs | TB/s | % of copy | Liger alone µs | Liger / fused | FlashInfer alone µs "
            "| FlashInfer / fused | Liger + quant µs | (Liger+quant) / fused | unfused µs | unfused / fused "
            "| compiled µs | compiled / fused | fused swz µs | swz TB/s | Liger / swz |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            k, m = r["K"], r["M"]
            f, fs = _g(r, f"{vname}/fused_{kind}"), _g(r, f"{vname}/fused_{kind}_swz")
            u, c = _g(r, f"{vname}/unfused_{kind}"), _g(r, f"compiled_{kind}")
            lg, lq, fi = _g(r, f"liger_{kind}"), _g(r, f"liger_{kind}+quant"), _g(r, f"flashinfer_{kind}")
            tb = tbs(needed_bytes(m, k, kind == "add", False), f)
            tbz = tbs(needed_bytes(m, k, kind == "add", True), fs)
            out.append(
                f"| {k} | {m} | {f:.2f} | {tb:.2f} | {100 * tb / copy_tbs:.0f}% | {lg:.2f} | {lg / f:.2f}x "
                f"| {fi:.2f} | {fi / f:.2f}x | {lq:.2f} | {lq / f:.2f}x | {u:.2f} | {u / f:.2f}x | {c:.2f} "
                f"| {c / f:.2f}x | {fs:.2f} | {tbz:.2f} | {lg / fs:.2f}x |"
            )
    out.append(
        "\n### standard RMSNorm (weight offset 0, normalized value rounded first) + MXFP8 quant, row-major; "
        "Liger = its Llama mode alone (µs per call)\n"
    )
    out.append(
        "| K | M | fused add µs | Liger add µs | Liger / fused | fused plain µs | Liger plain µs | Liger / fused |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for r in results:
        fa, la, fp, lp = (_g(r, key) for key in ("std/fused_add", "liger_llama_add", "std/fused_plain",
                                                 "liger_llama_plain"))  # fmt: skip
        out.append(
            f"| {r['K']} | {r['M']} | {fa:.2f} | {la:.2f} | {la / fa:.2f}x | {fp:.2f} | {lp:.2f} | {lp / fp:.2f}x |"
        )
    return "\n".join(out)


def variant_table(results, variants):
    """µs of every variant's fused kernels, next to Liger alone (same run)."""
    cols = [(v, kind, swz) for kind in KINDS for swz in ("", "_swz") for v in variants]
    out = ["\n### variants: fused kernels, µs per call (Liger's and the project's norms alone for reference)\n"]
    head = " | ".join(f"{v} {kind}{swz}" for v, kind, swz in cols)
    base_keys = ("liger_add", "liger_plain", "flashinfer_add", "flashinfer_plain", "norm_add", "norm_plain")
    out.append(
        "| K | M | Liger add | Liger plain | FlashInfer add | FlashInfer plain | our norm alone add "
        f"| our norm alone plain | {head} |"
    )
    out.append("|---|---|---|---|---|---|---|---|" + "---|" * len(cols))
    for r in results:
        cells = " | ".join(f"{_g(r, f'{v}/fused_{kind}{swz}'):.2f}" for v, kind, swz in cols)
        base = " | ".join(f"{_g(r, key):.2f}" for key in base_keys)
        out.append(f"| {r['K']} | {r['M']} | {base} | {cells} |")
    return "\n".join(out)


def plot(results, copy_tbs, vname, path, device="GPU"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot written")
        return None
    ks = sorted({r["K"] for r in results}, reverse=True)
    fig, axes = plt.subplots(2, len(ks), figsize=(6.5 * len(ks), 8.5), squeeze=False)
    for col, k in enumerate(ks):
        rs = [r for r in results if r["K"] == k]
        ms = [r["M"] for r in rs]
        for row, kind in enumerate(KINDS):
            ax = axes[row][col]
            add = kind == "add"
            nb = [needed_bytes(r["M"], k, add, False) for r in rs]
            for key, label in (
                (f"{vname}/fused_{kind}", f"fused {kind}-norm+quant ({vname})"),
                (f"liger_{kind}", "Liger norm alone (no quant)"),
                (f"liger_{kind}+quant", "Liger norm + quant"),
                (f"{vname}/unfused_{kind}", "Triton norm + Triton quant"),
                (f"compiled_{kind}", "torch.compile(reference)"),
            ):
                ax.plot(ms, [tbs(b, _g(r, key)) for b, r in zip(nb, rs)], marker="o", label=label)
            ax.axhline(copy_tbs, color="gray", linestyle=":", label=f"copy {copy_tbs:.2f} TB/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (rows)")
            ax.set_ylabel("TB/s (fused kernel's bytes / time)")
            ax.set_title(f"{kind} norm, K = {k}, bf16, {device}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def as_current_default(data):
    """`data` with the `default/...` entries of each row taken from the measured variant
    that today's `norm_config(K, M, plain_quant=...)` equals (the run's own `default/...` kept as
    `run-default/...`): a saved run re-read after the dispatch changed, same-run numbers."""
    out = {**data, "results": []}
    for r in data["results"]:
        r = dict(r)
        k, m = r["K"], r["M"]
        names = {kind: variant_of(norm_config(k, m, plain_quant=kind == "plain"), k) for kind in KINDS}
        norm_name = variant_of(norm_config(k, m), k)  # the unfused norm's own dispatch
        for key in [key for key in r if key.startswith(f"{DEFAULT}/")]:
            r["run-" + key] = r.pop(key)
        run_names = r.get("default_is") or {}  # what the run's own `default` was (recorded since run 6)
        for kind in KINDS:
            if names[kind] is None or norm_name is None:
                raise ValueError(f"K={k} M={m}: the default config is none of the named variants")
            for part, name in (("fused", names[kind]), ("unfused", norm_name)):
                for sfx in ("", "_swz"):
                    key = f"{part}_{kind}{sfx}"
                    measured = r.get(f"{name}/{key}")
                    if measured is None and run_names.get(f"{part}_{kind}") == name:  # the run timed it as `default`
                        measured = r.get(f"run-{DEFAULT}/{key}")
                    r[f"{DEFAULT}/{key}"] = measured
        r["default_is"] = {f"{part}_{kind}": names[kind] if part == "fused" else norm_name
                           for part in ("fused", "unfused") for kind in KINDS}  # fmt: skip
        out["results"].append(r)
    return out


FAMILIES = {
    "gemma": ("default/fused_{kind}{sfx}", ("liger_{kind}", "flashinfer_{kind}")),
    "standard": ("std/fused_{kind}{sfx}", ("liger_llama_{kind}", "flashinfer_std_{kind}")),
}
"""family: (the fused op's key, the peers' norms alone): Gemma (`1 + w`: Liger's Gemma mode, FlashInfer's
Gemma norms) and the standard RMSNorm (`w`, normalized value rounded first: Liger's Llama mode, FlashInfer's
RMSNorm / FusedAddRMSNorm)."""
COMBOS = [(fam, kind, sfx) for fam in FAMILIES for kind in KINDS for sfx in ("", "_swz")]


def best_alone_ratio(r, fam, kind, sfx):
    """(best norm alone µs, its name, best / fused): the faster of the family's peers, no quantization."""
    fused_key, peers = FAMILIES[fam]
    times = {p.format(kind=kind): _g(r, p.format(kind=kind)) for p in peers}
    times = {n: v for n, v in times.items() if v == v}  # NaN: not built / not installed
    if not times:
        return float("nan"), "-", float("nan")
    name = min(times, key=times.get)
    return times[name], name, times[name] / _g(r, fused_key.format(kind=kind, sfx=sfx))


def ratio_tables(results):
    """Best norm alone / fused (> 1: the fused norm + MXFP8 is faster than the fastest peer norm doing no
    quantization) per K x M: the worst of the 8 forms first, then each form (family, +-residual, layout)."""
    ms = sorted({r["M"] for r in results})
    ks = sorted({r["K"] for r in results})
    at = {(r["K"], r["M"]): r for r in results}
    head = "| K | " + " | ".join(f"M {m}" for m in ms) + " |"
    rule = "|---|" + "---:|" * len(ms)
    out = [
        "\n### best norm alone / fused norm + MXFP8, the worst of the 8 forms (Gemma and standard, add and plain, "
        "row-major and swizzled; > 1: fused faster)\n",
        head,
        rule,
    ]
    for k in ks:
        cells = []
        for m in ms:
            r = at.get((k, m))
            vals = [best_alone_ratio(r, *c)[2] for c in COMBOS] if r else []
            vals = [v for v in vals if v == v]
            if not vals:
                cells.append("-")
                continue
            worst = min(range(len(vals)), key=vals.__getitem__)
            fam, kind, sfx = COMBOS[worst]
            cells.append(f"{vals[worst]:.2f} ({fam[0]}{'+' if kind == 'add' else ''}{' swz' if sfx else ''})")
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    out.append("\n(form: g = Gemma, s = standard; + = with the residual; swz = swizzled scales)")
    for fam in FAMILIES:
        for kind in KINDS:
            out += [f"\n#### {fam}, {kind}: best norm alone / fused (row-major, swizzled)\n", head, rule]
            for k in ks:
                cells = []
                for m in ms:
                    r = at.get((k, m))
                    if r is None:
                        cells.append("-")
                        continue
                    row, swz = (best_alone_ratio(r, fam, kind, sfx)[2] for sfx in ("", "_swz"))
                    cells.append(f"{row:.2f} / {swz:.2f}")
                out.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ratio_plot(results, path, device="GPU"):
    """Best norm alone / fused against M, one panel per (family, residual), a line per K (row-major
    solid, swizzled dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), squeeze=False)
    ks = sorted({r["K"] for r in results})
    colors = plt.get_cmap("viridis")
    for i, fam in enumerate(FAMILIES):
        for j, kind in enumerate(KINDS):
            ax = axes[i][j]
            for n, k in enumerate(ks):
                rs = sorted((r for r in results if r["K"] == k), key=lambda r: r["M"])
                for sfx, style in (("", "-"), ("_swz", "--")):
                    ax.plot([r["M"] for r in rs], [best_alone_ratio(r, fam, kind, sfx)[2] for r in rs], style,
                            marker="o", ms=3, color=colors(n / max(1, len(ks) - 1)),
                            label=f"K {k}" if not sfx else None)  # fmt: skip
            ax.axhline(1.0, color="gray", linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (rows)")
            ax.set_ylabel("best norm alone / fused (> 1: fused faster)")
            ax.set_title(f"{fam} RMSNorm, {'add' if kind == 'add' else 'plain'} (dashed: swizzled scales)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"fused norm + MXFP8 vs the fastest peer norm alone (Liger-Kernel, FlashInfer), bf16, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def floor_table(results):
    """Decode-size floors (same run): an empty kernel, one row copy, a row copy with a reduction,
    next to our norm alone, our fused op and Liger alone (µs per call)."""
    out = ["\n### latency floors at decode sizes (µs per call)\n"]
    keys = ("floor_empty", "floor_copy", "floor_reduce", "norm_add", "default/fused_add", "liger_add",
            "norm_plain", "default/fused_plain", "liger_plain")  # fmt: skip
    out.append("| K | M | " + " | ".join(keys) + " |")
    out.append("|---|---|" + "---|" * len(keys))
    for r in results:
        if "floor_empty" in r:
            out.append(f"| {r['K']} | {r['M']} | " + " | ".join(f"{_g(r, key):.2f}" for key in keys) + " |")
    return "\n".join(out)


def render(data, vname):
    variants = data["variants"]
    return (
        data["head"]
        + f"\n\ncopy bandwidth (same run): {data['copy_tbs']:.3f} TB/s\n"
        + tables(data["results"], data["copy_tbs"], vname)
        + "\n"
        + variant_table(data["results"], variants)
        + "\n"
        + floor_table(data["results"])
        + "\n"
        + ratio_tables(data["results"])
    )


def save(out, data, vname):
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernels_bench.md"), "w") as f:
        f.write(render(data, vname) + "\n")
    with open(os.path.join(out, "kernels_bench.json"), "w") as f:
        json.dump(data, f, indent=1)
    device = data.get("device", "GPU").removeprefix("NVIDIA ")  # the plots' titles
    p = plot(data["results"], data["copy_tbs"], vname, os.path.join(out, "kernels_bench.png"), device)
    q = ratio_plot(data["results"], os.path.join(out, "kernels_ratio.png"), device)
    for path in (p, q):
        if path:
            print(f"wrote {path}")


# ------------------------------------------------------------------ the gated producers (issue 30)

GATED_KS = [8192, 6144, 4096, 2048, 1024, 512]
"""Rows of the gated producers (o_proj / out_proj inputs): 64, 48 and 32 value heads of 128 (32 is Qwen3-Next-80B,
whose gated attention is 16 heads of 256: 4096 too; 48 is the Qwen3.5 configuration's default), and the shards of
4096 / 8192 down to TP 8 (512 / 1024)."""
GATED_GROUP = 128  # the GDN value head dim


def _gated_refs():
    """Plain PyTorch (the references of mxfuse/ops/gated.py) for `torch.compile`: the producer alone (what
    Inductor generates for vLLM's native form) and the producer + the plain-PyTorch quant (Inductor's fusion)."""
    from mxfuse.ops import gated, reference

    def gate(x, g):
        return gated.sigmoid_gate_rows(x, g)

    def gate_quant(x, g):
        return reference.quantize_rows(gated.sigmoid_gate_rows(x, g))

    def norm(x, z, w):
        return gated.gated_rms_norm_rows(x, z, w, EPS, GATED_GROUP)

    def norm_quant(x, z, w):
        return reference.quantize_rows(gated.gated_rms_norm_rows(x, z, w, EPS, GATED_GROUP))

    return {name: torch.compile(fn, dynamic=True) for name, fn in
            dict(gate=gate, gate_quant=gate_quant, norm=norm, norm_quant=norm_quant).items()}  # fmt: skip


def time_same_size_copy(t, res, nbytes: int, n: int) -> None:
    """res["copy"]: µs of a device-to-device copy moving `nbytes` (half read, half written; the faster of an SM
    kernel and a memcpy node, as `copy_bandwidth_tbs`), the floor of a launch of this size in the same graph.
    `t(name, fn, inputs)` times and stores."""
    half = nbytes // 4  # bf16 elements: half the bytes read, half written
    copies = [(torch.ones(half, device="cuda", dtype=DT),) for _ in range(n)]
    copy_dst = torch.empty(half, device="cuda", dtype=DT)
    t("copy_sm", lambda src: torch.neg(src, out=copy_dst), copies)  # a kernel on the SMs
    t("copy_ce", lambda src: copy_dst.copy_(src), copies)  # a memcpy node (may run on a copy engine)
    res["copy"] = min(res["copy_sm"], res["copy_ce"])


def bench_gated_point(k, m, compiled=None, log=print):
    """µs of the gated ops at one (K, M): fused (row-major / swizzled), the unfused pair (producer kernel then
    the quant kernel), the producer kernel alone, `torch.compile` of the plain PyTorch producer alone and with
    the plain quant (None: skipped)."""
    ops = torch.ops.mxfuse
    sets = make_sets(m, k, seed=k + m + 1)
    w = (1 + 0.1 * torch.randn(GATED_GROUP, device="cuda")).to(DT)
    res = {"K": k, "M": m, "sets": len(sets)}

    def t(name, fn, inputs=sets):
        try:
            res[name] = time_cuda_graph(fn, inputs)
        except Exception as e:  # one failing row must not lose the table
            log(f"  {name} K={k} M={m} FAILED: {type(e).__name__}: {e}")
            res[name] = float("nan")

    t("gate_fused", lambda x, g: ops.sigmoid_gate_mxfp8(x, g))
    t("gate_fused_swz", lambda x, g: ops.sigmoid_gate_mxfp8(x, g, True))
    t("gate_unfused", lambda x, g: ops.mxfp8_quantize(ops.sigmoid_gate(x, g)))
    t("gate_alone", lambda x, g: ops.sigmoid_gate(x, g))
    t("norm_fused", lambda x, z: ops.gated_rms_norm_mxfp8(x, z, w, EPS, GATED_GROUP))
    t("norm_fused_swz", lambda x, z: ops.gated_rms_norm_mxfp8(x, z, w, EPS, GATED_GROUP, True))
    t("norm_unfused", lambda x, z: ops.mxfp8_quantize(ops.gated_rms_norm(x, z, w, EPS, GATED_GROUP)))
    t("norm_alone", lambda x, z: ops.gated_rms_norm(x, z, w, EPS, GATED_GROUP))
    from mxfuse.ops import triton_gated_quant as tg  # the default in the other grid order (groups / row tiles first)
    from mxfuse.ops.triton_targets import sm_count

    dev = torch.device("cuda")
    norm_default = tg.gated_norm_config(GATED_GROUP, m, k, sm_count(dev))  # this GPU's, at this (M, K)
    flipped = norm_default._replace(groups_first=not norm_default.groups_first)
    t("norm_fused_other_grid", lambda x, z: tg.gated_rms_norm(x, z, w, EPS, GATED_GROUP, quant=True, config=flipped))
    gate_variants, norm_variants = gated_variants()
    res["gate_default_cfg"] = list(_gate_default(k, m)[:3])
    for name, pick in gate_variants.items():
        cfg = pick(k, m)
        res[f"gate_cfg:{name}"] = list(cfg)
        t(f"gate_v:{name}", lambda x, g, c=cfg: tg.sigmoid_gate(x, g, quant=True, config=c))
    res["norm_default_cfg"] = list(norm_default[:2])
    for name, pick in norm_variants.items():
        cfg = pick(GATED_GROUP)
        res[f"norm_cfg:{name}"] = list(cfg)
        t(f"norm_v:{name}", lambda x, z, c=cfg: tg.gated_rms_norm(x, z, w, EPS, GATED_GROUP, quant=True, config=c))
    if compiled is not None:
        t("gate_compiled", compiled["gate"])
        t("gate_quant_compiled", compiled["gate_quant"])
        t("norm_compiled", lambda x, z: compiled["norm"](x, z, w))
        t("norm_quant_compiled", lambda x, z: compiled["norm_quant"](x, z, w))
    time_same_size_copy(t, res, producer_bytes(m, k), len(sets))
    return res


def gated_table(results, copy_tbs) -> str:
    """One markdown table per producer: µs, TB/s of the fused op (5.03·M·K bytes: two bf16 inputs read, codes
    and scales written), its share of the copy, and the ratios to the unfused pair and the peers."""
    lines = []
    for prod in ("gate", "norm"):
        title = "x * sigmoid(gate)" if prod == "gate" else f"gated RMSNorm (groups of {GATED_GROUP}, silu)"
        lines += [
            f"\n### {title} -> MXFP8 (bf16; fused vs. the unfused pair, the producer alone, torch.compile)\n",
            "| K | M | fused µs | swizzled µs | TB/s | % copy | unfused pair µs | pair / fused | producer alone µs |"
            " compiled producer µs | compiled producer+quant µs | alone / fused | same-size copy µs |"
            " copy / fused |" + (" other grid order µs |" if prod == "norm" else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if prod == "norm" else ""),
        ]
        for r in results:
            fused = r[f"{prod}_fused"]
            nbytes = producer_bytes(r["M"], r["K"])
            rate = tbs(nbytes, fused)
            lines.append(
                f"| {r['K']} | {r['M']} | {fused:.2f} | {r[f'{prod}_fused_swz']:.2f} | {rate:.2f} | "
                f"{100 * rate / copy_tbs:.0f}% | {r[f'{prod}_unfused']:.2f} | {r[f'{prod}_unfused'] / fused:.2f}x | "
                f"{r[f'{prod}_alone']:.2f} | {r.get(f'{prod}_compiled', float('nan')):.2f} | "
                f"{r.get(f'{prod}_quant_compiled', float('nan')):.2f} | {r[f'{prod}_alone'] / fused:.2f} | "
                f"{r.get('copy', float('nan')):.2f} | {r.get('copy', float('nan')) / fused:.2f} |"
                + (f" {r['norm_fused_other_grid']:.2f} |" if prod == "norm" else "")
            )
    return "\n".join(lines)


def _gate_default(k: int, m: int):
    """`gate_config` of this GPU (the nominal one where there is none: tools/compile_targets.py)."""
    from mxfuse.ops import triton_gated_quant as tg
    from mxfuse.ops.triton_targets import device_isa, dram_bytes_per_s, sm_count

    dev = torch.device("cuda")
    on_gpu = (sm_count(dev), dram_bytes_per_s(dev), device_isa(dev)) if torch.cuda.is_available() else ()
    return tg.gate_config(k, m, *on_gpu)


def gated_variants():
    """Launch shapes of the fused gated ops timed beside the default (`config=`; the same bits), each compiling without
    a spill on every target of tools/compile_targets.py: the gate as f(K, M), the norm as f(G) (batch
    invariance). Default on sm_90 (Triton 3.6, K 4096): the gate's (2, 1024) tile on 8 warps, 8 values a thread, 32
    registers, where `gate_config` takes 8, else (4, 1024), 16 a thread, 47 registers (5 programs an SM); the norm's
    32 x 128 on 8 warps, 16 values and 16 codes a thread, the load barrier, groups first, 57 registers (4 programs;
    run 16). "quant-tile": the gate in the quant kernel's tile at every M (16 a thread; the default before run 15);
    "v8": 8 a thread at every M; "v8w16": 8 a thread on 16 warps; "v32w4": 32 a thread on 4 warps (66 registers, 11%
    fewer instructions a value). The norm: "nofence": without the load barrier (40 registers, z loaded after x's
    reduction); "cv8": 8 codes a thread (9% more instructions); "v8": 8 values a thread (16 rows; 22% more
    instructions a value, 8 programs an SM), also row tiles first; the default in the other grid order is the gated
    section's own column. Run 16 (H100) timed these and "v32" (32 values a thread: 80 registers, slower everywhere;
    run 17: "regs48", capped at 48 registers for 5 programs an SM, no faster and a spill on sm_100). Run 18, for
    decode sizes: the gate one row a program ("row1024": 1024 columns on 4 warps, "row256": 256 on 1 warp, 8 a
    thread; "row128v4": 128 on 1 warp, 4 a thread), the norm one row on 1 warp ("bm1", 4 a thread) and 4 rows on 2
    ("bm4", 8 a thread). Run 22: 2 values a thread at decode sizes, "row128v2" (the gate's 128 columns on 2 warps)
    and "bm1w2" (the norm's row on 2 warps); run 23: 1 value a thread, "row128v1" and "bm1w4" (on 4 warps)."""
    from mxfuse.ops import triton_gated_quant as tg

    def gate_tile(values: int, warps: int, **fields):
        """The quant tile's columns (the default's beyond decode sizes), rows up to `values` a thread on `warps`
        warps (fewer at small M)."""

        def pick(k, m):
            bc = quant_config(k, m).block_cols  # not gate_config's: its decode tile would narrow every variant
            bm = max(1, min(triton.next_power_of_2(max(1, m)), values * 32 * warps // bc))
            return tg.GateConfig(bm, bc, max(1, min(warps, bm * bc // (32 * values))), **fields)

        return pick

    def quant_tile(k, m):
        q = quant_config(k, m)
        return tg.GateConfig(q.block_rows, q.block_cols, q.num_warps)

    def norm_rows(share: int, warps_factor: int = 1, rows: int = 1, **fields):
        """The default with its rows x `rows` / `share` (at least 1), its warps x `warps_factor` (at most 16) and
        `fields` changed."""

        def pick(group):
            d = tg.gated_norm_config(group)
            bm = max(1, d.block_rows * rows // share)
            return d._replace(block_rows=bm, num_warps=min(16, d.num_warps * warps_factor), **fields)

        return pick

    def one_row(cols: int, values: int):
        """Decode sizes: one row a program, `cols` columns (at most the quant tile's), `values` a thread."""

        def pick(k, m):
            bc = min(cols, quant_config(k, m).block_cols)
            return tg.GateConfig(1, bc, max(1, bc // (32 * values)), code_vector=8 if values < 16 else 16)

        return pick

    def capped(registers: int):
        """This GPU's default tile with a register cap (run 25: above ptxas's own choice it issues both loads of
        a thread's rows before the arithmetic; 40 spills in the 16-values tile on sm_100)."""
        return lambda k, m: _gate_default(k, m)._replace(max_registers=registers)

    gate = {"quant-tile": quant_tile, "v8": gate_tile(8, 8), "v8w16": gate_tile(8, 16), "v32w4": gate_tile(32, 4),
            "row1024": one_row(1024, 8), "row256": one_row(256, 8), "row128v4": one_row(128, 4),
            "row128v2": one_row(128, 2), "row128v1": one_row(128, 1), "regs48": capped(48)}  # fmt: skip

    def norm_tile(rows: int, warps: int):
        """Decode sizes: `rows` rows a program on `warps` warps, 8 codes a thread."""
        return lambda group: tg.gated_norm_config(group)._replace(block_rows=rows, num_warps=warps, code_vector=8)

    norm = {
        "bm1": norm_tile(1, 1),
        "bm4": norm_tile(4, 2),
        "bm1w2": norm_tile(1, 2),
        "bm1w4": norm_tile(1, 4),
        "nofence": norm_rows(1, load_fence=False),
        "cv8": norm_rows(1, code_vector=8),
        "v8": norm_rows(2, code_vector=8),
        "rows-first v8": norm_rows(2, code_vector=8, groups_first=False),
    }
    return gate, norm


def gated_variant_table(results, copy_tbs) -> str:
    """Markdown per producer: the fused op (row-major) in the default launch shape and each variant's, µs; the
    best one's % of the copy."""
    lines = []
    for prod in ("gate", "norm"):
        names = [n for n in results[0] if n.startswith(f"{prod}_v:")] if results else []
        cols = ["K", "M", f"default {prod} shape", "default", *(n.split(":", 1)[1] for n in names), "best % copy"]
        lines += [f"\n### {prod}: launch shapes (fused, row-major, µs per call)\n", "| " + " | ".join(cols) + " |",
                  "|" + "---|" * len(cols)]  # fmt: skip
        for r in results:
            nbytes = producer_bytes(r["M"], r["K"])
            best = min(r[f"{prod}_fused"], *(r[n] for n in names))
            cells = [r["K"], r["M"], tuple(r[f"{prod}_default_cfg"]), f"{r[f'{prod}_fused']:.2f}"]
            cells += [f"{r[n]:.2f}" for n in names] + [f"{100 * tbs(nbytes, best) / copy_tbs:.0f}%"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def gated_section(ks, ms, copy_tbs, compiled: bool = True, log=print) -> tuple[list, str]:
    refs = _gated_refs() if compiled else None
    results = []
    for k in ks:
        for m in ms:
            r = bench_gated_point(k, m, refs, log)
            log(json.dumps(r))
            results.append(r)
    return results, gated_table(results, copy_tbs) + "\n" + gated_variant_table(results, copy_tbs)


# ----------------------------------------------------------------- act·mul (a section of its own)

ACT_IS = [14336, 17408, 3584, 4352, 1792, 2176, 1536]  # Llama-3.1-8B, Qwen3.5-27B-sized, their TP 4 / 8 shards
GELU_IS = [21504, 15360, 10240, 5376, 2688]  # Gemma 3 27B / 12B / 4B, the 27B's TP 4 / 8 shards
OAI_IS = [16384, 4096, 2048]  # MiniMax-M3.1-Flash's dense MLP (mxfuse/models.py), its TP 4 / 8 shards
ACTIVATIONS = {"silu": ("SiLU", ACT_IS), "gelu_tanh": ("GELU-tanh", GELU_IS), "swiglu_oai": ("SwiGLU-OAI", OAI_IS)}
ACT_MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
ACT_COLUMNS = (
    "fused",
    "fused_swz",
    "fused_join",
    "fused_swz_join",
    "unfused",
    "act",
    "compiled",
    "compiled+quant",
    "liger",
    "liger+quant",
    "copy",
)


def producer_bytes(m: int, k: int) -> int:
    """Bytes a fused two-input producer (act·mul, gate, gated norm) moves, row-major: both bf16 `[M, K]` inputs
    read, codes and scales written (5.03·M·K)."""
    return 2 * m * 2 * k + m * k + m * scale_columns(k)


def _run12_act_config(m, i, sm, l2_bytes=50 * 2**20):
    """The dispatch of runs 12-13 (before 2026-12-05): 2048-value tiles halved at decode sizes, 8 values a
    thread once halved (one warp per 256 values), whatever M * I."""
    from mxfuse.ops.triton_act_quant import ActMulConfig, block_cols

    bc = block_cols(i)
    bm = max(1, 2048 // bc)
    while -(-m // bm) * -(-i // bc) < 2 * sm and (bm > 1 or bc > 128):
        bm, bc = (bm // 2, bc) if bm > 1 else (bm, bc // 2)
    warps = max(1, min(4, bm * bc // 256))
    wide = bc <= 512 and bm * bc >= 16 * 32 * warps and m * i <= l2_bytes // 2
    return ActMulConfig(bm, bc, warps, True, code_vector=16 if wide else 8)


def act_variants():
    """Launch shapes of the fused op timed beside the default (`ActMulConfig`s through `config=`; same bits):
    the dispatch with one input changed (a slow / fast memory, 8 values a thread at small M, no halving of
    the tile at decode sizes; 2 values a thread at decode sizes, run 22; one row a program on 4 or 8 warps up to M
    256, run 24) and earlier dispatches."""
    from mxfuse.ops.triton_act_quant import ActMulConfig, act_mul_config

    def with_device(**changes):
        def pick(m, i, sm):
            return act_mul_config(m, i, sm, **{"l2_bytes": _l2(), "dram_bytes_per_s": _dram(), **changes})

        return pick

    def changed(pick, **fields):
        return lambda m, i, sm: pick(m, i, sm)._replace(**fields)

    def one_warp_row(cols):  # decode sizes: one warp a program, `cols` columns of one row (16 or 8 a thread)
        default = with_device()
        return lambda m, i, sm: ActMulConfig(1, cols, 1, True) if m <= 64 else default(m, i, sm)

    def row_of(max_cols):  # up to M 256: one row a program, up to `max_cols` of its columns, 8 values a thread
        default = with_device()

        def pick(m, i, sm):
            cols = min(max_cols, triton.next_power_of_2(i))
            return ActMulConfig(1, cols, max(1, cols // 256), True) if m <= 256 else default(m, i, sm)

        return pick

    def wide_512(m, i, sm):  # 16 values and 16 codes a thread on 512 columns, where 512 divides I
        default = with_device()(m, i, sm)
        return ActMulConfig(4, 512, 4, True, code_vector=16) if m >= 1024 and i % 512 == 0 else default

    return {
        "run12": _run12_act_config,
        "mem-slow": with_device(dram_bytes_per_s=1e9),  # 8 values a thread at large M (16 in the tail window)
        "mem-slow-join": changed(with_device(dram_bytes_per_s=1e9), join_loads=True),  # the one-row tile, joined
        "mem-fast": with_device(dram_bytes_per_s=1e15),  # 16 values a thread at large M
        # run 26: ... with 16 contiguous codes a thread (one SHFL level, fewer instructions a value) at any L2 share
        "mem-fast-wide": changed(with_device(dram_bytes_per_s=1e15), code_vector=16),
        "w512x16": wide_512,  # ... and on 512-column tiles from M 1024 (the 16-codes tile where I's own tile is wider)
        "v8": with_device(small_values=(8,)),
        "v2": with_device(small_values=(2, 4, 8)),  # 2 values a thread while the launch fits at 2: decode sizes
        "v1": with_device(small_values=(1, 2, 4, 8)),  # 1 value a thread (128 columns on 4 warps) while it fits
        "nohalve": with_device(min_programs_per_sm=0),
        "w8": with_device(tile_values=2048, max_warps=8),
        "regs32": changed(with_device(), max_registers=32),  # 2048 resident threads an SM (35 registers: 1536)
        # run 25: a register cap above ptxas's own 32 lets it issue all of a thread's loads before the arithmetic
        # the dispatch's tile alone (no cap, no join, not GELU-tanh's issue-bound tile): run 24's default launch
        "uncapped": with_device(),
        "regs40": changed(with_device(), max_registers=40),
        "regs48": changed(with_device(), max_registers=48),
        "regs64": changed(with_device(), max_registers=64),
        "rows": changed(with_device(), cols_first=False),
        "rows-regs32": changed(with_device(), cols_first=False, max_registers=32),
        "w1c512": one_warp_row(512),
        "w1c256": one_warp_row(256),
        "row1k": row_of(1024),  # run 24: the gate's one-row tile (1024 columns on 4 warps)
        "row2k": row_of(2048),  # ... and Liger's (a TP-8 shard's whole row, 1536-2048 columns, on 8 warps)
    }


def _l2():
    from mxfuse.ops.triton_targets import l2_bytes

    return l2_bytes(torch.device("cuda"))


def _dram():
    from mxfuse.ops.triton_targets import dram_bytes_per_s

    return dram_bytes_per_s(torch.device("cuda"))


def act_mul_point(i, m, compiled, liger, log=print, activation="silu", variants=None):
    """µs of act·mul (`activation`: SiLU, GELU-tanh or SwiGLU-OAI; gate_up `[M, 2I]` bf16) at one (I, M): the fused op
    (both layouts), the unfused pair (act_mul then mxfp8_quantize), the activation alone (mxfuse's act_mul
    kernel), `torch.compile` of vLLM's native form (dynamic M) alone and followed by the quant, Liger's
    SiLU·mul / GELU·mul (`swiglu` / `geglu`) on two contiguous halves alone and followed by the quant, and
    the fused op in `act_variants()`'s launch shapes ("v:<name>" row-major, "vs:<name>" swizzled; `variants`: those
    names, for every activation; None: all, for SiLU only); "copy": a
    device-to-device copy moving the same bytes (half read, half written; the faster of an SM kernel and a
    memcpy node, as `copy_bandwidth_tbs`), the floor of a launch of this size in the same graph."""
    from mxfuse.ops import triton_act_quant as taq, triton_norm_quant as tnq
    from mxfuse.ops.triton_targets import device_isa

    n = n_input_sets(2 * m * 2 * i)
    g = torch.Generator(device="cuda").manual_seed(i + m)
    sets = [(torch.randn(m, 2 * i, device="cuda", dtype=DT, generator=g),) for _ in range(n)]
    halves = [(x[:, :i].contiguous(), x[:, i:].contiguous()) for (x,) in sets]
    res = {"I": i, "M": m, "activation": activation}
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    isa = device_isa(torch.device("cuda"))  # the rules are NVIDIA's only: record what this device's default runs
    launched = [taq.default_launch_config(activation, m, i, swizzled=swz, isa=isa, sm_count=sm, l2_bytes=_l2(),
                                          dram_bytes_per_s=_dram()) for swz in (False, True)]  # fmt: skip
    default_cfg = launched[0]._replace(join_loads=False, max_registers=0)  # the default's tile
    res["default_cfg"] = list(default_cfg)
    res["default_join"] = [c.join_loads for c in launched]
    res["default_registers"] = launched[0].max_registers

    def t(name, fn, inputs):
        try:
            res[name] = time_cuda_graph(fn, inputs)
        except Exception as e:
            log(f"  act_mul {name} I={i} M={m} FAILED: {type(e).__name__}: {e}")
            res[name] = float("nan")

    def fused(x, swizzled=False, config=None):
        return taq.act_mul(x[:, :i], x[:, i:], activation, swizzled=swizzled, config=config)

    def unfused(x):
        return tnq.quantize(taq.act_mul(x[:, :i], x[:, i:], activation, quant=False)[2], False)

    t("fused", fused, sets)
    t("fused_swz", lambda x: fused(x, True), sets)
    join = default_cfg._replace(join_loads=True)  # up's bits joined into the gate's: both loads before arithmetic
    t("fused_join", lambda x: fused(x, config=join), sets)
    t("fused_swz_join", lambda x: fused(x, True, config=join), sets)
    t("unfused", unfused, sets)
    t("act", lambda x: taq.act_mul(x[:, :i], x[:, i:], activation, quant=False), sets)
    shapes = act_variants()
    if variants is None:  # unnamed: every launch shape for SiLU, none for the other activations
        variants = list(shapes) if activation == "silu" else []
    for name in variants:
        cfg = shapes[name](m, i, sm)
        res[f"cfg:{name}"] = list(cfg[:3])
        t(f"v:{name}", lambda x, c=cfg: fused(x, config=c), sets)
        t(f"vs:{name}", lambda x, c=cfg: fused(x, True, config=c), sets)
    t("compiled", compiled, sets)
    t("compiled+quant", lambda x: tnq.quantize(compiled(x), False), sets)
    time_same_size_copy(t, res, producer_bytes(m, i), n)
    if liger is not None:
        t("liger", liger, halves)
        t("liger+quant", lambda a, b: tnq.quantize(liger(a, b), False), halves)
    else:
        res["liger"] = res["liger+quant"] = float("nan")
    return res


def _us(v: float) -> str:
    """µs with two decimals below 10 (the decode launches differ by hundredths), one above."""
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def act_mul_table(results, copy_tbs):
    """Markdown: µs per column, the fused op's TB/s (5.03·M·I bytes) and its ratios (> 1: the fused op faster)."""
    ratios = " | act / fused | liger / fused | compiled / fused | unfused / fused | copy / fused |"
    head = "| I | M | " + " | ".join(ACT_COLUMNS) + " | fused TB/s | % copy" + ratios
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        i, m = r["I"], r["M"]
        nbytes = producer_bytes(m, i)
        f = r["fused"]
        lines.append(
            f"| {i} | {m} | "
            + " | ".join(_us(r.get(c, float("nan"))) for c in ACT_COLUMNS)
            + f" | {tbs(nbytes, f):.2f} | {100 * tbs(nbytes, f) / copy_tbs:.0f} | {r['act'] / f:.2f} | "
            + f"{r['liger'] / f:.2f} | {r['compiled'] / f:.2f} | {r['unfused'] / f:.2f} | {r['copy'] / f:.2f} |"
        )
    return "\n".join(lines)


def act_variant_table(results, copy_tbs, swizzled=False):
    """Markdown: the fused op (row-major, or `swizzled`) in the default launch shape and each variant's, µs; % of
    the copy."""
    prefix, default = ("vs:", "fused_swz") if swizzled else ("v:", "fused")
    names = [k for k in results[0] if k.startswith(prefix)] if results else []
    head = "| I | M | default (BM, BC, warps) | default | " + " | ".join(n[len(prefix) :] for n in names)
    head += " | best % copy |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        nbytes = producer_bytes(r["M"], r["I"])
        best = min(r[default], *(r[n] for n in names))
        cfg = tuple(r["default_cfg"][:3])
        lines.append(f"| {r['I']} | {r['M']} | {cfg} | {r[default]:.1f} | " + " | ".join(f"{r[n]:.1f}" for n in names)
                     + f" | {100 * tbs(nbytes, best) / copy_tbs:.0f} |")  # fmt: skip
    return "\n".join(lines)


def _act_peers(activation):
    """(`torch.compile` of vLLM's native `forward_native` (SwiGLU-OAI: Hugging Face's eager formula), compiled as vLLM
    compiles it: dynamic token count; Liger-Kernel's two-tensor op, or None without Liger or for SwiGLU-OAI) of an
    activation."""
    import torch.nn.functional as F

    def native(x):  # SiluAndMul / GeluAndMul(approximate="tanh").forward_native; gpt-oss / MiniMax-M3's eager SwiGLU
        d = x.shape[-1] // 2
        g, u = x[..., :d], x[..., d:]
        if activation == "silu":
            a = F.silu(g)
        elif activation == "gelu_tanh":
            a = F.gelu(g, approximate="tanh")
        else:
            g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0) + 1
            a = g * torch.sigmoid(g * 1.702)
        return a * u

    compiled = torch.compile(native, dynamic=True)
    if activation not in ("silu", "gelu_tanh"):
        return compiled, None  # Liger-Kernel has no SwiGLU-OAI
    try:
        if activation == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as Liger
        else:
            from liger_kernel.ops.geglu import LigerGELUMulFunction as Liger  # the tanh form
    except ImportError:
        return compiled, None
    return compiled, lambda a, b: Liger.apply(a, b)


def act_mul_bench(out, copy_tbs, ms, log=print, activations=tuple(ACTIVATIONS), variants=None):
    """The act·mul section: for each activation, every (I, M) of its sizes (`ACTIVATIONS`) x `ms`; prints and
    (with `out`) writes act_mul_bench.md / .json. `variants`: the launch shapes timed (None: all, for SiLU)."""
    results, parts = [], []
    for activation in activations:
        title, sizes = ACTIVATIONS[activation]
        compiled, liger = _act_peers(activation)
        rows = []
        for i in sizes:
            for m in ms:
                r = act_mul_point(i, m, compiled, liger, log, activation, variants)
                log(json.dumps(r))
                rows.append(r)
        parts.append(f"### act·mul ({title}) -> MXFP8, µs per call\n\n" + act_mul_table(rows, copy_tbs))
        if any(k.startswith("v:") for k in rows[0]):
            for swizzled, layout in ((False, "row-major"), (True, "swizzled")):
                table = act_variant_table(rows, copy_tbs, swizzled)
                parts.append(f"### the fused op's launch shapes ({layout}, µs per call)\n\n{table}")
        results += rows
    text = "\n\n".join(parts)
    print(text, flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "act_mul_bench.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "act_mul_bench.json"), "w") as f:
            json.dump({"copy_tbs": copy_tbs, "results": results}, f, indent=1)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for kernels_bench.md / .json / .png")
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--variants", default=",".join([DEFAULT, *VARIANTS]), help="variants to time (VARIANTS names)")
    ap.add_argument("--variant", default=DEFAULT, help="variant of the main table (default: the ops' own choice)")
    ap.add_argument("--no-compiled", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--tables", default=None, help="re-render the tables of a saved kernels_bench.json")
    ap.add_argument(
        "--current-default", action="store_true", help="with --tables: `default` = the variant today's dispatch picks"
    )
    ap.add_argument("--flashinfer-include", default=None, help="FlashInfer's include dir (default: its wheel's)")
    ap.add_argument("--quick", action="store_true", help="K 2048,4096,6144 x M 1,16,64,256,4096 only")
    ap.add_argument("--lean", action="store_true", help="no unfused pair, no Liger + quant (a sweep in one call)")
    ap.add_argument("--calls", type=int, default=64, help="calls per CUDA graph")
    ap.add_argument("--replays", type=int, default=7, help="timed replays per point (median)")
    ap.add_argument("--warm-jobs", type=int, default=0, help="compile every kernel first in this many processes")
    ap.add_argument("--gated", action="store_true", help="then the gated producers' section (--gated-ks, --ms)")
    ap.add_argument("--only-gated", action="store_true", help="the gated producers' section only")
    ap.add_argument("--gated-ks", default=",".join(map(str, GATED_KS)))
    ap.add_argument("--gemm", action="store_true", help="then run tools/bench_gemm.py (GEMM rows)")
    ap.add_argument("--gemm-args", default="", help="extra arguments for bench_gemm.py, one string")
    ap.add_argument(
        "--act-mul", choices=("also", "only"), default=None, help="the act·mul section (after the norms / alone)"
    )
    ap.add_argument("--act-ms", default=",".join(map(str, ACT_MS)), help="M of the act·mul section")
    ap.add_argument(
        "--act-activations",
        default=",".join(ACTIVATIONS),
        help=f"activations of the act·mul section ({list(ACTIVATIONS)})",
    )
    ap.add_argument(
        "--act-variants",
        default=None,
        help="the launch shapes timed beside the default (act_variants names; default: all, for SiLU only)",
    )
    args = ap.parse_args(argv)
    vname = args.variant
    if args.tables:
        with open(args.tables) as f:
            data = json.load(f)
        if args.current_default:
            data = as_current_default(data)
        print(render(data, vname))
        if args.out:
            save(args.out, data, vname)
        return 0
    if args.quick:
        args.ks, args.ms = "2048,4096,6144", "1,16,64,256,4096"
    TIMING.update(calls=args.calls, replays=args.replays)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in [*variants, vname] if v != DEFAULT and v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    acts = tuple(a for a in args.act_activations.split(",") if a)
    if any(a not in ACTIVATIONS for a in acts):
        ap.error(f"--act-activations {args.act_activations!r}: known {list(ACTIVATIONS)}")
    act_shapes = None if args.act_variants is None else [v for v in args.act_variants.split(",") if v]
    if act_shapes is not None and any(v not in act_variants() for v in act_shapes):
        ap.error(f"--act-variants {args.act_variants!r}: known {list(act_variants())}")
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU")
        return 1
    head = (
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"liger-kernel {'yes' if liger_norms() else 'NOT INSTALLED'}  "
        f"L2 flushed before each replay  DRAM peak {_dram() / 1e12:.2f} TB/s (memory clock x bus width)"
    )
    print(head, flush=True)
    copy_tbs = copy_bandwidth_tbs()
    print(f"copy bandwidth: {copy_tbs:.3f} TB/s", flush=True)
    gated_ks, ms = [int(v) for v in args.gated_ks.split(",")], [int(v) for v in args.ms.split(",")]
    if args.only_gated:
        print(gated_section(gated_ks, ms, copy_tbs, not args.no_compiled)[1], flush=True)
        if args.act_mul is None:
            return 0

    if args.act_mul == "only":
        act_mul_bench(
            args.out, copy_tbs, [int(v) for v in args.act_ms.split(",")], activations=acts, variants=act_shapes
        )
        return 0
    compiled = None if args.no_compiled else {"add": torch.compile(_ref_add), "plain": torch.compile(_ref_plain)}
    include = flashinfer_include(args.flashinfer_include)
    points = [(int(k), int(m)) for k in args.ks.split(",") for m in args.ms.split(",")]
    if args.warm_jobs:
        warm_cache(points, variants, include, args.warm_jobs)
    flashinfer = flashinfer_norms(include)
    head += f"  flashinfer {'yes' if flashinfer else 'NOT BUILT'}"
    head += f"  graph of {args.calls} calls, median of {args.replays}"
    data = {"head": head, "device": torch.cuda.get_device_name(), "copy_tbs": copy_tbs, "variants": variants,
            "results": []}  # fmt: skip
    t0 = time.time()
    for k in sorted({k for k, _ in points}, key=[k for k, _ in points].index):
        for m in [m for kk, m in points if kk == k]:
            r = bench_point(k, m, variants, compiled, flashinfer, lean=args.lean)
            print(json.dumps(r), flush=True)
            data["results"].append(r)
        save(args.out, data, vname)  # the finished K survives a timeout
    print(f"benchmark took {time.time() - t0:.0f} s", flush=True)
    print(render(data, vname), flush=True)
    save(args.out, data, vname)
    if args.gated:
        gated_results, table = gated_section(gated_ks, ms, copy_tbs, not args.no_compiled)
        data["gated"] = gated_results
        print(table, flush=True)
        save(args.out, data, vname)

    if args.act_mul == "also":
        act_mul_bench(
            args.out, copy_tbs, [int(v) for v in args.act_ms.split(",")], activations=acts, variants=act_shapes
        )
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
