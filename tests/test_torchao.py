"""torchao's MXFP8 inference quant: the TORCHAO quant rule against torchao's own `to_mx`, the
recognizer of its decomposed chain (mxfuse.patterns.torchao_quant), and norm -> torchao
linear fusion in compiled graphs, up to a Hugging Face MiniMax-M3 decoder layer.

Everything runs on CPU with torchao's EMULATED kernel (dequantize + `aten.mm`); `AUTO`
graphs (`to_blocked` scales for `_scaled_mm`) compile on CPU but cannot run there, so the
blocked layout is checked on a function that returns torchao's blocked scales itself.

Nothing is stubbed: `graph_helpers.CapturingPass` runs the mxfuse pass itself and records op
counts around it.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from graph_helpers import CapturingPass, assert_bitwise, trace

import mxfuse  # noqa: F401
from mxfuse.ops.library import MxfuseInputError
from mxfuse.ops.reference import QuantRule, gemma_rmsnorm, quantize_rows
from mxfuse.passes.options import PassOptions
from mxfuse.patterns.torchao_quant import ScaleSpelling, match_torchao_quant

mx_formats = pytest.importorskip("torchao.prototype.mx_formats")
from torchao.prototype.mx_formats import mx_tensor
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.inference_workflow import MXDynamicActivationMXWeightConfig
from torchao.prototype.mx_formats.utils import to_blocked
from torchao.quantization import quantize_
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

mx = torch.ops.mxfuse
FP8, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
FUSED_PLAIN, FUSED_ADD = "mxfuse::gemma_rmsnorm_mxfp8", "mxfuse::gemma_fused_add_rmsnorm_mxfp8"


def torchao_to_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's RCEIL MXFP8 quant of `x` (what its inference linears run): `(codes, scale bytes)`."""
    scales, codes = mx_tensor.to_mx(x, FP8, 32, ScaleCalculationMode.RCEIL)
    return codes, scales.view(torch.uint8)


def code_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# --------------------------------------------------------------------------- the rule


def every_finite_bf16_amax() -> torch.Tensor:
    """One 32-value block per non-negative finite bf16 amax (0 .. 0x7F7F), the amax at a
    random position with a random sign, the rest random in [-amax, amax]."""
    g = torch.Generator().manual_seed(0)
    amax = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    blocks = amax[:, None] * (torch.rand(amax.numel(), 32, generator=g) * 2 - 1)
    sign = torch.where(torch.rand(amax.numel(), generator=g) < 0.5, -1.0, 1.0)
    column = torch.randint(0, 32, (amax.numel(),), generator=g)
    blocks[torch.arange(amax.numel()), column] = amax * sign
    return blocks.to(torch.bfloat16).reshape(-1, 256)


def edge_blocks() -> torch.Tensor:
    """Blocks of NaN (both signs, alone or with Inf), +-Inf, zeros, -0, bf16 subnormals, the
    scale-byte-0 boundary 448 * 2**-127 and its neighbours, the bf16 maximum."""
    nan, inf = float("nan"), float("inf")
    rows = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    rows[0, 3] = nan
    rows[1, 5], rows[1, 6] = -nan, -inf
    rows[2, 0] = inf
    rows[3, 31] = -inf
    rows[4] = 0.0
    rows[5] = -0.0
    rows[6] = torch.linspace(-1, 1, 32) * 2**-130  # bf16 subnormals
    rows[7] = 2**-133  # smallest bf16 subnormal
    rows[8] = torch.linspace(-1, 1, 32) * 448 * 2**-127  # amax exactly at the byte-0 boundary
    rows[9] = torch.linspace(-1, 1, 32) * 449 * 2**-127  # just above it: byte 1
    rows[10] = 3.3895e38  # bf16 max
    rows[11, 7], rows[11, 8] = -nan, nan
    rows[12] = torch.linspace(-448, 448, 32)
    rows[13] = torch.linspace(-448, 448, 32) * 1.0078125  # just above 448: byte 128
    rows[14] = torch.linspace(-1, 1, 32) * 2**-126  # smallest normal
    rows[15, 0] = nan
    rows[15, 1:] = 0.0
    return rows.to(torch.bfloat16).reshape(4, 128)


