"""vLLM 0.33 models with the STANDARD RMSNorm (`normalize(x) * w`) in front of MXFP8 linears.

vLLM's `RMSNorm` layer emits `vllm_ir.rms_norm(x, w, eps)` / `vllm_ir.fused_add_rms_norm(x, res, w,
eps)` with the parameter itself as the weight, in the model dtype (bf16 here): the detector of
tests/vllm_pipeline.py classifies such a weight as "model dtype" (Gemma's is `w.float() + 1`).
Each model is built and compiled through tests/vllm_pipeline.py (its method, its stubs; nothing
else replaced) with ModelOpt MXFP8 and the CuTe-DSL kernel declared supported, one layer each.

`test_standard_norm_sites_exist` proves the sites reach mxfuse's pass; `test_every_standard_norm_site_fuses`
that every one became `mxfuse::rms_norm_mxfp8` / `fused_add_rms_norm_mxfp8` with vLLM's native arithmetic
(`round_normalized=True`, the norm of the fp32 sum), counted by the detector, not by mxfuse's report.

DeepSeek-V2 (`DeepseekV2ForCausalLM`, MLA with `q_lora_rank`): its attention is `MLAAttention`
(`model_executor/layers/mla.py:122`), replaced by tests/vllm_pipeline.py's `StubMLAAttention` (vLLM's
MLA splitting op with its shapes). Its `kv_a_layernorm` output goes to the attention op (`kv_b_proj`
is applied inside the MLA backend), so it is no norm->quant site here; `q_a_layernorm` -> `q_b_proj` is.
"""

from __future__ import annotations

import pytest
import vllm_pipeline
from vllm_pipeline import HIDDEN, Case, compile_model, mla_attention_stub, tiny

pytestmark = pytest.mark.vllm
vllm_cpu = vllm_pipeline.vllm_cpu  # the module fixture: vLLM stood up on CPU

PER_LAYER = "input_layernorm (rms_norm) -> qkv_proj, post_attention_layernorm (fused_add_rms_norm) -> gate_up_proj"
CASES = [
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


@pytest.fixture(scope="module")
def records(vllm_cpu):
    """One build per model, shared by the tests below."""
    return {
        case.name: compile_model(vllm_cpu, case, patches=[p() for p in PATCHES.get(case.name, ())]) for case in CASES
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_standard_norm_sites_exist(records, case):
    record = records[case.name]
    described = [s.describe() for s in record.sites]
    assert record.graphs >= 2, record
    assert len(record.sites) == case.sites, (case.why_sites, described)
    assert all(s.weight == "model dtype" for s in record.sites), described
    assert all(s.quant_args == (True,) for s in record.sites), described  # CuTe-DSL: swizzled scales


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_standard_norm_site_fuses(records, case):
    record = records[case.name]
    described = [s.describe() for s in record.sites]
    assert record.fused == len(record.sites) > 0, (described, record.matched, record.skipped)
    assert record.left == 0, described
    assert [a["swizzled"] for a in record.fused_args] == [True] * record.fused
    assert all("weight_offset" not in a and a["round_normalized"] for a in record.fused_args), record.fused_args
    assert all(not a.get("round_sum", False) for a in record.fused_args), record.fused_args
    assert all(k.startswith("vllm_ir:") and "rms_norm->" in k for k in record.matched), record.matched
