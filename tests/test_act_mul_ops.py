"""The act·mul ops on CPU: each source's eager arithmetic bit for bit, fused == unfused, errors.

The sources are written out here as their modules write them (vLLM's `SiluAndMul` /
`GeluAndMul` / `SwigluStepAndMul` native forms, Hugging Face's `ACT2FN[act](gate) * up`
and gpt-oss's clamped SwiGLU in the model dtype, mxfuse's own `swiglu_oai` in fp32), run
eagerly in bf16 / fp16 on every value of the dtype's hard cases, and compared with the
ops' CPU impl, which is the reference of the fused ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_ops import special_rows
from torch._subclasses.fake_tensor import FakeTensorMode

import mxfuse  # noqa: F401
from mxfuse.models import swiglu_oai_native
from mxfuse.ops import MxfuseInputError
from mxfuse.ops.activations import ACTIVATIONS, SWIGLU_LIMIT, SWIGLU_OAI_ALPHA, act_mul_rows
from mxfuse.testing import assert_bitwise, assert_same_values

mx = torch.ops.mxfuse
DTYPES = [torch.bfloat16, torch.float16]


def every_value(dtype: torch.dtype, i: int = 256) -> torch.Tensor:
    """Every bit pattern of a 16-bit dtype (NaN, Inf, subnormals, -0 included) as `[*, i]` rows."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x.reshape(-1, i)


