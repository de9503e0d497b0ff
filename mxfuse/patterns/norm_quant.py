"""Rewrite 1: a norm (Gemma or standard) whose output is MXFP8-quantized becomes one fused op.

Before (any norm form of :mod:`mxfuse.patterns.norms`, any quant of :mod:`.quants`)::

    y, res_out = gemma_fused_add_rmsnorm(x, res, w, eps)
    q, s       = mxfp8_quantize(y, swizzled)        # -> mxfp8_linear(q, s, ...)
    other(y)                                         # optional bf16 user

After::

    q, s, res_out, y = gemma_fused_add_rmsnorm_mxfp8(x, res, w, eps, swizzled, emit_y=<other users>)

A standard RMSNorm (`normalize(x) * w`) becomes `rms_norm_mxfp8` / `fused_add_rms_norm_mxfp8`
(offset 0; `round_normalized` as its source computes it); the packed forms of rewrite 2 use the
Gemma-named packed ops with `weight_offset=0.0`. The scale layout comes from the quant node.
Quants of the same layout share the fused outputs; a quant with the other layout keeps
reading `y` (then emitted). A quant may read `y` through shape-only views that keep rows whole (`y.reshape(-1, K)` of a
`[batch, seq, K]` model); the fused outputs get the same views (the scales with `K/32`
as last size), and every other user keeps the shape it had. A quant across an
all-gather is not touched here: that is rewrite 2's business.

When a norm that feeds an MXFP8 quant is left alone, :meth:`NormQuant.plan` logs ONE
warning for the graph on the `mxfuse` logger: each such norm's source line, the reason
and the fix where there is one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import fx

from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import call, fake, getitem, has_live_users, redirect_uses, source_line
from mxfuse.patterns.norms import NormMatch, find_norms, reject_reason
from mxfuse.patterns.quants import ViewedQuant, quant_behind_other_view, quant_reject_reason, quants_through_views
from mxfuse.patterns.results import PlanSite, Reason, RefusalCode, SharedCode, Skip

NAME = "norm_quant"
log = logging.getLogger("mxfuse")


class NormQuantCode(RefusalCode):
    """Refusals of rewrite 1 of its own (the norm and quant guards it shares are :class:`SharedCode`)."""

    CROSSES_GATHER = "the output crosses an all-gather before the quant (sp_gather decides)"
    VIEW_NOT_ROWS = "the output reaches the quant through a view that does not keep the rows whole"


FIXES: dict[RefusalCode, str] = {
    SharedCode.ACTIVATION_DTYPE: "run the model in bfloat16 or float16",
    SharedCode.HIDDEN_SIZE: "keep the hidden size static (and a multiple of 32)",
    SharedCode.EPS_NOT_CONSTANT: "pass eps as a Python float (a 0-d host tensor also works)",
    SharedCode.EPS_INVALID: "give the norm a non-negative eps",
    SharedCode.WEIGHT_SHAPE: "keep the norm weight a 1-D [K] tensor",
    SharedCode.NORM_ARITHMETIC: "compute `n = x.float() * rsqrt(mean(x.float()**2, -1) + eps)` and "
    "`(n * (1 + w.float())).to(dtype)` (Gemma) or `w * n.to(dtype)` (Llama), or call torch.ops.mxfuse.gemma_rmsnorm "
    "/ rms_norm, if it is meant to be an RMSNorm (else leave it: this would change its arithmetic)",
    SharedCode.NORM_DTYPES: "give the norm weight the activations' dtype (bfloat16/float16) and cast the output back",
    SharedCode.NORM_KERNEL: "leave vLLM's IR priority for the norm at its default (native), e.g. VLLM_USE_OINK_OPS=0 "
    "or VLLM_ROCM_USE_AITER_RMSNORM=0",
    NormQuantCode.VIEW_NOT_ROWS: "quantize a view that keeps rows whole, e.g. `x.reshape(-1, K)`",
    SharedCode.RESIDUAL_MISMATCH: "give the residual the input's shape and dtype",
    SharedCode.ALLREDUCE_FUSED: "none needed at decode: the compile ranges above max_token_num reach mxfuse as "
    'all_reduce -> norm and fuse there; `"pass_config": {"fuse_allreduce_rms": false}` in vLLM\'s compilation '
    "config trades vLLM's all-reduce fusion for mxfuse's norm->quant fusion in every range (README: Where it applies)",
}
"""The change that makes a norm fuse, per reason (a reason without an entry has no simple fix)."""
_NOT_WARNED = (SharedCode.NO_QUANT, NormQuantCode.CROSSES_GATHER)  # nothing to fuse here / rewrite 2 reports it


@dataclass(frozen=True)
class NormQuantKind:
    """A norm and its quant(s) became one fused op (`str()`: `norm->quant_form_quant:layout[+y]`)."""

    norm_kind: str
    quant_form: str
    layout: str  # "rowmajor" | "swizzled"
    writes_y: bool
    rewrite = NAME
    fuses_norm = True
    packed_gather = False

    def __str__(self) -> str:
        return f"{self.norm_kind}->{self.quant_form}_quant:{self.layout}{'+y' if self.writes_y else ''}"


@dataclass(frozen=True)
class NormQuantFusion:
    """One planned rewrite: a norm and the quants that its fused op replaces."""

    norm: NormMatch
    quants: tuple[ViewedQuant, ...]
    swizzled: bool
    emit_y: bool

    @property
    def site(self) -> fx.Node:
        return self.norm.y

    @property
    def replaced(self) -> list[fx.Node]:
        return [self.norm.y, *(q.quant.reads for q in self.quants)]

    @property
    def kind(self) -> NormQuantKind:
        layout = "swizzled" if self.swizzled else "rowmajor"
        return NormQuantKind(self.norm.kind, self.quants[0].quant.form, layout, self.emit_y)


def skip(norm: NormMatch, reason: Reason) -> Skip:
    return Skip(NAME, norm.y, norm.kind, reason.code, reason.text, warn=_warning_line(norm, reason))


class NormQuant:
    """Rewrite 1 (see the module docstring); built by the pass only when `fuse_norm_quant` is on."""

    name = NAME
    warning_head = "norm(s) feeding an MXFP8 quant not fused in this graph"

    def __init__(self):
        self._moved: dict[fx.Node, fx.Node] = {}  # planned node -> what replaced it, in this run's applies

    def plan(self, graph: fx.Graph, plan_site: PlanSite) -> list[NormQuantFusion | Skip]:
        """Decide every rewrite without touching the graph."""
        return [
            plan_site(NAME, norm.y, norm.kind, functools.partial(plan_one, norm))
            for norm in find_norms(graph)
            if not _is_dead(norm)  # else left behind by an earlier rewrite; erased after the pass
        ]

    def apply(self, graph: fx.Graph, fusion: NormQuantFusion) -> fx.Node:
        """Insert the fused op and rewire the users; returns the fused node.

        The norm's inputs are read through what earlier fusions of this run replaced (chained
        layers: a norm's residual is the previous fused op's residual output). Dead nodes
        stay; the pass erases them.
        """
        norm = moved(fusion.norm, self._moved)
        rule = fusion.quants[0].quant.rule  # the encoding the matched quants use
        out = insert_fused_norm(graph, norm, swizzled=fusion.swizzled, emit_y=fusion.emit_y, rule=rule)
        x_val = fake(norm.x)
        assert x_val is not None, "plan_one fuses only norms whose input has a fake value"
        k = x_val.shape[-1]
        for viewed in fusion.quants:
            viewed.replace_outputs(graph, out["codes"], out["scales"], k)
        if fusion.emit_y:
            replaced = {q.quant.reads for q in fusion.quants}
            redirect_uses(norm.y, out["y"], keep=lambda user: user in replaced)
            self._moved[norm.y] = out["y"]
        if norm.residual_out is not None:  # insert_fused_norm returns "residual_out" exactly then
            self._moved[norm.residual_out] = out["residual_out"]
        return out["fused"]


def moved(norm: NormMatch, replaced: Mapping[fx.Node, fx.Node]) -> NormMatch:
    """`norm` with its inputs read through `replaced` (planned node -> the node now standing for it;
    an entry whose node a rollback erased no longer holds)."""

    def now(node):
        new = replaced.get(node)
        return node if new is None or getattr(new, "_erased", False) else new

    x, residual = now(norm.x), now(norm.residual)
    if x is norm.x and residual is norm.residual:
        return norm
    return replace(norm, x=x, residual=residual)


def _is_dead(norm: NormMatch) -> bool:
    return not has_live_users(norm.y) and (norm.residual_out is None or not has_live_users(norm.residual_out))


def plan_one(norm: NormMatch) -> NormQuantFusion | Skip:
    """The fusion of one norm with the quants reading it, or why not."""
    viewed = quants_through_views(norm.y)
    nothing_to_fuse = no_quant_reason(norm) if not viewed else None
    if nothing_to_fuse is not None and nothing_to_fuse.code is SharedCode.NO_QUANT:
        return skip(norm, nothing_to_fuse)  # no quant reads it: its dtype or shape is not why it stays
    reason = reject_reason(norm, runtime_eps=True)
    if reason is not None:
        return skip(norm, reason)
    if nothing_to_fuse is not None:
        return skip(norm, nothing_to_fuse)
    usable = [v for v in viewed if quant_reject_reason(v.quant) is None]
    if not usable:
        reason = quant_reject_reason(viewed[0].quant)
        assert reason is not None  # no quant is usable
        return skip(norm, reason)
    first = usable[0].quant
    chosen = tuple(v for v in usable if v.quant.swizzled == first.swizzled and v.quant.form == first.form)
    return NormQuantFusion(norm, chosen, first.swizzled, _keeps_other_users(norm.y, chosen))


def _keeps_other_users(y: fx.Node, chosen: tuple[ViewedQuant, ...]) -> bool:
    """Whether anything but the chosen quants (and views read only by them) reads `y`."""
    consumed = {v.quant.reads for v in chosen}
    views = {view for v in chosen for view in v.views}
    changed = True
    while changed:
        changed = False
        for view in views - consumed:
            if all(u in consumed for u in view.users):
                consumed.add(view)
                changed = True
    return any(user not in consumed for user in y.users)


def feeds_quant(norm: NormMatch) -> bool:
    """Whether an MXFP8 quant reads the norm's output, directly or through any view."""
    return bool(quants_through_views(norm.y)) or quant_behind_other_view(norm.y) is not None


