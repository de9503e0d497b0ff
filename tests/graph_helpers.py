"""Compile a function with the mxfuse pass and capture what the post-grad graph held."""

from __future__ import annotations

import collections
import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import mxfuse
from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions
from mxfuse.patterns import norm_quant


def op_name(node) -> str | None:
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name()  # e.g. "mxfuse::mxfp8_quantize"
    if isinstance(target, torch._ops.HigherOrderOperator):
        inner = node.args[0]
        return f"{target.name()}({inner.name() if hasattr(inner, 'name') else inner})"
    return getattr(target, "__name__", str(target))


def op_counts(graph) -> collections.Counter:
    return collections.Counter(filter(None, map(op_name, graph.nodes)))


class CapturingPass(CustomGraphPass):
    """Runs the mxfuse pass (or none) and records the graph's ops before and after."""

    def __init__(self, options: PassOptions | None):
        self.options = options
        self.before: collections.Counter | None = None
        self.after: collections.Counter | None = None
        self.graph_text: str | None = None
        self.report: post_grad.PassReport | None = None
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1
        self.before = op_counts(graph)
        if self.options is not None:
            self.report = post_grad.run(graph, self.options)
        self.after = op_counts(graph)
        self.graph_text = graph.python_code("self").src

    def uuid(self):
        return None  # never cache: every test compiles and captures


def compile_with_pass(fn, *, dynamic=False, passes=True, **options):
    """`(compiled_fn, capture)`; `passes=False` compiles without the mxfuse rewrites.

    Options as `mxfuse.post_grad_pass()` takes them (the environment fills the rest:
    the test suite sets MXFUSE_STRICT=1 in conftest)."""
    torch._dynamo.reset()
    capture = CapturingPass(PassOptions.from_env(**options) if passes else None)
    compiled = torch.compile(fn, dynamic=dynamic, options={"post_grad_custom_post_pass": capture})
    return compiled, capture


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view for bitwise comparison of any dtype."""
    if t.dtype in (torch.float8_e4m3fn, torch.uint8):
        return t.view(torch.uint8)
    if t.element_size() == 2:
        return t.view(torch.int16)
    return t.view(torch.int32)


def assert_bitwise(actual, expected):
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_bitwise(a, e)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    assert torch.equal(bits(actual), bits(expected))


def inputs(m=5, k=64, dtype=torch.bfloat16):
    """`(x, residual, weight)` of the norm tests."""
    x, residual, weight, _ = norm_quant.example_inputs(m, k, dtype)
    return x, residual, weight


def check(fn, args, expect_after, *, dynamic=False, **options):
    """Compile with the pass, compare to eager bitwise, return the capture."""
    compiled, capture = compile_with_pass(fn, dynamic=dynamic, **options)
    with torch.no_grad():
        assert_bitwise(compiled(*args), fn(*args))
    for op, count in expect_after.items():
        assert capture.after[op] == count, (op, capture.after)
    return capture


MX = "mxfuse::"
FUSED_ADD = MX + "gemma_fused_add_rmsnorm_mxfp8"
FUSED_PLAIN = MX + "gemma_rmsnorm_mxfp8"
QUANT = MX + "mxfp8_quantize"
NORM_ADD = MX + "gemma_fused_add_rmsnorm"
NORM_PLAIN = MX + "gemma_rmsnorm"

__all__ = ["mxfuse"]
