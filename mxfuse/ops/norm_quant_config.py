"""Launch configurations of the norm / quant kernels (`triton_norm_quant.py`) and their defaults.

Pure Python (no Triton, no GPU): the ops pick a config per call from K and M, the
compile test and tools/compile_targets.py enumerate them on a CPU, and the benchmark
variants (tools/kernel_variants.py) are configs too.

What a config may change: `tree` and `rsqrt` fix the arithmetic of a row (the fused and
the unfused norm must use the same two, and they must not change with M: batch
invariance); every other field only moves work between threads, programs or
instructions, so every value gives the same bits (tests/test_gpu_kernels.py). The
defaults below depend on K for the arithmetic and the row layout, and on M only for
those bit-neutral choices (the H200 sweeps behind them: docs/perf_notes.md, runs 5, 6 and 8).
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

SPLIT_MAX_ROWS = 16
"""Up to this many rows a row is split over one program per chunk (decode sizes)."""
EVICT_FIRST_MAX_ROWS = 1024
"""Up to this many rows the x / residual loads carry evict_first (streamed once)."""
PAIRED_BF16_MAX_ROWS = 256
"""Up to this many rows (and up to EVICT_FIRST_MAX_ROWS with a residual) y is rounded to bf16
two values per convert before the quant (`quant_ops="hw-bf16x2"`; run 8)."""
PIPELINED_MIN_ROWS = 4096
"""Fused plain norm + quant at K 2049..3072 and 4097..6144, NVIDIA: from this many rows a
persistent grid whose loop fetches the next tiles' rows while one is computed (run 8:
-9..-12% at K 6144)."""
PIPELINED_STAGES = 3
PIPELINED_WARPS_PER_SM = 24
"""Warps per SM of the pipelined loop (3 programs of 8 warps: 75 registers a thread on sm_90)."""
PAD_ROWS = 32
"""Padding rows per zero-fill program (swizzled scales, `scale_padding="fill"`)."""
MIN_CHUNK = 128
"""Smallest chunk of a row (columns): every chunk covers whole F8_128x4 column groups."""
MAX_CHUNKS = 4
"""Chunks per row at most: the squares are added elementwise across them, then `tl.sum`."""


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

    def __post_init__(self):
        for field, allowed in (
            ("tree", TREES),
            ("rsqrt", RSQRTS),
            ("quant_ops", QUANT_OPS),
            ("scale_store", SCALE_STORES),
            ("scale_padding", SCALE_PADDINGS),
        ):
            _check(self, field, allowed)
        if self.persistent and self.split > 1:
            raise ValueError(f"NormConfig: a persistent grid does not split rows, got {self}")
        if self.loop_stages < 1 or (self.loop_stages > 1 and not self.persistent):
            raise ValueError(f"NormConfig: loop_stages > 1 needs a persistent grid, got {self}")

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


def row_chunks(k: int) -> tuple[int, int]:
    """(CH, NCH): a row is NCH chunks of CH columns, CH = max(128, next_pow2(K) / 4), a power of two."""
    ch = max(MIN_CHUNK, padded_row(k) // MAX_CHUNKS)
    return ch, -(-k // ch)


def norm_config(k: int, m: int | None = None, *, plain_quant: bool = False, isa: str = "ptx") -> NormConfig:
    """Default config for M rows of K values (M None: the config of the row layout alone);
    `plain_quant`: the fused plain norm + quant (no residual); `isa`: the kernels' ISA
    (`triton_targets`: "ptx" on NVIDIA; the H200 measurements below choose for it).

    The arithmetic and the layout of a row (warps, the values of a row each thread holds:
    ~32 of the padded row, so 8 warps for K = 6144 and 4 for K = 3072) depend on K alone,
    so the reduction tree is fixed per K. M only chooses, without changing a bit: a split
    row at M <= 16 (a row's tail over NCH SMs); evict_first from 17 to 1024 rows (it loses
    at 4096 and above); the paired bf16 rounding of y up to 256 rows (1024 with a residual:
    -0.02..-0.19 µs there, +1..2% on the plain norm at large M); for the fused plain norm at
    K 2049..8192 from 4096 rows, a persistent grid with a software-pipelined loop (the next
    tiles' rows in flight while one is computed; the add-norm, with twice the bytes per
    value, already streams at 97% of the copy and loses with it). Off NVIDIA the loop is not
    pipelined (its AMDGCN spills: tools/compile_targets.py), and at 4 chunks a row (K 3073..4096,
    6145..8192) it would take 108 registers a thread: not measured, not picked.
    """
    block_k = padded_row(k)
    bm = 1 if block_k >= 2048 else min(16, 2048 // block_k)
    nw = max(4, min(16, bm * block_k // 1024))
    if m is None:
        return NormConfig(block_rows=bm, num_warps=nw)
    nch = row_chunks(k)[1]
    split = nch if m <= SPLIT_MAX_ROWS else 1
    evict_first = split == 1 and m <= EVICT_FIRST_MAX_ROWS  # a split row is read SPLIT times: no hint measured
    paired = m <= PAIRED_BF16_MAX_ROWS or (m <= EVICT_FIRST_MAX_ROWS and not plain_quant)
    if plain_quant and isa == "ptx" and m >= PIPELINED_MIN_ROWS and block_k in (4096, 8192) and nch == 3:
        return NormConfig(
            num_warps=nw,
            persistent=PIPELINED_WARPS_PER_SM // nw,
            loop_stages=PIPELINED_STAGES,
            load_fence=False,  # the weight is loaded once, before the loop
        )
    return NormConfig(
        block_rows=bm,
        num_warps=nw,
        split=split,
        evict_first=evict_first,
        quant_ops="hw-bf16x2" if paired else "hw",
    )


def quant_config(k: int, m: int) -> QuantConfig:
    """Default config of the quant kernel: tiles of ~4K values, at most 1024 columns (so
    even M = 1 gets K/1024 programs)."""
    bc = min(1024, padded_row(k))
    bm = max(1, min(max(1, 4096 // bc), next_pow2(max(m, 1))))
    nw = max(4, min(8, bm * bc // 512))
    return QuantConfig(block_rows=bm, block_cols=bc, num_warps=nw)
