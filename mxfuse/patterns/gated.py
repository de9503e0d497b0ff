"""Recognizers of the gated producers: the gated attention output and the gated RMSNorm.

Both feed an MXFP8 linear in Qwen3.5 / Qwen3-Next layers; each match implements
:class:`~mxfuse.patterns.producers.ProducerMatch`, so rewrite 1 fuses it with its quant into
`mxfuse::sigmoid_gate_mxfp8` / `gated_rms_norm_mxfp8` (mxfuse/ops/gated.py) like a norm.

**The gate** (`attn_output * torch.sigmoid(gate)` before o_proj: vLLM `qwen3_next.py:466-467`,
Hugging Face `modeling_qwen3_next.py:300`; the post-grad graph keeps it as written)::

    s = aten.sigmoid(gate)              # bf16: the sigmoid rounded (round_gate=True)
    y = aten.mul(x, s)                  # -> [view] -> MXFP8 quant

or with the sigmoid in fp32 (`round_gate=False`, one rounding)::

    y = convert(mul(convert(x, f32), sigmoid(convert(gate, f32))), bf16)

(a `convert(sigmoid(convert(gate, f32)), bf16)` is the rounded sigmoid too).

**The gated RMSNorm** (vLLM's `RMSNormGated.forward_static` in its native form, what vLLM runs
under Inductor; Hugging Face's `Qwen3NextRMSNormGated`), per head: the norm's input is
`[T, H, D]` and the quant reads `view(y, [T, H * D])`, so the fused op normalizes groups of D
of the `[T, H * D]` rows::

    x32 = convert(x, f32); z32 = convert(z, f32)
    n   = x32 * rsqrt(mean(x32 ** 2, -1, keepdim) + eps)
    a   = z32 / (exp(-z32) + 1)                                    # silu, decomposed ("sigmoid": aten.sigmoid)
    y   = convert((n * convert(w, f32)) * a, bf16)                 # vLLM: fp32 throughout
    y   = convert((w * convert(n, bf16)) * a, bf16)                # HF: round_normalized, round_weighted
    -> view(y, [T, H * D]) -> MXFP8 quant

`norm_before_gate=False` (vLLM's other order, `rms(x * act(z)) * w`) is recognized too.

Refused (left exactly as they were, with a code, a reason and a fix): a gate that broadcasts
(per-head gates), groups that are not multiples of 32, a non-constant eps, fp32 activations,
the packed (SP all-gather) form, and vLLM's `fla_rms_norm_gated` custom op (its FLA Triton
kernel, chosen only when a user enables the `rms_norm_gated` custom op under Inductor: its
arithmetic is not reproduced).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import fx
from torch.fx.node import Argument

from mxfuse.ops.library import ACTIVATION_DTYPES
from mxfuse.ops.mx_layout import BLOCK
from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import call, constant_float, fake, fake_dtype, is_call, static_int
from mxfuse.patterns.hf_norm import _normalized
from mxfuse.patterns.producers import FusedCall, ProducerFamily, fused_op, now
from mxfuse.patterns.results import Reason, RefusalCode, SharedCode

aten, prims = torch.ops.aten, torch.ops.prims
_CAST = prims.convert_element_type.default
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


class GatedCode(RefusalCode):
    """Refusals of the gated producers of their own (the shared guards are :class:`SharedCode`), each with its fix."""

    GATE_BROADCAST = (
        "the gate broadcasts against the gated tensor (a per-head gate)",
        "gate elementwise (a gate of the gated tensor's shape), e.g. `gate.expand_as(x).contiguous()`",
    )
    GROUP_SIZE = (
        "the gated norm's groups are not a static multiple of 32 dividing the row",
        "normalize groups of a multiple of 32 values (a head dim of 64, 128, 256)",
    )
    NO_PACKED_FORM = (
        "the gated producers have no packed (SP all-gather) fused op",
        "quantize after the all-gather (sp_gather='bf16')",
    )
    GATED_NORM_KERNEL = (
        "vLLM's FLA Triton kernel of the gated norm, whose arithmetic mxfuse does not reproduce",
        "leave vLLM's RMSNormGated in its native form (custom_ops 'none', vLLM's default under Inductor; "
        "drop '+rms_norm_gated')",
    )


def _reason_of_dtype(x: fx.Node) -> Reason | None:
    dtype = fake_dtype(x)
    if dtype not in ACTIVATION_DTYPES:
        return Reason(SharedCode.ACTIVATION_DTYPE, f"its activations are {dtype} (the fused op takes bf16 or fp16)")
    return None


def _row_width(node: fx.Node) -> int | None:
    val = fake(node)
    return None if val is None or val.dim() == 0 else static_int(val.shape[-1])


def _rows_of(graph: fx.Graph, node: fx.Node, k: int) -> fx.Node:
    """`node` as `[..., k]` rows: itself, or a reshape to `[-1, k]` (inserted at the insert point)."""
    return node if _row_width(node) == k else call(graph, aten.reshape.default, (node, [-1, k]))


# ------------------------------------------------------------------ the gate


@dataclass(frozen=True)
class GateMatch:
    """`y = x * sigmoid(gate)` (elementwise), found in a graph."""

    x: fx.Node
    gate: fx.Node
    y: fx.Node
    round_gate: bool
    form: str = "aten"
    difference: Reason | None = None

    family: ClassVar[ProducerFamily] = ProducerFamily.GATE

    @property
    def kind(self) -> str:
        return f"{self.form}:sigmoid_gate"

    @property
    def anchor(self) -> fx.Node:
        return self.y  # x and gate are defined before y; the fused op goes right before it

    def reject_reason(self, *, packed: bool = False) -> Reason | None:
        if self.difference is not None:
            return self.difference
        if packed:
            return Reason(GatedCode.NO_PACKED_FORM, "the gated attention output has no packed fused op")
        reason = _reason_of_dtype(self.x)
        if reason is not None:
            return reason
        k = _row_width(self.x)
        if k is None or k % BLOCK:
            return Reason(SharedCode.HIDDEN_SIZE, f"its row width {k} is symbolic or not a multiple of {BLOCK}")
        return None

    def moved(self, replaced: Mapping[fx.Node, fx.Node]) -> GateMatch:
        x, gate = now(self.x, replaced), now(self.gate, replaced)
        assert isinstance(x, fx.Node) and isinstance(gate, fx.Node)
        return replace(self, x=x, gate=gate)

    def fused_call(
        self, *, swizzled: bool = False, emit_y: bool = False, rule: QuantRule = QuantRule.DEFAULT, packed: bool = False
    ) -> FusedCall:
        assert not packed, "the gate has no packed fused op (reject_reason refuses it)"
        args: tuple[Argument, ...] = (self.x, self.gate, swizzled, emit_y, int(rule), self.round_gate)
        return FusedCall(fused_op("sigmoid_gate"), args)

    def side_outputs(self) -> dict[str, fx.Node]:
        return {}


def _low(node) -> bool:
    return fake_dtype(node) in ACTIVATION_DTYPES


def _widened(node) -> fx.Node | None:
    """`v` of `convert(v, f32)` with v of a 16-bit dtype."""
    if is_call(node, _CAST) and node.args[1] == torch.float32 and _low(node.args[0]):
        source = node.args[0]
        return source if isinstance(source, fx.Node) else None
    return None


def _rounded_sigmoid(node) -> fx.Node | None:
    """`gate` of a sigmoid whose result is of the model dtype: `sigmoid(gate)` on bf16, or
    `convert(sigmoid(convert(gate, f32)), bf16)`."""
    if is_call(node, aten.sigmoid.default) and _low(node) and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if is_call(node, _CAST) and _low(node) and is_call(node.args[0], aten.sigmoid.default):
        return _widened(node.args[0].args[0])
    return None


def match_gate(y: fx.Node) -> GateMatch | None:
    """The gate whose output `y` is (module docstring), or None."""
    if is_call(y, aten.mul.Tensor) and _low(y) and len(y.args) == 2:
        for x, s in itertools.permutations(y.args):
            gate = _rounded_sigmoid(s)
            if gate is not None and isinstance(x, fx.Node) and _low(x):
                found = _gate_match(x, gate, y, round_gate=True)
                if found is not None:
                    return found
    if is_call(y, _CAST) and _low(y) and is_call(y.args[0], aten.mul.Tensor) and len(y.args[0].args) == 2:
        for x32, s in itertools.permutations(y.args[0].args):
            x = _widened(x32)
            gate = _widened(s.args[0]) if is_call(s, aten.sigmoid.default) else None
            if x is not None and gate is not None:
                found = _gate_match(x, gate, y, round_gate=False)
                if found is not None:
                    return found
    return None


def _reads(node: fx.Node, x: fx.Node, depth: int = 3) -> bool:
    """Whether `node` is `x` or computed from it within `depth` ops (`x * 1.702`, a cast of it)."""
    if node is x:
        return True
    return depth > 0 and any(_reads(arg, x, depth - 1) for arg in node.all_input_nodes)


def _gate_match(x: fx.Node, gate: fx.Node, y: fx.Node, *, round_gate: bool) -> GateMatch | None:
    """The gate `x * sigmoid(gate)`; None where the sigmoid reads `x` itself: `x * sigmoid(alpha * x)` is
    an activation (the GLU of SwiGLU-OAI, a QuickGELU, a SiLU), not a gate, and inside an act·mul."""
    if _reads(gate, x):
        return None
    xv, gv = fake(x), fake(gate)
    difference = None
    if xv is None or gv is None:
        difference = Reason(SharedCode.NO_SHAPES, "no fake tensor on the gate or the gated tensor")
    elif xv.shape != gv.shape or xv.dtype != gv.dtype:
        difference = Reason(
            GatedCode.GATE_BROADCAST,
            f"the gate {tuple(gv.shape)} {gv.dtype} is not of the gated tensor's shape and dtype "
            f"{tuple(xv.shape)} {xv.dtype}",
        )
    return GateMatch(x, gate, y, round_gate, difference=difference)


def gate_candidates(graph: fx.Graph) -> Collection[fx.Node]:
    return [*graph.find_nodes(op="call_function", target=aten.mul.Tensor), *graph.find_nodes(
        op="call_function", target=_CAST)]  # fmt: skip


# ------------------------------------------------------------------ the gated RMSNorm


@dataclass(frozen=True)
class GatedNormMatch:
    """The gated RMSNorm whose (row-shaped) output is `y`, found in a graph.

    `x` / `z` are the norm's inputs as the graph holds them (`[T, H, D]` in vLLM's GDN layer);
    the fused op reads them as rows of `k` values (`[T, H * D]`), groups of `group_size`.
    """

    x: fx.Node
    z: fx.Node
    weight: fx.Node
    eps: float | None
    y: fx.Node
    k: int | None
    group_size: int | None
    norm_before_gate: bool = True
    activation: str = "silu"
    round_normalized: bool = False
    round_weighted: bool = False
    form: str = "aten"
    difference: Reason | None = None

    family: ClassVar[ProducerFamily] = ProducerFamily.GATED_NORM

    @property
    def kind(self) -> str:
        return f"{self.form}:gated_rms_norm"

    @property
    def anchor(self) -> fx.Node:
        return self.y  # every input is defined before y

    def reject_reason(self, *, packed: bool = False) -> Reason | None:
        if self.difference is not None:
            return self.difference
        if packed:
            return Reason(GatedCode.NO_PACKED_FORM, "the gated RMSNorm has no packed fused op")
        reason = _reason_of_dtype(self.x)
        if reason is not None:
            return reason
        xv, zv = fake(self.x), fake(self.z)
        if xv is None or zv is None or zv.shape != xv.shape:
            return Reason(SharedCode.RESIDUAL_MISMATCH, "the gate input z differs from x in shape")
        g, k = self.group_size, self.k
        if g is None or k is None or g % BLOCK or k % g:
            return Reason(GatedCode.GROUP_SIZE, f"it normalizes groups of {g} of rows of {k}")
        if self.eps is None or not self.eps >= 0:
            return Reason(SharedCode.EPS_NOT_CONSTANT, "its eps is not a non-negative graph constant")
        w = fake(self.weight)
        if w is None or w.dim() != 1 or w.shape[0] not in (g, k) or not w.is_floating_point():
            shape = None if w is None else tuple(w.shape)
            return Reason(SharedCode.WEIGHT_SHAPE, f"its weight {shape} is not a floating [{g}] or [{k}] tensor")
        return None

    def moved(self, replaced: Mapping[fx.Node, fx.Node]) -> GatedNormMatch:
        x, z, w = (now(n, replaced) for n in (self.x, self.z, self.weight))
        assert isinstance(x, fx.Node) and isinstance(z, fx.Node) and isinstance(w, fx.Node)
        return replace(self, x=x, z=z, weight=w)

    def fused_call(
        self, *, swizzled: bool = False, emit_y: bool = False, rule: QuantRule = QuantRule.DEFAULT, packed: bool = False
    ) -> FusedCall:
        """The fused call; x and z are read as `[-1, K]` rows (a reshape is inserted before the anchor
        where the graph holds them as `[T, H, D]`)."""
        assert not packed and self.k is not None, "reject_reason refuses these"
        graph = self.anchor.graph
        with graph.inserting_before(self.anchor):
            x, z = _rows_of(graph, self.x, self.k), _rows_of(graph, self.z, self.k)
        args: tuple[Argument, ...] = (x, z, self.weight, self.eps, self.group_size, swizzled, emit_y, int(rule))
        kwargs: dict[str, Argument] = dict(
            norm_before_gate=self.norm_before_gate,
            activation=self.activation,
            round_normalized=self.round_normalized,
            round_weighted=self.round_weighted,
        )
        return FusedCall(fused_op("gated_rms_norm"), args, kwargs)

    def side_outputs(self) -> dict[str, fx.Node]:
        return {}


def _activation(node) -> tuple[fx.Node, str] | None:
    """`(z, activation)` of the fp32 gate activation of a 16-bit z (module docstring)."""
    if is_call(node, aten.sigmoid.default):
        z = _widened(node.args[0])
        return (z, "sigmoid") if z is not None else None
    if not is_call(node, aten.div.Tensor):
        return None
    z32, denominator = node.args
    z = _widened(z32)
    if z is None or not is_call(denominator, aten.add.Tensor, aten.add.Scalar) or len(denominator.args) != 2:
        return None
    for e, one in itertools.permutations(denominator.args):
        negated = e.args[0] if is_call(e, aten.exp.default) else None
        if constant_float(one) == 1.0 and is_call(negated, aten.neg.default) and negated.args[0] is z32:
            return z, "silu"
    return None


def _weighted(node) -> dict | None:
    """`n * w` in either rounding: `{s32, eps, weight, round_normalized, round_weighted}`."""
    if not is_call(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for n, w in itertools.permutations(node.args):
        rounded = is_call(n, _CAST) and _low(n)
        stats = _normalized(n.args[0] if rounded else n) if isinstance(n, fx.Node) else None
        if stats is None or not isinstance(w, fx.Node):
            continue
        weight = w.args[0] if is_call(w, _CAST) and w.args[1] == torch.float32 else w
        assert isinstance(weight, fx.Node)
        s32, eps = stats
        return dict(s32=s32, eps=eps, weight=weight, round_normalized=rounded, round_weighted=_low(node))
    return None


def match_gated_norm(y: fx.Node) -> GatedNormMatch | None:
    """The gated RMSNorm whose row-shaped output `y` is (module docstring), or None.

    `y` is the rounded output itself when the norm's rows are the quant's (one group per row), else
    the first view that merges its groups into the quant's rows (`[T, H, D] -> [T, H * D]`, or
    Hugging Face's `[T * H, D] -> [B, T, H, D] -> [B, T, H * D]`): the rounded output is contiguous,
    so any view keeps consecutive groups consecutive.
    """
    rounded = y
    while is_call(rounded, *_VIEWS) and isinstance(rounded.args[0], fx.Node):
        rounded = rounded.args[0]
    if not (is_call(rounded, _CAST) and _low(rounded) and is_call(rounded.args[0], aten.mul.Tensor)):
        return None
    found = _gate_last(rounded.args[0]) or _gate_first(rounded.args[0])
    if found is None:
        return None
    x, z, activation, norm_before_gate, weighted = found
    group = _row_width(weighted["s32"])
    if group is None or not _is_output_of(y, rounded, group):
        return None
    k = _row_width(y)
    difference = None
    if k is None or k % group or not _contiguous(rounded):
        difference = Reason(GatedCode.GROUP_SIZE, f"its output is read as rows of {k}, not whole groups of {group}")
    return GatedNormMatch(
        x=x,
        z=z,
        weight=weighted["weight"],
        eps=constant_float(weighted["eps"]),
        y=y,
        k=k,
        group_size=group,
        norm_before_gate=norm_before_gate,
        activation=activation,
        round_normalized=weighted["round_normalized"],
        round_weighted=weighted["round_weighted"],
        difference=difference,
    )


def _contiguous(node: fx.Node) -> bool:
    val = fake(node)
    return val is not None and val.is_contiguous()


def _merging_views(node: fx.Node, group: int) -> list[fx.Node]:
    """The first views after `node` (through views that keep rows of `group`) whose rows are not `group`."""
    found = []
    for user in node.users:
        if is_call(user, *_VIEWS) and user.args[0] is node:
            found += _merging_views(user, group) if _row_width(user) == group else [user]
    return found


def _is_output_of(y: fx.Node, rounded: fx.Node, group: int) -> bool:
    """Whether `y` is the canonical output node of the norm rounded at `rounded` (one node per norm)."""
    if y is rounded:
        return not _merging_views(rounded, group)
    if _row_width(y) == group:
        return False  # an intermediate view that keeps the groups as rows
    node = y.args[0]
    while node is not rounded:
        if not isinstance(node, fx.Node) or _row_width(node) != group:
            return False  # behind another merging view
        node = node.args[0]
    return True


def _gate_last(product: fx.Node):
    """`(n * w) * act(z)` (norm_before_gate)."""
    for a, act in itertools.permutations(product.args):
        gate = _activation(act)
        weighted = _weighted(a) if gate is not None else None
        x = _widened(weighted["s32"]) if weighted is not None else None
        if gate is not None and x is not None:
            return x, gate[0], gate[1], True, weighted
    return None


def _gate_first(product: fx.Node):
    """`rms(x * act(z)) * w` (not norm_before_gate): the normalized value's input is `x32 * act(z)`."""
    weighted = _weighted(product)
    if weighted is None or not is_call(weighted["s32"], aten.mul.Tensor):
        return None
    for x32, act in itertools.permutations(weighted["s32"].args):
        gate, x = _activation(act), _widened(x32)
        if gate is not None and x is not None:
            return x, gate[0], gate[1], False, weighted
    return None


