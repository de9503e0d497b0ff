"""Arguments shared by the subcommands, and the checks that run before torch is imported.

Nothing here imports torch: `mxfuse --help` and a bad argument must answer at once. The
choice lists repeat the package's (`mxfuse.models.CONFIG_NAMES`, `mxfuse.passes.options.
SP_GATHER_MODES`) because importing those modules imports torch; tests/test_cli.py checks
that they agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from mxfuse_cli.model_spec import FORM, RETURNS, ModelSpecError, check_findable, parse

DEFAULT_TOKENS = 64

CONFIG_NAMES = ("tiny", "m3-flash-tp4")
SP_GATHER_MODES = ("auto", "bf16", "mxfp8")
MODEL_NAMES = ("reference", "hf-minimax-m3")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_DEVICE = "auto"
EXTRAS = {"depyf": "dump", "transformers": "hf"}  # optional dependency -> the extra that installs it


def positive_int(text: str) -> int:
    """argparse `type=` for counts: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_device_arg(p: argparse.ArgumentParser, what: str = "the reference model"):
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=DEFAULT_DEVICE,
        help=f"where {what} runs (default {DEFAULT_DEVICE}: cuda when a GPU is usable, else cpu)",
    )


def add_pass_args(p: argparse.ArgumentParser):
    p.add_argument("--sp-gather", choices=SP_GATHER_MODES, default="auto", help="pass option sp_gather (default auto)")
    p.add_argument("--no-fuse-norm-quant", action="store_true", help="pass option fuse_norm_quant=False")


def model_spec(text: str) -> str:
    """argparse `type=` for `explain --model`: a known model name, or `pkg.module:factory` (its form checked,
    and its top-level module found, without importing anything)."""
    if text in MODEL_NAMES:
        return text
    if ":" not in text:
        if text.endswith(".py") or "/" in text or os.sep in text:  # a file: say what to write instead
            name = os.path.splitext(os.path.basename(text))[0]
            raise argparse.ArgumentTypeError(
                f"{text}: expected {FORM}, not a file path: run from the file's directory with "
                f"--model {name}:FACTORY, FACTORY the function that returns {RETURNS}"
            )
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(MODEL_NAMES)} or {FORM}, got {text!r}")
    try:
        check_findable(parse(text))
    except ModelSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def is_factory(model: str) -> bool:
    """`--model pkg.module:factory`: the user's module, not one of the package's models."""
    return ":" in model


def add_model_args(p: argparse.ArgumentParser, factories: bool = False):
    """What `dump` and `explain` compile: the reference decoder or the tiny Hugging Face layer (and, with
    `factories`, any module a `pkg.module:factory` returns)."""
    if factories:
        p.add_argument(
            "--model",
            type=model_spec,
            default="reference",
            metavar="{" + ",".join((*MODEL_NAMES, FORM)) + "}",
            help=f"what to compile (default: reference); {FORM}: a function taking no arguments that returns "
            f"{RETURNS}, its module found as python -m finds one (the current directory first, then sys.path)",
        )
    else:
        p.add_argument("--model", choices=MODEL_NAMES, default="reference", help="what to compile (default: reference)")
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=None,
        help=f"tokens (rows) of the input (default {DEFAULT_TOKENS}; a factory's inputs are its own)",
    )
    p.add_argument("--config", choices=CONFIG_NAMES, default="tiny", help="reference model shapes (default: tiny)")
    p.add_argument("--layers", type=positive_int, default=None, help="reference model: override the number of layers")
    add_device_arg(p)
    add_pass_args(p)


def check_model_args(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """Flags that do not apply to the model asked for are an error, not silently ignored. Sets
    `args.factory`: the parsed :class:`~mxfuse_cli.model_spec.ModelSpec` of `--model pkg.module:factory`
    (what :mod:`mxfuse.cli.explain` loads), else None."""
    args.factory = parse(args.model) if is_factory(args.model) else None
    if args.factory is not None and args.tokens is not None:
        parser.error(f"--tokens applies to --model reference and hf-minimax-m3; {args.model} returns its own inputs")
    if args.factory is None and args.tokens is None:
        args.tokens = DEFAULT_TOKENS
    if args.model == "reference":
        return
    if args.factory is not None and args.device == "cuda":
        parser.error(f"--device cuda applies to --model reference; {args.model} places its own module and inputs")
    if args.layers is not None:
        parser.error(f"--layers applies to --model reference, not {args.model}")
    if args.device == "cuda" and not is_factory(args.model):
        parser.error(f"--device cuda applies to --model reference; {args.model} runs on cpu")
    if not is_factory(args.model):  # the Hugging Face layers
        require("transformers", f"{parser.prog} --model {args.model}")


def require(module: str, who: str):
    """A one-line error naming the extra to install when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"{who} needs {module}: pip install 'mxfuse[{EXTRAS[module]}]'")
