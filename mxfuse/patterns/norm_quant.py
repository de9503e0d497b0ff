"""Rewrite 1: a Gemma norm whose output is MXFP8-quantized becomes one fused op.

Before (any norm form of :mod:`mxfuse.patterns.norms`, any quant of :mod:`.quants`)::

    y, res_out = gemma_fused_add_rmsnorm(x, res, w, eps)
    q, s       = mxfp8_quantize(y, swizzled)        # -> mxfp8_linear(q, s, ...)
    other(y)                                         # optional bf16 user

After::

    q, s, res_out, y = gemma_fused_add_rmsnorm_mxfp8(x, res, w, eps, swizzled, emit_y=<other users>)

The scale layout comes from the quant node. Quants of the same layout share the
fused outputs; a quant with the other layout keeps reading `y` (then emitted). A quant
may read `y` through shape-only views that keep rows whole (`y.reshape(-1, K)` of a
`[batch, seq, K]` model); the fused outputs get the same views (the scales with `K/32`
as last size), and every other user keeps the shape it had. A quant across an
all-gather is not touched here: that is rewrite 2's business.

When a norm that feeds an MXFP8 quant is left alone, :meth:`NormQuant.plan` logs ONE
warning for the graph on the `mxfuse` logger: each such norm's source line, the reason
and the fix where there is one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.fx_utils import call, fake, getitem, has_live_users, redirect_uses, source_line
from mxfuse.patterns.norms import NormMatch, find_norms, match_norm, reject_reason
from mxfuse.patterns.quants import (
    ViewedQuant,
    quant_behind_other_view,
    quant_reject_reason,
    quants_through_views,
    replay_views,
)
from mxfuse.patterns.results import FusionKind, Reason, Skip, SkipCode, plan_site
from mxfuse.patterns.torchao_quant import TorchaoQuantMatch, torchao_quant_users

if TYPE_CHECKING:
    from mxfuse.passes.options import PassOptions

NAME = "norm_quant"
log = logging.getLogger("mxfuse")

FIXES = {
    SkipCode.ACTIVATION_DTYPE: "run the model in bfloat16 or float16",
    SkipCode.HIDDEN_SIZE: "keep the hidden size static (and a multiple of 32)",
    SkipCode.EPS_NOT_CONSTANT: "pass eps as a Python float (a 0-d host tensor also works)",
    SkipCode.WEIGHT_SHAPE: "keep the norm weight a 1-D [K] tensor",
    SkipCode.NORM_ARITHMETIC: "compute `(x.float() * rsqrt(mean(x.float()**2) + eps) * (1 + w.float())).to(dtype)` "
    "as transformers' GemmaRMSNorm does, or call torch.ops.mxfuse.gemma_rmsnorm",
    SkipCode.VIEW_NOT_ROWS: "quantize a view that keeps rows whole, e.g. `x.reshape(-1, K)`",
    SkipCode.RESIDUAL_MISMATCH: "give the residual the input's shape and dtype",
}
"""The change that makes a norm fuse, per reason (a reason without an entry has no simple fix)."""
_NOT_WARNED = (SkipCode.NO_QUANT, SkipCode.CROSSES_GATHER)  # nothing to fuse here / rewrite 2 reports it


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
    def kind(self) -> FusionKind:
        return FusionKind(
            rewrite=NAME,
            norm_kind=self.norm.kind,
            fuses_norm=True,
            writes_y=self.emit_y,
            packed_gather=False,
            site="norm_quant",
            layout="swizzled" if self.swizzled else "rowmajor",
            quant_form=self.quants[0].quant.form,
        )


def skip(norm: NormMatch, reason: Reason) -> Skip:
    return Skip(NAME, norm.y, norm.kind, reason.code, reason.text)


class NormQuant:
    """Rewrite 1 (see the module docstring)."""

    name = NAME

    def plan(self, graph: fx.Graph, options: PassOptions) -> list[NormQuantFusion | Skip]:
        """Decide every rewrite without touching the graph."""
        if not options.fuse_norm_quant:
            return []
        planned: list[NormQuantFusion | Skip] = []
        unfused: list[tuple[NormMatch, Skip]] = []
        for norm in find_norms(graph):
            if not _is_dead(norm):  # else left behind by an earlier rewrite; erased after the pass
                planned.append(plan_site(NAME, norm.y, norm.kind, options, lambda norm=norm: plan_one(norm)))
                if isinstance(planned[-1], Skip) and planned[-1].code not in _NOT_WARNED:
                    unfused.append((norm, planned[-1]))
        text = warning_text(unfused) if unfused else ""
        if text:
            log.warning("%s", text)
        return planned

    def apply(self, graph: fx.Graph, fusion: NormQuantFusion, options: PassOptions) -> fx.Node | None:
        """Insert the fused op and rewire the users; returns the fused node (None: no longer applies).

        The plan is re-derived from the graph first: an earlier fusion may have rewired
        this norm's inputs (chained layers). Dead nodes stay; the pass erases them.
        """
        found = match_norm(fusion.norm.y)
        fusion = plan_one(found) if found is not None else None
        if not isinstance(fusion, NormQuantFusion):
            return None
        norm = fusion.norm
        rule = fusion.quants[0].quant.rule  # the encoding the matched quant uses
        out = insert_fused_norm(graph, norm, swizzled=fusion.swizzled, emit_y=fusion.emit_y, rule=rule)
        codes, scales = out["codes"], out["scales"]
        if fusion.quants[0].quant.flat_swizzled_scales:
            with graph.inserting_after(scales):
                scales = call(graph, torch.ops.aten.view.default, (scales, [-1]))
        k = fake(norm.x).shape[-1]
        for viewed in fusion.quants:
            quant = viewed.quant
            if isinstance(quant, TorchaoQuantMatch):  # its codes/scales need torchao's views and dtypes
                quant.replace_outputs(graph, out["codes"], out["scales"])
                continue
            with graph.inserting_before(quant.node):  # the views' size operands are defined by now
                if quant.codes is not None:
                    _replace(quant.codes, replay_views(graph, viewed.views, codes, k))
                if quant.scales is not None:
                    rows = fusion.swizzled  # swizzled scales are 2-D over all rows: no view to replay
                    _replace(quant.scales, scales if rows else replay_views(graph, viewed.views, scales, k // 32))
        if fusion.emit_y:
            replaced = {q.quant.reads for q in fusion.quants}
            redirect_uses(norm.y, out["y"], keep=lambda user: user in replaced)
        return out["fused"]


def _is_dead(norm: NormMatch) -> bool:
    return not has_live_users(norm.y) and (norm.residual_out is None or not has_live_users(norm.residual_out))


def plan_one(norm: NormMatch) -> NormQuantFusion | Skip:
    """The fusion of one norm with the quants reading it, or why not."""
    viewed = quants_through_views(norm.y) + [ViewedQuant(q, ()) for q in torchao_quant_users(norm.y)]
    reason = reject_reason(norm, runtime_eps=True)
    if reason is not None:
        return skip(norm, reason)
    if not viewed:
        return skip(norm, no_quant_reason(norm))
    usable = [v for v in viewed if quant_reject_reason(v.quant) is None]
    if not usable:
        return skip(norm, quant_reject_reason(viewed[0].quant))
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
    return (
        bool(quants_through_views(norm.y))
        or bool(torchao_quant_users(norm.y))
        or quant_behind_other_view(norm.y) is not None
    )


def warning_text(unfused: list[tuple[NormMatch, Skip]]) -> str:
    """The one warning of a graph: each Gemma norm that feeds an MXFP8 quant and was left alone."""
    lines = []
    for norm, skipped in unfused:
        if not feeds_quant(norm):
            continue
        where = source_line(norm.y) or source_line(norm.anchor) or "(no source line recorded)"
        fix = FIXES.get(skipped.code)
        lines.append(f"  {where} [{norm.kind}]: {skipped.reason}" + (f"; fix: {fix}" if fix else ""))
    if not lines:
        return ""
    head = f"mxfuse: {len(lines)} Gemma norm(s) feeding an MXFP8 quant not fused in this graph:"
    return "\n".join([head, *lines])


def no_quant_reason(norm: NormMatch) -> Reason:
    from mxfuse.patterns.collectives import match_all_gather  # only for the message

    for user in norm.y.users:
        if match_all_gather(user) is not None:
            return Reason(
                SkipCode.CROSSES_GATHER,
                "its output crosses an all-gather before the quant (rewrite 2, sp_gather, decides)",
            )
    view = quant_behind_other_view(norm.y)
    if view is not None:
        shape = tuple(fake(view).shape) if fake(view) is not None else "?"
        return Reason(
            SkipCode.VIEW_NOT_ROWS,
            f"the MXFP8 quant reads its output through {view.name} ({view.target}, shape {shape}), "
            "a view that does not keep rows [K] whole",
        )
    return Reason(SkipCode.NO_QUANT, "no MXFP8 quant reads its output")


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
    flags = {"emit_y": emit_y, "weight_offset": norm.weight_offset}
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
        args, flags["round_sum"] = (norm.x, norm.residual, norm.weight, eps), norm.round_sum
    else:
        op = mx.gemma_rmsnorm_mxfp8_packed if packed else mx.gemma_rmsnorm_mxfp8
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


def _replace(old: fx.Node | None, new: fx.Node):
    if old is not None:
        redirect_uses(old, new)


def example_inputs(m: int = 4, k: int = 64, dtype=torch.bfloat16, device="cpu"):
    """Small `(x, residual, weight, eps)` for building graphs of every form in tests."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
    residual = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
    weight = (0.1 * torch.randn(k, generator=g)).to(dtype=dtype, device=device)
    return x, residual, weight, 1e-6
