"""The RMSNorm producer prologue of the norm kernels (:mod:`mxfuse.ops.triton_norm_quant`).

BM whole rows of x (+ residual), held as NCH chunks of CH columns: load them (and the
weight), add the residual (storing residual_out), reduce the sum of squares in the fixed
order of the bitwise contract, and give each chunk's fp32 output `yf` and its rounded form
`y` to the caller, which stores y or hands both to the MXFP8 epilogue
(:func:`mxfuse.ops.triton_mx_quant._mx_epilogue`). The arithmetic and its order are
described in triton_norm_quant's docstring ("Bitwise contract", "Targets").

Argument bundles: :class:`NormIo` (runtime: the input pointers, residual_out and the row
strides) and :class:`NormSpec` (a constexpr: the flags and the launch shape of a row).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from mxfuse.ops.triton_fp32_math import bf16_bits_to_f32


class NormIo(NamedTuple):
    """The norm's inputs and residual_out (runtime values)."""

    x_ptr: Any
    r_ptr: Any
    """The residual (x when there is none)."""
    w_ptr: Any
    ro_ptr: Any
    """residual_out, `[M, K]` contiguous (x when there is no residual)."""
    stride_x: int
    stride_r: int


class NormSpec(NamedTuple):
    """The norm kernel's constexprs besides the epilogue's (`triton_mx_quant.MxSpec`).

    A row is NCH (1..4) chunks of CH columns (a power of two); BM rows per tile. Flags:
    `norm_quant_config.NormConfig` and `triton_norm_quant._norm_kernel` say what each does.
    """

    HAS_RES: bool
    QUANT: bool
    ROUND_SUM: bool
    ROUND_NORMALIZED: bool
    BM: int
    CH: int
    NCH: int
    TREE: str
    RSQRT: str
    EVICT_FIRST: bool
    PERSISTENT: bool
    SPLIT: int
    LOAD_FENCE: bool
    PAD_FILL: bool
    PAD_ROWS: int
    PAD_WORDS: int
    LOOP_STAGES: int
    PDL: bool
    """Programmatic dependent launch: `gdc_wait` before the first load (NVIDIA only)."""
    UNPACK: str = "cvt"
    """`norm_quant_config.UNPACKS`: how bf16 rows and weight become fp32 (same bits)."""


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
def _to_f32(v, UNPACK: tl.constexpr, ISA: tl.constexpr):
    """`v.to(float32)`; UNPACK "bits" (bf16 on NVIDIA): by moving bits (`bf16_bits_to_f32`, same values)."""
    if UNPACK == "bits" and ISA == "ptx" and v.dtype == tl.bfloat16:
        return bf16_bits_to_f32(v)
    else:
        return v.to(tl.float32)


@triton.jit
def _load_weight(
    w_ptr, K, weight_offset, NCH: tl.constexpr, CH: tl.constexpr, UNPACK: tl.constexpr = "cvt", ISA: tl.constexpr = ""
):
    """(cols, w): the NCH column ranges of a row and the fp32 `w + weight_offset` on each
    (`UNPACK`, `ISA`: :func:`_to_f32`)."""
    cols = ()
    w = ()
    for j in tl.static_range(NCH):
        c = j * CH + tl.arange(0, CH)
        cols = cols + (c,)
        wj = tl.load(w_ptr + c[None, :], mask=(c < K)[None, :], other=0.0)
        w = w + (_to_f32(wj, UNPACK, ISA) + weight_offset,)
    return cols, w


@triton.jit
def _sum_chunk(
    x, r, ro_ptr, rows, cols, row_mask, K, owner, HAS_RES: tl.constexpr, ROUND_SUM: tl.constexpr,
    UNPACK: tl.constexpr, ISA: tl.constexpr,
):  # fmt: skip
    """fp32 `s = x (+ r)` of one chunk; stores residual_out = s.to(dtype) when HAS_RES and
    this program `owner`s the chunk. `UNPACK`, `ISA`: :func:`_to_f32`."""
    s = _to_f32(x, UNPACK, ISA)
    if HAS_RES:
        s = s + _to_f32(r, UNPACK, ISA)
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
    "approx": the hardware's reciprocal square root (triton_norm_quant's docstring, "Targets")."""
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
def _norm_rows(rows, row_mask, part, cols, io, K, eps, F: tl.constexpr, MX: tl.constexpr):
    """`(s, rstd)` of BM rows: the NCH fp32 chunks `s = x (+ residual)` and `1/rms` per row.

    All loads are issued before any use (one pass); residual_out is stored for the chunks
    this program finishes (`part` of F.SPLIT: J % SPLIT == part; all of them unsplit).
    `F`: :class:`NormSpec`; `MX`: `triton_mx_quant.MxSpec` (its ISA).
    """
    NCH: tl.constexpr = F.NCH  # bundle fields passed on: constexprs (see triton_norm_quant._norm_tile)
    BM: tl.constexpr = F.BM
    CH: tl.constexpr = F.CH
    EVICT_FIRST: tl.constexpr = F.EVICT_FIRST
    HAS_RES: tl.constexpr = F.HAS_RES
    ROUND_SUM: tl.constexpr = F.ROUND_SUM
    TREE: tl.constexpr = F.TREE
    RSQRT: tl.constexpr = F.RSQRT
    ISA: tl.constexpr = MX.ISA
    UNPACK: tl.constexpr = F.UNPACK
    if F.LOAD_FENCE:
        # ptxas otherwise issues the weight loads only after the first use of x (after x's
        # round trip: a second, dependent one, exposed once the reduction is short); the
        # barrier keeps them ahead of the x / residual loads.
        tl.debug_barrier()
    x = _load_chunks(io.x_ptr, rows, io.stride_x, cols, row_mask, K, NCH, EVICT_FIRST)
    r = x
    if HAS_RES:
        r = _load_chunks(io.r_ptr, rows, io.stride_r, cols, row_mask, K, NCH, EVICT_FIRST)
    s = ()
    for j in tl.static_range(NCH):
        owner = F.SPLIT == 1 or part == j % F.SPLIT  # the constexpr True when a row is not split: no branch
        s = s + (_sum_chunk(x[j], r[j], io.ro_ptr, rows, cols[j], row_mask, K, owner, HAS_RES, ROUND_SUM, UNPACK, ISA),)
    rstd = _rstd(_sum_of_squares(s, NCH, BM, CH, TREE), K, eps, BM, RSQRT, ISA)
    return s, rstd


@triton.jit
def _normalize(s, w, rstd, dtype: tl.constexpr, ROUND_NORMALIZED: tl.constexpr):
    """`(yf, y)` of one chunk: fp32 `(s * rstd) * w` (`s * rstd` rounded to dtype first when
    ROUND_NORMALIZED: the Hugging Face LlamaRMSNorm order) and y, it rounded to dtype."""
    n = s * rstd[:, None]
    if ROUND_NORMALIZED:
        n = n.to(dtype).to(tl.float32)
    yf = n * w
    return yf, yf.to(dtype)
