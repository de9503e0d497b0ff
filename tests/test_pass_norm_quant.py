"""Rewrite 1 (norm -> MXFP8 quant): one small graph per source form and variant."""

from __future__ import annotations

import pytest
import torch
from foreign_bound import assert_within_foreign_bound
from graph_helpers import (
    FUSED_ADD,
    FUSED_PLAIN,
    NORM_ADD,
    NORM_PLAIN,
    QUANT,
    assert_bitwise,
    check,
    compile_with_pass,
    flashinfer_norm_ops,
    inputs,
)

from mxfuse.patterns.results import SharedCode

mx = torch.ops.mxfuse
K = 64


# ---------------------------------------------------------------- mxfuse op forms


@pytest.mark.parametrize("swizzled", [False, True])
def test_fused_add_norm_then_quant_fuses(swizzled):
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        codes, scales = mx.mxfp8_quantize(y, swizzled)
        return codes, scales, res

    capture = check(fn, inputs(m=37), {FUSED_ADD: 1, NORM_ADD: 0, QUANT: 0})
    layout = "swizzled" if swizzled else "rowmajor"
    assert capture.report.matched_strings() == {f"mxfuse:fused_add->mxfuse_quant:{layout}": 1}
    assert f"swizzled = {swizzled}" in capture.graph_text


@pytest.mark.parametrize("swizzled", [False, True])
def test_plain_norm_then_quant_fuses(swizzled):
    def fn(x, weight):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6), swizzled)

    x, _, w = inputs(m=130)
    check(fn, (x, w), {FUSED_PLAIN: 1, NORM_PLAIN: 0, QUANT: 0})


def test_norm_output_with_another_user_is_emitted():
    def fn(x, residual, weight, w_bf16):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        codes, scales = mx.mxfp8_quantize(y)
        return codes, scales, res, y @ w_bf16  # a bf16 projection also reads y

    x, r, w = inputs()
    capture = check(fn, (x, r, w, torch.randn(K, 16, dtype=torch.bfloat16)), {FUSED_ADD: 1, NORM_ADD: 0, QUANT: 0})
    assert "emit_y = True" in capture.graph_text


def test_two_quants_same_layout_share_one_fused_op():
    def fn(x, weight):
        y = mx.gemma_rmsnorm(x, weight, 1e-6)
        a, sa = mx.mxfp8_quantize(y)
        b, sb = mx.mxfp8_quantize(y)
        return a, sa, b, sb

    x, _, w = inputs()
    capture = check(fn, (x, w), {FUSED_PLAIN: 1, QUANT: 0})
    assert "emit_y = False" in capture.graph_text


def test_two_quants_of_different_layouts_one_fuses_other_reads_y():
    def fn(x, weight):
        y = mx.gemma_rmsnorm(x, weight, 1e-6)
        a, sa = mx.mxfp8_quantize(y, False)
        b, sb = mx.mxfp8_quantize(y, True)
        return a, sa, b, sb

    x, _, w = inputs()
    capture = check(fn, (x, w), {FUSED_PLAIN: 1, NORM_PLAIN: 0, QUANT: 1})
    assert "emit_y = True" in capture.graph_text


@pytest.mark.parametrize("eps", [1e-5, 3.7e-7])
def test_any_eps_constant_matches(eps):
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, eps)
        return (*mx.mxfp8_quantize(y), res)

    capture = check(fn, inputs(), {FUSED_ADD: 1})
    assert repr(eps) in capture.graph_text


def test_fp16_activations_fuse():
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        return (*mx.mxfp8_quantize(y), res)

    check(fn, inputs(dtype=torch.float16), {FUSED_ADD: 1, QUANT: 0})


def test_3d_inputs_fuse():
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        return (*mx.mxfp8_quantize(y), res)

    x, r, w = inputs(m=12)
    check(fn, (x.view(3, 4, K), r.view(3, 4, K), w), {FUSED_ADD: 1, QUANT: 0})


def test_dynamic_token_counts_compile_once_and_stay_fused():
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        return (*mx.mxfp8_quantize(y), res)

    compiled, capture = compile_with_pass(fn, dynamic=True)
    with torch.no_grad():
        for m in (3, 17, 64):
            args = inputs(m=m)
            assert_bitwise(compiled(*args), fn(*args))
    assert capture.calls == 1
    assert capture.after[FUSED_ADD] == 1 and capture.after[QUANT] == 0


# --------------------------------------------------------------- left alone


def test_quant_of_something_else_is_left_alone():
    def fn(x):
        return mx.mxfp8_quantize(x * 2)

    capture = check(fn, (inputs()[0],), {QUANT: 1})
    assert capture.after == capture.before and not capture.report.matched


def test_norm_without_quant_is_left_alone_with_a_reason():
    def fn(x, weight):
        return mx.gemma_rmsnorm(x, weight, 1e-6) * 3

    x, _, w = inputs()
    capture = check(fn, (x, w), {NORM_PLAIN: 1})
    assert capture.after == capture.before
    assert [s.code for s in capture.report.skipped] == [SharedCode.NO_QUANT]


def test_fp32_activations_are_left_alone():
    def fn(x, weight):
        h = x.float()
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())).type_as(h)
        return mx.mxfp8_quantize(y)

    x, _, w = inputs()
    capture = check(fn, (x.float(), w), {QUANT: 1})
    assert not capture.report.matched


def test_fuse_norm_quant_option_off_leaves_graph():
    def fn(x, weight):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6))

    x, _, w = inputs()
    capture = check(fn, (x, w), {NORM_PLAIN: 1, QUANT: 1}, fuse_norm_quant=False)
    assert capture.after == capture.before


