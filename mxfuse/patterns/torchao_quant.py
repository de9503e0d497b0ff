"""Recognizer for torchao's MXFP8 activation quantization, decomposed in a post-grad graph.

`quantize_(model, MXDynamicActivationMXWeightConfig(...))` (torchao 0.18,
`prototype/mx_formats`) quantizes each linear's input with `to_mx(..., RCEIL)`. Under
`torch.compile` that is not one op but ~35 ATen nodes (read off torch 2.14's post-grad
graph; `y` is the bf16 activation `[..., K]`, `S = K/32`)::

    h  = reshape(reshape(y, [M, K]), [M, S, 32])                      # the head
    d  = div(convert(unsqueeze(amax(abs(h), [-1]), -1), f32), 448.0)  # descale; amax in bf16: NaN propagates
    e  = where(isnan(d), 255, where(isinf(d), 254,                    # E8M0 byte, spelling "log2"
             convert(add(clamp_max(clamp_min(ceil(log2(d)), -127), 127), 127), u8)))
    e  = convert(inline_asm_elementwise(d, "cvt.rp.satfinite.ue8m0x2.f32 ..."), u8)   # spelling "ptx" (sm100)
    r  = where(e == 255, d, where(e == 254, 2**-127, where(e == 0, 1.0, exp2(127 - convert(e, f32)))))
    codes  = reshape(convert(clamp_max(clamp_min(mul(convert(h, f32), r), -448), 448), e4m3fn), [M, K])
    scales = squeeze(view.dtype(e, e8m0fnu), -1)                      # [M, S]
    scales = reshape(...to_blocked(scales)..., [pad128(M) * pad4(S)]) # where the GEMM (AUTO) swizzles

EMULATED dequantizes `codes` and the row-major `scales`; AUTO feeds `_scaled_mm` the flat
blocked (F8_128x4) scales. For a bf16 amax both spellings give the exact `ceil(log2(amax /
448))` of docs/design.md ("The E8M0 scale of a block"); NaN and scale byte 0 differ from the
default encoding: :attr:`QuantRule.TORCHAO`.

The chain is declared as Inductor pattern trees in :mod:`.torchao_patterns` (head -> codes
and scales, the two spellings of `e`, the descale, `to_blocked`); this module matches them
and checks the sizes through fake shapes after the match (any K, dynamic M). Two steps stay
hand-walked because Inductor's rewriting leaves them no fixed shape: the zero padding
before `to_blocked` (which of its `copy` / `slice_scatter` writes survive depends on
whether M and S are already multiples of 128 and 4: :func:`_zero_padded`) and the
reshapes between `y` and the head (any number of them: :func:`_before_views`).
:meth:`TorchaoQuantMatch.replace_outputs` rewires the chain's readers to a fused op,
leaving it dead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._inductor.pattern_matcher import Match
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxfuse.ops.mx_layout import BLOCK, SWIZZLE_COLUMN_TILE, padded_rows, round_up
from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import RESHAPES, call, fake, is_call, known_fake, redirect_uses, static_int
from mxfuse.patterns.torchao_patterns import (
    ScaleSpelling,
    blocked_patterns,
    descale_pattern,
    exponent_patterns,
    match_forward,
    quant_patterns,
    scalar_value,
)

aten = torch.ops.aten
FORM = "torchao"
_PTX_RCEIL = "cvt.rp.satfinite.ue8m0x2.f32"


@dataclass(frozen=True)
class TorchaoQuantMatch:
    """torchao's decomposed MXFP8 quant of `x`: what a fused norm+quant op must stand in for.

    A :class:`mxfuse.patterns.quants.QuantSite`; `codes` / `scales` are torchao's nodes
    (`[M, K]` e4m3, and `[M, K/32]` e8m0fnu or the flat blocked e8m0fnu), replaced by
    :meth:`replace_outputs`.
    """

    node: fx.Node  # the `[M, K/32, 32]` head of the chain (the chain is live while it is)
    x: fx.Node  # the quantized activation, before the reshapes (e.g. the norm's y)
    reads: fx.Node  # the user of x the chain reads it through (a reshape, or the head itself)
    swizzled: bool  # the scales go through to_blocked (F8_128x4) before their reader
    codes: fx.Node
    scales: fx.Node
    spelling: ScaleSpelling
    rule: QuantRule = QuantRule.TORCHAO
    form: str = FORM

    @property
    def kind(self) -> str:
        return f"{FORM}_quant({self.spelling.value})"

    def replace_outputs(self, graph: fx.Graph, codes: fx.Node, scales: fx.Node) -> None:
        """Point the users of torchao's codes and scales at a fused op's `codes` (e4m3, shape
        of x) and `scales` (uint8: `[..., K/32]`, or `[pad128(M), pad4(K/32)]` if swizzled).

        Inserts the views torchao's readers expect (`[M, K]`; e8m0fnu, flat when blocked)
        just before the old nodes; the decomposed chain is left without users.
        """
        k = known_fake(self.codes).shape[-1]
        with graph.inserting_before(self.codes):
            new_codes = call(graph, aten.reshape.default, (codes, [-1, k]))
        with graph.inserting_before(self.scales):
            shape = [-1] if self.swizzled else [-1, k // BLOCK]
            flat = call(graph, aten.reshape.default, (scales, shape))
            new_scales = call(graph, aten.view.dtype, (flat, torch.float8_e8m0fnu))
        redirect_uses(self.codes, new_codes)
        redirect_uses(self.scales, new_scales)


def match_torchao_quant(head: fx.Node) -> TorchaoQuantMatch | None:
    """The torchao MXFP8 (e4m3, RCEIL, block 32) quant whose `[M, K/32, 32]` reshape is `head`."""
    h = fake(head)
    if not is_call(head, *RESHAPES) or h is None or h.dtype != torch.bfloat16 or h.dim() < 2:
        return None  # bf16 only: for fp32 input torchao's float log2 is not the exact ceiling
    if static_int(h.shape[-1]) != BLOCK:
        return None
    found = _match_chain(head)
    if found is None:
        return None
    _, codes, scales = found.output_nodes()
    assert codes is not None and scales is not None  # every output of the pattern matched
    spelling = _exponent_spelling(found.kwargs["exponent"], found.kwargs["descale"])
    if spelling is None:
        return None
    blocked = _to_blocked(scales)
    walked = _before_views(head, h.shape[-2] * BLOCK)
    if walked is None:
        return None
    x, reads = walked
    return TorchaoQuantMatch(
        node=head,
        x=x,
        reads=reads,
        swizzled=blocked is not None,
        codes=codes,
        scales=blocked if blocked is not None else scales,
        spelling=spelling,
    )


def torchao_heads(graph: fx.Graph) -> list[fx.Node]:
    """The nodes a torchao quant can be anchored at (its `[M, K/32, 32]` reshape), unordered."""
    return [n for op in RESHAPES for n in graph.find_nodes(op="call_function", target=op)]


def torchao_quant_users(node: fx.Node) -> list[TorchaoQuantMatch]:
    """The torchao quants that read `node` (through reshapes of its rows), in graph order."""
    found, work = [], [node]
    while work:
        for user in work.pop().users:
            match = match_torchao_quant(user)
            if match is not None:
                found.append(match)
            elif is_call(user, *RESHAPES):
                work.append(user)
    return sorted((m for m in found if m.x is node), key=lambda m: m.node)  # FX orders nodes by graph position


# --------------------------------------------------------------------------- the guards


def _match_chain(head: fx.Node) -> Match | None:
    """The first spelling of :func:`_quant_patterns` that matches at `head` and passes the guards."""
    for pattern in quant_patterns():
        found = pattern.match(head)
        if isinstance(found, Match) and _is_rows_quant(found, head):
            return found
    return None


def _is_rows_quant(found: Match, head: fx.Node) -> bool:
    """The matched chain quantizes `head`'s rows of 32, its codes have the shape of the rows
    before the head, and its descale is `amax / 448` of `head` over its last dim."""
    codes, rows = found.output_nodes()[1], fake(found.kwargs["rows"])
    descale = descale_pattern().match(found.kwargs["descale"])
    return (
        isinstance(descale, Match)
        and descale.kwargs["head"] is head
        and _is_last_dim(descale.kwargs["amax_dims"], head)
        and _is_last_dim([descale.kwargs["unsqueeze_dim"]], head)
        and _is_last_dim([found.kwargs["squeeze_dim"]], head)
        and rows is not None
        and _shape_is(codes, rows.shape)
    )


def _exponent_spelling(exponent: fx.Node, descale: fx.Node) -> ScaleSpelling | None:
    for spelling, pattern in exponent_patterns():
        found = pattern.match(exponent)
        if not isinstance(found, Match) or found.kwargs["descale"] is not descale:
            continue
        if spelling is ScaleSpelling.PTX:
            asm = found.kwargs["asm"]
            if not isinstance(asm, str) or asm.split()[:1] != [_PTX_RCEIL] or "0.0" not in asm:
                continue
        return spelling
    return None


def _to_blocked(scales: fx.Node) -> fx.Node | None:
    """torchao's `to_blocked(scales)` as compiled: the flat blocked node, or None when the
    scales are read row-major (`to_blocked` zero-pads to `[pad128(M), pad4(S)]` first)."""
    padded = _zero_padded(scales)
    if padded is None:
        return None
    for pattern, leaf in blocked_patterns():
        found = match_forward(pattern, leaf, padded)
        if found is not None and _is_blocked(found):
            return found.output_node()
    return None


def _is_blocked(found: Match) -> bool:
    """The four views of a match of :func:`_blocked_patterns` have to_blocked's sizes."""
    views = [n for n in found.nodes if is_call(n, *RESHAPES)]
    sizes: tuple[tuple[dict[int, int], int], ...] = (
        ({1: 128, 3: 4}, 4),
        ({1: 4, 2: 32, 3: 4}, 4),
        ({1: 32, 2: 16}, 3),
        ({}, 1),
    )
    return len(views) == 4 and all(any(_dims(v, dims, rank) for v in views) for dims, rank in sizes)


