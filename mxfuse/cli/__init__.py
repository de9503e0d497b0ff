"""The `mxfuse` command (also `python -m mxfuse`): the parser and `main`.

Subcommands, one module each:

- `mxfuse demo` (:mod:`mxfuse.cli.demo`): the reference MiniMax-M3-style decoder stack
  eagerly, under `torch.compile` and under `torch.compile` with the mxfuse passes: the
  patterns matched, the kernel launches in the code Inductor generated, the bf16 bytes
  that no longer go to memory, the bitwise checks and the time per step. `--sp N` runs
  the sequence-parallel form on N processes (gloo on CPU, NCCL on N GPUs).
- `mxfuse dump --out DIR` (:mod:`mxfuse.cli.dump`): depyf's debug dump and the passes'
  before/after graphs, with `DIR/INDEX.md` saying which file shows what.
- `mxfuse explain` (:mod:`mxfuse.cli.explain`): for every Gemma norm of the compiled graph,
  whether it fused and, if not, why.

Parsing and every argument check happen before torch is imported (`--help` and a bad
value answer at once); a subcommand imports what it needs when it runs. vLLM is never
imported here.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from mxfuse.cli import demo, dump, explain

SUBCOMMANDS = (demo, explain, dump)


class _Version(argparse.Action):
    """`--version`, read when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from mxfuse import __version__

        print(f"mxfuse {__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxfuse", description="Inductor passes that fuse Gemma RMSNorm with MXFP8 quantization."
    )
    parser.add_argument("--version", action=_Version, help="print the mxfuse version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.add_parser(sub).set_defaults(parser=sub.choices[command.NAME])
    return parser


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help(out or sys.stdout)
        return 2
    if unknown:  # the subcommand's usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.check(args, args.parser)

    from mxfuse.cli.progress import quiet_torch_imports

    quiet_torch_imports()
    return args.run(args, out or sys.stdout)