# ------------------------------------------------------------ Hugging Face form


def hf_gemma_norm(h, weight, eps):
    """transformers' GemmaRMSNorm / MiniMaxM3VLRMSNorm forward, verbatim in substance."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (1.0 + weight.float())).type_as(h)


def test_hf_decomposed_norm_with_residual_add_fuses_with_rounded_sum():
    def fn(hidden, residual, weight):
        hidden = residual + hidden
        residual = hidden
        return (*mx.mxfp8_quantize(hf_gemma_norm(hidden, weight, 1e-6)), residual)

    capture = check(fn, inputs(m=33), {FUSED_ADD: 1, QUANT: 0, "aten.rsqrt.default": 0})
    assert "round_sum = True" in capture.graph_text
    assert capture.report.matched_strings() == {"hf:fused_add->mxfuse_quant:rowmajor": 1}


def test_hf_decomposed_plain_norm_fuses():
    def fn(hidden, weight):
        return mx.mxfp8_quantize(hf_gemma_norm(hidden, weight, 1e-5), True)

    x, _, w = inputs(m=33)
    check(fn, (x, w), {FUSED_PLAIN: 1, QUANT: 0})


def test_hf_norm_with_non_multiple_of_32_hidden_and_no_quant_is_left_alone():
    def fn(hidden, weight):
        return hf_gemma_norm(hidden, weight, 1e-6)

    x, _, w = inputs(k=48)
    capture = check(fn, (x, w), {})
    assert capture.after == capture.before
    # what leaves it is that no quant reads it (its K would matter only to a quant)
    assert capture.report.skipped[0].code is SharedCode.NO_QUANT


# ------------------------------------------------------------ vLLM and FlashInfer


@pytest.mark.vllm
@pytest.mark.parametrize("swizzled", [False, True])
def test_vllm_quant_after_mxfuse_norm_fuses(vllm_ops, swizzled):
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        codes, scales = vllm_ops.mxfp8_quantize(y, swizzled, 0)
        return codes, scales, res

    capture = check(fn, inputs(m=37), {FUSED_ADD: 1, "vllm::mxfp8_quantize": 0})
    assert capture.report.matched_strings() == {
        f"mxfuse:fused_add->vllm_quant:{'swizzled' if swizzled else 'rowmajor'}": 1
    }


@pytest.mark.vllm
def test_vllm_ir_gemma_norms_fuse(vllm_ops):
    def fn(x, residual, weight):
        y0 = torch.ops.vllm_ir.rms_norm(x, weight.float() + 1.0, 1e-6)
        y1, res = torch.ops.vllm_ir.fused_add_rms_norm(x, residual, weight.float() + 1.0, 1e-6)
        return (*vllm_ops.mxfp8_quantize(y0, False, 0), *mx.mxfp8_quantize(y1), res)

    capture = check_foreign(fn, inputs(m=9))
    assert capture.after[FUSED_PLAIN] == 1 and capture.after[FUSED_ADD] == 1
    assert capture.after["vllm_ir::rms_norm"] == 0 and capture.after["vllm_ir::fused_add_rms_norm"] == 0


@pytest.mark.vllm
def test_vllm_ir_norm_with_bf16_weight_fuses_as_the_standard_norm(vllm_ops):
    """vLLM's RMSNorm layer (a model-dtype weight) is the standard norm, not a Gemma one
    (tests/test_std_norm_patterns.py covers its arithmetic)."""

    def fn(x, weight):
        return mx.mxfp8_quantize(torch.ops.vllm_ir.rms_norm(x, weight, 1e-6))

    x, _, w = inputs()
    capture = check(fn, (x, w), {QUANT: 0, "mxfuse::rms_norm_mxfp8": 1, FUSED_PLAIN: 0})
    assert capture.report.matched_strings() == {"vllm_ir:rms_norm->mxfuse_quant:rowmajor": 1}


def check_foreign(fn, args):
    """Compile with the pass; within the foreign-norm bound (tests/foreign_bound.py) of the unfused compile."""
    compiled, capture = compile_with_pass(fn)
    with torch.no_grad():
        assert_within_foreign_bound(compiled(*args), fn(*args))
    return capture


@pytest.fixture(scope="module")
def flashinfer_ops():
    """FlashInfer's in-place Gemma norms as torch ops, with FlashInfer's schemas (a stub: see
    `graph_helpers.flashinfer_norm_ops`)."""
    with flashinfer_norm_ops("gemma_", weight_offset=1.0) as ns:
        yield ns


@pytest.mark.parametrize("functionalized_v2", [False, True], ids=["auto_functionalized", "auto_functionalized_v2"])
def test_flashinfer_inplace_norms_fuse(flashinfer_ops, functionalized_v2):
    def fn(x, residual, weight):
        x, residual = x.clone(), residual.clone()
        flashinfer_ops.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6, None)
        out = torch.empty_like(x)
        flashinfer_ops.gemma_rmsnorm(out, residual, weight, 1e-6, None)
        return (*mx.mxfp8_quantize(x), *mx.mxfp8_quantize(out, True), residual)

    with torch._inductor.config.patch(enable_auto_functionalized_v2=functionalized_v2):
        capture = check(fn, inputs(m=9), {FUSED_ADD: 1, FUSED_PLAIN: 1, QUANT: 0})
    assert set(capture.report.matched_strings()) == {
        "flashinfer:fused_add->mxfuse_quant:rowmajor",
        "flashinfer:plain->mxfuse_quant:swizzled",
    }
    assert "flashinfer" not in capture.graph_text
