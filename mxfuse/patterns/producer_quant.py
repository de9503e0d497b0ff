"""Rewrite 1: a producer whose output is MXFP8-quantized becomes one fused op (producer -> quant).

Before (any producer of :mod:`.producer_registry`, e.g. a norm of :mod:`.norms`, and any quant
of :mod:`.quants`)::

    y, res_out = gemma_fused_add_rmsnorm(x, res, w, eps)
    q, s       = mxfp8_quantize(y, swizzled)        # -> mxfp8_linear(q, s, ...)
    other(y)                                         # optional bf16 user

After::

    q, s, res_out, y = gemma_fused_add_rmsnorm_mxfp8(x, res, w, eps, swizzled, emit_y=<other users>)

The fused op is the producer's row of :data:`~mxfuse.patterns.producers.FUSED_OPS` (its
:meth:`~mxfuse.patterns.producers.ProducerMatch.fused_call`): a standard RMSNorm
(`normalize(x) * w`) becomes `rms_norm_mxfp8` / `fused_add_rms_norm_mxfp8`, and so on. The
scale layout and the quant's NaN / scale-byte-0 rule come from the quant node. Quants of the
same layout share the fused outputs; a quant with the other layout keeps reading `y` (then
emitted). A quant may read `y` through shape-only views that keep rows whole (`y.reshape(-1, K)`
of a `[batch, seq, K]` model); the fused outputs get the same views (the scales with `K/32`
as last size), and every other user keeps the shape it had. A quant across an
all-gather is not touched here: that is rewrite 2's business.

When a producer that feeds an MXFP8 quant is left alone, :meth:`ProducerQuant.plan` logs ONE
warning for the graph on the `mxfuse` logger: each such producer's source line, its kind, the
reason and the fix where there is one (the refusal code's).

The rewrite keeps the name `norm_quant` (:data:`NAME`): it is the `rewrite` of the JSON report
and of the dump index, and its option is `fuse_norm_quant`; both are what users read and set.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from torch import fx

from mxfuse.patterns.fx_utils import fake, has_live_users, redirect_uses, source_line
from mxfuse.patterns.producer_registry import find_producers
from mxfuse.patterns.producers import ProducerFamily, ProducerMatch, insert_fused
from mxfuse.patterns.quants import ViewedQuant, quant_behind_other_view, quant_reject_reason, quants_through_views
from mxfuse.patterns.results import PlanSite, Reason, RefusalCode, Scope, SharedCode, Skip

NAME = "norm_quant"
log = logging.getLogger("mxfuse")


class ProducerQuantCode(RefusalCode):
    """Refusals of rewrite 1 of its own (the producer and quant guards it shares are :class:`SharedCode`)."""

    CROSSES_GATHER = "the output crosses an all-gather before the quant (sp_gather decides)"
    VIEW_NOT_ROWS = (
        "the output reaches the quant through a view that does not keep the rows whole",
        "quantize a view that keeps rows whole, e.g. `x.reshape(-1, K)`",
    )

    @property
    def defers(self) -> bool:
        return self is ProducerQuantCode.CROSSES_GATHER  # rewrite 2 decides (and reports) it


@dataclass(frozen=True)
class ProducerQuantKind:
    """A producer and its quant(s) became one fused op (`str()`: `producer_kind->quant_form_quant:layout[+y]`)."""

    producer_kind: str
    quant_form: str
    layout: str  # "rowmajor" | "swizzled"
    writes_y: bool
    family: ProducerFamily
    rewrite = NAME
    fuses_producer = True
    packed_gather = False

    def __str__(self) -> str:
        return f"{self.producer_kind}->{self.quant_form}_quant:{self.layout}{'+y' if self.writes_y else ''}"


@dataclass(frozen=True)
class ProducerQuantFusion:
    """One planned rewrite: a producer and the quants that its fused op replaces."""

    producer: ProducerMatch
    quants: tuple[ViewedQuant, ...]
    swizzled: bool
    emit_y: bool

    @property
    def site(self) -> fx.Node:
        return self.producer.y

    @property
    def replaced(self) -> list[fx.Node]:
        return [self.producer.y, *(q.quant.reads for q in self.quants)]

    @property
    def kind(self) -> ProducerQuantKind:
        layout = "swizzled" if self.swizzled else "rowmajor"
        p = self.producer
        return ProducerQuantKind(p.kind, self.quants[0].quant.form, layout, self.emit_y, p.family)


def skip(producer: ProducerMatch, reason: Reason) -> Skip:
    return Skip(NAME, producer.y, producer.kind, reason.code, reason.text, warn=_warning_line(producer, reason))


class ProducerQuant:
    """Rewrite 1 (see the module docstring); built by the pass only when `fuse_norm_quant` is on."""

    name = NAME
    warning_head = "producer(s) (norm, activation, ...) feeding an MXFP8 quant not fused in this graph"
    undo = Scope.SITE

    def __init__(self) -> None:
        self._moved: dict[fx.Node, fx.Node] = {}  # planned node -> what replaced it, in this run's applies

    def plan(self, graph: fx.Graph, plan_site: PlanSite) -> list[ProducerQuantFusion | Skip]:
        """Decide every rewrite without touching the graph."""
        return [
            plan_site(NAME, producer.y, producer.kind, functools.partial(plan_one, producer))
            for producer in find_producers(graph)
            if not _is_dead(producer)  # else left behind by an earlier rewrite; erased after the pass
        ]

    def apply(self, graph: fx.Graph, fusion: ProducerQuantFusion) -> fx.Node:
        """Insert the fused op and rewire the users; returns the fused node.

        The producer's inputs are read through what earlier fusions of this run replaced
        (chained layers: a norm's residual is the previous fused op's residual output). Dead
        nodes stay; the pass erases them.
        """
        producer = fusion.producer.moved(self._moved)
        rule = fusion.quants[0].quant.rule  # the encoding the matched quants use
        out = insert_fused(graph, producer, swizzled=fusion.swizzled, emit_y=fusion.emit_y, rule=rule)
        y_val = fake(producer.y)
        assert y_val is not None, "plan_one fuses only producers whose output has a fake value"
        k = y_val.shape[-1]
        for viewed in fusion.quants:
            viewed.replace_outputs(graph, out["codes"], out["scales"], k)
        if fusion.emit_y:
            replaced = {q.quant.reads for q in fusion.quants}
            redirect_uses(producer.y, out["y"], keep=lambda user: user in replaced)
            self._moved[producer.y] = out["y"]
        for name, node in producer.side_outputs().items():  # insert_fused rewired their users
            self._moved[node] = out[name]
        return out["fused"]


def _is_dead(producer: ProducerMatch) -> bool:
    return not any(has_live_users(node) for node in (producer.y, *producer.side_outputs().values()))


def plan_one(producer: ProducerMatch) -> ProducerQuantFusion | Skip:
    """The fusion of one producer with the quants reading it, or why not."""
    viewed = quants_through_views(producer.y)
    nothing_to_fuse = no_quant_reason(producer.y) if not viewed else None
    if nothing_to_fuse is not None and nothing_to_fuse.code is SharedCode.NO_QUANT:
        return skip(producer, nothing_to_fuse)  # no quant reads it: its dtype or shape is not why it stays
    reason = producer.reject_reason()
    if reason is not None:
        return skip(producer, reason)
    if nothing_to_fuse is not None:
        return skip(producer, nothing_to_fuse)
    usable = [v for v in viewed if quant_reject_reason(v.quant) is None]
    if not usable:
        reason = quant_reject_reason(viewed[0].quant)
        assert reason is not None  # no quant is usable
        return skip(producer, reason)
    first = usable[0].quant
    chosen = tuple(v for v in usable if v.quant.swizzled == first.swizzled and v.quant.form == first.form)
    return ProducerQuantFusion(producer, chosen, first.swizzled, _keeps_other_users(producer.y, chosen))


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


def feeds_quant(y: fx.Node) -> bool:
    """Whether an MXFP8 quant reads `y`, directly or through any view."""
    return bool(quants_through_views(y)) or quant_behind_other_view(y) is not None


def _warning_line(producer: ProducerMatch, reason: Reason) -> str | None:
    """This producer's line of the graph's one warning: it feeds an MXFP8 quant and was left alone."""
    code = reason.code
    if code is SharedCode.NO_QUANT or code.defers or not feeds_quant(producer.y):
        return None  # nothing to fuse here, or another rewrite reports it
    where = source_line(producer.y) or source_line(producer.anchor) or "(no source line recorded)"
    return f"  {where} [{producer.kind}]: {reason.text}" + (f"; fix: {code.fix}" if code.fix else "")


def no_quant_reason(y: fx.Node) -> Reason:
    """Why no quant of `y` is fused: it crosses an all-gather, a view splits its rows, or no quant reads it."""
    from mxfuse.patterns.collectives import match_all_gather  # only for the message

    for user in y.users:
        if match_all_gather(user) is not None:
            return Reason(
                ProducerQuantCode.CROSSES_GATHER,
                "its output crosses an all-gather before the quant (rewrite 2, sp_gather, decides)",
            )
    view = quant_behind_other_view(y)
    if view is not None:
        view_val = fake(view)
        shape = tuple(view_val.shape) if view_val is not None else "?"
        return Reason(
            ProducerQuantCode.VIEW_NOT_ROWS,
            f"the MXFP8 quant reads its output through {view.name} ({view.target}, shape {shape}), "
            "a view that does not keep rows [K] whole",
        )
    return Reason(SharedCode.NO_QUANT, "no MXFP8 quant reads its output")
