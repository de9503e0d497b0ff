"""The act·mul in decomposed ATen, as Inductor's post-grad graph holds it: :func:`match_decomposed`.

The sources (vLLM's native `SiluAndMul` / `GeluAndMul(approximate="tanh")` / `SwigluStepAndMul` /
`SwigluOAIAndMul` / `SiluAndMulWithClamp`, Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)`
with `ACT2FN["silu"]` / `["gelu_pytorch_tanh"]`, gpt-oss / MiniMax-M3's clamped SwiGLU in the
model dtype as the Transformers backend traces it, mxfuse's own `swiglu_oai_native` in fp32)
become Inductor pattern trees traced from each source's formula with Inductor's own
decompositions (:func:`_patterns`): literals matched exactly (a GELU with other constants is no
match), `alpha` / `limit` / `beta` bound as keyword arguments and read back. Which tensors the
gate and up are decides the op: two halves of one `[..., 2I]` tensor (slices or a split, either
order) -> `act_mul_mxfp8` with `gate_first`; two other tensors -> `act_mul_pair_mxfp8`.

Recognized and refused (a match with a `difference`, so that the report names them):

- gate and up interleaved (`x[..., ::2]`, `x[..., 1::2]`: vLLM's `SwigluOAIAndMul`, gpt-oss's
  experts): :attr:`ActMulCode.INTERLEAVED`.
- vLLM's `SiluAndMulWithClamp`, `clamp(gate, max=L) * sigmoid(alpha * clamp(gate, max=L)) *
  (clamp(up, -L, L) + beta)`: with `beta = 1.0` it is SwiGLU-OAI's arithmetic to the bit (the
  last product's operands swapped: IEEE multiplication commutes) and fuses as `swiglu_oai`; any
  other beta (the default 0) is :attr:`ActMulCode.CLAMPED_GATE_SILU`. Inductor's joint-graph
  pass drops `* 1.0` and `+ 0.0` before a post-grad pass sees the graph, so each is traced with
  and without them.
"""

from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import fx
from torch.fx.node import Argument

from mxfuse.ops.activations import SWIGLU_LIMIT, SWIGLU_OAI_ALPHA
from mxfuse.ops.library import ACTIVATION_DTYPES
from mxfuse.patterns.act_mul_match import ActMulCode, ActMulMatch
from mxfuse.patterns.fx_utils import fake
from mxfuse.patterns.results import Reason

aten = torch.ops.aten

# Distinct values the sources are traced with, so that the pattern binds them as keyword
# arguments (Inductor's `scalar_workaround`); read back from the match.
_ALPHA, _LIMIT, _NEG_LIMIT, _BETA = 1.703125, 7.125, -7.375, 1.1875


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


def _silu_clamp(*, alpha: bool, beta: bool):
    """vLLM's `SiluAndMulWithClamp.forward_native`; without `alpha`: its `1.0 * gate` dropped, without
    `beta`: its `+ 0.0` dropped (Inductor's joint-graph `remove_no_ops`, before any post-grad pass)."""

    def fn(g, u, limit, neg_limit, *alpha_beta):
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, min=neg_limit, max=limit)
        s = torch.sigmoid(alpha_beta[0] * g) if alpha else torch.sigmoid(g)
        return g * s * (u + alpha_beta[-1] if beta else u)

    return fn


@dataclass(frozen=True)
class _Form:
    activation: str
    fn: object
    scalars: tuple[str, ...]
    round_each_op: bool
    fp32_inputs: bool = False  # traced on fp32 gate / up, output converted to the dtype
    defaults: tuple[tuple[str, float], ...] = ()  # the scalars a form without them has (`* 1.0` dropped: alpha 1)


def _silu_clamp_form(alpha: bool, beta: bool) -> _Form:
    scalars = ("limit", "neg_limit", *(("alpha",) if alpha else ()), *(("beta",) if beta else ()))
    defaults = (*((("alpha", 1.0),) if not alpha else ()), *((("beta", 0.0),) if not beta else ()))
    return _Form("silu_clamp", _silu_clamp(alpha=alpha, beta=beta), scalars, True, defaults=defaults)


_FORMS = (
    _Form("silu", _silu, (), True),
    _Form("gelu_tanh", _gelu_tanh, (), True),
    _Form("swiglu_step", _swiglu_step, ("limit", "neg_limit"), True),
    _Form("swiglu_oai", _swiglu_oai, ("alpha", "limit", "neg_limit"), True),
    _Form("swiglu_oai", _swiglu_oai_fp32, ("alpha", "limit", "neg_limit"), False, fp32_inputs=True),
    *(_silu_clamp_form(alpha, beta) for alpha in (True, False) for beta in (True, False)),
)
_MAGIC = {"alpha": _ALPHA, "limit": _LIMIT, "neg_limit": _NEG_LIMIT, "beta": _BETA}


