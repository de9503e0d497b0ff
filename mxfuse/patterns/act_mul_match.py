"""The act·mul producer's match and refusal codes: :class:`ActMulMatch`, :class:`ActMulCode`.

What the recognizers of :mod:`.act_mul` (the opaque forms) and :mod:`.act_mul_aten` (the
decomposed ATen forms) return: an act·mul in the terms of `act_mul_mxfp8` /
`act_mul_pair_mxfp8` (mxfuse/ops/activations.py), its guards and its fused call. Apart from
the recognizers so that they can import it without a circle (:mod:`.act_mul` re-exports both names).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import Argument

from mxfuse.ops.activations import SWIGLU_LIMIT, SWIGLU_OAI_ALPHA
from mxfuse.ops.library import ACTIVATION_DTYPES
from mxfuse.ops.mx_layout import BLOCK
from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import fake
from mxfuse.patterns.producers import FusedCall, ProducerFamily, fused_op, now
from mxfuse.patterns.results import Reason, RefusalCode, SharedCode


class ActMulCode(RefusalCode):
    """Refusals of an act·mul producer of its own (dtype and size refusals are :class:`SharedCode`)."""

    GATE_UP_SHAPES = (
        "gate and up are not two [..., I] tensors of one shape",
        "multiply the activated gate by an up of the same shape (no broadcast)",
    )
    NOT_CONSTANT = (
        "the clamp limit or the sigmoid's alpha is not a graph constant",
        "pass alpha and limit as Python floats",
    )
    NO_PACKED_OP = "an activation is local to a rank: it never reaches the SP all-gather's packed op"
    INTERLEAVED = (
        "gate and up interleave along the last dim (`x[..., ::2]`, `x[..., 1::2]`): the fused op reads "
        "contiguous halves or tensors, and copying the strided ones first costs more than the round trip it saves",
        "store the gate_up projection de-interleaved (at load: the weight's rows `w.view(I, 2, K).transpose(0, 1)"
        ".reshape(2 * I, K)`, a bias likewise) and read the halves `x[..., :I]`, `x[..., I:]`",
    )
    CLAMPED_GATE_SILU = (
        "a SiLU of the clamped gate times `up + beta` (vLLM's SiluAndMulWithClamp) with beta != 1: "
        "no fused op computes it",
        "none without changing the model: the fused ops compute SiLU of the unclamped gate (`silu`, "
        "`swiglu_step` clamps after it) or SwiGLU-OAI's `(up + 1)` (SiluAndMulWithClamp with beta=1.0 fuses "
        "as `swiglu_oai`); the site stays a standalone MXFP8 quant, exact as it was",
    )


@dataclass(frozen=True)
class ActMulMatch:
    """An act·mul found in a graph, in the terms of `act_mul_mxfp8` / `act_mul_pair_mxfp8`.

    `gate_up` set: the gate and up are the halves of it (`gate_first` says which is the gate);
    else `gate` and `up` are two tensors.
    """

    form: str  # "aten" (decomposed), "vllm_c" (`_C.*_and_mul`), "mxfuse_models" (`swiglu_oai`)
    activation: str
    y: fx.Node
    anchor: fx.Node  # the fused op goes before it: y itself (every input is an ancestor of y)
    gate: fx.Node | None = None
    up: fx.Node | None = None
    gate_up: fx.Node | None = None
    gate_first: bool = True
    alpha: float | None = SWIGLU_OAI_ALPHA  # None: not a constant (refused)
    limit: float | None = SWIGLU_LIMIT
    round_each_op: bool = True
    difference: Reason | None = None

    family: ClassVar[ProducerFamily] = ProducerFamily.ACT_MUL

    @property
    def kind(self) -> str:
        """`form:activation_mul`, e.g. `aten:silu_mul`; `+fp32` when it rounds once."""
        return f"{self.form}:{self.activation}_mul{'' if self.round_each_op else '+fp32'}"

    def _inputs(self) -> list[fx.Node]:
        return [self.gate_up] if self.gate_up is not None else [n for n in (self.gate, self.up) if n is not None]

    def reject_reason(self, *, packed: bool = False) -> Reason | None:
        if self.difference is not None:
            return self.difference
        if packed:
            return Reason(ActMulCode.NO_PACKED_OP, "no packed act·mul op (the activation is rank-local)")
        if self.alpha is None or self.limit is None:
            return Reason(ActMulCode.NOT_CONSTANT, f"{self.activation}: alpha / limit are graph inputs")
        if not (math.isfinite(self.alpha) and math.isfinite(self.limit) and self.limit > 0):
            return Reason(ActMulCode.NOT_CONSTANT, f"alpha={self.alpha}, limit={self.limit}: not the op's range")
        vals = [fake(n) for n in self._inputs()]
        if any(v is None for v in vals):
            return Reason(SharedCode.NO_SHAPES, "no fake tensor on the act·mul inputs")
        x = vals[0]
        assert x is not None
        if any(v.dtype not in ACTIVATION_DTYPES for v in vals if v is not None):
            return Reason(
                SharedCode.ACTIVATION_DTYPE, f"act·mul inputs of dtype {x.dtype} (the fused op takes bf16/fp16)"
            )
        if self.gate_up is None:
            u = vals[1]
            if (
                u is None
                or u.dtype != x.dtype
                or u.dim() != x.dim()
                or not all(statically_known_true(p == q) for p, q in zip(x.shape, u.shape))
            ):
                return Reason(ActMulCode.GATE_UP_SHAPES, "gate and up differ in shape or dtype")
            i = x.shape[-1]
        else:
            i = x.shape[-1] // 2
        if not statically_known_true(i % BLOCK == 0) or i == 0:
            return Reason(SharedCode.HIDDEN_SIZE, f"intermediate size I={i} is symbolic or not a multiple of {BLOCK}")
        y = fake(self.y)
        if y is None or not statically_known_true(y.shape[-1] == i):
            return Reason(ActMulCode.GATE_UP_SHAPES, f"the product is not [..., {i}]")
        return None

    def moved(self, replaced: Mapping[fx.Node, fx.Node]) -> ActMulMatch:
        fields = {name: now(getattr(self, name), replaced) for name in ("gate", "up", "gate_up")}
        if all(fields[name] is getattr(self, name) for name in fields):
            return self
        return replace(self, **fields)  # type: ignore[arg-type]

    def fused_call(
        self, *, swizzled: bool = False, emit_y: bool = False, rule: QuantRule = QuantRule.DEFAULT, packed: bool = False
    ) -> FusedCall:
        if packed:
            raise ValueError("fused_call: there is no packed act·mul op")
        flags: dict[str, Argument] = {"swizzled": swizzled, "emit_y": emit_y}
        if rule != QuantRule.DEFAULT:
            flags["rule"] = int(rule)
        if self.activation in ("swiglu_step", "swiglu_oai"):
            flags["limit"] = self.limit
        if self.activation == "swiglu_oai":
            flags["alpha"] = self.alpha
        flags["round_each_op"] = self.round_each_op
        if self.gate_up is not None:
            flags["gate_first"] = self.gate_first
            return FusedCall(fused_op("act_mul"), (self.gate_up, self.activation), flags)
        return FusedCall(fused_op("act_mul_pair"), (self.gate, self.up, self.activation), flags)

    def side_outputs(self) -> dict[str, fx.Node]:
        return {}
