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
exact and order-free, so any tiling quantizes the same bits (NaN is removed with an
explicit `where` before the max; the E8M0 scale and the `2**(127 - sb)` multiplier are
built from bits; +-Inf is mapped to +-448 with explicit `where`s; the fp32 -> e4m3 cast is
the hardware's round-to-nearest-even). The one order-dependent operation is the norm's
sum of squares. It is done by :func:`_row_sum_of_squares`, a FIXED tree of two-element
additions over the row zero-padded to ``BLOCK_K = max(128, next_pow2(K))`` columns:

1. three levels of adjacent pairs (groups of 8 contiguous columns, which a thread holds
   in registers after a 16-byte load), then
2. ``log2(BLOCK_K / 8)`` levels of "halves": element g is added to element g + n/2.

Every level is a ``tl.sum`` over an axis of size 2, i.e. ONE IEEE addition ``a + b``,
which is commutative: the result does not depend on which thread holds which element,
so it is the same for every layout Triton picks (rows per program, num_warps). Padding
adds exact zeros. The tree depends on K only, never on M, on the regime, or on whether the
kernel is the fused or the unfused one. The norm and the fused kernel share
:func:`_gemma_norm_tile` (load, add, residual store, tree, rsqrt, weight), and every kernel
is compiled with ``enable_fp_fusion=False`` so that LLVM cannot contract a multiply and an
add into an FMA in one kernel and not in another. ``1/sqrt`` and ``/K`` use the correctly
rounded ``sqrt_rn``/``div_rn`` (what torch's CPU rsqrt and mean compute), so the only
difference from the CPU reference is the summation order of the sum of squares.
Consequences: fused == unfused bitwise, and results are batch invariant (the same row
gives the same bits inside any batch).

Regimes (launch shapes; arithmetic per row is the same in all of them):

- norm / fused norm+quant: a program owns a ``[BM, BLOCK_K]`` tile (BM whole rows) and
  does one pass: read x (+ residual) once, write residual_out, y (optional) and codes +
  scales. Large K (BLOCK_K >= 2048) uses BM = 1 (one row per program: at M >= 132 this
  fills the machine with up to 2-3 resident programs per SM, each with 16-24 KB of loads in
  flight); small K packs rows so a tile holds ~4K elements. num_warps grows with the tile
  (~16 fp32 values per thread) so small M (latency-bound: one program per row) spreads a
  row over many warps.
- quant: ``[BM, BC]`` tiles with BC <= 1024 columns (a 2-D grid, so even M = 1 gets
  K/1024 programs), BM rows so that a tile is ~4K-8K elements.
- swizzled scales: the kernel stores each scale at its F8_128x4 offset directly; the
  grid covers pad128(M) rows and pad4(K/32) columns, so the zero padding is written by the
  same launch (no memset).

Importing this module compiles nothing and makes no CUDA call; kernels compile on first
launch. The kernels' int arguments that vary with M are excluded from Triton's value
specialization so a new M never recompiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
BLOCK = 32

__all__ = ["fused_norm_quant", "gemma_norm", "quantize", "swizzle_scales"]


# --------------------------------------------------------------------------- helpers


@triton.jit
def _row_sum_of_squares(s, BM: tl.constexpr, BLOCK_K: tl.constexpr, LOG_K: tl.constexpr):
    """Fixed-tree sum of `s*s` along axis 1 of a `[BM, BLOCK_K]` fp32 tile (see module doc).

    Each level is a sum over an axis of size 2 (one commutative IEEE add), so the
    result is independent of the layout, of BM and of num_warps.
    """
    v = s * s
    # level i adds columns 2j and 2j+1 of the previous level (pairwise summation, bottom-up)
    for i in tl.static_range(LOG_K):
        v = tl.sum(tl.reshape(v, [BM, (BLOCK_K // 2) >> i, 2]), axis=2)
    return tl.reshape(v, [BM])


@triton.jit
def _gemma_norm_tile(
    x_ptr,
    r_ptr,
    w_ptr,
    ro_ptr,
    rows,
    cols,
    row_mask,
    col_mask,
    K,
    stride_x,
    stride_r,
    eps,
    weight_offset,
    round_sum,
    HAS_RES: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOG_K: tl.constexpr,
):
    """Norm of a `[BM, BLOCK_K]` row tile; stores residual_out; returns y in x's dtype."""
    r2 = rows[:, None]
    c2 = cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + r2 * stride_x + c2, mask=mask, other=0.0)
    s = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + r2 * stride_r + c2, mask=mask, other=0.0)
        s = s + r.to(tl.float32)
        ro = s.to(x.dtype)
        tl.store(ro_ptr + r2 * K + c2, ro, mask=mask)
        if round_sum != 0:
            s = ro.to(tl.float32)
    ssq = _row_sum_of_squares(s, BM, BLOCK_K, LOG_K)
    var = tl.math.div_rn(ssq, K.to(tl.float32))
    rstd = tl.math.div_rn(tl.full([BM], 1.0, tl.float32), tl.math.sqrt_rn(var + eps))
    w = tl.load(w_ptr + c2, mask=col_mask[None, :], other=0.0).to(tl.float32) + weight_offset
    y = (s * rstd[:, None]) * w
    return y.to(x.dtype)


@triton.jit
def _mx_quant_tile(v, BM: tl.constexpr, BC: tl.constexpr):
    """MXFP8 of a `[BM, BC]` fp32 tile: e4m3 codes `[BM, BC]` and E8M0 scales `[BM, BC/32]` (int32)."""
    v3 = tl.reshape(v, [BM, BC // 32, 32])
    a = tl.abs(v3)
    a = tl.where(a != a, 0.0, a)  # NaN does not take part in the amax
    amax = tl.max(a, axis=2)
    amax = tl.maximum(amax, 1.1754943508222875e-38)  # FLT_MIN (smallest normal)
    bits = amax.to(tl.int32, bitcast=True)
    biased_exp = bits >> 23
    sb = biased_exp - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    sb = tl.where(biased_exp == 255, 254, sb)  # +Inf amax
    sb = tl.where(sb < 0, 0, sb)
    sb = tl.where(sb > 254, 254, sb)
    e = 254 - sb  # biased exponent of 2**(127 - sb)
    mbits = tl.where(e == 0, 0x00400000, e << 23)  # e == 0: 2**-127 (subnormal)
    mult = mbits.to(tl.float32, bitcast=True)
    q = v3 * mult[:, :, None]
    vbits = v3.to(tl.int32, bitcast=True)
    is_inf = (vbits & 0x7FFFFFFF) == 0x7F800000
    q = tl.where(is_inf, tl.where(vbits < 0, -448.0, 448.0), q)
    codes = tl.reshape(q.to(tl.float8e4nv), [BM, BC])
    return codes, sb


@triton.jit
def _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, swizzled):
    """Store `[BM, NB]` scales at row-major `[M, S]` or F8_128x4 `[pad128(M), SP]` offsets."""
    r2 = rows[:, None]
    c2 = scols[None, :]
    if swizzled != 0:
        off = (r2 // 128) * (SP * 128) + (c2 // 4) * 512 + (r2 % 32) * 16 + ((r2 // 32) % 4) * 4 + (c2 % 4)
        mask = (r2 < M_grid) & (c2 < SP)
    else:
        off = r2 * S + c2
        mask = (r2 < M_grid) & (c2 < S)
    tl.store(sc_ptr + off, sb.to(tl.uint8), mask=mask)


# --------------------------------------------------------------------------- kernels

_DNS = ["M", "M_grid", "round_sum", "emit_y", "swizzled"]


@triton.jit(do_not_specialize=_DNS)
def _norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    ro_ptr,
    y_ptr,
    q_ptr,
    sc_ptr,
    M,
    M_grid,
    K,
    stride_x,
    stride_r,
    S,
    SP,
    eps,
    weight_offset,
    round_sum,
    emit_y,
    swizzled,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOG_K: tl.constexpr,
):
    """Unfused norm (QUANT=False: writes y) or fused norm+quant (QUANT=True)."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < K
    y = _gemma_norm_tile(
        x_ptr, r_ptr, w_ptr, ro_ptr, rows, cols, row_mask, col_mask, K, stride_x, stride_r,
        eps, weight_offset, round_sum, HAS_RES, BM, BLOCK_K, LOG_K,
    )  # fmt: skip
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows[:, None] * K + cols[None, :]
    if QUANT:
        if emit_y != 0:
            tl.store(y_ptr + offs, y, mask=mask)
        codes, sb = _mx_quant_tile(y.to(tl.float32), BM, BLOCK_K)
        # 8 codes (8 bytes) per thread: the same register layout as the 16-byte bf16 accesses,
        # so no shared-memory layout conversion is needed between the loads and the stores.
        tl.store(q_ptr + tl.max_contiguous(offs, [1, 8]), codes, mask=mask)
        _store_scales(sc_ptr, sb, rows, tl.arange(0, BLOCK_K // 32), M_grid, S, SP, swizzled)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


@triton.jit(do_not_specialize=["M", "M_grid", "swizzled"])
def _quant_kernel(
    x_ptr,
    q_ptr,
    sc_ptr,
    M,
    M_grid,
    K,
    stride_x,
    S,
    SP,
    swizzled,
    BM: tl.constexpr,
    BC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_k * BC + tl.arange(0, BC)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    codes, sb = _mx_quant_tile(x.to(tl.float32), BM, BC)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], codes, mask=mask)
    scols = pid_k * (BC // 32) + tl.arange(0, BC // 32)
    _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, swizzled)



@triton.jit(do_not_specialize=["M", "M_grid"])
def _swizzle_kernel(src_ptr, dst_ptr, M, M_grid, stride_src, S, SP, BR: tl.constexpr, BS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BS)
    mask = (rows < M)[:, None] & (cols < S)[None, :]
    v = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=mask, other=0)
    _store_scales(dst_ptr, v, rows, cols, M_grid, S, SP, 1)


# --------------------------------------------------------------------------- launch configs


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _block_k(k: int) -> int:
    return max(128, _pow2(k))


def row_config(block_k: int, m: int) -> tuple[int, int]:
    """(rows per program, num_warps) for the norm / fused kernels. Any choice gives the same bits.

    Depends on K only (one compiled kernel per K serves every M): BM whole rows per
    program so a tile holds >= 2K elements, ~16 fp32 values per thread.
    """
    del m
    bm = 1 if block_k >= 2048 else min(16, 2048 // block_k)
    nw = max(4, min(16, bm * block_k // 512))
    return bm, nw


def quant_config(k: int, m: int) -> tuple[int, int, int]:
    """(rows per program, columns per program, num_warps) for the quant kernel."""
    bc = min(1024, _block_k(k))
    bm = max(1, 4096 // bc)
    bm = max(1, min(bm, _pow2(max(m, 1))))
    nw = max(4, min(8, bm * bc // 512))
    return bm, bc, nw


# Overrides used by tools/bench_kernels.py to sweep launch shapes: {"row": (bm, nw), "quant": (bm, bc, nw)}.
CONFIG_OVERRIDE: dict = {}


# --------------------------------------------------------------------------- python entry points


def _check2d(name: str, t: torch.Tensor):
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"triton_norm_quant: {name} must be 2-D with a unit last stride, got {tuple(t.shape)} {t.stride()}")


def _launch_norm(x, residual, weight, eps, quant, swizzled, emit_y, round_sum, weight_offset):
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
        codes = torch.empty((m, k), dtype=FP8, device=dev)
        scales = torch.empty((m_grid, sp) if swizzled else (m, s), dtype=torch.uint8, device=dev)
    if m_grid == 0:
        return codes, scales, res_out, y
    block_k = _block_k(k)
    bm, nw = CONFIG_OVERRIDE.get("row") or row_config(block_k, m)
    grid = (triton.cdiv(m_grid, bm),)
    r = residual if has_res else x
    _norm_kernel[grid](
        x, r, weight, res_out if has_res else x, y if y is not None else x,
        codes if quant else x, scales if quant else x,
        m, m_grid, k, x.stride(0), r.stride(0), s, sp, float(eps), float(weight_offset),
        int(bool(round_sum and has_res)), int(bool(emit_y)), int(bool(swizzled)),
        HAS_RES=has_res, QUANT=quant, BM=bm, BLOCK_K=block_k, LOG_K=block_k.bit_length() - 1,
        num_warps=nw, enable_fp_fusion=False,
    )  # fmt: skip
    return codes, scales, res_out, y


def gemma_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Unfused Gemma norm: `(y, residual_out)` (residual_out is None without a residual)."""
    _, _, res_out, y = _launch_norm(x, residual, weight, eps, False, False, False, False, 1.0)
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
):
    """Norm (+add) and MXFP8 quant in one launch: `(codes, scales, residual_out|None, y|None)`."""
    return _launch_norm(x, residual, weight, eps, True, swizzled, emit_y, round_sum, weight_offset)


def quantize(x: torch.Tensor, swizzled: bool = False):
    """MXFP8 codes `[M, K]` e4m3 and scales (uint8 `[M, K/32]`, or F8_128x4 `[pad128(M), pad4(K/32)]`)."""
    _check2d("x", x)
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"triton_norm_quant: K={k} is not a multiple of {BLOCK}")
    s, sp = k // BLOCK, _round_up(k // BLOCK, 4)
    m_grid = _round_up(m, 128) if swizzled else m
    codes = torch.empty((m, k), dtype=FP8, device=x.device)
    scales = torch.empty((m_grid, sp) if swizzled else (m, s), dtype=torch.uint8, device=x.device)
    if m_grid == 0:
        return codes, scales
    bm, bc, nw = CONFIG_OVERRIDE.get("quant") or quant_config(k, m)
    grid = (triton.cdiv(m_grid, bm), triton.cdiv(k, bc))
    _quant_kernel[grid](
        x, codes, scales, m, m_grid, k, x.stride(0), s, sp, int(bool(swizzled)),
        BM=bm, BC=bc, num_warps=nw, enable_fp_fusion=False,
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
    br = 128
    bs = max(4, _pow2(sp))
    _swizzle_kernel[(mp // br,)](scales, out, m, mp, scales.stride(0), s, sp, BR=br, BS=bs, num_warps=4)
    return out
