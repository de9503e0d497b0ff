"""Recognizer of the gated RMSNorm (`rms(x) * w * act(z)` per head group), and vLLM's FLA kernel of it (refused).

It feeds out_proj's MXFP8 quant in the GDN (linear-attention) layers of Qwen3.5 / Qwen3-Next; its
match implements :class:`~mxfuse.patterns.producers.ProducerMatch`, so rewrite 1 fuses it with
its quant into `mxfuse::gated_rms_norm_mxfp8` (mxfuse/ops/gated.py). The codes and helpers it
shares with the gate are :mod:`.gated`'s.

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

Refused (left exactly as they were, with a :class:`~mxfuse.patterns.gated.GatedCode` or a
shared code, a reason and a fix): groups that are not multiples of 32, a non-constant eps, fp32
activations, the packed (SP all-gather) form, and vLLM's `fla_rms_norm_gated` custom op (its
FLA Triton kernel, chosen only when a user enables the `rms_norm_gated` custom op under
Inductor: its arithmetic is not reproduced).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import fx
from torch.fx.node import Argument

from mxfuse.ops.mx_layout import BLOCK
from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import constant_float, fake, is_call
from mxfuse.patterns.gated import CAST, VIEWS, GatedCode, is_low, reason_of_dtype, row_width, rows_of, widened
from mxfuse.patterns.hf_norm import _normalized
from mxfuse.patterns.producers import FusedCall, ProducerFamily, fused_op, now
from mxfuse.patterns.results import Reason, SharedCode

aten = torch.ops.aten


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
        reason = reason_of_dtype(self.x)
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
            x, z = rows_of(graph, self.x, self.k), rows_of(graph, self.z, self.k)
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
        z = widened(node.args[0])
        return (z, "sigmoid") if z is not None else None
    if not is_call(node, aten.div.Tensor):
        return None
    z32, denominator = node.args
    z = widened(z32)
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
        rounded = is_call(n, CAST) and is_low(n)
        stats = _normalized(n.args[0] if rounded else n) if isinstance(n, fx.Node) else None
        if stats is None or not isinstance(w, fx.Node):
            continue
        weight = w.args[0] if is_call(w, CAST) and w.args[1] == torch.float32 else w
        assert isinstance(weight, fx.Node)
        s32, eps = stats
        return dict(s32=s32, eps=eps, weight=weight, round_normalized=rounded, round_weighted=is_low(node))
    return None


def match_gated_norm(y: fx.Node) -> GatedNormMatch | None:
    """The gated RMSNorm whose row-shaped output `y` is (module docstring), or None.

    `y` is the rounded output itself when the norm's rows are the quant's (one group per row), else
    the first view that merges its groups into the quant's rows (`[T, H, D] -> [T, H * D]`, or
    Hugging Face's `[T * H, D] -> [B, T, H, D] -> [B, T, H * D]`): the rounded output is contiguous,
    so any view keeps consecutive groups consecutive.
    """
    rounded = y
    while is_call(rounded, *VIEWS) and isinstance(rounded.args[0], fx.Node):
        rounded = rounded.args[0]
    if not (is_call(rounded, CAST) and is_low(rounded) and is_call(rounded.args[0], aten.mul.Tensor)):
        return None
    found = _gate_last(rounded.args[0]) or _gate_first(rounded.args[0])
    if found is None:
        return None
    x, z, activation, norm_before_gate, weighted = found
    group = row_width(weighted["s32"])
    if group is None or not _is_output_of(y, rounded, group):
        return None
    k = row_width(y)
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
        if is_call(user, *VIEWS) and user.args[0] is node:
            found += _merging_views(user, group) if row_width(user) == group else [user]
    return found


def _is_output_of(y: fx.Node, rounded: fx.Node, group: int) -> bool:
    """Whether `y` is the canonical output node of the norm rounded at `rounded` (one node per norm)."""
    if y is rounded:
        return not _merging_views(rounded, group)
    if row_width(y) == group:
        return False  # an intermediate view that keeps the groups as rows
    node = y.args[0]
    while node is not rounded:
        if not isinstance(node, fx.Node) or row_width(node) != group:
            return False  # behind another merging view
        node = node.args[0]
    return True


def _gate_last(product: fx.Node):
    """`(n * w) * act(z)` (norm_before_gate)."""
    for a, act in itertools.permutations(product.args):
        gate = _activation(act)
        weighted = _weighted(a) if gate is not None else None
        x = widened(weighted["s32"]) if weighted is not None else None
        if gate is not None and x is not None:
            return x, gate[0], gate[1], True, weighted
    return None


def _gate_first(product: fx.Node):
    """`rms(x * act(z)) * w` (not norm_before_gate): the normalized value's input is `x32 * act(z)`."""
    weighted = _weighted(product)
    if weighted is None or not is_call(weighted["s32"], aten.mul.Tensor):
        return None
    for x32, act in itertools.permutations(weighted["s32"].args):
        gate, x = _activation(act), widened(x32)
        if gate is not None and x is not None:
            return x, gate[0], gate[1], False, weighted
    return None


def gated_norm_candidates(graph: fx.Graph) -> Collection[fx.Node]:
    nodes: list[fx.Node] = []
    for target in (CAST, *VIEWS):
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
    node, view = (y.args[0], y) if is_call(y, *VIEWS) else (y, None)
    if not is_call(node, op.default) or (view is None and any(is_call(u, *VIEWS) for u in node.users)):
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
    return found + [u for n in found for u in n.users if is_call(u, *VIEWS)]
