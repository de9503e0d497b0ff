"""Rewrite 2 (`sp_gather`): quantization around the sequence-parallel all-gather, graph level.

Graphs are traced with make_fx under a FakeTensorMode (a world size of 2 and a group
name that no process group backs: the functional collectives' fake impls need none),
the mxfuse pass runs on them, and they are executed in ONE process by an interpreter
that simulates the gather: every rank holds the same local rows, so the gathered
tensor is `world` copies of the local one. That is enough to show the swizzled
form's wrong bits (its padding rows land in the middle) and the rewrites' exactness;
`test_sp_distributed.py` runs real gloo ranks with different rows.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops import packed, reference
from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions
from mxfuse.patterns import sp_gather
from mxfuse.patterns.gather_checks import rows_reason
from mxfuse.patterns.norm_quant import example_inputs
from mxfuse.patterns.results import SkipCode

mx = torch.ops.mxfuse
c10d = torch.ops._c10d_functional
FP8 = torch.float8_e4m3fn
K = 64
W = 2
GROUP = "sp_test_group"


# --------------------------------------------------- a GEMM that reads swizzled scales


@torch.library.custom_op("mxfuse_sp_test::linear_swizzled", mutates_args=())
def linear_swizzled(codes: torch.Tensor, scales: torch.Tensor, wc: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """An MXFP8 GEMM whose activation scales are F8_128x4-swizzled (2-D, or vLLM's flat 1-D)."""
    m, k = codes.shape
    s, sp = k // 32, (k // 32 + 3) // 4 * 4
    tiles = scales.reshape(-1, sp)[: (m + 127) // 128 * 128]
    rowmajor = reference.unswizzle_scales(tiles, m, s)
    return reference.mxfp8_linear(codes, rowmajor, wc, ws, torch.bfloat16)


@linear_swizzled.register_fake
def _(codes, scales, wc, ws):
    return codes.new_empty((codes.shape[0], wc.shape[0]), dtype=torch.bfloat16)


# ------------------------------------------------------------------ helpers


def weights(n=48, k=K):
    g = torch.Generator().manual_seed(7)
    return mx.mxfp8_quantize((torch.randn(n, k, generator=g) / 8).to(torch.bfloat16))


def local_inputs(m=5, k=K, seed=0):
    x, r, w, _ = example_inputs(m, k)
    if seed:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        r = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, r, w


def trace(fn, *args, dynamic=False):
    """make_fx graph of `fn` with fake tensors (dim 0 of 2-D activations symbolic when dynamic)."""
    mode = FakeTensorMode(shape_env=ShapeEnv() if dynamic else None, allow_non_fake_inputs=True)
    first = None
    fakes = []
    for a in args:
        if dynamic and a.dim() == 2 and a.dtype in (torch.bfloat16, torch.float16) and a.shape[1] == K:
            if first is None:
                ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
                first = mode.from_tensor(a, symbolic_context=ctx)
                fakes.append(first)
            else:
                with mode:
                    fakes.append(torch.empty_like(first))
        else:
            fakes.append(mode.from_tensor(a))
    return make_fx(fn, tracing_mode="real")(*fakes)


class SimulatedWorld(fx.Interpreter):
    """Runs a graph as every one of `world` ranks holding the same local rows would."""

    def __init__(self, gm, world=W):
        super().__init__(gm)
        self.world = world

    def call_function(self, target, args, kwargs):
        if target is c10d.all_gather_into_tensor.default:
            return torch.cat([args[0]] * self.world)
        if target is c10d.wait_tensor.default:
            return args[0]
        if _vllm_all_gather() is not None and target is _vllm_all_gather():
            return torch.cat([args[0]] * self.world, dim=args[1])
        return super().call_function(target, args, kwargs)


def _vllm_all_gather():
    ns = torch.ops.vllm
    return ns.all_gather.default if hasattr(ns, "all_gather") else None


def simulate(gm, *args):
    with torch.no_grad():
        out = SimulatedWorld(gm).run(*args)
    return out if isinstance(out, (tuple, list)) else (out,)


def run_pass(gm, **options):
    report = post_grad.run(gm.graph, PassOptions.from_env(**options))
    assert report.failed is None, report.failed
    gm.recompile()
    return report


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def gathers(gm) -> list[fx.Node]:
    ops = {c10d.all_gather_into_tensor.default, _vllm_all_gather()} - {None}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]


def bits(t):
    if t.dtype in (FP8, torch.uint8):
        return t.view(torch.uint8)
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape, a.dtype, e.dtype)
        assert torch.equal(bits(a), bits(e))


