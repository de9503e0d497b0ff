"""The MXFP8 GEMM variants that `mxfuse.ops.triton_gemm` was chosen against (benchmarks and GPU tests only).

Never the product's kernel; kept so the choice can be re-measured (`tools/bench_gemm.py`)
and their bits compared with the product's (`tests/test_gpu_gemm.py`). One kernel,
`_mx_gemm_kernel`, activation rows on the wgmma M side, the same fixed K chunks as the
product (`triton_gemm.chunk_k`), so every variant is batch invariant:

- ``"bf16"``: both tiles dequantized to bf16 on chip, bf16 wgmma (the default before the
  product's swapped-operand kernel; bitwise equal to it);
- ``"fp8"``: fp8 wgmma per 32-wide block, the two scales applied to the partial sums on
  the CUDA cores;
- ``"dot_scaled"``: Triton's `tl.dot_scaled` with byte scale tiles (issue #8's baseline;
  emulated by an upcast on sm_90);
- ``"dot_scaled_w"``: the same with scales loaded as int32 words.

Measurements: docs/gemm_notes.md. Import with `tools/` on `sys.path` (as bench_gemm does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mxfuse.ops.triton_gemm import (
    SPLIT_MAX_M,
    SplitKOutput,
    chunk_k,
    dequant_bf16,
    e8m0_to_f32,
    grouped_tile,
    pow2_divisor,
    prepare_operands,
)

VARIANTS = ("fp8", "bf16", "dot_scaled", "dot_scaled_w")
_VARIANT_CODE = {"fp8": 0, "bf16": 1, "dot_scaled": 2, "dot_scaled_w": 3}  # the kernel's VARIANT constexpr


class TiledConfig(NamedTuple):
    """Launch configuration of `_mx_gemm_kernel` (activation rows x weight rows per tile)."""

    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: bool = False


def default_config(m: int, n: int, k: int, variant: str) -> TiledConfig:
    """Each variant's own default tiles (measured on the H200: docs/gemm_notes.md, runs 2-3).

    Decode splits over the K chunks with BM 64 (one wgmma row tile, rows wrapped for M < 64):
    an mma.sync tile (BM 16) rounds differently. Prefill 128 x 128, not 128 x 256: the chunk
    accumulator and the running total are two fp32 register tiles."""
    bk = pow2_divisor(k, 128)
    if m <= SPLIT_MAX_M:
        return TiledConfig(64, 32, bk, group_m=1, num_stages=4, split_k=True)
    if m < 512 or variant == "fp8":
        return TiledConfig(64, 128, bk, num_stages=4)
    return TiledConfig(128, 128, bk, num_warps=8, num_stages=3)


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
                    sa = e8m0_to_f32((saw >> (8 * c)) & 0xFF)
                    sb = e8m0_to_f32((sbw >> (8 * c)) & 0xFF)
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
                a16 = dequant_bf16(a, sa, BM, BK)
                b16 = dequant_bf16(b, sb, BN, BK)
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
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)

    rm = (pid_m * BM + tl.arange(0, BM)) % M  # wrapped rows: loads need no mask
    rn = (pid_n * BN + tl.arange(0, BN)) % N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)

    # Scales are read as int32 words (4 E8M0 bytes = 128 K values): a 1-byte load is
    # too narrow for an async copy, so Triton would not pipeline it and every K step
    # would wait a full memory latency (docs/gemm_notes.md, run 1). Word strides are in int32.
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


# ------------------------------------------------------------------- launcher


def mxfp8_linear(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight_codes: torch.Tensor,
    weight_scales: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    variant: str,
    config: TiledConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`triton_gemm.mxfp8_linear` computed by one of the comparison VARIANTS."""
    if variant not in VARIANTS:
        raise ValueError(f"gemm_variants.mxfp8_linear: variant {variant!r} not in {VARIANTS}")
    m, k = codes.shape
    n = weight_codes.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    codes, scales, weight_codes, weight_scales = prepare_operands(codes, scales, weight_codes, weight_scales)
    k = codes.shape[1]
    cfg = config or default_config(m, n, k, variant)
    cfg = cfg._replace(block_k=max(128, pow2_divisor(k, cfg.block_k)))
    chunk = chunk_k(k)
    assert chunk % cfg.block_k == 0, (chunk, cfg.block_k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    dst = SplitKOutput(out, m, n, k, chunk, tiles, cfg.split_k)
    _mx_gemm_kernel[dst.grid](
        codes, scales, weight_codes, weight_scales, dst.dst, m, n, k,
        codes.stride(0), scales.stride(0) // 4, weight_codes.stride(0), weight_scales.stride(0) // 4,
        out.stride(0), dst.stride_cc,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, CHUNK=chunk, GROUP_M=cfg.group_m,
        VARIANT=_VARIANT_CODE[variant], SPLIT=dst.split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return dst.finish()
