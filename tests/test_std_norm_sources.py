"""The standard RMSNorm of each real source against mxfuse's ops, on CPU (docs/design.md,
"The standard RMSNorm, source by source").

Each source runs as its users run it: Hugging Face's norm modules eager, vLLM's `RMSNorm`
layer and its IR ops (their `native` implementation, what vLLM lowers them to when it
compiles with Inductor), `torch.nn.functional.rms_norm` eager and compiled. Bitwise where
the contract says so; the foreign bound (tests/foreign_bound.py) where Inductor's
reduction order is not ours. One stub: the CUDA kernels of FlashInfer and vLLM's `_C`
(they need a GPU and vLLM's extension) are emulated in plain PyTorch
(`emulated_cuda_norm`) to test the bound claimed for them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from foreign_bound import assert_within_foreign_bound, assert_within_one_ulp
from test_ops import special_rows

import mxfuse  # noqa: F401
from mxfuse.testing import assert_bitwise

mx = torch.ops.mxfuse
DTYPES = [torch.bfloat16, torch.float16]
K = 256
EPS = 1e-6


def rows(m: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """special_rows (zeros, smallest normal, huge, NaN, +-Inf, tiny) plus a row in fp16's subnormal range."""
    x = special_rows(m, K, dtype, seed)
    x[8] = (torch.randn(K, generator=torch.Generator().manual_seed(seed)) * 2.0**-20).to(dtype)
    return x


