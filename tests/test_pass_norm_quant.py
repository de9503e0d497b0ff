"""Rewrite 1 (norm -> MXFP8 quant), both norm families: one small graph per source form and variant.

- Gemma (`normalize(x) * (1 + w)`): fused into `gemma_rmsnorm_mxfp8` / `gemma_fused_add_rmsnorm_mxfp8`;
- standard (`normalize(x) * w`): fused into `rms_norm_mxfp8` / `fused_add_rms_norm_mxfp8`, with the
  source's own arithmetic (`round_normalized`, `round_sum` read off the match).

Each graph is compiled with the pass (`graph_helpers.compile_with_pass`) or, where the form is there
before Inductor's compile, traced with Inductor's decompositions (`graph_helpers.rewritten`), and
compared with the graph before the pass bit for bit (eager ATen on CPU: docs/design.md "The standard
RMSNorm, source by source") or, where a compile changes the source's reduction order, within the
foreign-norm bound (tests/foreign_bound.py). Each guard has a look-alike left alone with its code,
the graph unchanged. The sources both families share (vLLM's IR ops, FlashInfer's in-place norms)
are one test parametrized by family.

Stubs: FlashInfer 0.7.2 registers no torch ops, so `graph_helpers.flashinfer_norm_ops` defines
FlashInfer's in-place norms of either family with FlashInfer's signatures, the reference as the CPU
impl and a fake.
"""

from __future__ import annotations

import logging
from unittest import mock

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
    op_counts,
    rewritten,
    run_pass,
    trace,
)
from test_norm_forms import data

import mxfuse
from mxfuse.patterns.norms import find_norms
from mxfuse.patterns.results import SharedCode

mx = torch.ops.mxfuse
K = 64
STD_PLAIN, STD_ADD = "mxfuse::rms_norm_mxfp8", "mxfuse::fused_add_rms_norm_mxfp8"
FUSED_OPS = {"gemma": (FUSED_PLAIN, FUSED_ADD), "standard": (STD_PLAIN, STD_ADD)}  # (plain, fused_add) by family


# ================================================================ Gemma: `normalize(x) * (1 + w)`

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
    (the standard family below covers its arithmetic)."""

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


# ================================================================ standard: `normalize(x) * w`


def weight(dtype=torch.bfloat16, seed=7):
    w = torch.randn(K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    w[:4] = -0.0  # -0 weights: the sign of y's zeros
    return w


def matched(report) -> list[str]:
    """The report's fusion kinds, one per site (each kind string once per site: sorted)."""
    return sorted(kind for kind, n in report.matched_strings().items() for _ in range(n))


def fused_nodes(graph, family="standard"):
    names = FUSED_OPS[family]
    return [n for n in graph.nodes if n.op == "call_function" and str(n.target).split(".")[0] in names]


def assert_fused(
    before, after, report, args, *, family="standard", plain=0, fused_add=0, round_normalized, round_sum=False
):
    """The pass emitted the family's fused ops with the source's arithmetic, and the bits did not change."""
    counts = op_counts(after.graph)
    plain_op, add_op = FUSED_OPS[family]
    assert (counts[plain_op], counts[add_op], counts[QUANT]) == (plain, fused_add, 0), counts
    for node in fused_nodes(after.graph, family):
        assert node.kwargs["round_normalized"] is round_normalized, node.kwargs
        if family == "standard":
            assert "weight_offset" not in node.kwargs  # the standard ops have none: offset 0
        else:
            assert node.kwargs["weight_offset"] == 1.0, node.kwargs
        if str(node.target).split(".")[0] == add_op:
            assert node.kwargs["round_sum"] is round_sum
    with torch.no_grad():
        assert_bitwise(after(*args), before(*args))
    return report


def hf_classes():
    from transformers.models.glm4.modeling_glm4 import Glm4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return [LlamaRMSNorm, Qwen3RMSNorm, MistralRMSNorm, Glm4RMSNorm]


def hf_norm(cls_index: int, dtype=torch.bfloat16):
    pytest.importorskip("transformers")
    norm = hf_classes()[cls_index](K, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight(dtype))
    return norm


# ------------------------------------------------------------------ Hugging Face LlamaRMSNorm & co.


