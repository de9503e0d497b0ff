"""The `mxfuse` command (also `python -m mxfuse`): the parser and `main`.

This package sits beside `mxfuse`, not inside it: `import mxfuse` registers the ops (and
imports torch), and the command must answer `--help` and bad arguments before that. Each
subcommand's arguments and checks are a module here; what it runs is the module of the
same name in `mxfuse.cli`, imported only once the arguments are good.

Subcommands:

- `mxfuse demo` (:mod:`mxfuse.cli.demo`): the reference MiniMax-M3-style decoder stack
  eagerly, under `torch.compile` and under `torch.compile` with the mxfuse passes: the
  patterns matched, the kernel launches in the code Inductor generated, the bf16 bytes
  that no longer go to memory, the bitwise checks and the time per step. `--sp N` runs
  the sequence-parallel form on N processes (gloo on CPU, NCCL on N GPUs).
- `mxfuse dump --out DIR` (:mod:`mxfuse.cli.dump`): depyf's debug dump and the passes'
  before/after graphs, with `DIR/INDEX.md` saying which file shows what.
- `mxfuse explain` (:mod:`mxfuse.cli.explain`): for every RMSNorm (Gemma or standard) of the compiled graph,
  whether it fused and, if not, why.

Nothing here imports torch, `mxfuse` or vLLM. The two packages depend in one direction: this
one imports `mxfuse.cli.<command>` to run it, with everything the runner needs on `args` (the
checked values, the parsed `--model` factory spec, the dump's manifest name); `mxfuse.cli`
never imports `mxfuse_cli`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from typing import TextIO

from mxfuse_cli import demo, dump, explain
from mxfuse_cli.model_spec import ModelSpecError

SUBCOMMANDS = (demo, explain, dump)


class _Version(argparse.Action):
    """`--version`, read when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"mxfuse {version('mxfuse')}")  # the installed version, without importing torch
        except PackageNotFoundError:  # a source tree on PYTHONPATH: ask the package itself
            from mxfuse import __version__

            print(f"mxfuse {__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxfuse", description="Inductor passes that fuse RMSNorm (Gemma and standard) with MXFP8 quantization."
    )
    parser.add_argument("--version", action=_Version, help="print the mxfuse version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.add_parser(sub).set_defaults(parser=sub.choices[command.NAME], command_module=command.NAME)
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

    # torch warns on import when numpy (not a dependency of torch or mxfuse) is absent; nothing here uses it
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    from mxfuse.cli.progress import quiet_torch_imports

    quiet_torch_imports()
    try:
        return importlib.import_module(f"mxfuse.cli.{args.command_module}").run(args, out or sys.stdout)
    except ModelSpecError as e:  # `--model pkg.module:factory` that cannot give a module and its inputs
        raise SystemExit(f"mxfuse {args.command}: --model {e}") from None
    except KeyboardInterrupt:  # the spawned ranks are gone already (run_ranks ends them)
        print(f"\nmxfuse {args.command}: interrupted", file=sys.stderr)
        return 130
