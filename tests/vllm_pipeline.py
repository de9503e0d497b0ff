"""vLLM 0.33's own compile pipeline on CPU, on vLLM's own model classes, with mxfuse as its post-grad pass.

The machinery the vLLM model tests share (tests/test_vllm_*.py): an independent site detector,
the module fixture that stands vLLM up on CPU, the CUDA-only replacements, and `compile_model`.

`compile_model` builds a tiny model (one or two layers, random weights from vLLM's dummy loader)
through vLLM's model loader with an MXFP8 checkpoint config (ModelOpt `quant_method: "mxfp8"`
unless the case gives another), and compiles it in `CompilationMode.VLLM_COMPILE` with
`inductor_passes={"post_grad_custom_post_pass": "mxfuse.vllm_pass"}`: Dynamo, vLLM's piecewise
split at its attention ops, AOTAutograd, Inductor, vLLM's PostGradPassManager (its own passes,
then mxfuse). A recording wrapper around the resolved `mxfuse.vllm_pass` counts, in every
piecewise graph, the norm->quant sites BEFORE mxfuse runs and the fused sites AFTER, with a
detector of its own (below), not with mxfuse's recognizers.

Replaced here, because they cannot run without CUDA (each test file lists what it adds):
- The MXFP8 linear kernel choice: vLLM has no CPU MXFP8 linear kernel, so the case's kernel
  (by default the Blackwell FlashInfer CuTe-DSL kernel, `FlashInferCutedslMxfp8LinearKernel`,
  the first choice on sm_100) is declared supported and is the only candidate. Its
  `process_weights_after_loading` and `apply_weights` run unchanged (CuTe-DSL:
  `vllm.mxfp8_quantize(x.view(-1, K), True)` then `vllm.mm_mxfp8`, traced through its fake
  impl, never run).
- Attention: vLLM's `Attention` layer picks a backend at construction, which this CPU build
  cannot. A stub layer with the same constructor calls vLLM's own splitting op
  `vllm.unified_attention_with_output` with the same shapes, so the piecewise split is vLLM's.
  MLA models (DeepSeek-V2): `StubMLAAttention` stands for `MLAAttention` the same way, calling
  vLLM's `vllm.unified_mla_attention_with_output` (a splitting op too) with the real shapes;
  a case enters it with `patches=(mla_attention_stub(),)`.
- `FixFunctionalizationPass`, the last step of vLLM's PostGradPassManager, needs vLLM's CUDA
  extension (`torch.ops._C.rotary_embedding`); mxfuse has run before it. The stub ends the
  piece's Inductor compile there, and the piece is not run (no CPU MXFP8 GEMM either).
- Only with the TRT-LLM kernel: its `process_weights_after_loading` shuffles the weight and its
  scales with FlashInfer ops that need a CUDA device; a stub pads them to the same shapes
  (`[pad(N, 128), K]`, flat scales) unshuffled. Its `apply_weights` (the activation quant) runs as is.
- FlashInfer's availability probe: vLLM registers `vllm.mm_mxfp8` and
  `vllm.flashinfer_mxfp8_quantize_8x4` only where FlashInfer could build its kernels (nvcc or
  flashinfer-cubin); tests/vllm_flashinfer.py sets vLLM's own override so their schemas and fake
  impls exist (traced, never run).
- `current_platform.current_device`: None on vLLM's `UnspecifiedPlatform` (what vLLM's CUDA wheel
  detects without a GPU); Qwen's gated-delta-net layer asks it where to put its gated norm: CPU.
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

aten = torch.ops.aten
TOKENS = 16
HIDDEN = 128  # the CuTe-DSL MXFP8 kernel needs K >= 128 and N >= 128
CUTEDSL = "flashinfer.FlashInferCutedslMxfp8LinearKernel"
TRTLLM = "flashinfer.FlashInferTrtllmMxfp8LinearKernel"


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
    mx = torch.ops.mxfuse
    return {
        mx.gemma_rmsnorm_mxfp8.default,
        mx.gemma_fused_add_rmsnorm_mxfp8.default,
        mx.rms_norm_mxfp8.default,
        mx.fused_add_rms_norm_mxfp8.default,
    }


def gemm_ops() -> set:
    """The MXFP8 GEMMs whose codes input counts a fused site: vLLM's (FlashInfer; ROCm's 32x32-block-scaled
    GEMM) and the stand-in for ROCm's dot-scaled Triton launch."""
    return {
        torch.ops.vllm.mm_mxfp8.default,
        torch.ops.vllm.rocm_mxfp8_block32_gemm.default,
        torch.ops.vllm_pipeline.dot_scaled_mxfp8_gemm.default,
    }


