"""The producer of an MXFP8 activation, as rewrite 1 and rewrite 2 see it: the contract and the table.

A *producer* is the computation whose output `y` an MXFP8 quant reads: a norm today
(:mod:`.norms`), an activation times the up projection (`act(gate) * up`), a gate
(`x * sigmoid(g)`), a gated norm (`rms(x) * w * silu(z)`) next. Each kind of producer
has a recognizer module returning a match that implements :class:`ProducerMatch`; the
rewrites never look inside it. They ask it

- for its guards (:meth:`ProducerMatch.reject_reason`: why the fused op cannot stand in),
- for the fused op that replaces it and the quant (:meth:`ProducerMatch.fused_call`, one
  row of :data:`FUSED_OPS`),
- for the outputs besides `y` that the fused op's outputs replace
  (:meth:`ProducerMatch.side_outputs`, e.g. a norm's `residual_out`),

and :func:`insert_fused` does the graph edit for every producer. The registry of
recognizers is :mod:`.producer_registry` (it imports the recognizer modules, which import
this one).

A new producer lands as: its recognizer module (a match class implementing the protocol),
its reference and kernel prologue under `mxfuse/ops/`, one row of :data:`FUSED_OPS`, one
entry of `producer_registry.PRODUCER_RECOGNIZERS`, and its tests.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, Self, runtime_checkable

import torch
from torch import fx
from torch.fx.node import Argument

from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import call, getitem, redirect_uses
from mxfuse.patterns.results import Reason

QUANT_OUTPUTS = frozenset({"codes", "scales", "packed"})
"""The fused op's outputs that replace the quant's (always taken); the others are the producer's."""


class ProducerFamily(enum.Enum):
    """What a producer computes (the report's and `explain`'s grouping of producer kinds)."""

    NORM = "norm"  # RMSNorm, Gemma's `1 + w` or the standard `w`, with or without a residual add
    ACT_MUL = "act_mul"  # `act(gate) * up` before down_proj: SiLU, GELU-tanh, clamped SwiGLU
    GATE = "gate"  # `x * sigmoid(g)`: the gated attention output
    GATED_NORM = "gated_norm"  # `rms(x) * w * silu(z)`: the gated RMSNorm of linear-attention layers


@dataclass(frozen=True)
class FusedOp:
    """A fused producer+quant op, `torch.ops.mxfuse.<name>`, and the names of its outputs in order.

    Output names: "codes" and "scales" (or "packed": one `[M, K + K/32]` byte buffer of both),
    then the producer's own ("residual_out", ...), then "y" (empty unless `emit_y`).
    """

    name: str
    outputs: tuple[str, ...]

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.mxfuse, self.name).default

    @property
    def packed(self) -> bool:
        return "packed" in self.outputs


_QUANT = ("codes", "scales")
_PACKED = ("packed",)
_RES = ("residual_out",)

FUSED_OPS: dict[tuple[str, bool, bool], FusedOp] = {
    # (producer op, with residual, packed) -> the fused op; layout and rule are arguments of the ops
    ("gemma_rmsnorm", False, False): FusedOp("gemma_rmsnorm_mxfp8", (*_QUANT, "y")),
    ("gemma_rmsnorm", True, False): FusedOp("gemma_fused_add_rmsnorm_mxfp8", (*_QUANT, *_RES, "y")),
    ("gemma_rmsnorm", False, True): FusedOp("gemma_rmsnorm_mxfp8_packed", (*_PACKED, "y")),
    ("gemma_rmsnorm", True, True): FusedOp("gemma_fused_add_rmsnorm_mxfp8_packed", (*_PACKED, *_RES, "y")),
    ("rms_norm", False, False): FusedOp("rms_norm_mxfp8", (*_QUANT, "y")),
    ("rms_norm", True, False): FusedOp("fused_add_rms_norm_mxfp8", (*_QUANT, *_RES, "y")),
    # the standard norm's packed forms: the Gemma-named packed ops with weight_offset=0.0
    ("rms_norm", False, True): FusedOp("gemma_rmsnorm_mxfp8_packed", (*_PACKED, "y")),
    ("rms_norm", True, True): FusedOp("gemma_fused_add_rmsnorm_mxfp8_packed", (*_PACKED, *_RES, "y")),
    # the gated producers (patterns/gated.py): no residual, no packed form
    ("sigmoid_gate", False, False): FusedOp("sigmoid_gate_mxfp8", (*_QUANT, "y")),
    ("gated_rms_norm", False, False): FusedOp("gated_rms_norm_mxfp8", (*_QUANT, "y")),
    # act·mul (mxfuse/ops/activations.py): a [..., 2I] gate_up, or gate and up as two tensors; no packed form
    ("act_mul", False, False): FusedOp("act_mul_mxfp8", (*_QUANT, "y")),
    ("act_mul_pair", False, False): FusedOp("act_mul_pair_mxfp8", (*_QUANT, "y")),
}
"""The one map from a producer to the `torch.ops.mxfuse` op fusing it with the quant."""


