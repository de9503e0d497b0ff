"""The mxfuse post-grad pass: runs the rewrites, counts, logs, dumps, and never half-applies.

Order: with `sequence_parallel=True`, the sequence-parallel rewrite first (it turns
all-reduce -> norm into reduce-scatter -> local norm -> all-gather); then rewrite 2
(quantization around the SP all-gather), so that rewrite 1
(norm -> quant fusion) sees the graph it leaves. Each rewrite plans without touching
the graph, then applies one site at a time. A site whose rewrite raises is restored
(its own :class:`GraphTransaction`) and reported as skipped with
`SkipCode.REWRITE_FAILED`; the other sites still fuse. Everything runs inside one more
transaction, the last line of defence: an exception outside a site restores the whole
graph. Failures are logged at WARNING on the `mxfuse` logger; with the option `strict`
(or `MXFUSE_STRICT=1`) they are raised instead (the test suite runs strict).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import uuid
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from mxfuse.passes.options import PassOptions
from mxfuse.passes.report import PassReport
from mxfuse.passes.transaction import GraphTransaction
from mxfuse.patterns.results import Fusion, Rewrite, Skip, SkipCode, SkipRecord

log = logging.getLogger("mxfuse")

_PACKAGE = Path(__file__).resolve().parent.parent
_SOURCE_DIRS = ("ops", "patterns", "passes")

__all__ = ["MxfusePass", "PassReport", "cache_key", "rewrites", "run"]


def rewrites() -> list[Rewrite]:
    """The rewrites, in the order they run (each reads the options it needs)."""
    from mxfuse.patterns.norm_quant import NormQuant
    from mxfuse.patterns.sequence_parallel import SequenceParallelRewrite
    from mxfuse.patterns.sp_gather import SpGather

    # sequence_parallel first (a no-op unless the option is on): it emits the
    # norm -> all_gather -> quant shape that sp_gather then places
    return [SequenceParallelRewrite(), SpGather(), NormQuant()]


def run(graph: fx.Graph, options: PassOptions) -> PassReport:
    """Apply the rewrites to `graph` in place and report what happened."""
    from mxfuse.patterns.fx_utils import fold_duplicate_getitems

    report = PassReport()
    before = _graph_text(graph) if options.dump_dir else None
    transaction = GraphTransaction(graph)
    users_before = {node: len(node.users) for node in transaction.order}
    current = "folding duplicate getitems"
    try:
        fold_duplicate_getitems(graph)  # left by CSE or freezing; the recognizers expect one of each
        for rewrite in rewrites():
            current = rewrite.name
            for planned in rewrite.plan(graph, options):
                if isinstance(planned, Skip):
                    report.skipped.append(planned.record())
                else:
                    _apply_site(graph, rewrite, planned, options, report)
        if report.matched:
            current = "topological sort"
            # Inductor (2.14) sorts again after post_grad_custom_post_pass, but this function
            # also runs where nothing sorts after it: `explain`, the CLI's recording pass,
            # tests that execute the graph, and inside vLLM's pass manager before its later
            # passes. (torch 2.11's post_grad.py, the GPU image's, was not at hand to check.)
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(graph)
            graph.lint()
        else:
            transaction.rollback()  # nothing fused: not even the folded getitems change
    except Exception as error:
        transaction.rollback()
        if options.strict:
            raise
        report = PassReport(failed=f"{current}: {type(error).__name__}: {error}")
        log.warning("mxfuse: pattern %s failed; graph left unchanged. %s: %s", current, type(error).__name__, error)
        log.debug("mxfuse pass failure", exc_info=True)
        if options.dump_dir:
            report.dumps = _dump(options.dump_dir, before, _graph_text(graph), report)
        return report
    if report.matched:
        transaction.erase_dead(n for n, count in users_before.items() if count and not n.users)
    _log(report)
    if options.dump_dir:  # every graph the pass sees: the report matters most when nothing fused
        report.dumps = _dump(options.dump_dir, before, _graph_text(graph), report)
    return report


def _apply_site(graph: fx.Graph, rewrite: Rewrite, fusion: Fusion, options: PassOptions, report: PassReport):
    """Apply one planned fusion; on an exception restore this site only and record why."""
    kind, replaced, site = fusion.kind, [n.name for n in fusion.replaced], fusion.site
    transaction = GraphTransaction(graph)
    try:
        applied = rewrite.apply(graph, fusion, options)
    except Exception as error:
        transaction.rollback()
        if options.strict:
            raise
        what = f"{type(error).__name__}: {error}"
        reason = f"rewriting it as {kind} failed and was undone ({what})"
        report.skipped.append(SkipRecord(rewrite.name, kind.norm_kind, site.name, SkipCode.REWRITE_FAILED, reason))
        log.warning(
            "mxfuse: pattern %s (%s) failed at %s; that site left unchanged. %s", rewrite.name, kind, site, what
        )
        log.debug("mxfuse site failure", exc_info=True)
        return
    if applied is not None:
        report.matched[kind] += 1
        report.replaced_nodes += replaced


def _graph_text(graph: fx.Graph) -> str:
    return graph.python_code("self", verbose=True).src


def _dump(dump_dir: str, before: str, after: str, report: PassReport) -> list[str]:
    """Write the graph before/after and the report; a dump that fails is one warning, never a
    failed compile (the graph is already rewritten)."""
    try:
        return _write_dump(Path(dump_dir), before, after, report)
    except OSError as e:
        log.warning("mxfuse: could not write the dump to %s (%s); the compile goes on without it", dump_dir, e)
        return []


def _write_dump(out: Path, before: str, after: str, report: PassReport) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    index = len(list(out.glob("mxfuse_*.before.py")))
    paths = []
    for stage, text in (("before", before), ("after", after)):
        path = out / f"mxfuse_{index:03d}.{stage}.py"
        path.write_text(text)
        paths.append(str(path))
    summary = out / f"mxfuse_{index:03d}.report.json"
    summary.write_text(json.dumps({**report.as_dict(), "dumps": paths}, indent=2))
    return [*paths, str(summary)]


def _log(report: PassReport):
    if report.matched:
        log.info("mxfuse: %s", ", ".join(f"{kind} x{n}" for kind, n in sorted(report.matched_strings().items())))
    for s in report.skipped:
        log.debug("mxfuse: %s left %s (%s): %s", s.rewrite, s.node, s.norm_kind or "quant_input", s.reason)
    try:
        from torch._logging import trace_structured

        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "mxfuse_pass_report", "encoding": "json"},
            payload_fn=lambda: json.dumps(report.as_dict()),
        )
    except Exception:
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


def cache_key(options: PassOptions, nonce: str = "") -> str:
    """The compile-cache key: every source file that decides the output, the options that
    change the graph, and a pass object's own nonce when `fresh` (a cache miss by design)."""
    return hashlib.sha256(f"{source_hash()}|{options.cache_key()}|{nonce}".encode()).hexdigest()


class MxfusePass(CustomGraphPass):
    """The mxfuse passes as an Inductor `post_grad_custom_post_pass` (cacheable via `uuid`)."""

    def __init__(self, options: PassOptions):
        options.check_dump_dir()
        self.options = options
        self.last_report: PassReport | None = None
        self._nonce = uuid.uuid4().hex if options.fresh else ""

    def __call__(self, graph: fx.Graph) -> None:
        self.last_report = run(graph, self.options)

    def uuid(self) -> str:
        return cache_key(self.options, self._nonce)

    def __repr__(self) -> str:
        return f"MxfusePass({self.options})"
