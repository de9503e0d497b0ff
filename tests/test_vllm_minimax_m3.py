"""MiniMax-M3 in vLLM 0.33: the Transformers backend compiles it, the native class is never compiled.

`--model-impl transformers` (`model_impl="transformers"`) builds the Hugging Face MiniMax-M3 text
code of the installed transformers (`MiniMaxM3VLForCausalLM`, `model_type: minimax_m3_vl_text`)
inside vLLM's `TransformersMoEForCausalLM`, whose `Base.__init__` decorates it with
`@support_torch_compile`; vLLM swaps its RMSNorms for its own (`vllm_ir.rms_norm` with the Gemma
weight `w.float() + 1`) and its linears for MXFP8 ones. Built here through tests/vllm_pipeline.py
(its method and its stubs; nothing else replaced) with ModelOpt MXFP8 and the CuTe-DSL kernel
declared supported: layer 0 is a sparse-attention layer (lightning indexer) with a dense MLP,
layer 1 full attention with a MoE block.

What the sparse-attention layer does under this backend: vLLM's attention function for HF models
(`model_executor/models/transformers/__init__.py:68-95`) takes `query, key, value` and ignores the
`block_indices` the indexer computes, so vLLM serves the layer as DENSE causal attention; the
indexer's outputs are unused and leave the graph (no quant of its projections appears). The
norm->quant sites are those of a dense layer.

vLLM's native `MiniMaxM3SparseForCausalLM` is not compiled: test_native_minimax_m3_is_not_compiled
runs vLLM's own compile-mode logic.
"""

from __future__ import annotations

import pytest
import vllm_pipeline
from vllm_pipeline import HIDDEN, Case, compile_mode_by_default, compile_model, has_support_torch_compile, tiny

pytestmark = pytest.mark.vllm
vllm_cpu = vllm_pipeline.vllm_cpu  # the module fixture: vLLM stood up on CPU

MINIMAX_M3 = Case(
    "minimax_m3_transformers_backend",
    ("transformers.base",),
    tiny(
        "MiniMaxM3VLForCausalLM",
        "minimax_m3_vl_text",
        layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        dense_intermediate_size=HIDDEN,
        shared_intermediate_size=HIDDEN,
        num_local_experts=4,
        num_experts_per_tok=2,
        rotary_dim=32,
        index_n_heads=2,
        index_head_dim=64,
        index_block_size=16,
        index_topk_blocks=2,
        bos_token_id=1,
        eos_token_id=2,
    ),
    3,
    "layer 0 (sparse attention, dense MLP): input_layernorm -> q/k/v (one QKVParallelLinear),"
    " post_attention_layernorm -> gate_up; layer 1 (full attention, MoE): input_layernorm -> q/k/v; its"
    " post_attention_layernorm feeds the MoE op (quant inside it, not a site)",
    model_impl="transformers",
)
# MXFP8 activation quants: layer 0 qkv, o_proj, gate_up, down_proj; layer 1 qkv, o_proj (the routed
# and shared experts quantize inside vLLM's MoE op; the indexer's projections are dead code)
QUANTS = 6


@pytest.fixture(scope="module")
def minimax_m3(vllm_cpu):
    return compile_model(vllm_cpu, MINIMAX_M3)


def test_transformers_backend_builds_minimax_m3_as_a_compiled_moe_model(minimax_m3):
    assert minimax_m3.model_class == "TransformersMoEForCausalLM"
    assert minimax_m3.graphs == 3  # VLLM_COMPILE's piecewise split at the two attention ops
    assert minimax_m3.quants == QUANTS


def test_every_gemma_norm_quant_site_fuses(minimax_m3):
    described = [s.describe() for s in minimax_m3.sites]
    assert all(s.gemma for s in minimax_m3.sites), described  # MiniMaxM3VLRMSNorm became vLLM's GemmaRMSNorm
    assert len(minimax_m3.sites) == MINIMAX_M3.sites, (MINIMAX_M3.why_sites, described)
    assert minimax_m3.fused == len(minimax_m3.sites), (described, minimax_m3.matched, minimax_m3.skipped)
    assert minimax_m3.left == 0, described
    # the HF code keeps [1, T, K]: every site reads the norm through the backend's flattening reshape
    assert all(s.chain and "reshape" in s.chain[0] for s in minimax_m3.sites), described


def test_native_minimax_m3_is_not_compiled():
    from vllm.config import CompilationMode

    for architecture in ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"):
        assert compile_mode_by_default(architecture) == CompilationMode.NONE, architecture
        assert not has_support_torch_compile(architecture), architecture
    assert compile_mode_by_default("TransformersMoEForCausalLM") == CompilationMode.VLLM_COMPILE
    assert has_support_torch_compile("TransformersMoEForCausalLM")
