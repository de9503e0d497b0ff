"""The gated producers' ops on CPU (mxfuse/ops/gated.py): contracts, bitwise fused == unfused + quant,
the reference against each source's own arithmetic, errors.

Sources, run on CPU:
- the gated attention output, `attn_out * torch.sigmoid(gate)` on bf16 / fp16 tensors (vLLM's
  `Qwen3NextAttention.forward` and Hugging Face's `Qwen3NextAttention` write the same line);
- vLLM's `RMSNormGated.forward_static` as Inductor's post-grad graph holds it (traced with Inductor's
  decompositions: `F.silu` becomes `z / (1 + exp(-z))`), and eager;
- Hugging Face's `Qwen3NextRMSNormGated` (eager and traced the same way).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import mxfuse  # noqa: F401
from mxfuse.ops import MxfuseInputError, gated, reference
from mxfuse.testing import assert_bitwise, bits

mx = torch.ops.mxfuse
FLT_MIN = torch.finfo(torch.float32).tiny


def special_rows(m: int, k: int, dtype=torch.bfloat16, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Random rows with the contract's hard cases planted in the first rows (as tests/test_ops.py)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * scale
    cases = [
        lambda r: r.zero_(),
        lambda r: r[:32].fill_(FLT_MIN),
        lambda r: r.mul_(3e37 if dtype == torch.bfloat16 else 6e4),
        lambda r: r.__setitem__(3, float("nan")),
        lambda r: r.__setitem__(5, float("inf")),
        lambda r: r.__setitem__(7, float("-inf")),
        lambda r: r[:32].mul_(1e4),
        lambda r: r.mul_(1e-30),
    ]
    for row, case in zip(x, cases):
        case(row)
    return x.to(dtype)


# ---------------------------------------------------------------- sigmoid_gate


SHAPES = [(0, 64), (1, 64), (3, 96), (37, 160), (130, 1024), (5, 6144)]


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("rule", [0, 1], ids=["default", "torchao"])
@pytest.mark.parametrize("round_gate", [True, False], ids=["round_gate", "fp32_gate"])
def test_sigmoid_gate_fused_equals_unfused_then_quant(m, k, swizzled, rule, round_gate):
    x, gate = special_rows(m, k), special_rows(m, k, seed=1, scale=6.0).roll(1, 0)
    y = mx.sigmoid_gate(x, gate, round_gate)
    expected = (*mx.mxfp8_quantize(y, swizzled, rule), y)
    assert_bitwise(mx.sigmoid_gate_mxfp8(x, gate, swizzled, True, rule, round_gate), expected)
    codes, scales, empty = mx.sigmoid_gate_mxfp8(x, gate, swizzled, False, rule, round_gate)
    assert_bitwise((codes, scales), expected[:2]) and empty.numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sigmoid_gate_is_the_sources_eager_arithmetic(dtype):
    """vLLM's and Hugging Face's `attn_output * torch.sigmoid(gate)` on tensors of the model dtype, bit for
    bit (the sigmoid is rounded to the dtype: `round_gate=True`)."""
    x, gate = special_rows(512, 256, dtype), special_rows(512, 256, dtype, seed=4, scale=8.0)
    ours, source = mx.sigmoid_gate(x, gate), x * torch.sigmoid(gate)
    nan = torch.isnan(source)
    assert torch.equal(torch.isnan(ours), nan)  # fp16: torch's half multiply returns another NaN payload
    assert_bitwise(ours[~nan], source[~nan])
    assert_bitwise(mx.sigmoid_gate(x, gate, False), (x.float() * torch.sigmoid(gate.float())).to(dtype))


def test_sigmoid_gate_rounding_is_a_real_parameter():
    """The two rounding orders differ on ordinary values (so the recognizer must pick the right one)."""
    x, gate = special_rows(256, 256, seed=5), special_rows(256, 256, seed=6, scale=4.0)
    assert not torch.equal(bits(mx.sigmoid_gate(x, gate, True)), bits(mx.sigmoid_gate(x, gate, False)))


# ---------------------------------------------------------------- gated_rms_norm


def gated_inputs(m, k, group, dtype=torch.bfloat16, full_weight=False, seed=0):
    x = special_rows(m, k, dtype, seed)
    z = special_rows(m, k, dtype, seed + 1, scale=4.0).roll(2, 0)
    g = torch.Generator().manual_seed(seed + 2)
    w = (1 + 0.1 * torch.randn(k if full_weight else group, generator=g)).to(dtype)
    return x, z, w


VARIANTS = [
    dict(),  # vLLM native
    dict(round_normalized=True, round_weighted=True),  # Hugging Face
    dict(norm_before_gate=False),
    dict(activation="sigmoid"),
]


@pytest.mark.parametrize("m,k,group", [(0, 128, 64), (1, 128, 128), (37, 256, 64), (130, 2048, 128), (5, 96, 96)])
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("rule", [0, 1], ids=["default", "torchao"])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_gated_rms_norm_fused_equals_unfused_then_quant(m, k, group, swizzled, rule, variant):
    x, z, w = gated_inputs(m, k, group, full_weight=variant == 2)
    kw = VARIANTS[variant]
    y = mx.gated_rms_norm(x, z, w, 1e-6, group, **kw)
    expected = (*mx.mxfp8_quantize(y, swizzled, rule), y)
    assert_bitwise(mx.gated_rms_norm_mxfp8(x, z, w, 1e-6, group, swizzled, True, rule, **kw), expected)


def test_gated_rms_norm_keeps_the_leading_shape_and_reads_row_strided_inputs():
    base_x, base_z, w = gated_inputs(24, 384, 128)
    x, z = base_x[:, :256], base_z[:, 128:]  # row strides 384
    x3, z3 = x.reshape(4, 6, 256), z.reshape(4, 6, 256)
    codes, scales, y = mx.gated_rms_norm_mxfp8(x3, z3, w, 1e-6, 128, False, True)
    assert codes.shape == (4, 6, 256) and scales.shape == (4, 6, 8) and y.shape == (4, 6, 256)
    c2, s2, y2 = mx.gated_rms_norm_mxfp8(x.contiguous(), z.contiguous(), w, 1e-6, 128, False, True)
    assert_bitwise((codes.reshape(24, 256), scales.reshape(24, 8), y.reshape(24, 256)), (c2, s2, y2))


def _inductor_graph(fn, *args):
    """`fn` traced to the ATen graph Inductor's post-grad passes see (its decompositions applied)."""
    from torch._inductor.decomposition import select_decomp_table

    return make_fx(fn, decomposition_table=select_decomp_table())(*args)


