"""The norm forms of each real source, both families, on CPU: how they are spelled, and what they compute.

1. Pattern unit tests of the Hugging Face spellings, views and runtime eps (issues 14 and 19).
   Graph in, counts and bits out: each function is traced to decomposed ATen with Inductor's
   decomposition table (`graph_helpers.rewritten`: make_fx, fake tensors, the node shapes the pass
   reads, as in a post-grad graph), the pass runs on a copy, and both graphs execute eagerly on CPU.
   No Inductor compile here (the end-to-end compiles are in tests/test_norm_forms_compiled.py).
2. The arithmetic of each source against mxfuse's ops (docs/design.md, "The standard RMSNorm, source
   by source"). Each source runs as its users run it: Hugging Face's norm modules eager (both
   families), vLLM's `RMSNorm` layer and its IR ops (their `native` implementation, what vLLM lowers
   them to when it compiles with Inductor), `torch.nn.functional.rms_norm` eager and compiled. Bitwise
   where the contract says so; the foreign bound (tests/foreign_bound.py) where Inductor's reduction
   order is not ours. One stub: the CUDA kernels of FlashInfer and vLLM's `_C` (they need a GPU and
   vLLM's extension) are emulated in plain PyTorch (`emulated_cuda_norm`) to test the bound claimed
   for them.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from foreign_bound import assert_within_foreign_bound, assert_within_one_ulp
from graph_helpers import FUSED_ADD, FUSED_PLAIN, QUANT, assert_bitwise, op_counts, rewritten
from norm_families import FAMILIES, special_rows

import mxfuse  # noqa: F401
from mxfuse.patterns.producer_quant import ProducerQuantCode
from mxfuse.patterns.results import SharedCode

mx = torch.ops.mxfuse
K = 64


def data(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def gemma_weight(dtype=torch.bfloat16):
    return (0.1 * torch.randn(K, generator=torch.Generator().manual_seed(7))).to(dtype)


def spelled_norm(h, w, eps, *, square="pow", inverse="rsqrt"):
    """One spelling of Gemma's `normalize(h.float()) * (1 + w.float())`, cast back with type_as."""
    x = h.float()
    var = x.pow(2).mean(-1, keepdim=True) if square == "pow" else (x * x).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps) if inverse == "rsqrt" else x / torch.sqrt(var + eps)
    return (x * (1.0 + w.float())).type_as(h)


SPELLINGS = [
    dict(square="pow", inverse="rsqrt", eps=1e-6),
    dict(square="mul", inverse="rsqrt", eps=1e-6),
    dict(square="pow", inverse="div_sqrt", eps=1e-6),
    dict(square="mul", inverse="div_sqrt", eps=0.0),
    dict(square="pow", inverse="rsqrt", eps=0.0),
]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["w_bf16", "w_fp32"])
def test_plain_norm_spellings_through_a_flattening_quant_fuse(spelling, w_dtype):
    spelling = dict(spelling)
    eps = spelling.pop("eps")

    def fn(h, w):  # [batch, seq, K] activations; the MXFP8 linear flattens before it quantizes
        codes, scales = mx.mxfp8_quantize(spelled_norm(h, w, eps, **spelling).reshape(-1, K))
        return codes, scales

    args = (data(2, 9, K), gemma_weight(w_dtype))
    before, after, report = rewritten(fn, *args)
    assert report.matched_strings() == {"hf:plain->mxfuse_quant:rowmajor": 1}, report.skipped
    assert op_counts(after.graph)[FUSED_PLAIN] == 1 and op_counts(after.graph)[QUANT] == 0
    assert "aten.rsqrt" not in after.code and "aten.sqrt" not in after.code
    with torch.no_grad():
        assert_within_foreign_bound(after(*args), before(*args))
        if spelling == {"square": "pow", "inverse": "rsqrt"}:
            assert_bitwise(after(*args), before(*args))  # eager ATen on CPU computes the reference's ops


