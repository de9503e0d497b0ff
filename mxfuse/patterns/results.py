"""Typed results of the rewrites: what a fusion is, why a site was left alone, the rewrite interface.

Readers (the pass report, `mxfuse explain`, the CLI) use these fields; the strings
(`str(FusionKind)`, `SkipRecord.reason`) are for people and the JSON report only,
never parsed back.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from torch import fx

if TYPE_CHECKING:
    from mxfuse.passes.options import PassOptions

log = logging.getLogger("mxfuse")
T = TypeVar("T")


@functools.total_ordering
@dataclass(frozen=True)
class FusionKind:
    """What one applied rewrite did; `str()` is the kind string of the report (`a->b:c`).

    rewrite: "norm_quant" | "sp_gather" | ... (the rewrite's `name`).
    norm_kind: the norm's form and variant ("mxfuse:fused_add", "hf:plain", ...); None: no norm.
    fuses_norm: the norm went into a fused kernel.
    writes_y: the norm's bf16 output still goes to memory (emitted, kept, or gathered in bf16).
    packed_gather: an all-gather carries the packed MXFP8 buffer `[M, K + K/32]`.
    quant_form: the quant op replaced ("mxfuse" | "vllm"); layout: "rowmajor" | "swizzled" |
    "rowmajor+swizzled"; gather_form: the collective family ("c10d" | "vllm");
    site: which form of its rewrite matched ("norm_quant"; sp_gather: "norm_gather",
    "repair" (swizzled codes/scales gathered), "two_gathers" (row-major, two collectives)).
    """

    rewrite: str
    norm_kind: str | None
    fuses_norm: bool
    writes_y: bool
    packed_gather: bool
    site: str
    layout: str = "rowmajor"
    quant_form: str | None = None
    gather_form: str | None = None
    keeps_bf16_gather: bool = False
    padded: bool = False

    def __str__(self) -> str:
        if self.site == "sequence_parallel":
            return f"sequence_parallel:{self.gather_form}_all_reduce->reduce_scatter{'+pad' if self.padded else ''}"
        if self.site == "norm_quant":
            return f"{self.norm_kind}->{self.quant_form}_quant:{self.layout}{'+y' if self.writes_y else ''}"
        if self.site == "norm_gather":
            src = self.norm_kind if self.fuses_norm else f"{self.norm_kind}(unfused)"
            extra = "+bf16_gather" if self.keeps_bf16_gather else ""
            return f"{src}->{self.gather_form}_gather:mxfp8_packed:{self.layout}{extra}"
        what = "repair:swizzled" if self.site == "repair" else "two_gathers:rowmajor"
        return f"{what}:{self.gather_form}_gather->{'mxfp8_packed' if self.packed_gather else 'bf16_gather'}"

    def __lt__(self, other: FusionKind) -> bool:
        return str(self) < str(other)


class SkipCode(enum.Enum):
    """Why a rewrite left a site alone (the reason text beside it says it for people)."""

    @property
    def whole_graph(self) -> bool:
        """The rewrite left the whole graph alone (the node is an all-reduce, not a norm or a quant input)."""
        return self in WHOLE_GRAPH

    NO_SHAPES = "no fake tensor (graph not traced with shapes)"
    ACTIVATION_DTYPE = "activation dtype the fused kernels do not take"
    HIDDEN_SIZE = "hidden size symbolic or not a multiple of 32"
    EPS_NOT_CONSTANT = "eps is not a graph constant"
    WEIGHT_SHAPE = "weight is not [K]"
    RESIDUAL_MISMATCH = "residual differs from the input in shape or dtype"
    DEVICE_MISMATCH = "input and weight on different devices"
    NO_QUANT = "no MXFP8 quant reads the output"
    CROSSES_GATHER = "the output crosses an all-gather before the quant (sp_gather decides)"
    QUANT_UNSUPPORTED = "a quant the fused op cannot stand in for"
    NOT_ROWS = "not 2-D rows [M, K]"
    GATHER_UNSUPPORTED = "an all-gather the rewrite cannot read (dim, constants, row count)"
    GATHER_SPLIT = "the all-gather is along a dim other than 0"
    MODE_KEEPS = "the sp_gather option keeps this form"
    SHAPE_READS = "shape reads that a packed gather would change"
    OTHER_USERS = "other users of a tensor the rewrite would replace"
    PARTIAL_GATHER = "only one of codes/scales crosses an all-gather"
    GROUP_MISMATCH = "codes and scales gathered by different groups or families"
    GATHERED_SHAPES = "gathered codes/scales of unexpected shape"
    # sequence_parallel decides for the whole graph (see WHOLE_GRAPH); the skip names an all-reduce
    ALL_REDUCE_FORM = "an all-reduce that is not a sum over a constant group of 2-D token rows"
    ALL_REDUCE_GROUPS = "all-reduces over more than one group or family"
    WORLD_SIZE_UNKNOWN = "the group's world size is unknown, or 1"
    ROWS_DIFFER = "an input to shard is not 2-D with the all-reduce's token rows"
    ALL_REDUCE_NO_NORM = "an all-reduce feeds no Gemma norm"
    NORM_IN_PLACE = "a norm reading an all-reduce is in place (auto_functionalized)"
    SWIZZLED_PADDED = "swizzled scales of rows that may be padded"
    UNGATHERABLE = "a value read outside the local rows has no tensor to gather"
    REWRITE_FAILED = "the rewrite raised on this site (rolled back; the others still fused)"
    NORM_ARITHMETIC = "a norm whose arithmetic differs from the fused op's (named in the reason)"
    VIEW_NOT_ROWS = "the output reaches the quant through a view that does not keep the rows whole"


@dataclass(frozen=True)
class Reason:
    """A refusal from a guard: its code and the text for people."""

    code: SkipCode
    text: str

    def prefixed(self, prefix: str) -> Reason:
        return Reason(self.code, f"{prefix}{self.text}")


WHOLE_GRAPH = frozenset(
    {
        SkipCode.ALL_REDUCE_FORM,
        SkipCode.ALL_REDUCE_GROUPS,
        SkipCode.WORLD_SIZE_UNKNOWN,
        SkipCode.ROWS_DIFFER,
        SkipCode.ALL_REDUCE_NO_NORM,
        SkipCode.NORM_IN_PLACE,
        SkipCode.SWIZZLED_PADDED,
        SkipCode.UNGATHERABLE,
    }
)


@dataclass(frozen=True)
class Skip:
    """A site a rewrite left alone, as planned (graph nodes; see :class:`SkipRecord`)."""

    rewrite: str
    node: fx.Node  # the norm's output y, the quantized tensor (`quant_site`), or an all-reduce (`code.whole_graph`)
    norm_kind: str | None  # None: the site is a quant input that is not a recognized norm, or the whole graph
    code: SkipCode
    reason: str

    @property
    def quant_site(self) -> bool:
        return self.norm_kind is None and not self.code.whole_graph

    def record(self) -> SkipRecord:
        return SkipRecord(self.rewrite, self.norm_kind, self.node.name, self.code, self.reason)


@dataclass(frozen=True)
class SkipRecord:
    """A site left alone, in the pass report (node by name: it outlives the graph)."""

    rewrite: str
    norm_kind: str | None
    node: str
    code: SkipCode
    reason: str

    def as_dict(self) -> dict:
        kind = self.norm_kind
        if kind is None:  # no norm: a quant input, or the whole graph (the node is an all-reduce)
            kind = "whole_graph" if self.code.whole_graph else "quant_input"
        return {"rewrite": self.rewrite, "kind": kind, "node": self.node, "reason": self.reason}


@runtime_checkable
class Fusion(Protocol):
    """One planned rewrite of one site."""

    @property
    def kind(self) -> FusionKind: ...

    @property
    def site(self) -> fx.Node: ...  # the node a skip or a failure names

    @property
    def replaced(self) -> list[fx.Node]: ...


class Rewrite(Protocol):
    """A rewrite: plans every site without touching the graph, then applies one fusion at a time."""

    name: str

    def plan(self, graph: fx.Graph, options: PassOptions) -> list[Fusion | Skip]: ...

    def apply(self, graph: fx.Graph, fusion: Fusion, options: PassOptions) -> fx.Node | None:
        """The node standing for the rewritten site; None when the plan no longer applies."""
        ...


def plan_site(
    rewrite: str, node: fx.Node, norm_kind: str | None, options: PassOptions, plan: Callable[[], T]
) -> T | Skip:
    """`plan()` for one site; an exception skips this site only (raised when `options.strict`)."""
    try:
        return plan()
    except Exception as error:
        if options.strict:
            raise
        what = f"{type(error).__name__}: {error}"
        log.warning("mxfuse: pattern %s failed planning %s; that site left unchanged. %s", rewrite, node, what)
        log.debug("mxfuse planning failure", exc_info=True)
        return Skip(rewrite, node, norm_kind, SkipCode.REWRITE_FAILED, f"planning it failed ({what})")
