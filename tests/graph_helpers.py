"""The graph helpers of the suite, one of each: `trace` (a function to a post-grad-like ATen graph,
without compiling), `run_pass` (the pass on such a graph), `CapturingPass` / `compile_with_pass`
(a real compile, recording what the post-grad graph held).

Bitwise comparison and op counting live in the package (`mxfuse.testing`,
`mxfuse.passes.analysis`); `assert_bitwise`, `bits` and `op_counts` / `op_name` are
re-exported here only for tests that still import them from this module."""

from __future__ import annotations

import collections
import contextlib
import copy
import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import mxfuse
from mxfuse.ops import reference
from mxfuse.passes import post_grad
from mxfuse.passes.analysis import op_counts, op_name
from mxfuse.passes.explain import RecordingPass, copy_graph
from mxfuse.passes.options import PassOptions
from mxfuse.passes.report import PassReport
from mxfuse.testing import assert_bitwise, bits


def trace(fn, *args, dynamic: bool = False, decompose: bool = False) -> fx.GraphModule:
    """`fn` as an ATen graph (make_fx over fake tensors; no compile). With `dynamic`, dim 0 of the first
    argument is symbolic, and so is dim 0 of every later argument of the same shape and dtype (the same
    symbol: the token count); every other size is static. With `decompose`, Inductor's decompositions
    apply (`.float()` becomes `prims.convert_element_type`, as in a post-grad graph). A tensor `fn`
    closes over becomes a `get_attr` constant."""
    table = None
    if decompose:
        from torch._inductor.decomposition import select_decomp_table

        table = select_decomp_table()
    if not dynamic:
        return make_fx(fn, decomposition_table=table, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = []
    for i, a in enumerate(args):
        if i == 0:
            dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (a.dim() - 1)
            fakes.append(mode.from_tensor(a, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)))
        elif a.shape == args[0].shape and a.dtype == args[0].dtype:
            with mode:
                fakes.append(torch.empty_like(fakes[0]))
        else:
            fakes.append(mode.from_tensor(a, static_shapes=True))
    return make_fx(fn, decomposition_table=table, tracing_mode="real")(*fakes)


def run_pass(gm: fx.GraphModule, **options) -> PassReport:
    """The pass on a traced graph, in place, with `options` (the environment fills the rest: strict in this
    suite, see conftest); no site may have failed."""
    report = post_grad.run(gm.graph, PassOptions.from_env(**options))
    assert report.failed is None, report.failed
    gm.recompile()
    return report


def rewritten(fn, *args, **options) -> tuple[fx.GraphModule, fx.GraphModule, PassReport]:
    """`(before, after, report)`: `fn` traced with Inductor's decompositions, a copy rewritten by the pass
    (`options` as `run_pass` takes them), the report. Both graphs run eagerly: the bits to compare."""
    before = trace(fn, *args, decompose=True)
    after = copy.deepcopy(before)
    return before, after, run_pass(after, **options)


def call_arguments(node: fx.Node) -> dict:
    """What an op call receives, by schema name: its positional and keyword arguments, and the
    defaults of those not passed (the fused ops take some flags by position, others by keyword)."""
    passed = dict(zip((a.name for a in node.target._schema.arguments), node.args)) | dict(node.kwargs)
    return {a.name: passed.get(a.name, a.default_value) for a in node.target._schema.arguments}


def edges(graph: fx.Graph) -> set[tuple[str, str]]:
    """`(producer, consumer)` op names of every data edge between two calls (through `getitem`)."""
    found = set()
    for node in graph.nodes:
        if (consumer := op_name(node)) is None:
            continue
        for arg in node.all_input_nodes:
            src = arg.args[0] if arg.target is operator.getitem else arg
            if isinstance(src, fx.Node) and (producer := op_name(src)) is not None:
                found.add((producer, consumer))
    return found