@pytest.mark.parametrize("residual_dtype", ["model", "fp32"])
def test_residual_add_in_model_dtype_or_fp32_fuses_and_keeps_the_residual_shape(residual_dtype):
    def fn(hidden, residual, w):
        if residual_dtype == "model":  # Gemma 3 in transformers: the add in bf16, then the norm
            s = residual + hidden
            y = spelled_norm(s, w, 1e-6)
            residual_out = s
        else:  # the add in fp32: the fused op's own order
            s = hidden.float() + residual.float()
            x = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
            y = (x * (1.0 + w.float())).to(hidden.dtype)
            residual_out = s.to(hidden.dtype)
        codes, scales = mx.mxfp8_quantize(y.view(-1, K))
        return codes, scales, residual_out * 2  # the residual's other user reads [batch, seq, K]

    args = (data(3, 5, K, seed=1), data(3, 5, K, seed=2, scale=4.0), gemma_weight())
    before, after, report = rewritten(fn, *args)
    assert report.matched_strings() == {"hf:fused_add->mxfuse_quant:rowmajor": 1}, report.skipped
    text = after.code
    assert f"round_sum = {residual_dtype == 'model'}" in text
    with torch.no_grad():
        out = after(*args)
        assert out[2].shape == (3, 5, K)
        assert_within_foreign_bound(out, before(*args))


def test_views_in_either_direction_and_other_users_keep_their_shape():
    """Norm on flat rows, quant of a `[1, M, K]` unsqueeze (swizzled) and of `[M/2, 2, K]` view; y also read."""

    def fn(h, w):
        y = spelled_norm(h, w, 1e-6)
        a = mx.mxfp8_quantize(y.unsqueeze(0), True)
        b = mx.mxfp8_quantize(y.view(-1, 2, K))
        return (*a, *b, y.sum(-1))

    args = (data(10, K, seed=3), gemma_weight())
    before, after, report = rewritten(fn, *args)
    # two layouts: the row-major quant fuses (it comes first), the swizzled one reads the emitted y
    assert report.matched_strings() == {"hf:plain->mxfuse_quant:swizzled+y": 1}, report.matched_strings()
    assert op_counts(after.graph)[QUANT] == 1
    with torch.no_grad():
        out, ref = after(*args), before(*args)
        assert out[3].shape == (5, 2, K // 32) and out[0].shape == (1, 10, K)
        assert_within_foreign_bound(out[:2], ref[:2], swizzled=True)
        assert_within_foreign_bound(out[2:4], ref[2:4])
        assert_within_foreign_bound([out[4]], [ref[4]])


def test_frozen_multiplier_constant_fuses_with_offset_zero():
    """Freezing folds `1 + w.float()` into one fp32 constant (a get_attr): that is the multiplier."""
    multiplier = 1.0 + gemma_weight().float()

    def fn(h):
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return mx.mxfp8_quantize((x * multiplier).type_as(h))

    args = (data(6, K, seed=4),)
    before, after, report = rewritten(fn, *args)
    assert any(n.op == "get_attr" for n in before.graph.nodes)
    assert report.matched_strings() == {"hf:plain->mxfuse_quant:rowmajor": 1}
    assert "weight_offset = 0.0" in after.code
    with torch.no_grad():
        assert_bitwise(after(*args), before(*args))


def test_one_plus_w_rounded_in_the_model_dtype_is_the_weight_itself():
    """`x.float() * (1 + w)` with bf16 `1 + w`: the multiply promotes the rounded sum; offset 0.0."""

    def fn(h, w):
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (*mx.mxfp8_quantize((x * (1.0 + w)).type_as(h)), *mx.mxfp8_quantize((x * (1.0 + w).float()).type_as(h)))

    args = (data(6, K, seed=11), gemma_weight())
    before, after, report = rewritten(fn, *args)
    assert report.matched_strings() == {"hf:plain->mxfuse_quant:rowmajor": 2}
    assert after.code.count("weight_offset = 0.0") == 2
    with torch.no_grad():
        assert_bitwise(after(*args), before(*args))


def test_runtime_eps_tensor_is_an_operand_of_the_fused_op():
    """dynamic=True makes eps a 0-d float64 graph input (tensorified Python float)."""

    def fn(h, residual, w, eps):
        s = residual + h
        return (*mx.mxfp8_quantize(spelled_norm(s, w, eps)), s)

    args = (data(7, K, seed=5), data(7, K, seed=6), gemma_weight(), torch.tensor(1e-5, dtype=torch.float64))
    before, after, report = rewritten(fn, *args)
    assert report.matched_strings() == {"hf:fused_add->mxfuse_quant:rowmajor": 1}
    assert "eps_tensor = eps" in after.code.replace("eps_1", "eps")
    with torch.no_grad():
        assert_bitwise(after(*args), before(*args))
        bigger = (*args[:3], torch.tensor(0.5, dtype=torch.float64))  # read at run time, not baked in
        assert_bitwise(after(*bigger), before(*bigger))


# ------------------------------------------------------------------ left alone, with the difference named


def llama_fp32(h, w, eps):
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()).type_as(h)


