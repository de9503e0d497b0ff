"""End-to-end compiles of the norm forms of issues 14 and 19: real transformers modules, tiny shapes.

What is real: transformers' `Gemma3DecoderLayer` / `GemmaRMSNorm` (tiny configs, random
weights, sdpa attention). What is stubbed, and why: each `nn.Linear` becomes an MXFP8
linear that flattens before it quantizes (`mxfp8_quantize(x.reshape(-1, K))`), the way
an MXFP8 linear kernel takes `[M, K]` rows (transformers has no MXFP8 linear of its own).
Compiles are few: each fixture compiles once and its asserts share it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from foreign_bound import assert_within_foreign_bound
from graph_helpers import FUSED_ADD, FUSED_PLAIN, QUANT, assert_bitwise, compile_with_pass

import mxfuse
from mxfuse.hf import swap_linears
from mxfuse.models import MXFP8Linear
from mxfuse.passes.options import PassOptions
from mxfuse.patterns.results import SharedCode

transformers = pytest.importorskip("transformers")
mx = torch.ops.mxfuse
HIDDEN = 64


class FlatteningMXFP8Linear(MXFP8Linear):
    """An MXFP8 linear that quantizes `[M, K]` rows, as MXFP8 GEMM kernels take them."""

    def forward(self, x):
        codes, scales = mx.mxfp8_quantize(x.reshape(-1, self.in_features))
        out = self.forward_quantized(codes, scales, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def gemma3_layer_forward(tokens: int):
    from transformers.models.gemma3 import configuration_gemma3 as conf, modeling_gemma3 as modeling

    config = conf.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        layer_types=["full_attention"],
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = modeling.Gemma3DecoderLayer(config, 0)
    for module in layer.modules():
        if isinstance(module, modeling.Gemma3RMSNorm):
            torch.nn.init.normal_(module.weight, std=0.1)
    layer = layer.to(torch.bfloat16).eval()
    swap_linears(layer, FlatteningMXFP8Linear)
    hidden = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    positions = torch.arange(tokens).unsqueeze(0)
    with torch.no_grad():
        cos_sin = modeling.Gemma3RotaryEmbedding(config=config)(hidden, positions, "full_attention")

    class Forward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, h):
            return self.layer(h, position_embeddings=cos_sin, position_ids=positions)

    return Forward().eval(), hidden


# input_layernorm -> q/k/v (one fused op); residual add in bf16 + pre_feedforward_layernorm -> gate/up
GEMMA3_MATCHED = {
    "hf:plain->mxfuse_quant:rowmajor": 1,
    "hf:fused_add->mxfuse_quant:rowmajor": 1,
    "aten:gelu_tanh_mul->mxfuse_quant:rowmajor": 1,  # Gemma 3's MLP: GELU-tanh(gate) * up -> down_proj
}


@pytest.fixture(scope="module")
def gemma3_unfused():
    forward, hidden = gemma3_layer_forward(12)
    compiled, _ = compile_with_pass(forward, passes=False)
    with torch.no_grad():
        return forward, hidden, compiled(hidden), forward(hidden)


def max_error(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def assert_layer_output_close(actual, unfused, eager):
    """The norm+quant bound holds at the quant (tests/test_norm_forms.py); after the GEMMs, attention
    and the post-norms of a layer no bound is stated. What must hold: the pass moves the layer's
    output no further from the unfused compile than Inductor's own compile moves it from eager."""
    assert max_error(actual, unfused) <= max_error(unfused, eager), (
        max_error(actual, unfused),
        max_error(unfused, eager),
    )


@pytest.mark.parametrize("freezing", [False, True], ids=["params", "frozen"])
def test_gemma3_decoder_layer_fuses_every_norm_that_feeds_a_quant(gemma3_unfused, freezing, caplog):
    forward, hidden, unfused, eager = gemma3_unfused
    with torch._inductor.config.patch(freezing=freezing), caplog.at_level(logging.WARNING, logger="mxfuse"):
        compiled, capture = compile_with_pass(forward)
        with torch.no_grad():
            actual = compiled(hidden)
    assert capture.report.matched_strings() == GEMMA3_MATCHED
    assert capture.after[FUSED_PLAIN] == 1 and capture.after[FUSED_ADD] == 1
    assert capture.after[QUANT] == 1  # o_proj's, after attention; down_proj's is fused with the GELU-tanh·up
    # q/k norms, post-attention and post-feedforward norms feed no quant: said so, not warned about
    assert {s.code for s in capture.report.skipped} == {SharedCode.NO_QUANT}
    assert not [r for r in caplog.records if r.name == "mxfuse" and r.levelno >= logging.WARNING]
    if freezing:  # `1 + w` folded into an fp32 constant: the multiplier itself, offset 0
        assert "weight_offset = 0.0" in capture.graph_text
    assert_layer_output_close(actual, unfused, eager)


