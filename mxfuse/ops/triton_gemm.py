"""MXFP8 x MXFP8 GEMM for Hopper (sm_90), which has no MX (block-scaled) tensor cores.

`out[M, N] = dequant(codes, scales) @ dequant(weight_codes, weight_scales).T`, fp32
accumulation, rounded once to `out_dtype`. `dequant(q, s) = q * 2**(s - 127)` per
32-element block of a row (E8M0 scales, row-major `[rows, K/32]`).

Two ways to feed Hopper's tensor cores (both "variants" share one kernel):

* ``"bf16"`` (the default): the operand tiles are dequantized on chip, exactly, to
  bf16 (`e4m3 * 2**k` is exact in bf16: 4 significant bits, fp32's exponent range;
  only blocks with scale byte < 10, magnitudes < 2**-108, can land in bf16's
  subnormals and round), then one chained bf16 wgmma (`tl.dot`) per K tile.
* ``"fp8"``: e4m3 codes go to the tensor core as they are. One fp8 MMA per 32-wide K
  chunk (the MX block) gives the raw partial sum `p[m, n]`; the scales are applied on
  the CUDA cores, `acc += (p * 2**(sa[m]-127)) * 2**(sb[n]-127)` (a multiply and an FMA
  per accumulator element per 32 K). Faster than "bf16" for 16 <= M (measured on the
  H200), slower at M = 1: its per-chunk scale loads are not software-pipelined by
  Triton (they feed no dot), so each K step waits on them.

Scales are read as int32 words (4 E8M0 bytes): Triton does not turn 1-byte loads into
async copies, so byte-wide scale loads stall every K step (this alone made the
kernels and `tl.dot_scaled` 2-10x slower). K is zero-padded to a multiple of 128 and
scale rows copied to 4-byte alignment when needed (never for the model's shapes).

Regimes, chosen by M alone (tile shapes only: neither the variant nor the K order
changes with M):

* decode, M <= 64: weight-read bound (1 byte + 1/32 byte per weight value). BLOCK_M
  64 (rows wrapped), BLOCK_N 16/32 so that `N / BLOCK_N` programs cover the SMs, K
  tile 256, 4 stages. No split-K. (BLOCK_M 16, an mma.sync tile, is ~1.6-2x faster
  here but rounds differently from the wgmma tiles: not batch invariant, not used.)
* middle, 64 < M < 512: 64 x 128 tiles.
* prefill, M >= 512: 128 x 256 (bf16) / 64 x 128 (fp8) tiles, grouped program order.

Status (H200, 2 runs, docs/gemm_notes.md): 3-5x slower than bf16 cuBLAS everywhere;
1.3-2.3x faster than the `tl.dot_scaled` baseline. The issue #8 targets are NOT met.

Batch invariance: the K loop of every output element runs in the same order
(ascending K, one fp32 accumulator, no split-K) whatever M and the tile shape are,
and every default tile uses wgmma (BLOCK_M >= 64), so a row's bits do not depend on
M (checked on the H200, both variants, M 1..1000 vs 2048:
tests/test_gpu_gemm.py::test_batch_invariance).

``"dot_scaled"`` is the baseline of issue #8: Triton's `tl.dot_scaled` with byte
scale tiles (emulated on sm_90 by a bf16 upcast in the kernel); ``"dot_scaled_w"`` the
same fed from word-loaded scales. Kept for comparison, never chosen by default.

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
VARIANTS = ("fp8", "bf16", "dot_scaled", "dot_scaled_w")
DEFAULT_VARIANT = os.environ.get("MXFUSE_GEMM_VARIANT", "bf16")


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


# ---------------------------------------------------------------------- kernel


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
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    VARIANT: tl.constexpr,  # 0 fp8 MMA per 32-chunk, 1 bf16 dequant, 2 tl.dot_scaled, 3 same, word scales
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # grouped ordering: GROUP_M row-tiles share each weight column-tile in L2
    num_in_group = GROUP_M * num_pid_n
    group = pid // num_in_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size
    pid_n = (pid % num_in_group) // group_size

    rm = (pid_m * BM + tl.arange(0, BM)) % M  # wrapped rows: loads need no mask
    rn = (pid_n * BN + tl.arange(0, BN)) % N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)

    # Scales are read as int32 words (4 E8M0 bytes = 128 K values): a 1-byte load is
    # too narrow for an async copy, so Triton would not pipeline it and every K step
    # would wait a full memory latency (measured: 10x slower). Word strides are in int32.
    as_w = as_ptr.to(tl.pointer_type(tl.int32))
    bs_w = bs_ptr.to(tl.pointer_type(tl.int32))
    if VARIANT == 0:
        rk = tl.arange(0, 32)
        a_ptrs = a_ptr + rm64[:, None] * stride_am + rk[None, :]  # [BM, 32]
        b_ptrs = b_ptr + rn64[None, :] * stride_bn + rk[:, None]  # [32, BN], K-major
        as_ptrs = as_w + rm64[:, None] * stride_asm + tl.arange(0, 1)[None, :]  # [BM, 1] words
        bs_ptrs = bs_w + rn64[:, None] * stride_bsn + tl.arange(0, 1)[None, :]
        for kb in range(0, K // 32, BK // 32):
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
        for k0 in range(0, K, BK):
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

    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    c_ptrs = c_ptr + om.to(tl.int64)[:, None] * stride_cm + on[None, :]
    mask = (om[:, None] < M) & (on[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- heuristics


def _pow2_divisor(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing k (k is a multiple of 32)."""
    bk = cap
    while k % bk:
        bk //= 2
    return bk


