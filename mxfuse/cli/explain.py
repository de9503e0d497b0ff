"""`mxfuse explain`: for every Gemma norm of the compiled graph, fused or not, and why."""

from __future__ import annotations

import argparse
import collections
from typing import TextIO

from mxfuse.cli.args import add_model_args, check_model_args

NAME = "explain"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="for every Gemma norm of the compiled graph: fused or not, and why",
        description="Compile a model with the mxfuse passes and say, for every Gemma norm of the graph, whether "
        "it fused and if not why, with its module and source line.",
    )
    add_model_args(p)
    p.add_argument("--source", action="store_true", help="also print the source line of each norm")
    p.set_defaults(check=check_model_args, run=run)
    return p


def run(args: argparse.Namespace, out: TextIO) -> int:
    from mxfuse.cli.recording import RecordingPass, compile_and_run
    from mxfuse.cli.targets import build_target, options_text, pass_options_from

    target = build_target(args, NAME)
    options = pass_options_from(args)
    pass_obj = RecordingPass(options, explain=True)
    print(f"mxfuse explain: {target.description}; passes: {options_text(options)}", file=out)
    compile_and_run(target.fn, target.x, pass_obj, "compiling", out)
    n_fused = n_total = 0
    for i, (verdicts, quants) in enumerate(zip(pass_obj.verdicts, pass_obj.quant_inputs)):
        fused = sum(v.fused for v in verdicts)
        n_fused, n_total = n_fused + fused, n_total + len(verdicts)
        print(f"graph {i}: {len(verdicts)} Gemma norms, {fused} fused, {len(verdicts) - fused} not fused", file=out)
        for v in verdicts:
            where = " ".join(filter(None, (v.module, f"at {v.source}" if v.source else None)))
            print(f"  {v.node} [{v.kind}] {where}".rstrip(), file=out)
            if v.source_line and args.source:
                print(f"      {v.source_line}", file=out)
            print(f"    {'fused: ' if v.fused else 'not fused: '}{v.detail}", file=out)
        if quants:
            producers = collections.Counter(q.producer for q in quants)
            print(f"  MXFP8 quants not fed by a Gemma norm (left as they are): {len(quants)}", file=out)
            for p, n in sorted(producers.items()):
                print(f"    {n} read {p}", file=out)
            for q in quants:
                if q.looks_like_norm:
                    print(
                        f"    {q.quant}: its input comes from {q.producer}, which looks like a norm but is not a "
                        "form the recognizers know (mxfuse, flashinfer, vllm_ir, Hugging Face ATen)",
                        file=out,
                    )
    print(f"{n_fused} of {n_total} Gemma norms fused", file=out)
    return 0 if not pass_obj.merged_report().failed else 1