def c10d_gather(t, dim_group=(W, GROUP)):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(t, *dim_group))


def gemma_norm(x, r, w, residual):
    """(y, residual out): the fused-add norm, or the plain norm passing `r` through."""
    if residual:
        return mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
    return mx.gemma_rmsnorm(x, w, 1e-6), r


def sp_block(swizzled=False, residual=True, extra_gathered_user=False, extra_local_user=False):
    """norm -> c10d all-gather (bf16) -> quant -> GEMM: the correct bf16 form."""
    wc, ws = weights()

    def fn(x, r, w):
        y, res = gemma_norm(x, r, w, residual)
        g = c10d_gather(y)
        q, s = mx.mxfp8_quantize(g, swizzled)
        out = linear_swizzled(q, s, wc, ws) if swizzled else mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16)
        outs = [out, res]
        if extra_gathered_user:
            outs.append(g * 2)
        if extra_local_user:
            outs.append(y + 1)
        return tuple(outs)

    return fn


# ------------------------------------------------------------------ form A: norm -> gather -> quant


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("mode", ["bf16", "mxfp8", "auto"])
def test_c10d_norm_gather_quant_modes(mode, residual):
    args = local_inputs(m=5)
    gm = trace(sp_block(residual=residual), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm, sp_gather=mode)
    got = simulate(gm, *args)
    assert_same(got, expected)
    (gather,) = gathers(gm)
    if mode == "bf16":
        assert gather.meta["val"].dtype == torch.bfloat16
        assert mx.mxfp8_quantize.default in targets(gm)
        assert not report.matched
        assert any(s.rewrite == "sp_gather" and "bf16" in s.reason for s in report.skipped)
        return
    # ONE collective, carrying the packed uint8 rows [W*M, K + K/32]
    assert gather.meta["val"].dtype == torch.uint8
    assert tuple(gather.meta["val"].shape) == (W * 5, K + K // 32)
    assert gather.args[1:] == (W, GROUP)
    op = mx.gemma_fused_add_rmsnorm_mxfp8_packed if residual else mx.gemma_rmsnorm_mxfp8_packed
    assert op.default in targets(gm)
    assert mx.mxfp8_quantize.default not in targets(gm)
    assert mx.gemma_fused_add_rmsnorm.default not in targets(gm)
    kind = f"mxfuse:{'fused_add' if residual else 'plain'}->c10d_gather:mxfp8_packed:rowmajor"
    assert report.matched_strings() == {kind: 1}
    # the views are aten.slice + aten.view.dtype, nothing copies
    assert torch.ops.aten.view.dtype in targets(gm)
    assert sum(t is torch.ops.aten.slice.Tensor for t in targets(gm)) == 2


def test_gemm_records_the_strides_of_its_new_inputs():
    """Inductor enforces the strides in a custom op's `eager_input_vals` on its inputs: after
    the rewrite the GEMM must record the strided views it now reads, or Inductor copies them
    into the quant outputs' dense layout (one copy kernel per view; seen on CPU and H200)."""
    args = local_inputs(m=5)
    gm = trace(sp_block(), *args)
    (gemm,) = [n for n in gm.graph.nodes if n.target is mx.mxfp8_linear.default]
    assert "eager_input_vals" in gemm.meta  # make_fx records them for exact-strides ops
    run_pass(gm, sp_gather="mxfp8")
    recorded, _ = gemm.meta["eager_input_vals"]
    for arg, val in zip(gemm.args[:2], recorded[:2]):
        assert arg.target in (torch.ops.aten.view.dtype, torch.ops.aten.slice.Tensor)
        assert val.stride() == arg.meta["val"].stride() == (K + K // 32, 1)


def test_a_failing_rewrite_restores_the_recorded_strides(monkeypatch, caplog):
    args = local_inputs(m=5)
    gm = trace(sp_block(), *args)
    (gemm,) = [n for n in gm.graph.nodes if n.target is mx.mxfp8_linear.default]
    before, code = gemm.meta["eager_input_vals"], gm.code
    real_apply = sp_gather.SpGather.apply

    def apply_then_fail(self, graph, action, options):
        real_apply(self, graph, action, options)  # rewires the GEMM first
        raise RuntimeError("injected failure")

    monkeypatch.setattr(sp_gather.SpGather, "apply", apply_then_fail)
    with caplog.at_level("WARNING", logger="mxfuse"):
        # not strict: the site is rolled back and reported; fuse_norm_quant off so nothing else fuses
        report = post_grad.run(gm.graph, PassOptions(sp_gather="mxfp8", fuse_norm_quant=False))
    gm.recompile()
    assert not report.matched and gm.code == code
    (failed,) = [s for s in report.skipped if s.code is SkipCode.REWRITE_FAILED]
    assert failed.rewrite == "sp_gather" and "injected failure" in failed.reason
    assert gemm.meta["eager_input_vals"] is before
    assert "injected failure" in caplog.text


def test_swizzled_consumer_gets_swizzle_after_the_gather():
    args = local_inputs(m=5)
    gm = trace(sp_block(swizzled=True), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm)  # auto
    assert_same(simulate(gm, *args), expected)
    assert report.matched_strings() == {"mxfuse:fused_add->c10d_gather:mxfp8_packed:swizzled": 1}
    (gather,) = gathers(gm)
    assert gather.meta["val"].dtype == torch.uint8
    (swz,) = [n for n in gm.graph.nodes if n.target is mx.mxfp8_swizzle_scales.default]
    assert swz.args[0].target is torch.ops.aten.slice.Tensor  # swizzles the gathered scale view


def test_gathered_bf16_with_another_user_auto_keeps_bf16():
    args = local_inputs(m=5)
    gm = trace(sp_block(extra_gathered_user=True), *args)
    report = run_pass(gm)
    assert not report.matched
    reasons = [s.reason for s in report.skipped if s.rewrite == "sp_gather"]
    assert reasons and "other users" in reasons[0]
    (gather,) = gathers(gm)
    assert gather.meta["val"].dtype == torch.bfloat16


def test_gathered_bf16_with_another_user_mxfp8_forced_keeps_both_gathers():
    args = local_inputs(m=5)
    gm = trace(sp_block(extra_gathered_user=True), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm, sp_gather="mxfp8")
    assert_same(simulate(gm, *args), expected)
    assert sorted(str(g.meta["val"].dtype) for g in gathers(gm)) == ["torch.bfloat16", "torch.uint8"]
    assert list(report.matched_strings()) == ["mxfuse:fused_add->c10d_gather:mxfp8_packed:rowmajor+bf16_gather"]
    (fused,) = [n for n in gm.graph.nodes if n.target is mx.gemma_fused_add_rmsnorm_mxfp8_packed.default]
    assert fused.kwargs["emit_y"] is True


def test_local_y_with_another_user_is_emitted():
    args = local_inputs(m=5)
    gm = trace(sp_block(extra_local_user=True), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm)
    assert_same(simulate(gm, *args), expected)
    assert report.matched
    (fused,) = [n for n in gm.graph.nodes if n.target is mx.gemma_fused_add_rmsnorm_mxfp8_packed.default]
    assert fused.kwargs["emit_y"] is True


def test_dynamic_rows():
    args = local_inputs(m=5)
    gm = trace(sp_block(swizzled=True), *args, dynamic=True)
    assert not isinstance(gathers(gm)[0].meta["val"].shape[0], int)  # symbolic rows
    expected = {m: simulate(gm, *local_inputs(m, seed=m)) for m in (1, 5, 130)}
    report = run_pass(gm, sp_gather="mxfp8")
    assert report.matched
    for m in (1, 5, 130):
        assert_same(simulate(gm, *local_inputs(m, seed=m)), expected[m])


def test_gather_along_dim_1_is_left_alone():
    wc, ws = weights(k=2 * K)

    def fn(x, w):
        y = mx.gemma_rmsnorm(x, w, 1e-6)
        g = c10d_gather(y)  # dim 0 collective; the functional all_gather_tensor(gather_dim=1) adds chunk + cat
        g = torch.cat(torch.chunk(g, W, dim=0), dim=1)
        q, s = mx.mxfp8_quantize(g)
        return mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16)

    x, _, w = local_inputs()
    gm = trace(fn, x, w)
    before = targets(gm)
    report = run_pass(gm, sp_gather="mxfp8")
    assert targets(gm) == before and not report.matched
    (reason,) = [s.reason for s in report.skipped if s.rewrite == "sp_gather"]
    assert "dim other than 0" in reason


def test_world_size_not_a_constant_is_left_alone():
    args = local_inputs()
    gm = trace(sp_block(), *args)
    (gather,) = gathers(gm)
    with gm.graph.inserting_before(gather):
        size = gm.graph.call_function(torch.ops.aten.sym_size.int, (args_node(gm, 0), 0))
    size.meta["val"] = 2
    gather.args = (gather.args[0], size, gather.args[2])
    report = run_pass(gm, sp_gather="mxfp8")
    assert not report.matched
    assert any("world size" in s.reason and "constant" in s.reason for s in report.skipped)


def test_group_not_a_constant_is_left_alone():
    args = local_inputs()
    gm = trace(sp_block(), *args)
    (gather,) = gathers(gm)
    gather.args = (gather.args[0], W, args_node(gm, 0))  # a node where the group name belongs
    report = run_pass(gm, sp_gather="mxfp8")
    assert not report.matched
    assert any("group" in s.reason for s in report.skipped)


def args_node(gm, i):
    return [n for n in gm.graph.nodes if n.op == "placeholder"][i]


def test_rows_reason_guards():
    mode = FakeTensorMode()
    with mode:
        assert "multiple of 32" in rows_reason(torch.empty(4, 48, dtype=torch.bfloat16), "y").text
        assert rows_reason(torch.empty(4, 48, dtype=torch.bfloat16), "y").code is SkipCode.HIDDEN_SIZE
        assert "dtype" in rows_reason(torch.empty(4, 64), "y").text
        assert "2-D" in rows_reason(torch.empty(2, 4, 64, dtype=torch.bfloat16), "y").text
        assert rows_reason(torch.empty(4, 64, dtype=torch.float16), "y") is None


# ------------------------------------------------------------------ form B: quantized before the gather


def broken_block(swizzled=True, as_uint8=True, residual=True):
    """The field's broken form: quantize (swizzled) BEFORE the gather, gather codes and scales.

    gloo cannot gather float8, so the codes travel as `view(uint8)` and are viewed back.
    """
    wc, ws = weights()

    def fn(x, r, w):
        y, res = gemma_norm(x, r, w, residual)
        q, s = mx.mxfp8_quantize(y, swizzled)
        if as_uint8:
            q = c10d_gather(q.view(torch.uint8)).view(FP8)
        else:
            q = c10d_gather(q)
        s = c10d_gather(s)
        out = linear_swizzled(q, s, wc, ws) if swizzled else mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16)
        return out, res

    return fn


