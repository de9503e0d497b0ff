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
default encoding: :attr:`QuantRule.TORCHAO`. :func:`match_torchao_quant` checks every node and constant of the
chain (reshape sizes only through fake shapes: any K, dynamic M);
:meth:`TorchaoQuantMatch.replace_outputs` rewires its readers to a fused op, leaving it dead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, FP8_MAX, SWIZZLE_COLUMN_TILE, padded_rows, round_up
from mxfuse.ops.reference import E8M0_NAN, QuantRule
from mxfuse.patterns.fx_utils import call, fake, is_call, redirect_uses, static_int

aten, prims = torch.ops.aten, torch.ops.prims
FORM = "torchao"
_PTX_RCEIL = "cvt.rp.satfinite.ue8m0x2.f32"
_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


class ScaleSpelling(enum.Enum):
    """How the matched chain computes the E8M0 byte (same bits for a bf16 amax)."""

    LOG2 = "log2"  # torch.ceil(torch.log2(descale)) with where() for NaN / Inf
    PTX = "ptx"  # inline_asm_elementwise("cvt.rp.satfinite.ue8m0x2.f32"), torchao on sm100


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
        k = fake(self.codes).shape[-1]
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
    if not is_call(head, *_VIEWS) or h is None or h.dtype != torch.bfloat16 or h.dim() < 2:
        return None  # bf16 only: for fp32 input torchao's float log2 is not the exact ceiling
    if static_int(h.shape[-1]) != BLOCK:
        return None
    descale = _descale(head)
    h32 = _only_user(head, prims.convert_element_type.default, check=lambda n: n.args[1] == torch.float32)
    if descale is None or h32 is None:
        return None
    multiplier = _only_user(descale, aten.where.self, check=lambda n: n.args[1] is descale)
    exponent = _multiplier_exponent(multiplier)
    spelling = _exponent_spelling(exponent, descale)
    if spelling is None:
        return None
    codes = _codes(h32, multiplier, head)
    scales = _row_scales(exponent, head)
    if codes is None or scales is None:
        return None
    blocked = _to_blocked(scales)
    x, reads = _before_views(head, h.shape[-2] * BLOCK)
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
    return [n for op in _VIEWS for n in graph.find_nodes(op="call_function", target=op)]


def torchao_quant_users(node: fx.Node) -> list[TorchaoQuantMatch]:
    """The torchao quants that read `node` (through reshapes of its rows), in graph order."""
    found, work = [], [node]
    while work:
        for user in work.pop().users:
            match = match_torchao_quant(user)
            if match is not None:
                found.append(match)
            elif is_call(user, *_VIEWS):
                work.append(user)
    return sorted((m for m in found if m.x is node), key=lambda m: m.node)  # FX orders nodes by graph position


# --------------------------------------------------------------------------- the chain


def _descale(head: fx.Node) -> fx.Node | None:
    """`div(convert(unsqueeze(amax(abs(head), [-1]), -1), f32), 448.0)`."""
    node = _only_user(head, aten.abs.default)
    node = _only_user(node, aten.amax.default, check=lambda n: len(n.args) == 2 and _is_last_dim(n.args[1], head))
    node = _only_user(node, aten.unsqueeze.default, check=lambda n: _is_last_dim([n.args[1]], head))
    node = _only_user(node, prims.convert_element_type.default, check=lambda n: n.args[1] == torch.float32)
    return _only_user(node, aten.div.Tensor, check=lambda n: _value(n.args[1]) == FP8_MAX)


def _multiplier_exponent(multiplier: fx.Node | None) -> fx.Node | None:
    """The E8M0 byte `e` of `where(e == 255, d, where(e == 254, 2**-127, where(e == 0, 1.0, exp2(127 - f32(e)))))`."""
    if multiplier is None:
        return None
    exponent = _eq_operand(multiplier.args[0], E8M0_NAN)
    inf = multiplier.args[2]
    if exponent is None or not is_call(inf, aten.where.self) or _eq_operand(inf.args[0], 254) is not exponent:
        return None
    if _value(inf.args[1]) != 2.0**-127:
        return None
    zero = inf.args[2]
    if (
        not is_call(zero, aten.where.self)
        or _eq_operand(zero.args[0], 0) is not exponent
        or _value(zero.args[1]) != 1.0
    ):
        return None
    exp2 = zero.args[2]
    if not is_call(exp2, aten.exp2.default) or not is_call(exp2.args[0], aten.sub.Tensor):
        return None
    minuend, e32 = exp2.args[0].args
    if _value(minuend) != 127 or not _is_convert(e32, torch.float32) or e32.args[0] is not exponent:
        return None
    return exponent


