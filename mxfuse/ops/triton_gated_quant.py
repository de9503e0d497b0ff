"""Triton kernels of the gated producers (CUDA impls of :mod:`mxfuse.ops.gated`).

Functions (2-D `[M, K]` rows with a unit last stride; any row stride; M may be 0; K % 32 == 0):

- :func:`sigmoid_gate` -- `x * sigmoid(gate)`, quantized to MXFP8 (`quant=True`, codes +
  scales in either layout, `y` too when `emit_y`) or stored as `y` (`quant=False`: the unfused op).
- :func:`gated_rms_norm` -- `rms(x) * w * act(z)` per group of `group_size` values, likewise.

Each has a `*_launch` twin that allocates the outputs and returns them with the launch
(:class:`KernelLaunch`) without running it, for tests/test_targets_compile.py. `config=` (a
:class:`GateConfig` / :class:`GatedNormConfig`) overrides the launch shape, which the dispatch
(:func:`gate_config`, :func:`gated_norm_config`) otherwise picks: for the benchmark's candidates; every
shape computes the same bits (tests/test_gpu_gated.py).

Design
======

A prologue computes the producer's `y` of a tile in fp32 and rounds it to the dtype; the
MXFP8 epilogue is every producer's (:func:`mxfuse.ops.triton_mx_quant._mx_epilogue`, the
norms' and the standalone quant's code), reading the ROUNDED `y`. The unfused op is the same
kernel with `QUANT` False storing `y` instead, so fused == unfused + `mxfp8_quantize`
bitwise on the device by construction (the quant kernel computes the same E8M0 function on
the same bf16 values). The launch checks and outputs are the act·mul kernel's
(:func:`mxfuse.ops.triton_mx_quant.producer_outputs`).

Arithmetic (compiled without FMA contraction):

- sigmoid / silu: `1 / (1 + exp(-v))`, `v / (1 + exp(-v))` with libdevice's precise `exp`
  (CUDA's `expf`, written out in :mod:`mxfuse.ops.triton_fp32_math`; never `ex2.approx`). The
  gate divides correctly rounded, what torch's CUDA `sigmoid` computes (`one / (one + std::exp(-x))`
  in fp32), bit for bit: `rcp_rn_f32`, ptxas's `rcp.rn` fast path for 1, 2 or 4 values behind one
  range test (`RCP_PACK`), `div_rn`'s bits in 3 instructions a value instead of ~10. The gated norm's SiLU divides as
  Inductor does (`div.full.f32` on NVIDIA, within 2 ulp): its contract is a bound, and `div_rn`
  made it issue-bound (docs/design.md, "Gated producers").
- the gated norm's mean square: a `[BM, GP]` tile holds whole groups (GP = the group padded
  to a power of two, >= 128), summed by the fixed pairwise tree of the norm kernels
  (`_pairwise_sum`: the same order for any layout, BM or grid, so fused == unfused and batch
  invariance hold whatever the tile), divided by G with `div_rn` (a multiply by 1/G where G is a power of two:
  the same bits, and no division subroutine to hold registers for); `1/sqrt` is
  `rsqrt.approx.f32` on NVIDIA (what torch's CUDA `rsqrt` and Inductor compute) and
  `tl.math.rsqrt` elsewhere.

Grids: the gate is elementwise: `[BM, BC]` tiles of `gate_config` (the quant kernel's, at 8 values a thread
where the act·mul takes 8). The gated norm: one program per BM rows and one group, groups first (`(K / G,
cdiv(rows, BM))`: consecutive programs read a row tile's K contiguous values; 3-4% faster than row tiles first
at M 16384 on an H100, run 16, where run 10 measured it 0-3% slower on the H200 with the previous kernel).
A group's padding lanes and the last row tile's rows past M compute from x = 0 and z = 1 (those rows'
y forced to 0 when swizzled: a zero row may give NaN with eps 0). z = 1, not 0, was chosen when the SiLU
divided with `div.rn.f32`, whose slow path a zero numerator takes (4.9 µs at M 1 against 3.3 at
M 64); x = 0 keeps every stored value and the sum of squares as they were. The last group also stores the
zero scale columns past K/32 up to the F8_128x4 padding.

Swizzled scales (both kernels, as the act·mul's): the row tiles cover the M real rows; the programs after
them only store the zero scales of the remaining padding rows up to pad128(M), a 32-bit word (4 scales) a
store, no loads. Computing those rows as rows of zeros, as the kernels did before, cost a decode launch up to
0.85 µs at K 8192 (127 rows of work for one; H100, docs/perf_notes.md run 17).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mxfuse.ops.mx_layout import SWIZZLE_COLUMN_TILE, padded_scale_columns
from mxfuse.ops.norm_quant_config import NOMINAL_SMS, next_pow2, quant_config
from mxfuse.ops.reference import QuantRule
from mxfuse.ops.triton_act_quant import values_per_thread
from mxfuse.ops.triton_fp32_math import math_of, rcp_pack, sigmoid_f32, silu_f32
from mxfuse.ops.triton_mx_quant import (
    CODE_VECTORS,
    COLUMN_TILE,
    SCALE_PAD_ROWS,
    MxDst,
    MxSpec,
    _mx_epilogue,
    _store_scales,
    _zero_pad_program,
    mx_dst,
    pad_programs,
    producer_outputs,
    rule_name,
    warp_amax,
)
from mxfuse.ops.triton_norm_prologue import _pairwise_sum, _to_f32
from mxfuse.ops.triton_targets import (
    NOMINAL_DRAM_BYTES_PER_S,
    Isa,
    KernelLaunch,
    device_isa,
    dram_bytes_per_s,
    launch_hints,
    pdl_enter,
    sm_count,
)

__all__ = [
    "GateConfig",
    "GatedNormConfig",
    "gate_config",
    "gate_launch",
    "gated_norm_config",
    "gated_norm_launch",
    "gated_rms_norm",
    "sigmoid_gate",
]

MIN_GROUP_TILE = 128
"""Columns of a group's tile, and of the gate's, at least (a multiple of 4 scale columns)."""
TILE_VALUES = 4096
"""Values per program of the gated norm (BM = TILE_VALUES / GP rows, at least 1)."""
GATE_CODE_VECTOR = 16
"""The gate's codes per thread (`MxSpec.CODE_VECTOR`): its `quant_config` tiles of 16 values a thread then
hold half a block each (one shuffle per amax, one 16-byte code store), the layout it had before it shared the
epilogue (sm_90 SASS: 712 instructions against 752 with 8)."""
MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second axis (a groups-first grid puts the row tiles there)."""
GATE_SMALL_VALUES = 8
"""The gate's values a thread where `values_per_thread` takes the fewer (its tile otherwise holds 16)."""
DECODE_MAX_GROUP_TILE = 512
"""The gated norm's decode tile (one row, 4 values a thread) for groups padded to at most this; wider groups keep
the default tile (already one row from 4096 lanes; a whole-row group of 6144 at 4 a thread would need 16 warps, and
at 8 codes a thread it takes scratch on sm_100)."""
DECODE_PROGRAMS_PER_SM = 8
"""Up to this many one-warp programs an SM, both gated producers run one row (a 128-value block of it for the gate,
a group for the norm) on one warp a program: at decode sizes a launch's time is one program's dependent chain, and
the shortest chain is the smallest tile. H100 (run 18), gate: 0.04-0.26 µs faster at M 1-16 (K 8192 M 16: 2.44
against 2.70), slower from M x K / 128 = 2048 programs (K 4096 M 64: 2.95 against 2.80); the gated norm likewise
(K 8192 M 1: 2.08 against 2.24; K 4096 M 64: 3.05 against 2.94)."""


