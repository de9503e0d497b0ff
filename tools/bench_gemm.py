"""Benchmark the MXFP8 GEMM (`mxfuse::mxfp8_linear`) on a CUDA GPU.

Prints markdown tables: per (shape, M) the time of our kernel, its TFLOP/s and
effective TB/s (bytes that must move: fp8 weight + scales, fp8 activations + scales,
output), the ratio to bf16 cuBLAS (`torch.matmul` of the dequantized bf16 operands)
and the speedup over the `tl.dot_scaled` baseline; then the composite
"norm + quant + qkv GEMM" fused vs. unfused vs. bf16.

Timing (docs/design.md, "Measuring"; mxfuse/timing.py): a CUDA graph of 64 back-to-back
calls cycling through enough input sets (weights included) that they cannot sit in L2,
the L2 flushed before each replay, median of 7 replays, per call.

    PYTHONPATH=. python3 tools/bench_gemm.py [--out DIR] [--sweep] [--quick]

`--sweep` also times a list of tile configurations of the product kernel (development aid).
`--pdl-pair` times the fused add-norm + MXFP8 followed by the GEMM that reads its codes (a decode
step's norm -> qkv pair) in one CUDA graph, each of the two launched with and without
programmatic dependent launch, checks that the four give the same bits, and prints the table;
then likewise a decode MLP (gate_up GEMM -> fused SiLU·mul + MXFP8 -> down GEMM), the act·mul and
the GEMMs each with and without PDL, and the gated producers before o_proj / out_proj likewise
(`--pdl-only`: those three tables alone).
"swap" is the product kernel (`mxfuse.ops.triton_gemm`); the other variants are the ones
it was chosen against (tools/gemm_variants.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from mxfuse.timing import copy_bandwidth_tbs, n_input_sets, time_cuda_graph as _time_graph

# TP4 shards of MiniMax-M3.1-Flash-like sizes (hidden 6144): (name, N, K)
SHAPES = [
    ("qkv", 2560, 6144),
    ("o_proj", 6144, 1536),
    ("gate_up", 4608, 6144),
    ("down", 6144, 2304),
]
MS = [1, 16, 64, 256, 1024, 4096]
PRODUCT = "swap"  # the product kernel (swapped operands), as the tables name it
TIMED_VARIANTS = (PRODUCT, "bf16", "fp8", "dot_scaled")  # each with its default tiles
SWEEP_DEADLINE = [float("inf")]  # wall-clock time after which --sweep stops adding configs


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gemm_variants, beside this script


def gemm(variant: str, config=None):
    """`(xc, xs, wc, ws) -> out` of the product kernel ("swap") or a comparison variant."""
    from mxfuse.ops import triton_gemm

    if variant == PRODUCT:
        return lambda *ops: triton_gemm.mxfp8_linear(*ops, torch.bfloat16, config=config)
    import gemm_variants

    return lambda *ops: gemm_variants.mxfp8_linear(*ops, torch.bfloat16, variant=variant, config=config)


def time_cuda_graph(calls_per_set) -> float:
    """Median µs per call of a graph of 64 calls cycling through the zero-argument calls."""
    return _time_graph(lambda f: f(), [(f,) for f in calls_per_set])


def n_sets_for(bytes_per_set: int) -> int:
    return min(32, n_input_sets(bytes_per_set))


# ------------------------------------------------------------------ inputs


def _quantize(x: torch.Tensor):
    """MXFP8 codes + row-major scales on the GPU with the exact plain-PyTorch reference
    (the GEMM inputs must not depend on the quant kernel under test elsewhere)."""
    from mxfuse.ops import reference

    return reference.quantize_rows(x.float())


def make_set(m, n, k, need_bf16=True):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xc, xs = _quantize(x)
    wc, ws = _quantize(w)
    d = dict(xc=xc, xs=xs, wc=wc, ws=ws)
    if need_bf16:
        from mxfuse.ops.reference import dequantize

        d["xb"] = dequantize(xc, xs).to(torch.bfloat16)
        d["wbT"] = dequantize(wc, ws).to(torch.bfloat16).t()  # [K, N] view of an [N, K] weight (nn.Linear)
    return d


def set_bytes(m, n, k, bf16=False):
    if bf16:
        return 2 * (m * k + n * k) + 2 * m * n
    from mxfuse.ops.mx_layout import packed_width

    return (m + n) * packed_width(k) + 2 * m * n  # codes + scales of both operands, bf16 out


# ------------------------------------------------------------------ main bench


def bench_shape(name, n, k, ms, sweep_cfgs=None, log=print):
    rows = []
    sweep_rows = []
    for m in ms:
        nsets = n_sets_for(max(set_bytes(m, n, k), set_bytes(m, n, k, bf16=True) // 2))
        sets = [make_set(m, n, k) for _ in range(nsets)]
        bf = nsets
        r = dict(shape=name, N=n, K=k, M=m, sets=nsets)
        r["ours"] = time_cuda_graph(
            [
                lambda d=d: torch.ops.mxfuse.mxfp8_linear(d["xc"], d["xs"], d["wc"], d["ws"], torch.bfloat16)
                for d in sets
            ]
        )
        r["cublas"] = time_cuda_graph([lambda d=d: torch.matmul(d["xb"], d["wbT"]) for d in sets[:bf]])
        r["variant"] = PRODUCT
        for variant in TIMED_VARIANTS:
            try:
                run = gemm(variant)
                r[variant] = time_cuda_graph(
                    [lambda d=d, run=run: run(d["xc"], d["xs"], d["wc"], d["ws"]) for d in sets]
                )
            except Exception as e:  # noqa: BLE001
                log(f"{variant} failed at {name} M={m}: {type(e).__name__}: {str(e)[:200]}")
                r[variant] = float("nan")
        if sweep_cfgs and time.time() < SWEEP_DEADLINE[0]:
            for variant, cfg in sweep_cfgs(m):
                try:
                    run = gemm(variant, cfg)
                    t = time_cuda_graph([lambda d=d, run=run: run(d["xc"], d["xs"], d["wc"], d["ws"]) for d in sets])
                except Exception as e:  # noqa: BLE001
                    log(f"  sweep {variant} {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
                    t = float("nan")
                sweep_rows.append({"shape": name, "M": m, "variant": variant, "cfg": cfg, "us": t})
                log(f"  sweep {name} M={m} {variant} {_cfg_str(cfg)}: {t:.2f} us")
        del sets
        torch.cuda.empty_cache()
        flops = 2 * m * n * k
        r["tflops"] = flops / (r["ours"] * 1e-6) / 1e12
        r["tbs"] = set_bytes(m, n, k) / (r["ours"] * 1e-6) / 1e12
        rows.append(r)
        log(
            f"{name} M={m}: ours {r['ours']:.2f} us, cuBLAS bf16 {r['cublas']:.2f} us, "
            + ", ".join(f"{v} {r[v]:.2f}" for v in TIMED_VARIANTS)
        )
    return rows, sweep_rows


_FLAGS = {
    "split_k": "SPLIT",
    "flat_k_loop": "FLAT",
    "dequantize_activations_first": "X_BF16",
    "dequantize_weight_first": "W_BF16",
}


def _cfg_str(cfg):
    """Short label of a GemmConfig (product) or TiledConfig (gemm_variants)."""
    fields = cfg._asdict()
    flags = " ".join(label for name, label in _FLAGS.items() if fields.get(name))
    chunk = f" chunk{cfg.chunk}" if fields.get("chunk") else ""
    if "weight_rows" in fields:
        tile = f"W{cfg.weight_rows}xX{cfg.activation_rows}x{cfg.block_k}"
    else:
        tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
    return f"{tile} w{cfg.num_warps} s{cfg.num_stages} {flags}{chunk}".strip()


def sweep_candidates(m):
    """Tile configurations of the product kernel tried by --sweep at this M: (variant, config).
    Every config sums the same fixed K chunks (batch invariant) unless it sets `chunk` (timing only)."""
    from mxfuse.ops.triton_gemm import GemmConfig

    def sw(weight_rows, activation_rows, block_k, warps, stages, group=8, **flags):
        return PRODUCT, GemmConfig(weight_rows, activation_rows, block_k, group, warps, stages, **flags)

    bm = min(64, max(16, 1 << (m - 1).bit_length()))
    x_first = {"dequantize_activations_first": True}
    both = {"dequantize_activations_first": True, "dequantize_weight_first": True}
    flat_both = {"flat_k_loop": True, **both}  # both operands dequantized up front
    if m <= 64:
        return [
            sw(64, bm, 128, 4, 4, 1, split_k=True),
            sw(64, bm, 128, 4, 3, 1, split_k=True),
            sw(64, bm, 128, 4, 4, 1, split_k=True, **x_first),
            sw(64, bm, 128, 4, 3, 1, split_k=True, **x_first),
            sw(64, min(bm, 32), 128, 4, 4, 1, split_k=True, **x_first),
            sw(64, bm, 128, 4, 4, 1, split_k=True, **both),
            sw(64, bm, 128, 4, 4, 1, split_k=True, chunk=384),
            sw(64, bm, 256, 4, 4, 1, flat_k_loop=True),  # no split: one program per weight tile
        ]
    if m < 512:
        return [
            sw(128, 64, 128, 4, 4, **flat_both),
            sw(64, 64, 128, 4, 4, **flat_both),
            sw(128, 32, 128, 4, 4, **flat_both),
            sw(64, 128, 128, 4, 4, **flat_both),
            sw(64, 64, 128, 4, 3, **flat_both),
            sw(128, 64, 128, 4, 4, **both),
            sw(128, 64, 128, 4, 4, 8, split_k=True, **both),
        ]
    return [
        sw(128, 128, 128, 8, 3, **flat_both),
        sw(128, 64, 128, 4, 4, **flat_both),
        sw(128, 64, 128, 4, 3, **flat_both),
        sw(64, 128, 128, 4, 4, **flat_both),
        sw(128, 128, 128, 8, 3, 4, **flat_both),
        sw(128, 128, 128, 4, 3, **flat_both),
        sw(128, 128, 128, 8, 3, flat_k_loop=True, **x_first),  # weight dequantized in every M tile
    ]


def bench_composite(ms, log=print):
    """norm + quant + qkv GEMM (N 2560, K 6144): fused vs. unfused vs. bf16."""
    from mxfuse.ops.mx_layout import packed_width

    n, k = 2560, 6144
    try:
        from mxfuse.ops import triton_norm_quant  # noqa: F401
    except Exception as e:  # noqa: BLE001
        log(f"composite skipped: mxfuse.ops.triton_norm_quant not importable ({type(e).__name__}: {e})")
        return []
    rows = []
    eps = 1e-6
    ops = torch.ops.mxfuse
    for m in ms:
        per_set = m * k * 2 * 3 + n * packed_width(k) + n * k * 2
        nsets = n_sets_for(per_set)
        sets = []
        for _ in range(nsets):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(k, device="cuda", dtype=torch.bfloat16) * 0.1
            wc, ws = _quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            from mxfuse.ops.reference import dequantize

            wbT = dequantize(wc, ws).to(torch.bfloat16).t()
            sets.append(dict(x=x, res=res, w=w, wc=wc, ws=ws, wbT=wbT))

        def fused(d):
            c, s, r, _ = ops.gemma_fused_add_rmsnorm_mxfp8(d["x"], d["res"], d["w"], eps)
            return ops.mxfp8_linear(c, s, d["wc"], d["ws"], torch.bfloat16), r

        def unfused(d):
            y, r = ops.gemma_fused_add_rmsnorm(d["x"], d["res"], d["w"], eps)
            c, s = ops.mxfp8_quantize(y)
            return ops.mxfp8_linear(c, s, d["wc"], d["ws"], torch.bfloat16), r

        def bf16(d):
            y, r = ops.gemma_fused_add_rmsnorm(d["x"], d["res"], d["w"], eps)
            return torch.matmul(y, d["wbT"]), r

        row = dict(M=m)
        try:
            row["fused"] = time_cuda_graph([lambda d=d: fused(d) for d in sets])
            row["unfused"] = time_cuda_graph([lambda d=d: unfused(d) for d in sets])
            row["bf16_norm_matmul"] = time_cuda_graph([lambda d=d: bf16(d) for d in sets])
            row["bf16_matmul"] = time_cuda_graph([lambda d=d: torch.matmul(d["x"], d["wbT"]) for d in sets])
        except Exception as e:  # noqa: BLE001
            log(f"composite failed at M={m}: {type(e).__name__}: {str(e)[:300]}")
            return rows
        rows.append(row)
        log(f"composite M={m}: {row}")
        del sets
        torch.cuda.empty_cache()
    return rows


def pair_input_sets(m: int, k: int, n: int, weight_len: int) -> list[tuple]:
    """Input sets of a producer -> GEMM pair, enough not to sit in L2: two bf16 `[M, K]` inputs, the
    producer's bf16 weight of `weight_len` values, the GEMM's MXFP8 `[N, K]` weight (codes, scales)."""
    sets = []
    for _ in range(n_sets_for(n * (k + k // 32) + 6 * m * k)):
        wc, ws = _quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        x, r = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sets.append((x, r, (0.5 * torch.randn(weight_len, device="cuda")).to(torch.bfloat16), wc, ws))
    return sets


def pdl_mark(name: str, on: bool) -> str:
    """A kernel's name in a PDL column: `gemm`, `gemm+pdl`."""
    return f"{name}+pdl" if on else name