class CapturingPass(RecordingPass):
    """`RecordingPass` (each graph's report kept) that also keeps, of the last graph, what the tests
    read: its ops before and after the rewrites, its code, its call targets and a copy of it as the
    pass left it (Inductor goes on editing its own). `options=None`: records only, no rewrites."""

    def __init__(self, options: PassOptions | None):
        super().__init__(options if options is not None else PassOptions())
        self.rewrites = options is not None
        self.calls = 0
        self.before: collections.Counter | None = None
        self.after: collections.Counter | None = None
        self.graph: torch.fx.Graph | None = None
        self.graph_text: str | None = None
        self.targets: list[str] = []

    def __call__(self, graph):
        self.calls += 1
        self.before = op_counts(graph)
        if self.rewrites:
            super().__call__(graph)
        self.after = op_counts(graph)
        self.graph = copy_graph(graph)
        self.graph_text = graph.python_code("self").src
        self.targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]

    @property
    def report(self) -> PassReport | None:
        """The last graph's report (None: the rewrites did not run)."""
        return self.last_report

    def uuid(self):
        return None  # never cache: every compile captures


def compile_with_pass(fn, *, dynamic=False, passes=True, **options):
    """`(compiled_fn, capture)`; `passes=False` compiles without the mxfuse rewrites.

    Options as `mxfuse.post_grad_pass()` takes them (the environment fills the rest:
    the test suite sets MXFUSE_STRICT=1 in conftest)."""
    torch._dynamo.reset()
    capture = CapturingPass(PassOptions.from_env(**options) if passes else None)
    compiled = torch.compile(fn, dynamic=dynamic, options={"post_grad_custom_post_pass": capture})
    return compiled, capture


def example_inputs(m: int = 4, k: int = 64, dtype=torch.bfloat16, device="cpu"):
    """Small `(x, residual, weight, eps)` for building graphs of every form in tests."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
    residual = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
    weight = (0.1 * torch.randn(k, generator=g)).to(dtype=dtype, device=device)
    return x, residual, weight, 1e-6


def inputs(m=5, k=64, dtype=torch.bfloat16):
    """`(x, residual, weight)` of the norm tests."""
    x, residual, weight, _ = example_inputs(m, k, dtype)
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

__all__ = ["assert_bitwise", "bits", "mxfuse", "op_counts", "op_name"]


@contextlib.contextmanager
def flashinfer_norm_ops(prefix: str, weight_offset: float):
    """FlashInfer's in-place norms `{prefix}rmsnorm` / `{prefix}fused_add_rmsnorm` as torch ops, with
    FlashInfer's schemas (`prefix` "gemma_": the Gemma norms, weight offset 1; "": the standard ones,
    offset 0). FlashInfer 0.7 registers no torch ops (its register_custom_op is a no-op), so they are
    defined here, in place, with the reference as the CPU impl; yields `torch.ops.flashinfer`."""
    ns = torch.ops.flashinfer
    plain_name, add_name = f"{prefix}rmsnorm", f"{prefix}fused_add_rmsnorm"
    if hasattr(ns, add_name):
        yield ns
        return
    lib = torch.library.Library("flashinfer", "FRAGMENT")
    lib.define(f"{plain_name}(Tensor(a!) out, Tensor input, Tensor weight, float eps, bool? enable_pdl) -> ()")
    lib.define(f"{add_name}(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, bool? enable_pdl) -> ()")

    def plain(out, input, weight, eps, enable_pdl):
        out.copy_(reference.gemma_rmsnorm(input, weight, eps, weight_offset))

    def fused_add(input, residual, weight, eps, enable_pdl):
        y, res = reference.gemma_fused_add_rmsnorm(input, residual, weight, eps, weight_offset=weight_offset)
        input.copy_(y)
        residual.copy_(res)

    lib.impl(plain_name, plain, "CompositeExplicitAutograd")
    lib.impl(add_name, fused_add, "CompositeExplicitAutograd")
    lib._register_fake(plain_name, lambda *a: None)
    lib._register_fake(add_name, lambda *a: None)
    try:
        yield ns
    finally:
        lib._destroy()
