"""act·mul producers (mxfuse/patterns/act_mul.py) through rewrite 1, on graphs of every source.

Each source's graph is traced with Inductor's decompositions (tests/test_norm_forms.py's
`rewritten`: what a post-grad pass receives), rewritten by the pass, and run: the fused graph
must equal the unfused one bit for bit on CPU (codes, scales and any bf16 `y` a second user
reads), with exactly the fused op the source calls for (its activation, `round_each_op`,
`gate_first`, the pair form). Sites that cannot fuse are left exactly as they were, with a code;
among them vLLM's two activations without a fused op, through their own classes' `forward_native`
(`SwigluOAIAndMul`'s interleaved halves, `SiluAndMulWithClamp` with beta 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graph_helpers import assert_bitwise, call_arguments, compile_with_pass, op_counts, rewritten as run_pass
from test_act_mul_ops import gate_up_of, hf_gpt_oss, vllm_gelu_tanh_and_mul, vllm_silu_and_mul, vllm_swiglu_step_and_mul

import mxfuse  # noqa: F401
from mxfuse.models import swiglu_oai, swiglu_oai_native
from mxfuse.patterns.act_mul import ActMulCode, match_act_mul
from mxfuse.patterns.producer_registry import find_producers
from mxfuse.patterns.producers import ProducerFamily
from mxfuse.patterns.results import SharedCode

mx = torch.ops.mxfuse
FUSED = "mxfuse::act_mul_mxfp8"
PAIR = "mxfuse::act_mul_pair_mxfp8"
QUANT = "mxfuse::mxfp8_quantize"


def quantized(act, *, swizzled=False, second_user=False):
    """`fn(*inputs)`: the source's act·mul, then mxfuse's quant (and optionally a bf16 reader of y)."""

    def fn(*xs):
        y = act(*xs)
        q, s = mx.mxfp8_quantize(y.reshape(-1, y.shape[-1]), swizzled)
        return (q, s, y * 2) if second_user else (q, s)

    return fn


def fused_args(after) -> list[dict]:
    return [
        call_arguments(n)
        for n in after.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("mxfuse.act_mul")
    ]


def rows(dtype=torch.bfloat16, seed=0, i=128):
    gate, up = gate_up_of(dtype, seed)
    return gate[:, :i].contiguous(), up[:, :i].contiguous()


def assert_fused(fn, xs, op, **expect):
    before, after, report = run_pass(fn, *xs)
    counts = op_counts(after.graph)
    assert counts[op] == 1 and counts[QUANT] == 0, (counts, report.skipped)
    (args,) = fused_args(after)
    for key, value in expect.items():
        assert args.get(key) == value, (key, args)
    with torch.no_grad():
        assert_bitwise(after(*xs), before(*xs), "fused vs unfused graph")
    return report


GATE_UP_SOURCES = [
    ("silu", vllm_silu_and_mul, {}),
    ("gelu_tanh", vllm_gelu_tanh_and_mul, {}),
    ("swiglu_step", vllm_swiglu_step_and_mul, {"limit": 7.0}),
]


@pytest.mark.parametrize("activation,source,extra", GATE_UP_SOURCES, ids=[s[0] for s in GATE_UP_SOURCES])
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_vllm_native_forms_fuse(activation, source, extra, swizzled):
    gate, up = rows()
    x = torch.cat((gate, up), dim=-1)
    expect = dict(activation=activation, round_each_op=True, gate_first=True, swizzled=swizzled, **extra)
    assert_fused(quantized(source, swizzled=swizzled), (x,), FUSED, **expect)


def test_halves_in_the_other_order_and_a_3d_gate_up():
    gate, up = rows(seed=1)

    def up_first(x):  # gate is the second half
        d = x.shape[-1] // 2
        return F.silu(x[..., d:]) * x[..., :d]

    x = torch.cat((up, gate), dim=-1)
    assert_fused(quantized(up_first), (x,), FUSED, gate_first=False)
    assert_fused(quantized(vllm_silu_and_mul), (x.reshape(2, -1, x.shape[-1]),), FUSED, gate_first=True)


@pytest.mark.parametrize("act,activation", [("silu", "silu"), ("gelu_pytorch_tanh", "gelu_tanh")])
def test_hugging_face_mlp_form_fuses_as_a_pair(act, activation):
    from transformers.activations import ACT2FN

    gate, up = rows(seed=2)
    fn = ACT2FN[act]
    assert_fused(quantized(lambda g, u: fn(g) * u), (gate, up), PAIR, activation=activation, round_each_op=True)


def test_gpt_oss_clamped_swiglu_in_the_model_dtype():
    gate, up = rows(seed=3)
    assert_fused(
        quantized(hf_gpt_oss), (gate, up), PAIR, activation="swiglu_oai", round_each_op=True, alpha=1.702, limit=7.0
    )


def test_mxfuse_swiglu_oai_native_and_opaque():
    gate, up = rows(seed=4)
    x = torch.cat((gate, up), dim=-1)
    assert_fused(quantized(swiglu_oai_native), (x,), FUSED, activation="swiglu_oai", round_each_op=False)
    swiglu_oai(x)  # registers mxfuse_models::swiglu_oai (what a compiled layer does when it is built)
    report = assert_fused(quantized(swiglu_oai), (x,), FUSED, activation="swiglu_oai", round_each_op=False)
    assert any(str(k).startswith("mxfuse_models:swiglu_oai_mul+fp32->") for k in report.matched), report.matched


def test_y_with_another_reader_is_emitted():
    gate, up = rows(seed=5)
    x = torch.cat((gate, up), dim=-1)
    assert_fused(quantized(vllm_silu_and_mul, second_user=True), (x,), FUSED, emit_y=True)


def test_vllm_c_silu_and_mul_under_auto_functionalized():
    """`_C.silu_and_mul(result, input)` (a user enabling vLLM's custom op): a fake schema stands for vLLM's
    CUDA extension, which does not load on CPU; its CPU impl here is vLLM's kernel arithmetic."""
    lib = torch.library.Library("_C", "FRAGMENT")
    if not hasattr(torch.ops._C, "silu_and_mul"):
        lib.define("silu_and_mul(Tensor! result, Tensor input) -> ()")

        def impl(result, x):
            d = x.shape[-1] // 2
            result.copy_(F.silu(x[..., :d]) * x[..., d:])

        lib.impl("silu_and_mul", impl, "CompositeExplicitAutograd")
        lib.impl("silu_and_mul", lambda result, x: None, "Meta")

    def fn(x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        torch.ops._C.silu_and_mul(out, x)
        return mx.mxfp8_quantize(out)

    gate, up = rows(seed=6)
    x = torch.cat((gate, up), dim=-1)
    compiled, capture = compile_with_pass(fn)
    with torch.no_grad():
        assert_bitwise(compiled(x), fn(x))
    assert capture.after[FUSED] == 1 and capture.after[QUANT] == 0, capture.after
    assert any(str(k).startswith("vllm_c:silu_mul->") for k in capture.report.matched), capture.report.matched


# ------------------------------------------------------------------ refusals and non-matches


def test_other_constants_are_no_gelu():
    gate, up = rows(seed=7)

    def not_gelu(g, u):  # GELU's shape with another kappa: not torch's GELU
        x = g.float()
        inner = 0.7978845608028654 * (x + 0.05 * (x * x * x))
        return ((x * 0.5) * (1 + torch.tanh(inner))).to(g.dtype) * u

    _, after, _ = run_pass(quantized(not_gelu), gate, up)
    assert op_counts(after.graph)[QUANT] == 1 and op_counts(after.graph)[PAIR] == 0


def test_asymmetric_clamp_is_no_swiglu_step():
    gate, up = rows(seed=8)
    x = torch.cat((gate, up), dim=-1)

    def lopsided(x):
        g, u = x.chunk(2, dim=-1)
        return F.silu(g).clamp(max=7.0) * u.clamp(min=-6.0, max=7.0)

    _, after, _ = run_pass(quantized(lopsided), x)
    assert op_counts(after.graph)[QUANT] == 1 and op_counts(after.graph)[FUSED] == 0


def test_fp32_activations_are_refused_with_a_code():
    gate, up = rows(seed=9)
    gate, up = gate.float(), up.float()
    before, after, report = run_pass(quantized(lambda g, u: F.silu(g) * u), gate, up)
    assert op_counts(after.graph) == op_counts(before.graph)
    codes = [s.code for s in report.skipped]
    assert SharedCode.ACTIVATION_DTYPE in codes, report.skipped


def test_a_size_not_a_multiple_of_32_is_refused_with_a_code():
    gate, up = rows(seed=10, i=128)
    gate, up = gate[:, :48].contiguous(), up[:, :48].contiguous()

    def fn(g, u):
        y = F.silu(g) * u
        return mx.mxfp8_quantize(torch.cat((y, y), dim=-1))  # the quant's rows are 96 wide; y's are 48

    before = run_pass(fn, gate, up)[0]
    producers = [p for p in find_producers(before.graph) if p.family is ProducerFamily.ACT_MUL]
    assert len(producers) == 1
    reason = producers[0].reject_reason()
    assert reason is not None and reason.code is SharedCode.HIDDEN_SIZE, reason


def test_broadcast_up_is_refused_and_left_alone():
    gate, up = rows(seed=11)
    up = up[:1]  # [1, I]: broadcast over the rows

    before, after, report = run_pass(quantized(lambda g, u: F.silu(g) * u), gate, up)
    assert op_counts(after.graph) == op_counts(before.graph)
    codes = [s.code for s in report.skipped]
    assert ActMulCode.GATE_UP_SHAPES in codes, report.skipped


def test_no_packed_op():
    gate, up = rows(seed=12)
    x = torch.cat((gate, up), dim=-1)
    before = run_pass(quantized(vllm_silu_and_mul), x)[0]
    (match,) = [m for n in before.graph.nodes if (m := match_act_mul(n)) is not None]
    reason = match.reject_reason(packed=True)
    assert reason is not None and reason.code is ActMulCode.NO_PACKED_OP


# ------------------------------------------------------------------ vLLM's forms without a fused op


@pytest.fixture(scope="module")
def vllm_activation():
    """vLLM's activation module (its CustomOps need a current config to be built; CPU, no `_C`)."""
    pytest.importorskip("vllm")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import activation

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield activation


def assert_left_with(fn, xs, code):
    """The pass leaves the site exactly as it was, its report and `explain` name `code` and its fix."""
    from mxfuse.passes.explain import explain

    before, after, report = run_pass(fn, *xs)
    assert str(after.graph) == str(before.graph)
    (skip,) = [s for s in report.skipped if s.code is code]
    assert skip.rewrite == "norm_quant" and skip.reason, report.skipped
    (verdict,) = [v for v in explain(before.graph) if v.family is ProducerFamily.ACT_MUL]
    assert not verdict.fused and verdict.code is code and verdict.fix == code.fix and code.fix, verdict
    with torch.no_grad():
        assert_bitwise(after(*xs), before(*xs), "left as it was")


def test_vllm_swiglu_oai_interleaved_is_refused_and_left_alone(vllm_activation, caplog):
    """`SwigluOAIAndMul.forward_native` reads `x[..., ::2]` / `x[..., 1::2]`: no fused op reads interleaved
    columns (a pair of strided views would be copied first), so the site stays, named; the graph's one
    warning gives its fix. The same arithmetic on the halves of a de-interleaved gate_up fuses."""
    module = vllm_activation.SwigluOAIAndMul()
    gate, up = rows(seed=13)
    x = torch.stack((gate, up), dim=-1).flatten(-2)  # gate in the even columns, up in the odd ones
    with caplog.at_level("WARNING", logger="mxfuse"):
        assert_left_with(quantized(module.forward_native), (x,), ActMulCode.INTERLEAVED)
    assert f"fix: {ActMulCode.INTERLEAVED.fix}" in caplog.text, caplog.text

    expect = dict(activation="swiglu_oai", alpha=1.702, limit=7.0, round_each_op=True, gate_first=True)
    de_interleaved = torch.cat((gate, up), dim=-1)

    def fixed(x):  # the fix: the gate_up weight's rows de-interleaved (its output `[gate | up]`), the halves read
        i = x.shape[-1] // 2
        g, u = x[..., :i], x[..., i:]
        g = g.clamp(min=None, max=module.limit)  # SwigluOAIAndMul.forward_native's lines, on the halves
        u = u.clamp(min=-module.limit, max=module.limit)
        return (u + 1) * (g * torch.sigmoid(g * module.alpha))

    assert_fused(quantized(fixed), (de_interleaved,), FUSED, **expect)
    with torch.no_grad():
        assert_bitwise(fixed(de_interleaved), module.forward_native(x), "the fix keeps the arithmetic")


@pytest.mark.parametrize("compiled", [False, True], ids=["traced", "compiled"])
def test_vllm_silu_and_mul_with_clamp_is_refused_and_left_alone(vllm_activation, compiled):
    """`SiluAndMulWithClamp(limit)` (alpha 1, beta 0): a SiLU of the clamped gate, no fused op's arithmetic.
    Traced, the graph keeps its `1.0 * gate` and `up + 0.0`; compiled, Inductor's joint-graph pass drops them
    before the post-grad pass: both spellings are named."""
    module = vllm_activation.SiluAndMulWithClamp(7.0)
    gate, up = rows(seed=14)
    x = torch.cat((gate, up), dim=-1)
    fn = quantized(module.forward_native)
    if not compiled:
        assert_left_with(fn, (x,), ActMulCode.CLAMPED_GATE_SILU)
        return
    compiled_fn, capture = compile_with_pass(fn)
    with torch.no_grad():
        with_pass = compiled_fn(x)
        without = compile_with_pass(fn, passes=False)[0](x)  # Inductor's arithmetic is not eager's: compare compiles
    assert_bitwise(with_pass, without, "the compiled graph with the pass vs without")
    assert capture.after == capture.before and capture.after[QUANT] == 1, capture.after
    assert [s.code for s in capture.report.skipped] == [ActMulCode.CLAMPED_GATE_SILU], capture.report.skipped


def test_vllm_silu_and_mul_with_clamp_beta_1_is_swiglu_oai(vllm_activation):
    """`SiluAndMulWithClamp(limit, alpha, beta=1.0)` computes SwiGLU-OAI's products in the other order (IEEE
    multiplication commutes): it fuses as `swiglu_oai`, bit for bit."""
    module = vllm_activation.SiluAndMulWithClamp(7.0, alpha=1.702, beta=1.0)
    gate, up = rows(seed=15)
    x = torch.cat((gate, up), dim=-1)
    expect = dict(activation="swiglu_oai", alpha=1.702, limit=7.0, round_each_op=True, gate_first=True)
    assert_fused(quantized(module.forward_native), (x,), FUSED, **expect)


def test_a_strided_slice_is_no_half():
    """`x[..., 0:I:2]` is not the first half of x, whatever its bounds."""
    gate, up = rows(seed=16)
    x = torch.cat((gate, up, up, up), dim=-1)  # [M, 4I]: x[..., 0:2I:2] and x[..., 2I::2] are [M, I]

    def fn(x):
        i2 = x.shape[-1] // 2
        return F.silu(x[..., 0:i2:2]) * x[..., i2::2]

    before = run_pass(quantized(fn), x)[0]
    (match,) = [m for n in before.graph.nodes if (m := match_act_mul(n)) is not None]
    assert match.gate_up is None and match.gate is not None, match
