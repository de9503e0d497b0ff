"""Why each producer (a norm, ...) of a graph did or did not fuse: the analysis behind `mxfuse explain`.

Pure functions over FX graphs. The verdicts come from what the pass itself decided,
never from a second copy of its rules:

- which producers exist: :func:`mxfuse.patterns.producer_registry.find_producers` (the
  recognizers of every family);
- fused or not, and how: the report's record of the site applied at the producer's output
  (rewrite, kind, replaced nodes), when its kind fused the producer;
- why not: the ``skipped`` records of the pass report (rewrite, producer kind, node, refusal
  code, reason), the ones that :mod:`mxfuse.passes.post_grad` also logs at debug level.
  Decisions read the codes as data: a code that `defers` (the site is another rewrite's to
  decide) gets the other rewrite's reason, and the fix is the code's own.

:func:`explain` runs the pass on a copy of the graph; :func:`explain_run` explains a
run that already happened (the graph before and the report), which is what
:class:`RecordingPass` does. Both log each verdict to the ``mxfuse`` logger at debug
level and emit an ``mxfuse_explain`` artifact for tlparse. :func:`explain_module` (the
public ``mxfuse.explain``) compiles a user's module once and returns the verdicts of
every graph it compiled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import fx

from mxfuse.passes.options import PassOptions
from mxfuse.passes.post_grad import MxfusePass
from mxfuse.passes.report import PassReport, SiteRecord
from mxfuse.patterns.fx_utils import VIEW_OPS, last_frame, op_label
from mxfuse.patterns.producers import ProducerFamily, ProducerMatch
from mxfuse.patterns.results import RefusalCode, Scope, SharedCode, SkipRecord

log = logging.getLogger("mxfuse")


@dataclass(frozen=True)
class Verdict:
    """One producer of the graph (a norm, ...) and what the passes did with it."""

    node: str  # the node holding the producer's output y (in the graph before the pass)
    kind: str  # producer form and variant, e.g. "mxfuse:fused_add", "hf:plain"
    fused: bool
    detail: str  # fused: the fusion's kind; not fused: the reason
    rewrite: str | None  # the rewrite that fused it, or that gave the reason
    module: str | None  # the nn.Module path, e.g. "layers.0.input_norm"
    source: str | None  # last frame of the node's stack trace: "models.py:204 in forward"
    source_line: str | None  # the code on that line
    code: RefusalCode | None = None  # not fused: why, as data (None: fused, or no rewrite recorded one)
    fix: str | None = None  # not fused: the change that would make it fuse, where there is a simple one

    def line(self) -> str:
        where = " ".join(filter(None, (self.module, f"({self.source})" if self.source else None)))
        status = f"fused: {self.detail}" if self.fused else f"not fused: {self.detail}"
        return f"{self.node} [{self.kind}] {where}".rstrip() + f" -> {status}"

    whole_graph: bool = False  # not a producer: a rewrite left the whole graph (node: an all-reduce)
    family: ProducerFamily | None = None  # what the producer computes (None: whole_graph)


@dataclass(frozen=True)
class QuantInput:
    """An MXFP8 quant whose input is not a recognized producer (what computes it, for the user)."""

    quant: str
    producer: str
    looks_like_norm: bool
    source: str | None


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy with the same node names and meta (fake values shared), for running the pass on."""
    new = fx.Graph(owning_module=graph.owning_module)
    out = new.graph_copy(graph, {})
    if out is not None:
        new.output(out)
    return new


def explain(graph: fx.Graph, options: PassOptions = PassOptions()) -> list[Verdict]:  # noqa: B008 - frozen
    """Verdicts for every producer of `graph`; runs the pass on a copy (`graph` is not touched, no dump)."""
    from mxfuse.passes import post_grad

    after = copy_graph(graph)
    report = post_grad.run(after, dataclasses.replace(options, dump_dir=None))
    return explain_run(graph, report, options)