WARP_ROW_SMS_PER_PROGRAM = 2
"""While its programs number at most one per this many SMs, the gate runs each 128-column block on 4 warps, one
value a thread, on NVIDIA: its chain is then the shortest and the block amax one `redux.sync` (`MxSpec.WARP_AMAX`).
H100 (run 23): 0.08-0.16 µs faster at M 1 than one warp of 4 values a thread for every K 512-8192 (K 8192: 1.96
against 2.07; K 512: 1.76 against 1.92); run 24: up to ~0.5 programs an SM also ahead of one row a program
(`DECODE_ROW_WARPS_PER_SM`: M 1 0.02-0.12 µs, K 2048 M 4 1.94 against 1.99), behind it from ~1 (K 4096 M 4: 2.09
against 2.01-2.05; K 1024 M 16: 2.08 against 2.02-2.05). Off NVIDIA (wave64, no redux) not measured."""

DECODE_ROW_WARPS_PER_SM = 2
"""Past `WARP_ROW_SMS_PER_PROGRAM`, while one row a program (the quant tile's up to 1024 columns, 8 values a thread)
keeps the launch at most this many warps an SM, the gate takes that tile on NVIDIA. H100 (run 24, three calls):
0.04-0.08 µs faster than the decode tile (one warp, 4 values a thread) from 64 to 256 warps (K 8192 M 4: 2.09
against 2.15; K 4096 M 16: 2.20 against 2.26; K 2048 M 16: 2.08-2.11 against 2.15-2.16; K 1024 M 64: 2.19 against
2.25), within -0.01..+0.05 from 384 to 512 (K 6144 M 16, K 8192 M 16, K 2048 M 64), where the decode tile stays."""

