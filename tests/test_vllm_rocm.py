"""vLLM's ROCm MXFP8 linear (MI355X, gfx950) through vLLM's own compile pipeline on CPU.

On ROCm, vLLM 0.33 serves MXFP8 linears with `RocmDotScaledMxfp8LinearKernel`
(`model_executor/kernels/linear/mxfp8/rocm_native.py`): `apply_weights` quantizes the
activation with `mxfp8_e4m3_quantize(x2d)` (`vllm.mxfp8_quantize`, row-major `[M, K/32]` scales)
and launches a Triton `tl.dot_scaled` GEMM from Python. Both checkpoint formats vLLM reads for it
are built: ModelOpt MXFP8 (`quant_method: "mxfp8"`) and Quark OCP-MX MXFP8 (`quant_method:
"quark"`, fp8_e4m3 weights and dynamic activations per group of 32 with E8M0 scales, scheme
`QuarkOCP_MX`). The models are test_vllm_models.py's Gemma-norm cases; the method, the detector and
the shared stubs are tests/vllm_pipeline.py's.

Replaced beyond tests/vllm_pipeline.py's list:
- `RocmDotScaledMxfp8LinearKernel.is_supported` says yes (it checks ROCm and gfx95x); the kernel's
  `process_weights_after_loading` and `apply_weights` run unchanged.
- The Triton GEMM launch `rocm_native._mxfp8_linear_kernel[grid](...)`: without a GPU driver
  vLLM's `triton.jit` is a placeholder, so the launch is `DotScaledLaunch`, which writes the
  output of a traced-only op `vllm_pipeline.dot_scaled_mxfp8_gemm(x_q, x_scale, w, w_scale)`
  (`[M, N]`, fake impl only) into the launcher's `out`.

Every activation quant of a layer on ROCm (`test_every_activation_quant_of_a_layer_fuses_on_rocm`):
the act·mul before down_proj (Llama's SiLU, Gemma 3's GELU-tanh) and Qwen3-Next's gate and gated
RMSNorm fuse with the ROCm kernel's row-major quant as they do with the Blackwell linear's swizzled
one; counted with the independent detectors of test_vllm_act_mul.py and test_gated_vllm.py.

A weight whose K is not a multiple of 128 (`dot_scaled` tiles K by 128) is dequantized to bf16 at
load and served by `F.linear` (`rocm_native.py:291-292, 316-317`): no activation quant, so a norm
in front of it is no site and not a miss (`test_k_not_multiple_of_128_has_no_activation_quant`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import vllm_pipeline
from graph_helpers import call_arguments
from test_gated_vllm import classified, fused_gated
from test_vllm_act_mul import CASES as ACT_MUL_CASES, reads
from test_vllm_models import CASES
from vllm_pipeline import Case, DotScaledLaunch, compile_model, modelopt_mxfp8, quant_nodes, tiny

pytestmark = pytest.mark.vllm
vllm_cpu = vllm_pipeline.vllm_cpu  # the module fixture: vLLM stood up on CPU
ROCM = "rocm_native.RocmDotScaledMxfp8LinearKernel"


def quark_ocp_mx_mxfp8(case: Case) -> dict:
    """A Quark OCP-MX MXFP8 export: fp8_e4m3 weights and dynamic activations, groups of 32, E8M0 scales."""
    group = {"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0"}
    return {
        "quant_method": "quark",
        "export": {"kv_cache_group": [], "pack_method": "reorder"},
        "global_quant_config": {
            "weight": {**group, "is_dynamic": False, "symmetric": True},
            "input_tensors": {**group, "is_dynamic": True, "symmetric": True},
            "output_tensors": None,
            "bias": None,
        },
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": ["lm_head", *case.unquantized],
    }


FORMATS = {"modelopt": modelopt_mxfp8, "quark": quark_ocp_mx_mxfp8}


def _rocm_launch():
    from unittest import mock

    from vllm.model_executor.kernels.linear.mxfp8 import rocm_native

    return mock.patch.object(rocm_native, "_mxfp8_linear_kernel", DotScaledLaunch())


def _per_row_scales():
    """Weight scales that differ from row to row, as a real per-row MXFP8 export's do.

    vLLM's dummy loader fills E8M0 scales with one byte (`weight_utils.py:1655-1658`), which the ROCm
    kernel takes for 32x32 blocks (`_as_block32_scale`) and serves with `vllm.rocm_mxfp8_block32_gemm`;
    MXFP8 checkpoints with one scale per row and 32 columns take the dot-scaled launch instead."""
    from unittest import mock

    from vllm.model_executor.kernels.linear.mxfp8.rocm_native import RocmDotScaledMxfp8LinearKernel

    prepare = RocmDotScaledMxfp8LinearKernel.process_weights_after_loading

    def with_per_row_scales(self, layer):
        rows = torch.arange(layer.weight_scale.shape[0], dtype=torch.uint8)
        layer.weight_scale.data.copy_((126 + rows % 3)[:, None].expand_as(layer.weight_scale))
        prepare(self, layer)

    return mock.patch.object(RocmDotScaledMxfp8LinearKernel, "process_weights_after_loading", with_per_row_scales)


# The CuTe-DSL cases leave `in_proj_ba` unquantized (N = 2 * value heads < 128: Marlin on Blackwell);
# the dot-scaled kernel takes any N (`can_implement` is always true), so on ROCm the gated-delta-net
# layer's input_layernorm feeds two quants: in_proj_qkvz and in_proj_ba.
IN_PROJ_BA_SITE = {"qwen3_next": 1, "qwen3_5": 1}


def rocm_case(case: Case, checkpoint: str) -> Case:
    extra = IN_PROJ_BA_SITE.get(case.name, 0)
    return dataclasses.replace(
        case,
        name=f"{case.name}_{checkpoint}",
        kernel=ROCM,
        unquantized=(),
        sites=case.sites + extra,
        why_sites=case.why_sites + (" + input_layernorm -> in_proj_ba (quantized on ROCm)" if extra else ""),
    )


# ModelOpt on every Gemma-norm model; Quark (a checkpoint format: the same kernel and activation quant, read
# through another scheme class) on two: Gemma 3 (a fused-add input norm whose residual comes from the
# previous piece) and Qwen3-Next (a gated delta net, an MoE layer, and `in_proj_ba` quantized on ROCm).
QUARK_CASES = ("gemma3", "qwen3_next")
ROCM_CASES = [
    *(pytest.param(case, "modelopt", id=f"{case.name}-modelopt") for case in CASES),
    *(pytest.param(case, "quark", id=f"{case.name}-quark") for case in CASES if case.name in QUARK_CASES),
]


@pytest.mark.parametrize(("case", "checkpoint"), ROCM_CASES)
def test_every_gemma_norm_quant_site_fuses_with_rocm_dot_scaled(vllm_cpu, case, checkpoint):
    case = rocm_case(case, checkpoint)
    record = compile_model(
        vllm_cpu, case, quantization_config=FORMATS[checkpoint], patches=[_rocm_launch(), _per_row_scales()]
    )
    described = [s.describe() for s in record.sites]
    assert record.graphs >= 2, record
    assert all(s.gemma for s in record.sites), described
    assert len(record.sites) == case.sites, (case.why_sites, described)
    # vLLM's ROCm kernel asks for row-major scales: `vllm.mxfp8_quantize(x2d)` with the default False
    assert all(s.quant_args in ((), (False,)) for s in record.sites), described
    assert record.fused == len(record.sites), (described, record.matched, record.skipped)
    assert record.left == 0, described
    assert [a["swizzled"] for a in record.fused_args] == [False] * record.fused, record.fused_args
    if checkpoint == "quark":
        assert record.schemes["QuarkOCP_MX"] > 0, record.schemes


def _fused_producers(graphs, name: str) -> list:
    return [n for g in graphs for n in g.nodes if n.op == "call_function" and name in str(n.target)]


ACT_MUL_ON_ROCM = [c for c in ACT_MUL_CASES if c.name in ("llama", "gemma3")]


@pytest.mark.parametrize("case", ACT_MUL_ON_ROCM, ids=lambda c: c.name)
def test_every_activation_quant_of_a_layer_fuses_on_rocm(vllm_cpu, case):
    """A dense layer on the ROCm kernel (ModelOpt MXFP8): the norms' and the act·mul's quants fuse,
    row-major; only o_proj's quant is left (the raw output of the opaque attention op)."""
    case = dataclasses.replace(case, name=f"{case.name}_rocm", kernel=ROCM)
    record = compile_model(vllm_cpu, case, patches=[_rocm_launch(), _per_row_scales()])
    left = [reads(q) for g in record.after for q in quant_nodes(g)]
    assert left == ["attention output"], left
    (act_mul,) = _fused_producers(record.after, "act_mul")
    assert act_mul.kwargs["swizzled"] is False, act_mul  # the ROCm kernel's `vllm.mxfp8_quantize(x2d)`
    assert [a["swizzled"] for a in record.fused_args] == [False] * record.fused, record.fused_args