def gated_norm_candidates(graph: fx.Graph) -> Collection[fx.Node]:
    nodes: list[fx.Node] = []
    for target in (_CAST, *_VIEWS):
        nodes += graph.find_nodes(op="call_function", target=target)
    return nodes


# ------------------------------------------------------------------ vLLM's FLA kernel (refused)


@dataclass(frozen=True)
class FlaGatedNormMatch(GatedNormMatch):
    """vLLM's `fla_rms_norm_gated` custom op (recognized so that it is named, never fused)."""


def match_fla_gated_norm(y: fx.Node) -> GatedNormMatch | None:
    """`vllm.fla_rms_norm_gated(x, z, w, eps, group_size, norm_before_gate, activation)` (or its flattening view)."""
    op = getattr(getattr(torch.ops, "vllm", None), "fla_rms_norm_gated", None)
    if op is None:
        return None
    node, view = (y.args[0], y) if is_call(y, *_VIEWS) else (y, None)
    if not is_call(node, op.default) or (view is None and any(is_call(u, *_VIEWS) for u in node.users)):
        return None
    x, z, w = node.args[:3]
    assert isinstance(x, fx.Node) and isinstance(z, fx.Node) and isinstance(w, fx.Node)
    text = (
        "vLLM runs its gated norm as the FLA Triton kernel `vllm.fla_rms_norm_gated` (layernorm_guard.py), "
        "whose reduction and rounding mxfuse does not reproduce"
    )
    return FlaGatedNormMatch(
        x, z, w, constant_float(node.args[3]), y, None, None, form="vllm_fla",
        difference=Reason(GatedCode.GATED_NORM_KERNEL, text),
    )  # fmt: skip


def fla_candidates(graph: fx.Graph) -> Collection[fx.Node]:
    op = getattr(getattr(torch.ops, "vllm", None), "fla_rms_norm_gated", None)
    if op is None:
        return []
    found = list(graph.find_nodes(op="call_function", target=op.default))
    return found + [u for n in found for u in n.users if is_call(u, *_VIEWS)]