def _warning_line(norm: NormMatch, reason: Reason) -> str | None:
    """This norm's line of the graph's one warning: it feeds an MXFP8 quant and was left alone."""
    if reason.code in _NOT_WARNED or not feeds_quant(norm):
        return None
    where = source_line(norm.y) or source_line(norm.anchor) or "(no source line recorded)"
    fix = FIXES.get(reason.code)
    return f"  {where} [{norm.kind}]: {reason.text}" + (f"; fix: {fix}" if fix else "")


def no_quant_reason(norm: NormMatch) -> Reason:
    from mxfuse.patterns.collectives import match_all_gather  # only for the message

    for user in norm.y.users:
        if match_all_gather(user) is not None:
            return Reason(
                NormQuantCode.CROSSES_GATHER,
                "its output crosses an all-gather before the quant (rewrite 2, sp_gather, decides)",
            )
    view = quant_behind_other_view(norm.y)
    if view is not None:
        view_val = fake(view)
        shape = tuple(view_val.shape) if view_val is not None else "?"
        return Reason(
            NormQuantCode.VIEW_NOT_ROWS,
            f"the MXFP8 quant reads its output through {view.name} ({view.target}, shape {shape}), "
            "a view that does not keep rows [K] whole",
        )
    return Reason(SharedCode.NO_QUANT, "no MXFP8 quant reads its output")


