"""vLLM 0.33's own compile pipeline on CPU, on vLLM's own model classes, with mxfuse as its post-grad pass.

Each case builds a tiny model (one or two layers, random weights from vLLM's dummy loader) through
vLLM's model loader with the ModelOpt MXFP8 config (`quant_method: "mxfp8"`, the MiniMax-style
checkpoint tag), and compiles it in `CompilationMode.VLLM_COMPILE` with
`inductor_passes={"post_grad_custom_post_pass": "mxfuse.vllm_pass"}`: Dynamo, vLLM's piecewise
split at its attention ops, AOTAutograd, Inductor, vLLM's PostGradPassManager (its own passes,
then mxfuse). A recording wrapper around the resolved `mxfuse.vllm_pass` counts, in every
piecewise graph, the norm->quant sites BEFORE mxfuse runs and the fused sites AFTER, with a
detector of its own (below), not with mxfuse's recognizers.

Replaced in the fixture, because they cannot run without CUDA (nothing else is):
- The MXFP8 linear kernel choice: vLLM has no CPU MXFP8 linear kernel, so the Blackwell
  FlashInfer CuTe-DSL kernel (`FlashInferCutedslMxfp8LinearKernel`, the first choice on
  sm_100) is declared supported and is the only candidate. Its `process_weights_after_loading`
  and `apply_weights` run unchanged: `vllm.mxfp8_quantize(x.view(-1, K), True)` then
  `vllm.mm_mxfp8` (traced through its fake impl, never run).
- Attention: vLLM's `Attention` layer picks a backend at construction, which this CPU build
  cannot. A stub layer with the same constructor calls vLLM's own splitting op
  `vllm.unified_attention_with_output` with the same shapes, so the piecewise split is vLLM's.
- `FixFunctionalizationPass`, the last step of vLLM's PostGradPassManager, needs vLLM's CUDA
  extension (`torch.ops._C.rotary_embedding`); mxfuse has run before it. The stub ends the
  piece's Inductor compile there, and the piece is not run (no CPU MXFP8 GEMM either).
- Only in the TRT-LLM case: that kernel's `process_weights_after_loading` shuffles the weight and
  its scales with FlashInfer ops that need a CUDA device; a stub pads them to the same shapes
  (`[pad(N, 128), K]`, flat scales) unshuffled. Its `apply_weights` (the activation quant) runs as is.
- FlashInfer's availability probe: vLLM registers `vllm.mm_mxfp8` and
  `vllm.flashinfer_mxfp8_quantize_8x4` only where FlashInfer could build its kernels (nvcc or
  flashinfer-cubin); tests/vllm_flashinfer.py sets vLLM's own override so their schemas and fake
  impls exist (traced, never run).
- `current_platform.current_device`: None on vLLM's `UnspecifiedPlatform` (what vLLM's CUDA wheel
  detects without a GPU); Qwen's gated-delta-net layer asks it where to put its gated norm: CPU.

vLLM's Transformers backend keeps activations 3-D (`rms_norm(x [1, T, K]) -> reshape(y, [-1, K])
-> mxfp8_quantize`): the pass sees through the reshape and fuses. One case is expected not to fuse
(xfail, strict): vLLM's TRT-LLM MXFP8 linear (the 8x4 quant spelling, whose scale rule is not
mxfuse's; see NOT_RECOGNIZED_8X4). docs/applicability.md has the table these cases produce.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from torch import fx
from vllm_flashinfer import register_vllm_flashinfer_ops

from mxfuse.testing import free_port

pytestmark = pytest.mark.vllm

aten = torch.ops.aten
TOKENS = 16
HIDDEN = 128  # the CuTe-DSL MXFP8 kernel needs K >= 128 and N >= 128


# ---------------------------------------------------------------- the independent detector
# Ops that only reinterpret or copy values: a site may have any chain of them between norm and quant.
_VALUE_PRESERVING = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
    aten.clone.default,
    aten.alias.default,
}


def _quant_ops() -> dict:
    ops = {torch.ops.vllm.mxfp8_quantize.default: "vllm.mxfp8_quantize"}
    if hasattr(torch.ops.vllm, "flashinfer_mxfp8_quantize_8x4"):
        ops[torch.ops.vllm.flashinfer_mxfp8_quantize_8x4.default] = "vllm.flashinfer_mxfp8_quantize_8x4"
    return ops


def _norm_ops() -> dict:
    return {
        torch.ops.vllm_ir.rms_norm.default: "rms_norm",
        torch.ops.vllm_ir.fused_add_rms_norm.default: "fused_add_rms_norm",
    }


def _fused_ops() -> set:
    return {torch.ops.mxfuse.gemma_rmsnorm_mxfp8.default, torch.ops.mxfuse.gemma_fused_add_rmsnorm_mxfp8.default}


def _is_gemma_weight(node) -> bool:
    """vLLM's GemmaRMSNorm hands its IR norm `weight.float() + 1.0`."""
    if not (isinstance(node, fx.Node) and node.target in (aten.add.Tensor, aten.add.Scalar)):
        return False
    return any(isinstance(a, (int, float)) and a == 1 for a in node.args)


