"""Rewrite 1: a Gemma norm whose output is MXFP8-quantized becomes one fused op.

Before (any norm form of :mod:`mxfuse.patterns.norms`, any quant of :mod:`.quants`)::

    y, res_out = gemma_fused_add_rmsnorm(x, res, w, eps)
    q, s       = mxfp8_quantize(y, swizzled)        # -> mxfp8_linear(q, s, ...)
    other(y)                                         # optional bf16 user

After::

    q, s, res_out, y = gemma_fused_add_rmsnorm_mxfp8(x, res, w, eps, swizzled, emit_y=<other users>)

The scale layout comes from the quant node. Quants of the same layout share the
fused outputs; a quant with the other layout keeps reading `y` (then emitted). A
quant that does not read the norm directly (e.g. across an all-gather) is not
touched here: that is rewrite 2's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from mxfuse.patterns.fx_utils import call, getitem, has_live_users, redirect_uses
from mxfuse.patterns.norms import NormMatch, find_norms, match_norm, reject_reason
from mxfuse.patterns.quants import QuantMatch, quant_reject_reason, quant_users
from mxfuse.patterns.results import FusionKind, Reason, Skip, SkipCode, plan_site

if TYPE_CHECKING:
    from mxfuse.passes.options import PassOptions

NAME = "norm_quant"


@dataclass(frozen=True)
class NormQuantFusion:
    """One planned rewrite: a norm and the quants that its fused op replaces."""

    norm: NormMatch
    quants: tuple[QuantMatch, ...]
    swizzled: bool
    emit_y: bool

    @property
    def site(self) -> fx.Node:
        return self.norm.y

    @property
    def replaced(self) -> list[fx.Node]:
        return [self.norm.y, *(q.node for q in self.quants)]

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
            quant_form=self.quants[0].form,
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
        for norm in find_norms(graph):
            if not _is_dead(norm):  # else left behind by an earlier rewrite; erased after the pass
                planned.append(plan_site(NAME, norm.y, norm.kind, options, lambda norm=norm: plan_one(norm)))
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
        out = insert_fused_norm(graph, norm, swizzled=fusion.swizzled, emit_y=fusion.emit_y)
        codes, scales = out["codes"], out["scales"]
        if fusion.quants[0].flat_swizzled_scales:
            with graph.inserting_after(scales):
                scales = call(graph, torch.ops.aten.view.default, (scales, [-1]))
        for quant in fusion.quants:
            _replace(quant.codes, codes)
            _replace(quant.scales, scales)
        if fusion.emit_y:
            replaced = {q.node for q in fusion.quants}
            redirect_uses(norm.y, out["y"], keep=lambda user: user in replaced)
        return out["fused"]


def _is_dead(norm: NormMatch) -> bool:
    return not has_live_users(norm.y) and (norm.residual_out is None or not has_live_users(norm.residual_out))


def plan_one(norm: NormMatch) -> NormQuantFusion | Skip:
    """The fusion of one norm with the quants reading it, or why not."""
    reason = reject_reason(norm)
    if reason is not None:
        return skip(norm, reason)
    quants = quant_users(norm.y)
    if not quants:
        return skip(norm, no_quant_reason(norm))
    usable = [q for q in quants if quant_reject_reason(q) is None]
    if not usable:
        return skip(norm, quant_reject_reason(quants[0]))
    chosen = tuple(q for q in usable if q.swizzled == usable[0].swizzled and q.form == usable[0].form)
    replaced = {q.node for q in chosen}
    emit_y = any(user not in replaced for user in norm.y.users)
    return NormQuantFusion(norm, chosen, usable[0].swizzled, emit_y)


def no_quant_reason(norm: NormMatch) -> Reason:
    from mxfuse.patterns.collectives import match_all_gather  # only for the message

    for user in norm.y.users:
        if match_all_gather(user) is not None:
            return Reason(
                SkipCode.CROSSES_GATHER,
                "its output crosses an all-gather before the quant (rewrite 2, sp_gather, decides)",
            )
    return Reason(SkipCode.NO_QUANT, "no MXFP8 quant reads its output")


def insert_fused_norm(
    graph: fx.Graph, norm: NormMatch, *, packed: bool = False, swizzled: bool = False, emit_y: bool = False
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
    if norm.has_residual:
        op = mx.gemma_fused_add_rmsnorm_mxfp8_packed if packed else mx.gemma_fused_add_rmsnorm_mxfp8
        args, flags["round_sum"] = (norm.x, norm.residual, norm.weight, norm.eps), norm.round_sum
    else:
        op = mx.gemma_rmsnorm_mxfp8_packed if packed else mx.gemma_rmsnorm_mxfp8
        args = (norm.x, norm.weight, norm.eps)
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
