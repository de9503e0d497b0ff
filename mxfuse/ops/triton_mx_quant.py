"""The MXFP8 epilogue of every fused producer kernel, the standalone quant and swizzle kernels, and their launchers.

A producer kernel (the norm of :mod:`mxfuse.ops.triton_norm_quant`, and any other) computes
an fp32 tile `yf` `[BM, BC]` of its output and its rounded form `y` (the output dtype);
:func:`_mx_epilogue` then stores y (optionally), quantizes the tile to MXFP8 and stores the
e4m3 codes and E8M0 scales, row-major or F8_128x4-swizzled. The building blocks are
usable alone: :func:`_mx_quant_tile` (codes and scale bytes of a tile, registers only) and
:func:`_store_scales` (scale bytes at their offsets in either layout).

Argument bundles (host-built, since Triton 3.6 cannot build a tuple of constexprs inside a
kernel): :class:`MxDst` (runtime: the output pointers and row strides) and :class:`MxSpec`
(a constexpr: the layout, y, quant variant, rule and ISA). Their fields are read by name
in the kernels (`dst.q_ptr`, `MX.SWIZZLED`).

Functions: :func:`quantize` / :func:`quant_launch` (MXFP8 of bf16 / fp16 / fp32 rows) and
:func:`swizzle_scales` / :func:`swizzle_launch` (row-major E8M0 scales to F8_128x4).
:mod:`mxfuse.ops.triton_norm_quant` re-exports them; its docstring has the design (the
bitwise contract, the targets, the regimes).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

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
    SWIZZLE_ROW_TILE,
    padded_rows,
    padded_scale_columns,
    round_up,
    scale_columns,
)
from mxfuse.ops.norm_quant_config import QuantConfig, quant_config
from mxfuse.ops.reference import E8M0_NAN, QuantRule
from mxfuse.ops.triton_targets import Isa, KernelLaunch, device_isa

SWIZZLE_BLOCK_COLS = 16  # scale columns per program of the standalone swizzle (x 128 rows = 2 KB)

__all__ = ["MxDst", "MxSpec", "quant_launch", "quantize", "swizzle_launch", "swizzle_scales"]

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
ROW_TILE = tl.constexpr(SWIZZLE_ROW_TILE)
COLUMN_TILE = tl.constexpr(SWIZZLE_COLUMN_TILE)
ROW_GROUP = tl.constexpr(SWIZZLE_ROW_TILE // SWIZZLE_COLUMN_TILE)
"""Rows of one of the 4 row groups of an F8_128x4 tile (32): row r's 4 scales of a column
group are the 4-byte word `(r % 32) * 4 + (r // 32) % 4` of the tile's 512-byte block."""


class MxDst(NamedTuple):
    """Where the epilogue stores (runtime values: pointers and ints).

    Codes rows are `stride_q` bytes apart (K, or K + K/32 in a row-packed buffer), row-major
    scale rows `stride_s` bytes apart; `y_ptr`: the rounded producer output, `[M, K]`
    contiguous (stored when `MxSpec.EMIT_Y`; kernels that write no y pass any pointer)."""

    y_ptr: Any
    q_ptr: Any
    sc_ptr: Any
    stride_q: int
    stride_s: int
    scale_cols: int
    """K / 32."""
    scale_cols_padded: int
    """K / 32 padded to 4: the swizzled layout's columns."""


CODE_VECTORS = (8, 16)
"""The values `MxSpec.CODE_VECTOR` takes (the producers' configs check theirs against it)."""


class MxSpec(NamedTuple):
    """How the epilogue quantizes and stores (a constexpr: every field selects code)."""

    SWIZZLED: bool
    """F8_128x4 scales (else row-major)."""
    EMIT_Y: bool
    """Also store y."""
    QUANT_OPS: str
    """`norm_quant_config.QUANT_OPS`."""
    SCALE_STORE: str
    """`norm_quant_config.SCALE_STORES`."""
    RULE: str
    """`reference.QuantRule` member name, lower case."""
    ISA: str
    """`triton_targets.Isa`."""
    CODE_VECTOR: int = 8
    """Contiguous codes per thread the code store is laid out for (a layout hint: the same bits for any of
    CODE_VECTORS): 8, the register layout of 16-byte bf16 loads (no layout conversion after a norm's loads),
    or 16 (one 16-byte store, and half a block per thread: one shuffle per block amax instead of two)."""
    WARP_AMAX: bool = False
    """The block amax on the magnitudes' bits (:func:`_amax_bits`; the same bits, default rule only): set where
    the tile holds one value a thread on NVIDIA (:func:`warp_amax`), so that a block's 32 values span a warp and
    Triton reduces them with one `redux.sync` instead of five shuffle levels."""


