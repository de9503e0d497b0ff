"""The pass as the command runs it: :class:`~mxfuse.passes.explain.RecordingPass` (every graph's report
kept, typed), and compiling a target with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

import torch

from mxfuse.cli.progress import Progress
from mxfuse.passes.analysis import capture_wrapper_code
from mxfuse.passes.explain import RecordingPass
from mxfuse.passes.post_grad import MxfusePass

__all__ = ["RecordingPass", "compile_and_run", "compile_with"]


def compile_with(fn, pass_obj: MxfusePass | None):
    """`torch.compile(fn, fullgraph=True)` with `pass_obj` as Inductor's post-grad custom pass."""
    options: dict[str, str | int | bool | Callable[..., Any]] | None = None
    if pass_obj is not None:
        options = {"post_grad_custom_post_pass": pass_obj}
    return torch.compile(fn, fullgraph=True, options=options)


def compile_and_run(fn, x: torch.Tensor, pass_obj: MxfusePass, label: str, out: TextIO):
    """Compile `fn` afresh with the pass, run it once on `x`; `(compiled, wrapper codes)`."""
    torch._dynamo.reset()
    compiled = compile_with(fn, pass_obj)
    codes: list[str] = []
    with Progress(label, out), capture_wrapper_code(codes), torch.inference_mode():
        compiled(x)
    return compiled, codes
