"""MXFP8 x MXFP8 GEMM for Hopper (sm_90), which has no MX (block-scaled) tensor cores.

`out[M, N] = dequant(codes, scales) @ dequant(weight_codes, weight_scales).T`, fp32
accumulation, rounded once to `out_dtype`. `dequant(q, s) = q * 2**(s - 127)` per
32-element block of a row (E8M0 scales, row-major `[rows, K/32]`). `e4m3 * 2**k` is exact
in bf16 (4 significant bits, fp32's exponent range; only blocks with scale byte < 10 can
land in bf16's subnormals and round), so both operands go to bf16 wgmma exactly.

Arithmetic (every regime): K is summed in FIXED chunks of `chunk_k(K)` = 768 columns (a
function of K alone); every output is `((0 + c_0) + c_1) + ...`, c_i the fp32 wgmma k16
chain over chunk i in ascending K from zero. Tiles, splits and whether an operand is
dequantized on chip or up front change with M; the additions do not, so a row's bits never
depend on M (batch invariance; tests/test_gpu_gemm.py on the GPU).

The kernel (`_mx_gemm_swap_kernel`) puts weight rows on the wgmma M side (the dequantized
weight tile is the register A operand) and activation rows on the N side, so a decode tile
is 64 weight rows x 16 activation rows. Regimes (`gemm_config`, by M alone):

* decode, M <= 64 (weight-read bound): split over the K chunks, one program per (64 weight
  rows, chunk); the weight dequantized on chip (each element once), the few activation rows
  dequantized once up front; fp32 workspace `[n_chunks, M, N]`, then `_chunk_sum_kernel`
  adds the chunks in ascending order.
* M > 64 (tensor-core bound): both operands dequantized ONCE to bf16 by `_dequant_rows_kernel`
  (weight: an `[N, K]` bf16 scratch per call, 2 bytes a value), then a plain bf16 wgmma GEMM
  over the same chunks (one K loop that folds the chunk into the total at chunk ends).

Scales are read as int32 words (4 E8M0 bytes): Triton does not turn 1-byte loads into
async copies, so byte-wide scale loads would stall every K step. K is zero-padded to a
multiple of 128 and scale rows copied to 4-byte alignment when needed (never for the
model's shapes). The variants this design was chosen against (and every measurement
behind the choices) live outside the package: tools/gemm_variants.py, docs/gemm_notes.md.

Programmatic dependent launch (`GemmConfig.pdl`, NVIDIA sm_90+): every kernel of the GEMM
is launched with Triton's `launch_pdl` and runs `griddepcontrol.wait` (`pdl_enter`) before
it reads an operand an earlier kernel wrote (the activation codes and scales, the
dequantized rows, the split workspace), then lets the next kernel launch: its launch and
prologue overlap the tail of the kernel before it (the norm that produced the codes, say).

Inputs: codes `[M, K]` float8_e4m3fn with a unit last stride (rows may be strided,
e.g. `buf[:, :K]` of a row-packed byte buffer), scales `[M, K/32]` uint8 (unit last
stride), weight `[N, K]` / `[N, K/32]` likewise. Importing this module does no CUDA
work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mxfuse.ops.mx_layout import BLOCK, scale_columns
from mxfuse.ops.triton_targets import Isa, KernelLaunch, device_isa, launch_hints, pdl_allowed, pdl_enter

SCALE_WORD_K = 4 * BLOCK
"""K values covered by one int32 word of 4 scale bytes: K is padded to a multiple of it."""

# ----------------------------------------------------------- shared jit helpers


@triton.jit
def e8m0_to_f32(s):
    """uint8 E8M0 -> fp32 `2**(s-127)` from bits (s = 0: 2**-127, subnormal)."""
    e = s.to(tl.int32)
    bits = tl.where(e == 0, 0x00400000, e << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dequant_bf16(q, s, ROWS: tl.constexpr, BK: tl.constexpr):
    """[ROWS, BK] e4m3 codes, [ROWS, BK/32] scale bytes -> [ROWS, BK] bf16 (exact)."""
    v = q.to(tl.bfloat16).reshape(ROWS, BK // 32, 32)
    f = e8m0_to_f32(s).to(tl.bfloat16).reshape(ROWS, BK // 32, 1)  # exact (2**-127 too)
    return (v * f).reshape(ROWS, BK)


@triton.jit
def grouped_tile(pid, num_outer, num_inner, GROUP: tl.constexpr):
    """(outer, inner) tile of program `pid`, GROUP outer tiles at a time: the GROUP outer
    tiles that run together share each inner tile in L2."""
    num_in_group = GROUP * num_inner
    first = (pid // num_in_group) * GROUP
    group_size = tl.minimum(num_outer - first, GROUP)
    return first + (pid % num_in_group) % group_size, (pid % num_in_group) // group_size


# ---------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M", "stride_cc"])
def _chunk_sum_kernel(
    ws_ptr, c_ptr, M, N, stride_cm, stride_cc, N_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    """out = ((0 + w_0) + w_1) + ... (ascending chunks), rounded once: the split path's second phase."""
    pdl_enter(PDL)
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
    buffer) or dequantized on chip from e4m3 codes + int32 words of 4 E8M0 scales (the
    whole tile at once, not per 32-wide block: docs/gemm_notes.md)."""
    q = tl.load(q_ptrs + k0)
    if IS_BF16:
        return q
    sw = tl.load(s_ptrs + k0 // 128)
    sh = tl.arange(0, 4) * 8
    s = ((sw[:, :, None] >> sh[None, None, :]) & 0xFF).reshape(ROWS, BK // 32)
    return dequant_bf16(q, s, ROWS, BK)


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
    PDL: tl.constexpr = False,  # programmatic dependent launch: wait for the producer of X before the K loop
):  # fmt: skip
    """Swapped operands: out^T tile [BN, BM] = W tile [BN, BK] @ X tile^T, summed over the
    fixed K chunks: output = ((0 + c_0) + c_1) + ..., c_i a wgmma k16 chain from zero.

    The weight is the wgmma A operand (dequantized in registers, no shared-memory round
    trip); the activation rows are the N side, so a decode tile is 64 weight rows x 16
    activation rows instead of 64 wrapped activation rows."""
    pid_n, pid_m = grouped_tile(tl.program_id(0), tl.cdiv(N, BN), tl.cdiv(M, BM), GROUP_N)

    rn64 = ((pid_n * BN + tl.arange(0, BN)) % N).to(tl.int64)  # wrapped rows: loads need no mask
    rm64 = ((pid_m * BM + tl.arange(0, BM)) % M).to(tl.int64)
    rk = tl.arange(0, BK)
    rw = tl.arange(0, BK // 128)
    w_ptrs = w_ptr + rn64[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm64[:, None] * stride_xm + rk[None, :]
    ws_ptrs = ws_ptr.to(tl.pointer_type(tl.int32)) + rn64[:, None] * stride_wsn + rw[None, :]
    xs_ptrs = xs_ptr.to(tl.pointer_type(tl.int32)) + rm64[:, None] * stride_xsm + rw[None, :]
    pdl_enter(PDL)  # the first read of X (and of the workspace the chunk sum reads after this)

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
def _dequant_rows_kernel(
    q_ptr, s_ptr, o_ptr, M, K, stride_qm, stride_sm, stride_om, BK: tl.constexpr, PDL: tl.constexpr = False
):
    """bf16 [M, K] = exact dequant of e4m3 codes + E8M0 scales (an operand dequantized once
    up front instead of once per tile that reads it)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    q = tl.load(q_ptr + row * stride_qm + k0 + tl.arange(0, BK)[None, :])
    s = tl.load(s_ptr + row * stride_sm + k0 // 32 + tl.arange(0, BK // 32)[None, :])
    tl.store(o_ptr + row * stride_om + k0 + tl.arange(0, BK)[None, :], dequant_bf16(q, s, 1, BK))


# ---------------------------------------------------------------- configuration

CHUNK_K = 768
"""K width of a summation chunk (a multiple of every block_k: 128, 256)."""
SPLIT_MAX_M = 64
"""Up to this M (decode), one program per (weight tile, K chunk) plus the chunk-sum kernel."""


def chunk_k(k: int) -> int:
    """K width of the fixed summation chunks: a function of K ALONE (never of M, the tile
    or the regime), so every output is the same `((0 + c_0) + c_1) + ...` in every regime.
    A multiple of 256 (and so of every block_k); the last chunk may be shorter."""
    return CHUNK_K


class GemmConfig(NamedTuple):
    """Launch configuration of `_mx_gemm_swap_kernel`. Every config sums the same chunks in the
    same order (same bits) unless `chunk` is set."""

    weight_rows: int
    """Weight rows per tile (kernel BN): the wgmma M side, 64 per warpgroup."""
    activation_rows: int
    """Activation rows per tile (kernel BM): the wgmma N side, a power of two >= 16."""
    block_k: int = 128
    group: int = 8
    """Weight tiles that run together (kernel GROUP_N), sharing each activation tile in L2."""
    num_warps: int = 4
    num_stages: int = 3
    split_k: bool = False
    """One program per (tile, K chunk) into an fp32 workspace, then `_chunk_sum_kernel`."""
    flat_k_loop: bool = False
    """One K loop that folds the chunk into the total at chunk ends (else a loop per chunk)."""
    dequantize_activations_first: bool = False
    """Dequantize the activation rows once to a bf16 `[M, K]` buffer before the GEMM."""
    dequantize_weight_first: bool = False
    """Dequantize the weight once to a bf16 `[N, K]` scratch buffer before the GEMM."""
    chunk: int | None = None
    """Benchmarks only: another chunk width than `chunk_k(K)` (changes the bits)."""
    pdl: bool = False
    """Programmatic dependent launch of every kernel of the GEMM (NVIDIA only; same bits)."""


def pow2_divisor(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing k (k is a multiple of 32)."""
    bk = cap
    while k % bk:
        bk //= 2
    return bk


PORTABLE_STAGES = 2
"""Pipeline depth off NVIDIA: the H200's 3-4 stages of bf16 tiles need more shared memory than an
AMD CU's LDS holds (64 KB on gfx942, 160 KB on gfx950; tools/compile_targets.py reports it)."""


def gemm_config(m: int, n: int, k: int, isa: Isa = "ptx") -> GemmConfig:
    """The default tiles: decode split over the K chunks up to SPLIT_MAX_M rows, both operands
    dequantized once above it (the measurements behind the choice: docs/gemm_notes.md, run 4).
    The same chunks (same bits) on every ISA; "portable" pipelines PORTABLE_STAGES deep.
    Decode launches with programmatic dependent launch on NVIDIA: its three small kernels
    (activation dequant, split product, chunk sum) overlap each other's launch and tail (H200:
    up to 1.7 µs a GEMM at M 1-64; docs/perf_notes.md, run 10). Above SPLIT_MAX_M it does not:
    the early trigger lets the product kernel's programs (196 KB of shared memory each) take SMs
    while the weight dequant still has waves to run (+8..17% at M 256)."""
    if m <= SPLIT_MAX_M:
        rows = min(64, max(16, triton.next_power_of_2(max(m, 1))))
        cfg = GemmConfig(64, rows, group=1, split_k=True, dequantize_activations_first=True, pdl=pdl_allowed(isa))
    else:
        both = {"flat_k_loop": True, "dequantize_activations_first": True, "dequantize_weight_first": True}
        if m < 2048:
            cfg = GemmConfig(64, 128, group=8, num_stages=4, **both)
        else:
            cfg = GemmConfig(128, 128, group=8, num_warps=8, num_stages=3, **both)
    return cfg if isa == "ptx" else cfg._replace(num_stages=min(cfg.num_stages, PORTABLE_STAGES))


# ------------------------------------------------------------------- launcher


def word_aligned(scales: torch.Tensor) -> torch.Tensor:
    """Scales whose rows start on 4-byte boundaries (the kernels read int32 words)."""
    if scales.stride(1) == 1 and scales.stride(0) % 4 == 0 and scales.data_ptr() % 4 == 0:
        return scales
    return scales.contiguous()


def prepare_operands(codes, scales, weight_codes, weight_scales):
    """Operands as the kernels read them: unit last strides, K zero-padded to a multiple of
    128 (whole scale words), word-aligned scale rows. Copies only when it must."""
    k = codes.shape[1]
    if codes.stride(1) != 1:  # rows may be strided views of a packed buffer; columns may not
        codes = codes.contiguous()
    if weight_codes.stride(1) != 1:
        weight_codes = weight_codes.contiguous()
    if k % SCALE_WORD_K:
        pad = (k + SCALE_WORD_K - 1) // SCALE_WORD_K * SCALE_WORD_K - k
        codes = torch.nn.functional.pad(codes.view(torch.uint8), (0, pad)).view(codes.dtype)
        weight_codes = torch.nn.functional.pad(weight_codes.view(torch.uint8), (0, pad)).view(weight_codes.dtype)
        scales = torch.nn.functional.pad(scales, (0, scale_columns(pad)))
        weight_scales = torch.nn.functional.pad(weight_scales, (0, scale_columns(pad)))
    return codes, word_aligned(scales), weight_codes, word_aligned(weight_scales)


class SplitKOutput:
    """Where a GEMM launch writes: `out` in one pass, or (decode split) an fp32 workspace
    `[n_chunks, M, N]` that `finish` adds up in ascending chunk order into `out`."""

    def __init__(self, out: torch.Tensor, m: int, n: int, k: int, chunk: int, tiles: int, split: bool):
        self.out, self.m, self.n = out, m, n
        self.n_chunks = triton.cdiv(k, chunk)
        self.split = split and self.n_chunks > 1
        if self.split:
            self.dst = torch.empty((self.n_chunks, m, n), dtype=torch.float32, device=out.device)
            self.grid, self.stride_cc = (tiles, self.n_chunks), m * n
        else:
            self.dst, self.grid, self.stride_cc = out, (tiles,), 0

    def finish(self, run: Callable[[KernelLaunch], None] = KernelLaunch.run, pdl: bool = False) -> torch.Tensor:
        if self.split:
            block = 1024
            args = (self.dst, self.out, self.m, self.n, self.out.stride(0), self.stride_cc)
            grid = (triton.cdiv(self.m * self.n, block),)
            constexprs = dict(N_CHUNKS=self.n_chunks, BLOCK=block, PDL=pdl)
            run(KernelLaunch(_chunk_sum_kernel, grid, args, constexprs, 4, pdl=pdl))
        return self.out


def mxfp8_linear(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight_codes: torch.Tensor,
    weight_scales: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    config: GemmConfig | None = None,
    out: torch.Tensor | None = None,
    run: Callable[[KernelLaunch], None] = KernelLaunch.run,
    isa: Isa | None = None,
) -> torch.Tensor:
    """`[M, K]` fp8 codes + `[M, K/32]` scales times `[N, K]` fp8 weight + `[N, K/32]` scales.

    `config` (tests and benchmarks) replaces `gemm_config(M, N, K)`; `out` is written in place.
    `run` receives each kernel launch and `isa` replaces the device's (tools/compile_targets.py
    collects the launches on meta tensors for each target)."""
    isa = isa or device_isa(codes.device)  # an unsupported GPU is refused before anything compiles
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
    cfg = config or gemm_config(m, n, k, isa)
    cfg = cfg._replace(pdl=launch_hints(isa, cfg.pdl).pdl)
    cfg = cfg._replace(block_k=max(128, pow2_divisor(k, cfg.block_k)))
    chunk = cfg.chunk or chunk_k(k)
    assert chunk % cfg.block_k == 0, (chunk, cfg.block_k)
    x = dequantize_rows(codes, scales, run, cfg.pdl) if cfg.dequantize_activations_first else codes
    w = dequantize_rows(weight_codes, weight_scales, run, cfg.pdl) if cfg.dequantize_weight_first else weight_codes
    tiles = triton.cdiv(m, cfg.activation_rows) * triton.cdiv(n, cfg.weight_rows)
    dst = SplitKOutput(out, m, n, k, chunk, tiles, cfg.split_k)
    args = (
        w, weight_scales, x, scales, dst.dst, m, n, k,
        w.stride(0), weight_scales.stride(0) // 4, x.stride(0), scales.stride(0) // 4, out.stride(0), dst.stride_cc,
    )  # fmt: skip
    constexprs = dict(
        BN=cfg.weight_rows,
        BM=cfg.activation_rows,
        BK=cfg.block_k,
        CHUNK=chunk,
        GROUP_N=cfg.group,
        W_BF16=cfg.dequantize_weight_first,
        X_BF16=cfg.dequantize_activations_first,
        SPLIT=dst.split,
        FLAT=cfg.flat_k_loop,
        PDL=cfg.pdl,
    )
    run(KernelLaunch(_mx_gemm_swap_kernel, dst.grid, args, constexprs, cfg.num_warps, cfg.num_stages, pdl=cfg.pdl))
    return dst.finish(run, cfg.pdl)


def dequantize_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    run: Callable[[KernelLaunch], None] = KernelLaunch.run,
    pdl: bool = False,
) -> torch.Tensor:
    """Exact bf16 `[M, K]` of MXFP8 rows (K % 128 == 0, word-aligned scale rows)."""
    m, k = codes.shape
    out = torch.empty((m, k), dtype=torch.bfloat16, device=codes.device)
    if m:
        bk = pow2_divisor(k, 1024)
        args = (codes, scales, out, m, k, codes.stride(0), scales.stride(0), out.stride(0))
        run(KernelLaunch(_dequant_rows_kernel, (m, k // bk), args, dict(BK=bk, PDL=pdl), 4, pdl=pdl))
    return out
