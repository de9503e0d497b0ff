"""vLLM's all-reduce fusion at TP 2 runs before mxfuse: the graphs mxfuse receives, and what it says.

At TP > 1 on sm90/sm100 with FlashInfer (and on ROCm with AITER) vLLM 0.33 puts its
`AllReduceFusionPass` (`RocmAiterAllReduceFusionPass`) in the PostGradPassManager before the custom
post pass, for the compile ranges up to its `max_token_num`: `all_reduce -> [fused_add_]rms_norm`
becomes `vllm.flashinfer_trtllm_fused_allreduce_norm` under `auto_functionalized` (or the
functional `vllm.rocm_aiter_fused_allreduce_rmsnorm`), and the MXFP8 quant reads its norm output.
vLLM splits the compile ranges at `max_token_num` (`VllmConfig._set_compile_ranges`) and compiles
every range up front, so each piece reaches mxfuse once per range. Driven here through vLLM's own
pipeline on CPU (tests/vllm_pipeline.py), with vLLM's own pass classes, patterns and gates.

The TP world is simulated in one process: vLLM's 1-rank gloo group (`vllm_on_cpu`) with its TP
`GroupCoordinator` set to `world_size=2` and `use_custom_op_call=True` (what vLLM's CUDA and ROCm
platforms use), so the model is built with TP-2 shards and its `tensor_model_parallel_all_reduce`
traces as `vllm.all_reduce`. No collective runs: the pieces are compiled, never run.

Replaced beyond tests/vllm_pipeline.py's list:
- The platform gates, evaluated by vLLM's own `enable_allreduce_rms_fusion` with the platform facts
  stubbed during that call only: sm100 CUDA with FlashInfer (`is_cuda`,
  `is_device_capability_family(100)`, `has_flashinfer`; on sm90 vLLM serves MXFP8 with Marlin
  W8A16), or ROCm with AITER on (`is_rocm`, `rocm_aiter_ops.is_enabled`).
- The pass manager imports its pass classes only on CUDA (`AllReduceFusionPass`) or with AITER on
  (`RocmAiterAllReduceFusionPass`): the classes are put into `pass_manager`'s namespace, and for
  AITER `pass_manager.rocm_aiter_ops.is_enabled` says yes (in that module only).
- Importing `fusion/allreduce_rms_fusion.py` reads nine ops of vLLM's CUDA extension
  (`torch.ops._C.rotary_embedding` ... `rms_norm_dynamic_per_token_quant`, via `matcher_utils` and
  `rms_quant_fusion`) as module constants: placeholders while it imports. None is in a pattern the
  pass registers here (its fp8 / NVFP4 quant patterns need the quant workspace, stubbed absent).
- The device size table: FlashInfer's `default_fi_allreduce_fusion_max_size_mb` (sm100's table
  needs a CUDA capability) and AITER's `effective_max_size` give `THRESHOLD_TOKENS` tokens of the
  tiny model's rows, so the split falls inside the compiled ranges.
- FlashInfer's IPC workspaces: `get_fi_ar_workspace` returns a token object (created by
  FlashInfer over CUDA IPC), `get_fi_ar_quant_workspace` None. FlashInfer's `flashinfer.comm`
  imports on CPU, so vLLM registers `vllm.flashinfer_trtllm_fused_allreduce_norm` itself.
- AITER: `rocm_aiter_ops.get_aiter_allreduce()` returns a stand-in communicator (its max size,
  `supports_dynamic_hidden_dim=True`, `supports_per_group_quant=False`), and
  `vllm.rocm_aiter_fused_allreduce_rmsnorm` is registered with vLLM's own impl and fake
  (`_aiter_ops.py` registers it only on ROCm); `_set_compile_ranges` sees AITER's custom
  all-reduce on. The linear kernel is ROCm's dot-scaled one (tests/test_vllm_rocm.py's stubs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import operator
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import vllm_pipeline
from test_vllm_rocm import ROCM, _rocm_launch
from torch import fx
from vllm_pipeline import Case, compile_model, norm_quant_sites, tiny

from mxfuse.patterns.producers import ProducerFamily
from mxfuse.patterns.results import SharedCode

pytestmark = pytest.mark.vllm
HIDDEN = 256  # at TP 2 the row-parallel K (o_proj, down_proj) is HIDDEN / 2: the MXFP8 kernels need >= 128
THRESHOLD_TOKENS = 8  # max_token_num of the stubbed size tables: ranges [1, 8] and [9, max_num_batched_tokens]
THRESHOLD_BYTES = THRESHOLD_TOKENS * HIDDEN * 2
TP2 = {"hidden_size": HIDDEN, "intermediate_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2}
GEMMA = Case("gemma_tp2", ("gemma",), tiny("GemmaForCausalLM", "gemma", num_hidden_layers=1, **TP2), 1, "")
LLAMA = Case("llama_tp2", ("llama",), tiny("LlamaForCausalLM", "llama", num_hidden_layers=1, **TP2), 2, "")
FLASHINFER_OP, AITER_OP = "flashinfer_trtllm_fused_allreduce_norm", "rocm_aiter_fused_allreduce_rmsnorm"
_C_AT_IMPORT = (
    "rotary_embedding",
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "silu_and_mul",
    "fused_add_rms_norm",
    "rms_norm_static_fp8_quant",
    "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_quant",
)


# ---------------------------------------------------------------- the stand-up
class _CAtImport:
    """`torch.ops._C` while the fusion module imports: the CUDA extension's ops it names, as placeholders."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in _C_AT_IMPORT:
            return SimpleNamespace(default=f"torch.ops._C.{name} (vLLM's CUDA extension, absent on CPU)")
        return getattr(self._real, name)