@functools.cache
def _patterns(dtype: torch.dtype):
    """`[(form, pattern)]` for activations of `dtype`, traced with Inductor's decompositions (as the
    post-grad graph holds them). Literals (GELU's constants, the `1` of `1 + exp`, dtypes) are
    matched exactly; alpha / limit / beta are keyword arguments."""
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
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])


def match_decomposed(y: fx.Node) -> ActMulMatch | None:
    """The act·mul in decomposed ATen whose output `y` is (module docstring), or None."""
    val = fake(y)
    if val is None or val.dtype not in (*ACTIVATION_DTYPES, torch.float32):
        return None  # fp32: recognized so that it is refused by name (ACTIVATION_DTYPE), not ignored
    for form, pattern in _patterns(val.dtype):
        m = pattern.match(y)
        if not m:
            continue
        kw = {**dict(form.defaults), **m.kwargs}
        alpha, limit = kw.get("alpha", SWIGLU_OAI_ALPHA), kw.get("limit", SWIGLU_LIMIT)
        if "neg_limit" in kw and kw["neg_limit"] != -limit:
            continue  # clamp(-a, b) with a != b: not the activation's arithmetic
        alpha, limit = as_float(alpha), as_float(limit)
        base = ActMulMatch("aten", form.activation, y, y, alpha=alpha, limit=limit, round_each_op=form.round_each_op)
        if form.activation == "silu_clamp":
            base = _clamped_silu(base, kw["beta"])
        found = _with_inputs(base, kw["g"], kw["u"], val.dtype if form.fp32_inputs else None)
        if found is not None:
            return found
    return None


def _clamped_silu(match: ActMulMatch, beta: Any) -> ActMulMatch:
    """vLLM's SiluAndMulWithClamp: with beta 1.0 SwiGLU-OAI's arithmetic (module docstring), else refused."""
    if as_float(beta) == 1.0:
        return replace(match, activation="swiglu_oai")
    text = (
        f"vLLM's SiluAndMulWithClamp: SiLU of the gate clamped to {match.limit}, times up + {beta} "
        "(only beta=1.0, SwiGLU-OAI's `up + 1`, has a fused op)"
    )
    return replace(match, difference=Reason(ActMulCode.CLAMPED_GATE_SILU, text))


def as_float(value: Any) -> float | None:
    """A Python number as float; None for anything else (a node: a value known only at run time)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unconvert(node: Argument, dtype: torch.dtype) -> fx.Node | None:
    """`x` of `convert_element_type(x, f32)` when x has `dtype` (the fused op reads the dtype tensor)."""
    if not isinstance(node, fx.Node) or node.target not in CONVERTS:
        return None
    src = node.args[0]
    val = fake(src) if isinstance(src, fx.Node) else None
    return src if val is not None and val.dtype == dtype else None  # type: ignore[return-value]


CONVERTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
_SLICE = aten.slice.Tensor


def _slice_args(node: fx.Node) -> tuple[Any, ...]:
    """`(src, dim, start, end, step)` of an `aten.slice.Tensor` node, its defaults filled in."""
    args = (*node.args, *(None, 0, None, None, 1)[len(node.args) :])
    return tuple(node.kwargs.get(name, arg) for name, arg in zip(("self", "dim", "start", "end", "step"), args))


def _halves(g: fx.Node, u: fx.Node) -> tuple[fx.Node, bool] | None:
    """`(gate_up, gate_first)` when gate and up are the two halves of one `[..., 2I]` tensor's last dim."""

    def half(node: fx.Node):  # (source, which half) of a last-dim half view
        src_val = None
        if node.target is _SLICE:
            src, dim, start, end, step = _slice_args(node)
            src_val = fake(src) if isinstance(src, fx.Node) else None
            if src_val is None or step != 1:
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
    fused op reads the tensors of this dtype before the converts. Interleaved halves are refused."""
    if _interleaved(g, u):
        text = f"its gate and up are the even and odd columns of {g.args[0]} (interleaved, not two halves)"
        return replace(match, gate=g, up=u, difference=match.difference or Reason(ActMulCode.INTERLEAVED, text))
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


def _interleaved(g: fx.Node, u: fx.Node) -> bool:
    """Whether gate and up are the even and odd columns of one tensor (`x[..., ::2]`, `x[..., 1::2]`)."""

    def columns(node: fx.Node):  # (source, first column) of a last-dim slice of step 2 to the end
        if node.target is not _SLICE:
            return None
        src, dim, start, end, step = _slice_args(node)
        val = fake(src) if isinstance(src, fx.Node) else None
        if val is None or step != 2 or dim not in (-1, val.dim() - 1) or start not in (0, 1):
            return None
        width = val.shape[-1]
        to_the_end = end is None or (isinstance(end, int) and isinstance(width, int) and end >= width)
        return (src, start) if to_the_end else None

    cg, cu = columns(g), columns(u)
    return cg is not None and cu is not None and cg[0] is cu[0] and cg[1] != cu[1]
