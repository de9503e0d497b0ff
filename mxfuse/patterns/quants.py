"""Recognizers for MXFP8 activation quantization, behind one :class:`QuantSite` protocol.

Forms: mxfuse's and vLLM's quant ops (:class:`QuantMatch`, one node each) and torchao's
decomposed quant (:class:`~mxfuse.patterns.torchao_quant.TorchaoQuantMatch`, a chain of
ATen nodes). :func:`find_quants` and :func:`quant_users` try every recognizer in
`RECOGNIZERS`; every rewrite and `mxfuse explain` read quants through them, and a rewrite
that cannot take a form refuses it with a code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import fx
from torch._inductor.pattern_matcher import get_arg_value

from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import (
    RESHAPES,
    SQUEEZES,
    VIEW_OPS,
    call,
    fake,
    has_live_users,
    is_call,
    redirect_uses,
    single_getitem,
    vllm_op,
)
from mxfuse.patterns.results import Reason, SharedCode
from mxfuse.patterns.torchao_quant import match_torchao_quant, torchao_heads, torchao_quant_users


class QuantSite(Protocol):
    """An MXFP8 quant in a graph, in the terms a fused op's outputs replace it by.

    form: "mxfuse" | "vllm" | "torchao"; node: the quant's anchor (its op node, or torchao's
    `[M, K/32, 32]` head); x: the quantized activation; reads: the user of `x` the quant reads
    it through; swizzled: it asked for F8_128x4 scales; rule: its NaN / scale-byte-0 encoding;
    codes / scales: the nodes its readers read (None: not read).
    """

    @property
    def form(self) -> str: ...

    @property
    def node(self) -> fx.Node: ...

    @property
    def x(self) -> fx.Node: ...

    @property
    def reads(self) -> fx.Node: ...

    @property
    def swizzled(self) -> bool: ...

    @property
    def rule(self) -> QuantRule: ...

    @property
    def codes(self) -> fx.Node | None: ...  # the node the quant's readers read its codes from

    @property
    def scales(self) -> fx.Node | None: ...

    def replace_outputs(self, graph: fx.Graph, codes: fx.Node, scales: fx.Node) -> None:
        """Point the quant's readers at `codes` (e4m3, the shape of `x`) and `scales` (uint8: `[..., K/32]`
        of x's rows, or `[pad128(M), pad4(K/32)]` when swizzled), with the views and dtypes they expect."""
        ...


@dataclass(frozen=True)
class QuantMatch:
    """An MXFP8 quant node: its input, the scale layout it asked for, its output getitems."""

    form: str  # "mxfuse" or "vllm"
    node: fx.Node
    x: fx.Node
    swizzled: bool
    codes: fx.Node | None
    scales: fx.Node | None
    flat_swizzled_scales: bool = False  # vLLM returns swizzled scales as a 1-D tensor
    rule: QuantRule = QuantRule.DEFAULT  # the NaN / scale-byte-0 encoding the quant uses

    @property
    def reads(self) -> fx.Node:
        """The node through which the quant reads its input (the quant node itself here)."""
        return self.node

    def replace_outputs(self, graph: fx.Graph, codes: fx.Node, scales: fx.Node) -> None:
        if self.scales is not None and self.flat_swizzled_scales:
            with graph.inserting_after(scales):
                scales = call(graph, torch.ops.aten.view.default, (scales, [-1]))
        if self.codes is not None:
            redirect_uses(self.codes, codes)
        if self.scales is not None:
            redirect_uses(self.scales, scales)


def _vllm_quant_op() -> torch._ops.OpOverload | None:
    return vllm_op("mxfp8_quantize")


def match_quant(node: fx.Node) -> QuantMatch | None:
    if is_call(node, torch.ops.mxfuse.mxfp8_quantize.default):
        x, swizzled = get_arg_value(node, 0, "x"), bool(get_arg_value(node, 1, "swizzled"))
        return QuantMatch("mxfuse", node, x, swizzled, single_getitem(node, 0), single_getitem(node, 1))
    vllm_op = _vllm_quant_op()
    if vllm_op is not None and is_call(node, vllm_op):
        x = get_arg_value(node, 0, "x")
        swizzled = bool(get_arg_value(node, 1, "is_sf_swizzled_layout"))
        return QuantMatch(
            "vllm", node, x, swizzled, single_getitem(node, 0), single_getitem(node, 1), flat_swizzled_scales=swizzled
        )
    return None


def quant_reject_reason(quant: QuantSite) -> Reason | None:
    """Why the fused op's outputs cannot replace this quant's (None: they can)."""
    x = fake(quant.x)
    if quant.form != "vllm" or x is None:
        return None
    alignment = get_arg_value(quant.node, 2, "alignment")  # vLLM's op: a QuantMatch
    alignment = 0 if alignment is None else alignment
    if not isinstance(alignment, int) or (alignment > 0 and x.shape[-1] % alignment):
        return Reason(SharedCode.QUANT_UNSUPPORTED, f"vLLM quant pads K={x.shape[-1]} to alignment {alignment}")
    if quant.swizzled and x.dim() != 2:
        return Reason(
            SharedCode.QUANT_UNSUPPORTED,
            "vLLM swizzles the scales of a 3-D input per batch; the fused op tiles all rows",
        )
    return None