@pytest.mark.parametrize("cls_index", range(4), ids=["Llama", "Qwen3", "Mistral", "Glm4"])
def test_hf_llama_rmsnorm_fuses_with_the_rounding_in_the_middle(cls_index):
    """`self.weight * h.to(input_dtype)` -> `rms_norm_mxfp8(..., round_normalized=True)`, bitwise."""
    norm = hf_norm(cls_index)

    def fn(x):
        return mx.mxfp8_quantize(norm(x), True)

    args = (data(5, K, seed=1, scale=3.0),)
    before, after, report = rewritten(fn, *args)
    assert_fused(before, after, report, args, plain=1, round_normalized=True)
    assert matched(report) == ["hf:rms_norm->mxfuse_quant:swizzled"]


def test_hf_decoder_residual_add_then_llama_norm_fuses_with_round_sum():
    """A Hugging Face decoder layer: `residual + hidden` in bf16, then the next norm (round_sum=True)."""
    norm = hf_norm(0)

    def fn(x, residual):
        h = residual + x
        return (*mx.mxfp8_quantize(norm(h)), h)

    args = (data(6, K, seed=2), data(6, K, seed=3))
    before, after, report = rewritten(fn, *args)
    assert_fused(before, after, report, args, fused_add=1, round_normalized=True, round_sum=True)
    assert matched(report) == ["hf:fused_add_rms_norm->mxfuse_quant:rowmajor"]


# ------------------------------------------------------------------ torch.nn.RMSNorm / F.rms_norm


@pytest.mark.parametrize("eps", [1e-6, None], ids=["eps", "eps_none"])
def test_torch_rms_norm_compiled_fuses_with_one_rounding(eps):
    """Post-grad `convert -> pow -> mean([1], True) -> add.Scalar(eps as fp32) -> rsqrt -> mul -> mul(., w bf16)
    -> convert(bf16)` -> `rms_norm_mxfp8(..., round_normalized=False)`; the foreign bound against eager
    (Inductor's sum order)."""
    norm = torch.nn.RMSNorm(K, eps=eps, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight())

    def fn(x):
        return mx.mxfp8_quantize(norm(x))

    x = data(8, K, seed=4)
    compiled, capture = compile_with_pass(fn)
    with torch.no_grad():
        assert_within_foreign_bound(compiled(x), fn(x))
    assert capture.after[STD_PLAIN] == 1 and capture.after[QUANT] == 0, capture.after
    assert "round_normalized = False" in capture.graph_text
    assert matched(capture.report) == ["hf:rms_norm->mxfuse_quant:rowmajor"]


# ------------------------------------------------------------------ vLLM's IR norms


@pytest.mark.vllm
def test_vllm_ir_rms_norm_with_a_model_dtype_weight_fuses_as_the_native_impl(vllm_ops):
    """vLLM's `RMSNorm` layer: `vllm_ir.rms_norm(x, w_bf16)`, native impl `x.to(w.dtype) * w`: bitwise."""

    def fn(x, residual, w):
        y0 = torch.ops.vllm_ir.rms_norm(x, w, 1e-6)
        y1, res = torch.ops.vllm_ir.fused_add_rms_norm(x, residual, w, 1e-6)
        return (*vllm_ops.mxfp8_quantize(y0, True, 0), *vllm_ops.mxfp8_quantize(y1, True, 0), res)

    args = (data(7, K, seed=8), data(7, K, seed=9), weight())
    before, after, report = rewritten(fn, *args)
    counts = op_counts(after.graph)
    assert counts[STD_PLAIN] == counts[STD_ADD] == 1 and counts["vllm::mxfp8_quantize"] == 0, counts
    assert all(n.kwargs["round_normalized"] is True for n in fused_nodes(after.graph))
    assert all(n.kwargs.get("round_sum", False) is False for n in fused_nodes(after.graph))
    y0, res_ref = torch.ops.vllm_ir.rms_norm(*args[::2], 1e-6), args[0].float() + args[1].float()
    with torch.no_grad():
        out, ref = after(*args), before(*args)
    assert_bitwise(out[-1], ref[-1])  # residual_out
    assert_bitwise(out[-1], res_ref.to(torch.bfloat16))
    assert_bitwise(mx.rms_norm(args[0], args[2], 1e-6, True), y0)  # the native impl, bit for bit
    assert_within_foreign_bound(out[:-1], ref[:-1], swizzled=True)  # vLLM's quant: log2 at 2^k boundaries
    assert matched(report) == [
        "vllm_ir:fused_add_rms_norm->vllm_quant:swizzled",
        "vllm_ir:rms_norm->vllm_quant:swizzled",
    ]