def _source(node) -> tuple[fx.Node, list[str]]:
    """Walk back through value-preserving ops (and a norm's tuple output); return the producer and the chain."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _VALUE_PRESERVING:
        chain.append(f"{node.target}{tuple(a if not isinstance(a, fx.Node) else a.name for a in node.args[1:])}")
        node = node.args[0]
    if isinstance(node, fx.Node) and node.target is operator.getitem:
        chain.append(f"getitem[{node.args[1]}]")
        node = node.args[0]
    return node, chain[::-1]


@dataclass
class Site:
    """One MXFP8 quant whose input is a vLLM IR RMSNorm output, seen before mxfuse ran."""

    norm: str  # rms_norm | fused_add_rms_norm
    gemma: bool  # the norm's weight is `w.float() + 1` (vLLM's GemmaRMSNorm); else a plain RMSNorm
    quant: str
    chain: list[str]  # the nodes between the norm and the quant, norm side first
    quant_args: tuple
    norm_shape: tuple  # the shape of the norm's output (symbolic sizes as strings)

    def describe(self) -> str:
        norm = f"{self.norm}({'gemma' if self.gemma else 'plain weight'}) -> {list(self.norm_shape)}"
        return f"{norm} -> {' -> '.join(self.chain) or '(direct)'} -> {self.quant}{self.quant_args}"


def norm_quant_sites(graph: fx.Graph) -> list[Site]:
    norms, quants = _norm_ops(), _quant_ops()
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in quants:
            continue
        producer, chain = _source(node.args[0])
        if isinstance(producer, fx.Node) and producer.target in norms:
            weight = (
                producer.args[2]
                if producer.target is torch.ops.vllm_ir.fused_add_rms_norm.default
                else producer.args[1]
            )
            args = tuple(node.args[1:]) + tuple(f"{k}={v}" for k, v in node.kwargs.items())
            val = producer.meta.get("val")
            shape = tuple(str(d) for d in (val[0] if isinstance(val, (tuple, list)) else val).shape)
            sites.append(
                Site(norms[producer.target], _is_gemma_weight(weight), quants[node.target], chain, args, shape)
            )
    return sites


def fused_sites(graph: fx.Graph) -> int:
    """mxfuse fused ops whose codes reach an MXFP8 GEMM (through getitem and value-preserving ops)."""
    fused, count = _fused_ops(), 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.vllm.mm_mxfp8.default:
            producer, _ = _source(node.args[0])
            count += isinstance(producer, fx.Node) and producer.target in fused
    return count


# ---------------------------------------------------------------- the vLLM stand-up
class _PiecesNotRun(Exception):
    """Raised when a compiled piece is called: its compile stopped at FixFunctionalization."""


class _StopAfterPostGradPasses(BaseException):
    """Ends a piece's Inductor compile where vLLM's FixFunctionalization would need its CUDA extension."""


@dataclass
class Record:
    sites: list[Site] = field(default_factory=list)
    fused: int = 0
    left: int = 0  # sites the detector still finds after mxfuse ran
    graphs: int = 0
    matched: Counter = field(default_factory=Counter)
    skipped: list = field(default_factory=list)


def _recorder(inner, record: Record):
    from vllm.compilation.passes.inductor_pass import InductorPass

    class RecordingPass(InductorPass):
        """Counts sites with the test's detector, runs the resolved mxfuse pass, counts fused sites."""

        def __call__(self, graph: fx.Graph) -> None:
            record.graphs += 1
            if os.environ.get("DBG"):
                print(graph)
            record.sites += norm_quant_sites(graph)
            inner(graph)
            record.fused += fused_sites(graph)
            record.left += len(norm_quant_sites(graph))
            report = inner.last_report
            record.matched.update({str(k): v for k, v in report.matched.items()})
            record.skipped += [str(s) for s in report.skipped]

        def uuid(self):
            return inner.uuid()

    return RecordingPass()


