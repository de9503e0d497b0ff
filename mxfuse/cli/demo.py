"""`mxfuse demo`: the reference decoder eagerly, compiled, and compiled with the passes; compared and timed."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import torch

    from mxfuse.cli.variants import DemoResult
    from mxfuse.models import ModelConfig
    from mxfuse.passes.options import PassOptions

NAME = "demo"


def run(args: argparse.Namespace, out: TextIO) -> int:
    from mxfuse.cli.devices import pick_device, sp_backend

    # the device first (torch only): no GPU, or too large a world, is said before anything is built
    device = pick_device(args.device, NAME) if args.sp is None else sp_backend(args.sp, args.device)[1]

    from mxfuse.cli.sp import run_demo_sp
    from mxfuse.cli.targets import pass_options_from
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
        result = run_demo(config, args.tokens, device, args.steps, out, options)
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
