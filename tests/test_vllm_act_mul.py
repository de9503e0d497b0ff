"""The act·mul -> MXFP8 sites of vLLM 0.33's own models, through its own VLLM_COMPILE pipeline on CPU.

Each model is built and compiled by tests/vllm_pipeline.py (ModelOpt MXFP8, the CuTe-DSL kernel
declared supported: `vllm.mxfp8_quantize(x, True)` before every MXFP8 linear), one decoder layer.
vLLM runs activations in their native form under Inductor (`custom_ops` `['none']`), so down_proj's
quant reads plain ATen: the SiLU / GELU-tanh chain of `SiluAndMul` / `GeluAndMul` between two
slices of gate_up's output and a bf16 multiply.

What is counted, with the pipeline's own detector (`vllm_pipeline.quant_nodes`, not mxfuse's
recognizers), in every piecewise graph as mxfuse received it and after mxfuse's pass: the
standalone MXFP8 quants, and what each one left reads (through views). Goal of issue 30: in a
dense decoder layer only o_proj's quant is left, whose input is the raw output of vLLM's opaque
attention op (a graph input of the piece after vLLM's split at the attention). Two-layer models apart:
MiniMax-M3 through the Transformers backend, Step-3.5 (`SwigluStepAndMul`, a MoE layer its class needs).
"""

from __future__ import annotations

import copy

import pytest
import torch
import vllm_pipeline
from test_vllm_models import PATCHES, STANDARD_CASES
from torch import fx
from vllm_pipeline import Case, compile_model, quant_nodes, tiny

from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions

pytestmark = pytest.mark.vllm
vllm_cpu = vllm_pipeline.vllm_cpu

SILU_MODELS = ("llama", "mistral", "qwen3", "glm4", "deepseek_v2")  # DeepSeek-V2: its dense layer 0
CASES = [
    *(c for c in STANDARD_CASES if c.name in SILU_MODELS),
    Case(
        "gemma3",
        ("gemma3",),
        tiny(
            "Gemma3ForCausalLM",
            "gemma3_text",
            sliding_window=64,
            num_hidden_layers=1,
            hidden_activation="gelu_pytorch_tanh",
        ),
        2,
        "input_layernorm -> qkv_proj, pre_feedforward_layernorm -> gate_up_proj (GELU-tanh)",
    ),
]
EXPECTED = {
    "llama": "silu",
    "mistral": "silu",
    "qwen3": "silu",
    "glm4": "silu",
    "gemma3": "gelu_tanh",
    "deepseek_v2": "silu",
}


def reads(quant: fx.Node) -> str:
    """What a quant reads, through views: "attention output" for a graph input (the piece's split
    point: the attention op's result), else the producing op's name."""
    node, _ = vllm_pipeline.source(quant.args[0])
    while isinstance(node, fx.Node) and node.target is torch.ops.aten.split.Tensor:
        node, _ = vllm_pipeline.source(node.args[0])  # a slice of it (MiniMax-M3's [attention | gate] output)
    if not isinstance(node, fx.Node):
        return "constant"
    return "attention output" if node.op == "placeholder" else str(node.target)


@pytest.fixture(scope="module")
def results(vllm_cpu):
    out = {}
    for case in CASES:
        record = compile_model(vllm_cpu, case, patches=[p() for p in PATCHES.get(case.name, ())])
        before, left, fused = 0, [], []
        for graph in record.before:  # a copy of each graph as mxfuse received it; rewritten again here
            graph = copy.deepcopy(graph)
            before += len(quant_nodes(graph))
            post_grad.run(graph, PassOptions(strict=True))
            left += [reads(q) for q in quant_nodes(graph)]
            fused += [n for n in graph.nodes if n.op == "call_function" and "act_mul" in str(n.target)]
        out[case.name] = (record, before, left, fused)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_only_o_proj_quant_is_left_per_layer(results, case):
    _, before, left, fused = results[case.name]
    assert before == case.sites + 2, (before, case.why_sites)  # the norm sites, o_proj's and down_proj's
    assert left == ["attention output"], left  # one layer: o_proj's quant only
    (op,) = fused
    assert op.args[1] == EXPECTED[case.name] and op.kwargs["round_each_op"] and op.kwargs["gate_first"], op
    assert op.kwargs["swizzled"] is True  # the CuTe-DSL linear's layout, read off its quant


def test_act_mul_fused_in_the_pipeline_itself(results):
    """The pass vLLM resolved from its config (mxfuse.vllm_pass) reported the act·mul sites fused."""
    for name, (record, *_rest) in results.items():
        kinds = [k for k in record.matched if k.startswith("aten:") and "_mul->" in k]
        assert kinds, (name, record.matched, record.skipped)


