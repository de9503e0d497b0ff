"""The gated producers' recognizers (mxfuse/patterns/gated.py, gated_norm.py) on traced graphs of their sources.

Each source is traced to the ATen graph Inductor's post-grad passes see (make_fx with Inductor's
decompositions), an MXFP8 quant behind it: vLLM's gated attention output and
its `RMSNormGated` (native form, the `[T, H, D]` GDN input flattened before out_proj), Hugging Face's
`Qwen3NextAttention` gate line and `Qwen3NextRMSNormGated` (with the model's reshapes). Each match is
fused with its quant the way rewrite 1 does it (`insert_fused`, the quant's outputs replaced), and the
fused graph is run against the source on CPU: bitwise where the quant is mxfuse's, and every
refusal leaves the graph exactly as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import mxfuse  # noqa: F401
from mxfuse.ops import gated as gated_ops
from mxfuse.patterns import gated, gated_norm
from mxfuse.patterns.producer_registry import find_producers, match_producer
from mxfuse.patterns.producers import ProducerFamily, insert_fused
from mxfuse.patterns.quants import quants_through_views
from mxfuse.testing import assert_bitwise

mx = torch.ops.mxfuse
aten = torch.ops.aten
GATED = (ProducerFamily.GATE, ProducerFamily.GATED_NORM)
T, H, D = 37, 4, 64


def trace(fn, *args) -> fx.GraphModule:
    """`fn` as the post-grad pass receives it: ATen with Inductor's decompositions (static shapes here; the
    symbolic token count of a real compile: tests/test_gated_vllm.py)."""
    from torch._inductor.decomposition import select_decomp_table

    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def gated_producers(gm: fx.GraphModule):
    return [p for p in find_producers(gm.graph) if p.family in GATED]


def fuse(gm: fx.GraphModule) -> list:
    """Rewrite 1 on the gated producers (its steps: insert_fused, the quants' outputs replaced); returns
    what fused."""
    fused = []
    for producer in gated_producers(gm):
        if producer.reject_reason() is not None:
            continue
        viewed = quants_through_views(producer.y)
        if not viewed:
            continue
        first = viewed[0].quant
        out = insert_fused(gm.graph, producer, swizzled=first.swizzled, rule=first.rule)
        k = producer.y.meta["val"].shape[-1]
        for v in viewed:
            v.replace_outputs(gm.graph, out["codes"], out["scales"], k)
        fused.append(producer)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return fused


def calls(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def rand(*shape, scale=1.0, seed=0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ---------------------------------------------------------------- the gate


def vllm_gate(attn_output, gate):
    """`Qwen3NextAttention.forward`'s gate (vLLM models/qwen3_next.py:466-467), then o_proj's quant."""
    attn_output = attn_output * torch.sigmoid(gate)
    return mx.mxfp8_quantize(attn_output, True)


def fp32_gate(x, gate):
    """The gate in fp32 with one rounding (`round_gate=False`)."""
    return mx.mxfp8_quantize((x.float() * torch.sigmoid(gate.float())).to(x.dtype), False)


@pytest.mark.parametrize("source, round_gate", [(vllm_gate, True), (fp32_gate, False)], ids=["vllm", "fp32"])
def test_gate_is_recognized_and_fuses_bitwise(source, round_gate):
    x, g = rand(T, H * D), rand(T, H * D, scale=4.0, seed=1)
    gm = trace(source, x, g)
    (producer,) = gated_producers(gm)
    assert isinstance(producer, gated.GateMatch) and producer.round_gate is round_gate
    assert producer.kind == "aten:sigmoid_gate" and producer.reject_reason() is None
    expected = source(x, g)
    assert len(fuse(gm)) == 1
    assert calls(gm, mx.sigmoid_gate_mxfp8.default) == 1 and calls(gm, mx.mxfp8_quantize.default) == 0
    assert calls(gm, aten.sigmoid.default) == 0
    assert_bitwise(gm(x, g), expected)


def hf_attention_gate(attn_output, gate):
    """Hugging Face `Qwen3NextAttention.forward` (modeling_qwen3_next.py:299-302), o_proj's input quantized."""
    attn_output = attn_output.reshape(1, T, -1).contiguous()
    attn_output = attn_output * torch.sigmoid(gate)
    return mx.mxfp8_quantize(attn_output.reshape(-1, H * D), False)


def test_hf_attention_gate_fuses_bitwise():
    x, g = rand(T, H * D), rand(1, T, H * D, scale=4.0, seed=1)
    gm = trace(hf_attention_gate, x, g)
    expected = hf_attention_gate(x, g)
    assert len(fuse(gm)) == 1
    assert_bitwise(gm(x, g), expected)


def per_head_gate(x, gate):
    return mx.mxfp8_quantize((x.view(-1, H, D) * torch.sigmoid(gate)).view(-1, H * D), False)


def test_broadcast_gate_is_refused_and_left_alone():
    x, g = rand(T, H * D), rand(T, H, 1, seed=1)
    gm = trace(per_head_gate, x, g)
    before = str(gm.graph)
    (producer,) = gated_producers(gm)
    reason = producer.reject_reason()
    assert reason is not None and reason.code is gated.GatedCode.GATE_BROADCAST
    assert "(s" in reason.text or str(H) in reason.text
    assert fuse(gm) == [] and str(gm.graph) == before
    assert reason.code.fix


def test_fp32_gate_is_refused_as_an_activation_dtype():
    x, g = rand(T, H * D, dtype=torch.float32), rand(T, H * D, seed=1, dtype=torch.float32)
    gm = trace(lambda x, g: mx.mxfp8_quantize(x * torch.sigmoid(g), False), x, g)
    assert gated_producers(gm) == []  # not a gate of model-dtype tensors: nothing to fuse, nothing claimed


@pytest.mark.parametrize(
    "activation",
    [lambda x: x * torch.sigmoid(x * 1.702), lambda x: (x.float() * torch.sigmoid(x.float())).to(x.dtype)],
    ids=["glu_oai", "silu_fp32"],
)
def test_an_activation_of_x_is_not_a_gate(activation):
    """`x * sigmoid(alpha * x)` (the GLU inside Hugging Face's MiniMax-M3 / GPT-OSS SwiGLU, a SiLU written
    with sigmoid) is an activation, not a gated output: no gate is claimed (the act·mul recognizer owns it)."""
    x = rand(T, H * D)
    gm = trace(lambda x: mx.mxfp8_quantize(activation(x), False), x)
    assert [p for p in find_producers(gm.graph) if p.family is ProducerFamily.GATE] == []


def test_no_packed_form():
    x, g = rand(T, H * D), rand(T, H * D, seed=1)
    (producer,) = gated_producers(trace(vllm_gate, x, g))
    assert producer.reject_reason(packed=True).code is gated.GatedCode.NO_PACKED_FORM


# ---------------------------------------------------------------- the gated RMSNorm


@pytest.fixture(scope="module")
def rms_norm_gated():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.layernorm import RMSNormGated

    return RMSNormGated


def vllm_gdn_output(norm_cls, norm_before_gate=True, activation="silu", swizzled=True):
    """`QwenGDNLinearAttention._output_projection` up to out_proj's quant: `RMSNormGated` (its native form,
    `group_size=None`, each head a row of D) on `[T, H, D]`, then `flatten(-2)`."""

    def source(core_attn_out, z, weight):
        y = norm_cls.forward_static(core_attn_out, z, weight, 1e-6, core_attn_out.dtype, None, norm_before_gate,
                                    activation)  # fmt: skip
        return mx.mxfp8_quantize(y.flatten(-2), swizzled)

    return source


@pytest.mark.parametrize(
    "norm_before_gate, activation, swizzled",
    [(True, "silu", True), (True, "silu", False), (False, "silu", True), (True, "sigmoid", False)],
)
def test_vllm_gated_norm_is_recognized_and_fuses_bitwise(rms_norm_gated, norm_before_gate, activation, swizzled):
    x, z, w = rand(T, H, D), rand(T, H, D, scale=3.0, seed=1), rand(D, seed=2).add(1)
    source = vllm_gdn_output(rms_norm_gated, norm_before_gate, activation, swizzled)
    gm = trace(source, x, z, w)
    (producer,) = gated_producers(gm)
    assert isinstance(producer, gated_norm.GatedNormMatch)
    assert (producer.group_size, producer.k, producer.eps) == (D, H * D, 1e-6)
    assert (producer.norm_before_gate, producer.activation) == (norm_before_gate, activation)
    assert not producer.round_normalized and not producer.round_weighted
    assert producer.reject_reason() is None
    expected = gm(x, z, w)
    assert len(fuse(gm)) == 1
    assert calls(gm, mx.gated_rms_norm_mxfp8.default) == 1 and calls(gm, mx.mxfp8_quantize.default) == 0
    assert calls(gm, aten.rsqrt.default) == 0
    assert_bitwise(gm(x, z, w), expected)


def hf_gdn_output(module):
    """Hugging Face `Qwen3NextGatedDeltaNet.forward`'s end (modeling_qwen3_next.py:750-758), out_proj's input
    quantized: the norm on `[T * H, D]` rows, reshaped back to `[1, T, H * D]`."""

    def source(core_attn_out, z, weight):
        z_shape_og = z.shape
        core_attn_out = core_attn_out.reshape(-1, core_attn_out.shape[-1])
        z = z.reshape(-1, z.shape[-1])
        core_attn_out = torch.func.functional_call(module, {"weight": weight}, (core_attn_out, z))
        core_attn_out = core_attn_out.reshape(z_shape_og)
        core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1)
        return mx.mxfp8_quantize(core_attn_out.reshape(-1, H * D), False)

    return source


