"""`mxfuse explain`: for every RMSNorm (Gemma or standard) of the compiled graph, fused or not, and why."""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable, Sequence
from typing import TextIO

from mxfuse_cli.args import is_factory

NAME = "explain"


def run(args: argparse.Namespace, out: TextIO) -> int:
    if is_factory(args.model):
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
    return 0 if not pass_obj.merged_report().failed else 1


def run_factory(args: argparse.Namespace, out: TextIO) -> int:
    """`--model pkg.module:factory`: explain the user's module on the inputs its factory returns."""
    from mxfuse.cli.progress import Progress
    from mxfuse.cli.targets import options_text, pass_options_from
    from mxfuse.passes.explain import explain_module
    from mxfuse_cli.model_spec import ModelSpecError, load, parse

    try:
        module, inputs = load(parse(args.model))
    except ModelSpecError as e:
        raise SystemExit(f"mxfuse explain: --model {e}") from None
    options = pass_options_from(args)
    print(f"mxfuse explain: {args.model}; passes: {options_text(options)}", file=out)
    with Progress("compiling", out):
        explanation = explain_module(module, *inputs, options=options)
    graphs = [(g.verdicts, g.quant_inputs) for g in explanation.graphs]
    print_verdicts(graphs, args.source, out, fixes=True)
    return 0 if not any(g.report.failed for g in explanation.graphs) else 1


def print_verdicts(graphs: Iterable[tuple[Sequence, Sequence]], source: bool, out: TextIO, fixes: bool = False):
    """Per graph: every norm (fused or why not), the rewrites that left the whole graph, and the
    MXFP8 quants no norm feeds."""
    n_fused = n_total = 0
    for i, (verdicts, quants) in enumerate(graphs):
        norms = [v for v in verdicts if not v.whole_graph]
        whole = [v for v in verdicts if v.whole_graph]
        fused = sum(v.fused for v in norms)
        n_fused, n_total = n_fused + fused, n_total + len(norms)
        print(f"graph {i}: {len(norms)} norms, {fused} fused, {len(norms) - fused} not fused", file=out)
        for v in norms:
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
            print(f"  MXFP8 quants not fed by a recognized norm (left as they are): {len(quants)}", file=out)
            for p, n in sorted(producers.items()):
                print(f"    {n} read {p}", file=out)
            for q in quants:
                if q.looks_like_norm:
                    print(
                        f"    {q.quant}: its input comes from {q.producer}, which looks like a norm but is not a "
                        "form the recognizers know (mxfuse, flashinfer, vllm_ir, Hugging Face ATen)",
                        file=out,
                    )
    print(f"{n_fused} of {n_total} norms fused", file=out)