@pytest.mark.parametrize("blocks", [every_finite_bf16_amax, edge_blocks])
def test_torchao_rule_equals_torchao_to_mx_bitwise(blocks):
    x = blocks()
    codes, scales = torchao_to_mx(x)
    ours = quantize_rows(x, QuantRule.TORCHAO)
    assert_bitwise((code_bits(ours[0]), ours[1]), (code_bits(codes), scales))
    op_codes, op_scales = mx.mxfp8_quantize(x.view(2, -1, x.shape[-1]), False, int(QuantRule.TORCHAO))
    assert_bitwise((code_bits(op_codes.reshape(x.shape)), op_scales.reshape(scales.shape)), (code_bits(codes), scales))


def test_default_rule_differs_from_torchao_only_at_nan_and_scale_byte_zero():
    x = torch.cat([every_finite_bf16_amax().reshape(-1, 128), edge_blocks()])
    codes, scales = torchao_to_mx(x)
    ours_codes, ours_scales = quantize_rows(x, QuantRule.DEFAULT)
    nan_block = scales == 255
    assert int(nan_block.sum()) == 4
    assert torch.equal(ours_scales[~nan_block], scales[~nan_block])
    differs = (code_bits(ours_codes) != code_bits(codes)).reshape(*scales.shape, 32).any(-1)
    assert differs.any()
    assert not (differs & (scales != 0) & ~nan_block).any()


@pytest.mark.parametrize("swizzled", [False, True])
def test_fused_ops_with_torchao_rule_equal_norm_then_torchao(swizzled):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    x[1, 40] = float("nan")
    x[2, 7] = float("inf")
    x[3] = 0
    x[4, :32] = 1e-30  # a tiny block in a normal row
    residual = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    weight = (0.1 * torch.randn(256, generator=g)).to(torch.bfloat16)
    rule = int(QuantRule.TORCHAO)
    codes, scales, _ = mx.gemma_rmsnorm_mxfp8(x, weight, 1e-6, swizzled, rule=rule)
    expected = torchao_to_mx(gemma_rmsnorm(x, weight, 1e-6))
    expected_scales = to_blocked(expected[1]).view(scales.shape) if swizzled else expected[1]
    assert_bitwise((code_bits(codes), scales), (code_bits(expected[0]), expected_scales))
    assert_bitwise(
        (code_bits(codes), scales),
        tuple(map(_as_bytes, mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6), swizzled, rule))),
    )
    add = mx.gemma_fused_add_rmsnorm_mxfp8(x, residual, weight, 1e-6, swizzled, rule=rule)
    y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
    assert_bitwise(tuple(map(_as_bytes, add[:3])), tuple(map(_as_bytes, (*mx.mxfp8_quantize(y, swizzled, rule), res))))


def _as_bytes(t):
    return code_bits(t) if t.dtype == FP8 else t


@pytest.mark.parametrize("rule", [2, -1])
def test_unknown_rule_is_refused_with_the_op_name(rule):
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(MxfuseInputError, match=r"mxfuse::gemma_rmsnorm_mxfp8: rule=.* is not a QuantRule"):
        mx.gemma_rmsnorm_mxfp8(x, torch.zeros(32), 1e-6, rule=rule)


