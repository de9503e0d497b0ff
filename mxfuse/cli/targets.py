"""What `dump` and `explain` compile, on which device, with which pass options."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mxfuse.cli.devices import pick_device
from mxfuse.cli.report import counted
from mxfuse.models import Model, ModelConfig, example_inputs
from mxfuse.passes.options import PassOptions


@contextlib.contextmanager
def _transformers_quiet():
    """transformers' warnings about the tiny layer's config (token ids beyond its 256-word vocabulary, which
    the layer never reads) are not the user's to act on: errors only, while it is built."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@dataclass
class Target:
    """What dump/explain compile: a callable, its input, and words about it."""

    fn: Callable
    x: torch.Tensor
    description: str


def build_target(args: argparse.Namespace, command: str) -> Target:
    if args.model == "hf-minimax-m3":
        try:
            from mxfuse.hf import tiny_minimax_m3_example

            with _transformers_quiet():
                fn, x = tiny_minimax_m3_example(args.tokens)
        except ImportError as e:
            raise SystemExit(
                f"mxfuse {command} --model hf-minimax-m3 needs transformers with MiniMax-M3 ({e}): "
                "pip install 'mxfuse[hf]'"
            ) from None
        desc = f"Hugging Face MiniMaxM3VLDecoderLayer (tiny: hidden 128, MXFP8 linears), {args.tokens} tokens, cpu"
        return Target(fn, x, desc)
    device = pick_device(args.device, command)
    overrides = {"n_layers": args.layers} if args.layers is not None else {}
    config = ModelConfig.by_name(args.config, **overrides)
    model = Model(config, device=device).eval()
    desc = f"reference decoder ({config.name}: hidden {config.hidden}, {counted(config.n_layers, 'layer')})"
    desc += f", {args.tokens} tokens, {device}"
    return Target(model, example_inputs(config, args.tokens, device), desc)


def pass_options_from(args: argparse.Namespace, dump_dir: str | None = None) -> PassOptions:
    return PassOptions(fuse_norm_quant=not args.no_fuse_norm_quant, sp_gather=args.sp_gather, dump_dir=dump_dir)


def options_text(options: PassOptions) -> str:
    return f"fuse_norm_quant={options.fuse_norm_quant}, sp_gather={options.sp_gather!r}"