def test_gemma_rmsnorm_dynamic_compiles_once_for_every_token_count():
    """dynamic=True turns the eps attribute into a graph input: the fused op reads it at run time."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    norm = GemmaRMSNorm(HIDDEN, eps=1e-6)
    torch.nn.init.normal_(norm.weight, std=0.1)
    norm = norm.to(torch.bfloat16).eval()

    def fn(hidden):  # [batch, seq, K], flattened by the linear
        return mx.mxfp8_quantize(norm(hidden).reshape(-1, HIDDEN))

    compiled, capture = compile_with_pass(fn, dynamic=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tokens in (3, 17, 40):
            hidden = torch.randn(2, tokens, HIDDEN, generator=g).to(torch.bfloat16)
            assert_bitwise(compiled(hidden), fn(hidden))  # on CPU the reference is eager HF's arithmetic
    assert capture.calls == 1
    assert capture.report.matched_strings() == {"hf:plain->mxfuse_quant:rowmajor": 1}
    assert capture.after[FUSED_PLAIN] == 1 and capture.after[QUANT] == 0
    assert "eps_tensor = " in capture.graph_text


class TwoNorms(torch.nn.Module):
    """transformers' GemmaRMSNorm with eps = 0.0 (Inductor drops the `+ 0.0`), then a look-alike
    multiplying by `2 + w`: the first fuses, the second is explained and warned about."""

    def __init__(self):
        super().__init__()
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        self.gemma = GemmaRMSNorm(HIDDEN, eps=0.0)
        torch.nn.init.normal_(self.gemma.weight, std=0.1)
        self.llama_weight = torch.nn.Parameter(torch.ones(HIDDEN), requires_grad=False)
        self.to(torch.bfloat16)

    def forward(self, h):
        a = mx.mxfp8_quantize(self.gemma(h).reshape(-1, HIDDEN))
        x = h.float()
        llama = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (2.0 + self.llama_weight.float())).type_as(h)
        return (*a, *mx.mxfp8_quantize(llama.reshape(-1, HIDDEN)))


def test_explain_api_gives_typed_verdicts_and_the_pass_warns_once_with_the_source_line(caplog):
    model = TwoNorms().eval()
    hidden = torch.randn(1, 8, HIDDEN).to(torch.bfloat16)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="mxfuse"):
        explanation = mxfuse.explain(model, hidden, options=PassOptions(strict=True))
    fused, unfused = sorted(explanation.verdicts, key=lambda v: not v.fused)
    assert fused.fused and fused.kind == "hf:plain" and fused.detail == "hf:plain->mxfuse_quant:rowmajor"
    assert fused.module is not None and "gemma" in fused.module
    assert not unfused.fused and unfused.code is SharedCode.NORM_ARITHMETIC
    assert "`2 + w`" in unfused.detail and unfused.fix is not None
    assert unfused.source is not None and unfused.source.startswith("test_norm_forms_compiled.py:")
    (report,) = [g.report for g in explanation.graphs]
    assert report.matched_strings() == {"hf:plain->mxfuse_quant:rowmajor": 1}
    warnings = [r.getMessage() for r in caplog.records if r.name == "mxfuse" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    line = unfused.source.split(" in ")[0]  # "test_norm_forms_compiled.py:NNN"
    assert line in warnings[0] and "`2 + w`" in warnings[0] and "fix:" in warnings[0]


@pytest.mark.vllm
def test_vllm_ir_gemma_norm_under_freezing_fuses(vllm_ops):
    """vLLM's GemmaRMSNorm passes `w.float() + 1.0`; freezing folds it into a constant."""

    class Norms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter((0.1 * torch.randn(HIDDEN)).to(torch.bfloat16), requires_grad=False)

        def forward(self, x, residual):
            y, res = torch.ops.vllm_ir.fused_add_rms_norm(x, residual, self.w.float() + 1.0, 1e-6)
            return (*vllm_ops.mxfp8_quantize(y, False, 0), res)

    model = Norms().eval()
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(9, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(2)]
    with torch._inductor.config.patch(freezing=True):
        compiled, capture = compile_with_pass(model)
        with torch.no_grad():
            actual = compiled(*args)
    assert capture.report.matched_strings() == {"vllm_ir:fused_add->vllm_quant:rowmajor": 1}
    assert "weight_offset = 0.0" in capture.graph_text
    with torch.no_grad():
        assert_within_foreign_bound(actual, model(*args))