def insert_fused_norm(
    graph: fx.Graph,
    norm: NormMatch,
    *,
    packed: bool = False,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: QuantRule = QuantRule.DEFAULT,
) -> dict[str, fx.Node]:
    """Insert the fused norm+quant op standing in for `norm` (before its first node).

    Rewires the norm's residual output to the fused one (y is the caller's: only it
    knows which users to keep). Returns the new nodes by name: "fused", then "codes"
    and "scales" (or "packed": one `[M, K + K/32]` byte buffer), "residual_out" when
    the norm's is used, "y" when `emit_y`.
    """
    mx = torch.ops.mxfuse
    standard_op = norm.standard and not packed  # rms_norm_mxfp8 / fused_add_rms_norm_mxfp8: no offset argument
    flags: dict = {"emit_y": emit_y} if standard_op else {"emit_y": emit_y, "weight_offset": norm.weight_offset}
    if norm.round_normalized or norm.standard:
        flags["round_normalized"] = norm.round_normalized
    if not packed:
        flags = {"swizzled": swizzled, **flags}
        if rule != QuantRule.DEFAULT:  # torchao's NaN / scale-byte-0 encoding (see QuantRule)
            flags["rule"] = int(rule)
    eps = norm.eps
    if isinstance(eps, fx.Node):  # a runtime eps (e.g. dynamic=True): an operand of the unpacked ops
        if packed:
            raise ValueError(f"insert_fused_norm: the packed ops take a constant eps, not the tensor {eps.name}")
        eps, flags["eps_tensor"] = 0.0, eps
    if norm.has_residual:
        op = mx.gemma_fused_add_rmsnorm_mxfp8_packed if packed else mx.gemma_fused_add_rmsnorm_mxfp8
        op = mx.fused_add_rms_norm_mxfp8 if standard_op else op
        args: tuple[object, ...] = (norm.x, norm.residual, norm.weight, eps)
        flags["round_sum"] = norm.round_sum
    else:
        op = mx.gemma_rmsnorm_mxfp8_packed if packed else mx.gemma_rmsnorm_mxfp8
        op = mx.rms_norm_mxfp8 if standard_op else op
        args = (norm.x, norm.weight, eps)
    names = (["packed"] if packed else ["codes", "scales"]) + (["residual_out"] if norm.has_residual else []) + ["y"]
    wanted = {"packed", "codes", "scales"}
    wanted |= {"residual_out"} if norm.residual_out is not None else set()
    wanted |= {"y"} if emit_y else set()
    with graph.inserting_before(norm.anchor):
        fused = call(graph, op.default, args, flags)
        fused.meta["stack_trace"] = norm.y.meta.get("stack_trace") or norm.anchor.meta.get("stack_trace")
        out = {name: getitem(graph, fused, i) for i, name in enumerate(names) if name in wanted}
    if norm.residual_out is not None:
        redirect_uses(norm.residual_out, out["residual_out"])
    return {"fused": fused, **out}