@pytest.fixture(scope="module")
def rms_norm_gated():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.layernorm import RMSNormGated

    return RMSNormGated


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm_is_vllms_compiled_arithmetic(rms_norm_gated, dtype, norm_before_gate, activation):
    """vLLM's `RMSNormGated` (Qwen3-Next's GDN: `[T, H, D]` input, `group_size=None`, so each head is a
    group) as the traced graph computes it, bit for bit: the fp32 arithmetic of `forward_static` with the
    silu decomposed."""
    t, h, d = 67, 4, 128
    x, z, w = gated_inputs(t, h * d, d, dtype)

    def source(x, z, w):
        return rms_norm_gated.forward_static(x, z, w, 1e-6, x.dtype, None, norm_before_gate, activation)

    graph = _inductor_graph(source, x.view(t, h, d), z.view(t, h, d), w)
    kw = dict(norm_before_gate=norm_before_gate, activation=activation)
    assert_bitwise(mx.gated_rms_norm(x, z, w, 1e-6, d, **kw), graph(x.view(t, h, d), z.view(t, h, d), w).view(t, -1))


def _hf_gated_norm(d, w):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    del transformers
    module = Qwen3NextRMSNormGated(d, eps=1e-6).to(w.dtype)
    module.weight.data.copy_(w)
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_rms_norm_is_hugging_faces_arithmetic(dtype):
    """`Qwen3NextRMSNormGated`: the normalized value rounded, times the model-dtype weight (a bf16 product),
    times the fp32 silu of the gate: `round_normalized=True, round_weighted=True`. Bitwise against its traced
    graph; against eager within one ulp of the dtype (eager's fp32 `F.silu` is not `z / (1 + exp(-z))`
    to the last bit on CPU: a different exp)."""
    t, h, d = 67, 4, 128
    x, z, w = gated_inputs(t, h * d, d, dtype)
    module = _hf_gated_norm(d, w)
    ours = mx.gated_rms_norm(x, z, w, 1e-6, d, round_normalized=True, round_weighted=True)
    with torch.no_grad():
        graph = _inductor_graph(module, x.view(t, h, d), z.view(t, h, d))
        assert_bitwise(ours, graph(x.view(t, h, d), z.view(t, h, d)).view(t, -1))
        eager = module(x.view(t, h, d), z.view(t, h, d)).view(t, -1)
    finite = torch.isfinite(eager) & torch.isfinite(ours)
    ulps = (bits(ours).int() - bits(eager).int()).abs()[finite]
    assert ulps.max() <= 1
    assert torch.equal(torch.isnan(ours), torch.isnan(eager))


