"""Rewrite 2 (`sp_gather`) on graphs that quantize BEFORE the all-gather (form B), the packed ops,
and vLLM's all_gather; same harness as test_sp_gather.py (tests/sp_helpers.py)."""

from __future__ import annotations

import operator
import re

import pytest
import torch
from graph_helpers import run_pass, trace
from sp_helpers import (
    K,
    W,
    c10d,
    c10d_gather,
    gathers,
    gemma_norm,
    linear_swizzled,
    local_inputs,
    mx,
    simulate,
    sp_block,
    targets,
    weights,
)

import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops import packed
from mxfuse.ops.mx_layout import FP8_DTYPE, packed_width
from mxfuse.patterns.gather_checks import SpGatherCode
from mxfuse.testing import assert_bitwise, bits

# ------------------------------------------------------------------ form B: quantized before the gather


def broken_block(swizzled=True, as_uint8=True, residual=True):
    """The field's broken form: quantize (swizzled) BEFORE the gather, gather codes and scales.

    gloo cannot gather float8, so the codes travel as `view(uint8)` and are viewed back.
    """
    wc, ws = weights()

    def fn(x, r, w):
        y, res = gemma_norm(x, r, w, residual)
        q, s = mx.mxfp8_quantize(y, swizzled)
        q = c10d_gather(q.view(torch.uint8)).view(FP8_DTYPE) if as_uint8 else c10d_gather(q)
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
    assert_bitwise(simulate(gm, *args), expected)
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
        q = c10d_gather(q.view(torch.uint8)).view(FP8_DTYPE)
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
    assert_bitwise(simulate(gm, x), expected)


@pytest.mark.parametrize("mode", ["auto", "bf16"])
def test_two_gathers_of_rowmajor_codes_and_scales(mode):
    args = local_inputs(m=5)
    expected = simulate(trace(sp_block(), *args), *args)
    gm = trace(broken_block(swizzled=False), *args)
    assert_bitwise(simulate(gm, *args), expected)  # row-major: correct, only two collectives
    report = run_pass(gm, sp_gather=mode)
    assert_bitwise(simulate(gm, *args), expected)
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
    assert p.shape == (m, packed_width(K)) and p.dtype == torch.uint8
    pc, ps = packed.unpack(p, K)
    assert_bitwise((pc, ps, res, y), (codes, scales, res2, y2))
    p, y = mx.gemma_rmsnorm_mxfp8_packed(x, w, 1e-6)
    codes, scales, _ = mx.gemma_rmsnorm_mxfp8(x, w, 1e-6)
    assert_bitwise(packed.unpack(p, K), (codes, scales))
    assert y.numel() == 0
    assert_bitwise(packed.unpack(mx.mxfp8_quantize_packed(x), K), mx.mxfp8_quantize(x))


def test_packed_op_fake_has_symbolic_rows():
    x, r, w = local_inputs()
    gm = trace(lambda x, r, w: mx.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, 1e-6)[0], x, r, w, dynamic=True)
    (node,) = [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[1] == 0]
    rows, width = node.meta["val"].shape
    assert not isinstance(rows, int) and width == packed_width(K)


def test_packed_views_feed_the_gemm_without_copies():
    """Inductor keeps the codes/scales views of the gathered buffer as reinterpret_tensor views."""
    from torch._inductor.utils import run_and_get_code

    wc, ws = weights()

    def fn(p):
        g = p + 0  # stands for the gathered buffer (a buffer Inductor owns)
        q = torch.ops.aten.slice.Tensor(g, 1, 0, K).view(FP8_DTYPE)
        s = torch.ops.aten.slice.Tensor(g, 1, K, packed_width(K))
        return mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16), mx.mxfp8_swizzle_scales(s)

    x = local_inputs(m=9)[0]
    p = mx.mxfp8_quantize_packed(x)
    torch._dynamo.reset()
    out, (code, *_) = run_and_get_code(torch.compile(fn), p)
    assert_bitwise(out, (mx.mxfp8_linear(*mx.mxfp8_quantize(x), wc, ws, torch.bfloat16), mx.mxfp8_quantize(x, True)[1]))
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
    assert_bitwise(simulate(gm, *args), expected)


@pytest.mark.vllm
def test_vllm_gather_along_dim_1_is_left_alone(vllm_ops):
    def fn(x, w):
        g = vllm_ops.all_gather(mx.gemma_rmsnorm(x, w, 1e-6), 1, W, "tp:0")
        return vllm_ops.mxfp8_quantize(g, False, 0)

    x, _, w = local_inputs()
    gm = trace(fn, x, w)
    report = run_pass(gm, sp_gather="mxfp8")
    assert not report.matched
    (code,) = [s.code for s in report.skipped if s.rewrite == "sp_gather"]
    assert code is SpGatherCode.GATHER_SPLIT


@pytest.mark.vllm
def test_vllm_broken_flat_swizzled_gather_is_repaired(vllm_ops):
    """vLLM's swizzled scales are 1-D: a graph that gathers them concatenates W padded tile sets."""
    wc, ws = weights()

    def broken(x, r, w):
        y, res = mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        q, s = vllm_ops.mxfp8_quantize(y, True, 0)
        q = vllm_ops.all_gather(q.view(torch.uint8), 0, W, "tp:0").view(FP8_DTYPE)
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
    assert_bitwise(simulate(gm, *args), expected)