# --------------------------------------------------------------------------- hand walks and small helpers


def _zero_padded(scales: fx.Node) -> fx.Node | None:
    """The node holding `scales` (`[M, S]`) zero-padded to `[pad128(M), pad4(S)]`.

    Compiled `padded = zeros(...); padded[:M, :S] = scales` is a `full(0)` and writes at
    offset 0 into it (copy into slices of it, slice_scatters); a write that covers a
    whole dim is dropped by Inductor, and with nothing to pad the scales are the result.
    """
    scales_val = fake(scales)
    if scales_val is None:
        return None
    m, n = scales_val.shape
    padded_shape = (padded_rows(m), round_up(n, SWIZZLE_COLUMN_TILE))
    node = scales
    for _ in range(4):  # copy, slice_scatter (columns), slice_scatter (rows)
        if _shape_is(node, padded_shape):
            return node  # the scales themselves, or zeros with the scales written at the origin
        writes = [u for u in node.users if _writes_at_origin(u, node)]
        if len(writes) != 1 or len(node.users) != 1:
            return None
        node = writes[0]
    return None


def _writes_at_origin(user: fx.Node, value: fx.Node) -> bool:
    """`user` writes `value` at offset 0 of a slice of a `full(0)`: `copy(slice..(full), value)`
    or `slice_scatter(base, value, dim, 0, end)` with base a `full(0)` or a slice of one."""
    if is_call(user, aten.copy.default) and user.args[1] is value:  # no broadcast: same shape
        value_val = fake(value)
        return value_val is not None and _shape_is(user.args[0], value_val.shape) and _root_of(user.args[0]) is not None
    if is_call(user, aten.slice_scatter.default) and user.args[1] is value:
        dim, start = user.args[2] if len(user.args) > 2 else 0, user.args[3] if len(user.args) > 3 else None
        return dim in (0, 1) and start in (0, None) and _root_of(user.args[0]) is not None
    return False


