"""What one run of the pass did to one graph, typed; `as_dict()` is the JSON of dumps and tlparse."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from mxfuse.patterns.results import FusionKind, SkipRecord


@dataclass
class PassReport:
    """What one run of the pass did to one graph."""

    matched: collections.Counter[FusionKind] = field(default_factory=collections.Counter)
    skipped: list[SkipRecord] = field(default_factory=list)
    replaced_nodes: list[str] = field(default_factory=list)  # names of the nodes the rewrites replaced
    failed: str | None = None  # the whole pass rolled back: where and why
    dumps: list[str] = field(default_factory=list)

    def matched_strings(self) -> dict[str, int]:
        """`{str(kind): count}` (kinds with the same string summed)."""
        out: collections.Counter[str] = collections.Counter()
        for kind, n in self.matched.items():
            out[str(kind)] += n
        return dict(out)

    def as_dict(self) -> dict:
        return {
            "matched": self.matched_strings(),
            "skipped": [s.as_dict() for s in self.skipped],
            "replaced_nodes": self.replaced_nodes,
            "failed": self.failed,
            "dumps": self.dumps,
        }