def test_hf_gated_norm_is_recognized_and_fuses_bitwise():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    module = Qwen3NextRMSNormGated(D, eps=1e-6).to(torch.bfloat16)
    x, z, w = rand(1, T, H, D), rand(1, T, H, D, scale=3.0, seed=1), rand(D, seed=2).add(1)
    with torch.no_grad():
        gm = trace(hf_gdn_output(module), x, z, w)
        (producer,) = gated_producers(gm)
        assert producer.round_normalized and producer.round_weighted and producer.k == H * D
        expected = gm(x, z, w)
        assert len(fuse(gm)) == 1
        assert_bitwise(gm(x, z, w), expected)


def test_whole_row_gated_norm_fuses(rms_norm_gated):
    """A 2-D input (one group per row): the norm's own output is the producer's, no view."""
    x, z, w = rand(T, 128), rand(T, 128, seed=1), rand(128, seed=2)

    def source(x, z, w):
        y = rms_norm_gated.forward_static(x, z, w, 1e-5, x.dtype, None, True, "silu")
        return mx.mxfp8_quantize(y, False)

    gm = trace(source, x, z, w)
    (producer,) = gated_producers(gm)
    assert producer.group_size == producer.k == 128
    expected = gm(x, z, w)
    assert len(fuse(gm)) == 1
    assert_bitwise(gm(x, z, w), expected)


