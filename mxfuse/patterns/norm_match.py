"""A recognized norm (Gemma or standard RMSNorm) as a producer: :class:`NormMatch`, its guards, its fused call.

The recognizers of :mod:`.norms` (and :mod:`.hf_norm`, :mod:`.allreduce_norm`) return it;
it implements :class:`~mxfuse.patterns.producers.ProducerMatch`, so rewrite 1 and rewrite 2
fuse it with its quant without knowing it is a norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import Argument

from mxfuse.ops.library import ACTIVATION_DTYPES
from mxfuse.ops.mx_layout import BLOCK
from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import fake
from mxfuse.patterns.producers import FusedCall, ProducerFamily, fused_op, now
from mxfuse.patterns.results import Reason, SharedCode


@dataclass(frozen=True)
class NormMatch:
    """A Gemma or standard norm found in a graph, in the terms of the mxfuse fused ops."""

    form: str
    x: fx.Node
    residual: fx.Node | None
    weight: fx.Node
    eps: float | fx.Node | None  # a node: a 0-d tensor read at run time; None: unusable (a SymFloat)
    y: fx.Node
    residual_out: fx.Node | None
    anchor: fx.Node  # first node of the norm; replacements are inserted before it
    round_sum: bool = False
    weight_offset: float = 1.0
    difference: Reason | None = None  # why its arithmetic is not the fused op's (never fused then)
    round_normalized: bool = False  # round `normalize(s)` to the dtype before the weight multiply
    standard: bool = False  # the standard RMSNorm (`normalize(x) * w`, offset 0), not Gemma's `1 + w`

    family: ClassVar[ProducerFamily] = ProducerFamily.NORM

    @property
    def has_residual(self) -> bool:
        return self.residual is not None

    @property
    def kind(self) -> str:
        """`form:plain` / `form:fused_add` for a Gemma norm; `form:rms_norm` / `form:fused_add_rms_norm`
        for a standard one; `form:layer_norm` for a LayerNorm recognized so that it is named (never fused)."""
        if self.difference is not None and self.difference.code is SharedCode.NORM_CENTERED:
            return f"{self.form}:{'fused_add_layer_norm' if self.has_residual else 'layer_norm'}"
        if self.standard:
            return f"{self.form}:{'fused_add_rms_norm' if self.has_residual else 'rms_norm'}"
        return f"{self.form}:{'fused_add' if self.has_residual else 'plain'}"

    def reject_reason(self, *, packed: bool = False) -> Reason | None:
        """Why the fused kernel cannot stand in for this norm (None: it can).

        The unpacked ops take eps as a 0-d host tensor operand when it is not a constant; the
        packed ops (`packed=True`) take a constant eps only.
        """
        if self.difference is not None:
            return self.difference
        x = fake(self.x)
        if x is None:
            return Reason(SharedCode.NO_SHAPES, "no fake tensor on the norm input (graph not traced with shapes)")
        if x.dtype not in ACTIVATION_DTYPES:
            return Reason(
                SharedCode.ACTIVATION_DTYPE, f"activation dtype {x.dtype} (the fused kernel takes bfloat16/float16)"
            )
        k = x.shape[-1]
        if not statically_known_true(k % BLOCK == 0):
            text = (
                f"hidden size K={k} is not a multiple of {BLOCK}"
                if isinstance(k, int)
                else f"hidden size {k} is symbolic"
            )
            return Reason(SharedCode.HIDDEN_SIZE, text)
        eps_reason = _eps_reason(self.eps, runtime_eps=not packed)
        if eps_reason is not None:
            return eps_reason
        w = fake(self.weight)
        if w is None or w.dim() != 1 or not statically_known_true(w.shape[0] == k):
            shape = None if w is None else tuple(w.shape)
            return Reason(SharedCode.WEIGHT_SHAPE, f"weight shape {shape} is not ({k},)")
        if self.residual is not None:
            r = fake(self.residual)
            if r is None or r.dtype != x.dtype or not same_shape(r.shape, x.shape):
                return Reason(SharedCode.RESIDUAL_MISMATCH, "residual does not match the input in shape and dtype")
        if x.device != w.device:
            return Reason(SharedCode.DEVICE_MISMATCH, f"input on {x.device}, weight on {w.device}")
        return None

    def moved(self, replaced: Mapping[fx.Node, fx.Node]) -> NormMatch:
        """This norm with its input and residual read through `replaced` (chained layers: a norm's
        residual is the previous fused op's residual output)."""
        x, residual = now(self.x, replaced), now(self.residual, replaced)
        if x is self.x and residual is self.residual:
            return self
        assert isinstance(x, fx.Node) and (residual is None or isinstance(residual, fx.Node))
        return replace(self, x=x, residual=residual)

    def fused_call(
        self, *, swizzled: bool = False, emit_y: bool = False, rule: QuantRule = QuantRule.DEFAULT, packed: bool = False
    ) -> FusedCall:
        """`gemma_[fused_add_]rmsnorm_mxfp8[_packed]` / `[fused_add_]rms_norm_mxfp8` and their arguments.

        The standard unpacked ops take no `weight_offset` (it is 0); the packed ops, Gemma-named,
        serve both with `weight_offset`. A runtime eps (a graph node) goes in as `eps_tensor`.
        """
        op = fused_op("rms_norm" if self.standard else "gemma_rmsnorm", residual=self.has_residual, packed=packed)
        flags: dict[str, Argument] = {"emit_y": emit_y}
        if packed or not self.standard:
            flags["weight_offset"] = self.weight_offset
        if self.round_normalized or self.standard:
            flags["round_normalized"] = self.round_normalized
        if not packed:
            flags = {"swizzled": swizzled, **flags}
            if rule != QuantRule.DEFAULT:  # torchao's NaN / scale-byte-0 encoding (see QuantRule)
                flags["rule"] = int(rule)
        eps: Argument = self.eps
        if isinstance(eps, fx.Node):  # a runtime eps (e.g. dynamic=True): an operand of the unpacked ops
            if packed:
                raise ValueError(f"fused_call: the packed ops take a constant eps, not the tensor {eps.name}")
            eps, flags["eps_tensor"] = 0.0, eps
        if self.residual is not None:
            flags["round_sum"] = self.round_sum
            return FusedCall(op, (self.x, self.residual, self.weight, eps), flags)
        return FusedCall(op, (self.x, self.weight, eps), flags)

    def side_outputs(self) -> dict[str, fx.Node]:
        return {} if self.residual_out is None else {"residual_out": self.residual_out}


def _eps_reason(eps: float | fx.Node | None, runtime_eps: bool) -> Reason | None:
    if isinstance(eps, float):
        if not eps >= 0:  # the fused ops refuse it (it is added to the mean square before the rsqrt)
            return Reason(SharedCode.EPS_INVALID, f"eps={eps} is not a valid norm epsilon; left unfused")
        return None
    what = "eps is not a graph constant (a float attribute made a graph input, e.g. by dynamic=True)"
    if eps is None:
        return Reason(SharedCode.EPS_NOT_CONSTANT, what)
    val = fake(eps)
    if not runtime_eps:
        return Reason(SharedCode.EPS_NOT_CONSTANT, f"{what}; this rewrite's fused op takes a constant eps")
    if val is None or val.dim() != 0 or not val.is_floating_point():
        shape = None if val is None else tuple(val.shape)
        return Reason(SharedCode.EPS_NOT_CONSTANT, f"eps is a tensor of shape {shape}, not a 0-d float scalar")
    if val.device.type != "cpu":
        text = f"eps is a 0-d tensor on {val.device}; the fused op reads a runtime eps on the host"
        return Reason(SharedCode.EPS_NOT_CONSTANT, text)
    return None


def same_shape(a: Any, b: Any) -> bool:
    """Shapes provably equal (dims may be symbolic)."""
    return len(a) == len(b) and all(statically_known_true(p == q) for p, q in zip(a, b))
