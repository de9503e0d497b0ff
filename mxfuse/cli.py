"""The `mxfuse` command (also `python -m mxfuse`).

Subcommands:

- ``mxfuse demo``: build the reference MiniMax-M3-style decoder stack
  (:mod:`mxfuse.models`) on the best device present, run it eagerly and under
  ``torch.compile``, check that the outputs are bitwise equal and print the time
  per step of each variant.

The demo runs a list of *variants* (eager, compiled, ...), each a name and a
callable built from the model; every variant after the first is checked bitwise
against eager and gets a column in the report. Adding "compiled with the mxfuse
passes" is one more entry built with ``compile_model(model, passes_options)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import torch

from mxfuse.models import CONFIG_NAMES, Model, ModelConfig, compile_model, example_inputs

DEFAULT_TOKENS = {"tiny": 128, "m3-flash-tp4": 1024}


# ------------------------------------------------------------------- helpers


def pick_device(name: str = "auto") -> torch.device:
    """`auto` -> cuda when a GPU is usable, else cpu; `cuda` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mxfuse demo: --device cuda was asked for but no CUDA GPU is available")
    return torch.device(name)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaNs with equal payloads compare equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.element_size() in (1, 2, 4, 8):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """A one-line progress indicator: `label ... done in X s` (a live timer on a terminal)."""

    def __init__(self, label: str, out: TextIO):
        self.label, self.out = label, out
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.out.write(f"{self.label} ...")
        self.out.flush()
        if self.live:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def _tick(self):
        spinner = "|/-\\"
        i = 0
        while not self._stop.wait(0.25):
            elapsed = time.perf_counter() - self.t0
            self.out.write(f"\r{self.label} ... {spinner[i % 4]} {elapsed:5.1f} s")
            self.out.flush()
            i += 1

    def __exit__(self, exc_type, exc, tb):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.elapsed = time.perf_counter() - self.t0
        prefix = f"\r{self.label} ..." if self.live else ""
        status = "failed" if exc_type else "done"
        self.out.write(f"{prefix} {status} in {self.elapsed:.1f} s" + (" " * 8 if self.live else "") + "\n")
        self.out.flush()
        return False


@dataclass
class VariantResult:
    name: str
    output: torch.Tensor
    step_ms: float
    first_call_s: float
    bitwise_vs_eager: bool | None = None
    max_abs_diff: float | None = None