def test_group_not_a_multiple_of_32_is_refused_and_left_alone(rms_norm_gated):
    x, z, w = rand(T, 8, 48), rand(T, 8, 48, seed=1), rand(48, seed=2)
    gm = trace(vllm_gdn_output(rms_norm_gated, swizzled=False), x, z, w)
    before = str(gm.graph)
    (producer,) = gated_producers(gm)
    assert producer.reject_reason().code is gated.GatedCode.GROUP_SIZE
    assert fuse(gm) == [] and str(gm.graph) == before


def test_one_producer_per_norm_whatever_the_views(rms_norm_gated):
    """The rounded output and the views before the head-merging one are not producers of their own."""
    x, z, w = rand(T, H, D), rand(T, H, D, seed=1), rand(D, seed=2)
    gm = trace(vllm_gdn_output(rms_norm_gated), x, z, w)
    matches = [match_producer(n) for n in gm.graph.nodes]
    assert sum(isinstance(m, gated_norm.GatedNormMatch) for m in matches) == 1


def test_reference_matches_the_traced_source_exactly(rms_norm_gated):
    """The op the match emits computes the traced source's y (not only its quant) bit for bit."""
    x, z, w = rand(T, H, D), rand(T, H, D, scale=3.0, seed=1), rand(D, seed=2)

    def source(x, z, w):
        return rms_norm_gated.forward_static(x, z, w, 1e-6, x.dtype, None, True, "silu").flatten(-2)

    y = trace(source, x, z, w)(x, z, w)
    assert_bitwise(gated_ops.gated_rms_norm_rows(x.view(T, -1), z.view(T, -1), w, 1e-6, D), y)


def test_vllm_fla_kernel_is_named_and_refused(rms_norm_gated):
    """vLLM's `fla_rms_norm_gated` custom op (the FLA Triton kernel, when a user enables the custom op)."""
    x, z, w = rand(T, H, D), rand(T, H, D, seed=1), rand(D, seed=2)

    def source(x, z, w):
        y = torch.ops.vllm.fla_rms_norm_gated(x, z, w, 1e-6, None, True, "silu")
        return mx.mxfp8_quantize(y.flatten(-2), True)

    gm = make_fx(source, tracing_mode="fake")(x, z, w)
    before = str(gm.graph)
    (producer,) = gated_producers(gm)
    assert producer.kind == "vllm_fla:gated_rms_norm"
    reason = producer.reject_reason()
    assert reason.code is gated.GatedCode.GATED_NORM_KERNEL and "fla_rms_norm_gated" in reason.text
    assert fuse(gm) == [] and str(gm.graph) == before
