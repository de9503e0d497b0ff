"""Triton kernel for the act·mul ops (CUDA impls of :mod:`mxfuse.ops.activations`).

One kernel, :func:`_act_mul_kernel`: an act·mul prologue (load a `[BM, BC]` tile of gate
and of up, compute `act(gate) * up`, round to the dtype) composed with the MXFP8 epilogue
of every producer kernel (:func:`mxfuse.ops.triton_mx_quant._mx_epilogue`: the same code as
the norms' and the standalone quant's, so the same bits). `QUANT` off is the unfused
`act_mul` (it stores y); on, the fused op (codes + scales, y with `MX.EMIT_Y`). Fused ==
unfused bitwise on a device by construction: one prologue, and the quant of the rounded y
is the standalone quant's (elementwise but for the block amax, whose `max` is order-free).

Arithmetic (fp32, no FMA contraction: launched with ``enable_fp_fusion=False``):

- Inductor's fp32 arithmetic (:mod:`mxfuse.ops.triton_fp32_math`): ``exp`` libdevice's
  (``__nv_expf``, written out in one instruction fewer; OCML's on AMD), ``tanh`` libdevice's (``__nv_tanhf``
  written out without its branch: the same bits);
  SiLU ``x / (1 + exp(-x))`` and the sigmoid ``1 / (1 + exp(-x))`` with Triton's ``/``
  (``div.full.f32`` on NVIDIA, its branch-free part), as Inductor compiles vLLM's native graph;
- GELU-tanh is torch's formula with torch's constants,
  ``0.5 * x * (1 + tanh(kBeta * (x + 0.044715 * (x * x * x))))``;
- ``ROUND_EACH_OP`` rounds every op's result to the dtype exactly where the reference does
  (:func:`mxfuse.ops.activations.act_mul_rows`); clamps are NaN-propagating (torch's clamp);
- bf16 on NVIDIA (``ActMulConfig.widen`` "shift", the default): the gate is widened to fp32 by
  moving its bits (two integer ops per pair of values), and the rounded product ``a * up`` of two
  bf16 values is one ``mul.rn.bf16x2`` (the fp32 product of two bf16 values is exact, so its
  rounding to bf16 is the correctly rounded bf16 product), widened the same way; the quant reads
  that fp32 y directly. The same values as ``.to(float32)`` and the fp32 multiply ("cvt"), in
  1.5 fewer instructions per value (the kernel is close to issue-bound: docs/perf_notes.md).

`round_each_op=False` is bit for bit Inductor's code for vLLM's native SiLU·mul; against torch's
eager CUDA functions the fp32 values differ by an ulp or two, which the rounding hides almost
always (bf16 SiLU / GELU-tanh: never, over every gate value); docs/design.md ("act·mul producers")
states the bound and tests/test_gpu_act_mul.py checks both.

Masked lanes (rows past M, columns past I) load zeros, and every activation maps a zero
gate and a zero up to y = +0 (SiLU 0 / 2, GELU 0.5 * 0 * 1, the clamped forms with their
finite limit), so their blocks quantize to zero codes and scale byte 0 without a select;
the clamped forms keep one (their `limit` is a runtime value).

**The dispatch** (:func:`act_mul_config`, a function of I, M, the SM count, the L2 size and the DRAM
bandwidth). The kernel moves 5.03 bytes a value and issues ~29-30 instructions a value on sm_90 (the SiLU 14 of them),
so at the copy's rate it keeps ~75% of the issue slots busy: it runs near the copy only if no lane is
masked off, every program has enough independent work and the reads stay in long runs. BC is the
largest power of two up to 1024 that divides I (I % 128 == 0: 1024 at 14336 and 17408, 512 at 3584
and 1536, 256 at 1792 and 4352, 128 at 2176), so no column block is partly empty (1024 columns at I
1792 left a quarter of every second block idle), and BM = tile / BC rows, so every program holds
the same number of values whatever the width: narrow shards get several rows per program instead
of one short one (run 10: the previous power-of-two-covering dispatch ran at 53-64% of the copy at I
1536-2176). The tile is `values_per_thread` on 4 warps: 4 a thread while the launch's M * I values
fit in the SMs' resident threads at 4 a thread (2048 a SM), 8 while they fit at 8 (with every thread
resident at once, more values a thread only lengthens each thread's dependent chain: run 12, 8-16 a
thread at M 16-1024 were 0.1-0.5 µs slower than 4-8), and beyond, by the card's peak DRAM bandwidth
per SM (memory clock x bus width), 16 on a memory of at least 30 GB/s an SM (the H200's 37; B200,
MI355X), whose faster stream needs more bytes in flight a thread (16 won by 1-6% at M >= 1024 there),
and 8 below (1024 values, ~5 KB moved, a program): on the H100 (25 GB/s an SM) 16 a thread was 1-12%
slower at every M >= 256 it was tried, the wide-I launches at M 16384 included (run 13: I 14336 405
against 400 µs; 17408 M 256 9.6 against 8.4). One exception at 8, just past the 8-a-thread limit (up
to a quarter of a wave more): 16 a thread there keeps the launch to
one wave of threads instead of a full one and a nearly empty second (I 2176 M 1024: 5.39 µs at 16,
5.65 at 8; at 1.7 waves 8 won). The grid walks the column blocks of a row tile first, so programs
running together read consecutive bytes of the same rows: 3-5% faster at M >= 4096 than row tiles
first (run 12; with the heavier `div_rn` arithmetic of run 11 it was not). Tiles of 16 values a
thread, several rows and at most 512 columns lay the codes out 16 a thread (`code_vector`: one 16-byte
store and one shuffle per block amax; 1-6% faster) while the launch's codes (M * I bytes) fit in half
the L2; beyond that the 16-byte code stores ran 10-27% slower than 8 a thread (I 1792-4352
at M 8192-16384 on the H200, run 12; on the H100 already at 25 MB, I 1536 M 16384: 51.1 against 42.8
µs, run 13). At
decode sizes (fewer than two programs per SM) BM, then BC, is halved down to 128 columns so that the
grid still covers the SMs. An I that is no multiple of 128 keeps the power of two covering it
(masked tail; the swizzled layout's padding scale columns then fall inside the last block). Every
tile computes the same bits (the arithmetic is elementwise and the block max order-free), so the
choice is free (batch invariance), and `config=` takes any `ActMulConfig` (the benchmark's variants,
the GPU tests).

On NVIDIA the default launch caps SiLU's tiles of 8 values a thread (and GELU-tanh's tiles of several rows up to
4M values) at 40 registers (:func:`load_first_registers`): ptxas then issues every load of a thread before its
arithmetic instead of holding 32 registers by loading up after the gate's `exp`s; 3-5% faster at M 512-4096 on
the TP shards (H100). GELU-tanh's one-row tiles from M 256 join the loads instead (:func:`join_loads_pays`).

Swizzled scales: after the tiles of the M real rows, one program per column block only stores
the zero scales of the padding rows up to pad128(M), a 32-bit word (4 scales) a store (no loads,
no memset).

Programmatic dependent launch (`ActMulConfig.pdl`, NVIDIA only, off by default, as the norms'): the
kernel runs `gdc_wait` before any load or store and `gdc_launch_dependents` right after, so in a decode
MLP of PDL launches (gate_up GEMM -> act·mul -> down GEMM) its launch overlaps the GEMM's tail and the
down GEMM's launch overlaps its own; the bits are the same (tests/test_gpu_act_mul.py).

Importing this module compiles nothing; kernels compile on the first launch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mxfuse.ops.reference import QuantRule
from mxfuse.ops.triton_fp32_math import bf16_bits_to_f32, math_of, sigmoid_f32, silu_f32, tanh_f32
from mxfuse.ops.triton_mx_quant import (
    CODE_VECTORS,
    COLUMN_TILE,
    SCALE_PAD_ROWS,
    MxSpec,
    _mx_epilogue,
    _zero_pad_program,
    mx_dst,
    pad_programs,
    producer_outputs,
    row_stride,
    rule_name,
    warp_amax,
)
from mxfuse.ops.triton_targets import (
    NOMINAL_DRAM_BYTES_PER_S,
    NOMINAL_L2_BYTES,
    Isa,
    KernelLaunch,
    device_isa,
    dram_bytes_per_s as device_dram_bytes_per_s,
    l2_bytes as device_l2_bytes,
    launch_hints,
    pdl_enter,
    sm_count as device_sm_count,
)

__all__ = [
    "ActMulConfig",
    "act_mul",
    "act_mul_config",
    "act_mul_launch",
    "default_launch_config",
    "issue_bound_tile",
    "join_loads_pays",
    "load_first_registers",
    "thread_values",
    "values_per_thread",
]

ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1, "swiglu_step": 2, "swiglu_oai": 3}
GELU_BETA = tl.constexpr(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5)
"""torch's `kBeta` (`M_SQRT2 * M_2_SQRTPI * 0.5`), the fp32 constant the decomposition multiplies by."""
GELU_KAPPA = tl.constexpr(0.044715)