@pytest.mark.parametrize("mode", ["auto", "mxfp8", "bf16"])
@pytest.mark.parametrize("as_uint8", [True, False])
def test_broken_swizzled_gather_is_repaired(mode, as_uint8):
    args = local_inputs(m=5)
    reference_gm = trace(sp_block(swizzled=True), *args)  # the correct bf16 form
    expected = simulate(reference_gm, *args)
    gm = trace(broken_block(as_uint8=as_uint8), *args)
    broken = simulate(gm, *args)
    assert not torch.equal(bits(broken[0]), bits(expected[0]))  # rank 1's rows read rank 0's padding
    assert torch.equal(bits(broken[1]), bits(expected[1]))
    report = run_pass(gm, sp_gather=mode)
    assert_same(simulate(gm, *args), expected)
    (gather,) = gathers(gm)
    if mode == "bf16":
        assert report.matched_strings() == {"repair:swizzled:c10d_gather->bf16_gather": 1}
        assert gather.meta["val"].dtype == torch.bfloat16
        (quant,) = [n for n in gm.graph.nodes if n.target is mx.mxfp8_quantize.default]
        assert quant.args[0].target is c10d.wait_tensor.default and quant.args[1] is True
    else:
        assert report.matched_strings() == {"repair:swizzled:c10d_gather->mxfp8_packed": 1}
        assert gather.meta["val"].dtype == torch.uint8
        assert mx.gemma_fused_add_rmsnorm_mxfp8_packed.default in targets(gm)


