"""vLLM 0.33's own compile pipeline on CPU, on vLLM's own Gemma-norm model classes, with mxfuse as its
post-grad pass (the method and every stub: tests/vllm_pipeline.py).

Each case builds a tiny model through vLLM's loader with the ModelOpt MXFP8 config and the
Blackwell CuTe-DSL MXFP8 linear declared supported, compiles it in `VLLM_COMPILE`, and counts
with the independent detector the Gemma norm -> MXFP8 quant sites before mxfuse ran and the
fused sites after. Nothing is replaced beyond tests/vllm_pipeline.py's list.

vLLM's Transformers backend keeps activations 3-D (`rms_norm(x [1, T, K]) -> reshape(y, [-1, K])
-> mxfp8_quantize`): the pass sees through the reshape and fuses. One case is expected not to fuse
(xfail, strict): vLLM's TRT-LLM MXFP8 linear (the 8x4 quant spelling, whose scale rule is not
mxfuse's; see NOT_RECOGNIZED_8X4). docs/applicability.md has the table these cases produce.
"""

from __future__ import annotations

import pytest
import vllm_pipeline
from vllm_pipeline import HIDDEN, TRTLLM, Case, compile_model, tiny

pytestmark = pytest.mark.vllm
vllm_cpu = vllm_pipeline.vllm_cpu  # the module fixture: vLLM stood up on CPU


PER_LAYER_2 = "per layer: input_layernorm -> qkv_proj, the pre-MLP norm -> gate_up_proj"
CASES = [
    # one layer where the family's two norm forms already meet a quant in it (plain input norm, fused-add
    # pre-MLP norm); Gemma 3 keeps two, so a fused-add input norm reads a residual from the previous piece
    Case("gemma", ("gemma",), tiny("GemmaForCausalLM", "gemma", num_hidden_layers=1), 2, PER_LAYER_2),
    Case(
        "gemma2",
        ("gemma2",),
        tiny("Gemma2ForCausalLM", "gemma2", sliding_window=64, num_hidden_layers=1),
        2,
        PER_LAYER_2,
    ),
    Case("gemma3", ("gemma3",), tiny("Gemma3ForCausalLM", "gemma3_text", sliding_window=64), 4, PER_LAYER_2),
    Case(
        "qwen3_next",
        ("qwen3_next",),
        tiny(
            "Qwen3NextForCausalLM",
            "qwen3_next",
            layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0],  # vLLM's Qwen3NextForCausalLM needs one MoE layer
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        ),
        3,
        "layer 0 (gated delta net, dense MLP): input_layernorm -> in_proj_qkvz, post_attention_layernorm -> gate_up;"
        " layer 1 (attention, MoE): input_layernorm -> qkv_proj; its post_attention_layernorm feeds"
        " vllm.moe_forward_shared, whose quant is inside the op (not a site)",
        # in_proj_ba has N = 2 * linear_num_value_heads (64 in Qwen3-Next-80B): below the N >= 128 of
        # the CuTe-DSL/CUTLASS MXFP8 kernels, so on Blackwell vLLM gives it Marlin W8A16 (bf16 input)
        unquantized=("*in_proj_ba",),
    ),
    Case(
        "qwen3_5",
        ("qwen3_next",),  # Qwen3.5's attention is Qwen3-Next's class
        tiny(
            "Qwen3_5ForCausalLM",
            "qwen3_5_text",
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        ),
        4,
        "layer 0 (gated delta net): input_layernorm -> in_proj_qkvz, post_attention_layernorm -> gate_up;"
        " layer 1 (attention): input_layernorm -> qkv_proj, post_attention_layernorm -> gate_up",
        unquantized=("*in_proj_ba", "*in_proj_a", "*in_proj_b"),  # N = linear_num_value_heads (as Qwen3-Next)
    ),
    Case(
        "step3p5",
        ("step3p5",),
        tiny(
            "Step3p5ForCausalLM",
            "step3p5",
            layer_types=["full_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],  # vLLM's Step3p5ForCausalLM needs one MoE layer
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN,
            share_expert_dim=HIDDEN,
            use_moe_router_bias=True,  # fields vLLM's Step-3.5 MoE block reads (remote-code config names)
            need_fp32_gate=True,
            norm_expert_weight=True,
        ),
        3,
        "layer 0: input_layernorm -> qkv_proj, post_attention_layernorm (a plain rms_norm after the model's own"
        " residual add) -> gate_up; layer 1: input_layernorm -> qkv_proj; its post_attention_layernorm feeds"
        " vllm.moe_forward_shared (quant inside the op, not a site)",
    ),
    Case(
        "rnj1",
        ("rnj1",),
        tiny("Rnj1ForCausalLM", "gemma3_text", sliding_window=64, num_hidden_layers=1),
        2,
        PER_LAYER_2,
    ),
]


TRANSFORMERS_BACKEND = Case(
    "gemma3_transformers_backend",
    ("transformers.base",),
    tiny("Gemma3ForCausalLM", "gemma3_text", sliding_window=64, num_hidden_layers=1),
    2,
    "per layer: input_layernorm -> q/k/v (one QKVParallelLinear), pre_feedforward_layernorm -> gate_up;"
    " plain norms (the HF code adds the residual itself)",
    model_impl="transformers",
)
TRTLLM_8X4 = Case(
    "gemma3_trtllm",
    ("gemma3",),
    # TRT-LLM's MXFP8 linear needs K % 256 == 0 in every projection
    tiny(
        "Gemma3ForCausalLM",
        "gemma3_text",
        sliding_window=64,
        hidden_size=256,
        intermediate_size=256,
        head_dim=128,
        num_hidden_layers=1,
    ),
    2,
    PER_LAYER_2 + ", each quantized by vllm.flashinfer_mxfp8_quantize_8x4 (8x4-swizzled flat scales)",
    kernel=TRTLLM,
)
NOT_RECOGNIZED_8X4 = (
    "mxfuse does not replace vllm.flashinfer_mxfp8_quantize_8x4 (vLLM's TRT-LLM MXFP8 linear, selected"
    " with KernelConfig.linear_backend='flashinfer_trtllm'): its 8x4 layout is known exactly"
    " (tests/layout_8x4.py) but its scale rule is not the E8M0 rule of the fused op (an approximate"
    " 1/448, rounding toward +inf, codes clamped to +-448, NaN -> 448), and its bits can only be checked"
    " on sm_100; the sites are found but none fuses"
)


@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        TRANSFORMERS_BACKEND,
        pytest.param(
            TRTLLM_8X4, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=NOT_RECOGNIZED_8X4)
        ),
    ],
    ids=lambda c: c.name,
)
def test_every_gemma_norm_quant_site_fuses_in_vllm_compile(vllm_cpu, case):
    record = compile_model(vllm_cpu, case)
    described = [s.describe() for s in record.sites]
    assert record.graphs >= 2, record  # piecewise: vLLM split at its attention op
    assert all(s.gemma for s in record.sites), described  # no plain-weight RMSNorm feeds an MXFP8 quant
    assert len(record.sites) == case.sites, (case.why_sites, described)
    assert record.fused == len(record.sites), (described, record.matched, record.skipped)
    assert record.left == 0, described