def fusion_module():
    name = "vllm.compilation.passes.fusion.allreduce_rms_fusion"
    with mock.patch.object(torch.ops, "_C", _CAtImport(torch.ops._C)):
        return importlib.import_module(name)


@pytest.fixture(scope="module")
def vllm_tp2(tmp_path_factory):
    """vLLM on CPU with a simulated TP-2 group; yields a scratch directory."""
    pytest.importorskip("vllm")
    from vllm.distributed import parallel_state

    with vllm_pipeline.vllm_on_cpu():
        tp = parallel_state.get_tp_group()
        with mock.patch.object(tp, "world_size", 2), mock.patch.object(tp, "use_custom_op_call", True):
            yield tmp_path_factory.mktemp("vllm_tp2")


def _gate(patches):
    """vLLM's own `enable_allreduce_rms_fusion`, evaluated with `patches` (the platform facts) entered."""
    from vllm.config import vllm as vllm_config

    gate = vllm_config.enable_allreduce_rms_fusion

    def on_platform(cfg):
        with contextlib.ExitStack() as stack:
            for patch in patches():
                stack.enter_context(patch)
            return gate(cfg)

    levels = (vllm_config.OPTIMIZATION_LEVEL_02, vllm_config.OPTIMIZATION_LEVEL_03)
    return [
        mock.patch.dict(lv["compilation_config"]["pass_config"], {"fuse_allreduce_rms": on_platform}) for lv in levels
    ]


def flashinfer_sm100():
    """The stubs that put vLLM's FlashInfer `AllReduceFusionPass` in front of mxfuse (module docstring)."""
    import vllm.utils.flashinfer as vllm_flashinfer
    from vllm.compilation.passes import pass_manager
    from vllm.config.compilation import PassConfig
    from vllm.platforms import current_platform

    arf = fusion_module()

    def blackwell():
        return [
            mock.patch.object(current_platform, "is_cuda", lambda: True),
            mock.patch.object(current_platform, "is_device_capability", lambda c: False),
            mock.patch.object(current_platform, "is_device_capability_family", lambda c: c == 100),
            mock.patch.object(vllm_flashinfer, "has_flashinfer", lambda: True),
        ]

    table = {2: THRESHOLD_BYTES / (1024 * 1024)}
    return [
        *_gate(blackwell),
        mock.patch.object(PassConfig, "default_fi_allreduce_fusion_max_size_mb", staticmethod(lambda: table)),
        mock.patch.object(pass_manager, "AllReduceFusionPass", arf.AllReduceFusionPass, create=True),
        mock.patch.object(arf, "get_fi_ar_workspace", lambda **kw: object()),
        mock.patch.object(arf, "get_fi_ar_quant_workspace", lambda **kw: None),
    ]


def _register_aiter_op():
    from vllm import _aiter_ops
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, AITER_OP):
        direct_register_custom_op(
            op_name=AITER_OP,
            op_func=_aiter_ops._rocm_aiter_fused_allreduce_rmsnorm_impl,
            fake_impl=_aiter_ops._rocm_aiter_fused_allreduce_rmsnorm_fake,
        )