def test_gated_rms_norm_roundings_are_real_parameters():
    x, z, w = gated_inputs(256, 512, 128, seed=9)
    native = mx.gated_rms_norm(x, z, w, 1e-6, 128)
    hf = mx.gated_rms_norm(x, z, w, 1e-6, 128, round_normalized=True, round_weighted=True)
    assert not torch.equal(bits(native), bits(hf))


def test_group_weight_and_full_weight_agree():
    x, z, w = gated_inputs(16, 512, 128)
    assert_bitwise(mx.gated_rms_norm(x, z, w, 1e-6, 128), mx.gated_rms_norm(x, z, w.repeat(4), 1e-6, 128))


def test_reference_is_the_grouped_formula():
    """The reference against a float64 evaluation of the formula (finite rows): within one bf16 ulp."""
    g = torch.Generator().manual_seed(3)
    x, z = torch.randn(64, 256, generator=g).bfloat16(), torch.randn(64, 256, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    xd, zd = x.double().view(64, 4, 64), z.double()
    n = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).view(64, 256)
    expected = n * w.double().repeat(4) * zd * torch.sigmoid(zd)
    ours = gated.gated_rms_norm_rows(x, z, w, 1e-6, 64).double()
    assert torch.allclose(ours, expected, rtol=2**-7, atol=1e-30)


# ---------------------------------------------------------------- schemas, fakes, errors


def test_fake_impls_give_the_real_shapes():
    x, z, w = gated_inputs(37, 256, 128)
    real = mx.gated_rms_norm_mxfp8(x, z, w, 1e-6, 128, True, True)
    real_gate = mx.sigmoid_gate_mxfp8(x, z, True, False)
    with FakeTensorMode() as mode:
        fx_, fz, fw = (mode.from_tensor(t) for t in (x, z, w))
        fake = mx.gated_rms_norm_mxfp8(fx_, fz, fw, 1e-6, 128, True, True)
        fake_gate = mx.sigmoid_gate_mxfp8(fx_, fz, True, False)
        fake_y = mx.gated_rms_norm(fx_, fz, fw, 1e-6, 128)
    for a, b in zip((*fake, *fake_gate), (*real, *real_gate)):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert fake_y.shape == x.shape and fake_y.dtype == x.dtype


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    x, z, w = (torch.randn(*s, generator=g).bfloat16() for s in ((8, 128), (8, 128), (64,)))
    torch.library.opcheck(mx.sigmoid_gate_mxfp8, (x, z, True, True, 1, False))
    torch.library.opcheck(mx.sigmoid_gate, (x, z))
    torch.library.opcheck(mx.gated_rms_norm_mxfp8, (x, z, w, 1e-6, 64, False, True, 0, True, "silu", True, True))
    torch.library.opcheck(mx.gated_rms_norm, (x, z, w, 1e-6, 64))