def test_broken_swizzled_gather_of_a_non_norm_is_repaired():
    wc, ws = weights()

    def fn(x):
        q, s = mx.mxfp8_quantize(x * 3, True)
        q = c10d_gather(q.view(torch.uint8)).view(FP8)
        return linear_swizzled(q, c10d_gather(s), wc, ws)

    def good(x):
        q, s = mx.mxfp8_quantize(c10d_gather(x * 3), True)
        return linear_swizzled(q, s, wc, ws)

    x = local_inputs(m=7)[0]
    expected = simulate(trace(good, x), x)
    gm = trace(fn, x)
    report = run_pass(gm)
    assert report.matched_strings() == {"repair:swizzled:c10d_gather->mxfp8_packed": 1}
    assert mx.mxfp8_quantize_packed.default in targets(gm)
    assert_same(simulate(gm, x), expected)


@pytest.mark.parametrize("mode", ["auto", "bf16"])
def test_two_gathers_of_rowmajor_codes_and_scales(mode):
    args = local_inputs(m=5)
    expected = simulate(trace(sp_block(), *args), *args)
    gm = trace(broken_block(swizzled=False), *args)
    assert_same(simulate(gm, *args), expected)  # row-major: correct, only two collectives
    report = run_pass(gm, sp_gather=mode)
    assert_same(simulate(gm, *args), expected)
    if mode == "bf16":  # left to rewrite 1 (which fuses the norm into the local quant)
        assert not any(kind.startswith("two_gathers") for kind in report.matched_strings()) and len(gathers(gm)) == 2
    else:
        assert report.matched_strings() == {"two_gathers:rowmajor:c10d_gather->mxfp8_packed": 1}
        (gather,) = gathers(gm)
        assert gather.meta["val"].dtype == torch.uint8


