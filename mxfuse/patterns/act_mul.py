"""act·mul producers: `act(gate) * up` feeding an MXFP8 quant (down_proj's input), from every source.

Before (vLLM's native `SiluAndMul` as Inductor's post-grad graph holds it; the gate and up are
the two halves of the gate_up GEMM's output)::

    gate = slice(gate_up, -1, 0, I);   up = slice(gate_up, -1, I, 2I)
    g32  = convert(gate, f32);         a = convert(g32 * sigmoid(g32), bf16)     # F.silu
    y    = mul(a, up)                                                           # bf16
    q, s = vllm.mxfp8_quantize(y.view(-1, I), True)

After (rewrite 1, :mod:`.producer_quant`, with this module's match)::

    q, s, _ = mxfuse.act_mul_mxfp8(gate_up, "silu", gate_first=True, swizzled=True)

Recognized (each returns an :class:`ActMulMatch`, a
:class:`~mxfuse.patterns.producers.ProducerMatch` of family ACT_MUL):

- decomposed ATen (vLLM's native `SiluAndMul` / `GeluAndMul(approximate="tanh")` /
  `SwigluStepAndMul`, Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)` with `ACT2FN["silu"]` /
  `["gelu_pytorch_tanh"]`, gpt-oss / MiniMax-M3's clamped SwiGLU in the model dtype as the
  Transformers backend traces it, mxfuse's own `swiglu_oai_native` in fp32): Inductor pattern
  trees traced from each source's formula with Inductor's own decompositions (:func:`_patterns`),
  literals matched exactly (a GELU with other constants is no match), `alpha` / `limit` bound
  as keyword arguments and read back. Which tensors the gate and up are decides the op: two
  halves of one `[..., 2I]` tensor (slices or a split, either order) -> `act_mul_mxfp8` with
  `gate_first`; anything else -> `act_mul_pair_mxfp8`.
- vLLM's `_C.silu_and_mul` / `_C.gelu_tanh_and_mul` under `auto_functionalized` (a user who
  enables the custom op): the CUDA kernel rounds the activation to the dtype, then multiplies
  in the dtype (`round_each_op=True`).
- the project's `mxfuse_models::swiglu_oai` (mxfuse/models.py): fp32 throughout, one rounding.

torchao's MX activation quant needs nothing here: its quant side is :mod:`.torchao_quant`'s and
the producer in front of it is one of the forms above.

Refused with :class:`ActMulCode` (the site is left exactly as it was): a gate / up that are not
`[..., I]` tensors of one shape, bf16 / fp16, `I` static and a multiple of 32; `alpha` / `limit`
that are not constants; the packed op of rewrite 2 (an activation is local to a rank: it never
crosses the SP all-gather, so there is no packed act·mul op).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import torch
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

aten = torch.ops.aten


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


# ------------------------------------------------------------------ the decomposed forms

# Distinct values the sources are traced with, so that the pattern binds them as keyword
# arguments (Inductor's `scalar_workaround`); read back from the match.
_ALPHA, _LIMIT, _NEG_LIMIT = 1.703125, 7.125, -7.375


def _silu(g, u):
    return torch.nn.functional.silu(g) * u


def _gelu_tanh(g, u):
    return torch.nn.functional.gelu(g, approximate="tanh") * u


def _swiglu_step(g, u, limit, neg_limit):  # vLLM's SwigluStepAndMul.forward_native
    return torch.nn.functional.silu(g).clamp(max=limit) * u.clamp(min=neg_limit, max=limit)


def _swiglu_oai(g, u, alpha, limit, neg_limit):  # gpt-oss / MiniMax-M3, in the model dtype (or fp32 inputs)
    g = g.clamp(min=None, max=limit)
    u = u.clamp(min=neg_limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def _swiglu_oai_fp32(g, u, alpha, limit, neg_limit):  # mxfuse/models.py's swiglu_oai_native, after .float()
    g = g.clamp(max=limit)
    u = u.clamp(min=neg_limit, max=limit)
    return (u + 1.0) * (g * torch.sigmoid(g * alpha))


@dataclass(frozen=True)
class _Form:
    activation: str
    fn: object
    scalars: tuple[str, ...]
    round_each_op: bool
    fp32_inputs: bool = False  # traced on fp32 gate / up, output converted to the dtype


_FORMS = (
    _Form("silu", _silu, (), True),
    _Form("gelu_tanh", _gelu_tanh, (), True),
    _Form("swiglu_step", _swiglu_step, ("limit", "neg_limit"), True),
    _Form("swiglu_oai", _swiglu_oai, ("alpha", "limit", "neg_limit"), True),
    _Form("swiglu_oai", _swiglu_oai_fp32, ("alpha", "limit", "neg_limit"), False, fp32_inputs=True),
)
_MAGIC = {"alpha": _ALPHA, "limit": _LIMIT, "neg_limit": _NEG_LIMIT}


@functools.cache
def _patterns(dtype: torch.dtype):
    """`[(form, pattern)]` for activations of `dtype`, traced with Inductor's decompositions (as the
    post-grad graph holds them). Literals (GELU's constants, the `1` of `1 + exp`, dtypes) are
    matched exactly; alpha / limit are keyword arguments."""
    from torch._inductor.pattern_matcher import fwd_only, fx_to_pattern

    out = []
    for form in _FORMS:
        if form.fp32_inputs and dtype == torch.float32:
            continue  # the same graph as the form without the converts
        args = ["g", "u", *form.scalars]
        example = torch.empty(4, 64, dtype=torch.float32 if form.fp32_inputs else dtype)
        workaround = {name: _MAGIC[name] for name in form.scalars}

        def fn(*a, _form=form):
            y = _form.fn(*a)
            return y.to(dtype) if _form.fp32_inputs else y

        fn.__signature__ = _signature(args)  # type: ignore[attr-defined]
        trace_args = [example, example.clone(), *workaround.values()]
        gm = fwd_only(fn, trace_args)
        out.append(
            (form, fx_to_pattern(gm, ignore_types=(list, torch.device), argnames=args, scalar_workaround=workaround))
        )
    return tuple(out)


def _signature(names):
    import inspect

    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])


def _match_aten(y: fx.Node) -> ActMulMatch | None:
    val = fake(y)
    if val is None or val.dtype not in (*ACTIVATION_DTYPES, torch.float32):
        return None  # fp32: recognized so that it is refused by name (ACTIVATION_DTYPE), not ignored
    for form, pattern in _patterns(val.dtype):
        m = pattern.match(y)
        if not m:
            continue
        kw = m.kwargs
        alpha, limit = kw.get("alpha", SWIGLU_OAI_ALPHA), kw.get("limit", SWIGLU_LIMIT)
        if "neg_limit" in kw and kw["neg_limit"] != -limit:
            continue  # clamp(-a, b) with a != b: not the activation's arithmetic
        alpha, limit = _const(alpha), _const(limit)
        base = ActMulMatch("aten", form.activation, y, y, alpha=alpha, limit=limit, round_each_op=form.round_each_op)
        found = _with_inputs(base, kw["g"], kw["u"], val.dtype if form.fp32_inputs else None)
        if found is not None:
            return found
    return None


def _const(value: Any) -> float | None:
    """A Python number as float; None for anything else (a node: a value known only at run time)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unconvert(node: Argument, dtype: torch.dtype) -> fx.Node | None:
    """`x` of `convert_element_type(x, f32)` when x has `dtype` (the fused op reads the dtype tensor)."""
    if not isinstance(node, fx.Node) or node.target not in _CONVERTS:
        return None
    src = node.args[0]
    val = fake(src) if isinstance(src, fx.Node) else None
    return src if val is not None and val.dtype == dtype else None  # type: ignore[return-value]


_CONVERTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
_SLICE = aten.slice.Tensor


def _halves(g: fx.Node, u: fx.Node) -> tuple[fx.Node, bool] | None:
    """`(gate_up, gate_first)` when gate and up are the two halves of one `[..., 2I]` tensor's last dim."""

    def half(node: fx.Node):  # (source, which half) of a last-dim half view
        src_val = None
        if node.target is _SLICE:
            src, dim, start, end = ([*list(node.args), 0, None, None])[:4]
            src_val = fake(src) if isinstance(src, fx.Node) else None
            if src_val is None:
                return None
            width = src_val.shape[-1]
            if dim not in (-1, src_val.dim() - 1) or not isinstance(width, int) or width % 2:
                return None
            end = width if end is None or (isinstance(end, int) and end >= width) else end
            if (start, end) == (0, width // 2):
                return src, 0
            if (start, end) == (width // 2, width):
                return src, 1
            return None
        if node.target is operator.getitem:
            split, index = node.args
            if not isinstance(split, fx.Node) or split.target not in _SPLITS:
                return None
            src = split.args[0]
            src_val = fake(src) if isinstance(src, fx.Node) else None
            if src_val is None or not isinstance(src_val.shape[-1], int):
                return None
            width = src_val.shape[-1]
            size, dim = [*split.args[1:], 0][:2]
            size = cast(Any, size)
            if split.target is aten.chunk.default:
                ok = size == 2
            elif split.target is aten.split_with_sizes.default:
                ok = list(size) == [width // 2, width // 2]
            else:
                ok = size == width // 2 and width % 2 == 0
            if not ok or dim not in (-1, src_val.dim() - 1):
                return None
            return src, cast(int, index)
        return None

    hg, hu = half(g), half(u)
    if hg is None or hu is None or hg[0] is not hu[0] or {hg[1], hu[1]} != {0, 1}:
        return None
    return hg[0], hg[1] == 0


def _with_inputs(match: ActMulMatch, g: fx.Node, u: fx.Node, unconvert: torch.dtype | None) -> ActMulMatch | None:
    """The match reading `g` / `u`: as the halves of one tensor when they are, else as two tensors.
    `unconvert`: the source converted them to fp32 (mxfuse's `gate_up.float().chunk(2)`); the
    fused op reads the tensors of this dtype before the converts."""
    halves = _halves(g, u)
    if halves is not None:
        src: fx.Node | None = halves[0]
        if unconvert is not None:
            src = _unconvert(src, unconvert)
        return None if src is None else replace(match, gate_up=src, gate_first=halves[1])
    if unconvert is not None:
        g2, u2 = _unconvert(g, unconvert), _unconvert(u, unconvert)
        if g2 is None or u2 is None:
            return None
        g, u = g2, u2
    return replace(match, gate=g, up=u)


# ------------------------------------------------------------------ the opaque forms

_VLLM_C = {"silu_and_mul": "silu", "gelu_tanh_and_mul": "gelu_tanh"}
"""vLLM's `_C` act·mul kernels whose arithmetic the fused op reproduces (activation rounded to the
dtype, then a dtype multiply; `[gate | up]` halves)."""


def _functionalized_op(node: fx.Node):
    """`(op, kwargs)` of an `auto_functionalized(op, **kwargs)` node (v1 or v2), else None."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    if node.op != "call_function" or node.target not in (auto_functionalized, auto_functionalized_v2):
        return None
    return node.args[0], node.kwargs


def _match_vllm_c(y: fx.Node) -> ActMulMatch | None:
    """`getitem(auto_functionalized(_C.silu_and_mul, result=..., input=x), 1)`: the written result."""
    if y.target is not operator.getitem or not isinstance(y.args[0], fx.Node):
        return None
    found = _functionalized_op(y.args[0])
    if found is None:
        return None
    op, kwargs = found
    name = getattr(op, "_schema", None) and op._schema.name
    if not name or not name.startswith("_C::") or name.removeprefix("_C::") not in _VLLM_C:
        return None
    x = kwargs.get("input")
    if not isinstance(x, fx.Node) or y.args[1] != 1:  # output 1: the mutated `result` (v1) / its base (v2)
        return None
    activation = _VLLM_C[name.removeprefix("_C::")]
    return ActMulMatch("vllm_c", activation, y, y, gate_up=x, gate_first=True)


def _match_mxfuse_models(y: fx.Node) -> ActMulMatch | None:
    """mxfuse/models.py's opaque `mxfuse_models::swiglu_oai(gate_up, alpha, limit)` (fp32, one rounding)."""
    ns = getattr(torch.ops, "mxfuse_models", None)
    op = getattr(ns, "swiglu_oai", None) if ns is not None else None
    if op is None or y.target is not getattr(op, "default", None):
        return None
    args: list[Any] = [*y.args, None, None]
    alpha = y.kwargs.get("alpha", args[1] if args[1] is not None else SWIGLU_OAI_ALPHA)
    limit = y.kwargs.get("limit", args[2] if args[2] is not None else SWIGLU_LIMIT)
    alpha, limit = _const(alpha), _const(limit)
    ok = alpha is not None and limit is not None
    return ActMulMatch(
        "mxfuse_models",
        "swiglu_oai",
        y,
        y,
        gate_up=y.args[0],  # type: ignore[arg-type]
        alpha=alpha if ok else None,
        limit=limit if ok else None,
        round_each_op=False,
    )


def match_act_mul(y: fx.Node) -> ActMulMatch | None:
    """The act·mul whose output `y` is, in any form; None if `y` is not one."""
    if y.op != "call_function":
        return None
    for recognize in (_match_mxfuse_models, _match_vllm_c, _match_aten):
        found = recognize(y)
        if found is not None:
            return found
    return None


_CANDIDATE_TARGETS = (aten.mul.Tensor, operator.getitem, *_CONVERTS)


def act_mul_candidates(graph: fx.Graph) -> list[fx.Node]:
    """The nodes :func:`match_act_mul` can return a match for (a superset)."""
    ns = getattr(torch.ops, "mxfuse_models", None)
    swiglu = getattr(getattr(ns, "swiglu_oai", None), "default", None) if ns is not None else None
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and (n.target in _CANDIDATE_TARGETS or (swiglu is not None and n.target is swiglu))
    ]