def gate_up_of(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate: every value of the dtype; up: scaled random values with special rows."""
    gate = every_value(dtype)
    up = special_rows(gate.shape[0], gate.shape[1], torch.float32, seed) * 4
    return gate, up.to(dtype)


# ------------------------------------------------------------- the sources, as written


def vllm_silu_and_mul(x):  # vllm/model_executor/layers/activation.py, SiluAndMul.forward_native
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def vllm_gelu_tanh_and_mul(x):  # GeluAndMul(approximate="tanh").forward_native
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def vllm_swiglu_step_and_mul(x, limit=SWIGLU_LIMIT):  # SwigluStepAndMul.forward_native (Step-3.5)
    gate, up = x.chunk(2, dim=-1)
    gate = F.silu(gate)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * up


def hf_gpt_oss(gate, up, alpha=SWIGLU_OAI_ALPHA, limit=SWIGLU_LIMIT):  # GptOssExperts, in the model dtype
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


SOURCES_GATE_UP = {
    "silu": vllm_silu_and_mul,
    "gelu_tanh": vllm_gelu_tanh_and_mul,
    "swiglu_step": vllm_swiglu_step_and_mul,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(SOURCES_GATE_UP))
def test_vllm_native_forms_are_round_each_op(activation, dtype):
    gate, up = gate_up_of(dtype)
    x = torch.cat((gate, up), dim=-1)
    assert_same_values(mx.act_mul(x, activation), SOURCES_GATE_UP[activation](x), activation)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_hugging_face_mlp_is_act_mul_pair(act, dtype):
    from transformers.activations import ACT2FN

    gate, up = gate_up_of(dtype, seed=1)
    activation = "silu" if act == "silu" else "gelu_tanh"
    assert_same_values(mx.act_mul_pair(gate, up, activation), ACT2FN[act](gate) * up, act)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_oss_swiglu_in_the_model_dtype_is_round_each_op(dtype):
    gate, up = gate_up_of(dtype, seed=2)
    up = (up.float() * 3).to(dtype)  # some beyond the +-7 clamp
    assert_same_values(mx.act_mul_pair(gate, up, "swiglu_oai"), hf_gpt_oss(gate, up), "gpt-oss")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfuse_swiglu_oai_is_fp32_one_rounding(dtype):
    gate, up = gate_up_of(dtype, seed=3)
    x = torch.cat((gate, up), dim=-1)
    assert_same_values(mx.act_mul(x, "swiglu_oai", round_each_op=False), swiglu_oai_native(x), "swiglu_oai_native")


def test_a_limit_the_dtype_cannot_hold_rounds_as_torch_clamps():
    gate, up = gate_up_of(torch.bfloat16, seed=4)
    x = torch.cat((gate, up), dim=-1)
    assert_same_values(mx.act_mul(x, "swiglu_step", limit=7.3), vllm_swiglu_step_and_mul(x, 7.3), "limit 7.3")
    assert_same_values(
        mx.act_mul_pair(gate, up, "swiglu_oai", alpha=1.3, limit=6.9), hf_gpt_oss(gate, up, 1.3, 6.9), "alpha/limit"
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gate_first_false_reads_the_second_half_as_gate(activation):
    gate, up = gate_up_of(torch.bfloat16, seed=5)
    want = mx.act_mul_pair(gate, up, activation)
    assert_bitwise(mx.act_mul(torch.cat((up, gate), dim=-1), activation, gate_first=False), want, "up|gate")
    assert_bitwise(mx.act_mul(torch.cat((gate, up), dim=-1), activation), want, "gate|up")


# ------------------------------------------------------------- fused == unfused


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("rule", [0, 1], ids=["default", "torchao"])
@pytest.mark.parametrize("round_each_op", [True, False])
def test_fused_is_act_mul_then_quant(activation, swizzled, rule, round_each_op):
    gate, up = gate_up_of(torch.bfloat16, seed=6)
    x = torch.cat((gate, up), dim=-1).reshape(4, -1, 512)  # 3-D, as the Transformers backend's
    kw = dict(round_each_op=round_each_op)
    y = mx.act_mul(x, activation, **kw)
    codes, scales = mx.mxfp8_quantize(y, swizzled, rule)
    fused = mx.act_mul_mxfp8(x, activation, True, swizzled, True, rule, **kw)
    assert_bitwise(fused, (codes, scales, y), "gate_up")
    pair = mx.act_mul_pair_mxfp8(
        gate.reshape(4, -1, 256), up.reshape(4, -1, 256), activation, swizzled, True, rule, **kw
    )
    assert_bitwise(pair, (codes, scales, y), "pair")
    assert mx.act_mul_mxfp8(x, activation, swizzled=swizzled, rule=rule, **kw)[2].numel() == 0


@pytest.mark.parametrize("m", [0, 1, 130])
def test_shapes_and_fake_impls_agree(m):
    x = torch.randn(m, 2 * 96, dtype=torch.bfloat16)
    for swizzled in (False, True):
        real = mx.act_mul_mxfp8(x, "silu", swizzled=swizzled, emit_y=True)
        with FakeTensorMode() as mode:
            fake = mx.act_mul_mxfp8(mode.from_tensor(x), "silu", swizzled=swizzled, emit_y=True)
        assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in fake]
    assert mx.act_mul(x, "gelu_tanh").shape == (m, 96)


def test_strided_halves_of_a_wider_buffer():
    """A gate_up that is a column slice of a wider tensor (row stride > 2I) reads the right values."""
    wide = torch.randn(7, 3 * 64, dtype=torch.bfloat16)
    x = wide[:, :128]
    assert_bitwise(mx.act_mul(x, "silu"), vllm_silu_and_mul(x.contiguous()), "strided")


def test_reference_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match="relu"):
        act_mul_rows(torch.zeros(1, 32), torch.zeros(1, 32), "relu")


# ------------------------------------------------------------- errors


def _bf16(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


BAD = [
    (lambda: mx.act_mul(torch.zeros(2, 65, dtype=torch.bfloat16), "silu"), "act_mul.*odd last dimension 65"),
    (lambda: mx.act_mul(torch.zeros(2, 96, dtype=torch.bfloat16), "silu"), "act_mul.*I=48 is not a multiple of 32"),
    (lambda: mx.act_mul(torch.zeros(2, 0, dtype=torch.bfloat16), "silu"), "act_mul.*I=0"),
    (lambda: mx.act_mul(torch.zeros(2, 64), "silu"), "act_mul.*float32.*bfloat16, float16"),
    (lambda: mx.act_mul(torch.zeros((), dtype=torch.bfloat16), "silu"), "act_mul.*scalar"),
    (lambda: mx.act_mul(torch.zeros(2, 64, dtype=torch.bfloat16), "relu"), "act_mul.*'relu' is not one of"),
    (lambda: mx.act_mul(torch.zeros(2, 64, dtype=torch.bfloat16), "swiglu_step", limit=-1.0), "limit=-1.0"),
    (lambda: mx.act_mul(torch.zeros(2, 64, dtype=torch.bfloat16), "swiglu_oai", alpha=float("nan")), "alpha=nan"),
    (
        lambda: mx.act_mul_pair(
            torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16), "silu"
        ),
        "act_mul_pair.*up .*must match gate",
    ),
    (
        lambda: mx.act_mul_pair(
            torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 32, dtype=torch.float16), "silu"
        ),
        "act_mul_pair.*must match gate",
    ),
    (
        lambda: mx.act_mul_pair_mxfp8(
            torch.zeros(2, 48, dtype=torch.float16), torch.zeros(2, 48, dtype=torch.float16), "silu"
        ),
        "act_mul_pair_mxfp8.*I=48",
    ),
    (lambda: mx.act_mul_mxfp8(torch.zeros(2, 64, dtype=torch.bfloat16), "silu", rule=7), "act_mul_mxfp8.*rule=7"),
]


@pytest.mark.parametrize("call,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_clear_error(call, message):
    with pytest.raises(MxfuseInputError, match=message):
        call()


def test_fake_impls_raise_the_same_errors():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(2, 65, dtype=torch.bfloat16))
        with pytest.raises(MxfuseInputError, match=r"act_mul_mxfp8.*odd"):
            mx.act_mul_mxfp8(x, "silu")


def test_inference_only():
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(MxfuseInputError, match="act_mul_mxfp8 has no backward"):
        mx.act_mul_mxfp8(x, "silu")[0].float().sum().backward()


# ------------------------------------------------------------- the kernel's index math (Triton's interpreter)

CHECK_KERNEL_LAYOUT = """
import torch
from mxfuse.ops import reference, triton_act_quant as taq
from mxfuse.ops.triton_act_quant import ActMulConfig
from mxfuse.testing import poisoned_allocations

with poisoned_allocations():  # an output byte no program writes reads 0xAB
    g = torch.Generator().manual_seed(0)
    # 384: 128- and 256-column blocks divide I; 96: a masked tail block; M 128: no padding rows
    for m, i in ((130, 384), (37, 96), (128, 128)):
        x = torch.randn(m, 2 * i, generator=g).bfloat16()
        gate, up = x[:, :i], x[:, i:]  # halves of one buffer: a row stride of 2I
        configs = [taq.act_mul_config(m, i, 64), ActMulConfig(4, 128, 2, True), ActMulConfig(2, 512, 4),
                   ActMulConfig(2, 128, 1, True, join_loads=True),  # up's bits or'ed (with 0) into the gate's
                   ActMulConfig(1, 2048, 8, True)]  # one row a program, wider than I (the benchmark's "row2k")
        _, _, y = taq.act_mul(gate, up, "silu", quant=False)
        for swizzled, rule in ((False, 0), (True, 1)):
            want = reference.mxfp8_quantize(y, swizzled, rule)
            for cfg in configs:
                assert torch.equal(taq.act_mul(gate, up, "silu", quant=False, config=cfg)[2], y), cfg
                codes, scales, fy = taq.act_mul(gate, up, "silu", swizzled=swizzled, emit_y=True, rule=rule, config=cfg)
                assert torch.equal(fy, y), cfg
                assert torch.equal(scales, want[1]), (cfg, swizzled)
                assert codes.shape == want[0].shape, cfg
print("ok")
"""


H100_DRAM = 3.35e12
"""An H100 SXM's peak DRAM bandwidth: 25 GB/s an SM, below FAST_DRAM_BYTES_PER_S_PER_SM (the H200: 37)."""


def test_dispatch_blocks_divide_the_intermediate_size():
    """BC is the largest power of two <= 1024 dividing I (I % 128 == 0), BM * BC the tile, halved at decode
    sizes while the grid has fewer than two programs per SM; at large M 16 values a thread (2048 a tile) on
    fast memory (the nominal H200's), 8 (1024 a tile) on an H100's."""
    from mxfuse.ops.triton_act_quant import ActMulConfig, act_mul_config

    for i, bc in ((14336, 1024), (17408, 1024), (3584, 512), (4352, 256), (1792, 256), (2176, 128), (1536, 512)):
        for m in (4096, 16384):
            # 16 codes a thread on multi-row tiles of <= 512 columns whose launch's codes fit in half the L2
            wide_codes = 16 if bc <= 512 and m * i <= 25 * 2**20 else 8
            assert act_mul_config(m, i, 132) == ActMulConfig(2048 // bc, bc, 4, True, code_vector=wide_codes)
            assert act_mul_config(m, i, 132, dram_bytes_per_s=H100_DRAM) == ActMulConfig(1024 // bc, bc, 4, True)
        assert act_mul_config(16384, i, 132, l2_bytes=2**30).code_vector == (16 if bc <= 512 else 8)
        assert i % act_mul_config(1, i, 132).block_cols == 0
    assert act_mul_config(1, 14336, 132) == ActMulConfig(1, 128, 1, True)  # 112 programs: the most there are
    assert act_mul_config(1, 14336, 132, min_programs_per_sm=0) == ActMulConfig(1, 512, 4, True)  # not halved
    for m in (1, 4, 16, 64, 256):
        cfg = act_mul_config(m, 1792, 132)
        programs = -(-m // cfg.block_rows) * (1792 // cfg.block_cols)
        assert programs >= 264 or (cfg.block_rows, cfg.block_cols) == (1, 128), (m, cfg)
    masked_tail = act_mul_config(65536, 96, 132)  # the power of two over I
    assert masked_tail == ActMulConfig(16, 128, 4, True, code_vector=16)
    wide = act_mul_config(4096, 1792, 132, tile_values=4096, max_warps=8)
    assert wide == ActMulConfig(16, 256, 8, True, code_vector=16)


def test_default_launch_joins_gelu_tanh_loads_only_where_it_was_measured_to_pay():
    """`join_loads_pays`: on NVIDIA, GELU-tanh swizzled at M <= 16 and its one-row tiles from M 256 (H100, run
    21); never SiLU, row-major decode, M 17-255, tiles of several rows or another ISA. The default launch carries
    the decision; an explicit config keeps its own."""
    from mxfuse.ops.triton_act_quant import act_mul_config, act_mul_launch, join_loads_pays

    h100 = dict(dram_bytes_per_s=H100_DRAM)
    one_row = act_mul_config(1024, 21504, 132, **h100)
    two_rows = act_mul_config(256, 10240, 132)
    assert (one_row.block_rows, two_rows.block_rows) == (1, 2)
    decode = act_mul_config(1, 21504, 132)
    assert join_loads_pays("gelu_tanh", True, 1, decode) and join_loads_pays("gelu_tanh", True, 16, decode)
    assert not join_loads_pays("gelu_tanh", False, 1, decode)
    assert not join_loads_pays("gelu_tanh", True, 64, act_mul_config(64, 21504, 132, **h100))
    assert join_loads_pays("gelu_tanh", False, 1024, one_row) and join_loads_pays("gelu_tanh", True, 256, one_row)
    assert not join_loads_pays("gelu_tanh", False, 256, two_rows)
    for act in ("silu", "swiglu_step", "swiglu_oai"):
        assert not any(join_loads_pays(act, swz, m, decode) for swz in (False, True) for m in (1, 1024))
    assert not join_loads_pays("gelu_tanh", True, 1, decode, "portable")  # ptxas's late load: measured on NVIDIA only

    gate_up = torch.empty(1, 2 * 21504, device="meta", dtype=torch.bfloat16)
    halves = (gate_up[:, :21504], gate_up[:, 21504:])
    joined = {swz: act_mul_launch(*halves, "gelu_tanh", isa="ptx", swizzled=swz)[1].constexprs["JOIN_LOADS"]
              for swz in (False, True)}  # fmt: skip
    assert joined == {False: False, True: True}
    explicit = act_mul_launch(*halves, "gelu_tanh", isa="ptx", swizzled=True, config=decode)[1]
    assert explicit.constexprs["JOIN_LOADS"] is False


def test_default_launch_caps_registers_only_where_it_was_measured_to_pay():
    """`load_first_registers`: on NVIDIA, 40 for SiLU's tiles of 8 values a thread and GELU-tanh's of several rows
    up to 4M values (H100, run 25); none for 4 or 16 a thread, joined tiles, the clamped SwiGLUs or another ISA.
    The default launch carries it; an explicit config keeps its own."""
    from mxfuse.ops.triton_act_quant import (
        LOAD_FIRST_REGISTERS,
        act_mul_config,
        act_mul_launch,
        join_loads_pays,
        load_first_registers,
    )

    h100 = dict(dram_bytes_per_s=H100_DRAM)
    shard = act_mul_config(1024, 1536, 132, **h100)  # (2, 512, 4): 8 a thread, several rows
    wide = act_mul_config(1024, 14336, 132, **h100)  # (1, 1024, 4): 8 a thread, one row
    assert (shard.block_rows, wide.block_rows) == (2, 1)
    assert load_first_registers("silu", 1024, 1536, shard) == LOAD_FIRST_REGISTERS == 40
    assert load_first_registers("silu", 1024, 14336, wide) == 40
    assert load_first_registers("silu", 1, 14336, act_mul_config(1, 14336, 132)) == 0  # 4 a thread
    sixteen = act_mul_config(16384, 1536, 132)  # fast memory: 16 a thread
    assert sixteen.block_rows * sixteen.block_cols // (32 * sixteen.num_warps) == 16
    assert load_first_registers("silu", 16384, 1536, sixteen) == 0
    small_gelu = act_mul_config(1024, 2688, 132, **h100)
    assert small_gelu.block_rows > 1 and load_first_registers("gelu_tanh", 1024, 2688, small_gelu) == 40
    big_gelu = act_mul_config(1024, 5376, 132, **h100)  # 5.5M values: issue-bound at 1536 threads an SM
    assert big_gelu.block_rows > 1 and load_first_registers("gelu_tanh", 1024, 5376, big_gelu) == 0
    one_row_gelu = act_mul_config(1024, 21504, 132, **h100)
    assert join_loads_pays("gelu_tanh", False, 1024, one_row_gelu)
    assert load_first_registers("gelu_tanh", 1024, 21504, one_row_gelu._replace(join_loads=True)) == 0
    assert load_first_registers("gelu_tanh", 64, 21504, act_mul_config(64, 21504, 132, **h100)) == 0  # one row
    for act in ("swiglu_step", "swiglu_oai"):
        assert load_first_registers(act, 1024, 1536, shard) == 0  # not timed
    assert load_first_registers("silu", 1024, 1536, shard, "portable") == 0

    gate_up = torch.empty(1024, 2 * 1536, device="meta", dtype=torch.bfloat16)
    halves = (gate_up[:, :1536], gate_up[:, 1536:])
    default = act_mul_launch(*halves, "silu", isa="ptx")[1]
    assert default.max_registers == 40
    assert act_mul_launch(*halves, "silu", isa="ptx", config=shard)[1].max_registers == 0
    assert act_mul_launch(*halves, "silu", isa="portable")[1].max_registers == 0


def test_gelu_takes_the_sixteen_values_tile_where_it_is_issue_bound():
    """`issue_bound_tile`: GELU-tanh on NVIDIA, past 4M values where the dispatch took 8 values a thread, takes the
    16-values tile while that tile stores 16 codes a thread (H100, run 26: I 2688 M 2048-4096, I 5376 M 1024-4096);
    not at or below 4M values, not where the codes would not fit in half the L2 or the tile is 1024 columns wide,
    not on fast memory (16 a thread already), not SiLU, the clamped SwiGLUs or another ISA. The default launch carries
    it, without a cap or a join."""
    from mxfuse.ops.triton_act_quant import (
        act_mul_config,
        act_mul_launch,
        default_launch_config,
        issue_bound_tile,
        thread_values,
    )

    h100 = dict(sm_count=132, l2_bytes=50 * 2**20, dram_bytes_per_s=H100_DRAM)

    def tile(act, m, i, isa="ptx", **device):
        cfg = default_launch_config(act, m, i, swizzled=False, isa=isa, **{**h100, **device})
        return tuple(cfg[:3]), cfg.code_vector, thread_values(cfg), cfg.max_registers, cfg.join_loads

    assert tile("gelu_tanh", 2048, 2688) == ((16, 128, 4), 16, 16, 0, False)
    assert tile("gelu_tanh", 4096, 2688) == ((16, 128, 4), 16, 16, 0, False)
    assert tile("gelu_tanh", 1024, 5376) == ((8, 256, 4), 16, 16, 0, False)
    assert tile("gelu_tanh", 4096, 5376) == ((8, 256, 4), 16, 16, 0, False)  # 22M codes: within half of 50 MB
    assert tile("gelu_tanh", 1024, 2688)[2] == 8  # 2.75M values: the capped 8-values tile
    assert tile("gelu_tanh", 16384, 2688)[:3] == ((8, 128, 4), 8, 8)  # 44M codes: past half the L2
    assert tile("gelu_tanh", 4096, 10240)[2] == 8  # 1024 columns: no 16-codes tile
    assert tile("gelu_tanh", 4096, 2688, dram_bytes_per_s=4.8e12)[:3] == ((16, 128, 4), 16, 16)  # the dispatch's own
    for act in ("silu", "swiglu_step", "swiglu_oai"):
        assert tile(act, 4096, 2688)[2] == 8
    assert tile("gelu_tanh", 4096, 2688, isa="portable")[2] == 8

    eight = act_mul_config(4096, 2688, 132, dram_bytes_per_s=H100_DRAM)
    assert issue_bound_tile("gelu_tanh", 4096, 2688, eight, isa="ptx", sm_count=132) != eight
    gate_up = torch.empty(4096, 2 * 2688, device="meta", dtype=torch.bfloat16)
    halves = (gate_up[:, :2688], gate_up[:, 2688:])
    launch = act_mul_launch(*halves, "gelu_tanh", isa="ptx", config=eight)[1]
    assert (launch.constexprs["BM"], launch.num_warps) == (8, 4)  # an explicit config keeps its tile


def test_dispatch_takes_fewer_values_a_thread_while_the_launch_fits_the_resident_threads():
    """4 values a thread while M * I <= 4 * 2048 threads * SMs, 8 up to twice that; then 16 on fast memory
    per SM; on slower memory 16 up to a quarter of a wave more (one wave instead of a nearly empty second),
    then 8. The warps follow (the tile's values at that many a thread, at most 4)."""
    from mxfuse.ops.triton_act_quant import ActMulConfig, act_mul_config, values_per_thread
    from mxfuse.ops.triton_targets import dram_bytes_per_s

    for m, i, want in ((64, 14336, 4), (150, 14336, 8), (151, 14336, 16), (189, 14336, 16), (1024, 1792, 8),
                       (1206, 1792, 8), (1207, 1792, 16), (16384, 14336, 16)):  # fmt: skip
        assert values_per_thread(m, i, 132) == want, (m, i)
    for m, i, want in ((150, 14336, 8), (151, 14336, 16), (188, 14336, 16), (189, 14336, 8), (1508, 1792, 16),
                       (1509, 1792, 8), (1024, 2176, 16), (256, 14336, 8), (16384, 14336, 8)):  # fmt: skip
        assert values_per_thread(m, i, 132, dram_bytes_per_s=H100_DRAM) == want, (m, i)
    assert values_per_thread(64, 14336, 64) == 8  # fewer SMs: fewer resident threads
    assert values_per_thread(64, 14336, 132, (8,)) == 8
    assert dram_bytes_per_s(torch.device("meta")) == 4.8e12  # a described launch: the nominal H200's
    assert act_mul_config(16, 14336, 132) == ActMulConfig(1, 512, 4, True)  # 448 programs of 4 values a thread
    assert act_mul_config(64, 14336, 132) == ActMulConfig(1, 512, 4, True)
    assert act_mul_config(64, 17408, 132) == ActMulConfig(1, 1024, 4, True)  # 8 a thread
    assert act_mul_config(1024, 1792, 132) == ActMulConfig(4, 256, 4, True)
    one_wave = ActMulConfig(16, 128, 4, True, code_vector=16)
    assert act_mul_config(1024, 2176, 132, dram_bytes_per_s=H100_DRAM) == one_wave
    assert act_mul_config(256, 2176, 132) == ActMulConfig(4, 128, 4, True)
    assert act_mul_config(64, 1792, 132) == ActMulConfig(1, 256, 2, True)  # halved: 2 warps of 4 a thread
    for dram in (H100_DRAM, 4.8e12):
        for m in (1, 4, 16, 64, 256, 1024, 4096, 16384):
            for i in (14336, 17408, 3584, 4352, 1792, 2176, 1536):
                cfg = act_mul_config(m, i, 132, dram_bytes_per_s=dram)
                per_thread = cfg.block_rows * cfg.block_cols // (32 * cfg.num_warps)
                assert per_thread <= values_per_thread(m, i, 132, dram_bytes_per_s=dram), (m, i, cfg)


def test_pdl_and_a_register_cap_are_nvidia_launch_hints():
    """`ActMulConfig.pdl` launches with `launch_pdl` and the kernel's PDL constexpr (its `gdc_wait` before any
    load or store) on NVIDIA, `max_registers` with `maxnreg`; other targets (Triton's AMD backend has neither)
    drop both and launch the same kernel plainly. Off by default."""
    from mxfuse.ops import triton_act_quant as taq

    gate = torch.empty(4, 256, dtype=torch.bfloat16, device="meta")
    plain = taq.act_mul_config(4, 256, 132)
    assert not plain.pdl and not plain.max_registers
    cfg = plain._replace(pdl=True, max_registers=32)
    for isa, on in (("ptx", True), ("portable", False)):
        for quant in (True, False):
            _, launch = taq.act_mul_launch(gate, gate, "silu", isa=isa, quant=quant, swizzled=quant, config=cfg)
            opts = launch.options()
            assert launch.pdl is on and launch.constexprs["PDL"] is on, (isa, quant)
            assert opts.get("launch_pdl", False) is on and opts.get("maxnreg", 0) == (32 if on else 0), (isa, quant)
        _, launch = taq.act_mul_launch(gate, gate, "silu", isa=isa, config=plain)
        assert not launch.pdl and not launch.constexprs["PDL"] and "launch_pdl" not in launch.options()


def test_kernel_writes_every_scale_byte_where_the_layout_puts_it():
    """Under Triton's interpreter (exact for integer work, not for bf16 / fp8 rounding): for the dispatch's
    tiles and others (one or many rows, 128..2048 columns, either grid order, a masked tail block), the unfused
    y is the same, the fused y is it, and the scale bytes, row-major and F8_128x4 with their zero padding rows,
    are the reference quant's of that y."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CHECK_KERNEL_LAYOUT], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