@pytest.mark.vllm
def test_vllm_ir_weight_of_another_dtype_is_refused(vllm_ops):
    def fn(x, w):
        return mx.mxfp8_quantize(torch.ops.vllm_ir.rms_norm(x, w, 1e-6))

    before, after, report = rewritten(fn, data(4, K), weight(torch.float16))
    (skip,) = report.skipped
    assert skip.code is SharedCode.NORM_DTYPES and "float16 on torch.bfloat16" in skip.reason, skip
    assert skip.producer_kind == "vllm_ir:rms_norm" and after.code == before.code


@pytest.mark.vllm
@pytest.mark.parametrize("provider", ["oink", "aiter"])
def test_vllm_ir_norm_lowered_to_an_external_kernel_is_refused(vllm_ops, provider):
    """vLLM's priority puts oink (Blackwell) or ROCm AITER first: not reproduced, never fused. Both take a
    weight of x's dtype only, so a Gemma norm's fp32 `w.float() + 1` still runs the native impl and fuses.
    (Neither kernel is supported on CPU: the priority is read through a patched `get_priority`.)"""
    import vllm.ir.ops

    def fn(x, residual, w):
        y, res = torch.ops.vllm_ir.fused_add_rms_norm(x, residual, w, 1e-6)
        gemma = torch.ops.vllm_ir.rms_norm(x, w.float() + 1.0, 1e-6)
        return (*mx.mxfp8_quantize(y), res, *mx.mxfp8_quantize(gemma))

    ir_op = vllm.ir.ops.fused_add_rms_norm
    with mock.patch.object(type(ir_op), "get_priority", lambda self: [provider, "native"]):
        before, after, report = rewritten(fn, data(4, K), data(4, K, seed=1), weight())
    (skip,) = report.skipped
    assert skip.code is SharedCode.NORM_KERNEL and provider in skip.reason, skip
    assert skip.producer_kind == "vllm_ir:fused_add_rms_norm"
    assert matched(report) == ["vllm_ir:plain->mxfuse_quant:rowmajor"]
    refused = "vllm_ir::fused_add_rms_norm"
    assert op_counts(before.graph)[refused] == op_counts(after.graph)[refused] == 1  # left as it was


# ------------------------------------------------------------------ look-alikes: refused, graph unchanged


def llama_body(h, w, *, stats=None, dim=-1, offset=None, eps=1e-6):
    x = h.float()
    s = x if stats is None else stats
    n = x * torch.rsqrt(s.pow(2).mean(dim, keepdim=True) + eps)
    scale = w if offset is None else offset + w.float()
    return (n * scale).to(h.dtype) if offset is not None else w * n.to(h.dtype)


LOOK_ALIKES = [
    ("three_plus_w", dict(offset=3.0), SharedCode.NORM_ARITHMETIC, "`3 + w`, neither the standard `w`"),
    ("minus_one_plus_w", dict(offset=-1.0), SharedCode.NORM_ARITHMETIC, "`-1 + w`"),
    ("stats_of_another_tensor", "other", SharedCode.NORM_ARITHMETIC, "statistics come from"),
    ("mean_over_dim0", dict(dim=0), SharedCode.NORM_ARITHMETIC, "mean over dim [0]"),
]


@pytest.mark.parametrize(("name", "how", "code", "words"), LOOK_ALIKES, ids=[a[0] for a in LOOK_ALIKES])
def test_standard_look_alikes_are_refused_with_a_code(name, how, code, words, caplog):
    def fn(h, w, other):
        kw = {"stats": other.float()} if how == "other" else how
        return mx.mxfp8_quantize(llama_body(h, w, **kw))

    with caplog.at_level(logging.WARNING, logger="mxfuse"):
        before, after, report = rewritten(fn, data(4, K), weight(), data(4, K, seed=5))
    (skip,) = [s for s in report.skipped if s.rewrite == "norm_quant"]
    assert skip.code is code and words in skip.reason, skip
    assert not report.matched and after.code == before.code
    (record,) = [r for r in caplog.records if r.name == "mxfuse" and r.levelno == logging.WARNING]
    assert words in record.getMessage()


def test_hf_fp32_weight_on_bf16_activations_is_refused():
    """An fp32 `LlamaRMSNorm` weight on bf16 activations: `w * h.to(bf16)` is an fp32 output."""
    norm = hf_norm(0, torch.float32)

    def fn(x):
        return mx.mxfp8_quantize(norm(x))

    before, after, report = rewritten(fn, data(4, K))
    (skip,) = report.skipped
    assert skip.code is SharedCode.NORM_DTYPES and "torch.float32 output" in skip.reason, skip
    assert skip.producer_kind == "hf:rms_norm" and after.code == before.code


