"""The contract between the rewrites and the pass: kinds, refusal codes, skips, the `Rewrite` interface.

Each rewrite module owns its kind type (a frozen dataclass implementing
:class:`FusionKind`, whose `str()` is the report's kind string) and its refusal codes
(a :class:`RefusalCode` enum, each member with its fix where there is a simple one);
guards shared by several rewrites return :class:`SharedCode` members. Readers (the pass
report, `mxfuse explain`, the CLI) use the typed fields; the strings (`str(kind)`,
`Skip.reason`) are for people and the JSON report only, never parsed back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar, runtime_checkable

from torch import fx

T = TypeVar("T")
F = TypeVar("F", bound="Fusion")  # the fusion type one rewrite plans and applies


class Scope(enum.Enum):
    """What a refusal leaves alone, or what one site of a rewrite may touch (its undo):
    one site (a producer or a quant input), or the whole graph."""

    SITE = "site"
    GRAPH = "graph"  # the skip names an all-reduce; nothing of the graph was rewritten by that rewrite


class RefusalCode(enum.Enum):
    """Base of every rewrite's refusal codes.

    A member is `NAME = "summary"` or `NAME = ("summary", "fix")`: its value says it in a few
    words, `fix` is the change that makes the site fuse (None: no simple one). `scope` says what
    it leaves alone (a rewrite whose refusals cover the graph overrides it); `defers`: the site
    is another rewrite's to decide (its reason is that rewrite's, and it is not warned about).
    """

    _fix: str | None

    def __new__(cls, summary: str, fix: str | None = None) -> Self:
        member = object.__new__(cls)
        member._value_ = summary
        member._fix = fix
        return member

    @property
    def fix(self) -> str | None:
        return self._fix

    @property
    def scope(self) -> Scope:
        return Scope.SITE

    @property
    def defers(self) -> bool:
        return False


class SharedCode(RefusalCode):
    """Refusals of guards several rewrites share (the producer and quant checks, a failing site)."""

    NO_SHAPES = "no fake tensor (graph not traced with shapes)"
    ACTIVATION_DTYPE = ("activation dtype the fused kernels do not take", "run the model in bfloat16 or float16")
    HIDDEN_SIZE = (
        "hidden size symbolic or not a multiple of 32",
        "keep the hidden size static (and a multiple of 32)",
    )
    EPS_NOT_CONSTANT = (
        "eps is not a graph constant",
        "pass eps as a Python float (a 0-d host tensor also works)",
    )
    EPS_INVALID = ("eps is negative or NaN", "give the norm a non-negative eps")
    WEIGHT_SHAPE = ("weight is not [K]", "keep the norm weight a 1-D [K] tensor")
    RESIDUAL_MISMATCH = (
        "residual differs from the input in shape or dtype",
        "give the residual the input's shape and dtype",
    )
    DEVICE_MISMATCH = "input and weight on different devices"
    NORM_ARITHMETIC = (
        "a norm whose arithmetic differs from the fused op's (named in the reason)",
        "compute `n = x.float() * rsqrt(mean(x.float()**2, -1) + eps)` and `(n * (1 + w.float())).to(dtype)` "
        "(Gemma) or `w * n.to(dtype)` (Llama), or call torch.ops.mxfuse.gemma_rmsnorm / rms_norm, if it is meant "
        "to be an RMSNorm (else leave it: this would change its arithmetic)",
    )
    NORM_GROUPED = "a norm normalized over groups of the channels, not the whole row"
    NORM_CENTERED = "a LayerNorm: it subtracts the row mean first, which no fused op computes"
    ALLREDUCE_FUSED = (
        "vLLM fused the norm with the all-reduce before it (its AllReduceFusionPass)",
        "none needed at decode: the compile ranges above max_token_num reach mxfuse as all_reduce -> norm and "
        'fuse there; `"pass_config": {"fuse_allreduce_rms": false}` in vLLM\'s compilation config trades vLLM\'s '
        "all-reduce fusion for mxfuse's norm->quant fusion in every range (README: Where it applies)",
    )
    NORM_DTYPES = (
        "a norm whose weight or output dtype differs from the activations' in a way the fused op does not compute",
        "give the norm weight the activations' dtype (bfloat16/float16) and cast the output back",
    )
    NORM_KERNEL = (
        "a norm lowered to an external kernel whose arithmetic mxfuse does not reproduce",
        "leave vLLM's IR priority for the norm at its default (native), e.g. VLLM_USE_OINK_OPS=0 or "
        "VLLM_ROCM_USE_AITER_RMSNORM=0",
    )
    NO_QUANT = "no MXFP8 quant reads the output"
    QUANT_UNSUPPORTED = "a quant the fused op cannot stand in for"
    REWRITE_FAILED = "the rewrite raised on this site (rolled back; the others still fused)"


@dataclass(frozen=True)
class Reason:
    """A refusal from a guard: its code and the text for people."""

    code: RefusalCode
    text: str

    def prefixed(self, prefix: str) -> Reason:
        return Reason(self.code, f"{prefix}{self.text}")


@runtime_checkable
class FusionKind(Protocol):
    """What one applied rewrite did, as the report counts it (`str()`: the kind string).

    rewrite: the rewrite's `name`; producer_kind: the producer's form and variant
    ("mxfuse:fused_add", "hf:plain", ...: :attr:`ProducerMatch.kind`), None when no producer is
    involved; fuses_producer: the producer went into a fused kernel; writes_y: the producer's
    bf16 output still goes to memory (emitted, kept, or gathered in bf16); packed_gather: an
    all-gather carries the packed MXFP8 buffer `[M, K + K/32]`.
    """

    @property
    def rewrite(self) -> str: ...

    @property
    def producer_kind(self) -> str | None: ...

    @property
    def fuses_producer(self) -> bool: ...

    @property
    def writes_y(self) -> bool: ...

    @property
    def packed_gather(self) -> bool: ...


@dataclass(frozen=True)
class Skip:
    """A site a rewrite left alone, as planned (graph nodes; see :class:`SkipRecord`)."""

    rewrite: str
    node: fx.Node  # the producer's output y, the quantized tensor (`quant_site`), or an all-reduce (scope GRAPH)
    producer_kind: str | None  # None: a quant input that is not a recognized producer, or the whole graph
    code: RefusalCode
    reason: str
    warn: str | None = None  # the line this site adds to its rewrite's one warning for the graph (None: none)

    @property
    def quant_site(self) -> bool:
        return self.producer_kind is None and self.code.scope is Scope.SITE

    def record(self) -> SkipRecord:
        return SkipRecord(self.rewrite, self.producer_kind, self.node.name, self.code, self.reason)


@dataclass(frozen=True)
class SkipRecord:
    """A site left alone, in the pass report (node by name: it outlives the graph)."""

    rewrite: str
    producer_kind: str | None
    node: str
    code: RefusalCode
    reason: str

    @property
    def label(self) -> str:
        """The producer kind, or the report's word for a site with no producer: "quant_input" / "whole_graph"."""
        if self.producer_kind is not None:
            return self.producer_kind
        return "whole_graph" if self.code.scope is Scope.GRAPH else "quant_input"

    def as_dict(self) -> dict:
        return {"rewrite": self.rewrite, "kind": self.label, "node": self.node, "reason": self.reason}