def llama_promoted(h, w, eps):
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w).type_as(h)  # bf16 w promoted


def two_plus_w(h, w, eps):
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (2.0 + w.float())).type_as(h)


def fp32_sum_read_twice(h, w, eps):
    s = h.float() + h.flip(0).float()
    y = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(h.dtype)
    return y, s.sum(-1)  # the fp32 sum has a reader in fp32


@pytest.mark.parametrize("norm", [llama_fp32, llama_promoted], ids=lambda f: f.__name__)
def test_a_multiplier_of_w_alone_is_the_standard_norm_and_fuses_bitwise(norm):
    """`* w.float()` or a bf16 `w` promoted: the standard RMSNorm, one rounding (the look-alikes of issue 14
    are the fused form of issue 24)."""

    def fn(h, w):
        return mx.mxfp8_quantize(norm(h, w, 1e-6))

    args = (data(4, K, seed=8), gemma_weight())
    before, after, report = rewritten(fn, *args)
    (fused,) = after.graph.find_nodes(op="call_function", target=mx.rms_norm_mxfp8.default)
    assert fused.kwargs["round_normalized"] is False
    assert report.matched_strings() == {"hf:rms_norm->mxfuse_quant:rowmajor": 1}
    with torch.no_grad():
        assert_bitwise(after(*args), before(*args))


LOOK_ALIKES = [
    (two_plus_w, SharedCode.NORM_ARITHMETIC, "`2 + w`"),
    (fp32_sum_read_twice, SharedCode.NORM_ARITHMETIC, "also read in fp32"),
]


@pytest.mark.parametrize(("norm", "code", "words"), LOOK_ALIKES, ids=[f[0].__name__ for f in LOOK_ALIKES])
def test_look_alikes_are_left_alone_with_the_difference_named(norm, code, words, caplog):
    def fn(h, w):
        y, *extra = out if isinstance(out := norm(h, w, 1e-6), tuple) else (out,)
        return (*mx.mxfp8_quantize(y), *extra)

    args = (data(4, K, seed=8), gemma_weight())
    with caplog.at_level(logging.WARNING, logger="mxfuse"):
        before, after, report = rewritten(fn, *args)
    assert not report.matched and after.code == before.code
    (skip,) = [s for s in report.skipped if s.rewrite == "norm_quant"]
    assert skip.code is code and words in skip.reason
    # the one warning of this graph names the reason and the fix (its source line: the compiled tests)
    (record,) = [r for r in caplog.records if r.name == "mxfuse" and r.levelno == logging.WARNING]
    assert words in record.getMessage() and "[hf:" in record.getMessage()
    assert "fix: compute" in record.getMessage()


def test_eps_tensor_of_shape_one_is_not_a_scalar():
    def fn(h, w, eps):
        return mx.mxfp8_quantize(spelled_norm(h, w, eps))

    _, _, report = rewritten(fn, data(4, K), gemma_weight(), torch.tensor([1e-6]))
    (skip,) = report.skipped
    assert skip.code is SharedCode.EPS_NOT_CONSTANT and "shape (1,)" in skip.reason


def test_quant_through_a_view_that_splits_rows_is_named():
    def fn(h, w):
        return mx.mxfp8_quantize(spelled_norm(h, w, 1e-6).transpose(0, 1).contiguous())

    _, after, report = rewritten(fn, data(32, K), gemma_weight())
    (skip,) = report.skipped
    assert skip.code is ProducerQuantCode.VIEW_NOT_ROWS and "aten.permute" in skip.reason
    assert op_counts(after.graph)[FUSED_PLAIN] == 0