def default_config(m: int, n: int, k: int, variant: str = DEFAULT_VARIANT) -> dict:
    """Tile shape for an `[m, k] x [n, k]^T` problem. Depends on M only through tile
    shapes (never the K order), so results stay batch invariant."""
    if m <= 64:
        # BM stays 64 (one wgmma row tile, rows wrapped for M < 64): an mma.sync tile
        # (BM 16) is faster but rounds differently (measured: not batch invariant).
        bn = 32 if n >= 4096 else 16
        if variant.startswith("dot_scaled"):
            bn = max(bn, 32)
        return dict(BM=64, BN=bn, BK=_pow2_divisor(k, 256), GROUP_M=1, num_warps=4, num_stages=4)
    if m < 512:
        return dict(BM=64, BN=128, BK=_pow2_divisor(k, 128), GROUP_M=8, num_warps=4, num_stages=4)
    if variant == "bf16":
        return dict(BM=128, BN=256, BK=_pow2_divisor(k, 128), GROUP_M=8, num_warps=8, num_stages=3)
    if variant.startswith("dot_scaled"):
        return dict(BM=128, BN=128, BK=_pow2_divisor(k, 128), GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BM=64, BN=128, BK=_pow2_divisor(k, 128), GROUP_M=8, num_warps=4, num_stages=4)


# ------------------------------------------------------------------- launcher


def _word_aligned(scales: torch.Tensor) -> torch.Tensor:
    """Scales whose rows start on 4-byte boundaries (the kernel reads int32 words)."""
    if scales.stride(1) == 1 and scales.stride(0) % 4 == 0 and scales.data_ptr() % 4 == 0:
        return scales
    return scales.contiguous()


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
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _mx_gemm_kernel[grid](
        codes,
        scales,
        weight_codes,
        weight_scales,
        out,
        m,
        n,
        k,
        codes.stride(0),
        scales.stride(0) // 4,
        weight_codes.stride(0),
        weight_scales.stride(0) // 4,
        out.stride(0),
        BM=cfg["BM"],
        BN=cfg["BN"],
        BK=cfg["BK"],
        GROUP_M=cfg.get("GROUP_M", 8),
        VARIANT=VARIANTS.index(variant),
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3),
    )
    return out
