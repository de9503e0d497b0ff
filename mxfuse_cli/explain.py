"""`mxfuse explain`: its arguments and their checks (what it runs: :mod:`mxfuse.cli.explain`)."""

from __future__ import annotations

import argparse

from mxfuse_cli.args import add_model_args, check_model_args

NAME = "explain"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="for every producer of an MXFP8 activation (norm, act·mul, gate) of the compiled graph: fused or not, "
        "and why",
        description="Compile a model with the mxfuse passes and say, for every producer of an MXFP8 activation "
        "(an RMSNorm, an act·mul before down_proj, a gated output) of the graph, whether it fused with its quant "
        "and if not why, with its module and source line.",
    )
    add_model_args(p, factories=True)
    p.add_argument("--source", action="store_true", help="also print the source line of each site")
    p.add_argument(
        "--verbose", action="store_true", help="a model that fails to compile: the whole traceback, not one line"
    )
    p.set_defaults(check=check_model_args)
    return p
