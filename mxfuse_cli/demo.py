"""`mxfuse demo`: its arguments and their checks (what it runs: :mod:`mxfuse.cli.demo`)."""

from __future__ import annotations

import argparse

from mxfuse_cli.args import CONFIG_NAMES, add_device_arg, add_pass_args, positive_int

NAME = "demo"
DEFAULT_TOKENS = {"tiny": 128, "m3-flash-tp4": 1024}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="run the reference MXFP8 decoder eagerly, compiled, and compiled with the passes; compare and time",
        description="Build the reference MiniMax-M3-style decoder (random weights, MXFP8 linears, Gemma norms), "
        "run it eagerly, under torch.compile and under torch.compile with the mxfuse passes; print the patterns "
        "matched, the kernel launches counted in Inductor's generated code, the bytes saved, the bitwise checks "
        "and the time per step.",
    )
    add_device_arg(p, "the model")
    p.add_argument("--tokens", type=positive_int, default=None, help="tokens (rows); default 128 (tiny) / 1024 (m3)")
    p.add_argument("--config", choices=CONFIG_NAMES, default="tiny", help="model shapes (default: tiny)")
    p.add_argument("--layers", type=positive_int, default=None, help="override the number of decoder layers")
    p.add_argument(
        "--steps", type=positive_int, default=10, help="timed steps per variant, median reported (default 10)"
    )
    p.add_argument(
        "--native-activation",
        action="store_true",
        help="SwiGLU as plain PyTorch that Inductor fuses (bitwise vs. eager guaranteed only on CPU)",
    )
    p.add_argument(
        "--sp",
        type=positive_int,
        default=None,
        metavar="N",
        help="sequence parallel on N local processes (gloo on CPU; NCCL when N GPUs exist)",
    )
    add_pass_args(p)
    p.set_defaults(check=check)
    return p


def check(args: argparse.Namespace, parser: argparse.ArgumentParser):
    if args.tokens is None:
        args.tokens = DEFAULT_TOKENS[args.config]
    if args.sp is not None and args.tokens % args.sp:
        parser.error(f"--tokens {args.tokens} is not a multiple of --sp {args.sp}")
