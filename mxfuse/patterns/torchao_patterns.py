"""The Inductor pattern trees of torchao's decomposed MXFP8 quant (:mod:`.torchao_quant` matches them).

Each spelling comes from one factory (`CallFunction` / `KeywordArg`, as
`torch/_inductor/fx_passes/micro_pipeline_tp.py` does): :func:`quant_patterns` (head -> codes
and scales, one `MultiOutputPattern` whose later outputs Inductor finds forward from the head),
:func:`exponent_patterns` (the two spellings of the E8M0 byte: :class:`ScaleSpelling`),
:func:`descale_pattern` and :func:`blocked_patterns` (the views and permutes of `to_blocked`, a
`clone` after a permute or not). Scalars match as literals or as the `scalar_tensor` / 0-d
`full` nodes decompositions make of them (:class:`Scalar`). Sizes are not part of the trees:
the guards of :mod:`.torchao_quant` read them off the fake shapes after a match.
"""

from __future__ import annotations

import enum
import functools
import itertools
from typing import Any

import torch
from torch import fx
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    CallFunction,
    FailedMatch,
    KeywordArg,
    Match,
    MatchContext,
    MatchResult,
    MultiOutputPattern,
    PatternExpr,
)
from torch.utils._ordered_set import OrderedSet

from mxfuse.ops.mx_layout import FP8_DTYPE, FP8_MAX
from mxfuse.ops.reference import E8M0_NAN
from mxfuse.patterns.fx_utils import RESHAPES, is_call

aten, prims = torch.ops.aten, torch.ops.prims


class ScaleSpelling(enum.Enum):
    """How the matched chain computes the E8M0 byte (same bits for a bf16 amax)."""

    LOG2 = "log2"  # torch.ceil(torch.log2(descale)) with where() for NaN / Inf
    PTX = "ptx"  # inline_asm_elementwise("cvt.rp.satfinite.ue8m0x2.f32"), torchao on sm100


class Scalar(PatternExpr):
    """A scalar operand equal to `value`: a literal, or the `scalar_tensor(value)` / 0-d
    `full([], value)` node a decomposition makes of `where`'s scalar operand."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def __repr__(self) -> str:
        return f"Scalar({self.value!r})"

    def _match(self, node: Any, ctx: MatchContext) -> MatchResult:
        if scalar_value(node) == self.value:
            return Match(ctx, self)
        return FailedMatch("{} is not the scalar {}", node, self.value)

    def pattern_eq(self, other: Any) -> bool:
        return super().pattern_eq(other) and self.value == other.value


def _op(target: Any, *args: Any, **kwargs: Any) -> CallFunction:
    """A call of `target` (or of any of a tuple of targets) whatever its users: the chain's nodes
    may be read elsewhere too (replacing codes and scales then leaves those readers alone)."""
    return CallFunction(target, *args, _users=MULTIPLE, **kwargs)


def _convert(x: PatternExpr, dtype: torch.dtype) -> CallFunction:
    return _op(prims.convert_element_type.default, x, dtype)


def _where(cond: PatternExpr, a: Any, b: PatternExpr) -> CallFunction:
    return _op(aten.where.self, cond, a, b)


def _eq(x: PatternExpr, value: int) -> CallFunction:
    return _op(aten.eq.Scalar, x, Scalar(value))


def _clamps(x: PatternExpr, low: float, high: float) -> list[CallFunction]:
    """Both spellings of `x` clamped to `[low, high]`: one `clamp`, or `clamp_max(clamp_min(x))`."""
    return [
        _op(aten.clamp.default, x, Scalar(low), Scalar(high)),
        _op(aten.clamp_max.default, _op(aten.clamp_min.default, x, Scalar(low)), Scalar(high)),
    ]


@functools.cache
def quant_patterns() -> tuple[MultiOutputPattern, ...]:
    """`[head, codes, scales]` of the chain, every spelling of the codes' clamp and of an `alias`
    before the scales' squeeze; `e` and `d` stay keyword args, checked by the patterns below."""
    head = _op(RESHAPES, KeywordArg("rows"), KeywordArg("head_shape"))
    exponent, descale = KeywordArg("exponent"), KeywordArg("descale")
    multiplier = _where(
        _eq(exponent, E8M0_NAN),
        descale,
        _where(
            _eq(exponent, 254),
            Scalar(2.0**-127),
            _where(
                _eq(exponent, 0),
                Scalar(1.0),
                _op(aten.exp2.default, _op(aten.sub.Tensor, Scalar(127), _convert(exponent, torch.float32))),
            ),
        ),
    )
    scaled = _op(aten.mul.Tensor, _convert(head, torch.float32), multiplier)
    byte_view = _op(aten.view.dtype, exponent, torch.float8_e8m0fnu)
    squeezes = [
        _op(aten.squeeze.dim, byte_view, KeywordArg("squeeze_dim")),
        _op(aten.squeeze.dim, _op(aten.alias.default, byte_view), KeywordArg("squeeze_dim")),
    ]
    return tuple(
        MultiOutputPattern([head, _op(RESHAPES, _convert(clamped, FP8_DTYPE), KeywordArg("codes_shape")), scales])
        for clamped, scales in itertools.product(_clamps(scaled, -FP8_MAX, FP8_MAX), squeezes)
    )


