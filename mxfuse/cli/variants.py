"""The demo's variants (eager, compiled, compiled with the passes): run, checked bit for bit, timed."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mxfuse.cli.recording import RecordingPass, compile_with
from mxfuse.models import ModelConfig, compile_model
from mxfuse.passes.analysis import capture_wrapper_code, count_launches
from mxfuse.passes.options import PassOptions
from mxfuse.passes.report import PassReport
from mxfuse.testing import bitwise_equal
from mxfuse.timing import step_time_ms, synchronize

PASSES_VARIANT = "mxfuse passes"


@dataclass
class VariantResult:
    name: str
    output: torch.Tensor | None
    step_ms: float
    first_call_s: float
    bitwise_vs_eager: bool | None = None
    max_abs_diff: float | None = None
    bitwise_vs_compiled: bool | None = None  # the passes variant vs. compiled without them
    launches: collections.Counter | None = None
    report: PassReport | None = None
    output_desc: str = ""
    timing: str = "wall clock"  # how step_ms was measured (see `step_time_ms`)


@dataclass
class DemoResult:
    device: torch.device
    config: ModelConfig
    tokens: int
    variants: list[VariantResult] = field(default_factory=list)
    world: int = 1
    rank_checks: list[dict] = field(default_factory=list)  # SP: per rank, {variant: bitwise flags}
    sp_gather: str = "auto"
    steps: int = 0

    @property
    def rows(self) -> int:
        return self.tokens // self.world

    @property
    def passed(self) -> bool:
        local = all(v.bitwise_vs_eager is not False and v.bitwise_vs_compiled is not False for v in self.variants)
        return local and all(all(flag is not False for flag in r.values()) for r in self.rank_checks)


def demo_variants(model: torch.nn.Module, pass_options: PassOptions | None = None):
    """`(name, callable, progress label or None, pass or None)` of every variant; the first is the reference."""
    pass_obj = RecordingPass(pass_options or PassOptions())
    return [
        ("eager", model, None, None),
        ("compiled", compile_model(model, None, fullgraph=True), "compiling with torch.compile (inductor)", None),
        (PASSES_VARIANT, compile_with(model, pass_obj), "compiling with torch.compile + the mxfuse passes", pass_obj),
    ]


def run_variants(
    model, x, device, steps, progress: Callable, pass_options: PassOptions | None = None, graphs: bool = True
) -> list[VariantResult]:
    """Run, check and time every demo variant; `progress(label)` is a context manager around each first call."""
    results: list[VariantResult] = []
    outputs: dict[str, torch.Tensor] = {}  # by variant name (a result's `output` may be dropped later)
    for name, fn, label, pass_obj in demo_variants(model, pass_options):
        codes: list[str] = []
        capture = capture_wrapper_code(codes) if label else contextlib.nullcontext()
        with progress(label or f"running {name}") as p, capture, torch.inference_mode():
            y = fn(x)
            synchronize(device)
        step_ms, timing = step_time_ms(fn, x, steps, device, graphs)
        v = VariantResult(name, y, step_ms, p.elapsed, timing=timing)
        v.output_desc = f"{'x'.join(str(d) for d in y.shape)} {str(y.dtype).removeprefix('torch.')}"
        if label:
            v.launches = count_launches(codes)
        if pass_obj is not None:
            v.report = pass_obj.merged_report()
        if results:
            ref = outputs[results[0].name]
            v.bitwise_vs_eager = bitwise_equal(y, ref)
            v.max_abs_diff = (y.float() - ref.float()).abs().max().item() if y.shape == ref.shape else None
        if pass_obj is not None:
            v.bitwise_vs_compiled = bitwise_equal(y, outputs["compiled"])
        results.append(v)
        outputs[name] = y
    return results
