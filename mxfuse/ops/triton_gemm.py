"""MXFP8 x MXFP8 GEMM for Hopper (sm_90), which has no MX (block-scaled) tensor cores.

`out[M, N] = dequant(codes, scales) @ dequant(weight_codes, weight_scales).T`, fp32
accumulation, rounded once to `out_dtype`. `dequant(q, s) = q * 2**(s - 127)` per
32-element block of a row (E8M0 scales, row-major `[rows, K/32]`). `e4m3 * 2**k` is exact
in bf16 (4 significant bits, fp32's exponent range; only blocks with scale byte < 10 can
land in bf16's subnormals and round), so both operands go to bf16 wgmma exactly.

Arithmetic (every variant, every regime): K is summed in FIXED chunks of `chunk_k(K)` = 768
columns (a function of K alone); every output is `((0 + c_0) + c_1) + ...`, c_i the fp32
wgmma k16 chain over chunk i in ascending K from zero. Tiles, splits and whether an
operand is dequantized on chip or up front change with M; the additions do not, so a row's
bits never depend on M (batch invariance; tests/test_gpu_gemm.py on the H200).

The default variant, ``"swap"`` (`_mx_gemm_swap_kernel`): weight rows on the wgmma M side
(the dequantized weight tile is the register A operand), activation rows on the N side, so a
decode tile is 64 weight rows x 16 activation rows. Regimes (`swap_config`, by M alone):

* decode, M <= 64 (weight-read bound): split over the K chunks, one program per (64 weight
  rows, chunk); the weight dequantized on chip (each element once), the few activation rows
  dequantized once up front; fp32 workspace `[n_chunks, M, N]`, then `_chunk_sum_kernel`
  adds the chunks in ascending order.
* M > 64 (tensor-core bound): both operands dequantized ONCE to bf16 by `_dequant_rows_kernel`
  (weight: an `[N, K]` bf16 scratch per call, 2 bytes a value), then a plain bf16 wgmma GEMM
  over the same chunks (one K loop that folds the chunk into the total at chunk ends);
  64 x 128 tiles below M = 2048 (more programs), 128 x 128 with 8 warps above. Dequantizing
  the weight inside every M tile cost 2-2.5x the whole GEMM.

Kept for comparison (benchmarks, tests), never chosen by default, in `_mx_gemm_kernel`:
``"bf16"`` (activation rows on the M side, both tiles dequantized on chip: the previous
default; bitwise equal to "swap"), ``"fp8"`` (fp8 wgmma per 32-wide block, scales applied to
the partial sums on the CUDA cores), ``"dot_scaled"`` (issue #8's baseline, Triton's
`tl.dot_scaled`, emulated on sm_90) and ``"dot_scaled_w"`` (the same with word-loaded scales).

Scales are read as int32 words (4 E8M0 bytes): Triton does not turn 1-byte loads into
async copies, so byte-wide scale loads stall every K step (this alone made the kernels
and `tl.dot_scaled` 2-10x slower). K is zero-padded to a multiple of 128 and scale rows
copied to 4-byte alignment when needed (never for the model's shapes).

Numbers (H200): docs/gemm_notes.md and the README.

Inputs: codes `[M, K]` float8_e4m3fn with a unit last stride (rows may be strided,
e.g. `buf[:, :K]` of a row-packed byte buffer), scales `[M, K/32]` uint8 (unit last
stride), weight `[N, K]` / `[N, K/32]` likewise. Importing this module does no CUDA
work.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MX_BLOCK = 32
VARIANTS = ("fp8", "bf16", "dot_scaled", "dot_scaled_w", "swap")
DEFAULT_VARIANT = os.environ.get("MXFUSE_GEMM_VARIANT", "swap")


# --------------------------------------------------------------------- helpers


@triton.jit
def _e8m0_to_f32(s):
    """uint8 E8M0 -> fp32 `2**(s-127)` from bits (s = 0: 2**-127, subnormal)."""
    e = s.to(tl.int32)
    bits = tl.where(e == 0, 0x00400000, e << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_bf16(q, s, ROWS: tl.constexpr, BK: tl.constexpr):
    """[ROWS, BK] e4m3 codes, [ROWS, BK/32] scale bytes -> [ROWS, BK] bf16 (exact)."""
    v = q.to(tl.bfloat16).reshape(ROWS, BK // 32, 32)
    f = _e8m0_to_f32(s).to(tl.bfloat16).reshape(ROWS, BK // 32, 1)  # exact (2**-127 too)
    return (v * f).reshape(ROWS, BK)


@triton.jit
def _grouped_tile(pid, num_outer, num_inner, GROUP: tl.constexpr):
    """(outer, inner) tile of program `pid`, GROUP outer tiles at a time: the GROUP outer
    tiles that run together share each inner tile in L2."""
    num_in_group = GROUP * num_inner
    first = (pid // num_in_group) * GROUP
    group_size = tl.minimum(num_outer - first, GROUP)
    return first + (pid % num_in_group) % group_size, (pid % num_in_group) // group_size


# ---------------------------------------------------------------------- kernel


@triton.jit
def _chunk_dot(
    a_ptr, b_ptr, as_w, bs_w, as_ptr, bs_ptr, rm64, rn64, k_lo, k_hi,
    stride_am, stride_asm, stride_bn, stride_bsn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, VARIANT: tl.constexpr,
):  # fmt: skip
    """fp32 `[BM, BN]` dot of the K range [k_lo, k_hi) (one K chunk), from a zero accumulator.

    The ONE place the products are summed: the decode (split) and the non-split regimes
    both call it on the same fixed chunks, so a chunk's partial sum has the same bits in
    every regime (same wgmma k16 chain in ascending K; BK only groups instructions)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if VARIANT == 0:
        rk = tl.arange(0, 32)
        a_ptrs = a_ptr + rm64[:, None] * stride_am + rk[None, :]  # [BM, 32]
        b_ptrs = b_ptr + rn64[None, :] * stride_bn + rk[:, None]  # [32, BN], K-major
        as_ptrs = as_w + rm64[:, None] * stride_asm + tl.arange(0, 1)[None, :]  # [BM, 1] words
        bs_ptrs = bs_w + rn64[:, None] * stride_bsn + tl.arange(0, 1)[None, :]
        for kb in range(k_lo // 32, k_hi // 32, BK // 32):
            for w in tl.static_range(BK // 128):
                saw = tl.reshape(tl.load(as_ptrs + (kb // 4 + w)), (BM,))
                sbw = tl.reshape(tl.load(bs_ptrs + (kb // 4 + w)), (BN,))
                for c in tl.static_range(4):
                    kc = kb + 4 * w + c
                    a = tl.load(a_ptrs + kc * 32)
                    b = tl.load(b_ptrs + kc * 32)
                    sa = _e8m0_to_f32((saw >> (8 * c)) & 0xFF)
                    sb = _e8m0_to_f32((sbw >> (8 * c)) & 0xFF)
                    p = tl.dot(a, b)
                    acc += (p * sa[:, None]) * sb[None, :]
    else:
        rk = tl.arange(0, BK)
        rw = tl.arange(0, BK // 128)
        sh = tl.arange(0, 4) * 8
        a_ptrs = a_ptr + rm64[:, None] * stride_am + rk[None, :]  # [BM, BK]
        b_ptrs = b_ptr + rn64[:, None] * stride_bn + rk[None, :]  # [BN, BK]
        as_ptrs = as_w + rm64[:, None] * stride_asm + rw[None, :]  # [BM, BK/128] words
        bs_ptrs = bs_w + rn64[:, None] * stride_bsn + rw[None, :]  # [BN, BK/128] words
        for k0 in range(k_lo, k_hi, BK):
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0)
            if VARIANT == 2:  # the baseline: byte scale tiles straight into tl.dot_scaled
                rs = k0 // 32 + tl.arange(0, BK // 32)
                sa = tl.load(as_ptr + rm64[:, None] * (stride_asm * 4) + rs[None, :])
                sb = tl.load(bs_ptr + rn64[:, None] * (stride_bsn * 4) + rs[None, :])
            else:
                saw = tl.load(as_ptrs + k0 // 128)
                sbw = tl.load(bs_ptrs + k0 // 128)
                sa = ((saw[:, :, None] >> sh[None, None, :]) & 0xFF).reshape(BM, BK // 32)
                sb = ((sbw[:, :, None] >> sh[None, None, :]) & 0xFF).reshape(BN, BK // 32)
            if VARIANT == 1:
                a16 = _dequant_bf16(a, sa, BM, BK)
                b16 = _dequant_bf16(b, sb, BN, BK)
                acc = tl.dot(a16, tl.trans(b16), acc)
            else:
                acc = tl.dot_scaled(a, sa.to(tl.uint8), "e4m3", tl.trans(b), sb.to(tl.uint8), "e4m3", acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _mx_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    stride_cc,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    CHUNK: tl.constexpr,  # K width of a chunk: depends on K only (chunk_k), a multiple of BK
    GROUP_M: tl.constexpr,
    VARIANT: tl.constexpr,  # 0 fp8 MMA per 32-chunk, 1 bf16 dequant, 2 tl.dot_scaled, 3 same, word scales
    SPLIT: tl.constexpr,  # True: program (tile, chunk) writes its fp32 chunk sum to the workspace c_ptr
):
    """Output tile = ((0 + c_0) + c_1) + ... over the K chunks, c_i = _chunk_dot of chunk i.

    SPLIT (decode): grid axis 1 is the chunk; the fp32 `0 + c_i` goes to workspace
    `[n_chunks, M, N]` (chunk stride stride_cc) and _chunk_sum_kernel adds the chunks in
    ascending order from 0 and rounds: the same additions as the non-split loop below.
    """
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)

    rm = (pid_m * BM + tl.arange(0, BM)) % M  # wrapped rows: loads need no mask
    rn = (pid_n * BN + tl.arange(0, BN)) % N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)

    # Scales are read as int32 words (4 E8M0 bytes = 128 K values): a 1-byte load is
    # too narrow for an async copy, so Triton would not pipeline it and every K step
    # would wait a full memory latency (measured: 10x slower). Word strides are in int32.
    as_w = as_ptr.to(tl.pointer_type(tl.int32))
    bs_w = bs_ptr.to(tl.pointer_type(tl.int32))
    total = tl.zeros((BM, BN), dtype=tl.float32)
    if SPLIT:
        k_lo = tl.program_id(1) * CHUNK
        c = _chunk_dot(a_ptr, b_ptr, as_w, bs_w, as_ptr, bs_ptr, rm64, rn64, k_lo, tl.minimum(k_lo + CHUNK, K),
                       stride_am, stride_asm, stride_bn, stride_bsn, BM, BN, BK, VARIANT)  # fmt: skip
        total = total + c
    else:
        for k_lo in range(0, K, CHUNK):
            c = _chunk_dot(a_ptr, b_ptr, as_w, bs_w, as_ptr, bs_ptr, rm64, rn64, k_lo, tl.minimum(k_lo + CHUNK, K),
                           stride_am, stride_asm, stride_bn, stride_bsn, BM, BN, BK, VARIANT)  # fmt: skip
            total = total + c

    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    mask = (om[:, None] < M) & (on[None, :] < N)
    if SPLIT:
        w_ptrs = c_ptr + tl.program_id(1).to(tl.int64) * stride_cc + om.to(tl.int64)[:, None] * N + on[None, :]
        tl.store(w_ptrs, total, mask=mask)
    else:
        c_ptrs = c_ptr + om.to(tl.int64)[:, None] * stride_cm + on[None, :]
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "stride_cc"])
def _chunk_sum_kernel(ws_ptr, c_ptr, M, N, stride_cm, stride_cc, N_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """out = ((0 + w_0) + w_1) + ... (ascending chunks), rounded once: the split path's second phase."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    t = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(N_CHUNKS):
        t = t + tl.load(ws_ptr + i * stride_cc + offs, mask=mask, other=0.0)
    om = offs // N
    on = offs % N
    tl.store(c_ptr + om * stride_cm + on, t.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bf16_tile(q_ptrs, s_ptrs, k0, ROWS: tl.constexpr, BK: tl.constexpr, IS_BF16: tl.constexpr):
    """[ROWS, BK] bf16 operand tile at K offset k0: loaded as is (a pre-dequantized bf16
    buffer) or dequantized on chip from e4m3 codes + int32 words of 4 E8M0 scales.
    (Dequantizing per 32-wide block straight in the wgmma operand layout instead avoids a
    shared-memory round trip but was 10-20% slower at decode: one wgmma wait per block.)"""
    q = tl.load(q_ptrs + k0)
    if IS_BF16:
        return q
    sw = tl.load(s_ptrs + k0 // 128)
    sh = tl.arange(0, 4) * 8
    s = ((sw[:, :, None] >> sh[None, None, :]) & 0xFF).reshape(ROWS, BK // 32)
    return _dequant_bf16(q, s, ROWS, BK)


@triton.jit
def _swap_step(acc, w_ptrs, ws_ptrs, x_ptrs, xs_ptrs, k0, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
               W_BF16: tl.constexpr, X_BF16: tl.constexpr):  # fmt: skip
    """acc + W[:, k0:k0+BK] @ X[:, k0:k0+BK]^T (one wgmma k16 chain, ascending K)."""
    w16 = _bf16_tile(w_ptrs, ws_ptrs, k0, BN, BK, W_BF16)
    x16 = _bf16_tile(x_ptrs, xs_ptrs, k0, BM, BK, X_BF16)
    return tl.dot(w16, tl.trans(x16), acc)


@triton.jit(do_not_specialize=["M"])
def _mx_gemm_swap_kernel(
    w_ptr, ws_ptr, x_ptr, xs_ptr, c_ptr,
    M, N, K,
    stride_wn, stride_wsn, stride_xm, stride_xsm, stride_cm, stride_cc,
    BN: tl.constexpr,  # weight rows per tile: the wgmma M side (64 per warpgroup)
    BM: tl.constexpr,  # activation rows per tile: the wgmma N side (16 is enough at decode)
    BK: tl.constexpr,
    CHUNK: tl.constexpr,
    GROUP_N: tl.constexpr,
    W_BF16: tl.constexpr,  # weight operand is a pre-dequantized bf16 [N, K] buffer
    X_BF16: tl.constexpr,  # activation operand is a pre-dequantized bf16 [M, K] buffer
    SPLIT: tl.constexpr,
    FLAT: tl.constexpr,  # one K loop that folds the chunk into the total at chunk ends
):  # fmt: skip
    """Swapped operands: out^T tile [BN, BM] = W tile [BN, BK] @ X tile^T, chunked like
    `_mx_gemm_kernel`: output = ((0 + c_0) + c_1) + ..., c_i a wgmma k16 chain from zero.

    The weight is the wgmma A operand (dequantized in registers, no shared-memory round
    trip); the activation rows are the N side, so a decode tile is 64 weight rows x 16
    activation rows instead of 64 wrapped activation rows (4x less wasted dequant and MMA)."""
    pid_n, pid_m = _grouped_tile(tl.program_id(0), tl.cdiv(N, BN), tl.cdiv(M, BM), GROUP_N)

    rn64 = ((pid_n * BN + tl.arange(0, BN)) % N).to(tl.int64)  # wrapped rows: loads need no mask
    rm64 = ((pid_m * BM + tl.arange(0, BM)) % M).to(tl.int64)
    rk = tl.arange(0, BK)
    rw = tl.arange(0, BK // 128)
    w_ptrs = w_ptr + rn64[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm64[:, None] * stride_xm + rk[None, :]
    ws_ptrs = ws_ptr.to(tl.pointer_type(tl.int32)) + rn64[:, None] * stride_wsn + rw[None, :]
    xs_ptrs = xs_ptr.to(tl.pointer_type(tl.int32)) + rm64[:, None] * stride_xsm + rw[None, :]

    total = tl.zeros((BN, BM), dtype=tl.float32)
    if SPLIT:
        k_lo = tl.program_id(1) * CHUNK
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BK):
            acc = _swap_step(acc, w_ptrs, ws_ptrs, x_ptrs, xs_ptrs, k0, BN, BM, BK, W_BF16, X_BF16)
        total = total + acc
    elif FLAT:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            acc = _swap_step(acc, w_ptrs, ws_ptrs, x_ptrs, xs_ptrs, k0, BN, BM, BK, W_BF16, X_BF16)
            if ((k0 + BK) % CHUNK == 0) | (k0 + BK >= K):
                total = total + acc
                acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        for k_lo in range(0, K, CHUNK):
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BK):
                acc = _swap_step(acc, w_ptrs, ws_ptrs, x_ptrs, xs_ptrs, k0, BN, BM, BK, W_BF16, X_BF16)
            total = total + acc

    out = tl.trans(total)  # [BM, BN]: stores contiguous along N
    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    mask = (om[:, None] < M) & (on[None, :] < N)
    if SPLIT:
        w_out = c_ptr + tl.program_id(1).to(tl.int64) * stride_cc + om.to(tl.int64)[:, None] * N + on[None, :]
        tl.store(w_out, out, mask=mask)
    else:
        tl.store(c_ptr + om.to(tl.int64)[:, None] * stride_cm + on[None, :], out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _dequant_rows_kernel(q_ptr, s_ptr, o_ptr, M, K, stride_qm, stride_sm, stride_om, BK: tl.constexpr):
    """bf16 [M, K] = exact dequant of e4m3 codes + E8M0 scales (an operand dequantized once
    up front instead of once per tile that reads it)."""
    row = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    q = tl.load(q_ptr + row * stride_qm + k0 + tl.arange(0, BK)[None, :])
    s = tl.load(s_ptr + row * stride_sm + k0 // 32 + tl.arange(0, BK // 32)[None, :])
    tl.store(o_ptr + row * stride_om + k0 + tl.arange(0, BK)[None, :], _dequant_bf16(q, s, 1, BK))


# ---------------------------------------------------------------- heuristics


def _pow2_divisor(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing k (k is a multiple of 32)."""
    bk = cap
    while k % bk:
        bk //= 2
    return bk


CHUNK_K = 768  # K width of a chunk (a multiple of every BK: 128, 256)
SPLIT_MAX_M = 64  # decode: one program per (N tile, K chunk) + the chunk-sum kernel


def chunk_k(k: int) -> int:
    """K width of the fixed summation chunks: a function of K ALONE (never of M, the tile
    or the regime), so every output is the same `((0 + c_0) + c_1) + ...` in every regime.
    A multiple of 256 (and so of every BK); the last chunk may be shorter (K % 128 == 0)."""
    return CHUNK_K


def swap_config(m: int, n: int, k: int) -> dict:
    """Tiles of the "swap" variant (the default). BN = weight rows (wgmma M side), BM =
    activation rows (wgmma N side, a power of two >= 16). Measured on the H200 (qkv shard,
    docs/gemm_notes.md run 4): dequantizing the weight once per call and running a plain bf16
    GEMM beats dequantizing it in every M tile as soon as there is more than one M tile."""
    if m <= SPLIT_MAX_M:
        bm = min(64, max(16, triton.next_power_of_2(max(m, 1))))
        return dict(BN=64, BM=bm, BK=128, GROUP_N=1, num_warps=4, num_stages=3, SPLIT=True, X_BF16=True)
    both = dict(FLAT=True, X_BF16=True, W_BF16=True)
    if m < 2048:
        return dict(BN=64, BM=128, BK=128, GROUP_N=8, num_warps=4, num_stages=4, **both)
    return dict(BN=128, BM=128, BK=128, GROUP_N=8, num_warps=8, num_stages=3, **both)


def default_config(m: int, n: int, k: int, variant: str = DEFAULT_VARIANT) -> dict:
    """Tile shape for an `[m, k] x [n, k]^T` problem. Depends on M only through tile
    shapes and the split (never the chunks or the K order), so results stay batch invariant."""
    if variant == "swap":
        return swap_config(m, n, k)
    if m <= SPLIT_MAX_M:
        # split over the K chunks: N/BN * K/CHUNK programs. BM stays 64 (one wgmma row
        # tile, rows wrapped for M < 64): an mma.sync tile (BM 16) rounds differently.
        # 64 x 32 x 128, 4 stages: 133 registers, no spill, ~63 KB smem (ptxas, sm_90).
        # Fastest of the split tiles measured on the H200 (docs/gemm_notes.md, run 3) and
        # checked bitwise equal to the 64x32x256 split / unsplit and 128x128 tiles there.
        return dict(BM=64, BN=32, BK=_pow2_divisor(k, 128), GROUP_M=1, num_warps=4, num_stages=4, SPLIT=True)
    if m < 512:
        return dict(BM=64, BN=128, BK=_pow2_divisor(k, 128), GROUP_M=8, num_warps=4, num_stages=4)
    if variant == "fp8":
        return dict(BM=64, BN=128, BK=_pow2_divisor(k, 128), GROUP_M=8, num_warps=4, num_stages=4)
    # 128 x 128, not 128 x 256: the chunk accumulator and the running total are two fp32
    # register tiles (128 x 256 with 8 warps would need 256 of them per thread).
    return dict(BM=128, BN=128, BK=_pow2_divisor(k, 128), GROUP_M=8, num_warps=8, num_stages=3)


# ------------------------------------------------------------------- launcher


def _word_aligned(scales: torch.Tensor) -> torch.Tensor:
    """Scales whose rows start on 4-byte boundaries (the kernel reads int32 words)."""
    if scales.stride(1) == 1 and scales.stride(0) % 4 == 0 and scales.data_ptr() % 4 == 0:
        return scales
    return scales.contiguous()


class _SplitK:
    """Where a GEMM launch writes: `out` in one pass, or (decode split) an fp32 workspace
    `[n_chunks, M, N]` that `finish` adds up in ascending chunk order into `out`."""

    def __init__(self, out: torch.Tensor, m: int, n: int, k: int, chunk: int, cfg: dict):
        self.out, self.m, self.n = out, m, n
        self.n_chunks = triton.cdiv(k, chunk)
        self.split = bool(cfg.get("SPLIT", False)) and self.n_chunks > 1
        tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
        if self.split:
            self.dst = torch.empty((self.n_chunks, m, n), dtype=torch.float32, device=out.device)
            self.grid, self.stride_cc = (tiles, self.n_chunks), m * n
        else:
            self.dst, self.grid, self.stride_cc = out, (tiles,), 0

    def finish(self) -> torch.Tensor:
        if self.split:
            block = 1024
            _chunk_sum_kernel[(triton.cdiv(self.m * self.n, block),)](
                self.dst, self.out, self.m, self.n, self.out.stride(0), self.stride_cc,
                N_CHUNKS=self.n_chunks, BLOCK=block, num_warps=4,
            )  # fmt: skip
        return self.out


def mxfp8_linear(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight_codes: torch.Tensor,
    weight_scales: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    variant: str | None = None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[M, K]` fp8 codes + `[M, K/32]` scales times `[N, K]` fp8 weight + `[N, K/32]` scales."""
    variant = variant or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"mxfp8_linear: variant {variant!r} not in {VARIANTS}")
    m, k = codes.shape
    n = weight_codes.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    # unit last strides (rows may be strided views of a packed buffer)
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    if weight_codes.stride(1) != 1:
        weight_codes = weight_codes.contiguous()
    if k % 128:  # the kernel reads scales as 4-byte words: zero-pad K to a multiple of 128
        kp = (k + 127) // 128 * 128
        codes = torch.nn.functional.pad(codes.view(torch.uint8), (0, kp - k)).view(codes.dtype)
        weight_codes = torch.nn.functional.pad(weight_codes.view(torch.uint8), (0, kp - k)).view(weight_codes.dtype)
        scales = torch.nn.functional.pad(scales, (0, (kp - k) // 32))
        weight_scales = torch.nn.functional.pad(weight_scales, (0, (kp - k) // 32))
        k = kp
    scales = _word_aligned(scales)
    weight_scales = _word_aligned(weight_scales)
    cfg = dict(config) if config else default_config(m, n, k, variant)
    cfg["BK"] = max(128, _pow2_divisor(k, cfg["BK"]))
    if variant == "swap":
        return _launch_swap(codes, scales, weight_codes, weight_scales, out, cfg)
    chunk = chunk_k(k)
    assert chunk % cfg["BK"] == 0, (chunk, cfg["BK"])
    dst = _SplitK(out, m, n, k, chunk, cfg)
    _mx_gemm_kernel[dst.grid](
        codes, scales, weight_codes, weight_scales, dst.dst, m, n, k,
        codes.stride(0), scales.stride(0) // 4, weight_codes.stride(0), weight_scales.stride(0) // 4,
        out.stride(0), dst.stride_cc,
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], CHUNK=chunk, GROUP_M=cfg.get("GROUP_M", 8),
        VARIANT=VARIANTS.index(variant), SPLIT=dst.split,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    return dst.finish()


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact bf16 `[M, K]` of MXFP8 rows (K % 128 == 0, word-aligned scale rows)."""
    m, k = codes.shape
    out = torch.empty((m, k), dtype=torch.bfloat16, device=codes.device)
    if m:
        bk = _pow2_divisor(k, 1024)
        _dequant_rows_kernel[(m, k // bk)](
            codes, scales, out, m, k, codes.stride(0), scales.stride(0), out.stride(0), BK=bk, num_warps=4
        )
    return out


def _launch_swap(codes, scales, weight_codes, weight_scales, out, cfg):
    """The "swap" variant (see `_mx_gemm_swap_kernel`); cfg keys beyond the tiles:
    SPLIT (decode), FLAT, X_BF16 / W_BF16 (dequantize that operand once, up front), CHUNK
    (benchmarks only: another chunk width changes the bits)."""
    m, k = codes.shape
    n = weight_codes.shape[0]
    chunk = cfg.get("CHUNK", chunk_k(k))
    assert chunk % cfg["BK"] == 0, (chunk, cfg["BK"])
    x_bf16, w_bf16 = bool(cfg.get("X_BF16", False)), bool(cfg.get("W_BF16", False))
    x = dequantize_rows(codes, scales) if x_bf16 else codes
    w = dequantize_rows(weight_codes, weight_scales) if w_bf16 else weight_codes
    dst = _SplitK(out, m, n, k, chunk, cfg)
    _mx_gemm_swap_kernel[dst.grid](
        w, weight_scales, x, scales, dst.dst, m, n, k,
        w.stride(0), weight_scales.stride(0) // 4, x.stride(0), scales.stride(0) // 4, out.stride(0), dst.stride_cc,
        BN=cfg["BN"], BM=cfg["BM"], BK=cfg["BK"], CHUNK=chunk, GROUP_N=cfg.get("GROUP_N", 8),
        W_BF16=w_bf16, X_BF16=x_bf16, SPLIT=dst.split, FLAT=bool(cfg.get("FLAT", False)),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    return dst.finish()