def explain_run(before: fx.Graph, report: PassReport, options: PassOptions) -> list[Verdict]:
    """Verdicts from a run of the pass: `before` (a copy taken before it) and its report (whose
    records say what became of each site)."""
    from mxfuse.patterns.producer_registry import find_producers

    skips: dict[str, list[SkipRecord]] = {}
    for record in report.skipped:
        skips.setdefault(record.node, []).append(record)
    fused: dict[str, SiteRecord] = {r.site: r for r in report.applied if r.kind.fuses_producer}
    verdicts = []
    for record in report.skipped:  # a rewrite that left the whole graph: its node is an all-reduce, not a producer
        if record.code.scope is Scope.GRAPH:
            nowhere = (None, None, None)  # module, source, source line
            reason, rewrite = record.reason, record.rewrite
            verdicts.append(Verdict(record.node, "whole_graph", False, reason, rewrite, *nowhere, whole_graph=True))
    for producer in find_producers(before):
        y = producer.y
        if not any(node.users for node in (y, *producer.side_outputs().values())):
            continue  # dead in the graph handed to the pass
        where = _where(producer)
        applied = fused.get(y.name)
        if applied is not None:
            detail, rewrite = str(applied.kind), applied.rewrite
            verdicts.append(Verdict(y.name, producer.kind, True, detail, rewrite, *where, family=producer.family))
            continue
        rewrite_or_none, why, reason = _reason(y, skips.get(y.name, []), report, options)
        fix = why.fix if why is not None else None  # the code's own
        kind, family = producer.kind, producer.family
        verdicts.append(Verdict(y.name, kind, False, reason, rewrite_or_none, *where, why, fix, family=family))
    _emit(verdicts)
    return verdicts


def _reason(
    y: fx.Node, skips: list[SkipRecord], report: PassReport, options: PassOptions
) -> tuple[str | None, RefusalCode | None, str]:
    if report.failed:
        return None, None, f"the pass failed and left the graph unchanged ({report.failed})"
    if not skips:
        if not options.fuse_norm_quant:
            return None, None, "the option fuse_norm_quant is off"
        return None, None, "left unchanged (no rewrite recorded a reason)"
    # a rewrite that defers (its output crosses an all-gather) leaves the word to the rewrite that placed
    # the gather; otherwise the last rewrite to look at the norm has it (its skips come last)
    deciding = [s for s in skips if not s.code.defers]
    deferred = len(deciding) < len(skips)
    if not deciding:
        chosen = skips[0]
        return chosen.rewrite, chosen.code, chosen.reason
    last = deciding[-1].rewrite
    chosen = next(s for s in deciding if s.rewrite == last)
    reason = f"its output crosses an all-gather: {chosen.reason}" if deferred else chosen.reason
    if chosen.code is SharedCode.NO_QUANT and not deferred:
        reason += f" (read by: {_readers(y)})"
    return chosen.rewrite, chosen.code, reason


_MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.linear", "aten._scaled_mm")


def _readers(node: fx.Node, through: tuple[str, ...] = ()) -> str:
    """What reads `node`, seen through views: `aten.mm via aten.reshape, an unquantized linear`."""
    names = []
    for user in node.users:
        if user.op == "output":
            names.append("the graph output" + (f" via {', '.join(through)}" if through else ""))
        elif user.target in VIEW_OPS and len(through) < 4:
            names.append(_readers(user, (*through, op_label(user))))
        else:
            label = op_label(user) + (f" via {', '.join(through)}" if through else "")
            if op_label(user) in _MATMULS:
                label += ", an unquantized linear"
            names.append(label)
    return ", ".join(dict.fromkeys(names)) or "nothing"


def _where(producer: ProducerMatch) -> tuple[str | None, str | None, str | None]:
    for node in (producer.y, producer.anchor):
        module, source, code = _module_path(node), *last_frame(node.meta.get("stack_trace"))
        if module or source:
            return module, source, code
    return None, None, None


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"^L\['(\w+)'\]\.?", r"\1.", path).rstrip(".")
    return path or None