def _exponent_spelling(exponent: fx.Node | None, descale: fx.Node) -> ScaleSpelling | None:
    if exponent is not None and _is_log2_rceil(exponent, descale):
        return ScaleSpelling.LOG2
    if _is_convert(exponent, torch.uint8) and _is_ptx_rceil(exponent.args[0], descale):
        return ScaleSpelling.PTX
    return None


def _is_log2_rceil(exponent: fx.Node, descale: fx.Node) -> bool:
    """`where(isnan(d), 255, where(isinf(d), 254, u8(clamp(ceil(log2(d)), -127, 127) + 127)))`."""
    if not (is_call(exponent, aten.where.self) and _is_unary(exponent.args[0], aten.isnan.default, descale)):
        return False
    inner = exponent.args[2]
    if _value(exponent.args[1]) != E8M0_NAN or not is_call(inner, aten.where.self):
        return False
    if not _is_unary(inner.args[0], aten.isinf.default, descale) or _value(inner.args[1]) != 254:
        return False
    node = inner.args[2]
    if not _is_convert(node, torch.uint8) or not is_call(node.args[0], aten.add.Tensor):
        return False
    node, bias = node.args[0].args
    if _value(bias) != 127:
        return False
    node = _clamped(node, -127, 127)
    if not is_call(node, aten.ceil.default):
        return False
    return _is_unary(node.args[0], aten.log2.default, descale)


def _is_ptx_rceil(node, descale: fx.Node) -> bool:
    """`inline_asm_elementwise(d, asm_str="cvt.rp.satfinite.ue8m0x2.f32 $0, 0.0, $1;", dtype=uint16)`."""
    try:
        from torch._higher_order_ops.inline_asm_elementwise import inline_asm_elementwise as hop
    except ImportError:  # torch < 2.12 has no inline asm, and torchao then never emits it
        return False
    if not is_call(node, hop) or tuple(node.args) != (descale,):
        return False
    asm = node.kwargs.get("asm_str", "")
    return asm.split()[:1] == [_PTX_RCEIL] and "0.0" in asm and node.kwargs.get("dtype") == torch.uint16


def _codes(h32: fx.Node, multiplier: fx.Node, head: fx.Node) -> fx.Node | None:
    """`reshape(e4m3(clamp(mul(f32(head), r), -448, 448)), [M, K])`."""
    node = _only_user(h32, aten.mul.Tensor, check=lambda n: tuple(n.args) == (h32, multiplier))
    node = _clamp_users(node, -FP8_MAX, FP8_MAX)
    node = _only_user(node, prims.convert_element_type.default, check=lambda n: n.args[1] == FP8_DTYPE)
    node = _only_user(node, *_VIEWS)
    return node if _shape_is(node, fake(head.args[0]).shape) else None


def _row_scales(exponent: fx.Node, head: fx.Node) -> fx.Node | None:
    """`squeeze(view.dtype(e, e8m0fnu), -1)` (an `alias` in between is allowed)."""
    node = _only_user(exponent, aten.view.dtype, check=lambda n: n.args[1] == torch.float8_e8m0fnu)
    while _only_user(node, aten.alias.default) is not None:
        node = _only_user(node, aten.alias.default)
    return _only_user(node, aten.squeeze.dim, check=lambda n: _is_last_dim([n.args[1]], head))


def _to_blocked(scales: fx.Node) -> fx.Node | None:
    """torchao's `to_blocked(scales)` as compiled: the flat blocked node, or None when the
    scales are read row-major.

    `to_blocked` zero-pads to `[pad128(M), pad4(S)]` (`padded[:M, :S] = scales`), views
    `[R/128, 128, C/4, 4]`, permutes (0, 2, 1, 3), views `[-1, 4, 32, 4]`, swaps dims 1 and
    2, views `[-1, 32, 16]` and flattens. Inductor drops the padding writes that cover a
    whole dim and adds a `clone` after a permute where it likes; both are accepted.
    """
    node = _zero_padded(scales)
    swap_1_2 = (aten.permute.default,), lambda n: list(n.args[1]) == [0, 2, 1, 3]
    steps = (
        (_VIEWS, lambda n: _dims(n, {1: 128, 3: 4}, rank=4)),
        swap_1_2,
        (_VIEWS, lambda n: _dims(n, {1: 4, 2: 32, 3: 4}, rank=4)),
        swap_1_2,
        (_VIEWS, lambda n: _dims(n, {1: 32, 2: 16}, rank=3)),
        (_VIEWS, lambda n: _dims(n, {}, rank=1)),
    )
    for targets, check in steps:
        node = _skip_clones(node)
        node = _only_user(node, *targets, check=check)
        if node is None:
            return None
    return node


