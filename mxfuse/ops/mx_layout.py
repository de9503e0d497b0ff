"""The MXFP8 data layout, in one place: element and scale formats, and every buffer shape.

Rows of `K` values (`K % BLOCK == 0`) become `K` float8_e4m3fn codes plus one E8M0
scale byte (uint8, bias 127) per block of `BLOCK` values. The scales come in three
layouts, all derived here:

- row-major: `[M, K/32]` (`scale_columns(k)` per row);
- F8_128x4 swizzled (what NVIDIA block-scaled GEMMs read): rows padded to 128 and
  scale columns to 4, `swizzled_scale_shape(m, k)`; 128x4 tiles cannot be
  concatenated by rows, which is why the SP gather never carries them;
- row-packed for the SP all-gather: one uint8 row of `packed_width(k)` bytes, the K
  code bytes then the K/32 scale bytes.

Shape functions take plain ints or SymInts (fake impls call them with symbolic sizes),
so they use only `+`, `//` and `*`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
"""Element (code) dtype of MXFP8."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
SCALE_DTYPE = torch.uint8
"""Storage dtype of E8M0 scale bytes."""
BLOCK = 32
"""Values per E8M0 scale (MX block size)."""
E8M0_BIAS = 127
"""Exponent bias of an E8M0 scale byte: byte `sb` stands for `2**(sb - E8M0_BIAS)`."""
E8M0_MAX = 254
"""Largest scale byte written (255 is E8M0's NaN)."""
SWIZZLE_ROW_TILE = 128
"""Rows of one F8_128x4 scale tile (rows are padded to a multiple of it)."""
SWIZZLE_COLUMN_TILE = 4
"""Scale columns of one F8_128x4 tile (scale columns are padded to a multiple of it)."""


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n (n an int or a SymInt)."""
    return (n + multiple - 1) // multiple * multiple


def scale_columns(k: int) -> int:
    """E8M0 scales per row of K values (row-major scale width)."""
    return k // BLOCK


def padded_scale_columns(k: int) -> int:
    """Scale columns of the swizzled layout: K/32 padded to a multiple of 4."""
    return round_up(k // BLOCK, SWIZZLE_COLUMN_TILE)


def padded_rows(m: int) -> int:
    """Rows of the swizzled scale layout: M padded to a multiple of 128."""
    return round_up(m, SWIZZLE_ROW_TILE)


def swizzled_scale_shape(m: int, k: int) -> tuple[int, int]:
    """Shape `(pad128(M), pad4(K/32))` of the F8_128x4 scales of `[M, K]` rows."""
    return (padded_rows(m), padded_scale_columns(k))


def scale_shape(lead: Sequence[int], k: int, swizzled: bool) -> tuple[int, ...]:
    """Scales of `[*lead, K]` values: row-major `[*lead, K/32]`, or swizzled over all `prod(lead)` rows."""
    if swizzled:
        m = 1
        for d in lead:
            m = m * d
        return swizzled_scale_shape(m, k)
    return (*lead, scale_columns(k))


def packed_width(k: int) -> int:
    """Bytes per row of the row-packed buffer: K code bytes then K/32 scale bytes."""
    return k + k // BLOCK
