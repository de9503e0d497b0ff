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
built from bits; +-Inf is mapped to +-448 by a clamp with `propagate_nan=ALL`, which keeps
NaN; the fp32 -> e4m3 cast is the hardware's round-to-nearest-even). The one
order-dependent operation is the norm's sum of squares. Its structure is fixed by K alone:

- a row is split into NCH <= 4 chunks of CH = max(128, next_pow2(K) / 4) columns (CH a
  power of two; the last chunk zero-padded);
- the squares are first added ELEMENTWISE across chunks, ``(a^2 + b^2) + (c^2 + d^2)``
  (an absent chunk is omitted; adding an exact +0 would change nothing);
- the resulting CH-vector is summed by :func:`_pairwise_sum`, the bottom-up pairwise
  tree, every level of which is a ``tl.sum`` over an axis of size 2, i.e. ONE IEEE
  addition ``a + b``: commutative, so the result does not depend on which thread holds
  which element, on the layout Triton picks, on num_warps or on rows per program.

The fused and the unfused norm are the same kernel (`QUANT` constexpr) and share every
helper. All kernels are compiled with ``enable_fp_fusion=False`` so LLVM cannot contract a
multiply and an add into an FMA in one variant and not in another. ``1/sqrt`` and ``/K``
use the correctly rounded ``sqrt_rn``/``div_rn`` (what torch's CPU rsqrt and mean compute),
so the only difference from the CPU reference is the summation order. Consequences:
fused == unfused bitwise, and results are batch invariant (a row gives the same bits in
any batch, in any regime).

Regimes (launch shapes; the arithmetic of a row is the same in all of them; numbers in
docs/perf_notes.md):

- norm / fused norm+quant: a program owns tiles of BM whole rows, all NCH chunks in
  registers, one pass: read x (+ residual) once, write residual_out, y (optional) and
  codes + scales. All loads of a tile are issued before any store. Large K uses BM = 1.
  ~32 values of the padded row per thread (8 warps for K = 6144, 4 for K = 3072): measured
  fastest at every M from 1 to 16384 (more warps did not help the latency-bound small-M
  case: the row's reduction then crosses more warps through shared memory). Chunking
  avoids the 25% of idle lanes a single power-of-two tile would waste at K = 3 * 2**n
  (the fused kernel is close to issue-bound at large M).
- quant: ``[BM, BC]`` tiles with BC <= 1024 columns (a 2-D grid, so even M = 1 gets
  K/1024 programs), BM rows so that a tile is ~4K elements.
- swizzled scales: the kernel stores each scale at its F8_128x4 offset directly; the
  grid covers pad128(M) rows and pad4(K/32) columns (CH >= 128 makes the chunks cover
  them), so the zero padding is written by the same launch (no memset).
- standalone swizzle (after the SP gather): `[128, 16]` blocks on a 2-D grid. One program
  per 128 rows moved all K/32 columns (24 KB of byte stores at K = 6144) alone at decode
  sizes: ~8 µs of the packed+swizzle SP variant (docs/sp_notes.md).

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
SWIZZLE_BLOCK_COLS = 16  # scale columns per program of the standalone swizzle (x 128 rows = 2 KB)

__all__ = ["fused_norm_quant", "gemma_norm", "quantize", "swizzle_scales"]


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
def _load_chunk(ptr, rows, stride, cols, row_mask, K):
    """`[BM, CH]` tile of rows `rows` and columns `cols` (zero outside the matrix)."""
    mask = row_mask[:, None] & (cols < K)[None, :]
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _sum_chunk(x, r, ro_ptr, rows, cols, row_mask, K, round_sum, HAS_RES: tl.constexpr):
    """fp32 `s = x (+ r)` of one chunk; stores residual_out = s.to(dtype) when HAS_RES."""
    s = x.to(tl.float32)
    if HAS_RES:
        s = s + r.to(tl.float32)
        ro = s.to(x.dtype)
        mask = row_mask[:, None] & (cols < K)[None, :]
        tl.store(ro_ptr + rows[:, None] * K + cols[None, :], ro, mask=mask)
        if round_sum != 0:
            s = ro.to(tl.float32)
    return s


@triton.jit
def _rstd(ssq, K, eps, BM: tl.constexpr):
    """`1 / sqrt(ssq / K + eps)` with correctly rounded divide and sqrt (what torch's CPU ops compute)."""
    var = tl.math.div_rn(ssq, K.to(tl.float32))
    return tl.math.div_rn(tl.full([BM], 1.0, tl.float32), tl.math.sqrt_rn(var + eps))


@triton.jit
def _finish_chunk(
    s, w, rstd, y_ptr, q_ptr, sc_ptr, rows, cols, row_mask, K, stride_q, stride_s, M_grid, S, SP, emit_y, swizzled,
    dtype: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, J: tl.constexpr, RULE: tl.constexpr = 0,
):  # fmt: skip
    """Chunk J (columns J*CH ..): y = (s * rstd) * w rounded to dtype; store y (norm) or quantize it and store codes + scales."""
    y = ((s * rstd[:, None]) * w).to(dtype)
    mask = row_mask[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    if QUANT:
        if emit_y != 0:
            tl.store(y_ptr + offs, y, mask=mask)
        codes, sb = _mx_quant_tile(y.to(tl.float32), BM, CH, RULE)
        # 8 codes (8 bytes) per thread: the register layout of the 16-byte bf16 accesses,
        # so no shared-memory layout conversion between the loads and the code stores.
        # Codes rows are `stride_q` bytes apart (K, or K + K/32 in a row-packed buffer).
        q_offs = rows[:, None] * stride_q + cols[None, :]
        tl.store(q_ptr + tl.max_contiguous(q_offs, [1, 8]), codes, mask=mask)
        scols = J * (CH // 32) + tl.arange(0, CH // 32)
        _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, swizzled, stride_s)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _mx_quant_tile(v, BM: tl.constexpr, BC: tl.constexpr, RULE: tl.constexpr = 0):
    """MXFP8 of a `[BM, BC]` fp32 tile: e4m3 codes `[BM, BC]` and E8M0 scales `[BM, BC/32]` (int32).

    RULE (reference.QuantRule): 0 DEFAULT; 1 TORCHAO (a NaN makes the block's scale 255
    and all its codes NaN; scale byte 0 multiplies by 1.0).
    """
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
    if RULE == 1:  # torchao's RCEIL
        nan_block = tl.max((v3 != v3).to(tl.int32), axis=2) > 0  # noqa: PLR0124 (NaN test)
        mbits = tl.where(sb == 0, 0x3F800000, mbits)  # 1.0
        mbits = tl.where(nan_block, 0x7FC00000, mbits)  # NaN: every code of the block NaN
        sb = tl.where(nan_block, 255, sb)
    mult = mbits.to(tl.float32, bitcast=True)
    q = v3 * mult[:, :, None]
    # Finite values are within +-448 by construction; this maps +-Inf to +-448 and keeps
    # NaN (propagate_nan=ALL lowers to the NaN-propagating min/max, never NaN-dropping).
    q = tl.clamp(q, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    codes = tl.reshape(q.to(tl.float8e4nv), [BM, BC])
    return codes, sb


@triton.jit
def _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, swizzled, stride_s):
    """Store `[BM, NB]` scales at row-major `[M, S]` (rows `stride_s` bytes apart) or F8_128x4 `[pad128(M), SP]` offsets."""
    r2 = rows[:, None]
    c2 = scols[None, :]
    if swizzled != 0:
        off = (r2 // 128) * (SP * 128) + (c2 // 4) * 512 + (r2 % 32) * 16 + ((r2 // 32) % 4) * 4 + (c2 % 4)
        mask = (r2 < M_grid) & (c2 < SP)
    else:
        off = r2 * stride_s + c2
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
    stride_q,
    stride_s,
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
    RPP: tl.constexpr,
    CH: tl.constexpr,
    NCH: tl.constexpr,
    LOG_CH: tl.constexpr,
    RULE: tl.constexpr = 0,
):
    """Unfused norm (QUANT=False: writes y) or fused norm+quant (QUANT=True).

    A row is NCH (1..4) chunks of CH columns (CH = max(128, BLOCK_K/4), a power of two),
    held in registers. Program p handles RPP consecutive tiles of BM rows starting at row
    p * RPP * BM; the weight is loaded once per program. All loads of a tile are issued
    before any store, so the chunks' memory latencies overlap.
    """
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    ca = tl.arange(0, CH)
    cb = ca + CH
    cc = ca + 2 * CH
    cd = ca + 3 * CH
    wa = tl.load(w_ptr + ca[None, :], mask=(ca < K)[None, :], other=0.0).to(tl.float32) + weight_offset
    wb = wa
    wc = wa
    wd = wa
    if NCH > 1:
        wb = tl.load(w_ptr + cb[None, :], mask=(cb < K)[None, :], other=0.0).to(tl.float32) + weight_offset
    if NCH > 2:
        wc = tl.load(w_ptr + cc[None, :], mask=(cc < K)[None, :], other=0.0).to(tl.float32) + weight_offset
    if NCH > 3:
        wd = tl.load(w_ptr + cd[None, :], mask=(cd < K)[None, :], other=0.0).to(tl.float32) + weight_offset
    for i in range(RPP):
        rows = (pid.to(tl.int64) * RPP + i) * BM + tl.arange(0, BM)
        rm = rows < M
        # ---- all loads first
        xa = _load_chunk(x_ptr, rows, stride_x, ca, rm, K)
        xb = xa
        xc = xa
        xd = xa
        if NCH > 1:
            xb = _load_chunk(x_ptr, rows, stride_x, cb, rm, K)
        if NCH > 2:
            xc = _load_chunk(x_ptr, rows, stride_x, cc, rm, K)
        if NCH > 3:
            xd = _load_chunk(x_ptr, rows, stride_x, cd, rm, K)
        ra = xa
        rb = xb
        rc = xc
        rd = xd
        if HAS_RES:
            ra = _load_chunk(r_ptr, rows, stride_r, ca, rm, K)
            if NCH > 1:
                rb = _load_chunk(r_ptr, rows, stride_r, cb, rm, K)
            if NCH > 2:
                rc = _load_chunk(r_ptr, rows, stride_r, cc, rm, K)
            if NCH > 3:
                rd = _load_chunk(r_ptr, rows, stride_r, cd, rm, K)
        # ---- s, residual_out, and the fixed-tree sum of squares: elementwise over the
        # chunks, (a^2 + b^2) + (c^2 + d^2) (absent chunks omitted: adding an exact +0
        # changes nothing), then the pairwise tree over the CH columns.
        sa = _sum_chunk(xa, ra, ro_ptr, rows, ca, rm, K, round_sum, HAS_RES)
        sb_ = sa
        sc_ = sa
        sd_ = sa
        v = sa * sa
        if NCH > 1:
            sb_ = _sum_chunk(xb, rb, ro_ptr, rows, cb, rm, K, round_sum, HAS_RES)
            v = v + sb_ * sb_
        if NCH > 2:
            sc_ = _sum_chunk(xc, rc, ro_ptr, rows, cc, rm, K, round_sum, HAS_RES)
            if NCH > 3:
                sd_ = _sum_chunk(xd, rd, ro_ptr, rows, cd, rm, K, round_sum, HAS_RES)
                v = v + (sc_ * sc_ + sd_ * sd_)
            else:
                v = v + sc_ * sc_
        rstd = _rstd(_pairwise_sum(v, BM, CH, LOG_CH), K, eps, BM)
        # ---- y (and quant) per chunk
        _finish_chunk(sa, wa, rstd, y_ptr, q_ptr, sc_ptr, rows, ca, rm, K, stride_q, stride_s, M_grid, S, SP, emit_y, swizzled,
                      dtype, QUANT, BM, CH, 0, RULE)  # fmt: skip
        if NCH > 1:
            _finish_chunk(sb_, wb, rstd, y_ptr, q_ptr, sc_ptr, rows, cb, rm, K, stride_q, stride_s, M_grid, S, SP, emit_y, swizzled,
                          dtype, QUANT, BM, CH, 1, RULE)  # fmt: skip
        if NCH > 2:
            _finish_chunk(sc_, wc, rstd, y_ptr, q_ptr, sc_ptr, rows, cc, rm, K, stride_q, stride_s, M_grid, S, SP, emit_y, swizzled,
                          dtype, QUANT, BM, CH, 2, RULE)  # fmt: skip
        if NCH > 3:
            _finish_chunk(sd_, wd, rstd, y_ptr, q_ptr, sc_ptr, rows, cd, rm, K, stride_q, stride_s, M_grid, S, SP, emit_y, swizzled,
                          dtype, QUANT, BM, CH, 3, RULE)  # fmt: skip


@triton.jit(do_not_specialize=["M", "M_grid", "swizzled"])
def _quant_kernel(
    x_ptr,
    q_ptr,
    sc_ptr,
    M,
    M_grid,
    K,
    stride_x,
    stride_q,
    stride_s,
    S,
    SP,
    swizzled,
    BM: tl.constexpr,
    BC: tl.constexpr,
    RULE: tl.constexpr = 0,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_k * BC + tl.arange(0, BC)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    codes, sb = _mx_quant_tile(x.to(tl.float32), BM, BC, RULE)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], codes, mask=mask)
    scols = pid_k * (BC // 32) + tl.arange(0, BC // 32)
    _store_scales(sc_ptr, sb, rows, scols, M_grid, S, SP, swizzled, stride_s)



@triton.jit(do_not_specialize=["M", "M_grid"])
def _swizzle_kernel(src_ptr, dst_ptr, M, M_grid, stride_src, S, SP, BR: tl.constexpr, BS: tl.constexpr):
    """One `[BR, BS]` block per program: a grid over row tiles AND scale columns, so the few
    rows of a decode-sized gather still spread over many programs."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BS + tl.arange(0, BS)
    mask = (rows < M)[:, None] & (cols < S)[None, :]
    v = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=mask, other=0)
    _store_scales(dst_ptr, v, rows, cols, M_grid, S, SP, 1, S)


# --------------------------------------------------------------------------- launch configs


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _block_k(k: int) -> int:
    return max(128, _pow2(k))


def row_config(block_k: int, m: int) -> tuple[int, int, int]:
    """(rows per tile BM, tiles per program RPP, num_warps) for the norm / fused kernels.

    Any choice gives the same bits (the row arithmetic does not depend on it). Measured on
    H200 (docs/perf_notes.md, sweep of run 2): ~32 values of the padded row per thread
    (8 warps for K = 6144, 4 for K = 3072) was the fastest at every M measured (1, 64,
    4096, 16384), for the fused and the unfused norm; 16 values per thread (more warps)
    was slower even at M = 1, and RPP = 4 (weight loaded once per 4 rows) was slower
    everywhere (2x at M = 1: the masked iterations still run; -5% at M = 16384: 127
    registers halve the resident programs).
    """
    del m
    bm = 1 if block_k >= 2048 else min(16, 2048 // block_k)
    nw = max(4, min(16, bm * block_k // 1024))
    return bm, 1, nw


def quant_config(k: int, m: int) -> tuple[int, int, int]:
    """(rows per program, columns per program, num_warps) for the quant kernel."""
    bc = min(1024, _block_k(k))
    bm = max(1, 4096 // bc)
    bm = max(1, min(bm, _pow2(max(m, 1))))
    nw = max(4, min(8, bm * bc // 512))
    return bm, bc, nw


# Overrides used by tools/bench_kernels.py to sweep launch shapes: {"row": (bm, rpp, nw), "quant": (bm, bc, nw)}.
CONFIG_OVERRIDE: dict = {}


# --------------------------------------------------------------------------- python entry points


def _check2d(name: str, t: torch.Tensor):
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"triton_norm_quant: {name} must be 2-D with a unit last stride, got {tuple(t.shape)} {t.stride()}")


def _out_views(m, k, swizzled, dev, out_codes, out_scales):
    """Codes `[m, k]` e4m3 and scales (row-major `[m, k/32]` or swizzled) buffers: the
    caller's views where given (row-major scales only; any row stride, unit last stride,
    e.g. the two halves of a row-packed `[m, k + k/32]` byte buffer), else new tensors."""
    s, sp = k // BLOCK, _round_up(k // BLOCK, 4)
    m_grid = _round_up(m, 128) if swizzled else m
    if out_codes is None:
        codes = torch.empty((m, k), dtype=FP8, device=dev)
    else:
        codes = out_codes
        if codes.shape != (m, k) or codes.dtype != FP8 or codes.device != dev:
            raise ValueError(f"triton_norm_quant: out_codes must be [{m}, {k}] {FP8} on {dev}, got "
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
                 out_codes=None, out_scales=None, rule=0):  # fmt: skip
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
    block_k = _block_k(k)
    ch = max(128, block_k // 4)
    bm, rpp, nw = CONFIG_OVERRIDE.get("row") or row_config(block_k, m)
    grid = (triton.cdiv(m_grid, bm * rpp),)
    r = residual if has_res else x
    _norm_kernel[grid](
        x, r, weight, res_out if has_res else x, y if y is not None else x,
        codes if quant else x, scales if quant else x,
        m, m_grid, k, x.stride(0), r.stride(0),
        _row_stride(codes, k) if quant else k, _row_stride(scales, s) if quant else s,
        s, sp, float(eps), float(weight_offset),
        int(bool(round_sum and has_res)), int(bool(emit_y)), int(bool(swizzled)),
        HAS_RES=has_res, QUANT=quant, BM=bm, RPP=rpp, CH=ch, NCH=triton.cdiv(k, ch), LOG_CH=ch.bit_length() - 1,
        RULE=int(rule), num_warps=nw, enable_fp_fusion=False,
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
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    rule: int = 0,
):
    """Norm (+add) and MXFP8 quant in one launch: `(codes, scales, residual_out|None, y|None)`.

    `out_codes` (`[M, K]` e4m3) / `out_scales` (`[M, K/32]` uint8, row-major only): write
    into these caller-provided 2-D views (any row stride, unit last stride), e.g.
    `packed[:, :K].view(float8_e4m3fn)` and `packed[:, K:]` of a row-packed byte buffer;
    they are returned as `codes` / `scales`. Only addresses change: same bits.
    """
    return _launch_norm(x, residual, weight, eps, True, swizzled, emit_y, round_sum, weight_offset,
                        out_codes, out_scales, rule)  # fmt: skip


def quantize(
    x: torch.Tensor,
    swizzled: bool = False,
    *,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    rule: int = 0,
):
    """MXFP8 codes `[M, K]` e4m3 and scales (uint8 `[M, K/32]`, or F8_128x4 `[pad128(M), pad4(K/32)]`).

    `out_codes` / `out_scales`: caller-provided output views, as in :func:`fused_norm_quant`.
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
    bm, bc, nw = CONFIG_OVERRIDE.get("quant") or quant_config(k, m)
    grid = (triton.cdiv(m_grid, bm), triton.cdiv(k, bc))
    _quant_kernel[grid](
        x, codes, scales, m, m_grid, k, x.stride(0), _row_stride(codes, k), _row_stride(scales, s),
        s, sp, int(bool(swizzled)),
        BM=bm, BC=bc, RULE=int(rule), num_warps=nw, enable_fp_fusion=False,
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