def test_mxfuse_fused_add_with_a_flattening_quant_fuses_bitwise():
    def fn(x, residual, w):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, w, 1e-6)
        return (*mx.mxfp8_quantize(y.reshape(-1, K)), res)

    args = (data(2, 3, K, seed=9), data(2, 3, K, seed=10), gemma_weight())
    before, after, _ = rewritten(fn, *args)
    assert op_counts(after.graph)[FUSED_ADD] == 1 and op_counts(after.graph)[QUANT] == 0
    with torch.no_grad():
        assert_bitwise(after(*args), before(*args))


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_a_negative_or_nan_eps_is_refused_at_planning_with_its_code(eps):
    def fn(h, w):
        return mx.mxfp8_quantize(spelled_norm(h, w, eps))

    before, after, report = rewritten(fn, data(4, K), gemma_weight())
    (skip,) = report.skipped
    assert skip.code is SharedCode.EPS_INVALID and not report.failed, skip
    assert skip.reason == f"eps={eps} is not a valid norm epsilon; left unfused"
    assert not report.matched and after.code == before.code


def test_a_grouped_one_plus_w_norm_is_left_alone_with_its_code_and_warned(caplog):
    """A norm per 128 of 512 channels (as transformers' Qwen4-Exp `hc_norm`) feeding an MXFP8 quant."""

    def fn(h, w):
        x = h.float().view(*h.shape[:-1], 4, 128)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return mx.mxfp8_quantize((x.view(h.shape) * (1.0 + w.float())).type_as(h))

    with caplog.at_level(logging.WARNING, logger="mxfuse"):
        before, after, report = rewritten(fn, data(4, 512), (0.1 * data(512, seed=3)))
    (skip,) = report.skipped
    assert skip.code is SharedCode.NORM_GROUPED and skip.producer_kind == "hf:plain", skip
    assert "groups of 128 of its 512 channels" in skip.reason
    assert not report.matched and after.code == before.code
    (record,) = [r for r in caplog.records if r.name == "mxfuse" and r.levelno == logging.WARNING]
    assert "grouped norm" in record.getMessage()


# ================================================================== the sources' arithmetic

SOURCE_K = 256
EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16]
SOURCE_K = 256
EPS = 1e-6