MIN_BLOCK_COLS = 128
"""4 scale columns: the F8_128x4 layout's column padding is then inside the last block."""
MAX_BLOCK_COLS = 1024
MAX_WARPS = 4
SMALL_VALUES_PER_THREAD = (4, 8)
"""Values a thread while the launch fits in the resident threads: shorter chains, one load of each input in
flight."""
LARGE_VALUES_PER_THREAD = (8, 16)
"""Values a thread beyond, on a GPU whose DRAM bandwidth per SM is below / at least FAST_DRAM_BYTES_PER_S_PER_SM:
the faster memory needs more bytes in flight a thread (run 13: 16 a thread won by 1-6% at M >= 1024 on the
H200, 4.9 TB/s over 132 SMs, and lost by 1-12% on the H100, 3.35 TB/s)."""
FAST_DRAM_BYTES_PER_S_PER_SM = 30e9
"""Between the H100 SXM's 25 GB/s an SM and the H200's 37 (B200: ~54, MI355X: ~31 a CU)."""
TAIL_WAVE_SHARE = 0.25
"""At 8 a thread, up to this share of a wave past the 8-a-thread limit 16 a thread keeps the launch to one
wave: a second wave this small cost more than the longer chains (H100, I 2176 M 1024: 5.39 µs at 16 a thread,
5.65 at 8; at 1.7 waves 8 won; run 13)."""
RESIDENT_THREADS_PER_SM = 2048
MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second axis (a column-first grid puts the row tiles there)."""
WIDENINGS = ("shift", "cvt")
WIDE_CODES_MAX_COLS = 512
"""Tiles of at most this many columns and 16 values a thread store 16 codes a thread (one 16-byte store,
one shuffle per block amax): 1-6% faster on the H200 while the codes fit in half the L2; at 1024 columns it
was not (run 11)."""
WIDE_CODES_MAX_L2_SHARE = 0.5
"""... and only while the launch's codes (M * I bytes) fit in this share of the L2: beyond it the 16-byte
code stores made the kernel 10-27% slower than 8 codes a thread (I 1792-4352, M 8192-16384, H200; run 12;
at 25 MB, I 1536 M 16384, 30.9 against 32.7 µs, still faster; run 13)."""


class ActMulConfig(NamedTuple):
    """Launch shape of the act·mul kernel (any value computes the same bits).

    `cols_first`: the grid's first axis walks the column blocks of a row tile (consecutive
    programs read consecutive bytes of the same rows) instead of the row tiles of a column block."""

    block_rows: int
    block_cols: int
    num_warps: int
    cols_first: bool = False
    widen: str = "shift"
    """bf16 -> fp32 of the gate and of y: "shift" (NVIDIA: two bit operations per pair) or "cvt" (Triton's)."""
    code_vector: int = 8
    """Contiguous values per thread the quant's code store is laid out for (`MxSpec.CODE_VECTOR`: 8 or 16)."""
    max_registers: int = 0
    """`KernelLaunch.max_registers` on NVIDIA (0: ptxas's choice; the default launch's: `load_first_registers`)."""
    pdl: bool = False
    """Programmatic dependent launch (NVIDIA only, dropped elsewhere): the kernel waits for the kernel before
    it (`gdc_wait`) before touching memory and lets the next one launch. Off by default for the norms'
    reason: it pays only between PDL launches on both sides (docs/perf_notes.md, runs 10 and 15)."""
    join_loads: bool = False
    """Up's bits joined into the gate's before any arithmetic (`_after_loads`), so that ptxas issues both loads of
    a row before computing on the gate. Without it (sm_90, Triton 3.6) GELU-tanh's swizzled decode launches issue
    up's load after the first use of the gate's (two memory round trips in a row: the 0.3 µs of run 19), and the
    16-values tiles compute on a thread's first row before loading the rest. The default launch sets it where
    it was measured to pay (:func:`join_loads_pays`); an explicit config keeps what it says."""


def block_cols(i: int) -> int:
    """Columns of a tile: the largest power of two <= 1024 dividing I (I % 128 == 0), else the power of
    two covering I, 128 .. 1024."""
    if i % MIN_BLOCK_COLS == 0:
        return min(MAX_BLOCK_COLS, i & -i)
    return max(MIN_BLOCK_COLS, min(MAX_BLOCK_COLS, triton.next_power_of_2(i)))


def values_per_thread(
    m: int, i: int, sm_count: int, small: tuple[int, ...] = SMALL_VALUES_PER_THREAD, *,
    dram_bytes_per_s: float = NOMINAL_DRAM_BYTES_PER_S,
) -> int:  # fmt: skip
    """The fewest of `small` values a thread with which the launch's M * I values fit in the threads the
    SMs hold at once (2048 each); beyond, 16 on a GPU of fast memory per SM, else 8 (16 while that keeps a
    nearly empty second wave away). The module docstring says why."""
    wave = sm_count * RESIDENT_THREADS_PER_SM
    for v in small:
        if m * i <= v * wave:
            return v
    slow, fast = LARGE_VALUES_PER_THREAD
    if dram_bytes_per_s / sm_count >= FAST_DRAM_BYTES_PER_S_PER_SM or m * i <= (1 + TAIL_WAVE_SHARE) * slow * wave:
        return fast
    return slow


JOIN_LOADS_DECODE_M = 16
"""Up to this M, GELU-tanh's swizzled launches join the loads: 0.29-0.33 µs (of ~2.4) faster at M 1-4 and
0.04-0.32 at M 16 (H100, run 21); row-major ones issue both loads first already and lost 0.01-0.12 µs."""
JOIN_LOADS_MIN_M = 256
"""From this M, GELU-tanh's one-row tiles (8 values a thread; up's load after the gate's whole activation)
join the loads: 5-8% faster at M 256-1024 and 0.5% on the median beyond (H100, run 21). At M 64 the join cost
up to 0.3 µs in both layouts and both activations timed, with or without a late load."""


def join_loads_pays(activation: str, swizzled: bool, m: int, config: ActMulConfig, isa: Isa = "ptx") -> bool:
    """Whether the default launch of `config` joins up's bits into the gate's (`ActMulConfig.join_loads`).
    On NVIDIA, GELU-tanh only, where ptxas issues up's load after the gate's arithmetic and the launch cannot
    hide the second round trip: swizzled decode launches, and one-row tiles from M 256. Elsewhere the join cost
    up to 0.3 µs at M 64 and up to 14% on tiles of several rows a thread, and SiLU never gained
    (docs/perf_notes.md, run 21). Not timed, so off: the other activations, and other ISAs (the late load is
    ptxas's schedule; there the join is two integer ops a pair for nothing known)."""
    if isa != "ptx" or activation != "gelu_tanh":
        return False
    if m <= JOIN_LOADS_DECODE_M:
        return swizzled
    return m >= JOIN_LOADS_MIN_M and config.block_rows == 1


LOAD_FIRST_REGISTERS = 40
"""The register cap (`ActMulConfig.max_registers`) of the default launch's 8-values tiles where it was measured to
pay (:func:`load_first_registers`). Left to itself (no cap) ptxas holds them at 32 registers by computing on a
thread's first values before loading the rest (the tiles of several rows: up's `LDG` after the gate's `exp`s);
capped at 40 it issues every load first, at 36-39 registers (1536 threads an SM instead of 2048), the same
instructions. H100, run 25: SiLU 3-5% faster at M 512-4096 on the TP shards' several-row tiles (I 1536-4352;
`join_loads` there: within 1.5%), 1-3% on the one-row tiles of I 14336 / 17408 at M 512-1024, within 1% beyond.
Row-major timed; the H200 (8 a thread only up to one wave there) not yet."""
LOAD_FIRST_GELU_MAX_VALUES = 1 << 22
"""GELU-tanh (twice SiLU's arithmetic a value) takes the cap on tiles of several rows up to this many values (M·I;
about 1.5 waves of 8 a thread on 132 SMs): 2-6% faster at I 2688 / 5376 M 256-1024; from 5.5M values -0.3..+2.5%
(H100, run 25). Its one-row tiles join the loads instead (`join_loads_pays`; capped, they were 8-12% slower)."""
LOAD_FIRST_VALUES_PER_THREAD = 8
"""The tiles the cap pays on (H100): 4 a thread issue both loads first already; 16 (the H100's one-wave tail
tiles) gained 1.4-1.6% at a cap of 40 and lost at 48 (run 25), and the H200's are untimed."""


def thread_values(config: ActMulConfig) -> int:
    """Values a thread of `config`'s tile."""
    return config.block_rows * config.block_cols // (32 * config.num_warps)


def load_first_registers(activation: str, m: int, i: int, config: ActMulConfig, isa: Isa = "ptx") -> int:
    """The register cap of the default launch of `config` (0: ptxas's choice): `LOAD_FIRST_REGISTERS` on NVIDIA
    for SiLU's tiles of 8 values a thread, and GELU-tanh's tiles of 8 a thread and several rows up to
    `LOAD_FIRST_GELU_MAX_VALUES` (not joined); elsewhere not timed (the clamped SwiGLUs, 16 a thread, other ISAs)
    or slower (docs/perf_notes.md, run 25)."""
    if isa != "ptx" or config.join_loads or thread_values(config) != LOAD_FIRST_VALUES_PER_THREAD:
        return 0
    if activation == "silu":
        return LOAD_FIRST_REGISTERS
    several_rows = config.block_rows > 1
    if activation == "gelu_tanh" and several_rows and m * i <= LOAD_FIRST_GELU_MAX_VALUES:
        return LOAD_FIRST_REGISTERS
    return 0


def act_mul_config(
    m: int, i: int, sm_count: int, *, l2_bytes: int = NOMINAL_L2_BYTES, tile_values: int | None = None,
    max_warps: int = MAX_WARPS, cols_first: bool = True, small_values: tuple[int, ...] = SMALL_VALUES_PER_THREAD,
    dram_bytes_per_s: float = NOMINAL_DRAM_BYTES_PER_S, min_programs_per_sm: int = 2,
) -> ActMulConfig:  # fmt: skip
    """`[BM, BC]` tiles of `tile_values` values (default: `values_per_thread` on `max_warps` warps; BC divides
    I, BM = tile / BC), halved (rows first, then columns, down to 128) while the grid has fewer than
    `min_programs_per_sm` programs per SM; warps: the tile's values at that many a thread, 1 .. `max_warps`;
    16 codes a thread on tiles of <= 512 columns and 16 values a thread while the codes fit in half of
    `l2_bytes`."""
    if tile_values is None:
        tile_values = (
            values_per_thread(m, i, sm_count, small_values, dram_bytes_per_s=dram_bytes_per_s) * 32 * max_warps
        )
    per_warp = tile_values // max_warps
    bc = min(block_cols(i), max(MIN_BLOCK_COLS, tile_values))
    bm = max(1, tile_values // bc)

    def programs(bm: int, bc: int) -> int:
        return triton.cdiv(max(1, m), bm) * triton.cdiv(i, bc)

    while programs(bm, bc) < min_programs_per_sm * sm_count and (bm > 1 or bc > MIN_BLOCK_COLS):
        if bm > 1:
            bm //= 2
        else:
            bc //= 2
    warps = max(1, min(max_warps, bm * bc // per_warp))
    wide_codes = (
        bc <= WIDE_CODES_MAX_COLS and bm * bc >= 16 * 32 * warps and m * i <= WIDE_CODES_MAX_L2_SHARE * l2_bytes
    )
    return ActMulConfig(bm, bc, warps, cols_first, code_vector=16 if wide_codes else 8)


def issue_bound_tile(
    activation: str, m: int, i: int, config: ActMulConfig, *, isa: Isa, sm_count: int, l2_bytes: int = NOMINAL_L2_BYTES
) -> ActMulConfig:  # fmt: skip
    """The default launch's tile for an issue-bound activation: GELU-tanh on NVIDIA, where the dispatch took 8 values a
    thread (the H100's large-M tile) for more than `LOAD_FIRST_GELU_MAX_VALUES` values, takes the 16-values tile
    instead wherever that tile stores 16 codes a thread (at most 512 columns, the codes in half the L2): its thread's
    own instructions (addresses, the block amax, the scale) spread over twice the values, 37.1 instructions a value
    against 42.4 (sm_90). H100, run 26: 2-7% faster at 5.5-11M values (I 2688 M 2048-4096, I 5376 M 1024-2048),
    within ±1.6% at 22M (I 5376 M 4096); SiLU (29 a value, memory-bound there) was slower with it at nearly every
    point (up to 22%), and the 16-values tile with 8 codes a thread gained nothing. Not timed, so `config`: the
    clamped SwiGLUs, other ISAs."""
    if isa != "ptx" or activation != "gelu_tanh" or m * i <= LOAD_FIRST_GELU_MAX_VALUES:
        return config
    if thread_values(config) != LARGE_VALUES_PER_THREAD[0]:
        return config
    tile_values = LARGE_VALUES_PER_THREAD[1] * 32 * MAX_WARPS
    wide = act_mul_config(m, i, sm_count, l2_bytes=l2_bytes, tile_values=tile_values, cols_first=config.cols_first)
    return wide if wide.code_vector == 16 else config


def default_launch_config(
    activation: str, m: int, i: int, *, swizzled: bool, isa: Isa, sm_count: int, l2_bytes: int = NOMINAL_L2_BYTES,
    dram_bytes_per_s: float = NOMINAL_DRAM_BYTES_PER_S,
) -> ActMulConfig:  # fmt: skip
    """What the launch runs without `config=`: `act_mul_config`'s tile (`issue_bound_tile`'s for GELU-tanh), up's
    loads joined where `join_loads_pays`, the register cap where `load_first_registers`."""
    cfg = act_mul_config(m, i, sm_count, l2_bytes=l2_bytes, dram_bytes_per_s=dram_bytes_per_s)
    cfg = issue_bound_tile(activation, m, i, cfg, isa=isa, sm_count=sm_count, l2_bytes=l2_bytes)
    cfg = cfg._replace(join_loads=join_loads_pays(activation, swizzled, m, cfg, isa))
    return cfg._replace(max_registers=load_first_registers(activation, m, i, cfg, isa))


@triton.jit
def _round(v, DTYPE: tl.constexpr, ON: tl.constexpr):
    if ON:
        return v.to(DTYPE).to(tl.float32)
    else:
        return v


@triton.jit
def _widen(v, WIDEN: tl.constexpr):
    """bf16 -> fp32 (exact): WIDEN "shift" (NVIDIA only: the launch sets it there) moves the bits
    (`bf16_bits_to_f32`); "cvt" is `.to(float32)`."""
    if WIDEN == "shift" and v.dtype == tl.bfloat16:
        return bf16_bits_to_f32(v)
    else:
        return v.to(tl.float32)


@triton.jit
def _mul_widen_bf16(a, u):
    """`(a * u).to(bf16).to(float32)` of bf16 operands: `mul.rn.bf16x2` (the product of two bf16 values is
    exact in fp32, so one correctly rounded bf16 multiply is the same value), widened by shifts."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 p; mul.rn.bf16x2 p, $2, $3; shl.b32 $0, p, 16; and.b32 $1, p, 0xffff0000; }",
        "=r,=r,r,r",
        [a, u],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _act_mul_tile(
    g,
    u,
    alpha,
    limit,
    ACT: tl.constexpr,
    ROUND: tl.constexpr,
    DTYPE: tl.constexpr,
    MATH: tl.constexpr,
    WIDEN_Y: tl.constexpr,
):
    """`act(g) * u` of fp32 tiles, rounded to DTYPE and widened back (the value y holds; WIDEN_Y: how, see
    `_widen`; "cvt" where y is stored, so that the compiler keeps the product in the dtype)."""
    if ACT == 0:  # silu
        a = _round(silu_f32(g, MATH), DTYPE, ROUND)
    elif ACT == 1:  # gelu_tanh
        inner = GELU_BETA * (g + GELU_KAPPA * (g * g * g))
        a = _round((0.5 * g) * (1.0 + tanh_f32(inner, MATH)), DTYPE, ROUND)
    elif ACT == 2:  # swiglu_step
        a = _round(silu_f32(g, MATH), DTYPE, ROUND)
        a = _round(tl.minimum(a, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
        u = _round(tl.clamp(u, -limit, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
    else:  # swiglu_oai
        g = _round(tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
        s = _round(sigmoid_f32(_round(g * alpha, DTYPE, ROUND), MATH), DTYPE, ROUND)
        a = _round(g * s, DTYPE, ROUND)
        u = _round(tl.clamp(u, -limit, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
        u = _round(u + 1.0, DTYPE, ROUND)
    if ROUND and WIDEN_Y == "shift" and DTYPE.is_bf16():  # a and u hold bf16 values
        return _mul_widen_bf16(a.to(DTYPE), u.to(DTYPE))
    else:
        return (a * u).to(DTYPE).to(tl.float32)


@triton.jit
def _after_loads(g, u, zero, ISA: tl.constexpr):
    """g's bits or'ed with (u's bits and a runtime zero): the same values, but ptxas cannot compute on g before
    u's load has issued (it cannot fold a kernel argument)."""
    z = tl.full(g.shape, 0, tl.int16) + zero.to(tl.int16)
    if ISA != "ptx":
        return (g.to(tl.int16, bitcast=True) | (u.to(tl.int16, bitcast=True) & z)).to(g.dtype, bitcast=True)
    j = tl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, $3, 0xF8;",
        "=r,r,r,r",
        [g.to(tl.int16, bitcast=True), u.to(tl.int16, bitcast=True), z],
        dtype=tl.int16,
        is_pure=True,
        pack=2,
    )
    return j.to(g.dtype, bitcast=True)


@triton.jit(do_not_specialize=["M", "scale_rows", "n_tiles", "join_zero"])
def _act_mul_kernel(
    g_ptr,
    u_ptr,
    dst,
    M,
    scale_rows,
    n_tiles,
    I,  # noqa: E741  (the MLP's intermediate size, as the papers name it)
    stride_g,
    stride_u,
    alpha,
    limit,
    join_zero,
    ACT: tl.constexpr,
    ROUND_EACH_OP: tl.constexpr,
    QUANT: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    ROW_AXIS: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    PAD_PROGRAMS: tl.constexpr,
    MX: tl.constexpr,
    MATH: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr = False,
    JOIN_LOADS: tl.constexpr = False,
):
    """A `[BM, BC]` tile: row tile `program_id(ROW_AXIS)`, column block `program_id(1 - ROW_AXIS)`;
    row tiles past `n_tiles` (swizzled layout only) zero the scales of padding rows."""
    pdl_enter(PDL)
    pid = tl.program_id(ROW_AXIS)
    cb = tl.program_id(1 - ROW_AXIS)
    # tiles of real rows first (the fall-through path ptxas lays out first), then the programs of padding rows
    # (no loads) where the launch has any (swizzled scales, rows past the tiles); else a constant condition
    real_rows = pid < n_tiles if PAD_PROGRAMS else True
    if real_rows:
        rows = pid.to(tl.int64) * BM + tl.arange(0, BM)
        cols = cb * BC + tl.arange(0, BC)
        r2 = rows[:, None]
        c2 = cols[None, :]
        mask = (r2 < M) & (c2 < I)
        g = tl.load(g_ptr + r2 * stride_g + c2, mask=mask, other=0.0, eviction_policy="evict_first")
        u = tl.load(u_ptr + r2 * stride_u + c2, mask=mask, other=0.0, eviction_policy="evict_first")
        if JOIN_LOADS:  # both loads issued before the arithmetic (ActMulConfig.join_loads)
            ISA: tl.constexpr = MX.ISA  # a bundle field passed on as an argument: a constexpr
            g = _after_loads(g, u, join_zero, ISA)
        dtype: tl.constexpr = g.dtype
        WIDEN_Y: tl.constexpr = WIDEN if QUANT and not MX.EMIT_Y else "cvt"
        y = _act_mul_tile(_widen(g, WIDEN), u.to(tl.float32), alpha, limit, ACT, ROUND_EACH_OP, dtype, MATH, WIDEN_Y)
        if QUANT:
            if ACT >= 2:  # the clamped forms' limit is a runtime value: zero the masked lanes whatever it is
                y = tl.where(mask, y, 0.0)
            # y holds dtype values in fp32: quantized as it is (a round trip through the dtype would cost a
            # convert per value where the compiler cannot see that y is exact), stored as the dtype
            y_out = y.to(dtype) if MX.EMIT_Y else y
            _mx_epilogue(y, y_out, rows, cols, mask, cb * (BC // 32), I, dst, scale_rows, BM, BC, MX)
        else:
            tl.store(dst.y_ptr + r2 * I + c2, y.to(dtype), mask=mask)
    else:
        WORDS: tl.constexpr = BC // (32 * COLUMN_TILE)  # BC >= 128: whole words
        _zero_pad_program(dst, pid, n_tiles, cb * WORDS, scale_rows, BM, PAD_ROWS, WORDS)


def act_mul_launch(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    isa: Isa,
    alpha: float = 1.702,
    limit: float = 7.0,
    round_each_op: bool = True,
    quant: bool = True,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    config: ActMulConfig | None = None,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales, y), launch)` without running it (quant False: codes / scales None,
    y always). gate / up: `[M, I]` with a unit last stride (e.g. the two halves of a
    `[M, 2I]` gate_up: any row stride). Outputs on gate's device (a meta device works)."""
    if activation not in ACTIVATION_IDS:
        raise ValueError(f"triton_act_quant: activation {activation!r} is not one of {', '.join(ACTIVATION_IDS)}")
    swizzled = bool(quant and swizzled)
    outputs, scale_rows = producer_outputs(
        "triton_act_quant", ("gate", gate), ("up", up), quant=quant, swizzled=swizzled, emit_y=emit_y, what="I"
    )
    codes, scales, y = outputs
    rule_key = rule_name(rule)
    m, i = gate.shape
    dev = gate.device
    if scale_rows == 0 or i == 0:
        return outputs, None
    cfg = config
    if cfg is None:
        cfg = default_launch_config(
            activation, m, i, swizzled=swizzled, isa=isa, sm_count=device_sm_count(dev),
            l2_bytes=device_l2_bytes(dev), dram_bytes_per_s=device_dram_bytes_per_s(dev),
        )  # fmt: skip
    if cfg.widen not in WIDENINGS or cfg.code_vector not in CODE_VECTORS:
        raise ValueError(f"triton_act_quant: {cfg} (widen one of {WIDENINGS}, code_vector one of {CODE_VECTORS})")
    hints = launch_hints(isa, cfg.pdl, cfg.max_registers)
    n_tiles, n_pad = pad_programs(m, scale_rows, cfg.block_rows, swizzled)
    row_axis = 1 if cfg.cols_first and n_tiles + n_pad <= MAX_GRID_Y else 0
    grid = [n_tiles + n_pad, triton.cdiv(i, cfg.block_cols)]
    if row_axis:
        grid.reverse()
    y_arg = y if y is not None else gate
    dst = mx_dst(y_arg, codes, scales, i) if quant else mx_dst(y_arg, gate, gate, i)
    join_zero = 0  # join_loads's zero: a kernel argument, so that ptxas cannot fold the join away
    args = (gate, up, dst, m, scale_rows, n_tiles, i, row_stride(gate, i), row_stride(up, i), float(alpha),
            float(limit), join_zero)  # fmt: skip
    spec = MxSpec(swizzled, bool(emit_y and quant), "hw", "in_place", rule_key, isa, cfg.code_vector,
                  warp_amax(cfg.block_rows * cfg.block_cols, cfg.num_warps, isa))  # fmt: skip
    constexprs = dict(
        ACT=ACTIVATION_IDS[activation],
        ROUND_EACH_OP=bool(round_each_op),
        QUANT=bool(quant),
        BM=cfg.block_rows,
        BC=cfg.block_cols,
        ROW_AXIS=row_axis,
        PAD_ROWS=SCALE_PAD_ROWS,
        PAD_PROGRAMS=n_pad > 0,
        MX=spec,
        MATH=math_of(dev, isa),
        WIDEN=cfg.widen if isa == "ptx" else "cvt",
        PDL=hints.pdl,
        JOIN_LOADS=bool(cfg.join_loads),
    )
    return outputs, KernelLaunch(_act_mul_kernel, tuple(grid), args, constexprs, cfg.num_warps, fp_fusion=False,
                                 pdl=hints.pdl, max_registers=hints.max_registers)  # fmt: skip


def act_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    round_each_op: bool = True,
    quant: bool = True,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    config: ActMulConfig | None = None,
):
    """`(codes, scales, y)` of `act(gate) * up` (quant False: `(None, None, y)`); one launch."""
    isa = device_isa(gate.device)
    outputs, launch = act_mul_launch(
        gate, up, activation, isa=isa, alpha=alpha, limit=limit, round_each_op=round_each_op, quant=quant,
        swizzled=swizzled, emit_y=emit_y, rule=rule, config=config,
    )  # fmt: skip
    if launch is not None:
        launch.run()
    return outputs