def test_fused_graph_runs_bitwise_like_the_source_on_cpu():
    """vLLM's SiluAndMul.forward_native then mxfp8_quantize == the fused op, on CPU, bit for bit."""
    from vllm.model_executor.layers.activation import SiluAndMul

    x = (torch.randn(5, 2 * 128) * 3).to(torch.bfloat16)
    y = SiluAndMul.forward_native(x)  # a staticmethod: vLLM's native arithmetic, no config needed
    want = torch.ops.vllm.mxfp8_quantize(y, False)
    codes, scales, _ = torch.ops.mxfuse.act_mul_mxfp8(x, "silu")
    assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8).reshape(-1), want[1].view(torch.uint8).reshape(-1))


@pytest.fixture(scope="module")
def minimax_m3(vllm_cpu):
    from test_vllm_minimax_m3 import MINIMAX_M3

    return compile_model(vllm_cpu, MINIMAX_M3)


def test_minimax_m3_through_the_transformers_backend(minimax_m3):
    """MiniMax-M3's HF code under vLLM's Transformers backend: the clamped SwiGLU in bf16 ops (gate
    `clamp_max 7`, `* 1.702`, sigmoid, `*`; up `clamp +-7`, `+ 1`; `*`) then the backend's reshape to
    rows: fused with down_proj's quant, each op rounded as the graph writes it. Layer 0 is dense, layer 1
    MoE (its experts quantize inside vLLM's MoE op): left are the two o_proj quants."""
    left, fused = [], []
    for graph in minimax_m3.before:
        graph = copy.deepcopy(graph)
        post_grad.run(graph, PassOptions(strict=True))
        left += [reads(q) for q in quant_nodes(graph)]
        fused += [n for n in graph.nodes if n.op == "call_function" and "act_mul" in str(n.target)]
    assert left == ["attention output"] * 2, left
    (op,) = fused
    assert op.args[-1] == "swiglu_oai" and op.kwargs["round_each_op"], op
    assert op.kwargs["alpha"] == 1.702 and op.kwargs["limit"] == 7.0, op.kwargs


@pytest.fixture(scope="module")
def step3p5(vllm_cpu):
    """Step-3.5 (test_vllm_models.py's case) with its dense MLP's `swiglu_limits_shared` set: layer 0's
    `Step3p5MLP` runs `SwigluStepAndMul(limit=7.0)` (silu, `clamp_max 7`; up clamped to +-7)."""
    import dataclasses

    from test_vllm_models import CASES as NORM_CASES

    (case,) = [c for c in NORM_CASES if c.name == "step3p5"]
    config = {**case.hf_config, "swiglu_limits_shared": [7.0, 7.0]}
    return compile_model(vllm_cpu, dataclasses.replace(case, name="step3p5_swiglu_step", hf_config=config))


def test_step3p5_swiglu_step_through_the_pipeline(step3p5):
    """Layer 0 (dense MLP, SwigluStepAndMul) leaves only o_proj's quant; layer 1 (MoE) only its o_proj's (the
    experts and the shared expert quantize inside vLLM's MoE op). vLLM's `SwigluStepAndMul` splits gate_up with
    `chunk`: the act·mul reads the halves."""
    before, left, fused = 0, [], []
    for graph in step3p5.before:
        graph = copy.deepcopy(graph)
        before += len(quant_nodes(graph))
        post_grad.run(graph, PassOptions(strict=True))
        left += [reads(q) for q in quant_nodes(graph)]
        fused += [n for n in graph.nodes if n.op == "call_function" and "act_mul" in str(n.target)]
    assert before == 3 + 1 + 2, before  # the norm sites, down_proj's, the two o_proj's
    assert left == ["attention output"] * 2, left
    (op,) = fused
    assert op.args[1] == "swiglu_step" and op.kwargs["limit"] == 7.0 and op.kwargs["gate_first"], op
    assert op.kwargs["round_each_op"] and op.kwargs["swizzled"] is True, op
    assert "aten:swiglu_step_mul->vllm_quant:swizzled" in step3p5.matched, step3p5.matched


def test_swiglu_step_fused_op_is_vllms_forward_native_bitwise():
    """vLLM's own `SwigluStepAndMul(7.0).forward_native` then vLLM's quant == the fused op, on CPU."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SwigluStepAndMul

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        module = SwigluStepAndMul(limit=7.0)
    x = (torch.randn(5, 2 * 128, generator=torch.Generator().manual_seed(3)) * 6).to(torch.bfloat16)
    want = torch.ops.vllm.mxfp8_quantize(module.forward_native(x), False)
    codes, scales, _ = torch.ops.mxfuse.act_mul_mxfp8(x, "swiglu_step", limit=7.0)
    assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8).reshape(-1), want[1].view(torch.uint8).reshape(-1))