# --------------------------------------------------------------------------- the epilogue


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
def _max_nan(a, b):
    """NaN-propagating max (`max.NaN.f32`): a block's amax is NaN if any of its values is."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


AMAX_BIAS = tl.constexpr(0x7FFFFF)
"""Added to a magnitude's bits so that NaN's (above +Inf's 0x7F800000) wrap to negative int32 values."""
FLT_MIN_BITS = tl.constexpr(0x00800000)


@triton.jit
def _amax_bits(v3):
    """The bits of `max(maxNum(|v|) over the last axis, FLT_MIN)` by an int32 max: a non-NaN magnitude's bits
    order as its value (0 .. 0x7F800000), and + AMAX_BIAS sends NaN's past INT32_MAX to negative values, below
    every other magnitude's; the floor is applied before the bias is taken off (a block of only NaN: FLT_MIN).
    Triton lowers an int32 max over a warp's 32 lanes to one `redux.sync.max.s32` (sm_80+)."""
    biased = (v3.to(tl.int32, bitcast=True) & 0x7FFFFFFF) + AMAX_BIAS
    return tl.maximum(tl.max(biased, axis=2), FLT_MIN_BITS + AMAX_BIAS) - AMAX_BIAS


@triton.jit
def _mx_quant_tile(
    v,
    BM: tl.constexpr,
    BC: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    RULE: tl.constexpr,
    ISA: tl.constexpr,
    WARP_AMAX: tl.constexpr = False,
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

    WARP_AMAX (`MxSpec.WARP_AMAX`; default rule): the amax's bits by :func:`_amax_bits` (the same bits).
    """
    explicit: tl.constexpr = QUANT_OPS == "explicit" or ISA != "ptx"
    v3 = tl.reshape(v, [BM, BC // 32, 32])
    if WARP_AMAX and RULE != "torchao":
        bits = _amax_bits(v3)
    else:
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
def _f8_128x4_offset(r, group, sub, scale_cols_padded, UNIT: tl.constexpr):
    """Offset, in units of UNIT bytes (1: bytes, 4: 32-bit words), of row r's scales of column
    group `group` (columns 4 * group .. + 3; `sub`: the column within the group, in units)
    in the F8_128x4 layout (`reference.swizzle_scales`): tiles of 128 rows by 4 columns,
    512 bytes each, row-tile major; in a tile, row r is the 4-byte word
    (r % 32) * 4 + (r // 32) % 4. Byte offset of scale (r, c): UNIT 1, group c // 4, sub c % 4."""
    W: tl.constexpr = COLUMN_TILE // UNIT  # units per 4-byte word
    # the row's part (int64, one value per row) and the column's part (int32, per element) are
    # summed apart and added once: a per-element sum of five int64 terms cost ~4 instructions
    # a scale byte more (sm_90 SASS; the same offsets)
    row_part = (
        (r // ROW_TILE) * (scale_cols_padded * (ROW_TILE // COLUMN_TILE * W))
        + (r % ROW_GROUP) * (COLUMN_TILE * W)
        + ((r // ROW_GROUP) % COLUMN_TILE) * W
    )
    return row_part + (group * (ROW_TILE * W) + sub)


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
        off = _f8_128x4_offset(r2, c2 // COLUMN_TILE, c2 % COLUMN_TILE, scale_cols_padded, 1)
        mask = (r2 < scale_rows) & (c2 < scale_cols_padded)
    else:
        off = r2 * stride_s + c2
        mask = (r2 < scale_rows) & (c2 < scale_cols)
    if SCALE_STORE == "in_place" and ISA == "ptx":
        _store_u8_in_place(sc_ptr + off, sb, mask)
    else:
        tl.store(sc_ptr + off, sb.to(tl.uint8), mask=mask)


SCALE_PAD_ROWS = 128
"""Rows of swizzled-scale padding one padding program of a producer zeroes (the act·mul's and the gated ones')."""


def pad_programs(m: int, scale_rows: int, block_rows: int, swizzled: bool) -> tuple[int, int]:
    """A producer grid's (row tiles of the M real rows, programs after them that only zero the swizzled scales of
    the padding rows, SCALE_PAD_ROWS each): computing the padding rows as rows of zeros took a decode launch up to
    0.85 µs more at K 8192 (H100, docs/perf_notes.md run 17)."""
    n_tiles = triton.cdiv(m, block_rows)
    return n_tiles, triton.cdiv(max(0, scale_rows - n_tiles * block_rows), SCALE_PAD_ROWS) if swizzled else 0


@triton.jit
def _zero_pad_scales(dst, first_row, word0, scale_rows, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Zero the F8_128x4 scales (`dst.sc_ptr`) of padding rows `first_row ..` (ROWS of them, < scale_rows), words
    `word0 ..` (WORDS of them, within the row): rows no tile of real rows covers, so no program loads or computes
    for them. A row's 4 scales of one column group are one aligned 32-bit word, stored as one (byte stores with
    their offsets took a 1-warp program ~0.3 µs at M 1, run 13)."""
    rows = first_row + tl.arange(0, ROWS)
    words = word0 + tl.arange(0, WORDS)
    r2 = rows[:, None]
    w2 = words[None, :]
    off = _f8_128x4_offset(r2, w2, 0, dst.scale_cols_padded, 4)
    mask = (r2 < scale_rows) & (w2 < dst.scale_cols_padded // COLUMN_TILE)
    tl.store(dst.sc_ptr.to(tl.pointer_type(tl.int32)) + off, tl.zeros([ROWS, WORDS], tl.int32), mask=mask)


@triton.jit
def _zero_pad_program(dst, pid, n_tiles, word0, scale_rows, BM: tl.constexpr, ROWS: tl.constexpr,
                      WORDS: tl.constexpr):  # fmt: skip
    """Program `pid` >= n_tiles of a producer's grid, whose first n_tiles row tiles of BM rows cover the M real
    rows: the zero scales of the next ROWS padding rows, words `word0 ..` (WORDS of them)."""
    _zero_pad_scales(dst, n_tiles * BM + (pid - n_tiles).to(tl.int64) * ROWS, word0, scale_rows, ROWS, WORDS)


@triton.jit
def _mx_epilogue(
    yf, y, rows, cols, mask, scol0, K, dst, scale_rows, BM: tl.constexpr, BC: tl.constexpr, MX: tl.constexpr
):
    """Store the producer's tile: y (`MX.EMIT_Y`), its e4m3 codes and its E8M0 scales.

    `yf`: the fp32 `[BM, BC]` tile before rounding, `y`: its rounded form (the output
    dtype), which is what is quantized: with `QUANT_OPS == "hw-bf16x2"` (bf16, no y stored)
    the rounding is done here, two values per convert, from `yf`. `rows` / `cols`: the
    tile's row and column indices, `mask` its valid elements, `scol0` its first scale
    column (or a `[BC/32]` tensor of per-block starts: a block whose column lands past the
    layout's last one is not stored), `K` the row length (y's row stride); `dst`: :class:`MxDst`;
    scale rows >= `scale_rows` are not stored.
    """
    QUANT_OPS: tl.constexpr = MX.QUANT_OPS  # bundle fields passed on as arguments: constexprs
    RULE: tl.constexpr = MX.RULE  # (Triton 3.6 passes a field of a constexpr NamedTuple on as a Python value)
    ISA: tl.constexpr = MX.ISA
    SWIZZLED: tl.constexpr = MX.SWIZZLED
    SCALE_STORE: tl.constexpr = MX.SCALE_STORE
    WARP_AMAX: tl.constexpr = MX.WARP_AMAX
    if MX.EMIT_Y:
        tl.store(dst.y_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
    if MX.QUANT_OPS == "hw-bf16x2" and y.dtype == tl.bfloat16 and not MX.EMIT_Y:
        codes, sb = _mx_quant_tile(_round_bf16_pairs(yf, ISA), BM, BC, QUANT_OPS, RULE, ISA, WARP_AMAX)
    else:
        codes, sb = _mx_quant_tile(y.to(tl.float32), BM, BC, QUANT_OPS, RULE, ISA, WARP_AMAX)
    # MX.CODE_VECTOR codes per thread: 8 is the register layout of the 16-byte bf16 accesses, so no
    # shared-memory layout conversion between the loads and the code stores.
    CODE_VECTOR: tl.constexpr = MX.CODE_VECTOR  # a bundle field read as a constexpr (Triton 3.6 needs the annotation)
    q_offs = rows[:, None] * dst.stride_q + cols[None, :]
    tl.store(dst.q_ptr + tl.max_contiguous(q_offs, [1, CODE_VECTOR]), codes, mask=mask)
    scols = scol0 + tl.arange(0, BC // 32)
    if MX.SWIZZLED and MX.RULE == "torchao":
        # the pad4 columns past K/32 hold zeros; under TORCHAO a row whose y is NaN (all-zero
        # row, eps = 0) would make their all-zero blocks NaN (scale 255)
        sb = tl.where(scols[None, :] < dst.scale_cols, sb, 0)
    _store_scales(
        dst.sc_ptr,
        sb,
        rows,
        scols,
        scale_rows,
        dst.scale_cols,
        dst.scale_cols_padded,
        dst.stride_s,
        SWIZZLED,
        SCALE_STORE,
        ISA,
    )


# --------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M", "scale_rows"])
def _quant_kernel(x_ptr, stride_x, dst, M, scale_rows, K, BM: tl.constexpr, BC: tl.constexpr, MX: tl.constexpr):
    """MXFP8 of `[BM, BC]` tiles of x (a 2-D grid: row tiles by column tiles)."""
    QUANT_OPS: tl.constexpr = MX.QUANT_OPS  # bundle fields passed on as arguments: constexprs
    RULE: tl.constexpr = MX.RULE  # (Triton 3.6 passes a field of a constexpr NamedTuple on as a Python value)
    ISA: tl.constexpr = MX.ISA
    SWIZZLED: tl.constexpr = MX.SWIZZLED
    SCALE_STORE: tl.constexpr = MX.SCALE_STORE
    WARP_AMAX: tl.constexpr = MX.WARP_AMAX
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    codes, sb = _mx_quant_tile(x.to(tl.float32), BM, BC, QUANT_OPS, RULE, ISA, WARP_AMAX)
    tl.store(dst.q_ptr + rows[:, None] * dst.stride_q + cols[None, :], codes, mask=mask)
    scols = tl.program_id(1) * (BC // 32) + tl.arange(0, BC // 32)
    _store_scales(
        dst.sc_ptr,
        sb,
        rows,
        scols,
        scale_rows,
        dst.scale_cols,
        dst.scale_cols_padded,
        dst.stride_s,
        SWIZZLED,
        SCALE_STORE,
        ISA,
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


# --------------------------------------------------------------------------- launch helpers


def check2d(name: str, t: torch.Tensor, where: str = "triton_norm_quant"):
    """A launcher's row operand: 2-D with a unit last stride (any row stride); `where` names the module."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{where}: {name} must be 2-D with a unit last stride, got {tuple(t.shape)} {t.stride()}")


def check_k(k: int, where: str = "triton_norm_quant", what: str = "K"):
    """Rows of whole MXFP8 blocks: `what` (K, I) a multiple of 32."""
    if k % BLOCK:
        raise ValueError(f"{where}: {what}={k} is not a multiple of {BLOCK}")


def warp_amax(tile_values: int, num_warps: int, isa: str) -> bool:
    """`MxSpec.WARP_AMAX` of a tile of `tile_values` values on `num_warps` warps: one value a thread on NVIDIA
    (elsewhere the integer max has no one-instruction form to pay for its two integer ops a value)."""
    return isa == "ptx" and tile_values == 32 * num_warps


def rule_name(rule) -> str:
    """The kernels' `MxSpec.RULE`: the `reference.QuantRule` member's name, lower case."""
    if isinstance(rule, bool) or rule not in set(QuantRule):
        raise ValueError(f"triton_norm_quant: rule={rule!r} is not a QuantRule (0 DEFAULT, 1 TORCHAO)")
    return QuantRule(rule).name.lower()


def out_views(m, k, swizzled, dev, out_codes, out_scales):
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
        check2d("out_codes", codes)
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
        check2d("out_scales", scales)
    return codes, scales


def producer_outputs(
    where: str, first: tuple[str, torch.Tensor], second: tuple[str, torch.Tensor], *, quant: bool,
    swizzled: bool, emit_y: bool, what: str = "K",
) -> tuple[tuple, int]:  # fmt: skip
    """The checks and outputs of a producer kernel reading two `[M, K]` row operands (the act·mul's gate and
    up, the gated producers' x and gate / z): `((codes, scales, y), scale_rows)`; codes / scales None unless
    `quant`, y None when quantized without `emit_y`; scale_rows = pad128(M) for swizzled scales, else M.
    `where` names the module in the errors, `what` the row length (K, I)."""
    (name, x), (other_name, other) = first, second
    check2d(name, x, where)
    check2d(other_name, other, where)
    if other.shape != x.shape or other.dtype != x.dtype:
        raise ValueError(
            f"{where}: {other_name} {tuple(other.shape)} {other.dtype} must match {name} {tuple(x.shape)} {x.dtype}"
        )
    m, k = x.shape
    check_k(k, where, what)
    y = torch.empty((m, k), dtype=x.dtype, device=x.device) if (emit_y or not quant) else None
    codes, scales = out_views(m, k, swizzled, x.device, None, None) if quant else (None, None)
    return (codes, scales, y), padded_rows(m) if (quant and swizzled) else m


def row_stride(t: torch.Tensor, default: int) -> int:
    return t.stride(0) if t.shape[0] > 1 else default


def mx_dst(y, codes: torch.Tensor, scales: torch.Tensor, k: int) -> MxDst:
    """The :class:`MxDst` of codes / scales buffers from :func:`out_views` (and y, or any tensor)."""
    s = scale_columns(k)
    return MxDst(y, codes, scales, row_stride(codes, k), row_stride(scales, s), s, padded_scale_columns(k))


def run(outputs: tuple, launch: KernelLaunch | None):
    if launch is not None:
        launch.run()
    return outputs


# --------------------------------------------------------------------------- launchers


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
    """`((codes, scales), launch)` of the quant kernel, not run (as `triton_norm_quant.norm_launch`)."""
    check2d("x", x)
    m, k = x.shape
    check_k(k)
    scale_rows = padded_rows(m) if swizzled else m
    codes, scales = out_views(m, k, swizzled, x.device, out_codes, out_scales)
    rule_ = rule_name(rule)
    if scale_rows == 0:
        return (codes, scales), None
    cfg = config or quant_config(k, m)
    grid = (triton.cdiv(scale_rows, cfg.block_rows), triton.cdiv(k, cfg.block_cols))
    args = (x, x.stride(0), mx_dst(x, codes, scales, k), m, scale_rows, k)
    spec = MxSpec(bool(swizzled), False, cfg.quant_ops, cfg.scale_store, rule_, isa,
                  WARP_AMAX=warp_amax(cfg.block_rows * cfg.block_cols, cfg.num_warps, isa))  # fmt: skip
    constexprs = dict(BM=cfg.block_rows, BC=cfg.block_cols, MX=spec)
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

    `out_codes` / `out_scales`: caller-provided output views, as in `triton_norm_quant.fused_norm_quant`.
    `config`: tiles and variant (default `quant_config`; every config gives the same bits).
    `rule`: a `reference.QuantRule` value (0 DEFAULT, 1 TORCHAO).
    """
    isa = device_isa(x.device)
    outputs, launch = quant_launch(
        x, swizzled, isa=isa, out_codes=out_codes, out_scales=out_scales, config=config, rule=rule
    )
    return run(outputs, launch)


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
    br, bs = SWIZZLE_ROW_TILE, SWIZZLE_BLOCK_COLS
    grid = (rows // br, triton.cdiv(cols, bs))
    args = (scales, out, m, rows, scales.stride(0), s, cols)
    return out, KernelLaunch(_swizzle_kernel, grid, args, dict(BR=br, BS=bs), 4, fp_fusion=False)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major `[M, S]` uint8 scales -> F8_128x4 `[pad128(M), pad4(S)]`, zero padded."""
    device_isa(scales.device)  # an unsupported GPU is refused before anything compiles
    out, launch = swizzle_launch(scales)
    if launch is not None:
        launch.run()
    return out