# ------------------------------------------------------------------ packed ops


@pytest.mark.parametrize("m", [0, 1, 37])
def test_packed_ops_match_unpacked(m):
    x, r, w = local_inputs(m=max(m, 1), seed=3)
    x, r = x[:m], r[:m]
    p, res, y = mx.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, 1e-6, emit_y=True)
    codes, scales, res2, y2 = mx.gemma_fused_add_rmsnorm_mxfp8(x, r, w, 1e-6, emit_y=True)
    assert p.shape == (m, K + K // 32) and p.dtype == torch.uint8
    pc, ps = packed.unpack(p, K)
    assert_same((pc, ps, res, y), (codes, scales, res2, y2))
    p, y = mx.gemma_rmsnorm_mxfp8_packed(x, w, 1e-6)
    codes, scales, _ = mx.gemma_rmsnorm_mxfp8(x, w, 1e-6)
    assert_same(packed.unpack(p, K), (codes, scales)) and y.numel() == 0
    assert_same(packed.unpack(mx.mxfp8_quantize_packed(x), K), mx.mxfp8_quantize(x))


def test_packed_op_fake_has_symbolic_rows():
    x, r, w = local_inputs()
    gm = trace(lambda x, r, w: mx.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, 1e-6)[0], x, r, w, dynamic=True)
    (node,) = [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[1] == 0]
    rows, width = node.meta["val"].shape
    assert not isinstance(rows, int) and width == K + K // 32