def fused_op(producer: str, *, residual: bool = False, packed: bool = False) -> FusedOp:
    """The row of :data:`FUSED_OPS` (a ValueError names what has no fused op)."""
    found = FUSED_OPS.get((producer, residual, packed))
    if found is None:
        raise ValueError(f"no fused MXFP8 op for producer {producer!r} (residual={residual}, packed={packed})")
    return found


@dataclass(frozen=True)
class FusedCall:
    """The call that replaces a producer and its quant: `op.overload(*args, **kwargs)`."""

    op: FusedOp
    args: tuple[Argument, ...]
    kwargs: Mapping[str, Argument] = field(default_factory=dict)


@runtime_checkable
class ProducerMatch(Protocol):
    """A producer found in a graph, in the terms of the fused op that replaces it and its quant.

    family / kind: what it is; `kind` is the report's string ("vllm_ir:fused_add", "aten:silu_mul"),
    `<form>:<variant>`. y: the node the quant reads. anchor: the producer's first node (the fused op
    is inserted before it). difference: why its arithmetic is not the fused op's (a recognized
    producer that is reported, never fused), or None.
    """

    @property
    def family(self) -> ProducerFamily: ...

    @property
    def kind(self) -> str: ...

    @property
    def y(self) -> fx.Node: ...

    @property
    def anchor(self) -> fx.Node: ...

    @property
    def difference(self) -> Reason | None: ...

    def reject_reason(self, *, packed: bool = False) -> Reason | None:
        """Why the fused op cannot stand in for this producer (`difference` first); None: it can.
        `packed`: for the packed op of rewrite 2 (whose arguments may be narrower)."""
        ...

    def moved(self, replaced: Mapping[fx.Node, fx.Node]) -> Self:
        """This match with its inputs read through `replaced` (planned node -> the node an earlier
        site of the same run put in its place; an entry whose node was erased no longer holds)."""
        ...

    def fused_call(
        self, *, swizzled: bool = False, emit_y: bool = False, rule: QuantRule = QuantRule.DEFAULT, packed: bool = False
    ) -> FusedCall:
        """The fused op (a row of :data:`FUSED_OPS`) and its arguments: scales in the F8_128x4 layout
        when `swizzled`, `y` written too when `emit_y`, the quant's NaN / scale-byte-0 `rule`; the
        packed op (row-major scales, default rule) when `packed`."""
        ...

    def side_outputs(self) -> dict[str, fx.Node]:
        """The producer's outputs other than `y` that have users, by the fused op's output name
        (`{"residual_out": node}`); :func:`insert_fused` points their users at the fused op's."""
        ...


def now(node: Argument, replaced: Mapping[fx.Node, fx.Node]) -> Argument:
    """`node` read through `replaced` (for :meth:`ProducerMatch.moved`)."""
    new = replaced.get(node) if isinstance(node, fx.Node) else None
    return node if new is None or getattr(new, "_erased", False) else new


def insert_fused(
    graph: fx.Graph,
    producer: ProducerMatch,
    *,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: QuantRule = QuantRule.DEFAULT,
    packed: bool = False,
) -> dict[str, fx.Node]:
    """Insert the fused op standing in for `producer` and its quant (before the producer's anchor).

    Rewires the producer's side outputs to the fused ones (y is the caller's: only it knows
    which users to keep). Returns the new nodes by name: "fused", then "codes" and "scales"
    (or "packed"), each side output the producer has users of, and "y" when `emit_y`.
    """
    fused_call = producer.fused_call(swizzled=swizzled, emit_y=emit_y, rule=rule, packed=packed)
    sides = producer.side_outputs()
    wanted = QUANT_OUTPUTS | sides.keys() | ({"y"} if emit_y else set())
    with graph.inserting_before(producer.anchor):
        fused = call(graph, fused_call.op.overload, fused_call.args, dict(fused_call.kwargs))
        fused.meta["stack_trace"] = producer.y.meta.get("stack_trace") or producer.anchor.meta.get("stack_trace")
        out = {name: getitem(graph, fused, i) for i, name in enumerate(fused_call.op.outputs) if name in wanted}
    for name, node in sides.items():
        redirect_uses(node, out[name])
    return {"fused": fused, **out}