ROW_TILE_WARPS_PER_SM = 16
"""Beyond decode sizes (`DECODE_PROGRAMS_PER_SM`), while one row a program keeps the launch at most this many warps
an SM, the gate takes it on NVIDIA rather than the 2-4 row tile, which leaves SMs idle or one program short there.
H100 (run 24): 0.03-0.25 µs faster from 1024 to 2048 warps (K 4096 M 64: 2.56 against 2.81; K 1024 M 256: 2.55
against 2.83; K 512 M 1024: 2.99 against 3.10), slower from 4096 (K 4096 M 256: 3.78 against 3.56; K 1024 M 1024:
3.75 against 3.56)."""


def is_decode_launch(programs: int, sms: int) -> bool:
    """Whether a launch of `programs` one-warp programs is at decode size (`DECODE_PROGRAMS_PER_SM`)."""
    return programs <= DECODE_PROGRAMS_PER_SM * sms


class GateConfig(NamedTuple):
    """Launch shape of the gate kernel: `[block_rows, block_cols]` tiles (powers of two, block_cols >= 128:
    the last column tile then covers the F8_128x4 padding scale columns, which nothing else writes).
    Elementwise, with whole 32-value blocks in a tile: any such shape computes the same bits."""

    block_rows: int
    block_cols: int
    num_warps: int
    code_vector: int = GATE_CODE_VECTOR
    """`MxSpec.CODE_VECTOR` (8 or 16; a layout hint)."""
    max_registers: int = 0
    """`KernelLaunch.max_registers` on NVIDIA (0: ptxas's choice)."""
    pdl: bool = False
    """Programmatic dependent launch (NVIDIA only; off by default, as the norms' and the act·mul's)."""


class GatedNormConfig(NamedTuple):
    """Launch shape of the gated norm: rows per program and warps (a group's GP columns are fixed by G).
    The pairwise tree sums in the same order for any, so any computes the same bits (batch invariance holds
    whatever the dispatch picks for M)."""

    block_rows: int
    num_warps: int
    code_vector: int = 8
    """`MxSpec.CODE_VECTOR` (8 or 16; a layout hint)."""
    max_registers: int = 0
    """`KernelLaunch.max_registers` on NVIDIA (0: ptxas's choice)."""
    pdl: bool = False
    """Programmatic dependent launch (NVIDIA only; off by default)."""
    load_fence: bool = True
    """A barrier between the z / weight loads and x's, so that every load is issued before x's reduction waits."""
    groups_first: bool = False
    """Consecutive programs take the groups of one row tile (reading the rows' K contiguous values between them),
    else the row tiles of one group."""


