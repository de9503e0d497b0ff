"""Whole models compiled with and without the pass: the reference block and a Hugging Face layer."""

from __future__ import annotations

import pytest
import torch
from foreign_bound import assert_within_foreign_bound
from graph_helpers import FUSED_ADD, FUSED_PLAIN, NORM_ADD, NORM_PLAIN, QUANT, compile_with_pass

import mxfuse  # noqa: F401
from mxfuse.models import Model, ModelConfig, example_inputs
from mxfuse.patterns.norms import find_norms
from mxfuse.patterns.quants import quant_users
from mxfuse.patterns.results import SharedCode
from mxfuse.testing import assert_bitwise

mx = torch.ops.mxfuse


def compile_pair(model, *, dynamic=False, **options):
    with_pass = compile_with_pass(model, dynamic=dynamic, **options)
    without = compile_with_pass(model, dynamic=dynamic, passes=False)
    return with_pass, without


@pytest.fixture(scope="module")
def tiny_model():
    return Model(ModelConfig.tiny()).eval()


def test_reference_block_fuses_every_norm_quant_pair_and_stays_bitwise(tiny_model):
    tokens = example_inputs(tiny_model.config, 48)
    (fused_fn, capture), (plain_fn, _) = compile_pair(tiny_model)
    with torch.no_grad():
        expected, actual = plain_fn(tokens), fused_fn(tokens)
        eager = tiny_model(tokens)
    assert_bitwise(actual, expected)
    assert_bitwise(actual, eager)
    layers = tiny_model.config.n_layers
    # layer 0: plain norm -> qkv; every post-attention norm and layer > 0 input norm: fused-add
    assert capture.after[FUSED_PLAIN] == 1
    assert capture.after[FUSED_ADD] == 2 * layers - 1
    assert capture.after[NORM_PLAIN] == 0 and capture.after[NORM_ADD] == 1  # the final norm feeds no quant
    assert capture.after[QUANT] == layers  # o_proj's: the attention output is no producer mxfuse fuses
    assert capture.after["mxfuse::act_mul_mxfp8"] == layers  # down_proj's: fused with the SwiGLU-OAI
    assert capture.before[QUANT] == 4 * layers


def test_no_quant_fed_by_a_norm_is_left(tiny_model):
    captured = {}

    def inspect(graph, options):
        report = real_run(graph, options)
        captured["left"] = [n for n in find_norms(graph) if quant_users(n.y)]
        return report

    from mxfuse.passes import post_grad

    real_run = post_grad.run
    post_grad.run = inspect
    try:
        (fused_fn, _), _ = compile_pair(tiny_model)
        with torch.no_grad():
            fused_fn(example_inputs(tiny_model.config, 16))
    finally:
        post_grad.run = real_run
    assert captured["left"] == []


def test_dynamic_token_counts_compile_once_and_stay_fused(tiny_model):
    fused_fn, capture = compile_with_pass(tiny_model, dynamic=True)
    with torch.no_grad():
        for n in (17, 64, 5):
            tokens = example_inputs(tiny_model.config, n)
            assert_bitwise(fused_fn(tokens), tiny_model(tokens))
    assert capture.calls == 1
    assert capture.after[FUSED_ADD] == 2 * tiny_model.config.n_layers - 1 and capture.after[FUSED_PLAIN] == 1


# --------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def hf_layer():
    pytest.importorskip("transformers")
    from mxfuse.hf import tiny_minimax_m3_layer

    return tiny_minimax_m3_layer()


def test_hugging_face_minimax_m3_layer_fuses_within_the_foreign_bound(hf_layer):
    layer, rotary = hf_layer
    hidden = torch.randn(1, 24, 128, dtype=torch.bfloat16)
    positions = torch.arange(24).unsqueeze(0)
    with torch.no_grad():
        cos_sin = rotary(hidden, positions)

    def forward(h):
        return layer(h, position_embeddings=cos_sin, position_ids=positions)

    (fused_fn, capture), (plain_fn, _) = compile_pair(forward)
    with torch.no_grad():
        actual, expected = fused_fn(hidden), plain_fn(hidden)
    # input_layernorm -> q/k/v (three quants, one fused op); residual add + post-attention norm -> gate/up;
    # the clamped SwiGLU in bf16 ops -> down_proj (an act·mul producer, each op rounded as the source writes it)
    assert capture.report.matched_strings() == {
        "hf:plain->mxfuse_quant:rowmajor": 1,
        "hf:fused_add->mxfuse_quant:rowmajor": 1,
        "aten:swiglu_oai_mul->mxfuse_quant:rowmajor": 1,
    }
    assert capture.after[QUANT] == 1  # o_proj
    # the per-head q/k norms feed RoPE, not a quant: left alone, with the code
    assert {s.code for s in capture.report.skipped} == {SharedCode.NO_QUANT}
    # foreign norm: outputs after two GEMMs agree to bf16 rounding of the layer
    error = (actual.float() - expected.float()).abs().max()
    assert error <= 2**-6 * expected.float().abs().max(), error


def test_hugging_face_norm_quant_alone_is_within_the_stated_bound(hf_layer):
    layer, _ = hf_layer
    norm = layer.post_attention_layernorm

    def fn(hidden, residual):
        hidden = residual + hidden
        return (*mx.mxfp8_quantize(norm(hidden)), hidden)

    g = torch.Generator().manual_seed(1)
    args = [(torch.randn(64, 128, generator=g) * 4).to(torch.bfloat16) for _ in range(2)]
    (fused_fn, capture), (plain_fn, _) = compile_pair(fn)
    with torch.no_grad():
        assert_within_foreign_bound(fused_fn(*args), plain_fn(*args))
        assert_bitwise(fused_fn(*args), fn(*args))  # on CPU our reference matches eager HF exactly
    assert capture.after[FUSED_ADD] == 1
