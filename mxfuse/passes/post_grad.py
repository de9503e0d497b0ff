"""The mxfuse post-grad pass: runs the rewrites, counts, logs, dumps, and never half-applies.

Order: with `sequence_parallel=True`, the sequence-parallel rewrite first (it turns
all-reduce -> norm into reduce-scatter -> local norm -> all-gather); then rewrite 2
(quantization around the SP all-gather), so that rewrite 1
(norm -> quant fusion) sees the graph it leaves. Each rewrite plans without touching
the graph, then applies; everything runs inside one :class:`GraphTransaction`, so an
exception anywhere restores the graph exactly and becomes a warning naming the
pattern that failed.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from mxfuse.passes.options import PassOptions
from mxfuse.passes.transaction import GraphTransaction

log = logging.getLogger("mxfuse")

_PACKAGE = Path(__file__).resolve().parent.parent
_SOURCE_DIRS = ("ops", "patterns", "passes")


@dataclass
class PassReport:
    """What one run of the pass did to one graph."""

    matched: collections.Counter = field(default_factory=collections.Counter)
    skipped: list = field(default_factory=list)  # (rewrite, norm kind, node name, reason)
    replaced_nodes: list = field(default_factory=list)  # names of the nodes the rewrites replaced
    failed: str | None = None
    dumps: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "matched": dict(self.matched),
            "skipped": [dict(zip(("rewrite", "kind", "node", "reason"), s)) for s in self.skipped],
            "replaced_nodes": self.replaced_nodes,
            "failed": self.failed,
            "dumps": self.dumps,
        }


def rewrites(options: PassOptions) -> list:
    """The rewrite modules to run, in order."""
    from mxfuse.patterns import norm_quant, sp_gather

    first = []
    if options.sequence_parallel:  # before sp_gather: it emits the norm -> all_gather -> quant that sp_gather places
        from mxfuse.patterns import sequence_parallel

        first = [sequence_parallel]
    return first + [sp_gather] + ([norm_quant] if options.fuse_norm_quant else [])


def run(graph: fx.Graph, options: PassOptions) -> PassReport:
    """Apply the rewrites to `graph` in place and report what happened."""
    report = PassReport()
    before = _graph_text(graph) if options.dump_dir else None
    transaction = GraphTransaction(graph)
    users_before = {node: len(node.users) for node in transaction.order}
    current = "planning"
    try:
        for rewrite in rewrites(options):
            current = rewrite.NAME
            actions, skips = rewrite.plan(graph, options)
            report.skipped += [(rewrite.NAME, s.norm.kind, s.norm.y.name, s.reason) for s in skips]
            for action in actions:
                current = f"{rewrite.NAME} ({action.kind})"
                if rewrite.apply(graph, action, options) is not None:
                    report.matched[action.kind] += 1
                    report.replaced_nodes += action_nodes(action)
        if report.matched:
            current = "topological sort"
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(graph)
            graph.lint()
    except Exception as error:  # noqa: BLE001 - any failure must leave the graph intact
        transaction.rollback()
        report = PassReport(failed=f"{current}: {type(error).__name__}: {error}")
        warnings.warn(f"mxfuse: pattern {current} failed; graph left unchanged. {type(error).__name__}: {error}")
        log.debug("mxfuse pass failure", exc_info=True)
        return report
    transaction.erase_dead(n for n, count in users_before.items() if count and not n.users)
    _log(report)
    if options.dump_dir and report.matched:
        report.dumps = _dump(options.dump_dir, before, _graph_text(graph), report)
    return report


def action_nodes(action) -> list[str]:
    nodes = getattr(action, "replaced", None)
    return [n.name for n in nodes] if nodes is not None else []


def _graph_text(graph: fx.Graph) -> str:
    return graph.python_code("self", verbose=True).src


def _dump(dump_dir: str, before: str, after: str, report: PassReport) -> list[str]:
    out = Path(dump_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = len(list(out.glob("mxfuse_*.before.py")))
    paths = []
    for stage, text in (("before", before), ("after", after)):
        path = out / f"mxfuse_{index:03d}.{stage}.py"
        path.write_text(text)
        paths.append(str(path))
    summary = out / f"mxfuse_{index:03d}.report.json"
    summary.write_text(json.dumps({**report.as_dict(), "dumps": paths}, indent=2))
    return paths + [str(summary)]


def _log(report: PassReport):
    if report.matched:
        log.info("mxfuse: %s", ", ".join(f"{kind} x{n}" for kind, n in sorted(report.matched.items())))
    for rewrite, kind, node, reason in report.skipped:
        log.debug("mxfuse: %s left %s (%s): %s", rewrite, node, kind, reason)
    try:
        from torch._logging import trace_structured

        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "mxfuse_pass_report", "encoding": "json"},
            payload_fn=lambda: json.dumps(report.as_dict()),
        )
    except Exception:  # noqa: BLE001 - tlparse artifacts are best effort
        log.debug("mxfuse: trace_structured unavailable", exc_info=True)


@functools.cache
def source_hash() -> str:
    """Hash of every source file that decides what the pass emits (patterns, passes, kernels)."""
    digest = hashlib.sha256()
    for folder in _SOURCE_DIRS:
        for path in sorted((_PACKAGE / folder).rglob("*.py")):
            digest.update(str(path.relative_to(_PACKAGE)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(options: PassOptions) -> str:
    return hashlib.sha256(f"{source_hash()}|{options.cache_key()}".encode()).hexdigest()


class MxfusePass(CustomGraphPass):
    """The mxfuse passes as an Inductor `post_grad_custom_post_pass` (cacheable via `uuid`)."""

    def __init__(self, options: PassOptions):
        self.options = options
        self.last_report: PassReport | None = None

    def __call__(self, graph: fx.Graph) -> None:
        self.last_report = run(graph, self.options)

    def uuid(self) -> str:
        return cache_key(self.options)

    def __repr__(self) -> str:
        return f"MxfusePass({self.options})"