def named_args(node: fx.Node) -> dict:
    """A call's arguments by schema name (positional and keyword alike), defaults filled in."""
    schema = node.target._schema
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    named.update({a.name: v for a, v in zip(schema.arguments, node.args, strict=False)})
    named.update(node.kwargs)
    return named


def _weight_kind(weight, x) -> str:
    """vLLM's GemmaRMSNorm hands its IR norm `weight.float() + 1.0` ("gemma"); its RMSNorm the parameter
    itself, in the model dtype ("model dtype"); anything else is "other"."""
    if (
        isinstance(weight, fx.Node)
        and weight.target in (aten.add.Tensor, aten.add.Scalar)
        and any(isinstance(a, (int, float)) and a == 1 for a in weight.args)
    ):
        return "gemma"
    w, v = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (weight, x))
    if w is not None and v is not None and w.dtype == v.dtype:
        return "model dtype"
    return "other"


def source(node) -> tuple[fx.Node, list[str]]:
    """Walk back through value-preserving ops (and a tuple output's getitem); return the producer and the chain."""
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
    weight: str  # "gemma" (`w.float() + 1`), "model dtype" (vLLM's standard RMSNorm) or "other"
    quant: str
    chain: list[str]  # the nodes between the norm and the quant, norm side first
    quant_args: tuple
    norm_shape: tuple  # the shape of the norm's output (symbolic sizes as strings)

    @property
    def gemma(self) -> bool:
        return self.weight == "gemma"

    def describe(self) -> str:
        norm = f"{self.norm}({self.weight} weight) -> {list(self.norm_shape)}"
        return f"{norm} -> {' -> '.join(self.chain) or '(direct)'} -> {self.quant}{self.quant_args}"


def norm_quant_sites(graph: fx.Graph) -> list[Site]:
    norms, quants = _norm_ops(), _quant_ops()
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in quants:
            continue
        producer, chain = source(node.args[0])
        if isinstance(producer, fx.Node) and producer.target in norms:
            fused_add = producer.target is torch.ops.vllm_ir.fused_add_rms_norm.default
            weight = producer.args[2] if fused_add else producer.args[1]
            args = tuple(node.args[1:]) + tuple(f"{k}={v}" for k, v in node.kwargs.items())
            val = producer.meta.get("val")
            shape = tuple(str(d) for d in (val[0] if isinstance(val, (tuple, list)) else val).shape)
            sites.append(
                Site(
                    norms[producer.target],
                    _weight_kind(weight, producer.args[0]),
                    quants[node.target],
                    chain,
                    args,
                    shape,
                )
            )
    return sites


def quant_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Every MXFP8 activation quant in the graph, whatever reads into it."""
    quants = _quant_ops()
    return [n for n in graph.nodes if n.op == "call_function" and n.target in quants]


def fused_nodes(graph: fx.Graph) -> list[fx.Node]:
    """mxfuse fused ops whose codes reach an MXFP8 GEMM (through getitem and value-preserving ops)."""
    fused, gemms, found = _fused_ops(), gemm_ops(), []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in gemms:
            producer, _ = source(node.args[0])
            if isinstance(producer, fx.Node) and producer.target in fused:
                found.append(producer)
    return found


# ---------------------------------------------------------------- the vLLM stand-up
class PiecesNotRun(Exception):
    """Raised when a compiled piece is called: its compile stopped at FixFunctionalization."""


class _StopAfterPostGradPasses(BaseException):
    """Ends a piece's Inductor compile where vLLM's FixFunctionalization would need its CUDA extension."""


@dataclass
class Record:
    sites: list[Site] = field(default_factory=list)
    fused: int = 0
    fused_args: list[dict] = field(default_factory=list)  # the fused ops' arguments by name
    left: int = 0  # sites the detector still finds after mxfuse ran
    quants: int = 0  # MXFP8 activation quants before mxfuse ran, sites or not
    graphs: int = 0
    matched: Counter = field(default_factory=Counter)
    skipped: list = field(default_factory=list)  # mxfuse's skip records, as the report gives them
    before: list[fx.Graph] = field(default_factory=list)  # a copy of each graph as mxfuse received it
    after: list[fx.Graph] = field(default_factory=list)  # each graph as mxfuse left it (a copy)
    schemes: Counter = field(default_factory=Counter)  # the linear layers' quantization schemes, by class name
    weight_dtypes: dict = field(default_factory=dict)  # linear weight name -> dtype after vLLM's weight prep
    model_class: str = ""  # the vLLM class the loader built


def _recorder(inner, record: Record):
    from vllm.compilation.passes.inductor_pass import InductorPass

    class RecordingPass(InductorPass):
        """Counts sites with the test's detector, runs the resolved mxfuse pass, counts fused sites."""

        def __call__(self, graph: fx.Graph) -> None:
            record.graphs += 1
            if os.environ.get("DBG"):
                print(graph)
            copy = fx.Graph()
            copy.output(copy.graph_copy(graph, {}))
            record.before.append(copy)
            record.sites += norm_quant_sites(graph)
            record.quants += len(quant_nodes(graph))
            inner(graph)
            copy = fx.Graph()
            copy.output(copy.graph_copy(graph, {}))
            record.after.append(copy)
            fused = fused_nodes(graph)
            record.fused += len(fused)
            record.fused_args += [named_args(n) for n in fused]
            record.left += len(norm_quant_sites(graph))
            report = inner.last_report
            record.matched.update({str(k): v for k, v in report.matched.items()})
            record.skipped += list(report.skipped)

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


