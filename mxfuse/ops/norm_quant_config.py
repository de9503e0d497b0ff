"""Launch configurations of the norm / quant kernels (`triton_norm_quant.py`) and their defaults.

Pure Python (no Triton, no GPU): the ops pick a config per call from K, M and the target,
the compile test and tools/compile_targets.py enumerate them on a CPU, and the benchmark
variants (tools/kernel_variants.py) are configs too.

What a config may change: `tree` and `rsqrt` fix the arithmetic of a row (the fused and
the unfused norm must use the same two, and they must not change with M: batch
invariance), and so does the row layout (rows per tile and warps: `tl.sum`'s order);
every other field only moves work between programs or instructions, so every value gives
the same bits (tests/test_gpu_norms.py, tests/test_gpu_norm_dispatch.py).

The dispatch (:func:`norm_config`) is derived from the shape and the target, not looked up:
the row layout from K alone (a tile holds the padded row, at least TILE_VALUES values, and
each warp 1024 of them, so 32 values a thread from K 4096 up and 16 below, never fewer than
4 warps), then every bit-neutral choice from the size of the grid against the
multiprocessors (`sms`) of the device, because at the sizes of a decode step the question is
only how much of the chip a row's work can occupy. While the grid has an SM for every
program of a row split over its NCH chunks (tiles x NCH <= sms), a row is split, each
program reducing the whole row (the same code, so the same bits) and finishing one chunk, so
a row's quant tail runs on otherwise idle SMs; never beyond, where the duplicated loads and
reduction share an SM's issue slots with real work (runs 8 and 10: a row over 3 programs
lost at 64 rows, over 2 programs by 0.04-0.31 µs). The loads carry evict_first up to
EVICT_FIRST_ROWS_PER_SM rows per SM (the rows are read once; the hint lost from 4096 rows on
the H200, 31 a SM). y is rounded two values per convert up to PAIRED_BF16_ROWS_PER_SM rows
per SM, and in the evict_first range with a residual, whose extra bytes hide the unpacking
it costs (beyond, where the kernel is issue-bound, it costs 1-2%). The fused plain norm,
NVIDIA only, runs a persistent grid of PIPELINED_WARPS_PER_SM warps an SM whose software-
pipelined loop fetches the next tiles while one is computed, where a row has 3 chunks (at 4
the loop takes 108 registers a thread), at least 3 programs share an SM (one computes while
two load) and each program gets at least PIPELINED_MIN_TILES_PER_PROGRAM tiles to amortize
the weight load and the pipeline fill (run 8: it lost at 1.3-2.6 tiles a program and won
9-12% at 5-10). Outside that loop, bf16 rows and weight are widened by moving their bits
(`unpack="bits"`, one integer op a value instead of ptxas's PRMT and shift for every odd one):
up to 0.15 µs faster at M 1-1024, K 2048-4096 on the H200 (64 of 96 points; 6 slower, by <= 0.06;
run 13). The
thresholds are counted per SM, so the same rule gives another M on a GPU
with another SM count (the H200 measurements behind them: docs/perf_notes.md, runs 5, 6, 8
and 10); a launch described on a meta or CPU tensor is dispatched for NOMINAL_SMS.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

TREES = ("native", "pairwise")
"""The sum of squares: `tl.sum` (order fixed by the layout, so by K) or a layout-free pairwise tree."""
RSQRTS = ("approx", "rn")
"""1/sqrt: the hardware approximation (see triton_norm_quant's docstring per target) or `div_rn(1, sqrt_rn)`."""
QUANT_OPS = ("hw", "explicit", "hw-bf16x2")
"""How NaN and Inf reach the codes: the hardware's (`hw`), spelled out (`explicit`), `hw` with paired bf16 rounding."""
SCALE_STORES = ("in_place", "tl_store")
"""Scale bytes stored from the reduction's own layout (inline `st.global.u8`) or through `tl.store`."""
SCALE_PADDINGS = ("fill", "norm")
"""F8_128x4 padding rows: zero-filled by store-only programs, or run through the norm on zero rows."""
UNPACKS = ("cvt", "bits")
"""bf16 -> fp32 of the loaded rows and weight: `.to(float32)` (ptxas: a PRMT and a shift for every
odd value) or, on NVIDIA, the bits moved by one integer op a value (`bits`; the same bits)."""

TILE_VALUES = 2048
"""Values of a tile at least: short rows are stacked (BM = TILE_VALUES / padded row, <= 16)."""
VALUES_PER_WARP = 1024
"""A tile's values per warp (32 a thread), at least MIN_WARPS warps and at most 16."""
MIN_WARPS = 4
NOMINAL_SMS = 132
"""Multiprocessors a launch described on a meta or CPU tensor is dispatched for (an H200's)."""
EVICT_FIRST_ROWS_PER_SM = 8
"""Up to this many rows per SM (unsplit) the x / residual loads carry evict_first."""
PAIRED_BF16_ROWS_PER_SM = 2
"""Up to this many rows per SM (and in the evict_first range with a residual) y is rounded
to bf16 two values per convert before the quant (`quant_ops="hw-bf16x2"`; run 8)."""
PIPELINED_STAGES = 3
PIPELINED_WARPS_PER_SM = 24
"""Warps per SM of the pipelined loop (3 programs of 8 warps: 75 registers a thread on sm_90)."""
PIPELINED_MIN_PROGRAMS_PER_SM = 3
PIPELINED_MIN_TILES_PER_PROGRAM = 4
PAD_ROWS = 32
"""Padding rows per zero-fill program (swizzled scales, `scale_padding="fill"`)."""
MIN_CHUNK = 128
"""Smallest chunk of a row (columns): every chunk covers whole F8_128x4 column groups."""
MAX_CHUNKS = 4
"""Chunks per row at most: the squares are added elementwise across them, then `tl.sum`."""
THREAD_CHUNK_VALUES = 8
"""Values a thread holds of one chunk in :func:`wide_chunk_layout` (a benchmark candidate)."""


def _check(config: object, field: str, allowed: tuple) -> None:
    value = getattr(config, field)
    if value not in allowed:
        raise ValueError(f"{type(config).__name__}: {field}={value!r} is not one of {allowed}")


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Launch shape and code variant of the norm / fused norm+quant kernel.

    - block_rows: rows per tile (BM); num_warps: warps per program.
    - split: programs per tile; > 1: each reads and reduces the whole rows and finishes
      (normalizes, quantizes, stores) one chunk of them (decode sizes).
    - persistent: 0 = one program per tile; n = at most n programs per SM, looping over tiles.
    - loop_stages (persistent only): > 1 = the loop fetches the rows of the next tiles while
      one is computed (Triton's software pipeliner, cp.async into shared memory).
    - tree, rsqrt: the arithmetic (:data:`TREES`, :data:`RSQRTS`).
    - quant_ops: :data:`QUANT_OPS`. "hw": maxNum skips NaN in the block amax and the
      saturating e4m3 convert maps +-Inf to +-448; "explicit": a `where` before the max and
      a clamp before the convert (same bits on NVIDIA, 2 instructions more per element; what
      every non-NVIDIA target runs); "hw-bf16x2": "hw" with the bf16 rounding of y done two
      values per convert (bf16 without emit_y).
    - scale_store: :data:`SCALE_STORES` (the portable `tl.store` off NVIDIA).
    - evict_first: evict_first hint on the x / residual loads.
    - load_fence: a barrier right after the loads, so that the weight is fetched together
      with x and residual rather than after x's round trip (ptxas's order otherwise).
    - scale_padding: :data:`SCALE_PADDINGS` (swizzled scales only).
    - pdl: programmatic dependent launch (NVIDIA sm_90+; a hint that other targets drop): the
      kernel waits (`griddepcontrol.wait`) before its first load and lets the next kernel launch
      (`launch_dependents`) right after.
    - chunk_cols: columns of a chunk of the row (0: :func:`row_chunks`' default, max(128,
      next_pow2(K) / 4)); else a power of two >= MIN_CHUNK with at most MAX_CHUNKS chunks a
      row. Part of the row layout (it fixes the sum-of-squares order, like block_rows and
      num_warps): fused and unfused must use the same, and it must be a function of K only.
    - unpack: :data:`UNPACKS` (bf16 inputs on NVIDIA only; "cvt" everywhere else; same bits).
    """

    block_rows: int = 1
    num_warps: int = 8
    split: int = 1
    persistent: int = 0
    loop_stages: int = 1
    tree: Literal["native", "pairwise"] = "native"
    rsqrt: Literal["approx", "rn"] = "approx"
    quant_ops: Literal["hw", "explicit", "hw-bf16x2"] = "hw"
    scale_store: Literal["in_place", "tl_store"] = "in_place"
    evict_first: bool = False
    load_fence: bool = True
    scale_padding: Literal["fill", "norm"] = "fill"
    pdl: bool = False
    chunk_cols: int = 0
    unpack: Literal["cvt", "bits"] = "cvt"

    def __post_init__(self):
        for field, allowed in (
            ("tree", TREES),
            ("rsqrt", RSQRTS),
            ("quant_ops", QUANT_OPS),
            ("scale_store", SCALE_STORES),
            ("scale_padding", SCALE_PADDINGS),
            ("unpack", UNPACKS),
        ):
            _check(self, field, allowed)
        if self.persistent and self.split > 1:
            raise ValueError(f"NormConfig: a persistent grid does not split rows, got {self}")
        if self.loop_stages < 1 or (self.loop_stages > 1 and not self.persistent):
            raise ValueError(f"NormConfig: loop_stages > 1 needs a persistent grid, got {self}")
        ch = self.chunk_cols
        if ch and (ch < MIN_CHUNK or ch & (ch - 1)):
            raise ValueError(f"NormConfig: chunk_cols must be 0 or a power of two >= {MIN_CHUNK}, got {self}")

    def replace(self, **changes) -> NormConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """`[block_rows, block_cols]` tiles of the quant kernel, num_warps, and the code variant
    (`quant_ops`, `scale_store` as in :class:`NormConfig`; same bits for every value)."""

    block_rows: int = 4
    block_cols: int = 1024
    num_warps: int = 8
    quant_ops: Literal["hw", "explicit", "hw-bf16x2"] = "hw"
    scale_store: Literal["in_place", "tl_store"] = "in_place"

    def __post_init__(self):
        _check(self, "quant_ops", QUANT_OPS)
        _check(self, "scale_store", SCALE_STORES)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def padded_row(k: int) -> int:
    """Columns of a row rounded up to a power of two (>= MIN_CHUNK)."""
    return max(MIN_CHUNK, next_pow2(k))


def row_chunks(k: int, chunk_cols: int = 0) -> tuple[int, int]:
    """(CH, NCH): a row is NCH chunks of CH columns, CH = max(128, next_pow2(K) / 4), a power of
    two, or `chunk_cols` (`NormConfig.chunk_cols`) when given; at most MAX_CHUNKS chunks."""
    ch = chunk_cols or max(MIN_CHUNK, padded_row(k) // MAX_CHUNKS)
    nch = -(-k // ch)
    if nch > MAX_CHUNKS:
        raise ValueError(f"row_chunks: K={k} in chunks of {ch} columns is {nch} chunks > {MAX_CHUNKS}")
    return ch, nch


def wide_chunk_layout(k: int, min_warps: int = MIN_WARPS) -> tuple[int, int, int]:
    """`(block_rows, num_warps, chunk_cols)` of a candidate row layout, a function of K only
    (benchmark variants; the default dispatch does not use it): the default layout's rows
    per tile, at least `min_warps` warps, and chunks at least THREAD_CHUNK_VALUES values a
    thread wide (one 16-byte access of 2-byte values: the default's 512-column chunks at K
    1025..2048 give a thread 4, and the MXFP8 block amax then takes three shuffles instead
    of two). Where that is the default's layout, chunk_cols is 0. K 2048..4096 at
    min_warps 8: Liger-Kernel's layout (8 warps, 8 or 16 values a thread)."""
    base = norm_config(k)
    nw = max(min_warps, base.num_warps) if base.block_rows == 1 else base.num_warps
    ch = max(row_chunks(k)[0], THREAD_CHUNK_VALUES * 32 * nw // base.block_rows)
    ch = min(ch, padded_row(k))
    return base.block_rows, nw, 0 if ch == row_chunks(k)[0] else ch


def norm_config(
    k: int,
    m: int | None = None,
    *,
    plain_quant: bool = False,
    isa: str = "ptx",
    sms: int = NOMINAL_SMS,
    layout: tuple[int, int, int] | None = None,
) -> NormConfig:
    """Default config for M rows of K values on a device of `sms` multiprocessors (M None:
    the config of the row layout alone); `plain_quant`: the fused plain norm + quant (no
    residual); `isa`: the kernels' ISA (`triton_targets`: "ptx" on NVIDIA). The rule is the
    module docstring's: the layout from K, the rest from the grid's programs per SM.
    `layout`: `(block_rows, num_warps, chunk_cols)` instead of the default row layout (a
    function of K only, e.g. :func:`wide_chunk_layout`; benchmark variants): the same rule
    for the rest, counted on its chunks, and the pipelined loop also at 2 chunks a row of
    at least 16 values a thread."""
    block_k = padded_row(k)
    bm = 1 if block_k >= TILE_VALUES else min(16, TILE_VALUES // block_k)
    nw = max(MIN_WARPS, min(16, bm * block_k // VALUES_PER_WARP))
    chunk_cols = 0
    if layout is not None:
        bm, nw, chunk_cols = layout
    if m is None:
        return NormConfig(block_rows=bm, num_warps=nw, chunk_cols=chunk_cols)
    ch, nch = row_chunks(k, chunk_cols)
    pipelined_chunks = nch == 3 or (layout is not None and nch == 2 and bm * ch * nch >= 16 * 32 * nw)
    sms = max(1, sms)
    tiles = max(1, -(-m // bm))
    split = nch if tiles * nch <= sms else 1
    evict_first = split == 1 and m <= EVICT_FIRST_ROWS_PER_SM * sms  # a split row is read SPLIT times
    paired = m <= PAIRED_BF16_ROWS_PER_SM * sms or (not plain_quant and m <= EVICT_FIRST_ROWS_PER_SM * sms)
    programs_per_sm = PIPELINED_WARPS_PER_SM // nw
    if (
        plain_quant
        and isa == "ptx"
        and pipelined_chunks
        and bm == 1
        and programs_per_sm >= PIPELINED_MIN_PROGRAMS_PER_SM
        and tiles >= PIPELINED_MIN_TILES_PER_PROGRAM * programs_per_sm * sms
    ):
        return NormConfig(
            num_warps=nw,
            chunk_cols=chunk_cols,
            persistent=programs_per_sm,
            loop_stages=PIPELINED_STAGES,
            load_fence=False,  # the weight is loaded once, before the loop
        )
    return NormConfig(
        block_rows=bm,
        num_warps=nw,
        chunk_cols=chunk_cols,
        split=split,
        evict_first=evict_first,
        quant_ops="hw-bf16x2" if paired else "hw",
        unpack="bits" if isa == "ptx" else "cvt",
    )


def quant_config(k: int, m: int) -> QuantConfig:
    """Default config of the quant kernel: tiles of ~4K values, at most 1024 columns (so
    even M = 1 gets K/1024 programs)."""
    bc = min(1024, padded_row(k))
    bm = max(1, min(max(1, 4096 // bc), next_pow2(max(m, 1))))
    nw = max(4, min(8, bm * bc // 512))
    return QuantConfig(block_rows=bm, block_cols=bc, num_warps=nw)