def test_gated_outputs_fuse_on_rocm_with_a_quark_checkpoint(vllm_cpu):
    """Qwen3-Next (a GDN layer with a dense MLP, an attention layer with a MoE MLP) from a Quark OCP-MX
    export: the gate before o_proj and the gated RMSNorm before out_proj fuse too, no standalone quant
    is left in its layers (in_proj_ba, quantized on ROCm, reads the input norm's fused codes)."""
    (qwen3_next,) = (c for c in CASES if c.name == "qwen3_next")
    case = dataclasses.replace(rocm_case(qwen3_next, "quark"), name="qwen3_next_quark_gated")  # its own model dir
    record = compile_model(
        vllm_cpu, case, quantization_config=FORMATS["quark"], patches=[_rocm_launch(), _per_row_scales()]
    )
    before, after = classified(record.before), classified(record.after)
    table = f"quants before {dict(before)}, standalone after {dict(after)}"
    assert before["gate"] == 1 and before["gated_norm"] == 1 and before["act_mul"] == 1, table
    assert not after, table
    assert fused_gated(record.after) == {"gate": 1, "gated_norm": 1}, table
    fused = _fused_producers(record.after, "sigmoid_gate") + _fused_producers(record.after, "gated_rms_norm")
    assert [call_arguments(n)["swizzled"] for n in fused] == [False, False], fused
    assert record.schemes["QuarkOCP_MX"] > 0, record.schemes


