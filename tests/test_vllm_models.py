"""vLLM 0.33's own compile pipeline on CPU, on vLLM's own model classes of both norm families, with mxfuse
as its post-grad pass (the method and every stub: tests/vllm_pipeline.py).

Each case builds a tiny model through vLLM's loader with the ModelOpt MXFP8 config and the
Blackwell CuTe-DSL MXFP8 linear declared supported, compiles it in `VLLM_COMPILE`, and counts
with the independent detector the norm -> MXFP8 quant sites before mxfuse ran and the fused
sites after (not mxfuse's report). Nothing is replaced beyond tests/vllm_pipeline.py's list.

The families:
- Gemma (`normalize(x) * (1 + w)`): vLLM's Gemma layers pass `w.float() + 1` to the IR ops, and every
  site fuses into the `gemma_*_mxfp8` ops.
- standard (`normalize(x) * w`): vLLM's `RMSNorm` layer emits `vllm_ir.rms_norm(x, w, eps)` /
  `vllm_ir.fused_add_rms_norm(x, res, w, eps)` with the parameter itself as the weight, in the model
  dtype (bf16 here; the detector calls it "model dtype"), and every site becomes
  `mxfuse::rms_norm_mxfp8` / `fused_add_rms_norm_mxfp8` with vLLM's native arithmetic
  (`round_normalized=True`, the norm of the fp32 sum).

vLLM's Transformers backend keeps activations 3-D (`rms_norm(x [1, T, K]) -> reshape(y, [-1, K])
-> mxfp8_quantize`): the pass sees through the reshape and fuses. One case is expected not to fuse
(xfail, strict): vLLM's TRT-LLM MXFP8 linear (the 8x4 quant spelling, whose scale rule is not
mxfuse's; see NOT_RECOGNIZED_8X4). docs/applicability.md has the table these cases produce.

DeepSeek-V2 (`DeepseekV2ForCausalLM`, MLA with `q_lora_rank`): its attention is `MLAAttention`
(`model_executor/layers/mla.py:122`), replaced by tests/vllm_pipeline.py's `StubMLAAttention` (vLLM's
MLA splitting op with its shapes). Its `kv_a_layernorm` output goes to the attention op (`kv_b_proj`
is applied inside the MLA backend), so it is no norm->quant site here; `q_a_layernorm` -> `q_b_proj` is.
"""

from __future__ import annotations

import pytest
import vllm_pipeline
from vllm_pipeline import HIDDEN, TRTLLM, Case, compile_model, mla_attention_stub, tiny

pytestmark = pytest.mark.vllm
vllm_cpu = vllm_pipeline.vllm_cpu  # the module fixture: vLLM stood up on CPU


# ---------------------------------------------------------------- Gemma: `normalize(x) * (1 + w)`

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


# ---------------------------------------------------------------- standard: `normalize(x) * w`

PER_LAYER = "input_layernorm (rms_norm) -> qkv_proj, post_attention_layernorm (fused_add_rms_norm) -> gate_up_proj"
STANDARD_CASES = [
    Case("llama", ("llama",), tiny("LlamaForCausalLM", "llama", num_hidden_layers=1), 2, PER_LAYER),
    Case("mistral", ("llama",), tiny("MistralForCausalLM", "mistral", num_hidden_layers=1), 2, PER_LAYER),
    Case("qwen3", ("qwen3",), tiny("Qwen3ForCausalLM", "qwen3", num_hidden_layers=1), 2, PER_LAYER),
    Case(
        "qwen3_moe",
        ("qwen3_moe",),
        tiny(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            num_hidden_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN,
            decoder_sparse_step=1,
        ),
        1,
        "input_layernorm -> qkv_proj; post_attention_layernorm feeds the router and the MoE op (quant inside it)",
        unquantized=("*mlp.gate",),  # the router: N = num_experts (< 128 here; bf16 in MXFP8 exports)
    ),
    Case(
        "glm4",
        ("glm4",),
        tiny("Glm4ForCausalLM", "glm4", num_hidden_layers=1, partial_rotary_factor=0.5),
        2,
        PER_LAYER + " (its post_self_attn_layernorm / post_mlp_layernorm feed residual adds, not quants)",
    ),
    Case(
        "deepseek_v2",
        (),
        tiny(
            "DeepseekV2ForCausalLM",
            "deepseek_v2",
            num_hidden_layers=1,
            num_key_value_heads=2,
            q_lora_rank=HIDDEN,
            kv_lora_rank=HIDDEN,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=1,  # layer 0 dense: its MLP is an MXFP8 linear, not the MoE op
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN,
        ),
        3,
        "input_layernorm -> fused_qkv_a_proj, q_a_layernorm -> q_b_proj, post_attention_layernorm -> gate_up_proj",
    ),
]
PATCHES = {"deepseek_v2": (mla_attention_stub,)}


# ---------------------------------------------------------------- the checks, by family


def check_gemma(record, case):
    """Every site is a Gemma norm (no plain-weight RMSNorm feeds an MXFP8 quant in these models)."""
    assert all(s.gemma for s in record.sites), [s.describe() for s in record.sites]


def check_standard(record, case):
    """Every site is vLLM's standard norm, a model-dtype weight, quantized with swizzled scales (CuTe-DSL),
    and fused with vLLM's native arithmetic."""
    described = [s.describe() for s in record.sites]
    assert all(s.weight == "model dtype" for s in record.sites), described
    assert all(s.quant_args == (True,) for s in record.sites), described
    assert [a["swizzled"] for a in record.fused_args] == [True] * record.fused
    assert all("weight_offset" not in a and a["round_normalized"] for a in record.fused_args), record.fused_args
    assert all(not a.get("round_sum", False) for a in record.fused_args), record.fused_args
    norm_kinds = [k for k in record.matched if "norm" in k.split("->")[0]]  # the act·mul sites: test_vllm_act_mul
    assert norm_kinds and all(k.startswith("vllm_ir:") and "rms_norm->" in k for k in norm_kinds), record.matched


FAMILY_CHECKS = {"gemma": check_gemma, "standard": check_standard}


@pytest.mark.parametrize(
    ("family", "case"),
    [
        *(pytest.param("gemma", c, id=c.name) for c in CASES),
        pytest.param("gemma", TRANSFORMERS_BACKEND, id=TRANSFORMERS_BACKEND.name),
        pytest.param(
            "gemma",
            TRTLLM_8X4,
            id=TRTLLM_8X4.name,
            marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=NOT_RECOGNIZED_8X4),
        ),
        *(pytest.param("standard", c, id=c.name) for c in STANDARD_CASES),
    ],
)
def test_every_norm_quant_site_fuses_in_vllm_compile(vllm_cpu, family, case):
    record = compile_model(vllm_cpu, case, patches=[p() for p in PATCHES.get(case.name, ())])
    described = [s.describe() for s in record.sites]
    assert record.graphs >= 2, record  # piecewise: vLLM split at its attention op
    assert len(record.sites) == case.sites, (case.why_sites, described)
    FAMILY_CHECKS[family](record, case)
    assert record.fused == len(record.sites) > 0, (described, record.matched, record.skipped)
    assert record.left == 0, described
