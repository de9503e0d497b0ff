"""`mxfuse explain`: for every producer of an MXFP8 activation (a norm, an act·mul, a gate) of the compiled
graph, fused or not, and why."""

from __future__ import annotations

import argparse
import collections
import os
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from mxfuse.passes.report import PassReport

NAME = "explain"


def run(args: argparse.Namespace, out: TextIO) -> int:
    if args.factory is not None:
        return run_factory(args, out)
    from mxfuse.cli.recording import RecordingPass, compile_and_run
    from mxfuse.cli.targets import build_target, options_text, pass_options_from

    target = build_target(args, NAME)
    options = pass_options_from(args)
    pass_obj = RecordingPass(options, explain=True)
    print(f"mxfuse explain: {target.description}; passes: {options_text(options)}", file=out)
    compile_and_run(target.fn, target.x, pass_obj, "compiling", out)
    graphs = [(g.verdicts, g.quant_inputs) for g in pass_obj.graphs]
    print_verdicts(graphs, args.source, out)
    report = pass_obj.merged_report()
    print_savings(report, out)
    return 0 if not report.failed else 1


def run_factory(args: argparse.Namespace, out: TextIO) -> int:
    """`--model pkg.module:factory`: explain the user's module on the inputs its factory returns."""
    from mxfuse.cli.progress import Progress
    from mxfuse.cli.targets import options_text, pass_options_from
    from mxfuse.passes.explain import explain_module
    from mxfuse.passes.report import PassReport

    module, inputs = args.factory.load()  # a mistake in the spec: one line, from the command's main
    options = pass_options_from(args)
    shapes = ", ".join(_shape_text(x) for x in inputs)
    print(f"mxfuse explain: {args.model} on inputs {shapes}; passes: {options_text(options)}", file=out)
    try:
        with Progress("compiling", out):
            explanation = explain_module(module, *inputs, options=options)
    except Exception as error:
        if args.verbose:
            raise
        raise SystemExit(f"mxfuse explain: {args.model} did not compile: {compile_error_line(error, module)}") from None
    graphs = [(g.verdicts, g.quant_inputs) for g in explanation.graphs]
    print_verdicts(graphs, args.source, out, fixes=True)
    report = PassReport.merge(g.report for g in explanation.graphs)
    print_savings(report, out)
    return 0 if not report.failed else 1


def print_savings(report: PassReport, out: TextIO):
    """What the fused sites remove per step, derived from the op contracts (:mod:`mxfuse.passes.report`)."""
    saved = report.savings_text()
    if saved:
        n = len(report.applied)
        print(f"{n} site{'s' if n != 1 else ''} fused: {saved}, derived from the op contracts", file=out)


def _shape_text(x: object) -> str:
    shape = getattr(x, "shape", None)
    if shape is None:
        return type(x).__name__
    return f"{str(getattr(x, 'dtype', '')).removeprefix('torch.')}{list(shape)}"


_MXFUSE_OP_ERROR = re.compile(
    r"mxfuse::\w+: [^\n]*?(?=['\"]\)|$)", re.M
)  # inside Dynamo's "got MxfuseInputError('...')"


def compile_error_line(error: BaseException, module: object) -> str:
    """One line for an error raised while compiling the user's module: the mxfuse op's own message when an op
    refused its input (it names the op and the shapes; Dynamo re-raises it as text inside its own error), else
    the error's first line; then where the user's code called it, and in which submodule.
    """
    from mxfuse.ops.library import MxfuseInputError

    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    found = next((e for e in chain if isinstance(e, MxfuseInputError)), None)
    match = None if found is not None else next(filter(None, (_MXFUSE_OP_ERROR.search(str(e)) for e in chain)), None)
    if found is not None:
        what = str(found)
    elif match is not None:
        what = match.group(0)
    else:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    where = _user_frame(chain, module)
    return f"{what}{f' ({where})' if where else ''}; --verbose shows the traceback"


def _user_frame(chain: Sequence[BaseException], module: object) -> str:
    """`in <submodule> (<Class>.forward) at file.py:line`: the innermost frame of the user's code that Dynamo
    was tracing (its `real_stack`), and the submodule whose forward holds that line."""
    stack = next((e.real_stack for e in chain if getattr(e, "real_stack", None)), None)  # type: ignore[attr-defined]
    if not stack:
        return ""
    frame = stack[-1]
    at = f"at {os.path.basename(frame.filename)}:{frame.lineno}"
    named = getattr(module, "named_modules", None)
    for name, sub in named() if named is not None else ():
        code = getattr(type(sub).forward, "__code__", None)
        if code is None or code.co_filename != frame.filename:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        if frame.lineno is not None and lines and min(lines) <= frame.lineno <= max(lines):
            method = f"{type(sub).__name__}.forward"
            return f"in {name} ({method}) {at}" if name else f"in {method} {at}"
    return f"in {frame.name} {at}"


def print_verdicts(graphs: Iterable[tuple[Sequence, Sequence]], source: bool, out: TextIO, fixes: bool = False):
    """Per graph: every producer site (fused or why not), counted by family, the rewrites that left the
    whole graph, and the MXFP8 quants no recognized producer feeds."""
    n_fused = n_total = 0
    for i, (verdicts, quants) in enumerate(graphs):
        sites = [v for v in verdicts if not v.whole_graph]
        whole = [v for v in verdicts if v.whole_graph]
        fused = sum(v.fused for v in sites)
        n_fused, n_total = n_fused + fused, n_total + len(sites)
        families = _counted(collections.Counter(v.family for v in sites))
        print(
            f"graph {i}: {_n(len(sites), 'site')} ({families}), {fused} fused, {len(sites) - fused} not fused", file=out
        )
        for v in sites:
            where = " ".join(filter(None, (v.module, f"at {v.source}" if v.source else None)))
            print(f"  {v.node} [{v.kind}] {where}".rstrip(), file=out)
            if v.source_line and source:
                print(f"      {v.source_line}", file=out)
            print(f"    {'fused: ' if v.fused else 'not fused: '}{v.detail}", file=out)
            if fixes and not v.fused and v.fix:
                print(f"    fix: {v.fix}", file=out)
        for v in whole:
            print(f"  {v.rewrite} left the whole graph alone at {v.node}: {v.detail}", file=out)
        if quants:
            producers = collections.Counter(q.producer for q in quants)
            print(f"  MXFP8 quants not fed by a recognized producer (left as they are): {len(quants)}", file=out)
            for p, n in sorted(producers.items()):
                print(f"    {n} read {p}", file=out)
            for q in quants:
                if q.looks_like_norm:
                    print(
                        f"    {q.quant}: its input comes from {q.producer}, which looks like a norm but is not a "
                        "form the recognizers know (mxfuse, flashinfer, vllm_ir, Hugging Face ATen)",
                        file=out,
                    )
    print(f"{n_fused} of {_n(n_total, 'site')} fused", file=out)


_FAMILY_NOUNS = {"norm": "norm", "act_mul": "act·mul", "gate": "gated output", "gated_norm": "gated norm"}


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _counted(families: collections.Counter) -> str:
    """`3 norms, 1 act·mul`: the sites of a graph by producer family, in the families' order."""
    from mxfuse.patterns.producers import ProducerFamily

    nouns = {f: _FAMILY_NOUNS.get(f.value, f.value.replace("_", " ")) for f in ProducerFamily}  # a new family: its name
    return ", ".join(_n(families[f], nouns[f]) for f in ProducerFamily if families[f]) or "none"
