"""Triton kernels for the `mxfuse::` norm and quant ops (CUDA impls of :mod:`mxfuse.ops.library`).

Functions (all take 2-D `[M, K]` rows with a unit last stride; the row stride may differ
from K; M may be 0; K % 32 == 0):

- :func:`gemma_norm` -- RMSNorm (Gemma weight offset 1.0 by default), plain or with the
  residual add (the unfused norm).
- :func:`fused_norm_quant` -- norm (+add) and quant in one launch, optionally writing y.
- :func:`quantize` -- MXFP8 quantization, row-major or F8_128x4-swizzled scales, and
  :func:`swizzle_scales` -- row-major E8M0 scales to the F8_128x4 layout (both defined in
  :mod:`mxfuse.ops.triton_mx_quant`, re-exported here).

Each has a `*_launch` twin that allocates the outputs and returns them with the launch
(:class:`KernelLaunch`) without running it: what tools/compile_targets.py and
tests/test_targets_compile.py compile on a CPU for every target.

Modules: a fused kernel is a producer prologue composed with the one MXFP8 epilogue.
:mod:`mxfuse.ops.triton_norm_prologue` holds the norm's prologue (loads, residual add,
sum of squares, rstd, the normalized chunk); :mod:`mxfuse.ops.triton_mx_quant` the epilogue
(`_mx_epilogue`: y, codes and scales in either layout; `_mx_quant_tile`, `_store_scales`),
the standalone quant and swizzle kernels and the shared launch helpers; this module the
norm kernel (`_norm_tile`, `_norm_kernel`) and its launchers. Kernel arguments travel in
bundles built by the launcher: `NormIo` and `MxDst` (runtime values), `NormSpec` and
`MxSpec` (constexprs).

Design
======

Bitwise contract. Quantization is elementwise except for the block amax, and `max` is
exact and order-free, so any tiling quantizes the same bits. The E8M0 scale and the
`2**(127 - sb)` multiplier are integer work on the bits of the amax (exact on every
target). The default NVIDIA code leans on the hardware's IEEE semantics (`quant_ops="hw"`):
`tl.max` is maxNum, which skips NaN (a block of only NaN gives NaN, which the FLT_MIN
floor, also maxNum, turns into FLT_MIN), and the fp32 -> e4m3 cast is
`cvt.rn.satfinite`, which maps +-Inf to +-448 and keeps NaN. The spelled-out form
(`"explicit"`: `where` before the max, a clamp before the cast) gives the same bits on
the GPU (tests/test_gpu_norms.py::test_variants_bitwise) with two more instructions
per element, and is what the portable code runs. The one order-dependent operation is
the norm's sum of squares:

- a row is split into NCH <= 4 chunks of CH = max(128, next_pow2(K) / 4) columns (CH a
  power of two; the last chunk zero-padded);
- the squares are first added ELEMENTWISE across chunks, ``(a^2 + b^2) + (c^2 + d^2)``
  (an absent chunk is omitted; adding an exact +0 would change nothing);
- the resulting CH-vector is summed by `tl.sum` (`tree="native"`, the default): its
  order is fixed by the register layout of the row, i.e. by (CH, rows per tile,
  num_warps), which `norm_config` derives from K alone. `tree="pairwise"` is the
  layout-free alternative (:func:`_pairwise_sum`); it costs four more barriers per row.

The fused and the unfused norm are the same kernel (`QUANT` constexpr) with the same
config, and share every helper. All kernels are compiled with ``enable_fp_fusion=False``
so LLVM cannot contract a multiply and an add into an FMA in one variant and not in
another. ``/K`` is the correctly rounded ``div_rn``; ``1/sqrt`` is the hardware
approximation (`rsqrt="approx"`; `rsqrt="rn"` keeps the correctly rounded
``div_rn(1, sqrt_rn(.))`` at ~0.1 µs more per decode launch). `round_normalized` (the
standard Hugging Face `LlamaRMSNorm` order) rounds `s * rstd` to the dtype before the
weight multiply. Consequences: fused == unfused bitwise, and results are batch invariant
(M only picks launch choices that do not change a bit: `split`, `evict_first`, the
paired rounding, the persistent loop, PDL).

Targets (`ISA` constexpr, set by the launcher from the device: mxfuse/ops/triton_targets.py)
============================================================================================

- "ptx" (sm_90, sm_100, sm_103): ``1/sqrt`` is ``rsqrt.approx.f32`` (MUFU.RSQ, relative
  error < 2**-22; not the `.ftz` form `tl.math.rsqrt` emits, which turns a subnormal
  `ssq / K + eps` into +Inf); bf16 pairs round with ``cvt.rn.bf16x2.f32``; scale bytes
  are stored with a predicated ``st.global.u8`` from the layout the amax was reduced in;
  e4m3 codes come from ``cvt.rn.satfinite.e4m3x2.f32``.
- "portable" (gfx942, gfx950): ``1/sqrt`` is ``tl.math.rsqrt`` (``v_rsq_f32``, 1 ulp);
  bf16 rounding is ``.to(bfloat16)`` (round to nearest even everywhere); scale bytes go
  through ``tl.store``; the quant is always "explicit", so the convert only ever sees
  finite values within +-448 (or NaN) and rounds them to nearest even on every target:
  gfx950 converts with ``v_cvt_scalef32_pk_fp8_f32`` (scale 1.0), gfx942, whose fp8
  hardware is FNUZ, with Triton's software OCP convert (integer round-to-nearest-even on
  the fp32 bits, a ladder of compares for the subnormal codes, 448 from 464 up, NaN to
  0x7f). Fused and unfused run the same helpers with the same `ISA`, so they agree
  bitwise on each target by construction.

Regimes (launch shapes; the arithmetic of a row is the same in all of them; numbers in
docs/perf_notes.md):

- norm / fused norm+quant: a program owns tiles of BM whole rows, all NCH chunks in
  registers, one pass: read the weight, then x (+ residual) once (a barrier keeps the
  weight loads ahead of the rows'), write residual_out, y (optional) and codes + scales.
  Large K uses BM = 1, ~32 values of the padded row per thread. The flags (residual
  rounding, y, scale layout) are constexpr: runtime flags put branches between the
  loads and their use, and the weight loads then waited for x's round trip.
- which of the launch shapes below a call gets is `norm_config`'s rule (its module
  docstring): counted in programs per SM of the device, so the row counts below are an
  H200's (132 SMs).
- decode sizes (tiles x NCH <= SMs: M <= 33..66 at 4..2 chunks): `split` = one program
  per chunk; each reads and reduces the whole row (the same code, so the same bits) and
  finishes one chunk, so a row's quant tail runs on NCH SMs. Up to 8 rows per SM (1056
  rows): evict_first on the row loads. Up to 2 rows per SM (264 rows; 1056 with a
  residual) y is rounded to bf16 two values per convert before the quant.
- the fused plain norm at 3 chunks a row with at most 8 warps (K 2049..3072 and
  4097..6144), NVIDIA, from 4 tiles per program (1584 rows at K 6144, 3168 at K 3072):
  a persistent grid of 24 warps per SM, the weight loaded once per program, Triton's
  software pipeliner fetching the next tiles' rows (cp.async) while one is computed.
- programmatic dependent launch (`NormConfig.pdl`, NVIDIA only, off by default): the
  kernel runs `griddepcontrol.wait` before its first load (weight included) and
  `launch_dependents` right after; it pays only between PDL launches on both sides
  (docs/perf_notes.md, run 10).
- quant: ``[BM, BC]`` tiles with BC <= 1024 columns (a 2-D grid, so even M = 1 gets
  K/1024 programs), BM rows so that a tile is ~4K elements.
- swizzled scales: the kernel stores each scale at its F8_128x4 offset directly; the
  grid covers the M real rows plus a few programs that store only the zero scale words
  of the padding rows up to pad128(M) (no memset).
- standalone swizzle (after the SP gather): `[128, 16]` blocks on a 2-D grid.

Variants (tools/kernel_variants.py) are configs passed explicitly (`config=`);
tools/bench_kernels.py times them in one run and the GPU tests check each bitwise.

Importing this module compiles nothing and makes no CUDA call; kernels compile on first
launch. The kernels' int arguments that vary with M are excluded from Triton's value
specialization so a new M never recompiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfuse.ops.mx_layout import SWIZZLE_COLUMN_TILE, padded_rows, padded_scale_columns, scale_columns
from mxfuse.ops.norm_quant_config import PAD_ROWS, NormConfig, norm_config, row_chunks
from mxfuse.ops.reference import QuantRule
from mxfuse.ops.triton_mx_quant import (
    MxSpec,
    _mx_epilogue,
    _zero_pad_scales,
    check2d,
    check_k,
    mx_dst,
    out_views,
    quant_launch,
    quantize,
    rule_name,
    run,
    swizzle_launch,
    swizzle_scales,
)
from mxfuse.ops.triton_norm_prologue import NormIo, NormSpec, _load_weight, _norm_rows, _normalize
from mxfuse.ops.triton_targets import Isa, KernelLaunch, device_isa, launch_hints, pdl_enter, sm_count

__all__ = [
    "fused_norm_quant",
    "gemma_norm",
    "norm_launch",
    "quant_launch",
    "quantize",
    "swizzle_launch",
    "swizzle_scales",
]


# --------------------------------------------------------------------------- the norm kernel


@triton.jit
def _norm_tile(tile, part, cols, w, io, dst, M, scale_rows, K, eps, F: tl.constexpr, MX: tl.constexpr):
    """BM whole rows of x (+ residual), rows `tile * BM ..`: the prologue (:func:`_norm_rows`),
    then per chunk y (the unfused norm) or the MXFP8 epilogue. `cols` and `w` are the NCH
    column ranges and the fp32 `w + weight_offset` chunks (:func:`_load_weight`).

    SPLIT > 1: this program (`part` of SPLIT) reads and reduces the whole rows like every
    other part (the same code, so the same bits), but stores the residual, normalizes,
    quantizes and stores only the chunks J with J % SPLIT == part: at decode sizes a row's
    tail work is spread over SPLIT SMs; the extra reads of the row hit L2.
    """
    # bundle fields passed on as arguments are bound to constexprs first (Triton 3.6 passes
    # a field of a constexpr NamedTuple on as a plain Python value)
    BM: tl.constexpr = F.BM
    CH: tl.constexpr = F.CH
    NCH: tl.constexpr = F.NCH
    ROUND_NORMALIZED: tl.constexpr = F.ROUND_NORMALIZED
    rows = tile.to(tl.int64) * BM + tl.arange(0, BM)
    row_mask = rows < M
    s, rstd = _norm_rows(rows, row_mask, part, cols, io, K, eps, F, MX)
    for j in tl.static_range(NCH):
        if F.SPLIT == 1 or part == j % F.SPLIT:
            yf, y = _normalize(s[j], w[j], rstd, io.x_ptr.dtype.element_ty, ROUND_NORMALIZED)
            mask = row_mask[:, None] & (cols[j] < K)[None, :]
            if F.QUANT:
                _mx_epilogue(yf, y, rows, cols[j], mask, j * (CH // 32), K, dst, scale_rows, BM, CH, MX)
            else:
                tl.store(dst.y_ptr + rows[:, None] * K + cols[j][None, :], y, mask=mask)


@triton.jit(do_not_specialize=["M", "scale_rows", "n_tiles"])
def _norm_kernel(io, dst, M, scale_rows, n_tiles, K, eps, weight_offset, F: tl.constexpr, MX: tl.constexpr):
    """Unfused norm (F.QUANT False: writes y) or fused norm+quant (F.QUANT True).

    `io`: :class:`NormIo`; `dst`: `triton_mx_quant.MxDst` (y, codes, scales); `F`:
    :class:`NormSpec`; `MX`: `triton_mx_quant.MxSpec`. A row is NCH (1..4) chunks of CH
    columns (a power of two), held in registers. One tile of BM rows per program, or
    (PERSISTENT) tiles pid, pid + grid, ... of the `n_tiles`, the weight loaded and
    converted once per program; LOOP_STAGES > 1 lets Triton's pipeliner fetch the rows of
    the next LOOP_STAGES - 1 tiles (cp.async into shared memory) while one is computed.

    `scale_rows`: rows of the scale buffer (pad128(M) when SWIZZLED, else M). PAD_FILL
    (swizzled scales only): the `n_tiles` tiles cover the M real rows, and the programs
    after them (pid >= n_tiles) only write the zero scale words of the padding rows
    M .. pad128(M) (PAD_ROWS rows each); otherwise the tiles cover pad128(M) rows and the
    padding rows run the norm on zeros (which gives scale byte 0).
    """
    NCH: tl.constexpr = F.NCH
    CH: tl.constexpr = F.CH
    PAD_ROWS: tl.constexpr = F.PAD_ROWS
    PAD_WORDS: tl.constexpr = F.PAD_WORDS
    LOOP_STAGES: tl.constexpr = F.LOOP_STAGES
    UNPACK: tl.constexpr = F.UNPACK
    ISA: tl.constexpr = MX.ISA
    pid = tl.program_id(0)
    part = tl.program_id(1)
    stored_scale_rows = M if F.PAD_FILL else scale_rows  # PAD_FILL: the pad programs store the rest
    pdl_enter(F.PDL)  # before the first load: x / residual are the kernels' before this one
    if F.PERSISTENT:
        cols, w = _load_weight(io.w_ptr, K, weight_offset, NCH, CH, UNPACK, ISA)  # once per program
        for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=LOOP_STAGES):
            _norm_tile(t, part, cols, w, io, dst, M, stored_scale_rows, K, eps, F, MX)
        if F.PAD_FILL:
            for p in range(pid, tl.cdiv(scale_rows - M, PAD_ROWS), tl.num_programs(0)):
                _zero_pad_scales(dst, M + p.to(tl.int64) * PAD_ROWS, 0, scale_rows, PAD_ROWS, PAD_WORDS)
    elif not F.PAD_FILL or pid < n_tiles:  # the constexpr True without PAD_FILL: no branch
        cols, w = _load_weight(io.w_ptr, K, weight_offset, NCH, CH, UNPACK, ISA)
        _norm_tile(pid, part, cols, w, io, dst, M, stored_scale_rows, K, eps, F, MX)
    else:
        p = (pid - n_tiles) * F.SPLIT + part
        _zero_pad_scales(dst, M + p.to(tl.int64) * PAD_ROWS, 0, scale_rows, PAD_ROWS, PAD_WORDS)


# --------------------------------------------------------------------------- launchers


def norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    quant: bool,
    isa: Isa,
    swizzled: bool = False,
    emit_y: bool = False,
    round_sum: bool = False,
    round_normalized: bool = False,
    weight_offset: float = 1.0,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    config: NormConfig | None = None,
    rule: int = QuantRule.DEFAULT,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales, residual_out, y), launch)` of the norm kernel (quant False: the
    unfused norm, codes / scales None) without running it; launch None when there is
    nothing to do. The outputs are allocated on x's device (a meta device works)."""
    check2d("x", x)
    m, k = x.shape
    check_k(k)
    dev = x.device
    has_res = residual is not None
    if has_res:
        check2d("residual", residual)
    weight = weight.contiguous()
    swizzled = bool(quant and swizzled)
    scale_rows = padded_rows(m) if swizzled else m
    res_out = torch.empty((m, k), dtype=x.dtype, device=dev) if has_res else None
    y = torch.empty((m, k), dtype=x.dtype, device=dev) if (emit_y or not quant) else None
    codes = scales = None
    if quant:
        codes, scales = out_views(m, k, swizzled, dev, out_codes, out_scales)
    elif out_codes is not None or out_scales is not None:
        raise ValueError("triton_norm_quant: out_codes / out_scales need quant")
    outputs = (codes, scales, res_out, y)
    rule = rule_name(rule)
    if scale_rows == 0:
        return outputs, None
    cfg = config or norm_config(k, m, plain_quant=bool(quant and not has_res), isa=isa, sms=sm_count(dev))
    ch, nch = row_chunks(k, cfg.chunk_cols)
    pdl = launch_hints(isa, cfg.pdl).pdl
    split = max(1, cfg.split)
    pad_fill = swizzled and cfg.scale_padding == "fill"
    n_tiles = triton.cdiv(m if pad_fill else scale_rows, cfg.block_rows)
    n_pad = triton.cdiv(triton.cdiv(scale_rows - m, PAD_ROWS), split) if pad_fill else 0
    grid = (min(n_tiles, cfg.persistent * sm_count(dev)) if cfg.persistent else n_tiles + n_pad, split)
    r = residual if has_res else x
    io = NormIo(x, r, weight, res_out if has_res else x, x.stride(0), r.stride(0))
    y_out = y if y is not None else x
    if quant:
        dst = mx_dst(y_out, codes, scales, k)
    else:  # the unfused norm stores y only
        dst = mx_dst(y_out, x, x, k)._replace(stride_q=k, stride_s=scale_columns(k))
    args = (io, dst, m, scale_rows, n_tiles, k, float(eps), float(weight_offset))
    spec = NormSpec(
        HAS_RES=has_res,
        QUANT=bool(quant),
        ROUND_SUM=bool(round_sum and has_res),
        ROUND_NORMALIZED=bool(round_normalized),
        BM=cfg.block_rows,
        CH=ch,
        NCH=nch,
        TREE=cfg.tree,
        RSQRT=cfg.rsqrt,
        EVICT_FIRST=bool(cfg.evict_first),
        PERSISTENT=bool(cfg.persistent),
        SPLIT=split,
        LOAD_FENCE=bool(cfg.load_fence),
        PAD_FILL=pad_fill,
        PAD_ROWS=PAD_ROWS,
        PAD_WORDS=triton.next_power_of_2(max(1, padded_scale_columns(k) // SWIZZLE_COLUMN_TILE)),
        LOOP_STAGES=cfg.loop_stages,
        PDL=pdl,
        UNPACK=cfg.unpack,
    )
    mx = MxSpec(swizzled, bool(emit_y and quant), cfg.quant_ops, cfg.scale_store, rule, isa)
    constexprs = dict(F=spec, MX=mx)
    return outputs, KernelLaunch(_norm_kernel, grid, args, constexprs, cfg.num_warps, fp_fusion=False, pdl=pdl)


def gemma_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    weight_offset: float = 1.0,
    round_normalized: bool = False,
    config: NormConfig | None = None,
):
    """Unfused norm: `(y, residual_out)` (residual_out is None without a residual).

    `weight_offset`: added to the fp32 weight (1.0: Gemma; 0.0: the standard norm).
    `round_normalized`: round `s * rstd` to the dtype before the weight multiply (the
    Hugging Face `LlamaRMSNorm` order). `config`: launch shape / variant (default
    `norm_config`); its `tree` and `rsqrt` must match the fused op's for the two to agree
    bitwise.
    """
    isa = device_isa(x.device)
    outputs, launch = norm_launch(
        x,
        residual,
        weight,
        eps,
        quant=False,
        isa=isa,
        weight_offset=weight_offset,
        round_normalized=round_normalized,
        config=config,
    )
    _, _, res_out, y = run(outputs, launch)
    return y, res_out


def fused_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    swizzled: bool = False,
    emit_y: bool = False,
    round_sum: bool = False,
    round_normalized: bool = False,
    weight_offset: float = 1.0,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    config: NormConfig | None = None,
    rule: int = QuantRule.DEFAULT,
):
    """Norm (+add) and MXFP8 quant in one launch: `(codes, scales, residual_out|None, y|None)`.

    `out_codes` (`[M, K]` e4m3) / `out_scales` (`[M, K/32]` uint8, row-major only): write
    into these caller-provided 2-D views (any row stride, unit last stride), e.g.
    `packed[:, :K].view(float8_e4m3fn)` and `packed[:, K:]` of a row-packed byte buffer;
    they are returned as `codes` / `scales`. Only addresses change: same bits.
    `round_normalized`, `weight_offset`, `config`: as in :func:`gemma_norm`.
    `rule`: a `reference.QuantRule` value (0 DEFAULT, 1 TORCHAO), as the quant ops take it.
    """
    isa = device_isa(x.device)
    outputs, launch = norm_launch(
        x,
        residual,
        weight,
        eps,
        quant=True,
        isa=isa,
        swizzled=swizzled,
        emit_y=emit_y,
        round_sum=round_sum,
        round_normalized=round_normalized,
        weight_offset=weight_offset,
        out_codes=out_codes,
        out_scales=out_scales,
        config=config,
        rule=rule,
    )
    return run(outputs, launch)