@runtime_checkable
class Fusion(Protocol):
    """One planned rewrite of one site."""

    @property
    def kind(self) -> FusionKind: ...

    @property
    def site(self) -> fx.Node: ...  # the node a skip or a failure names

    @property
    def replaced(self) -> list[fx.Node]: ...


class PlanSite(Protocol):
    """The pass's rule for planning one site: `plan()`, or a `Skip` of that site if it raises."""

    def __call__(
        self, rewrite: str, node: fx.Node, producer_kind: str | None, plan: Callable[[], T], /
    ) -> T | Skip: ...


class Rewrite(Protocol[F]):
    """A rewrite, built with its configuration: plans every site without touching the graph, then
    applies what was planned, one fusion at a time.

    `plan` hands each site's decision to `plan_site` (the pass's try / strict / log rule);
    `apply` rewrites the graph as planned (maps the planned nodes through what earlier sites of
    the same run replaced) and returns None when the plan no longer holds. The pass builds the
    rewrites afresh for each graph. `warning_head`: the first line of the one warning the pass
    logs for the `Skip.warn` lines of this rewrite ("" when it never warns). `undo`: what one
    applied site may touch, so what the pass records to undo it: `Scope.SITE` (the nodes the
    site edits, recorded as it goes) or `Scope.GRAPH` (a snapshot of the whole graph).
    """

    name: str
    warning_head: str
    undo: Scope

    def plan(self, graph: fx.Graph, plan_site: PlanSite) -> Sequence[F | Skip]: ...

    def apply(self, graph: fx.Graph, fusion: F) -> fx.Node | None:
        """The node standing for the rewritten site; None when the plan no longer applies."""
        ...
