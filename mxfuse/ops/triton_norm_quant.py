"""Triton kernels for the `mxfuse::` norm and quant ops (CUDA impls of :mod:`mxfuse.ops.library`).

Functions (all take 2-D `[M, K]` rows with a unit last stride; the row stride may differ
from K; M may be 0; K % 32 == 0):

- :func:`gemma_norm` -- Gemma RMSNorm, plain or with the residual add (unfused norm).
- :func:`quantize` -- MXFP8 quantization, row-major or F8_128x4-swizzled scales.
- :func:`fused_norm_quant` -- norm (+add) and quant in one launch, optionally writing y.
- :func:`swizzle_scales` -- row-major E8M0 scales to the F8_128x4 layout.

Design
======

Bitwise contract. Quantization is elementwise except for the block amax, and `max` is
exact and order-free, so any tiling quantizes the same bits. The default code leans on
the hardware's IEEE semantics (`quant_ops="hw"`): `tl.max` is maxNum, which skips NaN (a
block of only NaN gives NaN, which the FLT_MIN floor, also maxNum, turns into FLT_MIN),
and the fp32 -> e4m3 cast is `cvt.rn.satfinite`, which maps +-Inf to +-448 and keeps NaN;
the E8M0 scale and the `2**(127 - sb)` multiplier are built from bits. The spelled-out
form (`where` before the max, a clamp before the cast) gives the same bits on the GPU
(tests/test_gpu_kernels.py::test_variants_bitwise) with two more instructions per
element. The one order-dependent operation is the norm's sum of squares:

- a row is split into NCH <= 4 chunks of CH = max(128, next_pow2(K) / 4) columns (CH a
  power of two; the last chunk zero-padded);
- the squares are first added ELEMENTWISE across chunks, ``(a^2 + b^2) + (c^2 + d^2)``
  (an absent chunk is omitted; adding an exact +0 would change nothing);
- the resulting CH-vector is summed by `tl.sum` (`tree="native"`, the default): its
  order is fixed by the register layout of the row, i.e. by (CH, rows per tile,
  num_warps), which :func:`norm_config` derives from K alone. `tree="pairwise"` is
  the layout-free alternative (:func:`_pairwise_sum`: every level a ``tl.sum`` over an
  axis of size 2); it costs four more barriers per row (docs/perf_notes.md).

The fused and the unfused norm are the same kernel (`QUANT` constexpr) with the same
config, and share every helper. All kernels are compiled with ``enable_fp_fusion=False``
so LLVM cannot contract a multiply and an add into an FMA in one variant and not in
another. ``/K`` is the correctly rounded ``div_rn``; ``1/sqrt`` is ``rsqrt.approx.f32``
(`rsqrt="approx"`, relative error < 2**-22: y stays within one ulp of the CPU reference;
`rsqrt="rn"` keeps the correctly rounded ``div_rn(1, sqrt_rn(.))`` at ~0.1 µs more per
decode launch). Consequences: fused == unfused bitwise, and results are batch invariant
(a row gives the same bits in any batch: M only picks launch choices that do not change
a bit, `split` and `evict_first`).

Regimes (launch shapes; the arithmetic of a row is the same in all of them; numbers in
docs/perf_notes.md):

- norm / fused norm+quant: a program owns tiles of BM whole rows, all NCH chunks in
  registers, one pass: read the weight, then x (+ residual) once (a barrier keeps the
  weight loads ahead of the rows'), write residual_out, y (optional) and codes + scales.
  Large K uses BM = 1, ~32 values of the padded row per thread (8 warps for K = 6144, 4
  for K = 3072). The flags (residual rounding, y, scale layout) are constexpr: runtime
  flags put branches between the loads and their use, and the weight loads then waited
  for x's round trip.
- decode sizes (M <= 16, row-major scales): `split` = one program per chunk; each reads
  and reduces the whole row (the same code, so the same bits) and finishes one chunk,
  so a row's quant tail runs on NCH SMs. 17..1024 rows: evict_first on the row loads.
- scales are stored with an inline ``st.global.u8`` from the layout in which the block
  amax was reduced (`tl.store` moved them through shared memory with two barriers per
  chunk).
- quant: ``[BM, BC]`` tiles with BC <= 1024 columns (a 2-D grid, so even M = 1 gets
  K/1024 programs), BM rows so that a tile is ~4K elements.
- swizzled scales: the kernel stores each scale at its F8_128x4 offset directly; the
  grid covers pad128(M) rows and pad4(K/32) columns (CH >= 128 makes the chunks cover
  them), so the zero padding is written by the same launch (no memset).
- standalone swizzle (after the SP gather): `[128, 16]` blocks on a 2-D grid. One program
  per 128 rows moved all K/32 columns (24 KB of byte stores at K = 6144) alone at decode
  sizes: ~8 µs of the packed+swizzle SP variant (docs/sp_notes.md).

Variants (:data:`VARIANTS`, :class:`NormConfig`) are passed explicitly (`config=`);
tools/bench_kernels.py times them all in one run and the GPU tests check each bitwise.

Importing this module compiles nothing and makes no CUDA call; kernels compile on first
launch. The kernels' int arguments that vary with M are excluded from Triton's value
specialization so a new M never recompiles.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE

SWIZZLE_BLOCK_COLS = 16  # scale columns per program of the standalone swizzle (x 128 rows = 2 KB)

__all__ = [
    "NormConfig",
    "QuantConfig",
    "fused_norm_quant",
    "gemma_norm",
    "norm_config",
    "quant_config",
    "quantize",
    "swizzle_scales",
]


# --------------------------------------------------------------------------- helpers


@triton.jit
def _pairwise_sum(v, BM: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """Fixed-tree sum along axis 1 of a `[BM, N]` fp32 tile (N a power of two).

    Pairwise, bottom-up: level i adds columns 2j and 2j+1 of level i-1. Each level is a
    sum over an axis of size 2 (one commutative IEEE add), so the result does not depend
    on the layout, on BM or on num_warps.
    """
    for i in tl.static_range(LOG_N):
        v = tl.sum(tl.reshape(v, [BM, (N // 2) >> i, 2]), axis=2)
    return tl.reshape(v, [BM])


@triton.jit
def _row_sum(v, BM: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, TREE: tl.constexpr):
    """Sum of squares of a row: the pairwise tree (TREE 0: layout-free) or Triton's own
    reduction (TREE 1: fixed by the layout, i.e. by the launch config, which then must
    depend on K alone)."""
    if TREE == 0:
        return _pairwise_sum(v, BM, N, LOG_N)
    else:
        return tl.sum(v, axis=1)


@triton.jit
def _load_chunk(ptr, rows, stride, cols, row_mask, K, EVICT_FIRST: tl.constexpr):
    """`[BM, CH]` tile of rows `rows` and columns `cols` (zero outside the matrix)."""
    mask = row_mask[:, None] & (cols < K)[None, :]
    if EVICT_FIRST:
        return tl.load(
            ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
        )
    else:
        return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_weight(w_ptr, cols, K, weight_offset):
    return tl.load(w_ptr + cols[None, :], mask=(cols < K)[None, :], other=0.0).to(tl.float32) + weight_offset


@triton.jit
def _sum_chunk(
    x, r, ro_ptr, rows, cols, row_mask, K, part,
    HAS_RES: tl.constexpr, ROUND_SUM: tl.constexpr, J: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """fp32 `s = x (+ r)` of one chunk; stores residual_out = s.to(dtype) when HAS_RES
    (only the program `part` that owns chunk J when a row is split over SPLIT programs)."""
    s = x.to(tl.float32)
    if HAS_RES:
        s = s + r.to(tl.float32)
        ro = s.to(x.dtype)
        mask = row_mask[:, None] & (cols < K)[None, :]
        if SPLIT == 1:  # noqa: SIM114  (constexpr: no runtime branch when a row is not split)
            tl.store(ro_ptr + rows[:, None] * K + cols[None, :], ro, mask=mask)
        elif part == J % SPLIT:
            tl.store(ro_ptr + rows[:, None] * K + cols[None, :], ro, mask=mask)
        if ROUND_SUM:
            s = ro.to(tl.float32)
    return s


@triton.jit
def _rstd(ssq, K, eps, BM: tl.constexpr, RSQRT: tl.constexpr):
    """RSQRT 0: `1 / sqrt(ssq / K + eps)` with correctly rounded divide and sqrt (what
    torch's CPU ops compute: three dependent IEEE operations, ~0.1 µs of a decode-sized
    launch); RSQRT 1: `rsqrt.approx.f32` of the same (one MUFU op, relative error
    < 2**-22; not the `.ftz` form `tl.math.rsqrt` emits, which turns a subnormal
    `ssq / K + eps` (eps = 0) into +Inf)."""
    var = tl.math.div_rn(ssq, K.to(tl.float32))
    if RSQRT == 0:
        return tl.math.div_rn(tl.full([BM], 1.0, tl.float32), tl.math.sqrt_rn(var + eps))
    else:
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [var + eps], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _finish_chunk(
    s, w, rstd, y_ptr, q_ptr, sc_ptr, rows, cols, row_mask, K, stride_q, stride_s, M_grid, S, SP, part,
    dtype: tl.constexpr, QUANT: tl.constexpr, EMIT_Y: tl.constexpr, SWIZZLED: tl.constexpr, BM: tl.constexpr,
    CH: tl.constexpr, J: tl.constexpr, QUANT_OPS: tl.constexpr, SCALE_STORE: tl.constexpr, SPLIT: tl.constexpr,
    RULE: tl.constexpr,
):  # fmt: skip
    """Chunk J (columns J*CH ..), by the program that owns it: see :func:`_finish_owned`."""
    if SPLIT == 1:  # noqa: SIM114  (constexpr: no runtime branch when a row is not split)
        _finish_owned(s, w, rstd, y_ptr, q_ptr, sc_ptr, rows, cols, row_mask, K, stride_q, stride_s, M_grid, S, SP,
                      dtype, QUANT, EMIT_Y, SWIZZLED, BM, CH, J, QUANT_OPS, SCALE_STORE, RULE)  # fmt: skip
    elif part == J % SPLIT:
        _finish_owned(s, w, rstd, y_ptr, q_ptr, sc_ptr, rows, cols, row_mask, K, stride_q, stride_s, M_grid, S, SP,
                      dtype, QUANT, EMIT_Y, SWIZZLED, BM, CH, J, QUANT_OPS, SCALE_STORE, RULE)  # fmt: skip


@triton.jit
def _finish_owned(
    s, w, rstd, y_ptr, q_ptr, sc_ptr, rows, cols, row_mask, K, stride_q, stride_s, M_grid, S, SP,
    dtype: tl.constexpr, QUANT: tl.constexpr, EMIT_Y: tl.constexpr, SWIZZLED: tl.constexpr, BM: tl.constexpr,
    CH: tl.constexpr, J: tl.constexpr, QUANT_OPS: tl.constexpr, SCALE_STORE: tl.constexpr, RULE: tl.constexpr,
):  # fmt: skip
    """Chunk J (columns J*CH ..): y = (s * rstd) * w rounded to dtype; store y (norm) or quantize it and
    store codes + scales."""
    yf = (s * rstd[:, None]) * w
    y = yf.to(dtype)
    mask = row_mask[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    if QUANT:
        if EMIT_Y:
            tl.store(y_ptr + offs, y, mask=mask)
        if QUANT_OPS == 2 and dtype == tl.bfloat16 and not EMIT_Y:
            codes, sb = _mx_quant_tile(_round_bf16_pairs(yf), BM, CH, QUANT_OPS, RULE)
        else:
            codes, sb = _mx_quant_tile(y.to(tl.float32), BM, CH, QUANT_OPS, RULE)
        # 8 codes (8 bytes) per thread: the register layout of the 16-byte bf16 accesses,
        # so no shared-memory layout conversion between the loads and the code stores.
        # Codes rows are `stride_q` bytes apart (K, or K + K/32 in a row-packed buffer).
        q_offs = rows[:, None] * stride_q + cols[None, :]
        tl.store(q_ptr + tl.max_contiguous(q_offs, [1, 8]), codes, mask=mask)
        scols = J * (CH // 32) + tl.arange(0, CH // 32)
        if SWIZZLED and RULE == 1:
            # the pad4 columns past K/32 hold zeros; under TORCHAO a row whose y is NaN
            # (all-zero row, eps = 0) would make their all-zero blocks NaN (scale 255)
            sb = tl.where(scols[None, :] < S, sb, 0)
        _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, SWIZZLED, stride_s, SCALE_STORE)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _round_bf16_pairs(v):
    """fp32 -> bf16 (round to nearest even) -> fp32, two values per `cvt.rn.bf16x2.f32`
    (the same rounding as `.to(bfloat16).to(float32)`, which converts one value per F2F)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $3, $2; shl.b32 $0, p, 16; and.b32 $1, p, 0xffff0000; }",
        "=r,=r,r,r", [v], dtype=tl.float32, is_pure=True, pack=2,
    )  # fmt: skip


