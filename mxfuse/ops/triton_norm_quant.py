"""Triton kernels for the `mxfuse::` norm and quant ops (CUDA impls of :mod:`mxfuse.ops.library`).

Functions (all take 2-D `[M, K]` rows with a unit last stride; the row stride may differ
from K; M may be 0; K % 32 == 0):

- :func:`gemma_norm` -- RMSNorm (Gemma weight offset 1.0 by default), plain or with the
  residual add (the unfused norm).
- :func:`quantize` -- MXFP8 quantization, row-major or F8_128x4-swizzled scales.
- :func:`fused_norm_quant` -- norm (+add) and quant in one launch, optionally writing y.
- :func:`swizzle_scales` -- row-major E8M0 scales to the F8_128x4 layout.

Each has a `*_launch` twin that allocates the outputs and returns them with the launch
(:class:`KernelLaunch`) without running it: what tools/compile_targets.py and
tests/test_targets_compile.py compile on a CPU for every target.

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
the GPU (tests/test_gpu_kernels.py::test_variants_bitwise) with two more instructions
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
(M only picks launch choices that do not change a bit, `split` and `evict_first`).

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
- decode sizes (M <= 16): `split` = one program per chunk; each reads and reduces the
  whole row (the same code, so the same bits) and finishes one chunk, so a row's quant
  tail runs on NCH SMs. 17..1024 rows: evict_first on the row loads. Up to 256 rows (1024
  with a residual) y is rounded to bf16 two values per convert before the quant.
- the fused plain norm from 4096 rows (NVIDIA, K 2049..3072 and 4097..6144): a persistent
  grid of 3 programs of 8 warps per SM, the weight loaded once per program, Triton's
  software pipeliner fetching the next tiles' rows (cp.async) while one is computed.
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

import struct

import torch
import triton
import triton.language as tl

from mxfuse.ops.mx_layout import (
    BLOCK,
    E8M0_BIAS,
    E8M0_MAX,
    FP8_DTYPE,
    FP8_MAX,
    SWIZZLE_COLUMN_TILE,
    padded_rows,
    padded_scale_columns,
    round_up,
    scale_columns,
)
from mxfuse.ops.norm_quant_config import PAD_ROWS, NormConfig, QuantConfig, norm_config, quant_config, row_chunks
from mxfuse.ops.reference import E8M0_NAN, QuantRule
from mxfuse.ops.triton_targets import Isa, KernelLaunch, device_isa

SWIZZLE_BLOCK_COLS = 16  # scale columns per program of the standalone swizzle (x 128 rows = 2 KB)

__all__ = [
    "fused_norm_quant",
    "gemma_norm",
    "norm_launch",
    "quant_launch",
    "quantize",
    "swizzle_launch",
    "swizzle_scales",
]

_FP8_MAX_BITS = struct.unpack("<I", struct.pack("<f", FP8_MAX))[0]
FP8_MAX_ = tl.constexpr(FP8_MAX)
FP8_MAX_EXP = tl.constexpr((_FP8_MAX_BITS >> 23) - 127)
"""Exponent of the largest e4m3 value (448 = 1.75 * 2**8)."""
FP8_MAX_MANTISSA = tl.constexpr(_FP8_MAX_BITS & 0x7FFFFF)
"""fp32 mantissa bits of 1.75: an amax mantissa above it needs the next scale."""
FLT_MIN = tl.constexpr(torch.finfo(torch.float32).tiny)
SCALE_MAX = tl.constexpr(E8M0_MAX)
SCALE_NAN = tl.constexpr(E8M0_NAN)
UNIT_EXP = tl.constexpr(2 * E8M0_BIAS)
"""`UNIT_EXP - sb` is the biased fp32 exponent of the multiplier 2**(127 - sb)."""


# --------------------------------------------------------------------------- helpers


@triton.jit
def _pairwise_sum(v, BM: tl.constexpr, N: tl.constexpr):
    """Fixed-tree sum along axis 1 of a `[BM, N]` fp32 tile (N a power of two, < 2**16).

    Pairwise, bottom-up: level i adds columns 2j and 2j+1 of level i-1. Each level is a
    sum over an axis of size 2 (one commutative IEEE add), so the result does not depend
    on the layout, on BM or on num_warps.
    """
    for i in tl.static_range(16):
        if (N >> i) > 1:
            v = tl.sum(tl.reshape(v, [BM, (N // 2) >> i, 2]), axis=2)
    return tl.reshape(v, [BM])


@triton.jit
def _sum_of_squares(s, NCH: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, TREE: tl.constexpr):
    """Sum of squares of the rows held as the NCH chunks `s`: elementwise over the chunks,
    (a^2 + b^2) + (c^2 + d^2) (absent chunks omitted: adding an exact +0 changes
    nothing), then over the CH columns by `tl.sum` ("native": order fixed by the layout,
    i.e. by the launch config, which then must depend on K alone) or the pairwise tree."""
    v = s[0] * s[0]
    if NCH > 1:
        v = v + s[1] * s[1]
    if NCH == 3:
        v = v + s[2] * s[2]
    if NCH == 4:
        v = v + (s[2] * s[2] + s[3] * s[3])
    if TREE == "pairwise":
        return _pairwise_sum(v, BM, CH)
    else:
        return tl.sum(v, axis=1)


@triton.jit
def _load_chunks(ptr, rows, stride, cols, row_mask, K, NCH: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """The NCH `[BM, CH]` tiles of rows `rows` at columns `cols[j]` (zero outside the matrix)."""
    tiles = ()
    for j in tl.static_range(NCH):
        mask = row_mask[:, None] & (cols[j] < K)[None, :]
        ptrs = ptr + rows[:, None] * stride + cols[j][None, :]
        if EVICT_FIRST:
            tiles = tiles + (tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first"),)
        else:
            tiles = tiles + (tl.load(ptrs, mask=mask, other=0.0),)
    return tiles


@triton.jit
def _load_weight(w_ptr, K, weight_offset, NCH: tl.constexpr, CH: tl.constexpr):
    """(cols, w): the NCH column ranges of a row and the fp32 `w + weight_offset` on each."""
    cols = ()
    w = ()
    for j in tl.static_range(NCH):
        c = j * CH + tl.arange(0, CH)
        cols = cols + (c,)
        w = w + (tl.load(w_ptr + c[None, :], mask=(c < K)[None, :], other=0.0).to(tl.float32) + weight_offset,)
    return cols, w


@triton.jit
def _sum_chunk(x, r, ro_ptr, rows, cols, row_mask, K, owner, HAS_RES: tl.constexpr, ROUND_SUM: tl.constexpr):
    """fp32 `s = x (+ r)` of one chunk; stores residual_out = s.to(dtype) when HAS_RES and
    this program `owner`s the chunk."""
    s = x.to(tl.float32)
    if HAS_RES:
        s = s + r.to(tl.float32)
        ro = s.to(x.dtype)
        if owner:
            mask = row_mask[:, None] & (cols < K)[None, :]
            tl.store(ro_ptr + rows[:, None] * K + cols[None, :], ro, mask=mask)
        if ROUND_SUM:
            s = ro.to(tl.float32)
    return s


@triton.jit
def _rstd(ssq, K, eps, BM: tl.constexpr, RSQRT: tl.constexpr, ISA: tl.constexpr):
    """`1 / sqrt(ssq / K + eps)`: "rn" with correctly rounded divide and sqrt (what torch's
    CPU ops compute: three dependent IEEE operations, ~0.1 µs of a decode-sized launch);
    "approx": the hardware's reciprocal square root (module docstring, "Targets")."""
    var = tl.math.div_rn(ssq, K.to(tl.float32))
    if RSQRT == "rn":
        return tl.math.div_rn(tl.full([BM], 1.0, tl.float32), tl.math.sqrt_rn(var + eps))
    elif ISA == "ptx":
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [var + eps], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.rsqrt(var + eps)