# ------------------------------------------------------------------ forms that said nothing: a verdict now


class LlamaBlock(torch.nn.Module):
    """transformers' `LlamaRMSNorm` in front of an MXFP8 quant, as a new user would compile it."""

    def __init__(self, dtype):
        super().__init__()
        self.norm = hf_norm(0, dtype)

    def forward(self, x):
        return mx.mxfp8_quantize(self.norm(x))


class GemmaFp32Block(torch.nn.Module):
    """A Gemma norm with the whole model in fp32 (no cast back: the form had no anchor)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(0.1 * weight(torch.float32), requires_grad=False)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return mx.mxfp8_quantize((h * (1.0 + self.weight.float())).type_as(x))


@pytest.mark.parametrize(
    ("block", "dtype", "fused", "kind", "words"),
    [
        (lambda: LlamaBlock(torch.bfloat16), torch.bfloat16, True, "hf:rms_norm", "rms_norm->mxfuse_quant"),
        (lambda: LlamaBlock(torch.float32), torch.float32, False, "hf:rms_norm", "activation dtype torch.float32"),
        (GemmaFp32Block, torch.float32, False, "hf:plain", "activation dtype torch.float32"),
    ],
    ids=["llama_bf16", "llama_fp32", "gemma_fp32"],
)
def test_explain_gives_every_standard_and_fp32_norm_a_verdict(block, dtype, fused, kind, words):
    explanation = mxfuse.explain(block(), data(4, K).to(dtype))
    (verdict,) = explanation.verdicts
    assert (verdict.kind, verdict.fused) == (kind, fused) and words in verdict.detail, str(explanation)
    if not fused:
        assert verdict.code is SharedCode.ACTIVATION_DTYPE


def test_a_gemma_norm_in_fp32_is_one_norm_not_two():
    """Anchor (3) stays off a norm that anchor (1) already has (a product cast back to bf16)."""

    def fn(h, w):
        x = h.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).type_as(h)

    graph = trace(fn, data(4, K), weight(), decompose=True).graph
    assert [n.kind for n in find_norms(graph)] == ["hf:plain"]


# ------------------------------------------------------------------ the SP rewrites take the standard form


@pytest.mark.parametrize("residual", [True, False], ids=["fused_add", "plain"])
def test_standard_norm_gathered_in_mxfp8_uses_the_packed_gather(residual):
    """`rms_norm -> all_gather -> quant`: one packed `[W*M, K + K/32]` gather, the Gemma-named packed ops with
    `weight_offset=0.0` (rewrite 2 has no standard-named packed op), bitwise."""
    from sp_helpers import W, c10d_gather, gathers, simulate

    from mxfuse.ops.mx_layout import packed_width

    def fn(x, r, w):
        y, res = mx.fused_add_rms_norm(x, r, w, 1e-6, True) if residual else (mx.rms_norm(x, w, 1e-6, True), r)
        return (*mx.mxfp8_quantize(c10d_gather(y)), res)

    args = (data(5, K, seed=12), data(5, K, seed=13), weight())
    gm = trace(fn, *args)
    expected = simulate(gm, *args)
    report = run_pass(gm, sp_gather="mxfp8")
    assert_bitwise(simulate(gm, *args), expected)
    (gather,) = gathers(gm)
    assert gather.meta["val"].dtype == torch.uint8 and tuple(gather.meta["val"].shape) == (W * 5, packed_width(K))
    op = mx.gemma_fused_add_rmsnorm_mxfp8_packed if residual else mx.gemma_rmsnorm_mxfp8_packed
    (packed,) = gm.graph.find_nodes(op="call_function", target=op.default)
    assert packed.kwargs["weight_offset"] == 0.0 and packed.kwargs["round_normalized"] is True
    variant = "fused_add_rms_norm" if residual else "rms_norm"
    assert report.matched_strings() == {f"mxfuse:{variant}->c10d_gather:mxfp8_packed:rowmajor": 1}


def test_a_gated_norm_is_not_taken_for_a_norm_with_an_fp32_output():
    """vLLM's `RMSNormGated` native form, `(normalize(x) * w.float() * silu(z)).to(dtype)`: the fp32 product
    goes on into the gate, so no recognizer claims a norm there (no verdict with a wrong reason)."""

    def fn(h, w, z):
        x = h.float()
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        return mx.mxfp8_quantize((out * torch.nn.functional.silu(z.float())).to(h.dtype))

    assert find_norms(trace(fn, data(4, K), weight(), data(4, K, seed=3), decompose=True).graph) == []


# ================================================================ both families: the sources they share


@pytest.fixture(scope="module")
def flashinfer_ops():
    """FlashInfer's in-place norms of both families as torch ops, with FlashInfer's schemas (a stub: see
    `graph_helpers.flashinfer_norm_ops`): `{family: torch.ops.flashinfer}`."""
    with flashinfer_norm_ops("gemma_", weight_offset=1.0) as gemma, flashinfer_norm_ops("", weight_offset=0.0) as std:
        yield {
            "gemma": (gemma.gemma_rmsnorm, gemma.gemma_fused_add_rmsnorm),
            "standard": (std.rmsnorm, std.fused_add_rmsnorm),
        }


FLASHINFER_MATCHED = {
    "gemma": ["flashinfer:fused_add->mxfuse_quant:rowmajor", "flashinfer:plain->mxfuse_quant:swizzled"],
    "standard": ["flashinfer:fused_add_rms_norm->mxfuse_quant:rowmajor", "flashinfer:rms_norm->mxfuse_quant:swizzled"],
}


@pytest.mark.parametrize("functionalized_v2", [False, True], ids=["auto_functionalized", "auto_functionalized_v2"])
@pytest.mark.parametrize("family", ["gemma", "standard"])
def test_flashinfer_inplace_norms_fuse(flashinfer_ops, family, functionalized_v2):
    rmsnorm, fused_add_rmsnorm = flashinfer_ops[family]

    def fn(x, residual, w):
        x, residual = x.clone(), residual.clone()
        fused_add_rmsnorm(x, residual, w, 1e-6, None)
        out = torch.empty_like(x)
        rmsnorm(out, residual, w, 1e-6, None)
        return (*mx.mxfp8_quantize(x), *mx.mxfp8_quantize(out, True), residual)

    args = inputs(m=9) if family == "gemma" else (data(9, K, seed=10), data(9, K, seed=11), weight())
    plain, fused_add = FUSED_OPS[family]
    with torch._inductor.config.patch(enable_auto_functionalized_v2=functionalized_v2):
        capture = check(fn, args, {fused_add: 1, plain: 1, QUANT: 0})  # the stub computes the fused op's formula
    assert matched(capture.report) == FLASHINFER_MATCHED[family]
    assert "flashinfer" not in capture.graph_text
    if family == "standard":
        assert "round_normalized = False" in capture.graph_text


# ------------------------------------------------------------------ mxfuse's own norm ops


MXFUSE_NORM_OPS = {
    "gemma": (mx.gemma_rmsnorm, mx.gemma_fused_add_rmsnorm),
    "standard": (mx.rms_norm, mx.fused_add_rms_norm),
}
MXFUSE_MATCHED = {
    "gemma": ["mxfuse:fused_add->mxfuse_quant:swizzled", "mxfuse:plain->mxfuse_quant:rowmajor"],
    "standard": ["mxfuse:fused_add_rms_norm->mxfuse_quant:swizzled", "mxfuse:rms_norm->mxfuse_quant:rowmajor"],
}


@pytest.mark.parametrize("round_normalized", [False, True])
@pytest.mark.parametrize("family", ["gemma", "standard"])
def test_mxfuse_norm_ops_fuse_with_their_round_normalized(family, round_normalized):
    """Both families' mxfuse norm ops keep the `round_normalized` they were called with (the Gemma op's
    was once dropped)."""
    norm, add_norm = MXFUSE_NORM_OPS[family]

    def fn(x, residual, w):
        y0 = norm(x, w, 1e-6, round_normalized)
        y1, res = add_norm(x, residual, w, 1e-6, round_normalized)
        return (*mx.mxfp8_quantize(y0), *mx.mxfp8_quantize(y1, True), res)

    w = weight() if family == "standard" else 0.1 * weight()
    args = (data(5, K, seed=5), data(5, K, seed=6), w)
    before, after, report = rewritten(fn, *args)
    assert_fused(before, after, report, args, family=family, plain=1, fused_add=1, round_normalized=round_normalized)
    assert matched(report) == MXFUSE_MATCHED[family]