def _bad_cases():
    bf = torch.bfloat16
    x, z, w = gated_inputs(4, 128, 64)
    return [
        ("sigmoid_gate_mxfp8", lambda: mx.sigmoid_gate_mxfp8(x[:, :100], z[:, :100]), r"K=100 .*\(4, 100\)"),
        ("sigmoid_gate_mxfp8", lambda: mx.sigmoid_gate_mxfp8(x.float(), z.float()), r"float32"),
        ("sigmoid_gate", lambda: mx.sigmoid_gate(x, z[:2]), r"gate \(2, 128\) .* must match x \(4, 128\)"),
        ("sigmoid_gate_mxfp8", lambda: mx.sigmoid_gate_mxfp8(x, z.half()), r"gate .*float16"),
        ("sigmoid_gate_mxfp8", lambda: mx.sigmoid_gate_mxfp8(x, z, rule=7), r"rule=7"),
        ("gated_rms_norm", lambda: mx.gated_rms_norm(x, z, w, 1e-6, 48), r"group_size=48"),
        ("gated_rms_norm", lambda: mx.gated_rms_norm(x, z, w, 1e-6, 96), r"group_size=96 .*K=128"),
        ("gated_rms_norm_mxfp8", lambda: mx.gated_rms_norm_mxfp8(x, z, w[:32], 1e-6, 64), r"weight \(32,\)"),
        ("gated_rms_norm_mxfp8", lambda: mx.gated_rms_norm_mxfp8(x, z.to(bf)[:, :64], w, 1e-6, 64), r"z \(4, 64\)"),
        ("gated_rms_norm", lambda: mx.gated_rms_norm(x, z, w, -1.0, 64), r"eps=-1.0"),
        ("gated_rms_norm", lambda: mx.gated_rms_norm(x, z, w, 1e-6, 64, activation="gelu"), r"activation='gelu'"),
        ("gated_rms_norm", lambda: mx.gated_rms_norm(x, z, w.int(), 1e-6, 64), r"floating point"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_is_one_clear_error_from_real_and_fake(case):
    op, call, message = _bad_cases()[case]
    with pytest.raises(MxfuseInputError, match=rf"^mxfuse::{op}: .*{message}"):
        call()
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(MxfuseInputError, match=rf"^mxfuse::{op}: "):
        call()


def test_reference_quantizes_the_rounded_y():
    """The fused op quantizes `y` as rounded to the dtype, not the fp32 value before rounding."""
    x, z, w = gated_inputs(64, 256, 128, seed=11)
    codes, scales, y = mx.gated_rms_norm_mxfp8(x, z, w, 1e-6, 128, False, True)
    assert_bitwise((codes, scales), reference.mxfp8_quantize(y))


# ---------------------------------------------------------------- the kernels' index math (Triton's interpreter)

CHECK_KERNEL_LAYOUT = """
import torch
from mxfuse.ops import reference, triton_gated_quant as tg
from mxfuse.testing import poisoned_allocations

with poisoned_allocations():  # an output byte no program writes reads 0xAB
    g = torch.Generator().manual_seed(0)
    # M 130: two row tiles of F8_128x4, the second mostly padding; K 288: a masked tail tile; M 128: no padding rows
    for m, k, group, full in ((130, 384, 128, True), (130, 288, 96, False), (128, 128, 128, True)):
        x, z = (torch.randn(m, k, generator=g).bfloat16() for _ in range(2))
        w = torch.randn(k if full else group, generator=g).bfloat16()
        _, _, y = tg.gated_rms_norm(x, z, w, 1e-6, group, quant=False)
        _, _, gy = tg.sigmoid_gate(x, z, quant=False)
        for swizzled, rule in ((False, 0), (True, 1)):
            want = reference.mxfp8_quantize(y, swizzled, rule)
            codes = None
            for cfg in (None, tg.GatedNormConfig(1, 1), tg.GatedNormConfig(4, 2, 16)):  # other launch shapes
                c, scales, fy = tg.gated_rms_norm(x, z, w, 1e-6, group, quant=True, swizzled=swizzled, emit_y=True,
                                                  rule=rule, config=cfg)  # fmt: skip
                assert torch.equal(fy, y) and torch.equal(scales, want[1]), cfg
                codes = c if codes is None else codes
                assert torch.equal(c.view(torch.uint8), codes.view(torch.uint8)), cfg
            want = reference.mxfp8_quantize(gy, swizzled, rule)
            codes = None
            for cfg in (None, tg.GateConfig(2, 128, 1), tg.GateConfig(8, 128, 2, 8)):
                c, scales, fy = tg.sigmoid_gate(x, z, quant=True, swizzled=swizzled, emit_y=True, rule=rule,
                                                config=cfg)
                assert torch.equal(fy, gy) and torch.equal(scales, want[1]), cfg
                codes = c if codes is None else codes
                assert torch.equal(c.view(torch.uint8), codes.view(torch.uint8)), cfg
print("ok")
"""


def test_kernels_write_every_scale_byte_where_the_layout_puts_it():
    """Under Triton's interpreter (exact for integer work, not for bf16 / fp8 rounding): the fused kernels'
    scale bytes, row-major and F8_128x4 with their zero padding, groups that are not a power of two, are the
    reference quant's of the kernel's own y, and the fused kernel's y is the unfused one's; in other launch
    shapes (`config=`) too, with the default's codes (index math: every code lands where the default's does)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CHECK_KERNEL_LAYOUT], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_launch_shape_defaults_and_checks():
    """`config=None` is the dispatch's shape (the gate: the quant kernel's tile, cut to 8 values a thread where
    the act·mul takes 8; the norm: a function of G; both one row on one warp up to 8 such programs an SM); a
    given config
    reaches the launch (tile, warps, code layout, the register cap and PDL on NVIDIA only); a shape Triton
    cannot lay out is one clear error."""
    from mxfuse.ops import triton_gated_quant as tg
    from mxfuse.ops.norm_quant_config import quant_config

    def meta(*shape):
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16)

    h100 = 3.35e12  # 25 GB/s an SM: 8 values a thread at large M, as the act·mul
    decode = tg.GateConfig(1, 128, 1, 8)  # one row of 128 values on one warp
    warp_row = tg.GateConfig(1, 128, 4, 8)  # ... on 4 warps, one value a thread (NVIDIA, <= 1 program per 2 SMs)
    for m, k in ((1, 4096), (1, 96), (2, 4096), (16, 512), (1, 8448)):  # <= 66 programs
        assert tg.gate_config(k, m) == warp_row == tg.gate_config(k, m, dram=h100), (m, k)
        assert tg.gate_config(k, m, isa="portable") == decode, (m, k)
        assert tg.gated_norm_config(128, m, k) == tg.GatedNormConfig(1, 1, 8, groups_first=True), (m, k)
    for m, k in ((4, 4096), (4, 8192), (16, 2048), (64, 1024), (64, 512)):  # one row a program: <= 2 warps an SM
        row = tg.GateConfig(1, min(1024, k), min(1024, k) // 256, code_vector=8)
        assert tg.gate_config(k, m) == row, (m, k)
        assert tg.gate_config(k, m, isa="portable") == decode, (m, k)
    for m, k in ((16, 6144), (16, 8192), (64, 2048), (33, 4096), (256, 512), (1056, 128)):  # <= 8 programs an SM
        assert tg.gate_config(k, m) == decode == tg.gate_config(k, m, dram=h100), (m, k)
        assert tg.gated_norm_config(128, m, k) == tg.GatedNormConfig(1, 1, 8, groups_first=True), (m, k)
    assert tg.gate_config(4096, 33, sms=64) != decode and tg.gate_config(4096, 16, sms=64) == decode  # this GPU's SMs
    for m, k in ((64, 4096), (64, 8192), (256, 1024), (256, 2048), (1024, 512)):  # one row a program: <= 16 warps
        row = tg.GateConfig(1, min(1024, k), min(1024, k) // 256, code_vector=8)
        assert tg.gate_config(k, m) == row == tg.gate_config(k, m, dram=h100), (m, k)
        assert tg.gate_config(k, m, isa="portable").block_rows > 1, (m, k)  # NVIDIA only
    assert tg.gate_config(8192, 64, sms=64).block_rows > 1  # 2048 warps: 32 an SM on 64 SMs
    assert tg.gate_config(4096, 256).block_rows > 1 and tg.gate_config(1024, 1024).block_rows > 1  # 4096 warps
    la = tg.gate_launch(meta(1, 4096), meta(1, 4096), quant=True, isa="ptx")[1]
    assert la.constexprs["MX"].WARP_AMAX and la.num_warps == 4  # the block amax is one redux there
    assert not tg.gate_launch(meta(1, 4096), meta(1, 4096), quant=True, isa="portable")[1].constexprs["MX"].WARP_AMAX
    for cfg, pack in ((warp_row, 1), (tg.GateConfig(1, 128, 2, 8), 2), (decode, 4), (tg.GateConfig(2, 1024, 4), 4)):
        la = tg.gate_launch(meta(64, 4096), meta(64, 4096), quant=True, isa="ptx", config=cfg)[1]
        assert la.constexprs["RCP_PACK"] == pack, cfg  # the sigmoid's reciprocals: as many as divide a thread's
    assert tg.gated_norm_config(256, 1, 4096) == tg.GatedNormConfig(1, 2, 8, groups_first=True)  # 4 a thread
    assert tg.gated_norm_config(6144, 1, 6144) == tg.gated_norm_config(6144)  # wide groups: the default tile
    la = tg.gated_norm_launch(meta(1, 8192), meta(1, 8192), meta(128), 1e-6, 128, quant=True, isa="ptx")[1]
    assert (la.grid, la.constexprs["BM"], la.num_warps) == ((64, 1), 1, 1)
    rows = ((1056, 1024, 2, 2), (1024, 2048, 2, 2), (1024, 4096, 4, 2),
            (4096, 4096, 4, 2), (16384, 96, 16, 16), (65536, 96, 32, 16))  # fmt: skip
    for m, k, h200_rows, h100_rows in rows:
        q = quant_config(k, m)
        assert tg.gate_config(k, m) == tg.GateConfig(h200_rows, q.block_cols, q.num_warps, 16), (m, k)
        assert tg.gate_config(k, m, dram=h100) == tg.GateConfig(h100_rows, q.block_cols, q.num_warps, 16), (m, k)
        default = tg.gate_launch(meta(m, k), meta(m, k), quant=True, isa="ptx")[1]
        same = tg.gate_launch(meta(m, k), meta(m, k), quant=True, isa="ptx", config=tg.gate_config(k, m))[1]
        assert (default.grid, default.constexprs, default.num_warps) == (same.grid, same.constexprs, same.num_warps)
    default = tg.gated_norm_config(128)
    assert default == tg.gated_norm_config(128, 4096, 2048) == tg.gated_norm_config(128, 1057, 1024)
    assert default == tg.GatedNormConfig(*tg.gated_norm_tile(128)[1:], 16, groups_first=True)
    assert (default.block_rows, default.num_warps, default.code_vector, default.load_fence) == (32, 8, 16, True)
    la = tg.gated_norm_launch(meta(300, 2048), meta(300, 2048), meta(128), 1e-6, 128, quant=True, isa="ptx")[1]
    assert la.grid == (16, 10) and la.constexprs["ROW_AXIS"] == 1 and la.constexprs["LOAD_FENCE"]  # groups first
    cfg = tg.GateConfig(2, 512, 4, 8, 32)
    for isa, regs in (("ptx", 32), ("portable", 0)):
        la = tg.gate_launch(meta(300, 2048), meta(300, 2048), quant=True, isa=isa, config=cfg)[1]
        assert (la.grid, la.constexprs["BM"], la.constexprs["BC"], la.num_warps) == ((150, 4), 2, 512, 4)
        assert la.constexprs["MX"].CODE_VECTOR == 8 and la.max_registers == regs
    ncfg = tg.GatedNormConfig(16, 8, 16, 40)
    for isa, regs in (("ptx", 40), ("portable", 0)):
        la = tg.gated_norm_launch(meta(300, 2048), meta(300, 2048), meta(128), 1e-6, 128, quant=True, isa=isa,
                                  config=ncfg)[1]  # fmt: skip
        assert (la.grid, la.constexprs["BM"], la.constexprs["GP"], la.num_warps) == ((19, 16), 16, 128, 8)
        assert la.constexprs["MX"].CODE_VECTOR == 16 and la.max_registers == regs
    for isa, on in (("ptx", True), ("portable", False)):  # programmatic dependent launch: NVIDIA only
        gate = tg.gate_launch(meta(64, 2048), meta(64, 2048), quant=True, isa=isa,
                              config=tg.gate_config(2048, 64)._replace(pdl=True))[1]  # fmt: skip
        norm = tg.gated_norm_launch(meta(64, 2048), meta(64, 2048), meta(128), 1e-6, 128, quant=True, isa=isa,
                                    config=tg.gated_norm_config(128)._replace(pdl=True))[1]  # fmt: skip
        for la in (gate, norm):
            assert la.pdl is on and la.constexprs["PDL"] is on and la.options().get("launch_pdl", False) is on
    assert not tg.gate_launch(meta(4, 1024), meta(4, 1024), quant=True, isa="ptx")[1].pdl
    for bad in (tg.GateConfig(3, 1024, 8), tg.GateConfig(1, 64, 1), tg.GateConfig(1, 96, 1), tg.GateConfig(1, 1024, 32),
                tg.GateConfig(1, 1024, 4, 4)):  # fmt: skip
        with pytest.raises(ValueError, match="GateConfig"):
            tg.gate_launch(meta(4, 1024), meta(4, 1024), quant=True, isa="ptx", config=bad)
    for bad in (tg.GatedNormConfig(3, 8), tg.GatedNormConfig(32, 12), tg.GatedNormConfig(32, 8, 12)):
        with pytest.raises(ValueError, match="GatedNormConfig"):
            tg.gated_norm_launch(meta(4, 1024), meta(4, 1024), meta(128), 1e-6, 128, quant=True, isa="ptx", config=bad)