def test_block_scaled_weights_take_the_block32_gemm_and_fuse(vllm_cpu):
    """Scales shared by every 32 rows (DeepSeek-V4-style exports; also what vLLM's dummy loader writes)
    are served by `vllm.rocm_mxfp8_block32_gemm`; its activation quant is the same row-major one."""
    case = dataclasses.replace(CASES[0], name="gemma_block32", kernel=ROCM)
    record = compile_model(vllm_cpu, case, patches=[_rocm_launch()])
    described = [s.describe() for s in record.sites]
    assert len(record.sites) == case.sites, described
    assert record.fused == len(record.sites), (described, record.matched, record.skipped)
    assert record.left == 0, described
    assert [a["swizzled"] for a in record.fused_args] == [False] * record.fused


K_160 = Case(
    "gemma_k160",
    ("gemma",),
    # K = 160 for qkv_proj and gate_up_proj (160 % 128 != 0); o_proj and down_proj keep K = 128
    tiny("GemmaForCausalLM", "gemma", hidden_size=160, num_hidden_layers=1),
    0,
    "qkv_proj and gate_up_proj (K = 160) are dequantized to bf16 at load: their norms feed F.linear, no quant",
    kernel=ROCM,
)


def test_k_not_multiple_of_128_has_no_activation_quant(vllm_cpu):
    record = compile_model(vllm_cpu, K_160, patches=[_rocm_launch(), _per_row_scales()])
    dequantized = {n for n, dtype in record.weight_dtypes.items() if dtype == torch.bfloat16}
    assert dequantized == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"}
    assert record.sites == [], K_160.why_sites  # no quant reads a norm: nothing to fuse, and no miss
    assert record.quants == 2  # o_proj and down_proj (K = 128) still quantize their inputs
    assert {s.code.name for s in record.skipped} <= {"NO_QUANT"}, record.skipped  # mxfuse: nothing refused
