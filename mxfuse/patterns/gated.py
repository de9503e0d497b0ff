"""Recognizers of the gated producers: the gated attention output here, the gated RMSNorm in
:mod:`.gated_norm`; the refusal codes of both (:class:`GatedCode`) and the helpers they share.

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

Refused (left exactly as they were, with a code, a reason and a fix): a gate that broadcasts
(per-head gates), fp32 activations, a row width not a multiple of 32, the packed (SP
all-gather) form; the gated norm's refusals: :mod:`.gated_norm`.
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
from mxfuse.patterns.fx_utils import call, fake, fake_dtype, is_call, static_int
from mxfuse.patterns.producers import FusedCall, ProducerFamily, fused_op, now
from mxfuse.patterns.results import Reason, RefusalCode, SharedCode

aten, prims = torch.ops.aten, torch.ops.prims
CAST = prims.convert_element_type.default
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


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


# ------------------------------------------------------------------ shared with .gated_norm


def reason_of_dtype(x: fx.Node) -> Reason | None:
    """The refusal of activations of a dtype the fused ops do not take, or None."""
    dtype = fake_dtype(x)
    if dtype not in ACTIVATION_DTYPES:
        return Reason(SharedCode.ACTIVATION_DTYPE, f"its activations are {dtype} (the fused op takes bf16 or fp16)")
    return None


def row_width(node: fx.Node) -> int | None:
    """The static size of `node`'s last dim; None where it is symbolic or unknown."""
    val = fake(node)
    return None if val is None or val.dim() == 0 else static_int(val.shape[-1])


def rows_of(graph: fx.Graph, node: fx.Node, k: int) -> fx.Node:
    """`node` as `[..., k]` rows: itself, or a reshape to `[-1, k]` (inserted at the insert point)."""
    return node if row_width(node) == k else call(graph, aten.reshape.default, (node, [-1, k]))


def is_low(node) -> bool:
    """Whether `node` is a tensor of a 16-bit activation dtype."""
    return fake_dtype(node) in ACTIVATION_DTYPES


def widened(node) -> fx.Node | None:
    """`v` of `convert(v, f32)` with v of a 16-bit dtype."""
    if is_call(node, CAST) and node.args[1] == torch.float32 and is_low(node.args[0]):
        source = node.args[0]
        return source if isinstance(source, fx.Node) else None
    return None


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
        reason = reason_of_dtype(self.x)
        if reason is not None:
            return reason
        k = row_width(self.x)
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


def _rounded_sigmoid(node) -> fx.Node | None:
    """`gate` of a sigmoid whose result is of the model dtype: `sigmoid(gate)` on bf16, or
    `convert(sigmoid(convert(gate, f32)), bf16)`."""
    if is_call(node, aten.sigmoid.default) and is_low(node) and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if is_call(node, CAST) and is_low(node) and is_call(node.args[0], aten.sigmoid.default):
        return widened(node.args[0].args[0])
    return None


def match_gate(y: fx.Node) -> GateMatch | None:
    """The gate whose output `y` is (module docstring), or None."""
    if is_call(y, aten.mul.Tensor) and is_low(y) and len(y.args) == 2:
        for x, s in itertools.permutations(y.args):
            gate = _rounded_sigmoid(s)
            if gate is not None and isinstance(x, fx.Node) and is_low(x):
                found = _gate_match(x, gate, y, round_gate=True)
                if found is not None:
                    return found
    if is_call(y, CAST) and is_low(y) and is_call(y.args[0], aten.mul.Tensor) and len(y.args[0].args) == 2:
        for x32, s in itertools.permutations(y.args[0].args):
            x = widened(x32)
            gate = widened(s.args[0]) if is_call(s, aten.sigmoid.default) else None
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
        op="call_function", target=CAST)]  # fmt: skip