def unmatched_quant_inputs(graph: fx.Graph) -> list[QuantInput]:
    """MXFP8 quants of `graph` whose input is not the output of a recognized producer.

    Most are expected (attention or MLP activations); one fed by an op with "norm" in
    its name is a norm form the recognizers do not know (a foreign op).
    """
    from mxfuse.patterns.producer_registry import match_producer
    from mxfuse.patterns.quants import find_quants, is_row_view

    found = []
    for quant in find_quants(graph):
        node = quant.node
        if not isinstance(quant.x, fx.Node):
            continue
        source = quant.x
        while is_row_view(source) and isinstance(source.args[0], fx.Node):
            source = source.args[0]
        if match_producer(source) is not None:
            continue
        producer, via = quant.x, []
        while producer.target in VIEW_OPS and isinstance(producer.args[0], fx.Node):
            via.append(op_label(producer).removeprefix("aten."))
            producer = producer.args[0]
        label = op_label(producer) if producer.op == "call_function" else f"graph input {producer.name}"
        if via:
            label += f" (via {', '.join(dict.fromkeys(via))})"
        where, _ = last_frame(node.meta.get("stack_trace"))
        found.append(QuantInput(node.name, label, "norm" in label.lower(), where))
    return found


def _json_value(value: object) -> str:
    """A refusal code by its name, a producer family by its value (`"norm"`), anything else as `str()`."""
    if isinstance(value, RefusalCode):
        return value.name
    return value.value if isinstance(value, ProducerFamily) else str(value)


def _emit(verdicts: list[Verdict]) -> None:
    for v in verdicts:
        log.debug("mxfuse explain: %s", v.line())
    try:
        from torch._logging import trace_structured

        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "mxfuse_explain", "encoding": "json"},
            payload_fn=lambda: json.dumps([asdict(v) for v in verdicts], default=_json_value),
        )
    except Exception:
        log.debug("mxfuse: trace_structured unavailable", exc_info=True)


# ------------------------------------------------------------ explain a user's module


@dataclass(frozen=True)
class GraphVerdicts:
    """What the passes did to one graph the compile produced."""

    verdicts: tuple[Verdict, ...]
    quant_inputs: tuple[QuantInput, ...]  # MXFP8 quants fed by something other than a recognized producer
    report: PassReport


@dataclass(frozen=True)
class Explanation:
    """`mxfuse.explain`'s answer: per compiled graph, every producer and why it did or did not fuse
    (`str()`: one line per producer, as :meth:`lines`)."""

    graphs: tuple[GraphVerdicts, ...]

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return tuple(v for g in self.graphs for v in g.verdicts)

    @property
    def unfused(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if not v.fused)

    def lines(self) -> list[str]:
        return [v.line() + (f" (fix: {v.fix})" if v.fix else "") for v in self.verdicts]

    def __str__(self) -> str:
        return "\n".join(self.lines()) or "no norm in the compiled graphs"


class RecordingPass(MxfusePass):
    """The mxfuse pass, keeping each graph's report (and, with `explain`, its verdicts): the one pass
    that captures what the rewrites did, for `mxfuse.explain`, the command and the tests.

    Explaining is never cached (the verdicts need a run); recording alone keeps the pass's `uuid`.
    """

    def __init__(self, options: PassOptions, explain: bool = False):
        super().__init__(options)
        self.explain = explain
        self.graphs: list[GraphVerdicts] = []

    def __call__(self, graph: fx.Graph) -> None:
        from mxfuse.passes import post_grad

        before = copy_graph(graph) if self.explain else None
        report = self.last_report = post_grad.run(graph, self.options)
        if before is None:
            self.graphs.append(GraphVerdicts((), (), report))
            return
        verdicts = explain_run(before, report, self.options)
        self.graphs.append(GraphVerdicts(tuple(verdicts), tuple(unmatched_quant_inputs(before)), report))

    def uuid(self) -> str | None:  # type: ignore[override]
        return None if self.explain else super().uuid()

    def merged_report(self) -> PassReport:
        """The reports of every graph this pass ran on, as one."""
        return PassReport.merge(g.report for g in self.graphs)

    def explanation(self) -> Explanation:
        return Explanation(tuple(self.graphs))


def explain_module(
    module: Callable, *example_inputs, options: PassOptions | None = None, dynamic: bool | None = None
) -> Explanation:
    """Compile `module` with the passes, run it once on `example_inputs`, say what fused and why not.

    `options` default to :meth:`PassOptions.from_env`; `dynamic` is torch.compile's. The
    module's outputs are discarded; it runs under `torch.no_grad()`.
    """
    recorder = RecordingPass(options if options is not None else PassOptions.from_env(), explain=True)
    compiled = torch.compile(module, dynamic=dynamic, options={"post_grad_custom_post_pass": recorder})
    with torch.no_grad():
        compiled(*example_inputs)
    return recorder.explanation()