@triton.jit
def _max_nan(a, b):
    """NaN-propagating max (`max.NaN.f32`): a block's amax is NaN if any of its values is."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _mx_quant_tile(v, BM: tl.constexpr, BC: tl.constexpr, QUANT_OPS: tl.constexpr, RULE: tl.constexpr):
    """MXFP8 of a `[BM, BC]` fp32 tile: e4m3 codes `[BM, BC]` and E8M0 scales `[BM, BC/32]` (int32).

    QUANT_OPS 0 (hardware semantics, fewer instructions): `tl.max` is IEEE maxNum, which
    skips NaN (a block of only NaN gives NaN, which the FLT_MIN floor, also maxNum, turns
    into FLT_MIN), and the fp32 -> e4m3 cast is `cvt.rn.satfinite`, which maps +-Inf to
    +-448 and keeps NaN. QUANT_OPS 1 spells both out (`where` before the max, a clamp
    before the cast): the same bits, two instructions more per element.

    RULE (`reference.QuantRule`, constexpr: the default code is not touched by the other
    branch): 0 DEFAULT (docs/design.md); 1 TORCHAO (torchao's RCEIL: a NaN makes the block's
    scale 255 and all 32 of its codes NaN; a block with scale byte 0 is multiplied by 1.0
    instead of 2**127). The amax is then the NaN-propagating max (one `max.NaN` per element
    instead of maxNum: no extra instruction), so a NaN block is `amax != amax`; its scale
    is computed from FLT_MIN (the floor is maxNum) and then replaced.
    """
    v3 = tl.reshape(v, [BM, BC // 32, 32])
    a = tl.abs(v3)
    if RULE == 1:
        amax = tl.reduce(a, 2, _max_nan)
        nan_block = amax != amax  # noqa: PLR0124  (NaN test)
    else:
        if QUANT_OPS == 1:
            a = tl.where(a != a, 0.0, a)  # noqa: PLR0124  (NaN does not take part in the amax)
        amax = tl.max(a, axis=2)
    amax = tl.maximum(amax, 1.1754943508222875e-38)  # FLT_MIN (smallest normal); maxNum: NaN -> FLT_MIN
    bits = amax.to(tl.int32, bitcast=True)
    biased_exp = bits >> 23
    sb = biased_exp - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    sb = tl.where(biased_exp == 255, 254, sb)  # +Inf amax
    sb = tl.where(sb < 0, 0, sb)
    sb = tl.where(sb > 254, 254, sb)
    e = 254 - sb  # biased exponent of 2**(127 - sb)
    mbits = tl.where(e == 0, 0x00400000, e << 23)  # e == 0: 2**-127 (subnormal)
    if RULE == 1:  # torchao's RCEIL
        mbits = tl.where(sb == 0, 0x3F800000, mbits)  # 1.0
        mbits = tl.where(nan_block, 0x7FC00000, mbits)  # NaN: every code of the block NaN
        sb = tl.where(nan_block, 255, sb)
    mult = mbits.to(tl.float32, bitcast=True)
    q = v3 * mult[:, :, None]
    if QUANT_OPS == 1:
        # Finite values are within +-448 by construction; this maps +-Inf to +-448 and keeps
        # NaN (propagate_nan=ALL lowers to the NaN-propagating min/max, never NaN-dropping).
        q = tl.clamp(q, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    codes = tl.reshape(q.to(tl.float8e4nv), [BM, BC])
    return codes, sb


@triton.jit
def _store_u8_in_place(ptrs, val, mask):
    """`st.global.u8` from the operand's own register layout.

    `tl.store` would first move the scales (one per 32-element block, held by the 4 lanes
    that reduced it) into the layout Triton's coalescing picks, through shared memory with
    two barriers per chunk; the lanes holding copies of a scale store the same byte.
    """
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.u8 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptrs, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, SWIZZLED: tl.constexpr, stride_s, SCALE_STORE: tl.constexpr):
    """Store `[BM, NB]` scales at row-major `[M, S]` (rows `stride_s` bytes apart) or F8_128x4
    `[pad128(M), SP]` offsets."""
    r2 = rows[:, None]
    c2 = scols[None, :]
    if SWIZZLED:
        off = (r2 // 128) * (SP * 128) + (c2 // 4) * 512 + (r2 % 32) * 16 + ((r2 // 32) % 4) * 4 + (c2 % 4)
        mask = (r2 < M_grid) & (c2 < SP)
    else:
        off = r2 * stride_s + c2
        mask = (r2 < M_grid) & (c2 < S)
    if SCALE_STORE == 0:
        _store_u8_in_place(sc_ptr + off, sb, mask)
    else:
        tl.store(sc_ptr + off, sb.to(tl.uint8), mask=mask)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _norm_tile(
    tile, part, x_ptr, r_ptr, w_ptr, ro_ptr, y_ptr, q_ptr, sc_ptr, M, M_grid, K, stride_x, stride_r, stride_q, stride_s,
    S, SP, eps, weight_offset,
    HAS_RES: tl.constexpr, QUANT: tl.constexpr, ROUND_SUM: tl.constexpr, EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr, LOG_CH: tl.constexpr,
    TREE: tl.constexpr, RSQRT: tl.constexpr, QUANT_OPS: tl.constexpr, SCALE_STORE: tl.constexpr,
    EVICT_FIRST: tl.constexpr, SPLIT: tl.constexpr, LOAD_FENCE: tl.constexpr, RULE: tl.constexpr,
):  # fmt: skip
    """BM whole rows: all loads (x, residual, weight) issued before any use, one pass.

    SPLIT > 1: this program (`part` of SPLIT) reads and reduces the whole rows like every
    other part (the same code, so the same bits), but normalizes, quantizes and stores
    only the chunks J with J % SPLIT == part: at decode sizes a row's tail work is spread
    over SPLIT SMs; the extra reads of the row hit L2.
    """
    dtype = x_ptr.dtype.element_ty
    ca = tl.arange(0, CH)
    cb = ca + CH
    cc = ca + 2 * CH
    cd = ca + 3 * CH
    rows = tile.to(tl.int64) * BM + tl.arange(0, BM)
    rm = rows < M
    # ---- all loads first: the weight, then the rows (the flags are constexpr: no branch
    # between the loads and their first use)
    wa = _load_weight(w_ptr, ca, K, weight_offset)
    wb = wa
    wc = wa
    wd = wa
    if NCH > 1:
        wb = _load_weight(w_ptr, cb, K, weight_offset)
    if NCH > 2:
        wc = _load_weight(w_ptr, cc, K, weight_offset)
    if NCH > 3:
        wd = _load_weight(w_ptr, cd, K, weight_offset)
    if LOAD_FENCE:
        # ptxas otherwise issues the weight loads only after the first use of x (after x's
        # round trip: a second, dependent one, exposed once the reduction is short); the
        # barrier keeps them ahead of the x / residual loads.
        tl.debug_barrier()
    xa = _load_chunk(x_ptr, rows, stride_x, ca, rm, K, EVICT_FIRST)
    xb = xa
    xc = xa
    xd = xa
    if NCH > 1:
        xb = _load_chunk(x_ptr, rows, stride_x, cb, rm, K, EVICT_FIRST)
    if NCH > 2:
        xc = _load_chunk(x_ptr, rows, stride_x, cc, rm, K, EVICT_FIRST)
    if NCH > 3:
        xd = _load_chunk(x_ptr, rows, stride_x, cd, rm, K, EVICT_FIRST)
    ra = xa
    rb = xb
    rc = xc
    rd = xd
    if HAS_RES:
        ra = _load_chunk(r_ptr, rows, stride_r, ca, rm, K, EVICT_FIRST)
        if NCH > 1:
            rb = _load_chunk(r_ptr, rows, stride_r, cb, rm, K, EVICT_FIRST)
        if NCH > 2:
            rc = _load_chunk(r_ptr, rows, stride_r, cc, rm, K, EVICT_FIRST)
        if NCH > 3:
            rd = _load_chunk(r_ptr, rows, stride_r, cd, rm, K, EVICT_FIRST)
    # ---- s, residual_out, and the fixed-tree sum of squares: elementwise over the
    # chunks, (a^2 + b^2) + (c^2 + d^2) (absent chunks omitted: adding an exact +0
    # changes nothing), then the tree over the CH columns.
    sa = _sum_chunk(xa, ra, ro_ptr, rows, ca, rm, K, part, HAS_RES, ROUND_SUM, 0, SPLIT)
    sb_ = sa
    sc_ = sa
    sd_ = sa
    v = sa * sa
    if NCH > 1:
        sb_ = _sum_chunk(xb, rb, ro_ptr, rows, cb, rm, K, part, HAS_RES, ROUND_SUM, 1, SPLIT)
        v = v + sb_ * sb_
    if NCH > 2:
        sc_ = _sum_chunk(xc, rc, ro_ptr, rows, cc, rm, K, part, HAS_RES, ROUND_SUM, 2, SPLIT)
        if NCH > 3:
            sd_ = _sum_chunk(xd, rd, ro_ptr, rows, cd, rm, K, part, HAS_RES, ROUND_SUM, 3, SPLIT)
            v = v + (sc_ * sc_ + sd_ * sd_)
        else:
            v = v + sc_ * sc_
    rstd = _rstd(_row_sum(v, BM, CH, LOG_CH, TREE), K, eps, BM, RSQRT)
    # ---- y (and quant) per chunk
    _finish_chunk(sa, wa, rstd, y_ptr, q_ptr, sc_ptr, rows, ca, rm, K, stride_q, stride_s, M_grid, S, SP, part,
                  dtype, QUANT, EMIT_Y, SWIZZLED, BM, CH, 0, QUANT_OPS, SCALE_STORE, SPLIT, RULE)  # fmt: skip
    if NCH > 1:
        _finish_chunk(sb_, wb, rstd, y_ptr, q_ptr, sc_ptr, rows, cb, rm, K, stride_q, stride_s, M_grid, S, SP, part,
                      dtype, QUANT, EMIT_Y, SWIZZLED, BM, CH, 1, QUANT_OPS, SCALE_STORE, SPLIT, RULE)  # fmt: skip
    if NCH > 2:
        _finish_chunk(sc_, wc, rstd, y_ptr, q_ptr, sc_ptr, rows, cc, rm, K, stride_q, stride_s, M_grid, S, SP, part,
                      dtype, QUANT, EMIT_Y, SWIZZLED, BM, CH, 2, QUANT_OPS, SCALE_STORE, SPLIT, RULE)  # fmt: skip
    if NCH > 3:
        _finish_chunk(sd_, wd, rstd, y_ptr, q_ptr, sc_ptr, rows, cd, rm, K, stride_q, stride_s, M_grid, S, SP, part,
                      dtype, QUANT, EMIT_Y, SWIZZLED, BM, CH, 3, QUANT_OPS, SCALE_STORE, SPLIT, RULE)  # fmt: skip


@triton.jit(do_not_specialize=["M", "M_grid", "n_tiles"])
def _norm_kernel(
    x_ptr, r_ptr, w_ptr, ro_ptr, y_ptr, q_ptr, sc_ptr, M, M_grid, n_tiles, K, stride_x, stride_r, stride_q, stride_s,
    S, SP, eps, weight_offset,
    HAS_RES: tl.constexpr, QUANT: tl.constexpr, ROUND_SUM: tl.constexpr, EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr, LOG_CH: tl.constexpr,
    TREE: tl.constexpr, RSQRT: tl.constexpr, QUANT_OPS: tl.constexpr, SCALE_STORE: tl.constexpr,
    EVICT_FIRST: tl.constexpr, PERSISTENT: tl.constexpr, SPLIT: tl.constexpr, LOAD_FENCE: tl.constexpr,
    RULE: tl.constexpr, PAD_FILL: tl.constexpr, PAD_ROWS: tl.constexpr, PAD_WORDS: tl.constexpr,
):  # fmt: skip
    """Unfused norm (QUANT=False: writes y) or fused norm+quant (QUANT=True).

    A row is NCH (1..4) chunks of CH columns (CH = max(128, BLOCK_K/4), a power of two),
    held in registers. One tile of BM rows per program, or (PERSISTENT) tiles pid,
    pid + grid, ... of the `n_tiles`.

    PAD_FILL (swizzled scales only): the `n_tiles` tiles cover the M real rows, and the
    programs after them (pid >= n_tiles) only write the zero scale words of the padding
    rows M .. pad128(M) (PAD_ROWS rows each); otherwise the tiles cover pad128(M) rows
    and the padding rows run the norm on zeros (which gives scale byte 0).
    """
    pid = tl.program_id(0)
    part = tl.program_id(1)
    m_store = M if PAD_FILL else M_grid  # scale rows the norm tiles store (PAD_FILL: pad programs the rest)
    if PERSISTENT:
        for t in range(pid, n_tiles, tl.num_programs(0)):
            _norm_tile(t, part, x_ptr, r_ptr, w_ptr, ro_ptr, y_ptr, q_ptr, sc_ptr, M, m_store, K, stride_x, stride_r,
                       stride_q, stride_s, S, SP, eps, weight_offset, HAS_RES, QUANT, ROUND_SUM, EMIT_Y, SWIZZLED, BM,
                       CH, NCH, LOG_CH, TREE, RSQRT, QUANT_OPS, SCALE_STORE, EVICT_FIRST, SPLIT, LOAD_FENCE,
                       RULE)  # fmt: skip
        if PAD_FILL:
            for p in range(pid, tl.cdiv(M_grid - M, PAD_ROWS), tl.num_programs(0)):
                _zero_pad_scales(sc_ptr, p, M, M_grid, SP, PAD_ROWS, PAD_WORDS)
    elif PAD_FILL:
        if pid < n_tiles:
            _norm_tile(pid, part, x_ptr, r_ptr, w_ptr, ro_ptr, y_ptr, q_ptr, sc_ptr, M, m_store, K, stride_x, stride_r,
                       stride_q, stride_s, S, SP, eps, weight_offset, HAS_RES, QUANT, ROUND_SUM, EMIT_Y, SWIZZLED, BM,
                       CH, NCH, LOG_CH, TREE, RSQRT, QUANT_OPS, SCALE_STORE, EVICT_FIRST, SPLIT, LOAD_FENCE,
                       RULE)  # fmt: skip
        else:
            _zero_pad_scales(sc_ptr, (pid - n_tiles) * SPLIT + part, M, M_grid, SP, PAD_ROWS, PAD_WORDS)
    else:
        _norm_tile(pid, part, x_ptr, r_ptr, w_ptr, ro_ptr, y_ptr, q_ptr, sc_ptr, M, m_store, K, stride_x, stride_r,
                   stride_q, stride_s, S, SP, eps, weight_offset, HAS_RES, QUANT, ROUND_SUM, EMIT_Y, SWIZZLED, BM, CH,
                   NCH, LOG_CH, TREE, RSQRT, QUANT_OPS, SCALE_STORE, EVICT_FIRST, SPLIT, LOAD_FENCE, RULE)  # fmt: skip


@triton.jit
def _zero_pad_scales(sc_ptr, p, M, M_grid, SP, PAD_ROWS: tl.constexpr, PAD_WORDS: tl.constexpr):
    """Zero the F8_128x4 scale words of padding rows M + p*PAD_ROWS .. (< M_grid), all SP
    columns. A row's 4 scales of one 4-column group are one aligned 32-bit word (SP % 4 == 0),
    so the padding is stored as words: (r // 128) * SP * 32 + (c // 4) * 128 + (r % 32) * 4
    + (r // 32) % 4, in words."""
    rows = M + p.to(tl.int64) * PAD_ROWS + tl.arange(0, PAD_ROWS)
    cw = tl.arange(0, PAD_WORDS)
    r2 = rows[:, None]
    c2 = cw[None, :]
    off = (r2 // 128) * (SP * 32) + c2 * 128 + (r2 % 32) * 4 + (r2 // 32) % 4
    mask = (r2 < M_grid) & (c2 < SP // 4)
    tl.store(sc_ptr.to(tl.pointer_type(tl.int32)) + off, tl.zeros([PAD_ROWS, PAD_WORDS], tl.int32), mask=mask)


@triton.jit(do_not_specialize=["M", "M_grid"])
def _quant_kernel(
    x_ptr, q_ptr, sc_ptr, M, M_grid, K, stride_x, stride_q, stride_s, S, SP,
    SWIZZLED: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, QUANT_OPS: tl.constexpr, SCALE_STORE: tl.constexpr,
    RULE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_k * BC + tl.arange(0, BC)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    codes, sb = _mx_quant_tile(x.to(tl.float32), BM, BC, QUANT_OPS, RULE)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], codes, mask=mask)
    scols = pid_k * (BC // 32) + tl.arange(0, BC // 32)
    _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, SWIZZLED, stride_s, SCALE_STORE)


@triton.jit(do_not_specialize=["M", "M_grid"])
def _swizzle_kernel(src_ptr, dst_ptr, M, M_grid, stride_src, S, SP, BR: tl.constexpr, BS: tl.constexpr):
    """One `[BR, BS]` block per program: a grid over row tiles AND scale columns, so the few
    rows of a decode-sized gather still spread over many programs."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BS + tl.arange(0, BS)
    mask = (rows < M)[:, None] & (cols < S)[None, :]
    v = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=mask, other=0)
    _store_scales(dst_ptr, v, rows, cols, M_grid, S, SP, True, S, 1)


# --------------------------------------------------------------------------- launch configs


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _block_k(k: int) -> int:
    return max(128, _pow2(k))


class NormConfig(NamedTuple):
    """Launch shape and code variant of the norm / fused norm+quant kernel.

    `tree` and `rsqrt` fix the arithmetic of a row: the fused and the unfused norm must be
    launched with the same two values, and they must not change with M (batch invariance);
    the default depends on K alone. Every other field only moves work between threads
    or instructions: same bits.

    - block_rows: rows per tile (BM); num_warps: warps per program.
    - split: programs per tile; > 1: each reads and reduces the whole rows and finishes
      (normalizes, quantizes, stores) every split-th chunk (decode sizes).
    - persistent: 0 = one program per tile; n = at most n programs per SM, looping over tiles.
    - tree: "pairwise" (the layout-free tree of `_pairwise_sum`) or "native" (`tl.sum`).
    - rsqrt: "rn" (correctly rounded divide and sqrt) or "approx" (`rsqrt.approx.f32`).
    - quant_ops: "hw" (maxNum skips NaN, the satfinite cast saturates Inf) or "explicit"
      (`where` + clamp: same bits, 2 instructions more per element); "hw-bf16x2": "hw" with
      the bf16 rounding of y before the quant done two values per `cvt.rn.bf16x2.f32`
      (bf16 without emit_y; the quant kernel treats it as "hw").
    - scale_store: "in_place" (inline `st.global.u8` from the reduction's layout) or
      "tl_store" (through Triton's coalescing: a shared-memory round trip per chunk).
    - evict_first: evict_first hint on the x / residual loads (streamed once).
    - load_fence: a barrier right after the loads, so that the weight is fetched together
      with x and residual rather than after x's round trip (ptxas's order otherwise).
    - scale_padding (swizzled scales): "fill" = the grid covers the M real rows plus a few
      programs that only store the zero scale words of the padding rows up to pad128(M);
      "norm" = the grid covers pad128(M) rows and the padding rows run the norm on zeros.
    """

    block_rows: int = 1
    num_warps: int = 8
    split: int = 1
    persistent: int = 0
    tree: str = "native"
    rsqrt: str = "approx"
    quant_ops: str = "hw"
    scale_store: str = "in_place"
    evict_first: bool = False
    load_fence: bool = True
    scale_padding: str = "fill"


class QuantConfig(NamedTuple):
    """`[block_rows, block_cols]` tiles of the quant kernel, num_warps, and the code variant
    (`quant_ops`, `scale_store` as in :class:`NormConfig`; same bits for every value)."""

    block_rows: int = 4
    block_cols: int = 1024
    num_warps: int = 8
    quant_ops: str = "hw"
    scale_store: str = "in_place"


_TREES = {"pairwise": 0, "native": 1}
_RSQRTS = {"rn": 0, "approx": 1}
_QUANT_OPS = {"hw": 0, "explicit": 1, "hw-bf16x2": 2}
_SCALE_STORES = {"in_place": 0, "tl_store": 1}
_SCALE_PADDINGS = {"norm": 0, "fill": 1}
PAD_ROWS = 32  # padding rows per zero-fill program (swizzled scales, scale_padding="fill")


def _rule(rule) -> int:
    """The `reference.QuantRule` value as the kernels' RULE constexpr (0 DEFAULT, 1 TORCHAO)."""
    if int(rule) not in (0, 1) or isinstance(rule, bool):
        raise ValueError(f"triton_norm_quant: rule={rule!r} is not a QuantRule (0 DEFAULT, 1 TORCHAO)")
    return int(rule)


def _code(table: dict, field: str, value) -> int:
    if value not in table:
        raise ValueError(f"triton_norm_quant: {field}={value!r} is not one of {sorted(table)}")
    return table[value]


# Launch choices by M, from the H200 sweeps of 2026-12-01 (docs/perf_notes.md, runs 5 and 6): up to
# SPLIT_MAX_ROWS rows (row-major scales only) a row is split over one program per chunk; up
# to EVICT_FIRST_MAX_ROWS rows the x / residual loads carry evict_first. Same bits.
SPLIT_MAX_ROWS = 16
EVICT_FIRST_MAX_ROWS = 1024
TWO_ROWS_MIN_ROWS = 4096  # fused plain norm + quant, K 2049..3072: two rows per tile from here (run 6)


def _chunks(k: int) -> tuple[int, int]:
    """(CH, NCH): a row is NCH chunks of CH columns, CH = max(128, next_pow2(K) / 4)."""
    ch = max(128, _block_k(k) // 4)
    return ch, -(-k // ch)


def norm_config(k: int, m: int | None = None, *, plain_quant: bool = False) -> NormConfig:
    """Default config for M rows of K values (M None: the config of the layout alone);
    `plain_quant`: the fused plain norm + quant (no residual).

    The arithmetic (`tree`, `rsqrt`) and the layout of a row (warps, the values of a row
    each thread holds) depend on K alone, so the reduction tree is fixed per K (batch
    invariant); M only chooses how many programs share a row, how many rows share a
    program's registers and a cache hint, none of which changes a bit
    (tests/test_gpu_kernels.py::test_variants_bitwise). Measured on H200
    (docs/perf_notes.md, runs 5 and 6): ~32 values of the padded row per thread (8 warps
    for K = 6144, 4 for K = 3072); a split row wins at M <= 16, with either scale layout
    (swizzled lost while the 128-row padding ran the norm: 384 programs at M = 1; the
    padding is now zero-filled by a few store-only programs); evict_first wins from 64 to
    1024 rows and loses at 4096 and above; two rows per tile (the weight loaded and
    converted once for both) win for the plain fused kernel at K 3072 from 4096 rows
    (-2..-5%) and lose at K 6144 (8 warps of 98 registers: half the resident programs).
    """
    block_k = _block_k(k)
    bm = 1 if block_k >= 2048 else min(16, 2048 // block_k)
    nw = max(4, min(16, bm * block_k // 1024))
    if m is None:
        return NormConfig(block_rows=bm, num_warps=nw)
    split = _chunks(k)[1] if m <= SPLIT_MAX_ROWS else 1
    evict_first = split == 1 and m <= EVICT_FIRST_MAX_ROWS  # a split row is read SPLIT times: no hint measured
    if plain_quant and m >= TWO_ROWS_MIN_ROWS and block_k == 4096 and _chunks(k)[1] <= 3:  # K 2049..3072
        bm = 2
    return NormConfig(block_rows=bm, num_warps=nw, split=split, evict_first=evict_first)


def row_config(block_k: int, m: int) -> tuple[int, int, int]:
    """(rows per tile, tiles per program, num_warps) of the default config (kept for callers
    that print it; the launch takes a :class:`NormConfig`)."""
    del m
    c = norm_config(block_k)
    return c.block_rows, 1, c.num_warps


def quant_config(k: int, m: int) -> QuantConfig:
    """Default config of the quant kernel (any config gives the same bits)."""
    bc = min(1024, _block_k(k))
    bm = max(1, 4096 // bc)
    bm = max(1, min(bm, _pow2(max(m, 1))))
    nw = max(4, min(8, bm * bc // 512))
    return QuantConfig(block_rows=bm, block_cols=bc, num_warps=nw)


# Variants timed against each other by tools/bench_kernels.py and checked bitwise (fused ==
# unfused, batch invariance) by tests/test_gpu_kernels.py; docs/perf_notes.md has the numbers.
VARIANTS: Mapping[str, NormConfig] = MappingProxyType(
    {
        "v3-ops": NormConfig(
            tree="pairwise", rsqrt="rn", quant_ops="explicit", scale_store="tl_store", load_fence=False
        ),
        "pairwise": NormConfig(tree="pairwise", rsqrt="rn", load_fence=False),
        "native-rn": NormConfig(rsqrt="rn", load_fence=False),
        "native-nofence": NormConfig(load_fence=False),
        "native": NormConfig(),
        "native-rn-split": NormConfig(rsqrt="rn", split=2),
        "native-split-nofence": NormConfig(split=2, load_fence=False),
        "native-split": NormConfig(split=2),
        "native-2rows": NormConfig(block_rows=2),
        "native-evict": NormConfig(evict_first=True),
        "native-persist": NormConfig(persistent=1),
        "native-padnorm": NormConfig(scale_padding="norm"),
        "native-bf16x2": NormConfig(quant_ops="hw-bf16x2"),
        "native-split-padnorm": NormConfig(split=2, scale_padding="norm"),
    }
)


def variant_of(config: NormConfig, k: int) -> str | None:
    """The name of the variant whose config for K is `config` (None if none is)."""
    return next((name for name in VARIANTS if variant(name, k) == config), None)


def variant(name: str, k: int) -> NormConfig:
    """`VARIANTS[name]` with the default launch shape for K: its block_rows multiply a
    one-row default tile (K >= 2048; the rows then sit in registers of the same threads,
    the same per-row layout), split > 1 means one program per chunk, and a persistent variant
    gets as many programs per SM as fit (the loop takes ~80 registers a thread, from
    ptxas for sm_90: 3 programs of 8 warps)."""
    base = norm_config(k)
    entry = VARIANTS[name]
    cfg = entry._replace(
        block_rows=entry.block_rows if base.block_rows == 1 else base.block_rows,
        num_warps=base.num_warps,
        split=_chunks(k)[1] if entry.split > 1 else 1,
    )
    if cfg.persistent:
        cfg = cfg._replace(persistent=max(1, 65536 // (80 * 32 * cfg.num_warps)))
    return cfg


def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


# --------------------------------------------------------------------------- python entry points


def _check2d(name: str, t: torch.Tensor):
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"triton_norm_quant: {name} must be 2-D with a unit last stride, got {tuple(t.shape)} {t.stride()}"
        )


def _out_views(m, k, swizzled, dev, out_codes, out_scales):
    """Codes `[m, k]` e4m3 and scales (row-major `[m, k/32]` or swizzled) buffers: the
    caller's views where given (row-major scales only; any row stride, unit last stride,
    e.g. the two halves of a row-packed `[m, k + k/32]` byte buffer), else new tensors."""
    s, sp = k // BLOCK, _round_up(k // BLOCK, 4)
    m_grid = _round_up(m, 128) if swizzled else m
    if out_codes is None:
        codes = torch.empty((m, k), dtype=FP8_DTYPE, device=dev)
    else:
        codes = out_codes
        if codes.shape != (m, k) or codes.dtype != FP8_DTYPE or codes.device != dev:
            raise ValueError(f"triton_norm_quant: out_codes must be [{m}, {k}] {FP8_DTYPE} on {dev}, got "
                             f"{tuple(codes.shape)} {codes.dtype} {codes.device}")  # fmt: skip
        _check2d("out_codes", codes)
    if out_scales is None:
        scales = torch.empty((m_grid, sp) if swizzled else (m, s), dtype=torch.uint8, device=dev)
    else:
        if swizzled:
            raise ValueError("triton_norm_quant: out_scales is for row-major scales only (swizzled=False)")
        scales = out_scales
        if scales.shape != (m, s) or scales.dtype != torch.uint8 or scales.device != dev:
            raise ValueError(f"triton_norm_quant: out_scales must be [{m}, {s}] uint8 on {dev}, got "
                             f"{tuple(scales.shape)} {scales.dtype} {scales.device}")  # fmt: skip
        _check2d("out_scales", scales)
    return codes, scales


def _row_stride(t: torch.Tensor, default: int) -> int:
    return t.stride(0) if t.shape[0] > 1 else default


def _launch_norm(x, residual, weight, eps, quant, swizzled, emit_y, round_sum, weight_offset,
                 out_codes=None, out_scales=None, config: NormConfig | None = None, rule=0):  # fmt: skip
    _check2d("x", x)
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"triton_norm_quant: K={k} is not a multiple of {BLOCK}")
    dev = x.device
    has_res = residual is not None
    if has_res:
        _check2d("residual", residual)
    weight = weight.contiguous()
    s, sp = k // BLOCK, _round_up(k // BLOCK, 4)
    m_grid = _round_up(m, 128) if (quant and swizzled) else m
    res_out = torch.empty((m, k), dtype=x.dtype, device=dev) if has_res else None
    y = torch.empty((m, k), dtype=x.dtype, device=dev) if (emit_y or not quant) else None
    codes = scales = None
    if quant:
        codes, scales = _out_views(m, k, swizzled, dev, out_codes, out_scales)
    elif out_codes is not None or out_scales is not None:
        raise ValueError("triton_norm_quant: out_codes / out_scales need quant")
    if m_grid == 0:
        return codes, scales, res_out, y
    ch, nch = _chunks(k)
    cfg = config or norm_config(k, m, plain_quant=bool(quant and not has_res))
    rule = _rule(rule)
    bm = cfg.block_rows
    split = max(1, cfg.split)
    pad_fill = bool(quant and swizzled) and _code(_SCALE_PADDINGS, "scale_padding", cfg.scale_padding) == 1
    n_tiles = triton.cdiv(m if pad_fill else m_grid, bm)
    n_pad = triton.cdiv(triton.cdiv(m_grid - m, PAD_ROWS), split) if pad_fill else 0
    if cfg.persistent and cfg.split > 1:
        raise ValueError(f"triton_norm_quant: a persistent grid does not split rows, got {cfg}")
    grid = (min(n_tiles, cfg.persistent * _sm_count(dev)) if cfg.persistent else n_tiles + n_pad, split)
    r = residual if has_res else x
    _norm_kernel[grid](
        x, r, weight, res_out if has_res else x, y if y is not None else x,
        codes if quant else x, scales if quant else x,
        m, m_grid, n_tiles, k, x.stride(0), r.stride(0),
        _row_stride(codes, k) if quant else k, _row_stride(scales, s) if quant else s,
        s, sp, float(eps), float(weight_offset),
        HAS_RES=has_res, QUANT=quant, ROUND_SUM=bool(round_sum and has_res), EMIT_Y=bool(emit_y and quant),
        SWIZZLED=bool(quant and swizzled), BM=bm, CH=ch, NCH=nch, LOG_CH=ch.bit_length() - 1,
        TREE=_code(_TREES, "tree", cfg.tree), RSQRT=_code(_RSQRTS, "rsqrt", cfg.rsqrt),
        QUANT_OPS=_code(_QUANT_OPS, "quant_ops", cfg.quant_ops),
        SCALE_STORE=_code(_SCALE_STORES, "scale_store", cfg.scale_store),
        EVICT_FIRST=bool(cfg.evict_first), PERSISTENT=bool(cfg.persistent), SPLIT=split,
        LOAD_FENCE=bool(cfg.load_fence), RULE=rule, PAD_FILL=pad_fill, PAD_ROWS=PAD_ROWS,
        PAD_WORDS=triton.next_power_of_2(max(1, sp // 4)),
        num_warps=cfg.num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return codes, scales, res_out, y


def gemma_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    config: NormConfig | None = None,
):
    """Unfused Gemma norm: `(y, residual_out)` (residual_out is None without a residual).

    `config`: launch shape / variant (default :func:`norm_config`); its `tree` and `rsqrt`
    must match the fused op's for the two to agree bitwise.
    """
    _, _, res_out, y = _launch_norm(x, residual, weight, eps, False, False, False, False, 1.0, config=config)
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
    weight_offset: float = 1.0,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    config: NormConfig | None = None,
    rule: int = 0,
):
    """Norm (+add) and MXFP8 quant in one launch: `(codes, scales, residual_out|None, y|None)`.

    `out_codes` (`[M, K]` e4m3) / `out_scales` (`[M, K/32]` uint8, row-major only): write
    into these caller-provided 2-D views (any row stride, unit last stride), e.g.
    `packed[:, :K].view(float8_e4m3fn)` and `packed[:, K:]` of a row-packed byte buffer;
    they are returned as `codes` / `scales`. Only addresses change: same bits.
    `config`: launch shape / variant (default :func:`norm_config`), as in :func:`gemma_norm`.
    `rule`: a `reference.QuantRule` value (0 DEFAULT, 1 TORCHAO), as the quant ops take it.
    """
    return _launch_norm(x, residual, weight, eps, True, swizzled, emit_y, round_sum, weight_offset,
                        out_codes, out_scales, config, rule)  # fmt: skip


def quantize(
    x: torch.Tensor,
    swizzled: bool = False,
    *,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    config: QuantConfig | None = None,
    rule: int = 0,
):
    """MXFP8 codes `[M, K]` e4m3 and scales (uint8 `[M, K/32]`, or F8_128x4 `[pad128(M), pad4(K/32)]`).

    `out_codes` / `out_scales`: caller-provided output views, as in :func:`fused_norm_quant`.
    `config`: tiles and variant (default :func:`quant_config`; every config gives the same bits).
    `rule`: a `reference.QuantRule` value (0 DEFAULT, 1 TORCHAO).
    """
    _check2d("x", x)
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"triton_norm_quant: K={k} is not a multiple of {BLOCK}")
    s, sp = k // BLOCK, _round_up(k // BLOCK, 4)
    m_grid = _round_up(m, 128) if swizzled else m
    codes, scales = _out_views(m, k, swizzled, x.device, out_codes, out_scales)
    if m_grid == 0:
        return codes, scales
    cfg = config or quant_config(k, m)
    rule = _rule(rule)
    bm, bc = cfg.block_rows, cfg.block_cols
    grid = (triton.cdiv(m_grid, bm), triton.cdiv(k, bc))
    _quant_kernel[grid](
        x, codes, scales, m, m_grid, k, x.stride(0), _row_stride(codes, k), _row_stride(scales, s), s, sp,
        SWIZZLED=bool(swizzled), BM=bm, BC=bc, QUANT_OPS=_code(_QUANT_OPS, "quant_ops", cfg.quant_ops),
        SCALE_STORE=_code(_SCALE_STORES, "scale_store", cfg.scale_store), RULE=rule, num_warps=cfg.num_warps,
        enable_fp_fusion=False,
    )  # fmt: skip
    return codes, scales


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major `[M, S]` uint8 scales -> F8_128x4 `[pad128(M), pad4(S)]`, zero padded."""
    if scales.dim() != 2:
        raise ValueError(f"triton_norm_quant: scales must be 2-D, got {tuple(scales.shape)}")
    if scales.shape[1] > 1 and scales.stride(1) != 1:
        scales = scales.contiguous()
    m, s = scales.shape
    mp, sp = _round_up(m, 128), _round_up(s, 4)
    out = torch.empty((mp, sp), dtype=torch.uint8, device=scales.device)
    if mp == 0 or sp == 0:
        return out
    br, bs = 128, SWIZZLE_BLOCK_COLS
    grid = (mp // br, triton.cdiv(sp, bs))
    _swizzle_kernel[grid](scales, out, m, mp, scales.stride(0), s, sp, BR=br, BS=bs, num_warps=4)
    return out