def _zero_padded(scales: fx.Node) -> fx.Node | None:
    """The node holding `scales` (`[M, S]`) zero-padded to `[pad128(M), pad4(S)]`.

    Compiled `padded = zeros(...); padded[:M, :S] = scales` is a `full(0)` and writes at
    offset 0 into it (copy into slices of it, slice_scatters); a write that covers a
    whole dim is dropped by Inductor, and with nothing to pad the scales are the result.
    """
    m, n = fake(scales).shape
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
        return _shape_is(user.args[0], fake(value).shape) and _root_of(user.args[0]) is not None
    if is_call(user, aten.slice_scatter.default) and user.args[1] is value:
        dim, start = user.args[2] if len(user.args) > 2 else 0, user.args[3] if len(user.args) > 3 else None
        return dim in (0, 1) and start in (0, None) and _root_of(user.args[0]) is not None
    return False


def _root_of(node) -> fx.Node | None:
    """The `full(..., 0)` under slices at offset 0 (so `node` is all zeros), else None."""
    while is_call(node, aten.slice.Tensor):
        start, step = node.args[2:3] or (0,), node.args[4:5] or (1,)
        if start[0] not in (0, None) or step[0] != 1:
            return None
        node = node.args[0]
    return node if is_call(node, aten.full.default) and _value(node.args[1]) == 0 else None


def _skip_clones(node: fx.Node | None) -> fx.Node | None:
    while _only_user(node, aten.clone.default) is not None and len(node.users) == 1:
        node = _only_user(node, aten.clone.default)
    return node


# --------------------------------------------------------------------------- small helpers


def _only_user(node, *targets, check=None) -> fx.Node | None:
    """The single user of `node` among calls of `targets` (passing `check`), else None."""
    if not isinstance(node, fx.Node):
        return None
    found = [u for u in node.users if is_call(u, *targets) and (check is None or check(u))]
    return found[0] if len(found) == 1 else None


def _dims(node: fx.Node, expected: dict, rank: int) -> bool:
    """`node`'s fake value has `rank` dims and the `expected` {dim: size}."""
    value = fake(node)
    if value is None or value.dim() != rank:
        return False
    return all(statically_known_true(value.shape[i] == size) for i, size in expected.items())


def _value(arg):
    """A scalar literal, or the value of a `scalar_tensor(v)` / 0-d `full([], v)` constant node."""
    if isinstance(arg, (bool, int, float)):
        return arg
    if is_call(arg, aten.scalar_tensor.default):
        return arg.args[0]
    if is_call(arg, aten.full.default) and list(arg.args[0]) == []:
        return arg.args[1]
    return None


def _eq_operand(node, value) -> fx.Node | None:
    """`x` of `eq(x, value)`."""
    if is_call(node, aten.eq.Scalar) and _value(node.args[1]) == value:
        return node.args[0]
    return None


def _is_unary(node, target, operand) -> bool:
    return is_call(node, target) and tuple(node.args) == (operand,)


def _is_convert(node, dtype) -> bool:
    return is_call(node, prims.convert_element_type.default) and node.args[1] == dtype


def _clamped(node, low, high):
    """`x` of `clamp_max(clamp_min(x, low), high)` or `clamp(x, low, high)`; None otherwise."""
    if is_call(node, aten.clamp.default) and _value(node.args[1]) == low and _value(node.args[2]) == high:
        return node.args[0]
    if is_call(node, aten.clamp_max.default) and _value(node.args[1]) == high:
        inner = node.args[0]
        if is_call(inner, aten.clamp_min.default) and _value(inner.args[1]) == low:
            return inner.args[0]
    return None


def _clamp_users(node, low, high):
    """The end of `clamp_max(clamp_min(node, low), high)` (or one `clamp`) among node's users."""
    one = _only_user(node, aten.clamp.default)
    if one is not None and _clamped(one, low, high) is node:
        return one
    high_node = _only_user(_only_user(node, aten.clamp_min.default), aten.clamp_max.default)
    return high_node if high_node is not None and _clamped(high_node, low, high) is node else None


def _is_last_dim(dims, head: fx.Node) -> bool:
    rank = fake(head).dim()
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _shape_is(node, shape) -> bool:
    """`node`'s fake value has `shape` (dims may be symbolic)."""
    value = fake(node)
    return (
        value is not None
        and value.dim() == len(shape)
        and all(statically_known_true(a == b) for a, b in zip(value.shape, shape))
    )


def _before_views(head: fx.Node, k: int) -> tuple[fx.Node, fx.Node]:
    """`(x, reads)`: walking back from the head through reshapes that keep the rows (last dim
    K), the tensor the rows come from and its user on the way to the head."""
    reads, node = head, head.args[0]
    while is_call(node, *_VIEWS) and isinstance(node.args[0], fx.Node):
        src = fake(node.args[0])
        if src is None or src.dim() < 1 or not statically_known_true(src.shape[-1] == k):
            break
        reads, node = node, node.args[0]
    return node, reads


__all__ = ["ScaleSpelling", "TorchaoQuantMatch", "match_torchao_quant", "torchao_quant_users"]
