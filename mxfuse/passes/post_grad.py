"""The mxfuse post-grad pass: runs the rewrites, counts, logs, dumps, and never half-applies.

Order: with `sequence_parallel=True`, the sequence-parallel rewrite first (it turns
all-reduce -> norm into reduce-scatter -> local norm -> all-gather); then rewrite 2
(quantization around the SP all-gather), so that rewrite 1 (producer -> quant fusion) sees
the graph it leaves. :func:`rewrites` builds each with the options it needs. Each rewrite
plans without touching the graph, then applies one site at a time.

This module holds the one rule for failures (:func:`_contain`): a site whose planning or
rewriting raises is restored (its own transaction, of the kind the rewrite declares in `undo`:
a :class:`SiteTransaction`, which records only what the site touches, so the pass stays linear
in the graph's size, or a whole-graph snapshot) and reported as skipped
with `SharedCode.REWRITE_FAILED`, the other sites still fuse; everything runs inside one
more transaction, the last line of defence: an exception outside a site restores the
whole graph. Failures are logged at WARNING on the `mxfuse` logger; with the option
`strict` (or `MXFUSE_STRICT=1`) they are raised instead (the test suite runs strict).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from mxfuse.passes.options import PassOptions
from mxfuse.passes.report import PassReport, SiteRecord
from mxfuse.passes.transaction import GraphTransaction, Transaction, site_transaction
from mxfuse.patterns.results import Fusion, Rewrite, Scope, SharedCode, Skip

log = logging.getLogger("mxfuse")
T = TypeVar("T")

_PACKAGE = Path(__file__).resolve().parent.parent
_SOURCE_DIRS = ("ops", "patterns", "passes")

__all__ = ["MxfusePass", "PassReport", "cache_key", "rewrites", "run"]


def rewrites(options: PassOptions) -> list[Rewrite]:
    """The rewrites the options turn on, built with their configuration, in the order they run."""
    from mxfuse.patterns.producer_quant import ProducerQuant
    from mxfuse.patterns.sequence_parallel import SequenceParallelRewrite
    from mxfuse.patterns.sp_gather import SpGather

    # sequence_parallel first: it emits the norm -> all_gather -> quant shape that sp_gather then places
    chosen: list[Rewrite] = [SequenceParallelRewrite()] if options.sequence_parallel else []
    chosen.append(SpGather(mode=options.sp_gather, fuse_norm=options.fuse_norm_quant))
    if options.fuse_norm_quant:
        chosen.append(ProducerQuant())
    return chosen


class _Failed(Exception):
    """A contained failure: `text` is the error, already logged (and rolled back)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _contain(fn: Callable[[], T], transaction: Transaction | None, strict: bool, what: Callable[[], str]) -> T:
    """`fn()`; if it raises: restore `transaction`, re-raise when `strict`, else log `what()` failed and
    raise :class:`_Failed` carrying the error's text. The pass's one rule for a failure."""
    try:
        return fn()
    except Exception as error:
        if transaction is not None:
            transaction.rollback()
        if strict:
            raise
        text = f"{type(error).__name__}: {error}"
        log.warning("mxfuse: %s failed; left unchanged. %s", what(), text)
        log.debug("mxfuse failure", exc_info=True)
        raise _Failed(text) from error


def run(graph: fx.Graph, options: PassOptions) -> PassReport:
    """Apply the rewrites to `graph` in place and report what happened."""
    from mxfuse.patterns.fx_utils import fold_duplicate_getitems

    report = PassReport()
    before = _graph_text(graph) if options.dump_dir else None
    transaction = GraphTransaction(graph)
    users_before = {node: len(node.users) for node in transaction.order}
    current = ["folding duplicate getitems"]

    def whole_pass():
        fold_duplicate_getitems(graph)  # left by CSE or freezing; the recognizers expect one of each
        for rewrite in rewrites(options):
            current[0] = f"pattern {rewrite.name}"
            _run_rewrite(graph, rewrite, options, report)
        if report.applied:
            current[0] = "topological sort"
            # Inductor (2.14) sorts again after post_grad_custom_post_pass, but this function also
            # runs where nothing sorts after it: `explain`, the CLI's recording pass, tests that
            # execute the graph, and inside vLLM's pass manager before its later passes.
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(graph)
            graph.lint()
        else:
            transaction.rollback()  # nothing fused: not even the folded getitems change

    try:
        _contain(whole_pass, transaction, options.strict, lambda: f"{current[0]} (the whole graph)")
    except _Failed as failure:
        report = PassReport(failed=f"{current[0]}: {failure.text}")
    else:
        if report.applied:
            transaction.erase_dead(n for n, count in users_before.items() if count and not n.users)
        _log(report)
    if options.dump_dir and before is not None:  # every graph the pass sees: the report matters most when nothing fused
        report.dumps = _dump(options.dump_dir, before, _graph_text(graph), report)
    return report


def _run_rewrite(graph: fx.Graph, rewrite: Rewrite, options: PassOptions, report: PassReport) -> None:
    """Plan every site of `rewrite`, then apply each planned fusion, each inside the one rule."""

    def plan_site(name: str, node: fx.Node, producer_kind: str | None, plan: Callable[[], T]) -> T | Skip:
        try:
            return _contain(plan, None, options.strict, lambda: f"pattern {name} planning {node}")
        except _Failed as failure:
            return Skip(name, node, producer_kind, SharedCode.REWRITE_FAILED, f"planning it failed ({failure.text})")

    planned = rewrite.plan(graph, plan_site)
    warned = [p.warn for p in planned if isinstance(p, Skip) and p.warn]
    if warned:
        log.warning("%s", "\n".join([f"mxfuse: {len(warned)} {rewrite.warning_head}:", *warned]))
    for item in planned:
        if isinstance(item, Skip):
            report.skipped.append(item.record())
        else:
            _apply_site(graph, rewrite, item, options, report)


def _apply_site(graph: fx.Graph, rewrite: Rewrite, fusion: Fusion, options: PassOptions, report: PassReport):
    """Apply one planned fusion; on an exception restore this site only and record why."""
    kind, site = fusion.kind, fusion.site
    record = SiteRecord.of(rewrite.name, kind, site, fusion.replaced)
    what = lambda: f"pattern {rewrite.name} ({kind}) at {site}"  # noqa: E731
    transaction: Transaction = GraphTransaction(graph) if rewrite.undo is Scope.GRAPH else site_transaction(graph)
    try:
        applied = _contain(lambda: rewrite.apply(graph, fusion), transaction, options.strict, what)
    except _Failed as failure:
        reason = f"rewriting it as {kind} failed and was undone ({failure.text})"
        skipped = Skip(rewrite.name, site, kind.producer_kind, SharedCode.REWRITE_FAILED, reason)
        report.skipped.append(skipped.record())
        return
    finally:
        transaction.close()
    if applied is not None:
        report.applied.append(record)


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
    # one INFO line per compiled graph with a site (fused, left and why, savings); DEBUG for the others
    log.log(logging.INFO if report.applied or report.skipped else logging.DEBUG, "%s", report.summary())
    for s in report.skipped:
        log.debug("mxfuse: %s left %s (%s): %s", s.rewrite, s.node, s.label, s.reason)
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