class StubAttention(torch.nn.Module):
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


class StubMLAAttention(torch.nn.Module):
    """vLLM's `MLAAttention` constructor, then vLLM's MLA splitting op with the real shapes."""

    def __init__(self, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, *args, prefix="", **kwargs):
        super().__init__()
        self.num_heads, self.v_head_dim, self.layer_name = num_heads, v_head_dim, prefix

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        shape = output_shape or (q.shape[0], self.num_heads * self.v_head_dim)
        output = torch.empty(shape, dtype=q.dtype, device=q.device)
        torch.ops.vllm.unified_mla_attention_with_output(q, kv_c_normed, k_pe, output, self.layer_name)
        return output


def mla_attention_stub():
    """The patch that puts `StubMLAAttention` where vLLM's MLA wrapper builds its attention."""
    from unittest import mock

    from vllm.model_executor.layers import mla

    return mock.patch.object(mla, "MLAAttention", StubMLAAttention)


@torch.library.custom_op("vllm_pipeline::dot_scaled_mxfp8_gemm", mutates_args=())
def dot_scaled_mxfp8_gemm(
    x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """Stands for vLLM's ROCm Triton dot-scaled GEMM launch in the traced graph; never run."""
    raise NotImplementedError("the ROCm dot-scaled GEMM stand-in is traced, never run")


@dot_scaled_mxfp8_gemm.register_fake
def _(x_q, x_scale, w, w_scale):
    return x_q.new_empty(x_q.shape[0], w.shape[0], dtype=torch.bfloat16)


class DotScaledLaunch:
    """Replaces `rocm_native._mxfp8_linear_kernel[grid](...)`: on a machine without a GPU driver vLLM's
    `triton.jit` is a placeholder (a plain function, not subscriptable). Writes the stand-in GEMM's
    `[M, N]` output into the launcher's `out`, so the quant's codes and scales reach a GEMM node."""

    def __getitem__(self, grid):
        def launch(x_q, x_scale, w, w_scale, out, *sizes_and_strides, **meta):
            out.copy_(torch.ops.vllm_pipeline.dot_scaled_mxfp8_gemm(x_q, x_scale, w, w_scale))

        return launch


@contextlib.contextmanager
def vllm_on_cpu(world_size: int = 1, rank: int = 0, init_method: str | None = None):
    """vLLM stood up on CPU: env, the CUDA-only replacements, a gloo TP group of `world_size` ranks."""
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
                raise PiecesNotRun

            return not_run

    def stop(self, graph):
        raise _StopAfterPostGradPasses

    with (
        mock.patch.dict(os.environ, {"VLLM_DISABLE_COMPILE_CACHE": "1", "HF_HUB_OFFLINE": "1"}),
        mock.patch.object(FixFunctionalizationPass, "__call__", stop),
        mock.patch.object(current_platform, "current_device", lambda: torch.device("cpu")),
        mock.patch.object(backends.CompilerManager, "compile", compile_until_post_grad_done),
    ):
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            parallel_state.init_distributed_environment(world_size, rank, init_method, rank, backend="gloo")
            parallel_state.initialize_model_parallel(world_size)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


@pytest.fixture(scope="module")
def vllm_cpu(tmp_path_factory):
    """vLLM stood up once per test module on CPU (a 1-rank gloo TP group); yields a scratch directory."""
    pytest.importorskip("vllm")
    with vllm_on_cpu():
        yield tmp_path_factory.mktemp("vllm_models")


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
    sites: int  # norm -> MXFP8-quant sites in the compiled graphs
    why_sites: str
    unquantized: tuple[str, ...] = ()  # ModelOpt `ignored_layers` besides lm_head, and why in the case list
    kernel: str = CUTEDSL  # vllm.model_executor.kernels.linear.mxfp8.<module>.<class>, declared supported
    model_impl: str = "auto"  # "transformers": vLLM's Transformers modeling backend on the HF model code


def modelopt_mxfp8(case: Case) -> dict:
    """ModelOpt's MXFP8 checkpoint tag (what MiniMax's MXFP8 checkpoints carry)."""
    return {"quant_method": "mxfp8", "ignored_layers": ["lm_head", *case.unquantized]}


def compile_model(root, case: Case, *, quantization_config=modelopt_mxfp8, patches=(), tp_size: int = 1) -> Record:
    """Load the case's HF config through vLLM's loader (dummy weights), run one forward under VLLM_COMPILE.

    `quantization_config(case)` gives the checkpoint's `quantization_config`; `patches` are extra
    context managers entered while the model is built and run (each test file lists its own)."""
    import importlib
    from unittest import mock

    from vllm.config import (
        CompilationConfig,
        CompilationMode,
        CUDAGraphMode,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    import mxfuse

    module_name, class_name = case.kernel.rsplit(".", 1)
    kernel = getattr(importlib.import_module(f"vllm.model_executor.kernels.linear.mxfp8.{module_name}"), class_name)

    model_dir = root / case.name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({**case.hf_config, "torch_dtype": "bfloat16", "quantization_config": quantization_config(case)})
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
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
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
            stack.enter_context(mock.patch.object(model_module, "Attention", StubAttention))
        stack.enter_context(mock.patch.object(kernel, "is_supported", classmethod(lambda c, cc=None: (True, None))))
        stack.enter_context(mock.patch.dict(linear_kernels._POSSIBLE_MXFP8_KERNELS, {current_platform._enum: [kernel]}))
        if case.kernel == TRTLLM:
            stack.enter_context(mock.patch.object(kernel, "process_weights_after_loading", _trtllm_weights_unshuffled))
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(set_current_vllm_config(config))
        model = get_model_loader(config.load_config).load_model(config, model_config)
        record.model_class = type(model).__name__
        record.schemes.update(type(m.scheme).__name__ for m in model.modules() if hasattr(m, "scheme"))
        record.weight_dtypes = {n: p.dtype for n, p in model.named_parameters() if n.endswith("proj.weight")}
        input_ids = torch.randint(0, case.hf_config["vocab_size"], (TOKENS,))
        positions = torch.arange(TOKENS)
        if model_config.uses_mrope:
            positions = positions.expand(3, TOKENS)
        with torch.inference_mode(), pytest.raises(PiecesNotRun):
            model(input_ids, positions)
    return record


# ---------------------------------------------------------------- vLLM's compile decision, per architecture
def compile_mode_by_default(architecture: str):
    """The compilation mode vLLM 0.33 keeps for `architecture` when the user asks for `VLLM_COMPILE`.

    Runs vLLM's own `VllmConfig._maybe_enable_breakable_cudagraph` (called from `__post_init__`,
    `config/vllm.py:1793`): an architecture on `DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES` turns on
    `VLLM_USE_BREAKABLE_CUDAGRAPH` (unless the user set it) and the mode becomes `NONE`. Off ROCm, as
    on this machine and on NVIDIA GPUs."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm.config import CompilationConfig, CompilationMode, VllmConfig

    config = SimpleNamespace(
        model_config=SimpleNamespace(architectures=[architecture]),
        compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE),
    )
    config._uses_breakable_cudagraph_by_default = lambda: VllmConfig._uses_breakable_cudagraph_by_default(config)
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_USE_BREAKABLE_CUDAGRAPH"}
    with mock.patch.dict(os.environ, environ, clear=True):
        VllmConfig._maybe_enable_breakable_cudagraph(config)
    return config.compilation_config.mode


def has_support_torch_compile(architecture: str) -> bool:
    """Whether vLLM's class for `architecture` reaches `@support_torch_compile`: its module defines a
    decorated class (the inner `...Model`), or it is a Transformers-backend class, whose `Base.__init__`
    decorates the Hugging Face model it wraps (`model_executor/models/transformers/base.py:288`)."""
    import importlib

    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.model_executor.models.transformers.base import Base

    lazy = ModelRegistry.models[architecture]
    module = importlib.import_module(lazy.module_name)
    if issubclass(getattr(module, lazy.class_name), Base):
        return True
    return any(
        isinstance(v, type) and issubclass(v, TorchCompileWithNoGuardsWrapper) and v.__module__ == module.__name__
        for v in vars(module).values()
    )