def rocm_aiter():
    """The stubs that put vLLM's `RocmAiterAllReduceFusionPass` in front of mxfuse (module docstring)."""
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.compilation.passes import pass_manager
    from vllm.config.vllm import VllmConfig
    from vllm.distributed.device_communicators.aiter_custom_all_reduce import AiterCustomAllreduce
    from vllm.platforms import current_platform

    arf = fusion_module()
    _register_aiter_op()
    communicator = SimpleNamespace(
        effective_max_size=lambda: THRESHOLD_BYTES, supports_dynamic_hidden_dim=True, supports_per_group_quant=False
    )

    def aiter_on():
        return [
            mock.patch.object(current_platform, "is_rocm", lambda: True),
            mock.patch.object(rocm_aiter_ops, "is_enabled", lambda: True),
        ]

    set_ranges = VllmConfig._set_compile_ranges

    def ranges_with_aiter_all_reduce(self):
        with (
            mock.patch.object(rocm_aiter_ops, "is_custom_all_reduce_enabled", lambda: True),
            mock.patch.object(AiterCustomAllreduce, "effective_max_size", staticmethod(lambda: THRESHOLD_BYTES)),
        ):
            return set_ranges(self)

    pm_aiter = SimpleNamespace(is_enabled=lambda: True, is_rdna_aiter_enabled=lambda: False)
    return [
        *_gate(aiter_on),
        mock.patch.object(VllmConfig, "_set_compile_ranges", ranges_with_aiter_all_reduce),
        mock.patch.object(pass_manager, "rocm_aiter_ops", pm_aiter),
        mock.patch.object(pass_manager, "RocmAiterAllReduceFusionPass", arf.RocmAiterAllReduceFusionPass, create=True),
        mock.patch.object(rocm_aiter_ops, "get_aiter_allreduce", lambda: communicator),
    ]


# ---------------------------------------------------------------- what each graph was, per compile range
@dataclass
class Piece:
    """One graph mxfuse received: its compile range, the graph before and after, mxfuse's report."""

    start: int
    end: int
    before: fx.Graph
    after: fx.Graph
    report: object

    @property
    def small(self) -> bool:
        return self.end <= THRESHOLD_TOKENS


@dataclass
class Compiled:
    record: vllm_pipeline.Record
    pieces: list[Piece] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def compile_tp2(root, case: Case, stubs, *, patches=(), options: dict | None = None) -> Compiled:
    """`compile_model` at TP 2 under `stubs` (entered before vLLM's config is built), by compile range."""
    from vllm.compilation.passes.inductor_pass import get_pass_context

    pieces: list[Piece] = []
    original = vllm_pipeline._recorder

    def ranged_recorder(inner, record):
        recording = original(inner, record)

        class Ranged(type(recording)):
            def __call__(self, graph):
                super().__call__(graph)
                r = get_pass_context().compile_range
                after = fx.Graph()
                after.output(after.graph_copy(graph, {}))
                pieces.append(Piece(r.start, r.end, record.before[-1], after, inner.last_report))

        return Ranged()

    env = {"MXFUSE_OPTIONS": json.dumps(options)} if options else {}
    handler = _Lines()
    log = logging.getLogger("mxfuse")
    log.addHandler(handler)
    try:
        with contextlib.ExitStack() as stack:
            for patch in [*stubs(), mock.patch.object(vllm_pipeline, "_recorder", ranged_recorder)]:
                stack.enter_context(patch)
            stack.enter_context(mock.patch.dict(os.environ, env))
            record = compile_model(root, case, patches=patches, tp_size=2)
    finally:
        log.removeHandler(handler)
    return Compiled(record, pieces, handler.lines)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@dataclass(frozen=True)
class FusedSite:
    """A norm output of a fused all-reduce+norm node that an MXFP8 quant reads (found by the test)."""

    y: str
    index: int
    kwargs: dict


def fused_allreduce_sites(graph: fx.Graph) -> list[FusedSite]:
    quants = set(vllm_pipeline._quant_ops())
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in quants:
            continue
        producer = node.args[0]
        while producer.target in vllm_pipeline._VALUE_PRESERVING:
            producer = producer.args[0]
        if producer.target is not operator.getitem:
            continue
        fused = producer.args[0]
        if fused.target is torch.ops.higher_order.auto_functionalized:
            if fused.args[0] is getattr(torch.ops.vllm, FLASHINFER_OP).default:
                found.append(FusedSite(producer.name, producer.args[1], dict(fused.kwargs)))
        elif hasattr(torch.ops.vllm, AITER_OP) and fused.target is getattr(torch.ops.vllm, AITER_OP).default:
            found.append(FusedSite(producer.name, producer.args[1], dict(zip(("x", "residual", "w"), fused.args))))
    return found


def _skips(piece: Piece, code) -> dict[str, object]:
    return {s.node: s for s in piece.report.skipped if s.code is code}