def _check_shape(cfg: GateConfig | GatedNormConfig, dims: tuple[int, ...]) -> None:
    """Powers of two for the tile's dims and warps (<= 16), a known code vector: a clear error, not Triton's."""
    ok = all(d >= 1 and d & (d - 1) == 0 for d in (*dims, cfg.num_warps)) and cfg.num_warps <= 16
    if not ok or cfg.code_vector not in CODE_VECTORS:
        raise ValueError(f"triton_gated_quant: {cfg} (powers of two, <= 16 warps, code_vector in {CODE_VECTORS})")


def gate_config(
    k: int, m: int, sms: int = NOMINAL_SMS, dram: float = NOMINAL_DRAM_BYTES_PER_S, isa: Isa = "ptx"
) -> GateConfig:
    """The gate's default launch shape: the quant kernel's `quant_config(k, m)` tile (4096 values, 16 a
    thread), its rows cut to 8 values a thread where the act·mul takes 8 (`values_per_thread`: while the
    launch fits in the SMs' resident threads at 8, and at large M on a memory below 30 GB/s an SM).
    H100, K 2048 / 4096: 0.15-0.35 µs faster at M 4-1024 (2.33 against 2.64 at K 2048 M 16), within 0.6% at
    M 4096-16384 (docs/perf_notes.md, run 15). At decode sizes (`DECODE_PROGRAMS_PER_SM`) one row of 128
    columns on one warp, 4 values a thread. On NVIDIA, by the launch's size: 128 columns on 4 warps, one value
    a thread (`WARP_ROW_SMS_PER_PROGRAM`), then one row of the quant tile's columns a program, 8 values a thread
    (`DECODE_ROW_WARPS_PER_SM`), then the decode tile, then one row a program again up to
    `ROW_TILE_WARPS_PER_SM` warps an SM. The gate is elementwise: any tile gives the same bits."""
    programs = m * triton.cdiv(k, MIN_GROUP_TILE)
    cfg = quant_config(k, m)
    row = GateConfig(1, cfg.block_cols, max(1, cfg.block_cols // (32 * GATE_SMALL_VALUES)), code_vector=8)
    row_warps = m * triton.cdiv(k, row.block_cols) * row.num_warps
    if isa == "ptx" and programs * WARP_ROW_SMS_PER_PROGRAM <= sms:
        return GateConfig(1, MIN_GROUP_TILE, MIN_GROUP_TILE // 32, code_vector=8)
    if isa == "ptx" and row_warps <= DECODE_ROW_WARPS_PER_SM * sms:
        return row
    if is_decode_launch(programs, sms):
        return GateConfig(1, MIN_GROUP_TILE, 1, code_vector=8)
    if isa == "ptx" and row_warps <= ROW_TILE_WARPS_PER_SM * sms:
        return row
    values = values_per_thread(m, k, sms, (GATE_SMALL_VALUES,), dram_bytes_per_s=dram)
    rows = cfg.block_rows
    if rows * cfg.block_cols > values * 32 * cfg.num_warps:
        rows = max(1, values * 32 * cfg.num_warps // cfg.block_cols)
    return GateConfig(rows, cfg.block_cols, cfg.num_warps)


# --------------------------------------------------------------------------- prologues


@triton.jit
def _gate_activation(v, ACTIVATION: tl.constexpr, MATH: tl.constexpr):
    """fp32 silu `v / (1 + exp(-v))` or sigmoid `1 / (1 + exp(-v))` of the gated norm (gated.gate_activation),
    with Inductor's division (the norm's contract against torch is a bound: docs/design.md)."""
    if ACTIVATION == "silu":
        return silu_f32(v, MATH)
    else:
        return sigmoid_f32(v, MATH)


@triton.jit
def _rsqrt(v, ISA: tl.constexpr):
    """`1 / sqrt(v)`: `rsqrt.approx.f32` on NVIDIA (not the `.ftz` form), `tl.math.rsqrt` elsewhere."""
    if ISA == "ptx":
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.rsqrt(v)


# --------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M", "scale_rows", "n_tiles"])
def _gate_kernel(
    x_ptr,
    g_ptr,
    dst,
    M,
    scale_rows,
    n_tiles,
    K,
    stride_x,
    stride_g,
    QUANT: tl.constexpr,
    ROUND_GATE: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    PAD_PROGRAMS: tl.constexpr,
    MX: tl.constexpr,
    MATH: tl.constexpr,
    RCP_PACK: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """`y = x * sigmoid(gate)` of a `[BM, BC]` tile (the sigmoid rounded to the dtype first when ROUND_GATE);
    row tiles past `n_tiles` (swizzled layout only) zero the scales of padding rows."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    cb = tl.program_id(1)
    # tiles of real rows first (the fall-through path ptxas lays out first), then the programs of padding rows
    # (no loads) where the launch has any (swizzled scales, rows past the tiles); else a constant condition
    real_rows = pid < n_tiles if PAD_PROGRAMS else True
    if real_rows:
        rows = pid.to(tl.int64) * BM + tl.arange(0, BM)
        cols = cb * BC + tl.arange(0, BC)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
        ISA: tl.constexpr = MX.ISA  # bundle fields passed on as arguments: constexprs
        s = sigmoid_f32(_to_f32(g, "bits", ISA), MATH, ROUNDED_DIV=True, PACK=RCP_PACK)
        if ROUND_GATE:
            s = s.to(x.dtype).to(tl.float32)
        yf = x.to(tl.float32) * s  # (a bf16 x bf16 product LLVM rounds with one HMUL2 when ROUND_GATE: a cvt)
        y = yf.to(x.dtype)
        if QUANT:  # the last tile's rows past M (swizzled) load zeros: y = 0, scale byte 0
            _mx_epilogue(yf, y, rows, cols, mask, cb * (BC // 32), K, dst, scale_rows, BM, BC, MX)
        else:
            tl.store(dst.y_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
    else:
        WORDS: tl.constexpr = BC // (32 * COLUMN_TILE)  # BC >= 128: whole words
        _zero_pad_program(dst, pid, n_tiles, cb * WORDS, scale_rows, BM, PAD_ROWS, WORDS)


@triton.jit(do_not_specialize=["M", "scale_rows", "n_tiles"])
def _gated_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    dst,
    M,
    scale_rows,
    n_tiles,
    K,
    stride_x,
    stride_z,
    group_size,
    eps,
    G: tl.constexpr,
    GP: tl.constexpr,
    W_FULL: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr,
    ROUND_WEIGHTED: tl.constexpr,
    QUANT: tl.constexpr,
    BM: tl.constexpr,
    ROW_AXIS: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    PAD_PROGRAMS: tl.constexpr,
    PAD_WORDS: tl.constexpr,
    MX: tl.constexpr,
    MATH: tl.constexpr,
    LOAD_FENCE: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    """The gated RMSNorm of the BM rows `program_id(ROW_AXIS)`, group `program_id(1 - ROW_AXIS)` (G values,
    padded to GP lanes); row tiles past `n_tiles` (swizzled layout only) zero the scales of padding rows,
    PAD_WORDS scale words a group program (the words need not line up with the groups)."""
    pdl_enter(PDL)
    pid = tl.program_id(ROW_AXIS)
    group = tl.program_id(1 - ROW_AXIS)
    # tiles of real rows first (the fall-through path ptxas lays out first), then the programs of padding rows
    # (no loads) where the launch has any (swizzled scales, rows past the tiles); else a constant condition
    real_rows = pid < n_tiles if PAD_PROGRAMS else True
    if real_rows:
        ISA: tl.constexpr = MX.ISA  # bundle fields passed on as arguments: constexprs
        rows = pid.to(tl.int64) * BM + tl.arange(0, BM)
        j = tl.arange(0, GP)
        cols = group * G + j
        mask = (rows < M)[:, None] & (j < G)[None, :]
        # z = 1 past the mask: the module docstring
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=1.0)
        w_offs = cols if W_FULL else j
        w = tl.load(w_ptr + w_offs[None, :], mask=(j < G)[None, :], other=0.0).to(tl.float32)
        if LOAD_FENCE:
            # ptxas otherwise issues z's loads after x's sum of squares, which waits for x: two memory round trips
            # in a row, 0.3-0.5 µs more at decode sizes on an H100 (docs/perf_notes.md, run 16); the barrier keeps
            # them ahead
            tl.debug_barrier()
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        act = _gate_activation(_to_f32(z, "bits", ISA), ACTIVATION, MATH)
        s = _to_f32(x, "bits", ISA)
        if not NORM_BEFORE_GATE:
            s = s * act
        # a fixed-tree sum: `tl.sum`'s order follows the register layout, which the quant epilogue's
        # reshapes change (seen in the sm_90 TTGIR: [1, 8] x [2, 16] lanes unfused, [1, 16] x [4, 8] fused),
        # so fused and unfused would round the mean square differently; the pairwise tree does not
        ssq = _pairwise_sum(s * s, BM, GP)
        # x / 2**k correctly rounded is x * 2**-k (one rounding of the same real value): no division at a power of two
        var = ssq * (1.0 / G) if G & (G - 1) == 0 else tl.math.div_rn(ssq, group_size.to(tl.float32))
        n = s * _rsqrt(var + eps, ISA)[:, None]
        if ROUND_NORMALIZED:
            n = n.to(x.dtype).to(tl.float32)
        out = n * w
        if ROUND_WEIGHTED:
            out = out.to(x.dtype).to(tl.float32)
        if NORM_BEFORE_GATE:
            out = out * act
        if QUANT and MX.SWIZZLED:  # padding rows of F8_128x4: y = 0 (zero rows may give NaN), scale byte 0
            out = tl.where((rows < M)[:, None], out, 0.0)
        y = out.to(x.dtype)
        if not QUANT:
            tl.store(dst.y_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
        else:
            jb = tl.arange(0, GP // 32)
            # a group's padding blocks store nothing (they are the next group's columns): their scale columns
            # start past the layout's last one, so the epilogue's store mask drops them
            scol0 = tl.where(jb < G // 32, group * (G // 32), dst.scale_cols_padded)
            _mx_epilogue(out, y, rows, cols, mask, scol0, K, dst, scale_rows, BM, GP, MX)
            if MX.SWIZZLED:  # noqa: SIM102  (a constexpr branch around a runtime one)
                if group == tl.num_programs(1 - ROW_AXIS) - 1:  # the zero scale columns K/32 .. pad4(K/32)
                    pad = dst.scale_cols + tl.arange(0, 4)
                    zeros = tl.zeros([BM, 4], dtype=tl.int32)
                    _store_scales(dst.sc_ptr, zeros, rows, pad, scale_rows, dst.scale_cols, dst.scale_cols_padded,
                                  dst.stride_s, True, "tl_store", ISA)  # fmt: skip
    else:
        _zero_pad_program(dst, pid, n_tiles, group * PAD_WORDS, scale_rows, BM, PAD_ROWS, PAD_WORDS)


# --------------------------------------------------------------------------- launches


def gate_launch(
    x: torch.Tensor,
    gate: torch.Tensor,
    *,
    quant: bool,
    isa: Isa,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    round_gate: bool = True,
    config: GateConfig | None = None,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales, y), launch)` of the gate kernel, not run (quant False: codes / scales None);
    `config`: the launch shape (default `gate_config(K, M)`)."""
    swizzled = bool(quant and swizzled)
    outputs, scale_rows = producer_outputs(
        "triton_gated_quant", ("x", x), ("gate", gate), quant=quant, swizzled=swizzled, emit_y=emit_y
    )
    rule_key = rule_name(rule)
    m, k = x.shape
    if scale_rows == 0:
        return outputs, None
    qcfg = quant_config(k, m)  # the quant variant (quant_ops, scale_store) of the quant kernel
    cfg = config or gate_config(k, m, sm_count(x.device), dram_bytes_per_s(x.device), isa)
    _check_shape(cfg, (cfg.block_rows, cfg.block_cols, cfg.block_cols // MIN_GROUP_TILE))
    hints = launch_hints(isa, cfg.pdl, cfg.max_registers)
    n_tiles, n_pad = pad_programs(m, scale_rows, cfg.block_rows, swizzled)
    grid = (n_tiles + n_pad, triton.cdiv(k, cfg.block_cols))
    dst = _dst(x, outputs, k)
    args = (x, gate, dst, m, scale_rows, n_tiles, k, x.stride(0) if m > 1 else k, gate.stride(0) if m > 1 else k)
    # a rounded gate makes y a product of two bf16 values, which LLVM rounds with one HMUL2 a pair: pairing the
    # fp32 product's rounding instead would cost 56 instructions a thread (sm_90, K 4096)
    quant_ops = qcfg.quant_ops if round_gate else _paired(qcfg.quant_ops)
    spec = MxSpec(swizzled, bool(emit_y and quant), quant_ops, qcfg.scale_store, rule_key, isa, cfg.code_vector,
                  warp_amax(cfg.block_rows * cfg.block_cols, cfg.num_warps, isa))  # fmt: skip
    constexprs = dict(
        QUANT=bool(quant),
        ROUND_GATE=bool(round_gate),
        BM=cfg.block_rows,
        BC=cfg.block_cols,
        PAD_ROWS=SCALE_PAD_ROWS,
        PAD_PROGRAMS=n_pad > 0,
        MX=spec,
        MATH=math_of(x.device, isa),
        RCP_PACK=rcp_pack(max(1, cfg.block_rows * cfg.block_cols // (32 * cfg.num_warps))),
        PDL=hints.pdl,
    )
    return outputs, KernelLaunch(_gate_kernel, grid, args, constexprs, cfg.num_warps, fp_fusion=False,
                                 pdl=hints.pdl, max_registers=hints.max_registers)  # fmt: skip


def _paired(quant_ops: str) -> str:
    """The quant's NaN / Inf handling with y rounded to bf16 two values per convert (`hw-bf16x2`; the epilogue
    takes it for bf16 without `emit_y` only): half the converts of an fp32 y (the gated producers are
    issue-bound on the H200)."""
    return "hw-bf16x2" if quant_ops == "hw" else quant_ops


def _dst(x: torch.Tensor, outputs: tuple, k: int) -> MxDst:
    """The epilogue's destinations; x stands in for the outputs a launch does not write."""
    codes, scales, y = outputs
    return mx_dst(y if y is not None else x, codes if codes is not None else x, scales if scales is not None else x, k)


def gated_norm_tile(group_size: int) -> tuple[int, int, int]:
    """(GP, BM, num_warps) of the gated norm's tile for a group size beyond decode sizes."""
    gp = max(MIN_GROUP_TILE, next_pow2(group_size))
    bm = max(1, TILE_VALUES // gp)
    return gp, bm, max(4, min(16, bm * gp // 512))


def gated_norm_config(group_size: int, m: int | None = None, k: int | None = None, sms: int = NOMINAL_SMS
                      ) -> GatedNormConfig:  # fmt: skip
    """The gated norm's default launch shape: :func:`gated_norm_tile`'s rows and warps (16 values a thread),
    16 codes a thread (one 16-byte code store, half a block a thread; 8% fewer instructions than 8 codes),
    the load barrier, groups first. 57-59 registers on sm_90 and sm_100 (the barrier holds z and w across x's
    reduction; 40 without it). H100, G 128, K 2048 / 4096: 2.16-2.20 µs at M 1 against 2.54-2.59 before, 3-4%
    faster than row tiles first at M 16384, 87% / 93% of the copy at M 4096 (docs/perf_notes.md, run 16).
    Given M and K, at decode sizes (`DECODE_PROGRAMS_PER_SM`) and for groups up to `DECODE_MAX_GROUP_TILE`, one
    row a program at 4 values a thread (one warp for groups of 128), 8 codes a thread. The pairwise sum adds in
    the same order in every tile, so the rule keeps the bits."""
    gp, bm, warps = gated_norm_tile(group_size)
    decode = m is not None and k is not None and is_decode_launch(m * (k // group_size), sms)
    if decode and gp <= DECODE_MAX_GROUP_TILE:
        return GatedNormConfig(1, gp // MIN_GROUP_TILE, code_vector=8, groups_first=True)
    return GatedNormConfig(bm, warps, code_vector=16, groups_first=True)


def gated_norm_launch(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    *,
    quant: bool,
    isa: Isa,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    norm_before_gate: bool = True,
    activation: str = "silu",
    round_normalized: bool = False,
    round_weighted: bool = False,
    config: GatedNormConfig | None = None,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales, y), launch)` of the gated-norm kernel, not run (quant False: codes / scales None).
    `config`: the launch shape (default `gated_norm_config(group_size, M, K, SMs)`)."""
    swizzled = bool(quant and swizzled)
    outputs, scale_rows = producer_outputs(
        "triton_gated_quant", ("x", x), ("z", z), quant=quant, swizzled=swizzled, emit_y=emit_y
    )
    m, k = x.shape
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"triton_gated_quant: group_size={group_size} must be a multiple of 32 dividing K={k}")
    weight = weight.contiguous()
    if weight.shape not in ((group_size,), (k,)):
        raise ValueError(f"triton_gated_quant: weight {tuple(weight.shape)} must be ({group_size},) or ({k},)")
    rule_key = rule_name(rule)
    if scale_rows == 0:
        return outputs, None
    gp = gated_norm_tile(group_size)[0]
    cfg_n = config or gated_norm_config(group_size, m, k, sm_count(x.device))
    _check_shape(cfg_n, (cfg_n.block_rows,))
    bm, warps = cfg_n.block_rows, cfg_n.num_warps
    hints = launch_hints(isa, cfg_n.pdl, cfg_n.max_registers)
    n_tiles, n_pad = pad_programs(m, scale_rows, bm, swizzled)
    row_tiles, groups = n_tiles + n_pad, k // group_size
    row_axis = 1 if cfg_n.groups_first and row_tiles <= MAX_GRID_Y else 0
    grid = (groups, row_tiles) if row_axis else (row_tiles, groups)
    cfg = quant_config(k, m)  # the quant variant (quant_ops, scale_store) of the quant kernel
    args = (x, z, weight, _dst(x, outputs, k), m, scale_rows, n_tiles, k, x.stride(0) if m > 1 else k,
            z.stride(0) if m > 1 else k, group_size, float(eps))  # fmt: skip
    spec = MxSpec(swizzled, bool(emit_y and quant), _paired(cfg.quant_ops), cfg.scale_store, rule_key, isa,
                  cfg_n.code_vector, warp_amax(bm * gp, warps, isa))  # fmt: skip
    constexprs = dict(
        G=group_size,
        GP=gp,
        W_FULL=weight.shape[0] == k and k != group_size,
        NORM_BEFORE_GATE=bool(norm_before_gate),
        ACTIVATION=activation,
        ROUND_NORMALIZED=bool(round_normalized),
        ROUND_WEIGHTED=bool(round_weighted),
        QUANT=bool(quant),
        BM=bm,
        ROW_AXIS=row_axis,
        PAD_ROWS=SCALE_PAD_ROWS,
        PAD_PROGRAMS=n_pad > 0,
        PAD_WORDS=next_pow2(triton.cdiv(padded_scale_columns(k) // SWIZZLE_COLUMN_TILE, groups)),
        MX=spec,
        MATH=math_of(x.device, isa),
        LOAD_FENCE=bool(cfg_n.load_fence),
        PDL=hints.pdl,
    )
    return outputs, KernelLaunch(_gated_norm_kernel, grid, args, constexprs, warps, fp_fusion=False,
                                 pdl=hints.pdl, max_registers=hints.max_registers)  # fmt: skip


def _run(outputs: tuple, launch: KernelLaunch | None) -> tuple:
    if launch is not None:
        launch.run()
    return outputs


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, *, quant: bool, **kw) -> tuple:
    """`(codes, scales, y)` of `x * sigmoid(gate)` (keywords of :func:`gate_launch`); None where not computed."""
    return _run(*gate_launch(x, gate, quant=quant, isa=device_isa(x.device), **kw))


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, *, quant: bool, **kw
) -> tuple:
    """`(codes, scales, y)` of the gated RMSNorm (keywords of :func:`gated_norm_launch`); None where not computed."""
    return _run(*gated_norm_launch(x, z, weight, eps, group_size, quant=quant, isa=device_isa(x.device), **kw))