def source_rows(m: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """special_rows (zeros, smallest normal, huge, NaN, +-Inf, tiny) plus a row in fp16's subnormal range."""
    x = special_rows(m, SOURCE_K, dtype, seed)
    x[8] = (torch.randn(SOURCE_K, generator=torch.Generator().manual_seed(seed)) * 2.0**-20).to(dtype)
    return x


def source_weight(dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(SOURCE_K, generator=torch.Generator().manual_seed(9)).to(dtype)
    w[:8], w[8:16] = -0.0, 2.0**-10  # -0 weights (the sign of y's zeros) and a small block
    return w


def quant_then(y: torch.Tensor, *rest: torch.Tensor, swizzled: bool = False):
    return (*mx.mxfp8_quantize(y, swizzled), *rest, y)


def hf_norm_classes(family: str = "standard"):
    pytest.importorskip("transformers")
    if family == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

        return [GemmaRMSNorm, Gemma3RMSNorm]
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm
    from transformers.models.glm4.modeling_glm4 import Glm4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    return [LlamaRMSNorm, Qwen3RMSNorm, Qwen3MoeRMSNorm, MistralRMSNorm, DeepseekV2RMSNorm, Glm4RMSNorm]


def hf_module(cls, dtype):
    module = cls(SOURCE_K, eps=EPS).to(dtype)
    module.weight.data.copy_(source_weight(dtype))
    return module


# ----------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_hugging_face_norms_equal_the_family_op(family, dtype):
    """Standard: `weight * normalize(x).to(dtype)`: `rms_norm(round_normalized=True)`, bitwise; the default
    differs. Gemma: `(normalize(x.float()) * (1 + w.float())).type_as(x)`: `gemma_rmsnorm`, one rounding."""
    x = source_rows(24, dtype).view(2, 12, SOURCE_K)
    for cls in hf_norm_classes(family):
        module = hf_module(cls, dtype)
        with torch.no_grad():
            y = module(x)
        assert y.dtype == dtype
        if family == "gemma":
            assert_bitwise(mx.gemma_rmsnorm(x, module.weight, EPS), y)
            assert_bitwise(mx.gemma_rmsnorm_mxfp8(x, module.weight, EPS, True, True), quant_then(y, swizzled=True))
            continue
        assert_bitwise(mx.rms_norm(x, module.weight, EPS, True), y)
        fused = mx.gemma_rmsnorm_mxfp8(x, module.weight, EPS, True, True, 0.0, round_normalized=True)
        assert_bitwise(fused, quant_then(y, swizzled=True))
        assert not torch.equal(mx.rms_norm(x, module.weight, EPS), y), cls.__name__  # the rounding matters


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_hugging_face_decoder_add_then_norm_is_round_sum_round_normalized(dtype, swizzled):
    """A decoder layer adds `residual + hidden` in the model dtype, then norms: `round_sum=True`."""
    x, residual = source_rows(40, dtype), source_rows(40, dtype, seed=3).roll(5, 0)
    module = hf_module(hf_norm_classes()[0], dtype)
    with torch.no_grad():
        h = residual + x
        y = module(h)
    fused = mx.gemma_fused_add_rmsnorm_mxfp8(
        x, residual, module.weight, EPS, swizzled, True, True, 0.0, round_normalized=True
    )
    assert_bitwise(fused, quant_then(y, h, swizzled=swizzled))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hugging_face_norm_compiled_by_inductor_is_within_the_foreign_bound(dtype):
    """Inductor reorders the mean's sum: within the bound, not bitwise (as for foreign Gemma norms)."""
    x = (torch.randn(64, SOURCE_K, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    module = hf_module(hf_norm_classes()[0], dtype)
    with torch.no_grad():
        y = torch.compile(module, fullgraph=True)(x)
    fused = mx.gemma_rmsnorm_mxfp8(x, module.weight, EPS, False, True, 0.0, round_normalized=True)
    assert_within_foreign_bound(fused, quant_then(y), swizzled=False)


# ------------------------------------------------------------------------ vLLM


@pytest.fixture(scope="module")
def vllm_config():
    pytest.importorskip("vllm")
    import vllm.ir.ops  # noqa: F401  (vllm_ir.rms_norm / fused_add_rms_norm)
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_ir_norms_with_a_model_dtype_weight_are_round_normalized(vllm_config, dtype):
    """`vllm_ir.rms_norm` (native): `x.to(w.dtype) * w`: `round_normalized=True`; the fused-add
    form normalizes the fp32 sum (`round_sum=False`) and returns its rounding as the residual."""
    x, residual, w = source_rows(33, dtype), source_rows(33, dtype, seed=2), source_weight(dtype)
    y = torch.ops.vllm_ir.rms_norm(x, w, EPS)
    assert_bitwise(mx.rms_norm(x, w, EPS, True), y)
    assert_bitwise(mx.gemma_rmsnorm_mxfp8(x, w, EPS, False, True, 0.0, round_normalized=True), quant_then(y))
    y, residual_out = torch.ops.vllm_ir.fused_add_rms_norm(x, residual, w, EPS)
    assert_bitwise(mx.fused_add_rms_norm(x, residual, w, EPS, True), (y, residual_out))
    fused = mx.gemma_fused_add_rmsnorm_mxfp8(x, residual, w, EPS, True, True, weight_offset=0.0, round_normalized=True)
    assert_bitwise(fused, quant_then(y, residual_out, swizzled=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_ir_norm_with_an_fp32_weight_rounds_once(vllm_config, dtype):
    """With an fp32 weight (vLLM's Gemma layer passes `w.float() + 1`) `x.to(fp32)` rounds nothing."""
    x, w = source_rows(17, dtype), source_weight(torch.float32)
    assert_bitwise(mx.rms_norm(x, w, EPS), torch.ops.vllm_ir.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_rms_norm_layer_on_cpu(vllm_config, dtype):
    """vLLM's `RMSNorm` layer (its CustomOp dispatch on CPU: `forward_native`, the IR ops)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer = RMSNorm(SOURCE_K, eps=EPS, dtype=dtype)
    layer.weight.data.copy_(source_weight(dtype))
    x, residual = source_rows(20, dtype), source_rows(20, dtype, seed=6)
    assert_bitwise(layer(x), mx.rms_norm(x, layer.weight.data, EPS, True))
    expected = mx.fused_add_rms_norm(x, residual, layer.weight.data, EPS, True)
    assert_bitwise(layer(x.clone(), residual.clone()), expected)  # clones: the IR op may work in place


# ----------------------------------------------------------------------- torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_rms_norm_eager_is_fp32_throughout(dtype):
    """`F.rms_norm` / `nn.RMSNorm` on CPU: the weight multiply in fp32, one rounding (the default form)."""
    x, w = source_rows(30, dtype), source_weight(dtype)
    y = F.rms_norm(x, (SOURCE_K,), w, EPS)
    assert_bitwise(mx.rms_norm(x, w, EPS), y)
    assert_bitwise(mx.gemma_rmsnorm_mxfp8(x, w, EPS, True, True, 0.0), quant_then(y, swizzled=True))
    assert not torch.equal(mx.rms_norm(x, w, EPS, True), y)
    module = torch.nn.RMSNorm(SOURCE_K, dtype=dtype)  # eps=None: torch.finfo(float32).eps
    module.weight.data.copy_(w)
    with torch.no_grad():
        assert_bitwise(mx.rms_norm(x, w, torch.finfo(torch.float32).eps), module(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_rms_norm_compiled_is_within_the_foreign_bound(dtype):
    """Inductor decomposes `rms_norm` (fp32 throughout) and reorders the sum: within the bound."""
    x = (torch.randn(64, SOURCE_K, generator=torch.Generator().manual_seed(8)) * 3).to(dtype)
    w = source_weight(dtype)
    y = torch.compile(lambda t: F.rms_norm(t, (SOURCE_K,), w, EPS), fullgraph=True)(x)
    assert_within_one_ulp(mx.rms_norm(x, w, EPS), y)
    assert_within_foreign_bound(mx.gemma_rmsnorm_mxfp8(x, w, EPS, False, True, 0.0), quant_then(y), swizzled=False)


# ----------------------------------------- CUDA kernels (FlashInfer, vLLM's _C)


def emulated_cuda_norm(x, residual, w, round_sum: bool):
    """The arithmetic of FlashInfer's norm kernels (`norm.cuh:63-127, 416-496`, fp32 sum of x + residual)
    and vLLM's `_C` kernels (`layernorm_kernels.cu`, the sum rounded to dtype first: `round_sum`),
    in plain PyTorch: per-thread strided partial sums of squares added as a tree (not torch's
    order), `sum / SOURCE_K`, an rsqrt two fp32 ulps off (as `rsqrt.approx` / `rsqrtf` may be), one rounding."""
    s = x.float() if residual is None else x.float() + residual.float()
    residual_out = None if residual is None else s.to(x.dtype)
    if round_sum and residual is not None:
        s = residual_out.float()
    partial = (s * s).view(s.shape[0], -1, 32).sum(dim=1)  # 32 "threads", each striding over the row
    while partial.shape[1] > 1:
        partial = partial[:, 0::2] + partial[:, 1::2]
    rstd = torch.rsqrt(partial / SOURCE_K + EPS) * (1 + 2.0**-22)
    y = (s * rstd * w.float()).to(x.dtype)
    return y if residual is None else (y, residual_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("round_sum", [False, True], ids=["flashinfer", "vllm_c"])
def test_cuda_kernel_arithmetic_is_within_the_foreign_bound(dtype, round_sum):
    """The bound claimed for the kernels that cannot run here, against an emulation of their order
    of operations (the one stub of this module: the kernels themselves need CUDA)."""
    g = torch.Generator().manual_seed(11)
    x, residual = ((torch.randn(256, SOURCE_K, generator=g) * 3).to(dtype) for _ in range(2))
    w = source_weight(dtype)
    y = emulated_cuda_norm(x, None, w, round_sum)
    assert_within_foreign_bound(mx.gemma_rmsnorm_mxfp8(x, w, EPS, False, True, 0.0), quant_then(y), swizzled=False)
    y, residual_out = emulated_cuda_norm(x, residual, w, round_sum)
    fused = mx.gemma_fused_add_rmsnorm_mxfp8(x, residual, w, EPS, False, True, round_sum, 0.0)
    assert_within_foreign_bound(fused, quant_then(y, residual_out), swizzled=False)
    assert_bitwise(fused[2], residual_out)