def pdl_combos(run, sets, label, what: str) -> dict:
    """µs of `run(d, first_pdl, second_pdl)` over `sets` (a CUDA graph of 64 calls) for the four PDL
    combinations, columns `label(first_pdl, second_pdl)`, after checking that each gives the plain launches'
    bits (an AssertionError naming `what` otherwise)."""
    want = run(sets[0], False, False)
    row = {}
    for a in (False, True):
        for b in (False, True):
            got = run(sets[0], a, b)
            if not all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, want)):
                raise AssertionError(f"{what}: PDL {a} / {b}: other bits")
            row[label(a, b)] = time_cuda_graph([lambda d=d, a=a, b=b: run(d, a, b) for d in sets])
    return row


PDL_PAIRS = [(4096, 6144), (2048, 5120), (6144, 2560)]
"""(K, N) of the norm -> GEMM pairs: Llama-3-8B's qkv (hidden 4096), a Qwen3-Next-sized one (2048),
the TP-4 qkv shard of the 6144 model."""
PDL_MS = [1, 4, 16, 64, 256]


def bench_pdl_pair(pairs, ms, log=print):
    """µs per (norm + GEMM) pair in a CUDA graph of 64 pairs: norm and GEMM each with and without
    PDL; the GEMM alone and the norm alone for reference. Raises if any of the four differs in a
    bit from the plain launches (codes, scales, residual_out, GEMM output)."""
    from mxfuse.ops import triton_gemm, triton_norm_quant as tnq
    from mxfuse.ops.norm_quant_config import norm_config
    from mxfuse.ops.triton_targets import sm_count

    eps, rows = 1e-6, []
    sms = sm_count(torch.device("cuda"))
    for k, n in pairs:
        for m in ms:
            sets = pair_input_sets(m, k, n, weight_len=k)
            base_n = norm_config(k, m, sms=sms)
            base_g = triton_gemm.gemm_config(m, n, k)

            def pair(d, pn, pg):
                x, r, w, wc, ws = d
                c, s, ro, _ = tnq.fused_norm_quant(x, r, w, eps, config=base_n.replace(pdl=pn))
                return c, s, ro, triton_gemm.mxfp8_linear(c, s, wc, ws, torch.bfloat16, config=base_g._replace(pdl=pg))

            row = dict(K=k, N=n, M=m)
            label = lambda pn, pg: f"{pdl_mark('norm', pn)} -> {pdl_mark('gemm', pg)}"  # noqa: E731
            row |= pdl_combos(pair, sets, label, f"norm -> GEMM K={k} N={n} M={m}")
            row["norm alone"] = time_cuda_graph([lambda d=d: tnq.fused_norm_quant(*d[:3], eps) for d in sets])
            codes = [tnq.fused_norm_quant(*d[:3], eps)[:2] for d in sets]
            row["gemm alone"] = time_cuda_graph(
                [lambda d=d, c=c: triton_gemm.mxfp8_linear(*c, d[3], d[4], torch.bfloat16) for d, c in zip(sets, codes)]
            )
            log(f"pdl pair {row}")
            rows.append(row)
            del sets, codes
            torch.cuda.empty_cache()
    return rows