def _root_of(node: Any) -> fx.Node | None:
    """The `full(..., 0)` under slices at offset 0 (so `node` is all zeros), else None."""
    while is_call(node, aten.slice.Tensor):
        start, step = node.args[2:3] or (0,), node.args[4:5] or (1,)
        if start[0] not in (0, None) or step[0] != 1:
            return None
        node = node.args[0]
    return node if is_call(node, aten.full.default) and scalar_value(node.args[1]) == 0 else None


def _dims(node: fx.Node, expected: dict[int, int], rank: int) -> bool:
    """`node`'s fake value has `rank` dims and the `expected` {dim: size}."""
    value = fake(node)
    if value is None or value.dim() != rank:
        return False
    return all(statically_known_true(value.shape[i] == size) for i, size in expected.items())


def _is_last_dim(dims: Any, head: fx.Node) -> bool:
    head_val = fake(head)
    if head_val is None:
        return False
    rank = head_val.dim()
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _shape_is(node: Any, shape: Any) -> bool:
    """`node`'s fake value has `shape` (dims may be symbolic)."""
    value = fake(node)
    return (
        value is not None
        and value.dim() == len(shape)
        and all(statically_known_true(a == b) for a, b in zip(value.shape, shape))
    )


def _before_views(head: fx.Node, k: int) -> tuple[fx.Node, fx.Node] | None:
    """`(x, reads)`: walking back from the head through reshapes that keep the rows (last dim
    K), the tensor the rows come from and its user on the way to the head; None when the
    head reshapes no node."""
    reads, node = head, head.args[0]
    if not isinstance(node, fx.Node):
        return None
    while is_call(node, *RESHAPES) and isinstance(node.args[0], fx.Node):
        src = fake(node.args[0])
        if src is None or src.dim() < 1 or not statically_known_true(src.shape[-1] == k):
            break
        reads, node = node, node.args[0]
    return node, reads


__all__ = ["ScaleSpelling", "TorchaoQuantMatch", "match_torchao_quant", "torchao_quant_users"]