def _trtllm_weights_unshuffled(self, layer) -> None:
    """TRT-LLM's weight prep with its shapes, without FlashInfer's CUDA-only shuffles (values unused here)."""
    from vllm.model_executor.utils import replace_parameter

    n, k = layer.weight.shape
    padded_n = (n + 127) // 128 * 128
    weight = layer.weight.data.new_zeros(padded_n, k)
    weight[:n] = layer.weight.data
    scale = layer.weight_scale.data.new_zeros(padded_n, k // 32)
    scale[:n] = layer.weight_scale.data[:n, : k // 32]
    replace_parameter(layer, "weight", weight)
    replace_parameter(layer, "weight_scale", scale.reshape(-1))
    layer._mxfp8_trtllm_output_size = n


class _StubAttention(torch.nn.Module):
    """vLLM's `Attention` constructor, then vLLM's splitting op with the real shapes."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, *args, prefix="", **kwargs):
        super().__init__()
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads, self.layer_name = num_kv_heads or num_heads, prefix
        self.head_size_v = kwargs.get("head_size_v") or head_size

    def forward(self, query, key, value, output_shape=None, output_dtype=None):
        shape = output_shape or (query.shape[0], self.num_heads * self.head_size_v)
        output = torch.empty(shape, dtype=output_dtype or query.dtype, device=query.device)
        torch.ops.vllm.unified_attention_with_output(
            query.view(-1, self.num_heads, self.head_size),
            key.view(-1, self.num_kv_heads, self.head_size),
            value.view(-1, self.num_kv_heads, self.head_size_v),
            output.view(-1, self.num_heads, self.head_size_v),
            self.layer_name,
        )
        return output.view(-1, shape[-1])


@pytest.fixture(scope="module")
def vllm_cpu(tmp_path_factory):
    """vLLM stood up once on CPU: env, the three CUDA-only replacements, a 1-rank gloo TP group."""
    pytest.importorskip("vllm")
    from unittest import mock

    from vllm.compilation import backends
    from vllm.compilation.passes.utility.fix_functionalization import FixFunctionalizationPass
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    import mxfuse  # noqa: F401

    if not register_vllm_flashinfer_ops():
        pytest.skip("vLLM did not register vllm.mm_mxfp8 (tests/vllm_flashinfer.py)")

    original_compile = backends.CompilerManager.compile

    def compile_until_post_grad_done(self, *args, **kwargs):
        try:
            return original_compile(self, *args, **kwargs)
        except _StopAfterPostGradPasses:

            def not_run(*_):
                raise _PiecesNotRun

            return not_run

    def stop(self, graph):
        raise _StopAfterPostGradPasses

    with (
        mock.patch.dict(os.environ, {"VLLM_DISABLE_COMPILE_CACHE": "1", "HF_HUB_OFFLINE": "1"}),
        mock.patch.object(FixFunctionalizationPass, "__call__", stop),
        mock.patch.object(current_platform, "current_device", lambda: torch.device("cpu")),
        mock.patch.object(backends.CompilerManager, "compile", compile_until_post_grad_done),
    ):
        port = free_port()
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
            parallel_state.initialize_model_parallel(1)
        try:
            yield tmp_path_factory.mktemp("vllm_models")
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def compile_model(root, case: Case) -> Record:
    """Load `hf_config` through vLLM's loader (dummy weights), run one forward under VLLM_COMPILE."""
    import importlib
    from unittest import mock

    from vllm.config import (
        CompilationConfig,
        CompilationMode,
        CUDAGraphMode,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.kernels.linear.mxfp8 import flashinfer as flashinfer_kernels
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    import mxfuse

    kernel = getattr(flashinfer_kernels, case.kernel)

    model_dir = root / case.name
    model_dir.mkdir()
    quant = {"quant_method": "mxfp8", "ignored_layers": ["lm_head", *case.unquantized]}
    (model_dir / "config.json").write_text(
        json.dumps({**case.hf_config, "torch_dtype": "bfloat16", "quantization_config": quant})
    )
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, model_impl=case.model_impl
    )
    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        inductor_passes={"post_grad_custom_post_pass": "mxfuse.vllm_pass"},
        cudagraph_mode=CUDAGraphMode.NONE,
        compile_sizes=[],
    )
    config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        compilation_config=compilation,
        load_config=LoadConfig(load_format="dummy"),
    )
    resolved = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert resolved is mxfuse.vllm_pass  # the string resolved to mxfuse's own InductorPass
    record = Record()
    config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"] = _recorder(resolved, record)
    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        for module in case.attention_modules:
            model_module = importlib.import_module(f"vllm.model_executor.models.{module}")
            stack.enter_context(mock.patch.object(model_module, "Attention", _StubAttention))
        stack.enter_context(mock.patch.object(kernel, "is_supported", classmethod(lambda c, cc=None: (True, None))))
        stack.enter_context(mock.patch.dict(linear_kernels._POSSIBLE_MXFP8_KERNELS, {current_platform._enum: [kernel]}))
        if case.kernel == "FlashInferTrtllmMxfp8LinearKernel":
            stack.enter_context(mock.patch.object(kernel, "process_weights_after_loading", _trtllm_weights_unshuffled))
        stack.enter_context(set_current_vllm_config(config))
        model = get_model_loader(config.load_config).load_model(config, model_config)
        input_ids = torch.randint(0, case.hf_config["vocab_size"], (TOKENS,))
        positions = torch.arange(TOKENS)
        if model_config.uses_mrope:
            positions = positions.expand(3, TOKENS)
        with torch.inference_mode(), pytest.raises(_PiecesNotRun):
            model(input_ids, positions)
    return record