MLP_PDL_CHAINS = [(4096, 14336), (4096, 1792), (5120, 4352)]
"""(K, I) of the decode MLP chains: Llama-3.1-8B's MLP, its TP-8 shard, a Qwen3.5-27B-sized TP-4 shard."""


def bench_pdl_mlp(chains, ms, log=print):
    """µs per decode MLP (gate_up GEMM -> fused SiLU·mul + MXFP8 -> down GEMM, the project's kernels) in a
    CUDA graph of 64 chains: the act·mul and the two GEMMs each with and without PDL; the act·mul alone for
    reference. Raises if any of the four differs in a bit from the plain launches."""
    from mxfuse.ops import triton_act_quant as taq, triton_gemm
    from mxfuse.ops.triton_targets import dram_bytes_per_s, l2_bytes, sm_count

    dev = torch.device("cuda")
    rows = []
    for k, i in chains:
        for m in ms:
            nsets = n_sets_for(3 * i * (k + k // 32) + 4 * m * (k + i))
            sets = []
            for _ in range(nsets):
                xc, xs = _quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
                guc, gus = _quantize(torch.randn(2 * i, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                dc, ds = _quantize(torch.randn(k, i, device="cuda", dtype=torch.bfloat16) * 0.02)
                sets.append((xc, xs, guc, gus, dc, ds))
            act_cfg = taq.act_mul_config(
                m, i, sm_count(dev), l2_bytes=l2_bytes(dev), dram_bytes_per_s=dram_bytes_per_s(dev)
            )

            def chain(d, pa, pg):
                xc, xs, guc, gus, dc, ds = d
                cfg = triton_gemm.gemm_config(m, 2 * i, k)._replace(pdl=pg)
                gu = triton_gemm.mxfp8_linear(xc, xs, guc, gus, torch.bfloat16, config=cfg)
                c, s, _ = taq.act_mul(gu[:, :i], gu[:, i:], "silu", config=act_cfg._replace(pdl=pa))
                cfg = triton_gemm.gemm_config(m, k, i)._replace(pdl=pg)
                return c, s, triton_gemm.mxfp8_linear(c, s, dc, ds, torch.bfloat16, config=cfg)

            row = dict(K=k, I=i, M=m)
            label = lambda pa, pg: f"{pdl_mark('gemm', pg)} -> {pdl_mark('act', pa)}"  # noqa: E731
            row |= pdl_combos(chain, sets, label, f"MLP K={k} I={i} M={m}")
            gus = [triton_gemm.mxfp8_linear(*d[:4], torch.bfloat16) for d in sets]
            row["act alone"] = time_cuda_graph([lambda g=g: taq.act_mul(g[:, :i], g[:, i:], "silu") for g in gus])
            log(f"pdl mlp {row}")
            rows.append(row)
            del sets, gus
            torch.cuda.empty_cache()
    return rows


GATED_PDL_PAIRS = [(4096, 2048)]
"""(K, N) of the gated producer -> GEMM pairs: Qwen3-Next's o_proj / out_proj (16 heads x 256 or 32 x 128 -> 2048)."""


def bench_pdl_gated(pairs, ms, log=print):
    """µs per (gated producer + MXFP8, then the GEMM reading its codes) pair in a CUDA graph of 64 pairs,
    for `x * sigmoid(gate)` and the gated RMSNorm (groups of 128), each of the two launched with and without
    PDL; the producer alone for reference. Raises if any of the four differs in a bit from the plain launches."""
    from mxfuse.ops import triton_gated_quant as tg, triton_gemm
    from mxfuse.ops.triton_targets import device_isa, dram_bytes_per_s, sm_count

    dev = torch.device("cuda")
    rows = []
    for k, n in pairs:
        for m in ms:
            sets = pair_input_sets(m, k, n, weight_len=128)
            gate_cfg = tg.gate_config(k, m, sm_count(dev), dram_bytes_per_s(dev), device_isa(dev))
            norm_cfg = tg.gated_norm_config(128, m, k, sm_count(dev))
            producers = {
                "gate": lambda d, p: tg.sigmoid_gate(d[0], d[1], quant=True, config=gate_cfg._replace(pdl=p)),
                "gated norm": lambda d, p: tg.gated_rms_norm(
                    d[0], d[1], d[2], 1e-6, 128, quant=True, config=norm_cfg._replace(pdl=p)
                ),
            }
            gemm_cfg = triton_gemm.gemm_config(m, n, k)
            for name, producer in producers.items():

                def pair(d, pp, pg, producer=producer):
                    c, s, _ = producer(d, pp)
                    return c, s, triton_gemm.mxfp8_linear(c, s, d[3], d[4], torch.bfloat16,
                                                          config=gemm_cfg._replace(pdl=pg))  # fmt: skip

                row = dict(producer=name, K=k, N=n, M=m)
                label = lambda pp, pg: f"{pdl_mark('prod', pp)} -> {pdl_mark('gemm', pg)}"  # noqa: E731
                row |= pdl_combos(pair, sets, label, f"{name} -> GEMM K={k} N={n} M={m}")
                row["producer alone"] = time_cuda_graph([lambda d=d: producer(d, False) for d in sets])
                log(f"pdl gated {row}")
                rows.append(row)
            del sets
            torch.cuda.empty_cache()
    return rows


def pdl_gated_table(rows):
    return pdl_rows_table(
        rows,
        "### gated producer + MXFP8 -> MXFP8 GEMM (o_proj / out_proj), with and without programmatic dependent "
        "launch (µs per pair, CUDA graph of 64 pairs; same bits in all four)",
        ("producer", "K", "N", "M"),
        ("both PDL / GEMM PDL", "prod+pdl -> gemm+pdl", "prod -> gemm+pdl"),
    )


def pdl_rows_table(rows, title: str, size_keys: tuple[str, ...], ratio: tuple[str, str, str]) -> str:
    """A PDL timing table: the size columns, every timed column, then `ratio` = (name, numerator, denominator)."""
    if not rows:
        return ""
    keys = [key for key in rows[0] if key not in size_keys]
    out = [
        title + "\n",
        "| " + " | ".join(size_keys) + " | " + " | ".join(keys) + f" | {ratio[0]} |",
        "|" + "---|" * (len(size_keys) + len(keys) + 1),
    ]
    for r in rows:
        cells = [str(r[key]) for key in size_keys] + [f"{r[key]:.2f}" for key in keys]
        out.append("| " + " | ".join(cells) + f" | {r[ratio[1]] / r[ratio[2]]:.3f} |")
    return "\n".join(out)


def pdl_table(rows):
    return pdl_rows_table(
        rows,
        "### fused add-norm + MXFP8 -> MXFP8 GEMM, with and without programmatic dependent launch "
        "(µs per pair, CUDA graph of 64 pairs; same bits in all four)",
        ("K", "N", "M"),
        ("both PDL / neither", "norm+pdl -> gemm+pdl", "norm -> gemm"),
    )


def pdl_mlp_table(rows):
    return pdl_rows_table(
        rows,
        "### decode MLP: gate_up GEMM -> fused SiLU·mul + MXFP8 -> down GEMM, with and without programmatic "
        "dependent launch (µs per chain, CUDA graph of 64 chains; same bits in all four)",
        ("K", "I", "M"),
        ("all PDL / GEMMs PDL", "gemm+pdl -> act+pdl", "gemm+pdl -> act"),
    )


def gemm_table(rows, copy_tbs):
    default = rows[0]["variant"] if rows else "?"
    others = [v for v in TIMED_VARIANTS if v != default]
    out = [
        f"MXFP8 GEMM `mxfuse::mxfp8_linear` (bf16 out), {torch.cuda.get_device_name()}, "
        f"copy bandwidth {copy_tbs:.2f} TB/s. t/cuBLAS < 1 is faster than bf16 cuBLAS.",
        "",
        f"Ours = the op with its default variant `{default}` and default tiles; the other "
        "columns are the other variants with their default tiles.",
        "",
        "| shape (N, K) | M | ours µs | TFLOP/s | TB/s | cuBLAS bf16 µs | t/cuBLAS | "
        + " | ".join(f"{v} µs" for v in others)
        + " |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(others),
    ]
    for r in rows:
        out.append(
            f"| {r['shape']} ({r['N']}, {r['K']}) | {r['M']} | {r['ours']:.2f} | {r['tflops']:.1f} | {r['tbs']:.2f} | "
            f"{r['cublas']:.2f} | {r['ours'] / r['cublas']:.2f} | " + " | ".join(f"{r[v]:.2f}" for v in others) + " |"
        )
    return "\n".join(out)


def composite_table(rows):
    if not rows:
        return "composite (norm + quant + qkv GEMM): not run (norm/quant kernels unavailable)"
    out = [
        "Composite: Gemma add+RMSNorm + MXFP8 quant + qkv GEMM (N 2560, K 6144), bf16 out.",
        "",
        "| M | fused µs | unfused µs | unfused/fused | bf16 norm+matmul µs | bf16 matmul only µs "
        "| fused/bf16 norm+matmul |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['M']} | {r['fused']:.2f} | {r['unfused']:.2f} | {r['unfused'] / r['fused']:.2f} | "
            f"{r['bf16_norm_matmul']:.2f} | {r['bf16_matmul']:.2f} | {r['fused'] / r['bf16_norm_matmul']:.2f} |"
        )
    return "\n".join(out)


def sweep_table(sweep_rows):
    out = ["| shape | M | variant | config | µs |", "|---|---:|---|---|---:|"]
    for r in sweep_rows:
        out.append(f"| {r['shape']} | {r['M']} | {r['variant']} | {_cfg_str(r['cfg'])} | {r['us']:.2f} |")
    best = {}
    for r in sweep_rows:
        key = (r["shape"], r["M"], r["variant"])
        if not math.isnan(r["us"]) and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    out += ["", "Best per variant:", "", "| shape | M | variant | config | µs |", "|---|---:|---|---|---:|"]
    for key in sorted(best, key=lambda t: (t[0], t[1], t[2])):
        r = best[key]
        out.append(f"| {r['shape']} | {r['M']} | {r['variant']} | {_cfg_str(r['cfg'])} | {r['us']:.2f} |")
    return "\n".join(out)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    shapes = sorted({r["shape"] for r in rows}, key=[s[0] for s in SHAPES].index)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == s]
        ms = [r["M"] for r in rs]
        for key, label in (("ours", "mxfp8_linear"), ("cublas", "cuBLAS bf16"), ("dot_scaled", "tl.dot_scaled")):
            ax.plot(ms, [r[key] for r in rs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M")
        ax.set_ylabel("µs")
        ax.set_title(f"{s} N={rs[0]['N']} K={rs[0]['K']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for gemm_bench.md, gemm_bench.json and gemm_bench.png")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tile configs per variant")
    ap.add_argument("--quick", action="store_true", help="qkv shape only")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (qkv,o_proj,gate_up,down)")
    ap.add_argument("--ms", default=None, help="comma-separated M values")
    ap.add_argument("--no-composite", action="store_true")
    ap.add_argument("--sweep-seconds", type=float, default=240.0, help="stop sweeping after this many seconds")
    ap.add_argument("--pdl-pair", action="store_true", help="also the norm -> GEMM pair with / without PDL")
    ap.add_argument("--pdl-only", action="store_true", help="the norm -> GEMM PDL table alone")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm: needs a CUDA GPU")
        return 1
    import mxfuse.ops  # noqa: F401  (registers torch.ops.mxfuse)

    ms = [int(v) for v in args.ms.split(",")] if args.ms else MS
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        want = args.shapes.split(",")
        bad = [w for w in want if w not in {s[0] for s in SHAPES}]
        if bad:
            ap.error(f"unknown shapes {bad}")
        shapes = [s for s in SHAPES if s[0] in want]
    t0 = time.time()
    pdl_ms = ms if args.ms else PDL_MS
    pdl_text = ""
    if args.pdl_pair or args.pdl_only:
        mlp = pdl_mlp_table(bench_pdl_mlp(MLP_PDL_CHAINS, pdl_ms))
        gated = pdl_gated_table(bench_pdl_gated(GATED_PDL_PAIRS, pdl_ms))
        pdl_text = pdl_table(bench_pdl_pair(PDL_PAIRS, pdl_ms)) + "\n\n" + mlp + "\n\n" + gated
    if args.pdl_only:
        print(pdl_text)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "pdl_pair.md"), "w") as f:
                f.write(pdl_text + "\n")
        return 0
    SWEEP_DEADLINE[0] = t0 + args.sweep_seconds
    copy_tbs = copy_bandwidth_tbs()
    rows, sweep_rows = [], []
    for name, n, k in shapes:
        r, s = bench_shape(name, n, k, ms, sweep_candidates if args.sweep else None)
        rows += r
        sweep_rows += s
    comp = [] if args.no_composite else bench_composite(ms)
    text = gemm_table(rows, copy_tbs) + "\n\n" + composite_table(comp) + ("\n\n" + pdl_text if pdl_text else "")
    if sweep_rows:
        text = sweep_table(sweep_rows) + "\n\n" + text
    print(f"\n(bench took {time.time() - t0:.0f} s)\n")
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemm_bench.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "gemm_bench.json"), "w") as f:
            sweep = [{**r, "cfg": r["cfg"]._asdict()} for r in sweep_rows]
            json.dump({"gemm": rows, "composite": comp, "sweep": sweep, "copy_tbs": copy_tbs}, f, indent=1)
        plot(rows, os.path.join(args.out, "gemm_bench.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