@dataclass
class DemoResult:
    device: torch.device
    config: ModelConfig
    tokens: int
    variants: list[VariantResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(v.bitwise_vs_eager is not False for v in self.variants)


def demo_variants(model: torch.nn.Module) -> list[tuple[str, Callable, str | None]]:
    """`(name, callable, progress label or None)` of every variant the demo runs; the first is the reference.

    A later change adds `("mxfuse passes", compile_model(model, {...}), "compiling with the mxfuse passes")`.
    """
    return [
        ("eager", model, None),
        ("compiled", compile_model(model, None), "compiling with torch.compile (inductor)"),
    ]


def time_steps(fn: Callable, x: torch.Tensor, steps: int, device: torch.device, warmup: int = 2) -> float:
    """Median wall time of one call in ms over `steps` calls (each synchronized), after `warmup` calls."""
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            fn(x)
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            fn(x)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------------- demo


def run_demo(
    config: ModelConfig, tokens: int, device: torch.device, steps: int = 5, out: TextIO | None = None
) -> DemoResult:
    out = out or sys.stdout
    c = config
    print("mxfuse demo: reference MiniMax-M3-style decoder stack (MXFP8 linears, Gemma norms)", file=out)
    dev_desc = str(device)
    if device.type == "cuda":
        dev_desc += f" ({torch.cuda.get_device_name(device)})"
    else:
        dev_desc += f" ({torch.get_num_threads()} threads)"
    print(f"  device : {dev_desc}, torch {torch.__version__}", file=out)
    print(
        f"  config : {c.name}: hidden {c.hidden}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv heads"
        f" x {c.head_dim}, intermediate {c.intermediate}, vocab {c.vocab}, {str(c.dtype).removeprefix('torch.')}",
        file=out,
    )
    shapes = ", ".join(f"{n} {nk[0]}x{nk[1]}" for n, nk in c.linear_shapes().items())
    print(f"  linears: (N x K) {shapes}", file=out)
    print(f"  tokens : {tokens} (one causal sequence), {steps} timed steps", file=out)
    out.flush()

    with Progress(f"building the model on {device}", out):
        model = Model(config, device=device).eval()
        x = example_inputs(config, tokens, device)
    result = DemoResult(device, config, tokens)
    reference = None
    for name, fn, label in demo_variants(model):
        with Progress(label or f"running {name}", out) as p, torch.inference_mode():
            y = fn(x)
            _sync(device)
        step_ms = time_steps(fn, x, steps, device)
        v = VariantResult(name, y, step_ms, p.elapsed)
        if reference is None:
            reference = y
        else:
            v.bitwise_vs_eager = bitwise_equal(y, reference)
            v.max_abs_diff = (y.float() - reference.float()).abs().max().item() if y.shape == reference.shape else None
        result.variants.append(v)
    _print_table(result, out)
    return result


def _print_table(result: DemoResult, out: TextIO):
    names = [v.name for v in result.variants]
    width = max(12, *(len(n) + 2 for n in names))
    label_w = 22

    def row(label, cells):
        print(f"  {label:<{label_w}}" + "".join(f"{cell:>{width}}" for cell in cells), file=out)

    eager_ms = result.variants[0].step_ms
    print("", file=out)
    row("", names)
    row("time per step", [f"{v.step_ms:.3f} ms" for v in result.variants])
    row("speedup vs eager", [f"{eager_ms / v.step_ms:.2f}x" for v in result.variants])
    row("first call", [f"{v.first_call_s:.2f} s" for v in result.variants])
    marks = {None: "(ref)", True: "yes", False: "NO"}
    row("bitwise == eager", [marks[v.bitwise_vs_eager] for v in result.variants])
    print("", file=out)
    shape = "x".join(str(d) for d in result.variants[0].output.shape)
    dtype = str(result.variants[0].output.dtype).removeprefix("torch.")
    for v in result.variants[1:]:
        if v.bitwise_vs_eager:
            print(f"bitwise check PASSED: {v.name} output == eager output ({shape} {dtype}, every bit)", file=out)
        else:
            print(f"bitwise check FAILED: {v.name} output != eager output (max |diff| {v.max_abs_diff})", file=out)
    out.flush()


# ----------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxfuse", description="Inductor passes that fuse Gemma RMSNorm with MXFP8 quantization."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run the reference MXFP8 decoder eagerly and compiled; check bitwise equality and time it",
        description="Build the reference MiniMax-M3-style decoder (random weights, MXFP8 linears, Gemma norms), "
        "run it eagerly and under torch.compile, check the outputs are bitwise equal, print timings.",
    )
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if present")
    demo.add_argument("--tokens", type=int, default=None, help="tokens (rows); default 128 (tiny) / 1024 (m3)")
    demo.add_argument("--config", choices=CONFIG_NAMES, default="tiny", help="model shapes (default: tiny)")
    demo.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    demo.add_argument("--steps", type=int, default=10, help="timed steps per variant, median reported (default 10)")
    demo.add_argument(
        "--native-activation",
        action="store_true",
        help="SwiGLU as plain PyTorch that Inductor fuses (bitwise vs. eager guaranteed only on CPU)",
    )
    demo.set_defaults(func=_cmd_demo)
    return parser


def _cmd_demo(args, out: TextIO) -> int:
    overrides = {}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    if args.native_activation:
        overrides["native_activation"] = True
    config = ModelConfig.by_name(args.config, **overrides)
    tokens = args.tokens if args.tokens is not None else DEFAULT_TOKENS[config.name]
    if tokens < 1 or args.steps < 1:
        raise SystemExit("mxfuse demo: --tokens and --steps must be positive")
    result = run_demo(config, tokens, pick_device(args.device), steps=args.steps, out=out)
    return 0 if result.passed else 1


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(out or sys.stdout)
        return 2
    return args.func(args, out or sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