@pytest.mark.parametrize("op", ["mxfp8_quantize", "gemma_rmsnorm_mxfp8", "gemma_fused_add_rmsnorm_mxfp8"])
def test_opcheck_with_the_torchao_rule(op):
    g = torch.Generator().manual_seed(6)
    x, r = (torch.randn(5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(64, dtype=torch.bfloat16)
    args = {"mxfp8_quantize": (x, True), "gemma_rmsnorm_mxfp8": (x, w, 1e-6, True, True)}
    args = args.get(op, (x, r, w, 1e-6, False, True, True))
    kwargs = {"rule": int(QuantRule.TORCHAO)}
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(getattr(mx, op).default, args, kwargs, test_utils=utils)


def nan_sign_free(codes: torch.Tensor) -> torch.Tensor:
    """Code bytes with every NaN as 0x7F: which NaN operand survives (its sign) is an
    implementation detail (x86 vs GPU, eager vs Inductor); NaN-ness is compared."""
    return code_bits(torch.where(codes.float().isnan(), float("nan"), codes.float()).to(FP8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("swizzled", [False, True])
def test_gpu_kernels_with_torchao_rule_equal_torchao(swizzled):
    """The Triton kernels' TORCHAO branch: quant == torchao's to_mx on the GPU (eager and
    compiled) and == the CPU reference; fused == norm then quant, bitwise."""
    rule = int(QuantRule.TORCHAO)
    x = torch.cat([every_finite_bf16_amax().reshape(-1, 128), edge_blocks()]).cuda()
    codes, scales = mx.mxfp8_quantize(x, swizzled, rule)
    for name, quant in (("eager", torchao_to_mx), ("compiled", torch.compile(torchao_to_mx))):
        want_codes, want_scales = quant(x)
        want_scales = to_blocked(want_scales).view(scales.shape) if swizzled else want_scales
        assert torch.equal(nan_sign_free(codes), nan_sign_free(want_codes)), name
        assert torch.equal(scales, want_scales), name
    ref_codes, ref_scales = mx.mxfp8_quantize(x.cpu(), swizzled, rule)
    assert torch.equal(nan_sign_free(codes).cpu(), nan_sign_free(ref_codes)) and torch.equal(scales.cpu(), ref_scales)
    g = torch.Generator().manual_seed(5)
    rows = torch.cat([edge_blocks(), (torch.randn(60, 128, generator=g) * 5).to(torch.bfloat16)]).cuda()
    residual, weight = rows.flip(0), (0.2 * torch.randn(128, generator=g)).to(torch.bfloat16).cuda()
    fused = mx.gemma_fused_add_rmsnorm_mxfp8(rows, residual, weight, 1e-6, swizzled, emit_y=True, rule=rule)
    y, res = mx.gemma_fused_add_rmsnorm(rows, residual, weight, 1e-6)
    assert_bitwise(tuple(map(_as_bytes, fused)), tuple(map(_as_bytes, (*mx.mxfp8_quantize(y, swizzled, rule), res, y))))
    plain = mx.gemma_rmsnorm_mxfp8(rows, weight, 1e-6, swizzled, rule=rule)
    want = mx.mxfp8_quantize(mx.gemma_rmsnorm(rows, weight, 1e-6), swizzled, rule)
    assert_bitwise(tuple(map(_as_bytes, plain[:2])), tuple(map(_as_bytes, want)))


# --------------------------------------------------------------------------- the recognizer


def traced_to_mx(x: torch.Tensor, scaling_mode=ScaleCalculationMode.RCEIL):
    """torchao's `to_mx` traced to core ATen with Inductor's decompositions (fake tensors)."""

    def quant(data):
        scales, codes = mx_tensor.to_mx(data, FP8, 32, scaling_mode)
        return codes, scales

    return trace(quant, x, decompose=True)


def heads(gm) -> list:
    return [m for m in map(match_torchao_quant, gm.graph.nodes) if m is not None]


def test_sm100_ptx_spelling_is_recognized():
    """torchao on sm100 computes the scale byte with inline PTX; traced here on fake CUDA
    tensors (torchao's own code path, `is_sm_at_least_100` patched; nothing runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, 128, dtype=torch.bfloat16, device="cuda")
    with mock.patch.object(mx_tensor, "is_sm_at_least_100", lambda: True):
        gm = traced_to_mx(x)
    assert "inline_asm_elementwise" in gm.code
    (match,) = heads(gm)
    assert match.spelling is ScaleSpelling.PTX and match.rule is QuantRule.TORCHAO and not match.swizzled
    outputs = gm.graph.output_node().args[0]
    assert (match.codes, match.scales) == tuple(outputs)


def test_log2_spelling_is_recognized_and_other_scale_modes_are_not():
    x = torch.zeros(8, 128, dtype=torch.bfloat16)
    (match,) = heads(traced_to_mx(x))
    assert match.spelling is ScaleSpelling.LOG2
    for mode in (ScaleCalculationMode.FLOOR, ScaleCalculationMode.CEIL, ScaleCalculationMode.EVEN):
        assert heads(traced_to_mx(x, mode)) == []
    assert heads(traced_to_mx(x.float())) == []  # fp32 input: torchao's float log2 is not the exact ceiling


def test_a_changed_constant_is_not_matched():
    gm = traced_to_mx(torch.zeros(8, 128, dtype=torch.bfloat16))
    (clamp,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clamp_max.default and n.args[1] == 448.0]
    clamp.args = (clamp.args[0], 440.0)
    assert heads(gm) == []


# --------------------------------------------------------------------------- compiled graphs


def compile_fused(fn, enabled=True):
    torch._dynamo.reset()
    fusion = CapturingPass(PassOptions.from_env() if enabled else None)
    return torch.compile(fn, options={"post_grad_custom_post_pass": fusion}), fusion


class NormLinear(torch.nn.Module):
    """`mxfuse::gemma_rmsnorm` (the project's bitwise norm) -> a torchao MXFP8 linear."""

    def __init__(self, k=128, n=64):
        super().__init__()
        self.weight = torch.nn.Parameter(0.1 * torch.randn(k))
        self.linear = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.linear(mx.gemma_rmsnorm(x, self.weight, 1e-6))


def torchao_mxfp8(module, kernel=KernelPreference.EMULATED):
    quantize_(module, MXDynamicActivationMXWeightConfig(kernel_preference=kernel))
    return module


def test_norm_into_torchao_linear_fuses_bitwise_with_dynamic_tokens():
    torch.manual_seed(0)
    model = torchao_mxfp8(NormLinear().to(torch.bfloat16))
    fused_fn, fusion = compile_fused(model)
    plain_fn, plain = compile_fused(model, enabled=False)
    with torch.no_grad():
        for tokens in (5, 33):
            x = torch.randn(2, tokens, 128).to(torch.bfloat16)
            x[0, 1, 64] = float("nan")  # a NaN block: torchao's scale 255 and all-NaN codes
            x[1, 2] = 0
            torch._dynamo.mark_dynamic(x, 1)
            assert_bitwise(fused_fn(x), plain_fn(x))
            # eager torchao: the same values; the NaN row's payload bits come from another mm kernel
            torch.testing.assert_close(fused_fn(x), model(x), rtol=0, atol=0, equal_nan=True)
    assert fusion.calls == 1 and plain.calls == 1
    assert fusion.merged_report().matched_strings() == {"mxfuse:plain->torchao_quant:rowmajor": 1}
    assert fusion.after[FUSED_PLAIN] == 1 and fusion.after["mxfuse::gemma_rmsnorm"] == 0
    # the decomposed quant is gone; what is left of the chain ops is torchao's dequant
    assert fusion.after["aten::log2"] == fusion.after["aten::amax"] == fusion.after["aten::exp2"] == 0
    assert plain.after["aten::log2"] == 1


def test_blocked_scales_are_written_blocked():
    """torchao's AUTO kernel swizzles the activation scales with `to_blocked` before
    `_scaled_mm` (which CPUs lack): the same code, returning the blocked scales (and the
    norm output itself, which the fused op then also writes)."""
    torch.manual_seed(1)
    norm_weight = 0.1 * torch.randn(96 * 32)

    def quant_for_scaled_mm(x):
        y = mx.gemma_rmsnorm(x, norm_weight, 1e-6)
        a = y.reshape(-1, x.shape[-1])
        scales, codes = mx_tensor.to_mx(a, FP8, 32, ScaleCalculationMode.RCEIL)
        return codes, to_blocked(scales.view(a.shape[0], -1)).view(torch.uint8), y * 2

    x = torch.randn(3, 50, 96 * 32).to(torch.bfloat16)
    fused_fn, fusion = compile_fused(quant_for_scaled_mm)
    plain_fn, _ = compile_fused(quant_for_scaled_mm, enabled=False)
    with torch.no_grad():
        expected = tuple(map(_as_bytes, quant_for_scaled_mm(x)))
        assert_bitwise(tuple(map(_as_bytes, fused_fn(x))), expected)
        assert_bitwise(tuple(map(_as_bytes, plain_fn(x))), expected)
    assert fusion.merged_report().matched_strings() == {"mxfuse:plain->torchao_quant:swizzled+y": 1}
    assert fusion.after["aten::permute"] == 0 and fusion.after["aten::slice_scatter"] == 0
    assert fusion.after["mxfuse::gemma_rmsnorm"] == 0  # y comes from the fused op (emit_y)


# --------------------------------------------------------------------------- Hugging Face


def tiny_minimax_m3_torchao_layer():
    """One bf16 Hugging Face `MiniMaxM3VLDecoderLayer` (mxfuse.hf's tiny config) whose linears
    torchao quantized to MXFP8 (EMULATED), and a function of the hidden states running it."""
    pytest.importorskip("transformers.models.minimax_m3_vl")
    from mxfuse import hf

    with mock.patch.object(hf, "swap_linears", lambda module: None):
        layer, rotary = hf.tiny_minimax_m3_layer(seed=3)
    torchao_mxfp8(layer)

    def forward(hidden, cos, sin):
        return layer(hidden, position_embeddings=(cos, sin), position_ids=None)

    def prepare(tokens):
        """`(hidden, cos, sin)` for `tokens` tokens, the token dim marked dynamic."""
        hidden = torch.randn(1, tokens, hf.HIDDEN).to(torch.bfloat16)
        with torch.no_grad():
            cos, sin = rotary(hidden, torch.arange(tokens).unsqueeze(0))
        for t in (hidden, cos, sin):
            torch._dynamo.mark_dynamic(t, 1)
        return hidden, cos, sin

    return forward, prepare, layer


def test_hugging_face_minimax_m3_layer_with_torchao_fuses_every_norm_before_a_linear():
    forward, prepare, layer = tiny_minimax_m3_torchao_layer()
    assert isinstance(layer.self_attn.q_proj.weight, mx_tensor.MXTensor)
    fused_fn, fusion = compile_fused(forward)  # one compile (~45 s here): the plain compile is left out
    with torch.no_grad():
        for tokens in (24, 7):
            args = prepare(tokens)
            actual, eager = fused_fn(*args), forward(*args)
            # Foreign (Hugging Face) norm, so not bitwise: compared with eager torchao (whose HF
            # norm our reference equals on CPU), the layer agrees to bf16 rounding of the layer
            # (measured: 2**-7 of the max; torchao's own compiled layer is 2**-6 off eager).
            assert _max_error(actual, eager) <= 2**-6 * eager.float().abs().max()
    assert fusion.calls == 1
    # input_layernorm -> q/k/v; residual add + post_attention_layernorm -> gate/up; the clamped
    # SwiGLU (MiniMax-M3's, in bf16 ops) -> down_proj
    assert fusion.merged_report().matched_strings() == {
        "hf:plain->torchao_quant:rowmajor": 1,
        "hf:fused_add->torchao_quant:rowmajor": 1,
        "aten:swiglu_oai_mul->torchao_quant:rowmajor": 1,
    }
    assert fusion.after[FUSED_PLAIN] == 1 and fusion.after[FUSED_ADD] == 1
    assert fusion.after["mxfuse::act_mul_pair_mxfp8"] + fusion.after["mxfuse::act_mul_mxfp8"] == 1
    # Inductor keeps q, k and v's quant chains apart (6 log2); only o_proj's stays
    assert fusion.before["aten::log2"] == 6 and fusion.after["aten::log2"] == 1


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def test_hugging_face_norm_into_torchao_quant_is_within_the_stated_bound():
    """The stated bound for foreign norms (README): codes within one e4m3 step, scales equal
    except by one at an exact power-of-two boundary; and on CPU bitwise equal to eager."""
    from foreign_bound import assert_within_foreign_bound

    _, _, layer = tiny_minimax_m3_torchao_layer()
    norm = layer.post_attention_layernorm

    def fn(hidden, residual):
        hidden = residual + hidden
        codes, scales = torchao_to_mx(norm(hidden))
        return codes.view(torch.uint8), scales, hidden

    g = torch.Generator().manual_seed(4)
    args = [(torch.randn(64, 128, generator=g) * 4).to(torch.bfloat16) for _ in range(2)]
    fused_fn, fusion = compile_fused(fn)
    plain_fn, _ = compile_fused(fn, enabled=False)
    with torch.no_grad():
        actual = fused_fn(*args)
        assert_within_foreign_bound(
            [actual[0].view(FP8), *actual[1:]], [plain_fn(*args)[0].view(FP8), *plain_fn(*args)[1:]]
        )
        assert_bitwise(actual, fn(*args))
    assert fusion.merged_report().matched_strings() == {"hf:fused_add->torchao_quant:rowmajor": 1}