@functools.cache
def descale_pattern() -> CallFunction:
    """`d = div(convert(unsqueeze(amax(abs(head), dims), dim), f32), 448.0)`."""
    amax = _op(aten.amax.default, _op(aten.abs.default, KeywordArg("head")), KeywordArg("amax_dims"))
    return _op(
        aten.div.Tensor,
        _convert(_op(aten.unsqueeze.default, amax, KeywordArg("unsqueeze_dim")), torch.float32),
        Scalar(FP8_MAX),
    )


@functools.cache
def exponent_patterns() -> tuple[tuple[ScaleSpelling, CallFunction], ...]:
    """The E8M0 byte `e` of `d` in each spelling (the log2 one in both clamp spellings)."""
    log2 = [
        _where(
            _op(aten.isnan.default, KeywordArg("descale")),
            Scalar(E8M0_NAN),
            _where(
                _op(aten.isinf.default, KeywordArg("descale")),
                Scalar(254),
                _convert(_op(aten.add.Tensor, clamped, Scalar(127)), torch.uint8),
            ),
        )
        for clamped in _clamps(_op(aten.ceil.default, _op(aten.log2.default, KeywordArg("descale"))), -127, 127)
    ]
    patterns = [(ScaleSpelling.LOG2, p) for p in log2]
    hop = _inline_asm()
    if hop is not None:  # torch < 2.12 has no inline asm, and torchao then never emits it
        ptx = _op(hop, KeywordArg("descale"), asm_str=KeywordArg("asm"), dtype=torch.uint16)
        patterns.append((ScaleSpelling.PTX, _convert(ptx, torch.uint8)))
    return tuple(patterns)


def _inline_asm() -> Any:
    try:
        from torch._higher_order_ops.inline_asm_elementwise import inline_asm_elementwise
    except ImportError:
        return None
    return inline_asm_elementwise


@functools.cache
def blocked_patterns() -> tuple[tuple[CallFunction, KeywordArg], ...]:
    """torchao's `to_blocked` after the padding, as compiled, with its leaf (the padded scales):
    views `[R/128, 128, C/4, 4]`, permutes (0, 2, 1, 3), views `[-1, 4, 32, 4]`, swaps dims 1
    and 2, views `[-1, 32, 16]`, flattens; Inductor puts a `clone` after either permute where it
    likes. Sizes are checked on the fake shapes (`torchao_quant._is_blocked`)."""

    def swap_1_2(x: PatternExpr, clone: bool) -> CallFunction:
        swapped = _op(aten.permute.default, x, [0, 2, 1, 3])
        return _op(aten.clone.default, swapped) if clone else swapped

    patterns = []
    for first_clone, second_clone in itertools.product((False, True), repeat=2):
        padded = KeywordArg("padded")
        tiles = swap_1_2(_op(RESHAPES, padded, KeywordArg("tiles")), first_clone)
        blocks = swap_1_2(_op(RESHAPES, tiles, KeywordArg("blocks")), second_clone)
        patterns.append((_op(RESHAPES, _op(RESHAPES, blocks, KeywordArg("rows32")), KeywordArg("flat")), padded))
    return tuple(patterns)


def match_forward(pattern: PatternExpr, leaf: PatternExpr, node: fx.Node) -> Match | None:
    """`pattern` matched at a node reached forward from `node`, which its `leaf` stands for:
    Inductor's own search for the later outputs of a `MultiOutputPattern`."""
    anchors = pattern.find_anchor_nodes(MatchContext([pattern], {leaf: node}, graph=node.graph), OrderedSet())
    for anchor in list(anchors):
        found = MatchContext([pattern], {leaf: node}, graph=node.graph).match(pattern, anchor)
        if isinstance(found, Match):
            return found
    return None


def scalar_value(arg: Any) -> Any:
    """A scalar literal, or the value of a `scalar_tensor(v)` / 0-d `full([], v)` constant node."""
    if isinstance(arg, (bool, int, float)):
        return arg
    if is_call(arg, aten.scalar_tensor.default):
        return arg.args[0]
    if is_call(arg, aten.full.default) and isinstance(arg.args[0], (list, tuple)) and len(arg.args[0]) == 0:
        return arg.args[1]
    return None
