"""What one run of the pass did to one graph, typed; `as_dict()` is the JSON of dumps and tlparse;
`summary()` the one INFO line per compiled graph on the `mxfuse` logger.

What a fused site saves is derived from the op contracts (docs/design.md), per row (token) of
the site: the fused op no longer writes the norm's 16-bit output `y` ([M, K]) and the quant no
longer reads it back, `2 * K * 2` bytes per row (`K * 2` when something else still needs `y`,
which the fused op then writes in the same launch), and one launch (norm + quant become one
kernel). Derived, not measured: the kernels' times are in the README's Performance section.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from mxfuse.patterns.results import FusionKind, SkipRecord

PREFILL_CHUNK = 8192  # tokens: the "per prefill chunk" of the summaries (vLLM's default long-prefill chunk size)


def size_text(n: float) -> str:
    """Bytes in binary units: `512 B`, `4 KiB`, `1.5 MiB`, `2.25 GiB` (up to 3 significant digits)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.3g} {unit}" if n < 1000 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _row_bytes(node: fx.Node) -> int | None:
    """Bytes of one row of the node's value (`K * itemsize`), or None when K is symbolic or unknown."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not isinstance(val.shape[-1], int):
        return None
    return int(val.shape[-1]) * val.dtype.itemsize


@dataclass(frozen=True)
class SiteRecord:
    """One site a rewrite applied (nodes by name: the record outlives the graph)."""

    rewrite: str
    kind: FusionKind
    site: str  # the node the plan named: a norm's y, a quant input, an all-reduce
    replaced: tuple[str, ...]  # the nodes the rewrite replaced
    row_bytes: int | None = None  # bytes of one row of the site's value (K * 2 for bf16), None if unknown

    @classmethod
    def of(cls, rewrite: str, kind: FusionKind, site: fx.Node, replaced: Iterable[fx.Node]) -> SiteRecord:
        return cls(rewrite, kind, site.name, tuple(n.name for n in replaced), _row_bytes(site))

    @property
    def launches_saved(self) -> int:
        """Kernel launches per step this site no longer makes: the producer's and the quant's became one."""
        return 1 if self.kind.fuses_producer else 0

    @property
    def bytes_saved_per_row(self) -> int | None:
        """Bytes per row (token) that no longer go through memory: the producer's output written and read back
        (2 * K * 2 for bf16), only the read when the fused op still writes it; 0 when no producer was fused."""
        if not self.kind.fuses_producer:
            return 0
        if self.row_bytes is None:
            return None
        return self.row_bytes if self.kind.writes_y else 2 * self.row_bytes


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

    def launches_saved(self) -> int:
        """Kernel launches per step the applied sites removed (one per fused norm)."""
        return sum(record.launches_saved for record in self.applied)

    def bytes_saved_per_row(self) -> tuple[int, int]:
        """`(bytes per row (token) that no longer go through memory, fused sites whose K is unknown)`."""
        saved = [record.bytes_saved_per_row for record in self.applied]
        return sum(b for b in saved if b is not None), sum(b is None for b in saved)

    def savings_text(self, tokens: int = PREFILL_CHUNK) -> str:
        """`N fewer launches per step, X KiB less memory traffic per token (Y MB per 8192-token step)`,
        derived from the op contracts (see the module docstring); "" when nothing was saved."""
        launches = self.launches_saved()
        per_row, unknown = self.bytes_saved_per_row()
        if not launches and not per_row:
            return ""
        text = f"{launches} fewer launch{'es' if launches != 1 else ''} per step"
        if per_row:
            per_step = size_text(per_row * tokens)
            text += f", {size_text(per_row)} less memory traffic per token ({per_step} per {tokens}-token step)"
        if unknown:
            text += f" + {unknown} site(s) of symbolic hidden size"
        return text

    def summary(self) -> str:
        """The one INFO line per compiled graph: what fused (by kind), what was left and why (by reason),
        what that saves; or the failure that left the graph unchanged."""
        if self.failed:
            return f"mxfuse: the pass failed and left this graph unchanged: {self.failed}"
        n = len(self.applied) + len(self.skipped)
        if not n:
            return "mxfuse: nothing to fuse in this graph (no norm or MXFP8 quant the rewrites look at)"
        parts = [f"mxfuse: fused {len(self.applied)} of {n} site{'s' if n != 1 else ''}"]
        if self.applied:
            parts[0] += f" ({', '.join(f'{kind} x{count}' for kind, count in self.matched_text())})"
        if self.skipped:
            reasons = collections.Counter(f"{s.code.value}" for s in self.skipped)
            why = ", ".join(f"{reason} x{count}" for reason, count in sorted(reasons.items()))
            parts.append(f"left {len(self.skipped)} ({why}; `mxfuse explain` names each)")
        saved = self.savings_text()
        if saved:
            parts.append(saved)
        return "; ".join(parts)

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
        per_row, _ = self.bytes_saved_per_row()
        return {
            "summary": self.summary(),
            "matched": self.matched_strings(),
            "launches_saved": self.launches_saved(),
            "bytes_saved_per_token": per_row,
            "skipped": [s.as_dict() for s in self.skipped],
            "replaced_nodes": self.replaced_nodes,
            "failed": self.failed,
            "dumps": self.dumps,
        }