@triton.jit
def _round_bf16_pairs(v, ISA: tl.constexpr):
    """fp32 -> bf16 (round to nearest even) -> fp32; on NVIDIA two values per
    `cvt.rn.bf16x2.f32` (`.to(bfloat16)` converts one value per F2F there)."""
    if ISA == "ptx":
        return tl.inline_asm_elementwise(
            "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $3, $2; shl.b32 $0, p, 16; and.b32 $1, p, 0xffff0000; }",
            "=r,=r,r,r",
            [v],
            dtype=tl.float32,
            is_pure=True,
            pack=2,
        )
    else:
        return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _finish_chunk(
    s,
    w,
    rstd,
    y_ptr,
    q_ptr,
    sc_ptr,
    rows,
    cols,
    row_mask,
    K,
    stride_q,
    stride_s,
    scale_rows,
    scale_cols,
    scale_cols_padded,
    J: tl.constexpr,
    dtype: tl.constexpr,
    QUANT: tl.constexpr,
    EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr,
    BM: tl.constexpr,
    CH: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    RULE: tl.constexpr,
    ISA: tl.constexpr,
):
    """Chunk J (columns J*CH ..): y = (s * rstd) * w rounded to dtype (`s * rstd` rounded
    first when ROUND_NORMALIZED); store y (norm) or quantize it and store codes + scales."""
    n = s * rstd[:, None]
    if ROUND_NORMALIZED:
        n = n.to(dtype).to(tl.float32)
    yf = n * w
    y = yf.to(dtype)
    mask = row_mask[:, None] & (cols < K)[None, :]
    if QUANT:
        if EMIT_Y:
            tl.store(y_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
        if QUANT_OPS == "hw-bf16x2" and dtype == tl.bfloat16 and not EMIT_Y:
            codes, sb = _mx_quant_tile(_round_bf16_pairs(yf, ISA), BM, CH, QUANT_OPS, RULE, ISA)
        else:
            codes, sb = _mx_quant_tile(y.to(tl.float32), BM, CH, QUANT_OPS, RULE, ISA)
        # 8 codes (8 bytes) per thread: the register layout of the 16-byte bf16 accesses,
        # so no shared-memory layout conversion between the loads and the code stores.
        # Codes rows are `stride_q` bytes apart (K, or K + K/32 in a row-packed buffer).
        q_offs = rows[:, None] * stride_q + cols[None, :]
        tl.store(q_ptr + tl.max_contiguous(q_offs, [1, 8]), codes, mask=mask)
        scols = J * (CH // 32) + tl.arange(0, CH // 32)
        if SWIZZLED and RULE == "torchao":
            # the pad4 columns past K/32 hold zeros; under TORCHAO a row whose y is NaN
            # (all-zero row, eps = 0) would make their all-zero blocks NaN (scale 255)
            sb = tl.where(scols[None, :] < scale_cols, sb, 0)
        _store_scales(
            sc_ptr, sb, rows, scols, scale_rows, scale_cols, scale_cols_padded, stride_s, SWIZZLED, SCALE_STORE, ISA
        )
    else:
        tl.store(y_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)


@triton.jit
def _max_nan(a, b):
    """NaN-propagating max (`max.NaN.f32`): a block's amax is NaN if any of its values is."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _mx_quant_tile(
    v, BM: tl.constexpr, BC: tl.constexpr, QUANT_OPS: tl.constexpr, RULE: tl.constexpr, ISA: tl.constexpr
):
    """MXFP8 of a `[BM, BC]` fp32 tile: e4m3 codes `[BM, BC]` and E8M0 scales `[BM, BC/32]` (int32).

    QUANT_OPS "hw" (NVIDIA semantics, fewer instructions): `tl.max` is IEEE maxNum, which
    skips NaN (a block of only NaN gives NaN, which the FLT_MIN floor, also maxNum, turns
    into FLT_MIN), and the fp32 -> e4m3 cast is `cvt.rn.satfinite`, which maps +-Inf to
    +-448 and keeps NaN. "explicit" (and every ISA but "ptx") spells both out (`where`
    before the max, a clamp before the cast): the same bits, two instructions more per
    element.

    RULE (`reference.QuantRule`, by name; constexpr: the default code is not touched by the
    other branch): "default" (docs/design.md); "torchao" (torchao's RCEIL: a NaN makes the
    block's scale 255 and all 32 of its codes NaN; a block with scale byte 0 is multiplied
    by 1.0 instead of 2**127). The amax is then the NaN-propagating max (one `max.NaN` per
    element instead of maxNum: no extra instruction), so a NaN block is `amax != amax`;
    its scale is computed from FLT_MIN (the floor is maxNum) and then replaced.
    """
    explicit: tl.constexpr = QUANT_OPS == "explicit" or ISA != "ptx"
    v3 = tl.reshape(v, [BM, BC // 32, 32])
    a = tl.abs(v3)
    if RULE == "torchao":
        amax = tl.reduce(a, 2, _max_nan)
        nan_block = amax != amax  # noqa: PLR0124  (NaN test)
    else:
        if explicit:
            a = tl.where(a != a, 0.0, a)  # noqa: PLR0124  (NaN does not take part in the amax)
        amax = tl.max(a, axis=2)
    amax = tl.maximum(amax, FLT_MIN)  # maxNum: NaN -> FLT_MIN
    bits = amax.to(tl.int32, bitcast=True)
    biased_exp = bits >> 23
    sb = biased_exp - FP8_MAX_EXP + ((bits & 0x7FFFFF) > FP8_MAX_MANTISSA).to(tl.int32)
    sb = tl.where(biased_exp == 255, SCALE_MAX, sb)  # +Inf amax (fp32 exponent field all ones)
    sb = tl.where(sb < 0, 0, sb)
    sb = tl.where(sb > SCALE_MAX, SCALE_MAX, sb)
    e = UNIT_EXP - sb  # biased exponent of 2**(127 - sb)
    mbits = tl.where(e == 0, 0x00400000, e << 23)  # e == 0: 2**-127 (subnormal)
    if RULE == "torchao":
        mbits = tl.where(sb == 0, 0x3F800000, mbits)  # 1.0
        mbits = tl.where(nan_block, 0x7FC00000, mbits)  # NaN: every code of the block NaN
        sb = tl.where(nan_block, SCALE_NAN, sb)
    mult = mbits.to(tl.float32, bitcast=True)
    q = v3 * mult[:, :, None]
    if explicit:
        # Finite values are within +-448 by construction; this maps +-Inf to +-448 and keeps
        # NaN (propagate_nan=ALL lowers to the NaN-propagating min/max, never NaN-dropping).
        q = tl.clamp(q, -FP8_MAX_, FP8_MAX_, propagate_nan=tl.PropagateNan.ALL)
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
        "=r,l,r,r",
        [ptrs, val, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _store_scales(
    sc_ptr,
    sb,
    rows,
    scols,
    scale_rows,
    scale_cols,
    scale_cols_padded,
    stride_s,
    SWIZZLED: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    ISA: tl.constexpr,
):
    """Store `[BM, NB]` scales at row-major `[M, scale_cols]` (rows `stride_s` bytes apart) or
    F8_128x4 `[pad128(M), scale_cols_padded]` offsets; rows >= scale_rows are not stored."""
    r2 = rows[:, None]
    c2 = scols[None, :]
    if SWIZZLED:
        off = (r2 // 128) * (scale_cols_padded * 128) + (c2 // 4) * 512 + (r2 % 32) * 16 + ((r2 // 32) % 4) * 4 + c2 % 4
        mask = (r2 < scale_rows) & (c2 < scale_cols_padded)
    else:
        off = r2 * stride_s + c2
        mask = (r2 < scale_rows) & (c2 < scale_cols)
    if SCALE_STORE == "in_place" and ISA == "ptx":
        _store_u8_in_place(sc_ptr + off, sb, mask)
    else:
        tl.store(sc_ptr + off, sb.to(tl.uint8), mask=mask)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _norm_tile(
    tile,
    part,
    cols,
    w,
    x_ptr,
    r_ptr,
    ro_ptr,
    y_ptr,
    q_ptr,
    sc_ptr,
    M,
    scale_rows,
    K,
    stride_x,
    stride_r,
    stride_q,
    stride_s,
    scale_cols,
    scale_cols_padded,
    eps,
    weight_offset,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    ROUND_SUM: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr,
    EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BM: tl.constexpr,
    CH: tl.constexpr,
    NCH: tl.constexpr,
    TREE: tl.constexpr,
    RSQRT: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    SPLIT: tl.constexpr,
    LOAD_FENCE: tl.constexpr,
    RULE: tl.constexpr,
    ISA: tl.constexpr,
):
    """BM whole rows of x (+ residual): all loads issued before any use, one pass; `cols`
    and `w` are the NCH column ranges and the fp32 `w + weight_offset` chunks (:func:`_load_weight`).

    SPLIT > 1: this program (`part` of SPLIT) reads and reduces the whole rows like every
    other part (the same code, so the same bits), but stores the residual, normalizes,
    quantizes and stores only the chunks J with J % SPLIT == part: at decode sizes a row's
    tail work is spread over SPLIT SMs; the extra reads of the row hit L2.
    """
    rows = tile.to(tl.int64) * BM + tl.arange(0, BM)
    row_mask = rows < M
    if LOAD_FENCE:
        # ptxas otherwise issues the weight loads only after the first use of x (after x's
        # round trip: a second, dependent one, exposed once the reduction is short); the
        # barrier keeps them ahead of the x / residual loads.
        tl.debug_barrier()
    x = _load_chunks(x_ptr, rows, stride_x, cols, row_mask, K, NCH, EVICT_FIRST)
    r = x
    if HAS_RES:
        r = _load_chunks(r_ptr, rows, stride_r, cols, row_mask, K, NCH, EVICT_FIRST)
    s = ()
    for j in tl.static_range(NCH):
        owner = SPLIT == 1 or part == j % SPLIT  # the constexpr True when a row is not split: no branch
        s = s + (_sum_chunk(x[j], r[j], ro_ptr, rows, cols[j], row_mask, K, owner, HAS_RES, ROUND_SUM),)
    rstd = _rstd(_sum_of_squares(s, NCH, BM, CH, TREE), K, eps, BM, RSQRT, ISA)
    for j in tl.static_range(NCH):
        if SPLIT == 1 or part == j % SPLIT:
            _finish_chunk(
                s[j],
                w[j],
                rstd,
                y_ptr,
                q_ptr,
                sc_ptr,
                rows,
                cols[j],
                row_mask,
                K,
                stride_q,
                stride_s,
                scale_rows,
                scale_cols,
                scale_cols_padded,
                j,
                x_ptr.dtype.element_ty,
                QUANT,
                EMIT_Y,
                SWIZZLED,
                ROUND_NORMALIZED,
                BM,
                CH,
                QUANT_OPS,
                SCALE_STORE,
                RULE,
                ISA,
            )


@triton.jit
def _zero_pad_scales(sc_ptr, p, M, scale_rows, scale_cols_padded, PAD_ROWS: tl.constexpr, PAD_WORDS: tl.constexpr):
    """Zero the F8_128x4 scale words of padding rows M + p*PAD_ROWS .. (< scale_rows), all
    columns. A row's 4 scales of one 4-column group are one aligned 32-bit word, so the
    padding is stored as words: (r // 128) * cols * 32 + (c // 4) * 128 + (r % 32) * 4
    + (r // 32) % 4, in words."""
    rows = M + p.to(tl.int64) * PAD_ROWS + tl.arange(0, PAD_ROWS)
    cw = tl.arange(0, PAD_WORDS)
    r2 = rows[:, None]
    c2 = cw[None, :]
    off = (r2 // 128) * (scale_cols_padded * 32) + c2 * 128 + (r2 % 32) * 4 + (r2 // 32) % 4
    mask = (r2 < scale_rows) & (c2 < scale_cols_padded // 4)
    tl.store(sc_ptr.to(tl.pointer_type(tl.int32)) + off, tl.zeros([PAD_ROWS, PAD_WORDS], tl.int32), mask=mask)


@triton.jit(do_not_specialize=["M", "scale_rows", "n_tiles"])
def _norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    ro_ptr,
    y_ptr,
    q_ptr,
    sc_ptr,
    M,
    scale_rows,
    n_tiles,
    K,
    stride_x,
    stride_r,
    stride_q,
    stride_s,
    scale_cols,
    scale_cols_padded,
    eps,
    weight_offset,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    ROUND_SUM: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr,
    EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BM: tl.constexpr,
    CH: tl.constexpr,
    NCH: tl.constexpr,
    TREE: tl.constexpr,
    RSQRT: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PERSISTENT: tl.constexpr,
    SPLIT: tl.constexpr,
    LOAD_FENCE: tl.constexpr,
    RULE: tl.constexpr,
    PAD_FILL: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    PAD_WORDS: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    ISA: tl.constexpr,
):
    """Unfused norm (QUANT=False: writes y) or fused norm+quant (QUANT=True).

    A row is NCH (1..4) chunks of CH columns (a power of two), held in registers. One
    tile of BM rows per program, or (PERSISTENT) tiles pid, pid + grid, ... of the `n_tiles`,
    the weight loaded and converted once per program; LOOP_STAGES > 1 lets Triton's pipeliner
    fetch the rows of the next LOOP_STAGES - 1 tiles (cp.async into shared memory) while one
    is computed.

    `scale_rows`: rows of the scale buffer (pad128(M) when SWIZZLED, else M). PAD_FILL
    (swizzled scales only): the `n_tiles` tiles cover the M real rows, and the programs
    after them (pid >= n_tiles) only write the zero scale words of the padding rows
    M .. pad128(M) (PAD_ROWS rows each); otherwise the tiles cover pad128(M) rows and the
    padding rows run the norm on zeros (which gives scale byte 0).
    """
    pid = tl.program_id(0)
    part = tl.program_id(1)
    stored_scale_rows = M if PAD_FILL else scale_rows  # PAD_FILL: the pad programs store the rest
    if PERSISTENT:
        cols, w = _load_weight(w_ptr, K, weight_offset, NCH, CH)  # once per program
        for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=LOOP_STAGES):
            _norm_tile(
                t,
                part,
                cols,
                w,
                x_ptr,
                r_ptr,
                ro_ptr,
                y_ptr,
                q_ptr,
                sc_ptr,
                M,
                stored_scale_rows,
                K,
                stride_x,
                stride_r,
                stride_q,
                stride_s,
                scale_cols,
                scale_cols_padded,
                eps,
                weight_offset,
                HAS_RES,
                QUANT,
                ROUND_SUM,
                ROUND_NORMALIZED,
                EMIT_Y,
                SWIZZLED,
                BM,
                CH,
                NCH,
                TREE,
                RSQRT,
                QUANT_OPS,
                SCALE_STORE,
                EVICT_FIRST,
                SPLIT,
                LOAD_FENCE,
                RULE,
                ISA,
            )
        if PAD_FILL:
            for p in range(pid, tl.cdiv(scale_rows - M, PAD_ROWS), tl.num_programs(0)):
                _zero_pad_scales(sc_ptr, p, M, scale_rows, scale_cols_padded, PAD_ROWS, PAD_WORDS)
    elif not PAD_FILL or pid < n_tiles:  # the constexpr True without PAD_FILL: no branch
        cols, w = _load_weight(w_ptr, K, weight_offset, NCH, CH)
        _norm_tile(
            pid,
            part,
            cols,
            w,
            x_ptr,
            r_ptr,
            ro_ptr,
            y_ptr,
            q_ptr,
            sc_ptr,
            M,
            stored_scale_rows,
            K,
            stride_x,
            stride_r,
            stride_q,
            stride_s,
            scale_cols,
            scale_cols_padded,
            eps,
            weight_offset,
            HAS_RES,
            QUANT,
            ROUND_SUM,
            ROUND_NORMALIZED,
            EMIT_Y,
            SWIZZLED,
            BM,
            CH,
            NCH,
            TREE,
            RSQRT,
            QUANT_OPS,
            SCALE_STORE,
            EVICT_FIRST,
            SPLIT,
            LOAD_FENCE,
            RULE,
            ISA,
        )
    else:
        _zero_pad_scales(sc_ptr, (pid - n_tiles) * SPLIT + part, M, scale_rows, scale_cols_padded, PAD_ROWS, PAD_WORDS)


@triton.jit(do_not_specialize=["M", "scale_rows"])
def _quant_kernel(
    x_ptr,
    q_ptr,
    sc_ptr,
    M,
    scale_rows,
    K,
    stride_x,
    stride_q,
    stride_s,
    scale_cols,
    scale_cols_padded,
    SWIZZLED: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    RULE: tl.constexpr,
    ISA: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    codes, sb = _mx_quant_tile(x.to(tl.float32), BM, BC, QUANT_OPS, RULE, ISA)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], codes, mask=mask)
    scols = tl.program_id(1) * (BC // 32) + tl.arange(0, BC // 32)
    _store_scales(
        sc_ptr, sb, rows, scols, scale_rows, scale_cols, scale_cols_padded, stride_s, SWIZZLED, SCALE_STORE, ISA
    )


@triton.jit(do_not_specialize=["M", "scale_rows"])
def _swizzle_kernel(
    src_ptr, dst_ptr, M, scale_rows, stride_src, scale_cols, scale_cols_padded, BR: tl.constexpr, BS: tl.constexpr
):
    """One `[BR, BS]` block per program: a grid over row tiles AND scale columns, so the few
    rows of a decode-sized gather still spread over many programs."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BS + tl.arange(0, BS)
    mask = (rows < M)[:, None] & (cols < scale_cols)[None, :]
    v = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=mask, other=0)
    _store_scales(
        dst_ptr, v, rows, cols, scale_rows, scale_cols, scale_cols_padded, scale_cols, True, "tl_store", "portable"
    )


# --------------------------------------------------------------------------- launches


def _check2d(name: str, t: torch.Tensor):
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"triton_norm_quant: {name} must be 2-D with a unit last stride, got {tuple(t.shape)} {t.stride()}"
        )


def _check_k(k: int):
    if k % BLOCK:
        raise ValueError(f"triton_norm_quant: K={k} is not a multiple of {BLOCK}")


def _rule_name(rule) -> str:
    """The kernels' RULE constexpr: the `reference.QuantRule` member's name, lower case."""
    if isinstance(rule, bool) or rule not in set(QuantRule):
        raise ValueError(f"triton_norm_quant: rule={rule!r} is not a QuantRule (0 DEFAULT, 1 TORCHAO)")
    return QuantRule(rule).name.lower()


def _out_views(m, k, swizzled, dev, out_codes, out_scales):
    """Codes `[m, k]` e4m3 and scales (row-major `[m, k/32]` or swizzled) buffers: the
    caller's views where given (row-major scales only; any row stride, unit last stride,
    e.g. the two halves of a row-packed `[m, k + k/32]` byte buffer), else new tensors."""
    s = scale_columns(k)
    if out_codes is None:
        codes = torch.empty((m, k), dtype=FP8_DTYPE, device=dev)
    else:
        codes = out_codes
        if codes.shape != (m, k) or codes.dtype != FP8_DTYPE or codes.device != dev:
            raise ValueError(
                f"triton_norm_quant: out_codes must be [{m}, {k}] {FP8_DTYPE} on {dev}, got "
                f"{tuple(codes.shape)} {codes.dtype} {codes.device}"
            )
        _check2d("out_codes", codes)
    if out_scales is None:
        shape = (padded_rows(m), padded_scale_columns(k)) if swizzled else (m, s)
        scales = torch.empty(shape, dtype=torch.uint8, device=dev)
    else:
        if swizzled:
            raise ValueError("triton_norm_quant: out_scales is for row-major scales only (swizzled=False)")
        scales = out_scales
        if scales.shape != (m, s) or scales.dtype != torch.uint8 or scales.device != dev:
            raise ValueError(
                f"triton_norm_quant: out_scales must be [{m}, {s}] uint8 on {dev}, got "
                f"{tuple(scales.shape)} {scales.dtype} {scales.device}"
            )
        _check2d("out_scales", scales)
    return codes, scales


def _row_stride(t: torch.Tensor, default: int) -> int:
    return t.stride(0) if t.shape[0] > 1 else default


def _sm_count(dev: torch.device) -> int:
    """Multiprocessors of a GPU (1 on a meta device: a described launch's grid is nominal there)."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1


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
    _check2d("x", x)
    m, k = x.shape
    _check_k(k)
    dev = x.device
    has_res = residual is not None
    if has_res:
        _check2d("residual", residual)
    weight = weight.contiguous()
    swizzled = bool(quant and swizzled)
    s, s_padded = scale_columns(k), padded_scale_columns(k)
    scale_rows = padded_rows(m) if swizzled else m
    res_out = torch.empty((m, k), dtype=x.dtype, device=dev) if has_res else None
    y = torch.empty((m, k), dtype=x.dtype, device=dev) if (emit_y or not quant) else None
    codes = scales = None
    if quant:
        codes, scales = _out_views(m, k, swizzled, dev, out_codes, out_scales)
    elif out_codes is not None or out_scales is not None:
        raise ValueError("triton_norm_quant: out_codes / out_scales need quant")
    outputs = (codes, scales, res_out, y)
    rule = _rule_name(rule)
    if scale_rows == 0:
        return outputs, None
    ch, nch = row_chunks(k)
    cfg = config or norm_config(k, m, plain_quant=bool(quant and not has_res), isa=isa)
    split = max(1, cfg.split)
    pad_fill = swizzled and cfg.scale_padding == "fill"
    n_tiles = triton.cdiv(m if pad_fill else scale_rows, cfg.block_rows)
    n_pad = triton.cdiv(triton.cdiv(scale_rows - m, PAD_ROWS), split) if pad_fill else 0
    grid = (min(n_tiles, cfg.persistent * _sm_count(dev)) if cfg.persistent else n_tiles + n_pad, split)
    r = residual if has_res else x
    args = (
        x, r, weight, res_out if has_res else x, y if y is not None else x,
        codes if quant else x, scales if quant else x,
        m, scale_rows, n_tiles, k, x.stride(0), r.stride(0),
        _row_stride(codes, k) if quant else k, _row_stride(scales, s) if quant else s,
        s, s_padded, float(eps), float(weight_offset),
    )  # fmt: skip
    constexprs = dict(
        HAS_RES=has_res,
        QUANT=bool(quant),
        ROUND_SUM=bool(round_sum and has_res),
        ROUND_NORMALIZED=bool(round_normalized),
        EMIT_Y=bool(emit_y and quant),
        SWIZZLED=swizzled,
        BM=cfg.block_rows,
        CH=ch,
        NCH=nch,
        TREE=cfg.tree,
        RSQRT=cfg.rsqrt,
        QUANT_OPS=cfg.quant_ops,
        SCALE_STORE=cfg.scale_store,
        EVICT_FIRST=bool(cfg.evict_first),
        PERSISTENT=bool(cfg.persistent),
        SPLIT=split,
        LOAD_FENCE=bool(cfg.load_fence),
        RULE=rule,
        PAD_FILL=pad_fill,
        PAD_ROWS=PAD_ROWS,
        PAD_WORDS=triton.next_power_of_2(max(1, s_padded // SWIZZLE_COLUMN_TILE)),
        LOOP_STAGES=cfg.loop_stages,
        ISA=isa,
    )
    return outputs, KernelLaunch(_norm_kernel, grid, args, constexprs, cfg.num_warps, fp_fusion=False)


def _run(outputs: tuple, launch: KernelLaunch | None):
    if launch is not None:
        launch.run()
    return outputs


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
    _, _, res_out, y = _run(outputs, launch)
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
    return _run(outputs, launch)


def quant_launch(
    x: torch.Tensor,
    swizzled: bool = False,
    *,
    isa: Isa,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    config: QuantConfig | None = None,
    rule: int = QuantRule.DEFAULT,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales), launch)` of the quant kernel, not run (as :func:`norm_launch`)."""
    _check2d("x", x)
    m, k = x.shape
    _check_k(k)
    s = scale_columns(k)
    scale_rows = padded_rows(m) if swizzled else m
    codes, scales = _out_views(m, k, swizzled, x.device, out_codes, out_scales)
    rule = _rule_name(rule)
    if scale_rows == 0:
        return (codes, scales), None
    cfg = config or quant_config(k, m)
    grid = (triton.cdiv(scale_rows, cfg.block_rows), triton.cdiv(k, cfg.block_cols))
    strides = (x.stride(0), _row_stride(codes, k), _row_stride(scales, s))
    args = (x, codes, scales, m, scale_rows, k, *strides, s, padded_scale_columns(k))
    constexprs = dict(
        SWIZZLED=bool(swizzled),
        BM=cfg.block_rows,
        BC=cfg.block_cols,
        QUANT_OPS=cfg.quant_ops,
        SCALE_STORE=cfg.scale_store,
        RULE=rule,
        ISA=isa,
    )
    return (codes, scales), KernelLaunch(_quant_kernel, grid, args, constexprs, cfg.num_warps, fp_fusion=False)


def quantize(
    x: torch.Tensor,
    swizzled: bool = False,
    *,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    config: QuantConfig | None = None,
    rule: int = QuantRule.DEFAULT,
):
    """MXFP8 codes `[M, K]` e4m3 and scales (uint8 `[M, K/32]`, or F8_128x4 `[pad128(M), pad4(K/32)]`).

    `out_codes` / `out_scales`: caller-provided output views, as in :func:`fused_norm_quant`.
    `config`: tiles and variant (default `quant_config`; every config gives the same bits).
    `rule`: a `reference.QuantRule` value (0 DEFAULT, 1 TORCHAO).
    """
    isa = device_isa(x.device)
    outputs, launch = quant_launch(
        x, swizzled, isa=isa, out_codes=out_codes, out_scales=out_scales, config=config, rule=rule
    )
    return _run(outputs, launch)


def swizzle_launch(scales: torch.Tensor) -> tuple[torch.Tensor, KernelLaunch | None]:
    """`(swizzled, launch)` of the swizzle kernel, not run (byte moves only: no ISA choice)."""
    if scales.dim() != 2:
        raise ValueError(f"triton_norm_quant: scales must be 2-D, got {tuple(scales.shape)}")
    if scales.shape[1] > 1 and scales.stride(1) != 1:
        scales = scales.contiguous()
    m, s = scales.shape
    rows, cols = padded_rows(m), round_up(s, SWIZZLE_COLUMN_TILE)
    out = torch.empty((rows, cols), dtype=torch.uint8, device=scales.device)
    if rows == 0 or cols == 0:
        return out, None
    br, bs = 128, SWIZZLE_BLOCK_COLS
    grid = (rows // br, triton.cdiv(cols, bs))
    args = (scales, out, m, rows, scales.stride(0), s, cols)
    return out, KernelLaunch(_swizzle_kernel, grid, args, dict(BR=br, BS=bs), 4, fp_fusion=False)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major `[M, S]` uint8 scales -> F8_128x4 `[pad128(M), pad4(S)]`, zero padded."""
    device_isa(scales.device)  # an unsupported GPU is refused before anything compiles
    return _run(*swizzle_launch(scales))
