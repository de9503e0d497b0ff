"""The reference MiniMax-M3-style decoder stack (mxfuse.models) on CPU.

Checks: config shapes, determinism, shapes/dtypes, the MXFP8 linear and norm
modules, the post-grad graph the passes will see, compiled == eager bitwise
(several token counts), and the SP form with 2 gloo processes == non-SP rows bitwise.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import CapturingPass, edges as graph_edges

from mxfuse.models import (
    GemmaNorm,
    Model,
    ModelConfig,
    MXFP8Linear,
    compile_model,
    example_inputs,
    local_rows,
    swiglu_oai,
    swiglu_oai_native,
)
from mxfuse.ops import reference
from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE
from mxfuse.testing import assert_bitwise, bitwise_equal, run_ranks


@pytest.fixture
def fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


# ---------------------------------------------------------------- config


def test_config_shapes():
    tiny = ModelConfig.tiny()
    assert (tiny.hidden, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.head_dim) == (256, 2, 4, 2, 64)
    assert tiny.dtype == torch.bfloat16
    m3 = ModelConfig.m3_flash_tp4()
    assert m3.linear_shapes() == {
        "qkv_proj": (2560, 6144),
        "o_proj": (6144, 2048),
        "gate_up_proj": (8192, 6144),
        "down_proj": (6144, 4096),
    }
    for cfg in (tiny, m3):
        assert all(k % BLOCK == 0 for _, k in cfg.linear_shapes().values())
    assert ModelConfig.by_name("m3-flash-tp4", n_layers=1).n_layers == 1
    with pytest.raises(ValueError, match="multiple of 32"):
        ModelConfig.tiny(intermediate=100)
    with pytest.raises(ValueError, match="unknown model config"):
        ModelConfig.by_name("huge")


# --------------------------------------------------------------- modules


def test_mxfp8_linear_module():
    gen = torch.Generator().manual_seed(3)
    lin = MXFP8Linear(128, 96, gen)
    assert lin.weight_codes.dtype == FP8_DTYPE and lin.weight_codes.shape == (96, 128)
    assert lin.weight_scales.dtype == torch.uint8 and lin.weight_scales.shape == (96, 4)
    assert not list(lin.parameters())  # only quantized buffers are kept
    x = torch.randn(10, 128, generator=gen).bfloat16()
    y = lin(x)
    assert y.shape == (10, 96) and y.dtype == torch.bfloat16
    codes, scales = torch.ops.mxfuse.mxfp8_quantize(x)
    assert_bitwise(y, lin.forward_quantized(codes, scales, torch.bfloat16))
    # close to the bf16 product with the dequantized weight (MXFP8 activation error only)
    w = reference.dequantize(lin.weight_codes, lin.weight_scales)
    exact = x.float() @ w.T
    assert (y.float() - exact).norm() / exact.norm() < 0.08
    # leading dims are kept
    assert lin(x.view(2, 5, 128)).shape == (2, 5, 96)


def _quantized_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.endswith(("weight_codes", "weight_scales"))}


def test_dtype_casts_keep_the_mxfp8_weights():
    """`.to(dtype)` / `.half()` / `.float()` cast floating-point buffers, fp8 codes included: the
    codes and scales must come through with their dtypes and bytes (a cast code is a different weight)."""
    model = Model(ModelConfig.tiny(n_layers=1))
    ids = example_inputs(model.config, 7)
    before = {n: b.clone() for n, b in _quantized_buffers(model).items()}
    assert len(before) == 8
    with torch.no_grad():
        expected = model(ids)
        out = model.to(torch.bfloat16)(ids)  # a no-op on a bf16 model: same bits
        assert_bitwise(out, expected)
        for cast in (lambda m: m.to(torch.float16), lambda m: m.half(), lambda m: m.float(), lambda m: m.bfloat16()):
            cast(model)
            for name, buf in _quantized_buffers(model).items():
                assert buf.dtype == before[name].dtype, (name, buf.dtype)
                assert torch.equal(buf.view(torch.uint8), before[name].view(torch.uint8)), name
        half = model.to(torch.float16)(ids)  # activations, norm weights and embedding in fp16: still runs
        assert half.dtype == torch.float16 and torch.isfinite(half).all()
        assert_bitwise(model.to(torch.bfloat16)(ids), expected)
    lin = model.layers[0].qkv_proj.float()  # the linear alone takes fp32 activations
    assert lin(torch.randn(3, 256)).dtype == torch.float32
    assert lin.to("meta").weight_codes.dtype == FP8_DTYPE  # a device move still applies


def test_gemma_norm_module():
    gen = torch.Generator().manual_seed(4)
    norm = GemmaNorm(64, 1e-6, gen)
    x = torch.randn(6, 64, generator=gen).bfloat16()
    r = torch.randn(6, 64, generator=gen).bfloat16()
    assert_bitwise(norm(x), reference.gemma_rmsnorm(x, norm.w, 1e-6))
    y, res = norm(x, r)
    y_ref, res_ref = reference.gemma_fused_add_rmsnorm(x, r, norm.w, 1e-6)
    assert_bitwise(y, y_ref)
    assert_bitwise(res, res_ref)


def test_swiglu_oai():
    g = torch.tensor([-20.0, -1.0, 0.0, 1.0, 8.0, 30.0])
    u = torch.tensor([-9.0, 0.5, 2.0, -1.0, 9.0, 0.0])
    gu = torch.cat([g, u]).view(1, 12).bfloat16()
    out = swiglu_oai(gu)
    assert out.shape == (1, 6) and out.dtype == torch.bfloat16
    assert_bitwise(out, swiglu_oai_native(gu))
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    expected = (uc + 1) * gc * torch.sigmoid(1.702 * gc)
    torch.testing.assert_close(out.float().view(6), expected, rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------- model


def test_model_shapes_and_determinism():
    cfg = ModelConfig.tiny()
    ids = example_inputs(cfg, 48)
    assert ids.shape == (48,) and ids.dtype == torch.int64 and int(ids.max()) < cfg.vocab
    assert torch.equal(ids, example_inputs(cfg, 48))
    a, b = Model(cfg), Model(cfg)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name].view(torch.uint8), sb[name].view(torch.uint8)), name
    ya = a(ids)
    assert ya.shape == (48, cfg.hidden) and ya.dtype == torch.bfloat16
    assert torch.isfinite(ya.float()).all() and ya.float().std() > 0.1
    assert_bitwise(ya, b(ids))
    assert_bitwise(ya, a(ids))
    other = Model(cfg.replace(seed=1))(ids)
    assert not bitwise_equal(ya, other)
    # causal: the first rows do not depend on later tokens
    assert_bitwise(a(ids[:16]), ya[:16])
    # one token works
    assert a(ids[:1]).shape == (1, cfg.hidden)


def test_model_builds_on_meta_device():
    """The GPU configs trace without allocating: shapes of the m3 stack on the meta device."""
    cfg = ModelConfig.m3_flash_tp4(n_layers=1, vocab=1024)
    with torch.device("meta"):
        ids = torch.zeros(8, dtype=torch.int64)
    layer_model = Model(cfg, device="meta")
    assert layer_model(ids).shape == (8, 6144)
    lin = layer_model.layers[0].gate_up_proj
    assert lin.weight_codes.shape == (8192, 6144) and lin.weight_scales.shape == (8192, 192)


def _expected_counts(n_layers: int) -> dict[str, int]:
    return {
        "mxfuse::gemma_rmsnorm": 1,
        "mxfuse::gemma_fused_add_rmsnorm": 2 * n_layers,  # post-attention norms, layers >= 1, final norm
        "mxfuse::mxfp8_quantize": 4 * n_layers,
        "mxfuse::mxfp8_linear": 4 * n_layers,
    }


def test_compiled_equals_eager_dynamic_tokens(fresh_dynamo):
    cfg = ModelConfig.tiny()
    model = Model(cfg)
    recorder = CapturingPass(None)
    compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": recorder})
    for n in (64, 40, 96, 33):
        ids = example_inputs(cfg, n, seed=n)
        assert_bitwise(compiled(ids), model(ids))
    # Inductor compiled it (static, then once with a dynamic token dim) and the
    # post-grad graph holds the unfused norm -> quant -> GEMM chains the passes rewrite
    assert 1 <= recorder.calls <= 2, recorder.calls
    counts = recorder.after
    for op, n in _expected_counts(cfg.n_layers).items():
        assert counts[op] == n, (op, counts[op], n)
    assert counts["mxfuse_models::swiglu_oai"] == cfg.n_layers
    edges = graph_edges(recorder.graph)
    assert ("mxfuse::gemma_rmsnorm", "mxfuse::mxfp8_quantize") in edges
    assert ("mxfuse::gemma_fused_add_rmsnorm", "mxfuse::mxfp8_quantize") in edges
    assert ("mxfuse::mxfp8_quantize", "mxfuse::mxfp8_linear") in edges


def test_compile_model_helper_and_native_activation(fresh_dynamo):
    cfg = ModelConfig.tiny(n_layers=1, native_activation=True)
    model = Model(cfg)
    ids = example_inputs(cfg, 32)
    assert_bitwise(compile_model(model)(ids), model(ids))  # CPU: Inductor's fp32 SwiGLU matches eager
    import mxfuse

    if not hasattr(mxfuse, "post_grad_pass"):
        with pytest.raises(RuntimeError, match="post_grad_pass"):
            compile_model(model, {})
    else:  # the demo's third column: compiled with the mxfuse passes is still bitwise equal to eager
        torch.compiler.reset()
        assert_bitwise(compile_model(model, {})(ids), model(ids))


# -------------------------------------------------------------------- SP


def _sp_rank_body(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # no pool of compile workers per rank (the ranks share the cores)
    cfg = ModelConfig.tiny()
    full = Model(cfg)
    sp_model = Model(cfg, sp_group=dist.group.WORLD)
    results = {}
    for n in (32, 48):
        ids = example_inputs(cfg, n, seed=n)
        expected = local_rows(full(ids), rank, world)
        out = sp_model(local_rows(ids, rank, world))
        results[f"eager_{n}"] = bitwise_equal(out, expected)
    recorder = CapturingPass(None)
    compiled = torch.compile(sp_model, fullgraph=True, options={"post_grad_custom_post_pass": recorder})
    ids = example_inputs(cfg, 32, seed=32)
    out = compiled(local_rows(ids, rank, world))
    results["compiled_32"] = bitwise_equal(out, local_rows(full(ids), rank, world))
    counts, edges = recorder.after, graph_edges(recorder.graph)
    results["counts"] = dict(counts)
    results["edges"] = sorted(edges)
    dist.destroy_process_group()
    return results


@pytest.mark.distributed
def test_sp_gloo_matches_non_sp_rows():
    for rank, results in sorted(run_ranks(_sp_rank_body, 2).items()):
        assert results["eager_32"] and results["eager_48"], (rank, results)
        assert results["compiled_32"], (rank, results)
        counts = results["counts"]
        n_layers = ModelConfig.tiny().n_layers
        # two bf16 all-gathers per layer, as PyTorch functional collectives
        assert counts.get("_c10d_functional::all_gather_into_tensor") == 2 * n_layers, counts
        assert counts.get("_c10d_functional::wait_tensor") == 2 * n_layers, counts
        for op, n in _expected_counts(n_layers).items():
            assert counts.get(op) == n, (op, counts)
        edges = {tuple(e) for e in results["edges"]}
        assert ("_c10d_functional::wait_tensor", "mxfuse::mxfp8_quantize") in edges, edges
