"""`mxfuse demo`: the reference decoder eagerly, compiled, and compiled with the passes; compared and timed."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from mxfuse.cli.args import CONFIG_NAMES, add_device_arg, add_pass_args, positive_int

if TYPE_CHECKING:
    import torch

    from mxfuse.cli.variants import DemoResult
    from mxfuse.models import ModelConfig
    from mxfuse.passes.options import PassOptions

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
    p.set_defaults(check=check, run=run)
    return p


def check(args: argparse.Namespace, parser: argparse.ArgumentParser):
    if args.tokens is None:
        args.tokens = DEFAULT_TOKENS[args.config]
    if args.sp is not None and args.tokens % args.sp:
        parser.error(f"--tokens {args.tokens} is not a multiple of --sp {args.sp}")


def run(args: argparse.Namespace, out: TextIO) -> int:
    from mxfuse.cli.sp import run_demo_sp
    from mxfuse.cli.targets import pass_options_from, pick_device
    from mxfuse.models import ModelConfig

    overrides = {}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    if args.native_activation:
        overrides["native_activation"] = True
    config = ModelConfig.by_name(args.config, **overrides)
    options = pass_options_from(args)
    if args.sp is not None:
        result = run_demo_sp(config, args.tokens, args.sp, args.device, args.steps, out, options)
    else:
        result = run_demo(config, args.tokens, pick_device(args.device, NAME), args.steps, out, options)
    return 0 if result.passed else 1


def run_demo(
    config: ModelConfig,
    tokens: int,
    device: torch.device,
    steps: int = 5,
    out: TextIO | None = None,
    pass_options: PassOptions | None = None,
) -> DemoResult:
    """The demo in this process: header, the three variants, the report."""
    from mxfuse.cli.progress import Progress
    from mxfuse.cli.report import print_header, print_report
    from mxfuse.cli.variants import DemoResult, run_variants
    from mxfuse.models import Model, example_inputs
    from mxfuse.passes.options import PassOptions

    out = out or sys.stdout
    pass_options = pass_options or PassOptions()
    print_header(config, tokens, device, steps, out)
    with Progress(f"building the model on {device}", out):
        model = Model(config, device=device).eval()
        x = example_inputs(config, tokens, device)
    result = DemoResult(device, config, tokens, sp_gather=pass_options.sp_gather, steps=steps)
    result.variants = run_variants(model, x, device, steps, lambda label: Progress(label, out), pass_options)
    print_report(result, out)
    return result