def _norm_sites(piece: Piece) -> list:
    """The applied sites whose producer is a norm (the act·mul before down_proj, local to a rank, fuses in
    every range too: tests/test_vllm_act_mul.py)."""
    return [a for a in piece.report.applied if a.kind.family is ProducerFamily.NORM]


def _as_vllm_left_it(piece: Piece) -> bool:
    """Every fused all-reduce + norm node of vLLM still in the graph, with the users it had."""
    before = {(s.y, s.index) for s in fused_allreduce_sites(piece.before)}
    return before == {(s.y, s.index) for s in fused_allreduce_sites(piece.after)}


def _touched(piece: Piece) -> set[str]:
    """Every node an applied site of mxfuse named or replaced."""
    return {n for a in piece.report.applied for n in (a.site, *a.replaced)}


# ---------------------------------------------------------------- the tests
def test_flashinfer_gemma_fused_add_form_is_refused_and_larger_ranges_fuse(vllm_tp2):
    """Gemma, one layer: o_proj's all-reduce -> post_attention_layernorm (fused add, `w.float() + 1`) ->
    gate_up's MXFP8 quant. (The embedding's all-reduce is scaled by Gemma's normalizer before the first
    norm, so vLLM's pattern does not match there: that site is fused by mxfuse in both ranges.)"""
    compiled = compile_tp2(vllm_tp2, GEMMA, flashinfer_sm100)
    small = [p for p in compiled.pieces if p.small]
    large = [p for p in compiled.pieces if not p.small]
    assert len(small) == len(large) == 2, [(p.start, p.end) for p in compiled.pieces]

    sites = [s for p in small for s in fused_allreduce_sites(p.before)]
    assert len(sites) == 1, [str(p.before) for p in small]
    (site,) = sites
    assert site.index == 1  # fused add: the norm output is written in place into allreduce_in
    assert site.kwargs["norm_out"] is None and site.kwargs["weight_bias"] == 1.0
    assert site.kwargs["max_token_num"] == THRESHOLD_TOKENS and site.kwargs["world_size"] == 2
    assert isinstance(site.kwargs["rms_gamma"], fx.Node)  # the raw weight: `weight_bias` carries Gemma's + 1
    assert site.kwargs["rms_gamma"].meta["val"].dtype == torch.bfloat16

    refused_piece = next(p for p in small if fused_allreduce_sites(p.before))
    refused = _skips(refused_piece, SharedCode.ALLREDUCE_FUSED)
    assert set(refused) == {site.y}, refused_piece.report.skipped
    skip = refused[site.y]
    assert skip.rewrite == "norm_quant" and skip.producer_kind == "flashinfer_allreduce:fused_add"
    assert f"max_token_num={THRESHOLD_TOKENS}" in skip.reason and FLASHINFER_OP in skip.reason
    assert not _norm_sites(refused_piece)  # no other norm to fuse in that piece ...
    assert _as_vllm_left_it(refused_piece)  # ... and the refusal left vLLM's fused node as it was

    # the ranges above max_token_num keep the plain form, which mxfuse fuses
    assert not any(fused_allreduce_sites(p.before) for p in large)
    plain = [s for p in large for s in norm_quant_sites(p.before)]
    assert [(s.norm, s.gemma) for s in plain] == [("rms_norm", True), ("fused_add_rms_norm", True)], plain
    assert sum(len(_norm_sites(p)) for p in large) == 2
    assert not any(_skips(p, SharedCode.ALLREDUCE_FUSED) for p in large)

    # the one warning of that graph names the site, the reason and the fix
    warned = [w for w in compiled.warnings if "flashinfer_allreduce:fused_add" in w]
    assert len(warned) == 1, compiled.warnings
    assert "fuse_allreduce_rms" in warned[0] and "above max_token_num" in warned[0]


def test_flashinfer_standard_norm_forms(vllm_tp2):
    """Llama, one layer: the embedding's all-reduce -> input_layernorm (plain: `norm_out` given, output
    getitem[3]) and o_proj's all-reduce -> post_attention_layernorm (fused add, getitem[1]), both with the
    model-dtype weight and no `weight_bias`."""
    compiled = compile_tp2(vllm_tp2, LLAMA, flashinfer_sm100)
    small = [p for p in compiled.pieces if p.small]
    sites = sorted((s for p in small for s in fused_allreduce_sites(p.before)), key=lambda s: -s.index)
    assert [s.index for s in sites] == [3, 1], [str(p.before) for p in small]
    plain, fused_add = sites
    assert plain.kwargs["norm_out"] is not None and fused_add.kwargs["norm_out"] is None
    assert all("weight_bias" not in s.kwargs for s in sites)
    kinds = {s.node: s.producer_kind for p in small for s in _skips(p, SharedCode.ALLREDUCE_FUSED).values()}
    assert kinds == {plain.y: "flashinfer_allreduce:plain", fused_add.y: "flashinfer_allreduce:fused_add"}
    assert all(not _norm_sites(p) and _as_vllm_left_it(p) for p in small)
    large = [p for p in compiled.pieces if not p.small]
    assert not any(fused_allreduce_sites(p.before) for p in large)
    assert [s.norm for p in large for s in norm_quant_sites(p.before)] == ["rms_norm", "fused_add_rms_norm"]


