"""The guards of rewrite 2 (:mod:`.sp_gather`) and its refusal codes: rows, gathers and gathered shapes.

Each guard returns a :class:`~mxfuse.patterns.results.Reason` (why not) or None (it can).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxfuse.ops.library import ACTIVATION_DTYPES
from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, scale_columns
from mxfuse.patterns.collectives import GatherMatch
from mxfuse.patterns.fx_utils import fake, is_call, static_int
from mxfuse.patterns.quants import QuantMatch
from mxfuse.patterns.results import Reason, RefusalCode, SharedCode

aten = torch.ops.aten


class SpGatherCode(RefusalCode):
    """Refusals of rewrite 2 of its own (the norm and quant guards it shares are :class:`SharedCode`)."""

    NOT_ROWS = "not 2-D rows [M, K]"
    GATHER_UNSUPPORTED = "an all-gather the rewrite cannot read (dim, constants, row count)"
    GATHER_SPLIT = "the all-gather is along a dim other than 0"
    MODE_KEEPS = "the sp_gather option keeps this form"
    SHAPE_READS = "shape reads that a packed gather would change"
    OTHER_USERS = "other users of a tensor the rewrite would replace"
    PARTIAL_GATHER = "only one of codes/scales crosses an all-gather"
    GROUP_MISMATCH = "codes and scales gathered by different groups or families"
    GATHERED_SHAPES = "gathered codes/scales of unexpected shape"


def rows_reason(t: torch.Tensor | None, what: str) -> Reason | None:
    """Whether `t` is 2-D bf16/fp16 rows with a static K that is a multiple of 32."""
    if t is None:
        return Reason(SharedCode.NO_SHAPES, f"no fake tensor on the {what} (graph not traced with shapes)")
    if t.dim() != 2:
        return Reason(
            SpGatherCode.NOT_ROWS, f"the {what} is {t.dim()}-D; only 2-D rows [M, K] are gathered by this rewrite"
        )
    if t.dtype not in ACTIVATION_DTYPES:
        return Reason(
            SharedCode.ACTIVATION_DTYPE, f"the {what} has dtype {t.dtype}; the packed quant takes bfloat16/float16"
        )
    k = static_int(t.shape[-1])
    if k is None:
        return Reason(SharedCode.HIDDEN_SIZE, f"hidden size {t.shape[-1]} of the {what} is symbolic")
    if k % BLOCK:
        return Reason(SharedCode.HIDDEN_SIZE, f"hidden size K={k} of the {what} is not a multiple of {BLOCK}")
    return None


def gather_reason(gather: GatherMatch, local: torch.Tensor | None = None) -> Reason | None:
    """Why this gather cannot be rewritten (None: it can): dim, constants, row count."""
    out = fake(gather.out)
    dim = gather.dim

    def no(text: str, code: RefusalCode = SpGatherCode.GATHER_UNSUPPORTED) -> Reason:
        return Reason(code, text)

    if not isinstance(dim, int) or isinstance(dim, bool):
        return no(f"gather dim {dim!r} is not a constant")
    if out is None:
        return no("no fake tensor on the gathered output", SharedCode.NO_SHAPES)
    if dim % max(out.dim(), 1) != 0:
        return no(f"the all-gather is along dim {dim}, not 0 (rows)", SpGatherCode.GATHER_SPLIT)
    ws = static_int(gather.world_size) if not isinstance(gather.world_size, bool) else None
    if ws is None or ws < 1:
        return no(f"world size {gather.world_size!r} is not a constant the pass can read")
    if not isinstance(gather.group_name, str):
        return no(f"group {gather.group_name!r} is not a constant group name the pass can read")
    local = fake(gather.x) if local is None else local
    if local is None or local.dim() != out.dim() or out.dim() == 0:
        return no("gathered and local tensors differ in rank")
    if not statically_known_true(out.shape[0] == ws * local.shape[0]):
        return no(f"gathered rows {out.shape[0]} are not world_size {ws} x local rows {local.shape[0]}")
    if any(not statically_known_true(a == b) for a, b in zip(out.shape[1:], local.shape[1:])):
        return no("gathered and local tensors differ beyond dim 0")
    return None


def gathered_shapes_reason(quant: QuantMatch, codes_out: fx.Node, scales_out: fx.Node, ws: int) -> Reason | None:
    """The gathered codes must read as fp8 `[W*M, K]`; gathered row-major scales as `[W*M, K/32]`."""
    x, codes, scales = fake(quant.x), fake(codes_out), fake(scales_out)
    if codes is None or scales is None:
        return Reason(SharedCode.NO_SHAPES, "no fake tensor on the gathered codes or scales")
    if x is None:
        return Reason(SharedCode.NO_SHAPES, "no fake tensor on the quant's input")
    m, k = x.shape
    rows_ok = codes.dim() == 2 and statically_known_true(codes.shape[0] == ws * m)
    if codes.dtype != FP8_DTYPE or not rows_ok or codes.shape[1] != k:
        return Reason(
            SpGatherCode.GATHERED_SHAPES,
            f"gathered codes are {tuple(codes.shape)} {codes.dtype}, not float8_e4m3fn [{ws}*{m}, {k}]",
        )
    if not quant.swizzled and (scales.dim() != 2 or not statically_known_true(scales.shape[0] == ws * m)):
        return Reason(
            SpGatherCode.GATHERED_SHAPES,
            f"gathered row-major scales are {tuple(scales.shape)}, not [{ws}*{m}, {scale_columns(k)}]",
        )
    if quant.swizzled and scales.dim() not in (1, 2):
        return Reason(SpGatherCode.GATHERED_SHAPES, f"gathered swizzled scales are {scales.dim()}-D")
    return None


def shape_reads(gather: GatherMatch, dims_other_than_0: bool = False) -> list[fx.Node]:
    """`aten.sym_size.int` users of the collective or its output (dim 0 only, or only the others)."""
    found = []
    for node in dict.fromkeys((gather.start, gather.out)):
        for u in node.users:
            if is_call(u, aten.sym_size.int) and (u.args[1] != 0) == dims_other_than_0:
                found.append(u)
    return found