def tiny(architecture: str, model_type: str, **extra) -> dict:
    """A two-layer HF config (unless `extra` says otherwise): hidden 128, two query heads of 64, one KV head,
    vocab 256."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": 256,
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 256,
        **extra,
    }


@dataclass(frozen=True)
class Case:
    name: str
    attention_modules: tuple[str, ...]  # vllm.model_executor.models.* whose `Attention` the stub replaces
    hf_config: dict
    sites: int  # Gemma-norm -> MXFP8-quant sites in the compiled graphs (two layers)
    why_sites: str
    unquantized: tuple[str, ...] = ()  # ModelOpt `ignored_layers` besides lm_head, and why in CASES
    kernel: str = "FlashInferCutedslMxfp8LinearKernel"  # the MXFP8 linear kernel declared supported
    model_impl: str = "auto"  # "transformers": vLLM's Transformers modeling backend on the HF model code


PER_LAYER_2 = "per layer: input_layernorm -> qkv_proj, the pre-MLP norm -> gate_up_proj"
CASES = [
    # one layer where the family's two norm forms already meet a quant in it (plain input norm, fused-add
    # pre-MLP norm); Gemma 3 keeps two, so a fused-add input norm reads a residual from the previous piece
    Case("gemma", ("gemma",), tiny("GemmaForCausalLM", "gemma", num_hidden_layers=1), 2, PER_LAYER_2),
    Case(
        "gemma2",
        ("gemma2",),
        tiny("Gemma2ForCausalLM", "gemma2", sliding_window=64, num_hidden_layers=1),
        2,
        PER_LAYER_2,
    ),
    Case("gemma3", ("gemma3",), tiny("Gemma3ForCausalLM", "gemma3_text", sliding_window=64), 4, PER_LAYER_2),
    Case(
        "qwen3_next",
        ("qwen3_next",),
        tiny(
            "Qwen3NextForCausalLM",
            "qwen3_next",
            layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0],  # vLLM's Qwen3NextForCausalLM needs one MoE layer
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        ),
        3,
        "layer 0 (gated delta net, dense MLP): input_layernorm -> in_proj_qkvz, post_attention_layernorm -> gate_up;"
        " layer 1 (attention, MoE): input_layernorm -> qkv_proj; its post_attention_layernorm feeds"
        " vllm.moe_forward_shared, whose quant is inside the op (not a site)",
        # in_proj_ba has N = 2 * linear_num_value_heads (64 in Qwen3-Next-80B): below the N >= 128 of
        # the CuTe-DSL/CUTLASS MXFP8 kernels, so on Blackwell vLLM gives it Marlin W8A16 (bf16 input)
        unquantized=("*in_proj_ba",),
    ),
    Case(
        "qwen3_5",
        ("qwen3_next",),  # Qwen3.5's attention is Qwen3-Next's class
        tiny(
            "Qwen3_5ForCausalLM",
            "qwen3_5_text",
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        ),
        4,
        "layer 0 (gated delta net): input_layernorm -> in_proj_qkvz, post_attention_layernorm -> gate_up;"
        " layer 1 (attention): input_layernorm -> qkv_proj, post_attention_layernorm -> gate_up",
        unquantized=("*in_proj_ba", "*in_proj_a", "*in_proj_b"),  # N = linear_num_value_heads (as Qwen3-Next)
    ),
    Case(
        "step3p5",
        ("step3p5",),
        tiny(
            "Step3p5ForCausalLM",
            "step3p5",
            layer_types=["full_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],  # vLLM's Step3p5ForCausalLM needs one MoE layer
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN,
            share_expert_dim=HIDDEN,
            use_moe_router_bias=True,  # fields vLLM's Step-3.5 MoE block reads (remote-code config names)
            need_fp32_gate=True,
            norm_expert_weight=True,
        ),
        3,
        "layer 0: input_layernorm -> qkv_proj, post_attention_layernorm (a plain rms_norm after the model's own"
        " residual add) -> gate_up; layer 1: input_layernorm -> qkv_proj; its post_attention_layernorm feeds"
        " vllm.moe_forward_shared (quant inside the op, not a site)",
    ),
    Case(
        "rnj1",
        ("rnj1",),
        tiny("Rnj1ForCausalLM", "gemma3_text", sliding_window=64, num_hidden_layers=1),
        2,
        PER_LAYER_2,
    ),
]


TRANSFORMERS_BACKEND = Case(
    "gemma3_transformers_backend",
    ("transformers.base",),
    tiny("Gemma3ForCausalLM", "gemma3_text", sliding_window=64, num_hidden_layers=1),
    2,
    "per layer: input_layernorm -> q/k/v (one QKVParallelLinear), pre_feedforward_layernorm -> gate_up;"
    " plain norms (the HF code adds the residual itself)",
    model_impl="transformers",
)
TRTLLM_8X4 = Case(
    "gemma3_trtllm",
    ("gemma3",),
    # TRT-LLM's MXFP8 linear needs K % 256 == 0 in every projection
    tiny(
        "Gemma3ForCausalLM",
        "gemma3_text",
        sliding_window=64,
        hidden_size=256,
        intermediate_size=256,
        head_dim=128,
        num_hidden_layers=1,
    ),
    2,
    PER_LAYER_2 + ", each quantized by vllm.flashinfer_mxfp8_quantize_8x4 (8x4-swizzled flat scales)",
    kernel="FlashInferTrtllmMxfp8LinearKernel",
)
NOT_RECOGNIZED_8X4 = (
    "mxfuse does not replace vllm.flashinfer_mxfp8_quantize_8x4 (vLLM's TRT-LLM MXFP8 linear, selected"
    " with KernelConfig.linear_backend='flashinfer_trtllm'): its 8x4 layout is known exactly"
    " (mxfuse/ops/layout_8x4.py) but its scale rule is not the E8M0 rule of the fused op (an approximate"
    " 1/448, rounding toward +inf, codes clamped to +-448, NaN -> 448), and its bits can only be checked"
    " on sm_100; the sites are found but none fuses"
)


@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        TRANSFORMERS_BACKEND,
        pytest.param(
            TRTLLM_8X4, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=NOT_RECOGNIZED_8X4)
        ),
    ],
    ids=lambda c: c.name,
)
def test_every_gemma_norm_quant_site_fuses_in_vllm_compile(vllm_cpu, case):
    record = compile_model(vllm_cpu, case)
    described = [s.describe() for s in record.sites]
    assert record.graphs >= 2, record  # piecewise: vLLM split at its attention op
    assert all(s.gemma for s in record.sites), described  # no plain-weight RMSNorm feeds an MXFP8 quant
    assert len(record.sites) == case.sites, (case.why_sites, described)
    assert record.fused == len(record.sites), (described, record.matched, record.skipped)
    assert record.left == 0, described
