"""The mxfuse pass as the command runs it: every graph's report kept, read through typed fields."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import NamedTuple, TextIO

import torch

from mxfuse.cli.progress import Progress
from mxfuse.passes import explain as ex, post_grad
from mxfuse.passes.analysis import capture_wrapper_code
from mxfuse.passes.options import PassOptions
from mxfuse.passes.post_grad import MxfusePass, PassReport


class KindFields(NamedTuple):
    """The facts about a matched fusion kind that the command's summaries need."""

    fuses_norm: bool  # a norm went into a fused kernel
    writes_y: bool  # its bf16 y is still written (or gathered in bf16)
    packed_gather: bool  # an all-gather carries the packed MXFP8 buffer


class SkipFields(NamedTuple):
    rewrite: str
    norm_kind: str
    node: str
    reason: str


def kind_fields(kind) -> KindFields:
    """Read a `FusionKind` of the pass report by its fields (never by its text)."""
    return KindFields(kind.fuses_norm, kind.writes_y, kind.packed_gather)


def skip_fields(skip) -> SkipFields:
    """Read a `SkipRecord` of the pass report by its fields."""
    label = skip.as_dict()["kind"]  # the norm kind, or "quant_input" / "whole_graph" for a site with no norm
    return SkipFields(skip.rewrite, label, str(skip.node), skip.reason)


@dataclass
class MergedReport:
    """The reports of every graph of one compile, added up (kinds as the pass typed them)."""

    matched: collections.Counter = field(default_factory=collections.Counter)
    skipped: list[SkipFields] = field(default_factory=list)
    replaced_nodes: list[str] = field(default_factory=list)
    failed: str | None = None
    dumps: list[str] = field(default_factory=list)

    def matched_text(self) -> list[tuple[str, int]]:
        """`(kind string, count)` sorted by the kind's string."""
        return sorted((str(kind), n) for kind, n in self.matched.items())

    def fused_norms(self) -> tuple[int, int]:
        """`(norms whose bf16 y no longer goes to memory, norms fused that still write y)`."""
        gone = kept = 0
        for kind, n in self.matched.items():
            facts = kind_fields(kind)
            if facts.fuses_norm:
                if facts.writes_y:
                    kept += n
                else:
                    gone += n
        return gone, kept

    def packed_gathers(self) -> int:
        return sum(n for kind, n in self.matched.items() if kind_fields(kind).packed_gather)


class RecordingPass(MxfusePass):
    """The mxfuse pass, keeping each graph's report (and, with `explain`, the per-norm verdicts)."""

    def __init__(self, options: PassOptions, explain: bool = False):
        super().__init__(options)
        self.explain = explain
        self.reports: list[PassReport] = []
        self.verdicts: list[list] = []
        self.quant_inputs: list[list] = []

    def __call__(self, graph):
        before = ex.copy_graph(graph) if self.explain else None
        self.last_report = post_grad.run(graph, self.options)
        self.reports.append(self.last_report)
        if before is not None:
            self.verdicts.append(ex.explain_run(before, graph, self.last_report, self.options))
            self.quant_inputs.append(ex.unmatched_quant_inputs(before))

    def merged_report(self) -> MergedReport:
        merged = MergedReport()
        for r in self.reports:
            merged.matched.update(r.matched)
            merged.skipped += [skip_fields(s) for s in r.skipped]
            merged.replaced_nodes += list(r.replaced_nodes)
            merged.dumps += list(r.dumps)
            merged.failed = merged.failed or r.failed
        return merged


def compile_with(fn, pass_obj: MxfusePass | None):
    """`torch.compile(fn, fullgraph=True)` with `pass_obj` as Inductor's post-grad custom pass."""
    options = {"post_grad_custom_post_pass": pass_obj} if pass_obj is not None else None
    return torch.compile(fn, fullgraph=True, options=options)


def compile_and_run(fn, x: torch.Tensor, pass_obj: MxfusePass, label: str, out: TextIO):
    """Compile `fn` afresh with the pass, run it once on `x`; `(compiled, wrapper codes)`."""
    torch._dynamo.reset()
    compiled = compile_with(fn, pass_obj)
    codes: list[str] = []
    with Progress(label, out), capture_wrapper_code(codes), torch.inference_mode():
        compiled(x)
    return compiled, codes