def weight(dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(K, generator=torch.Generator().manual_seed(9)).to(dtype)
    w[:8], w[8:16] = -0.0, 2.0**-10  # -0 weights (the sign of y's zeros) and a small block
    return w


def quant_then(y: torch.Tensor, *rest: torch.Tensor, swizzled: bool = False):
    return (*mx.mxfp8_quantize(y, swizzled), *rest, y)


def hf_norm_classes():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm
    from transformers.models.glm4.modeling_glm4 import Glm4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    return [LlamaRMSNorm, Qwen3RMSNorm, Qwen3MoeRMSNorm, MistralRMSNorm, DeepseekV2RMSNorm, Glm4RMSNorm]


def hf_module(cls, dtype):
    module = cls(K, eps=EPS).to(dtype)
    module.weight.data.copy_(weight(dtype))
    return module


# ----------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("dtype", DTYPES)
def test_hugging_face_norms_are_rms_norm_round_normalized(dtype):
    """`weight * normalize(x).to(dtype)`: `round_normalized=True`, bitwise; the default differs."""
    x = rows(24, dtype).view(2, 12, K)
    for cls in hf_norm_classes():
        module = hf_module(cls, dtype)
        with torch.no_grad():
            y = module(x)
        assert y.dtype == dtype
        assert_bitwise(mx.rms_norm(x, module.weight, EPS, True), y)
        fused = mx.gemma_rmsnorm_mxfp8(x, module.weight, EPS, True, True, 0.0, round_normalized=True)
        assert_bitwise(fused, quant_then(y, swizzled=True))
        assert not torch.equal(mx.rms_norm(x, module.weight, EPS), y), cls.__name__  # the rounding matters


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_hugging_face_decoder_add_then_norm_is_round_sum_round_normalized(dtype, swizzled):
    """A decoder layer adds `residual + hidden` in the model dtype, then norms: `round_sum=True`."""
    x, residual = rows(40, dtype), rows(40, dtype, seed=3).roll(5, 0)
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
    x = (torch.randn(64, K, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
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
    x, residual, w = rows(33, dtype), rows(33, dtype, seed=2), weight(dtype)
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
    x, w = rows(17, dtype), weight(torch.float32)
    assert_bitwise(mx.rms_norm(x, w, EPS), torch.ops.vllm_ir.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_rms_norm_layer_on_cpu(vllm_config, dtype):
    """vLLM's `RMSNorm` layer (its CustomOp dispatch on CPU: `forward_native`, the IR ops)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer = RMSNorm(K, eps=EPS, dtype=dtype)
    layer.weight.data.copy_(weight(dtype))
    x, residual = rows(20, dtype), rows(20, dtype, seed=6)
    assert_bitwise(layer(x), mx.rms_norm(x, layer.weight.data, EPS, True))
    expected = mx.fused_add_rms_norm(x, residual, layer.weight.data, EPS, True)
    assert_bitwise(layer(x.clone(), residual.clone()), expected)  # clones: the IR op may work in place


# ----------------------------------------------------------------------- torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_rms_norm_eager_is_fp32_throughout(dtype):
    """`F.rms_norm` / `nn.RMSNorm` on CPU: the weight multiply in fp32, one rounding (the default form)."""
    x, w = rows(30, dtype), weight(dtype)
    y = F.rms_norm(x, (K,), w, EPS)
    assert_bitwise(mx.rms_norm(x, w, EPS), y)
    assert_bitwise(mx.gemma_rmsnorm_mxfp8(x, w, EPS, True, True, 0.0), quant_then(y, swizzled=True))
    assert not torch.equal(mx.rms_norm(x, w, EPS, True), y)
    module = torch.nn.RMSNorm(K, dtype=dtype)  # eps=None: torch.finfo(float32).eps
    module.weight.data.copy_(w)
    with torch.no_grad():
        assert_bitwise(mx.rms_norm(x, w, torch.finfo(torch.float32).eps), module(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_rms_norm_compiled_is_within_the_foreign_bound(dtype):
    """Inductor decomposes `rms_norm` (fp32 throughout) and reorders the sum: within the bound."""
    x = (torch.randn(64, K, generator=torch.Generator().manual_seed(8)) * 3).to(dtype)
    w = weight(dtype)
    y = torch.compile(lambda t: F.rms_norm(t, (K,), w, EPS), fullgraph=True)(x)
    assert_within_one_ulp(mx.rms_norm(x, w, EPS), y)
    assert_within_foreign_bound(mx.gemma_rmsnorm_mxfp8(x, w, EPS, False, True, 0.0), quant_then(y), swizzled=False)


# ----------------------------------------- CUDA kernels (FlashInfer, vLLM's _C)


def emulated_cuda_norm(x, residual, w, round_sum: bool):
    """The arithmetic of FlashInfer's norm kernels (`norm.cuh:63-127, 416-496`, fp32 sum of x + residual)
    and vLLM's `_C` kernels (`layernorm_kernels.cu`, the sum rounded to dtype first: `round_sum`),
    in plain PyTorch: per-thread strided partial sums of squares added as a tree (not torch's
    order), `sum / K`, an rsqrt two fp32 ulps off (as `rsqrt.approx` / `rsqrtf` may be), one rounding."""
    s = x.float() if residual is None else x.float() + residual.float()
    residual_out = None if residual is None else s.to(x.dtype)
    if round_sum and residual is not None:
        s = residual_out.float()
    partial = (s * s).view(s.shape[0], -1, 32).sum(dim=1)  # 32 "threads", each striding over the row
    while partial.shape[1] > 1:
        partial = partial[:, 0::2] + partial[:, 1::2]
    rstd = torch.rsqrt(partial / K + EPS) * (1 + 2.0**-22)
    y = (s * rstd * w.float()).to(x.dtype)
    return y if residual is None else (y, residual_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("round_sum", [False, True], ids=["flashinfer", "vllm_c"])
def test_cuda_kernel_arithmetic_is_within_the_foreign_bound(dtype, round_sum):
    """The bound claimed for the kernels that cannot run here, against an emulation of their order
    of operations (the one stub of this module: the kernels themselves need CUDA)."""
    g = torch.Generator().manual_seed(11)
    x, residual = ((torch.randn(256, K, generator=g) * 3).to(dtype) for _ in range(2))
    w = weight(dtype)
    y = emulated_cuda_norm(x, None, w, round_sum)
    assert_within_foreign_bound(mx.gemma_rmsnorm_mxfp8(x, w, EPS, False, True, 0.0), quant_then(y), swizzled=False)
    y, residual_out = emulated_cuda_norm(x, residual, w, round_sum)
    fused = mx.gemma_fused_add_rmsnorm_mxfp8(x, residual, w, EPS, False, True, round_sum, 0.0)
    assert_within_foreign_bound(fused, quant_then(y, residual_out), swizzled=False)
    assert_bitwise(fused[2], residual_out)
