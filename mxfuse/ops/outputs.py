"""The outputs of the `mxfuse::` ops, shaped as their schemas return them.

Optional outputs keep fixed positions (a schema cannot vary its arity): the `y` of a fused op
called without `emit_y` is an empty tensor, and the ops that add a residual return
`residual_out` before `y`. Scales come back row-major `[..., K/32]` or F8_128x4 (`swizzled`)
as the op's argument asks, from the reference or from a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from mxfuse.ops import reference
from mxfuse.ops.mx_layout import scale_columns


def empty_y(x: Tensor) -> Tensor:
    """The `y` output of a fused op called without `emit_y` (a schema cannot vary its arity)."""
    return x.new_empty(0)


def norm_outputs(first: tuple[Tensor, ...], residual_out: Tensor | None, y: Tensor) -> tuple[Tensor, ...]:
    """The outputs of a fused norm op: `(*first, y)`, or `(*first, residual_out, y)` when it adds a residual."""
    return (*first, y) if residual_out is None else (*first, residual_out, y)


def reference_scales(scales: Tensor, lead: Sequence[int], k: int, swizzled: bool) -> Tensor:
    """The reference's row-major `[M, K/32]` scales as the op returns them: F8_128x4 when
    swizzled, else `[*lead, K/32]`."""
    return reference.swizzle_scales(scales) if swizzled else scales.reshape(*lead, scale_columns(k))


def kernel_scales(scales: Tensor, lead: Sequence[int], k: int, swizzled: bool) -> Tensor:
    """A kernel's scales as the op returns them: swizzled ones as written (F8_128x4), row-major
    ones as `[*lead, K/32]`."""
    return scales if swizzled else scales.reshape(*lead, scale_columns(k))