def test_packed_views_feed_the_gemm_without_copies():
    """Inductor keeps the codes/scales views of the gathered buffer as reinterpret_tensor views."""
    from torch._inductor.utils import run_and_get_code

    wc, ws = weights()

    def fn(p):
        g = p + 0  # stands for the gathered buffer (a buffer Inductor owns)
        q = torch.ops.aten.slice.Tensor(g, 1, 0, K).view(FP8)
        s = torch.ops.aten.slice.Tensor(g, 1, K, K + K // 32)
        return mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16), mx.mxfp8_swizzle_scales(s)

    x = local_inputs(m=9)[0]
    p = mx.mxfp8_quantize_packed(x)
    torch._dynamo.reset()
    out, (code, *_) = run_and_get_code(torch.compile(fn), p)
    assert_same(out, (mx.mxfp8_linear(*mx.mxfp8_quantize(x), wc, ws, torch.bfloat16), mx.mxfp8_quantize(x, True)[1]))
    call = code[code.find("def call") :]
    assert "reinterpret_tensor" in call and "aten.view.dtype" in call
    assert call.count("mxfp8_linear.default(") == 1 and ".copy_(" not in call and "clone" not in call
    assert not re.findall(r"\b(cpp_fused_\w+|triton_\w+)", call), "a copy kernel materialized a view"


# ------------------------------------------------------------------ vLLM all_gather form


@pytest.mark.vllm
@pytest.mark.parametrize("swizzled", [False, True])
def test_vllm_all_gather_form(vllm_ops, swizzled):
    wc, ws = weights()

    def fn(x, r, w):
        y, res = mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        g = vllm_ops.all_gather(y, 0, W, "tp:0")
        q, s = vllm_ops.mxfp8_quantize(g, swizzled, 0)
        out = linear_swizzled(q, s, wc, ws) if swizzled else mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16)
        return out, res

    args = local_inputs(m=5)
    gm = trace(fn, *args)
    expected = simulate(gm, *args)
    report = run_pass(gm)
    layout = "swizzled" if swizzled else "rowmajor"
    assert report.matched_strings() == {f"mxfuse:fused_add->vllm_gather:mxfp8_packed:{layout}": 1}
    (gather,) = gathers(gm)
    assert gather.target is vllm_ops.all_gather.default and gather.args[1:] == (0, W, "tp:0")
    assert gather.meta["val"].dtype == torch.uint8
    assert_same(simulate(gm, *args), expected)


@pytest.mark.vllm
def test_vllm_gather_along_dim_1_is_left_alone(vllm_ops):
    def fn(x, w):
        g = vllm_ops.all_gather(mx.gemma_rmsnorm(x, w, 1e-6), 1, W, "tp:0")
        return vllm_ops.mxfp8_quantize(g, False, 0)

    x, _, w = local_inputs()
    gm = trace(fn, x, w)
    report = run_pass(gm, sp_gather="mxfp8")
    assert not report.matched
    (reason,) = [s.reason for s in report.skipped if s.rewrite == "sp_gather"]
    assert "along dim 1, not 0" in reason


@pytest.mark.vllm
def test_vllm_broken_flat_swizzled_gather_is_repaired(vllm_ops):
    """vLLM's swizzled scales are 1-D: a graph that gathers them concatenates W padded tile sets."""
    wc, ws = weights()

    def broken(x, r, w):
        y, res = mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        q, s = vllm_ops.mxfp8_quantize(y, True, 0)
        q = vllm_ops.all_gather(q.view(torch.uint8), 0, W, "tp:0").view(FP8)
        s = vllm_ops.all_gather(s, 0, W, "tp:0")
        return linear_swizzled(q, s, wc, ws), res

    def good(x, r, w):
        y, res = mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        q, s = vllm_ops.mxfp8_quantize(vllm_ops.all_gather(y, 0, W, "tp:0"), True, 0)
        return linear_swizzled(q, s, wc, ws), res

    args = local_inputs(m=5)
    expected = simulate(trace(good, *args), *args)
    gm = trace(broken, *args)
    assert not torch.equal(bits(simulate(gm, *args)[0]), bits(expected[0]))
    report = run_pass(gm)
    assert report.matched_strings() == {"repair:swizzled:vllm_gather->mxfp8_packed": 1}
    (gather,) = gathers(gm)
    assert gather.meta["val"].dtype == torch.uint8
    assert_same(simulate(gm, *args), expected)