def test_explain_names_the_refusal_and_its_fix(vllm_tp2):
    from mxfuse.passes.explain import explain_run
    from mxfuse.passes.options import PassOptions

    compiled = compile_tp2(vllm_tp2, dataclasses.replace(LLAMA, name="llama_tp2_explain"), flashinfer_sm100)
    verdicts = [v for p in compiled.pieces if p.small for v in explain_run(p.before, p.report, PassOptions())]
    refused = [v for v in verdicts if v.code is SharedCode.ALLREDUCE_FUSED]
    assert {v.kind for v in refused} == {"flashinfer_allreduce:plain", "flashinfer_allreduce:fused_add"}
    assert all(not v.fused and "fuse_allreduce_rms" in v.fix for v in refused), refused


AITER_GEMMA = dataclasses.replace(GEMMA, name="gemma_tp2_aiter", kernel=ROCM)


def test_aiter_gemma_form_is_refused_and_larger_ranges_fuse(vllm_tp2):
    compiled = compile_tp2(vllm_tp2, AITER_GEMMA, rocm_aiter, patches=[_rocm_launch()])
    small = [p for p in compiled.pieces if p.small]
    large = [p for p in compiled.pieces if not p.small]
    sites = [s for p in small for s in fused_allreduce_sites(p.before)]
    assert len(sites) == 1 and sites[0].index == 0, [str(p.before) for p in small]
    refused = {s.node: s for p in small for s in _skips(p, SharedCode.ALLREDUCE_FUSED).values()}
    assert set(refused) == {sites[0].y}
    assert refused[sites[0].y].producer_kind == "aiter_allreduce:fused_add"
    assert "max_token_num" in refused[sites[0].y].reason and AITER_OP in refused[sites[0].y].reason
    assert not any(fused_allreduce_sites(p.before) for p in large)
    assert sum(len(_norm_sites(p)) for p in large) == 2


def test_sequence_parallel_and_the_allreduce_fusion_take_each_site_once(vllm_tp2):
    """`sequence_parallel=True` with vLLM's all-reduce fusion (ROCm: AITER's fusion, row-major scales, which
    the sequence-parallel rewrite gathers at any token count; with sm100's swizzled scales it refuses a
    symbolic token count by itself): in the small ranges vLLM's fused node
    holds the all-reduce and the norm (mxfuse refuses it and leaves it), in the large ranges the
    sequence-parallel rewrite takes the all-reduce -> norm sites; no node is taken twice."""
    case = dataclasses.replace(AITER_GEMMA, name="gemma_tp2_aiter_sp")
    options = {"sequence_parallel": True}
    compiled = compile_tp2(vllm_tp2, case, rocm_aiter, patches=[_rocm_launch()], options=options)
    by_rewrite: dict[str, list] = {}
    for piece in compiled.pieces:
        names = [n for a in piece.report.applied for n in {a.site, *a.replaced}]
        assert len(names) == len(set(names)), piece.report.applied  # no node taken by two sites
        refused = set(_skips(piece, SharedCode.ALLREDUCE_FUSED))
        assert not refused & _touched(piece)
        for a in piece.report.applied:
            by_rewrite.setdefault(a.rewrite, []).append((piece.small, a.site))
        for site in fused_allreduce_sites(piece.before):
            assert site.y in refused and site.y in {n.name for n in piece.after.nodes}  # as vLLM left it
        piece.after.lint()
    sp_skips = [(p.small, s) for p in compiled.pieces for s in p.report.skipped if s.rewrite == "sequence_parallel"]
    assert {small for small, _ in by_rewrite.get("sequence_parallel", [])} == {False}, (by_rewrite, sp_skips)
    refused_small = [s for p in compiled.pieces if p.small for s in _skips(p, SharedCode.ALLREDUCE_FUSED)]
    assert len(refused_small) == 1