def quant_ops() -> list:
    """The quant op overloads this module recognizes (vLLM's only once vLLM registered it)."""
    ops = [torch.ops.mxfuse.mxfp8_quantize.default]
    vllm_op = _vllm_quant_op()
    return ops + ([vllm_op] if vllm_op is not None else [])


RECOGNIZERS = (match_quant, match_torchao_quant)
"""Each anchored at its quant's `node`; a new quant form adds its recognizer here."""


def match_any_quant(node: fx.Node) -> QuantSite | None:
    """The quant of any form anchored at `node`, or None."""
    for recognize in RECOGNIZERS:
        found = recognize(node)
        if found is not None:
            return found
    return None


def find_quants(graph: fx.Graph) -> list[QuantSite]:
    """Every MXFP8 quant of the graph, of every form, in graph order."""
    found = {n for op in quant_ops() for n in graph.find_nodes(op="call_function", target=op)}
    found |= set(torchao_heads(graph))
    quants = (match_any_quant(n) for n in graph.nodes if n in found)
    return [q for q in quants if q is not None]


def _op_quant_users(node: fx.Node) -> list[QuantMatch]:
    found = (match_quant(u) for u in node.users)
    return [q for q in found if q is not None and q.x is node and has_live_users(q.node)]


def quant_users(node: fx.Node) -> list[QuantSite]:
    """The quants of every form that read `node` (torchao's through its own reshapes): op quants
    first, in graph order, then torchao's."""
    return [*_op_quant_users(node), *torchao_quant_users(node)]


# ------------------------------------------------------- through shape-only views


@dataclass(frozen=True)
class ViewedQuant:
    """A quant reading `node` through `views` (node -> views[0] -> ... -> quant.x), all row views."""

    quant: QuantSite
    views: tuple[fx.Node, ...]

    def replace_outputs(self, graph: fx.Graph, codes: fx.Node, scales: fx.Node, k: int) -> None:
        """`quant.replace_outputs` with the views replayed on `codes` and row-major `scales` (of the
        viewed tensor's rows): swizzled scales are 2-D over all rows, no view to replay."""
        with graph.inserting_before(self.quant.node):  # the views' size operands are defined by now
            codes = replay_views(graph, self.views, codes, k)
            if not self.quant.swizzled:
                scales = replay_views(graph, self.views, scales, k // 32)
        self.quant.replace_outputs(graph, codes, scales)


def is_row_view(view: fx.Node) -> bool:
    """A shape-only op that keeps every row `[K]` whole and contiguous, whose args replay on the
    scales `[..., K/32]` with the last size changed (see :func:`replay_views`)."""
    if not is_call(view, *RESHAPES, *SQUEEZES):
        return False
    src, out = fake(view.args[0]), fake(view)
    if src is None or out is None or src.dim() == 0 or out.dim() == 0:
        return False
    k = src.shape[-1]
    if not isinstance(k, int) or out.shape[-1] != k or src.stride(-1) != 1:
        return False
    if view.target in RESHAPES:
        shape = view.args[1]
        return isinstance(shape, (list, tuple)) and len(shape) > 0 and bool(shape[-1] == k)
    dims = view.args[1] if len(view.args) > 1 else ()
    dims = dims if isinstance(dims, (list, tuple)) else (dims,)
    last = (out.dim() if view.target is torch.ops.aten.unsqueeze.default else src.dim()) - 1
    return all(isinstance(d, int) and d % (last + 1) != last for d in dims)


def replay_views(graph: fx.Graph, views: tuple[fx.Node, ...], src: fx.Node, last_size: int) -> fx.Node:
    """Apply the row views `views` to `src` (same rows, last size `last_size`) at the insert point."""
    for view in views:
        rest = list(view.args[1:])
        if view.target in RESHAPES:
            shape = view.args[1]
            assert isinstance(shape, (list, tuple)), "is_row_view admits only reshapes to a list of sizes"
            rest[0] = [*shape[:-1], last_size]
        src = call(graph, view.target, (src, *rest), dict(view.kwargs))
    return src


def quants_through_views(node: fx.Node) -> list[ViewedQuant]:
    """The quants that read `node` directly or through row views: op quants in graph order, then
    torchao's (which read through reshapes of their own)."""
    found: list[ViewedQuant] = []
    work: list[tuple[fx.Node, tuple[fx.Node, ...]]] = [(node, ())]
    while work:
        current, views = work.pop()
        for q in _op_quant_users(current):
            found.append(ViewedQuant(q, views))
        for user in current.users:
            if is_row_view(user):
                work.append((user, (*views, user)))
    found.sort(key=lambda v: v.quant.node)  # FX orders nodes by graph position (kept current on insert)
    return found + [ViewedQuant(q, ()) for q in torchao_quant_users(node)]


def quant_behind_other_view(node: fx.Node) -> fx.Node | None:
    """A view that is not a row view through which a quant reads `node` (None: there is none)."""
    work, seen = [node], set()
    while work:
        current = work.pop()
        for user in current.users:
            if user in seen or not is_call(user, *VIEW_OPS):
                continue
            seen.add(user)
            if not is_row_view(user) and any(match_quant(u) is not None for u in _through_views(user)):
                return user
            work.append(user)
    return None


def _through_views(node: fx.Node) -> list[fx.Node]:
    out, work = [], [node]
    while work:
        current = work.pop()
        out.append(current)
        work += [u for u in current.users if is_call(u, *VIEW_OPS)]
    return [u for n in out for u in n.users]
