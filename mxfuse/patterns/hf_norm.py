"""The decomposed-ATen norms of Hugging Face models and of `torch.nn.RMSNorm`, in every spelling seen.

Three anchors. (1) The final cast `y = P.to(dtype)` (Gemma's `(n * (1 + w.float())).type_as(x)`,
and `torch.nn.RMSNorm` / `F.rms_norm`: `(n * w).to(dtype)`, `w` promoted to fp32, `eps` an
`add.Scalar` rounded to fp32). (2) Hugging Face's `LlamaRMSNorm` & co. (Qwen3, Mistral,
DeepSeek-V2, GLM-4): `y = w * n.to(dtype)`, a product in the model dtype of the rounded
normalized value (`round_normalized=True`). (3) A norm of fp32 activations (no cast back): `y = n *
M` in fp32, reported (the fused op takes bf16/fp16), never fused.
From the anchor the recognizer walks up the graph:

- `P = normed * M` (either order), `normed = s32 * rsqrt(v + eps)` or `s32 / sqrt(v + eps)`;
- `v = mean(s32 ** 2 | s32 * s32, dim=-1, keepdim=True)`; `eps` a float literal, a 0-d
  tensor (`dynamic=True` makes the float attribute a graph input), or gone (`eps = 0.0`:
  Inductor drops the `+ 0.0`);
- `s32 = s.float()` (the norm input; if `s = residual + hidden` in the model dtype, the add
  is folded in with `round_sum=True`: Gemma 3 / MiniMax-M3 layers), or
  `s32 = x.float() + residual.float()` (the residual add in fp32: the fused op's own order);
- `M = w.float() + 1.0` (or `1.0 + w`, `w` bf16/fp16 or an fp32 parameter): weight `w`,
  offset 1.0; or an fp32 constant (`get_attr`): freezing folded `1 + w` into it, offset 0.0;
  or `M = 1 + w` computed in the model dtype (promoted by the multiply): weight `M`, offset 0.0;
  or anything else (`w.float()`, a bf16 `w` promoted, an fp32 `w`, `0 + w`): the standard
  RMSNorm, weight `M`, offset 0.0.
- `normed` may also be `view(normalize(view(s32, [..., G, K/G])), [..., K])`: a norm over groups
  of channels, recognized only to be reported (`SharedCode.NORM_GROUPED`).

Every one of these computes what the fused op computes up to the reduction order (the
foreign-norm bound of docs/design.md "Fidelity"). A norm of this shape whose multiplier is
`c + w` for another constant `c`, whose statistics come from another tensor or another dim,
whose output dtype is not the activations', or whose fp32 sum is read in fp32 elsewhere is
returned with a `difference` naming it, so it is reported, never fused.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import fx
from torch.fx.node import Argument

from mxfuse.ops.library import ACTIVATION_DTYPES
from mxfuse.patterns.fx_utils import RESHAPES, constant_float, fake, fake_dtype, is_call
from mxfuse.patterns.results import Reason, SharedCode

aten, prims = torch.ops.aten, torch.ops.prims
_CAST = prims.convert_element_type.default


def match_hf(y: fx.Node, make_match):
    """The decomposed-ATen norm whose output is `y` (`make_match(**fields)` builds it), or None."""
    dtype = _model_dtype(y.args[1]) if is_call(y, _CAST) else None
    if dtype is not None:
        return _match_cast(y, dtype, make_match)
    if is_call(y, aten.mul.Tensor) and len(y.args) == 2 and not y.kwargs:
        return _match_rounded_normalized(y, make_match) or _match_fp32(y, make_match)
    return None


def _model_dtype(value: Any) -> torch.dtype | None:
    """`value` when it is bf16 or fp16 (the dtype argument of a cast), else None."""
    return value if isinstance(value, torch.dtype) and value in ACTIVATION_DTYPES else None


def _match_cast(y: fx.Node, dtype: torch.dtype, make_match):
    """Anchor (1): `y = (n * M).to(dtype)`."""
    product = y.args[0]
    if not _is_f32(product) or not is_call(product, aten.mul.Tensor) or len(product.args) != 2:
        return None
    split = _split(product)
    if split is None:
        return None
    normed, multiplier, s32, eps, stats_difference = split
    source = _norm_input(s32, dtype, {y, product, normed})
    multiplier_val = fake(multiplier)
    if source is None or multiplier_val is None:
        return None
    if _is_f32(multiplier):
        weight = _multiplier(multiplier)
    elif multiplier_val.dtype in ACTIVATION_DTYPES:  # promoted exactly to fp32 by the multiply
        weight = _model_dtype_multiplier(multiplier)
    else:
        return None
    source_difference, weight_difference = source.pop("difference"), weight.pop("difference")
    difference = stats_difference or source_difference or weight_difference
    return make_match(form="hf", eps=eps, y=y, difference=difference, **weight, **source)


def _match_rounded_normalized(y: fx.Node, make_match):
    """Anchor (2): `y = w * n.to(dtype)` (transformers' `LlamaRMSNorm`: `self.weight * h.to(input_dtype)`)."""
    for rounded, w in itertools.permutations(y.args):
        if not is_call(rounded, _CAST) or not _is_f32(rounded.args[0]):
            continue
        dtype = _model_dtype(rounded.args[1])
        if dtype is None:
            continue
        found = _normalized_any(rounded.args[0])
        w_val, y_val = fake(w), fake(y)
        if found is None or w_val is None or y_val is None:
            continue
        s32, eps, difference = found
        source = _norm_input(s32, dtype, {y, rounded, rounded.args[0]})
        if source is None:
            return None
        source_difference = source.pop("difference")
        difference = difference or source_difference
        w_dtype, out_dtype = w_val.dtype, y_val.dtype
        if difference is None and not w_dtype == out_dtype == dtype:
            text = (
                f"the weight is {w_dtype}: `w * normalize(x).to({dtype})` gives a {out_dtype} output, "
                f"the fused op writes {dtype} (give the norm weight the model dtype)"
            )
            difference = Reason(SharedCode.NORM_DTYPES, text)
        return make_match(
            form="hf",
            eps=eps,
            y=y,
            weight=w,
            weight_offset=0.0,
            standard=True,
            round_normalized=True,
            difference=difference,
            **source,
        )
    return None


def _match_fp32(y: fx.Node, make_match):
    """Anchor (3): `y = n * M` of fp32 activations (no user casts it to a model dtype: else anchor (1) holds)."""
    if not _is_f32(y) or any(is_call(u, _CAST) and u.args[1] in ACTIVATION_DTYPES for u in y.users):
        return None
    split = _split(y)
    if split is None or fake(split[1]) is None:
        return None
    _, multiplier, s32, eps, stats_difference = split
    weight = _multiplier(multiplier) if _is_f32(multiplier) else _model_dtype_multiplier(multiplier)
    weight_difference = weight.pop("difference")
    difference = stats_difference or weight_difference
    if _widened(s32):  # bf16 activations whose fp32 value goes on (a gate, another multiply): not a norm output
        return None
    # fp32 activations: `norms.reject_reason` says so (ACTIVATION_DTYPE)
    source = _fields(s32, None, None, s32, difference=difference)
    return make_match(form="hf", eps=eps, y=y, **weight, **source)


def _widened(s32: fx.Node) -> bool:
    """Whether `s32` is a 16-bit tensor widened to fp32 (`x.float()`, `x.float() + r.float()`)."""
    casts = [s32] if is_call(s32, _CAST) else list(s32.args) if _is_same_dtype_add(s32, torch.float32) else []
    return any(is_call(c, _CAST) and fake_dtype(c.args[0]) in ACTIVATION_DTYPES for c in casts)


def _split(product: fx.Node):
    """`(normed, multiplier, s32, eps, difference)` of `normed * multiplier` (either order), or None."""
    for normed, multiplier in itertools.permutations(product.args):
        found = _normalized_any(normed)
        if found is not None:
            return normed, multiplier, *found
    return None


def _normalized_any(node) -> tuple[fx.Node, float | fx.Node, Reason | None] | None:
    """`(s32, eps, difference)` of a whole-row normalize (difference None), a grouped one, or a look-alike."""
    stats = _normalized(node)
    if stats is not None:
        return (*stats, None)
    stats, grouped = _grouped(node)
    if stats is not None:
        return (*stats, grouped)
    return _look_alike(node)


def _is_f32(node) -> bool:
    val = fake(node)
    return val is not None and val.dtype == torch.float32


def _normalized(node) -> tuple[fx.Node, float | fx.Node] | None:
    """`(s32, eps)` of `s32 * rsqrt(var + eps)` or `s32 / sqrt(var + eps)`."""
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        for s32, rsqrt in itertools.permutations(node.args):
            if is_call(rsqrt, aten.rsqrt.default) and isinstance(s32, fx.Node):
                eps = _variance_eps(rsqrt.args[0], s32)
                if eps is not None:
                    return s32, eps
    if is_call(node, aten.div.Tensor) and is_call(node.args[1], aten.sqrt.default):
        s32 = node.args[0]
        eps = _variance_eps(node.args[1].args[0], s32)
        if eps is not None and isinstance(s32, fx.Node):
            return s32, eps
    return None


def _grouped(node) -> tuple[tuple[fx.Node, float | fx.Node] | None, Reason | None]:
    """`((s32, eps), why)` of `view(normalize(view(s32, [..., G, K/G])), [..., K])`: a norm over groups
    of the channels (transformers' Qwen4-Exp `hc_norm`), which the fused op (one row) cannot compute."""
    if not is_call(node, *RESHAPES) or not isinstance(node.args[0], fx.Node):
        return None, None
    stats = _normalized(node.args[0])
    if stats is None or not is_call(stats[0], *RESHAPES) or not isinstance(stats[0].args[0], fx.Node):
        return None, None
    full, groups, out = fake(stats[0].args[0]), fake(stats[0]), fake(node)
    if full is None or groups is None or out is None or groups.dim() != full.dim() + 1:
        return None, None
    if out.shape != full.shape or groups.shape[:-2] != full.shape[:-1]:
        return None, None
    k, size = full.shape[-1], groups.shape[-1]
    text = f"it normalizes groups of {size} of its {k} channels, not the whole row (a grouped norm)"
    return (stats[0].args[0], stats[1]), Reason(SharedCode.NORM_GROUPED, text)


def _variance_eps(node, s32) -> float | fx.Node | None:
    """eps of `mean(s32**2, -1, keepdim) + eps` (0.0 when the add is gone); None: not that."""
    if _is_mean_square(node, s32):
        return 0.0
    if not is_call(node, aten.add.Tensor, aten.add.Scalar) or len(node.args) != 2 or node.kwargs:
        return None  # add.Scalar: torch's `rms_norm` decomposition (eps rounded to fp32)
    for mean, eps in itertools.permutations(node.args):
        if _is_mean_square(mean, s32):
            value = constant_float(eps)
            if value is not None:
                return value
            if isinstance(eps, fx.Node) and fake(eps) is not None:
                source = eps.args[0] if is_call(eps, _CAST) and eps.args[1] == torch.float32 else None
                if isinstance(source, fx.Node) and fake(source) is not None:
                    eps = source  # the fused op casts it to fp32 itself; its source is a graph input
                return eps  # a runtime eps; `norms.reject_reason` checks it is a usable scalar
    return None


def _look_alike(node) -> tuple[fx.Node, float | fx.Node, Reason] | None:
    """`(s32, eps, why)` of `s32 * rsqrt(mean(z ** p, dims) + eps)` (or `/ sqrt`) that is not a norm of
    `s32`'s rows: statistics of another tensor, over another dim, or of another power."""
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        pairs = [(a, b.args[0]) for a, b in itertools.permutations(node.args) if is_call(b, aten.rsqrt.default)]
    elif is_call(node, aten.div.Tensor) and is_call(node.args[1], aten.sqrt.default):
        pairs = [(node.args[0], node.args[1].args[0])]
    else:
        return None
    for s32, variance in pairs:
        mean: Argument = variance
        eps_arg: Argument = 0.0
        if is_call(variance, aten.add.Tensor, aten.add.Scalar) and len(variance.args) == 2:
            mean, eps_arg = variance.args
            if not is_call(mean, aten.mean.dim):
                eps_arg, mean = mean, eps_arg
        eps: float | fx.Node | None = constant_float(eps_arg)
        if eps is None and isinstance(eps_arg, fx.Node):
            eps = eps_arg
        s32_val = fake(s32)
        if eps is None or not is_call(mean, aten.mean.dim) or not isinstance(s32, fx.Node) or s32_val is None:
            continue
        square, dims_arg = mean.args[0], mean.args[1]
        if not isinstance(dims_arg, (list, tuple)):
            continue
        dims = list(dims_arg)
        if is_call(square, aten.pow.Tensor_Scalar):
            z, power = square.args[0], constant_float(square.args[1])
        elif is_call(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
            z, power = square.args[0], 2.0
        else:
            continue
        ndim = s32_val.dim()
        if _is_centered(s32) and (z is s32 or _is_centered(z)):
            text = "it subtracts the row mean before normalizing (a LayerNorm, e.g. Cohere's), not an RMSNorm"
            return s32, eps, Reason(SharedCode.NORM_CENTERED, text)
        if z is not s32:
            text = f"its statistics come from {getattr(z, 'name', z)}, not from the tensor it normalizes ({s32.name})"
        elif dims not in ([-1], [ndim - 1]):
            text = f"it takes the mean over dim {dims}, not over the last (hidden) dim"
        elif power != 2.0:
            text = f"it takes the mean of x**{power:g}, not of x**2"
        else:
            continue
        return s32, eps, Reason(SharedCode.NORM_ARITHMETIC, text)
    return None


def _is_centered(node) -> bool:
    """`x - mean(x, -1, keepdim)`: a row centred on its mean (LayerNorm), which an RMSNorm does not do."""
    if not is_call(node, aten.sub.Tensor) or len(node.args) != 2:
        return False
    x, mean = node.args
    return is_call(mean, aten.mean.dim) and mean.args[0] is x


def _is_mean_square(node, s32) -> bool:
    if not is_call(node, aten.mean.dim) or not isinstance(s32, fx.Node):
        return False
    square, dims = node.args[0], node.args[1]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    s32_val = fake(s32)
    ndim = s32_val.dim() if s32_val is not None else -1
    if not keepdim or not isinstance(dims, (list, tuple)) or list(dims) not in ([-1], [ndim - 1]):
        return False
    if is_call(square, aten.pow.Tensor_Scalar):
        return square.args[0] is s32 and constant_float(square.args[1]) == 2.0
    return is_call(square, aten.mul.Tensor) and square.args[0] is s32 and square.args[1] is s32


def _norm_input(s32: fx.Node, dtype: torch.dtype, norm_nodes: set) -> dict | None:
    """`x`, `residual`, `residual_out`, `anchor`, `round_sum` and any `difference` of the norm's input."""
    if is_call(s32, _CAST) and s32.args[1] == torch.float32:
        s = s32.args[0]
        if not isinstance(s, fx.Node) or fake_dtype(s) != dtype:
            return None
        if _is_same_dtype_add(s, dtype):
            return _fields(s.args[0], s.args[1], s, s, round_sum=True)
        return _fields(s, None, None, s32)
    if _is_same_dtype_add(s32, torch.float32) and all(is_call(a, _CAST) for a in s32.args):
        x, residual = (a.args[0] for a in s32.args if is_call(a, _CAST))
        if not (fake_dtype(x) == fake_dtype(residual) == dtype):
            return None
        rounded = [u for u in s32.users if is_call(u, _CAST) and u.args[1] == dtype]
        others = [u for u in s32.users if u not in rounded and not _is_norm_read(u, s32)]
        difference = None
        if others or len(rounded) > 1:
            difference = Reason(
                SharedCode.NORM_ARITHMETIC,
                "the fp32 sum `x.float() + residual.float()` is also read in fp32 "
                f"(by {', '.join(o.name for o in others + rounded[1:])}); the fused op returns it rounded to {dtype}",
            )
        return _fields(x, residual, rounded[0] if rounded else None, s32, difference=difference)
    if _is_f32(s32):
        return _fields(s32, None, None, s32)  # fp32 activations: `reject_reason` says why not
    return None


def _fields(x, residual, residual_out, anchor, *, round_sum=False, difference=None) -> dict:
    return {
        "x": x,
        "residual": residual,
        "residual_out": residual_out,
        "anchor": anchor,
        "round_sum": round_sum,
        "difference": difference,
    }


def _is_norm_read(user: fx.Node, s32: fx.Node) -> bool:
    """A node of the norm itself: the square, or `s32 * rsqrt(...)` / `s32 / sqrt(...)`."""
    if is_call(user, aten.pow.Tensor_Scalar):
        return True
    if is_call(user, aten.mul.Tensor, aten.div.Tensor):
        return all(a is s32 or is_call(a, aten.rsqrt.default, aten.sqrt.default) for a in user.args)
    return False


def _is_same_dtype_add(node, dtype: torch.dtype) -> bool:
    """`a + b` of two tensors of one shape and `dtype` (no alpha): a residual add."""
    if not is_call(node, aten.add.Tensor) or node.kwargs or len(node.args) != 2:
        return False
    a, b, out = fake(node.args[0]), fake(node.args[1]), fake(node)
    if a is None or b is None or out is None:
        return False
    return a.shape == b.shape == out.shape and a.dtype == b.dtype == out.dtype == dtype


def _model_dtype_multiplier(m: fx.Node) -> dict:
    """A bf16/fp16 multiplier, as it is (offset 0.0: the op adds nothing to it): Gemma's `1 + w` rounded
    in the model dtype, or the standard norm's weight (`torch.nn.RMSNorm`'s bf16 `w`, promoted)."""
    one_plus = is_call(m, aten.add.Tensor) and not m.kwargs and len(m.args) == 2
    gemma = one_plus and any(constant_float(c) == 1.0 for c in m.args) and any(isinstance(w, fx.Node) for w in m.args)
    return _weight(m, 0.0, standard=not gemma)


def _multiplier(m: fx.Node) -> dict:
    """`weight`, `weight_offset`, `standard`, `difference` with the multiplier = `weight.f32 + offset`."""
    if is_call(m, aten.add.Tensor) and not m.kwargs and len(m.args) == 2:
        for w, c in itertools.permutations(m.args):
            offset = constant_float(c)
            if offset is None or not isinstance(w, fx.Node):
                continue
            inner = w.args[0] if is_call(w, _CAST) and w.args[1] == torch.float32 else w
            if not isinstance(inner, fx.Node):
                continue
            if offset == 1.0:
                return _weight(inner, 1.0)
            if offset == 0.0:  # `0 + w`: the sum itself is the weight (it turns a -0 weight into +0)
                return _weight(m, 0.0, standard=True)
            text = f"the weight multiplier is `{offset:g} + w`, neither the standard `w` nor Gemma's `1 + w`"
            return _weight(inner, offset, difference=Reason(SharedCode.NORM_ARITHMETIC, text))
        scalars = [a for a in m.args if isinstance(a, fx.Node) and (val := fake(a)) is not None and val.dim() == 0]
        if len(scalars) == 1:
            text = (
                f"the weight multiplier is `c + w` with `c` the run-time scalar {scalars[0].name} (dynamic=True "
                "makes a float that is not a literal a graph input); the fused op takes a constant offset"
            )
            return _weight(m, 0.0, difference=Reason(SharedCode.NORM_ARITHMETIC, text))
    if m.op == "get_attr":
        return _weight(m, 0.0)  # freezing folded `1 + w.float()` into one fp32 constant
    inner = m.args[0] if is_call(m, _CAST) else m
    if inner is not m and isinstance(inner, fx.Node) and fake_dtype(inner) in ACTIVATION_DTYPES:
        return _model_dtype_multiplier(inner)  # `w.float()`, `(1 + w).float()`: the cast is exact
    return _weight(m, 0.0, standard=True)  # an fp32 weight: `normalize(x) * w`, one rounding


def _weight(weight: fx.Node, offset: float, *, standard: bool = False, difference: Reason | None = None) -> dict:
    return {"weight": weight, "weight_offset": offset, "standard": standard, "difference": difference}
