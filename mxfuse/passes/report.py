"""What one run of the pass did to one graph, typed; `as_dict()` is the JSON of dumps and tlparse."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

from mxfuse.patterns.results import FusionKind, SkipRecord


@dataclass(frozen=True)
class SiteRecord:
    """One site a rewrite applied (nodes by name: the record outlives the graph)."""

    rewrite: str
    kind: FusionKind
    site: str  # the node the plan named: a norm's y, a quant input, an all-reduce
    replaced: tuple[str, ...]  # the nodes the rewrite replaced


@dataclass
class PassReport:
    """What one run of the pass did to one graph (or, merged, to every graph of a compile)."""

    applied: list[SiteRecord] = field(default_factory=list)
    skipped: list[SkipRecord] = field(default_factory=list)
    failed: str | None = None  # the whole pass rolled back: where and why
    dumps: list[str] = field(default_factory=list)

    @property
    def matched(self) -> collections.Counter[FusionKind]:
        """How many sites of each kind were applied."""
        return collections.Counter(record.kind for record in self.applied)

    @property
    def replaced_nodes(self) -> list[str]:
        """Names of the nodes the rewrites replaced, site by site."""
        return [name for record in self.applied for name in record.replaced]

    def fused_producers(self) -> tuple[int, int]:
        """`(sites whose producer was fused and its bf16 y no longer goes to memory, fused ones that still
        write y)`."""
        fused = [record.kind for record in self.applied if record.kind.fuses_producer]
        kept = sum(kind.writes_y for kind in fused)
        return len(fused) - kept, kept

    def fused_act_muls(self) -> int:
        """Fused sites whose producer is an act·mul (`act(gate) * up`) and whose bf16 y no longer goes to memory."""
        return sum(
            1
            for record in self.applied
            if record.kind.fuses_producer
            and not record.kind.writes_y
            and getattr(getattr(record.kind, "family", None), "value", None) == "act_mul"
        )

    def packed_gathers(self) -> int:
        """Sites whose all-gather now carries the packed MXFP8 buffer."""
        return sum(record.kind.packed_gather for record in self.applied)

    def matched_strings(self) -> dict[str, int]:
        """`{str(kind): count}` (kinds with the same string summed)."""
        return dict(collections.Counter(str(record.kind) for record in self.applied))

    def matched_text(self) -> list[tuple[str, int]]:
        """`(kind string, count)` sorted by the kind's string."""
        return sorted(self.matched_strings().items())

    @classmethod
    def merge(cls, reports: Iterable[PassReport]) -> PassReport:
        """The reports of several graphs (one compile) as one: records in order, the first failure."""
        merged = cls()
        for report in reports:
            merged.applied += report.applied
            merged.skipped += report.skipped
            merged.dumps += report.dumps
            merged.failed = merged.failed or report.failed
        return merged

    def as_dict(self) -> dict:
        return {
            "matched": self.matched_strings(),
            "skipped": [s.as_dict() for s in self.skipped],
            "replaced_nodes": self.replaced_nodes,
            "failed": self.failed,
            "dumps": self.dumps,
        }
