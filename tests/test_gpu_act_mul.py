"""GPU tests of the act·mul kernel (mxfuse/ops/triton_act_quant.py; docs/design.md, "act·mul producers").

What is asserted, on CUDA, through `torch.ops.mxfuse.*`:

- fused vs. unfused project ops: BITWISE (codes, scales, y): `act_mul_mxfp8` /
  `act_mul_pair_mxfp8` against `act_mul` then `mxfp8_quantize`, every activation,
  `round_each_op` both ways, both layouts, both rules, bf16 and fp16, gate_up in both half
  orders and a strided gate_up; M from 1 to 4096 (every tiling regime of
  `act_mul_config`), I a multiple of 32 that is no power of two (column masking, swizzled
  padding columns) up to 17408 / 8.
- batch invariance: a row's bits do not depend on M (the tiling changes with M).
- the kernel vs. the CPU reference (torch's own functions): y within one ulp of the dtype
  where the reference is finite, the same NaN positions; codes within one e4m3 step where
  the scales agree (the bound of docs/design.md).

Runs without vLLM. Marked `gpu`, skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, gpu_test

import mxfuse.ops  # noqa: F401
from mxfuse.ops.activations import ACTIVATIONS
from mxfuse.testing import assert_bitwise, assert_same_values

ops = torch.ops.mxfuse


def gate_up_rows(m: int, i: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """`[m, 2I]` with hard cases planted: zeros, huge, tiny, NaN / Inf, values beyond the clamp."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * i, generator=g) * 4
    cases = [
        lambda r: r.zero_(),
        lambda r: r.mul_(1e4),
        lambda r: r.mul_(1e-30),
        lambda r: r.__setitem__(3, float("nan")),
        lambda r: r.__setitem__(i + 5, float("inf")),
        lambda r: r.__setitem__(7, float("-inf")),
        lambda r: r[:32].mul_(100.0),
    ]
    for row, case in zip(x, cases):
        case(row)
    return x.to(dtype).to(DEVICE)


SHAPES = [(1, 192), (3, 1792), (16, 2176), (130, 96), (257, 1536), (4096, 224)]


@gpu_test
@pytest.mark.parametrize("m,i", SHAPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_unfused_bitwise(m, i, activation, dtype):
    x = gate_up_rows(m, i, dtype, seed=m + i)
    for round_each_op in (True, False):
        kw = dict(round_each_op=round_each_op)
        y = ops.act_mul(x, activation, **kw)
        for swizzled in (False, True):
            for rule in (0, 1):
                want = (*ops.mxfp8_quantize(y, swizzled, rule), y)
                got = ops.act_mul_mxfp8(x, activation, True, swizzled, True, rule, **kw)
                assert_bitwise(got, want, f"{activation} swz={swizzled} rule={rule} round={round_each_op}")
        gate, up = x[:, :i].contiguous(), x[:, i:].contiguous()
        assert_bitwise(ops.act_mul_pair(gate, up, activation, **kw), y, "pair y")
        assert_bitwise(ops.act_mul_pair_mxfp8(gate, up, activation, **kw)[:2], ops.mxfp8_quantize(y), "pair")
        swapped = torch.cat((up, gate), dim=-1)
        assert_bitwise(ops.act_mul(swapped, activation, gate_first=False, **kw), y, "gate_first=False")


@gpu_test
def test_strided_gate_up():
    wide = gate_up_rows(37, 3 * 64)
    x = wide[:, : 2 * 128]
    assert_bitwise(ops.act_mul_mxfp8(x, "silu", emit_y=True), ops.act_mul_mxfp8(x.contiguous(), "silu", emit_y=True))


@gpu_test
@pytest.mark.parametrize("i", [1792, 17408])
def test_batch_invariant(i):
    x = gate_up_rows(4096, i, seed=11)
    full = ops.act_mul_mxfp8(x, "silu", emit_y=True)
    for m in (1, 16, 300):
        part = ops.act_mul_mxfp8(x[:m], "silu", emit_y=True)
        assert_bitwise(part, tuple(t[:m] for t in full), f"M={m}")


def e4m3_ordinal(codes: torch.Tensor) -> torch.Tensor:
    """Codes as signed ordinals (sign-magnitude -> integer): neighbours differ by 1, +0 and -0 are 0."""
    b = codes.view(torch.uint8).int()
    return torch.where(b >= 128, -(b - 128), b)


@gpu_test
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("round_each_op", [True, False])
def test_kernel_within_the_bound_of_the_reference(activation, round_each_op):
    """docs/design.md, "act·mul producers": y within one ulp of the dtype of the CPU reference
    (torch's own functions), plus, for GELU-tanh, `2**-21 * |gate * up|` (tanh's absolute error
    near -1, where `1 + tanh` cancels); codes within one e4m3 step where the scales agree."""
    x = gate_up_rows(512, 1536, seed=3)
    codes, scales, y = ops.act_mul_mxfp8(x, activation, emit_y=True, round_each_op=round_each_op)
    xc = x.cpu()
    ref_y = ops.act_mul(xc, activation, round_each_op=round_each_op)
    got = y.cpu()
    assert torch.equal(got.isnan(), ref_y.isnan())
    finite = ref_y.isfinite()
    inf = ref_y.isinf()
    assert torch.equal(got[inf], ref_y[inf])
    a, b = got[finite].float(), ref_y[finite].float()
    up = torch.nextafter(ref_y, torch.full_like(ref_y, float("inf"))).float() - ref_y.float()
    down = ref_y.float() - torch.nextafter(ref_y, torch.full_like(ref_y, float("-inf"))).float()
    ulp = torch.maximum(up.abs(), down.abs())[finite]  # either neighbour
    bound = ulp
    if activation == "gelu_tanh":
        gu = (xc[:, :1536].float() * xc[:, 1536:].float()).abs()[finite]
        bound = ulp + 2.0**-21 * gu
    assert ((a - b).abs() <= bound).all(), f"{activation}: y beyond the bound of the reference"
    differ = (a != b).float().mean().item()
    assert differ < 0.01, f"{activation}: {differ:.4f} of y differ from the reference (expected a last-bit rarity)"
    ref_codes, ref_scales = ops.mxfp8_quantize(ref_y)
    same_scale = scales.cpu() == ref_scales
    assert same_scale.float().mean().item() > 0.99
    blocks = same_scale.repeat_interleave(32, dim=1) & finite
    step = (e4m3_ordinal(codes.cpu()) - e4m3_ordinal(ref_codes)).abs()
    assert (step[blocks] <= 1).all()


DISPATCH_IS = [14336, 17408, 3584, 4352, 1792, 2176, 1536, 96]
"""tools/bench_kernels.py's I (Llama-3.1-8B, a Qwen3.5-27B-sized MLP, their TP shards) and a masked tail."""


def every_launch_shape(i: int) -> set:
    """Every `ActMulConfig` the dispatch picks for I on this GPU (M from 1 to 16384) or with a smaller SM
    count, and the benchmark's other launch shapes (8 values a thread at small M or at large M on a slower memory,
    2 or 1 at decode sizes, no halving at decode sizes, more or fewer values per program, 8 warps, the column-first
    grid, Triton's own bf16 -> fp32 converts, 16 codes per thread, 32 registers a thread, one warp a row, one row a
    program on 4 or 8 warps)."""
    from mxfuse.ops.norm_quant_config import next_pow2
    from mxfuse.ops.triton_act_quant import ActMulConfig, act_mul_config

    sm = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    out = set()
    for m in (1, 4, 16, 64, 256, 1024, 4096, 16384):
        for count in (sm, 8):
            out.add(act_mul_config(m, i, count))
            out.add(act_mul_config(m, i, count, small_values=(8,)))
            out.add(act_mul_config(m, i, count, small_values=(2, 4, 8)))  # 2 a thread at decode sizes
            out.add(act_mul_config(m, i, count, small_values=(1, 2, 4, 8)))  # 1 a thread (4 warps a 128 columns)
            out.add(act_mul_config(m, i, count, dram_bytes_per_s=1e9))  # slow memory: 8 a thread at large M
            out.add(act_mul_config(m, i, count, min_programs_per_sm=0))  # no halving at decode sizes
            out.add(act_mul_config(m, i, count, tile_values=1024))
            out.add(act_mul_config(m, i, count, tile_values=2048))  # 16 a thread at every M
            out.add(act_mul_config(m, i, count, tile_values=2048)._replace(code_vector=16))  # ... 16 codes a thread
            out.add(act_mul_config(m, i, count, tile_values=4096, max_warps=8))
            out.add(act_mul_config(m, i, count, tile_values=2048, max_warps=8))
            out.add(act_mul_config(m, i, count, cols_first=False))
            out.add(act_mul_config(m, i, count)._replace(widen="cvt"))
            out.add(act_mul_config(m, i, count)._replace(code_vector=16))
            out.add(act_mul_config(m, i, count)._replace(max_registers=32))
            out.add(act_mul_config(m, i, count)._replace(join_loads=True))  # up's bits or'ed (with 0) into the gate's
    out |= {ActMulConfig(1, 512, 1, True), ActMulConfig(1, 256, 1, True)}  # one warp a row at decode sizes
    for cols in (1024, 2048):  # one row a program on 4 or 8 warps (the benchmark's "row1k" / "row2k")
        cols = min(cols, next_pow2(i))
        out.add(ActMulConfig(1, cols, max(1, cols // 256), True))
    return out


@gpu_test
@pytest.mark.parametrize("i", DISPATCH_IS)
def test_every_launch_shape_computes_the_same_bits(i):
    """Any tile (1..16 rows, 128..1024 columns, 1..8 warps, either grid order, either widening) gives the
    default's bits: codes, scales (both layouts, both rules) and y; the unfused y too."""
    from mxfuse.ops import triton_act_quant as taq

    x = gate_up_rows(300, i, seed=i)
    gate, up = x[:, :i], x[:, i:]
    for swizzled, rule in ((False, 0), (True, 1)):
        want = taq.act_mul(gate, up, "silu", swizzled=swizzled, emit_y=True, rule=rule)
        for cfg in every_launch_shape(i):
            got = taq.act_mul(gate, up, "silu", swizzled=swizzled, emit_y=True, rule=rule, config=cfg)
            assert_bitwise(got, want, f"I={i} {cfg} swz={swizzled}")
    y = taq.act_mul(gate, up, "gelu_tanh", quant=False)[2]
    for cfg in every_launch_shape(i):
        assert_bitwise(taq.act_mul(gate, up, "gelu_tanh", quant=False, config=cfg)[2], y, f"unfused {cfg}")


@gpu_test
def test_pdl_changes_no_bit():
    """The decode MLP of the project's kernels, gate_up GEMM -> fused act·mul -> down GEMM, each launched with
    programmatic dependent launch, back to back on one stream: the bits of the plain launches (the act·mul
    waits for the GEMM that writes gate_up before its first load, and the down GEMM for the act·mul)."""
    from mxfuse.ops import reference, triton_act_quant as taq, triton_gemm

    k, i = 256, 1792
    g = torch.Generator(device=DEVICE).manual_seed(11)
    guc, gus = reference.quantize_rows(0.05 * torch.randn(2 * i, k, device=DEVICE, generator=g))
    dc, ds = reference.quantize_rows(0.05 * torch.randn(k, i, device=DEVICE, generator=g))
    sm = torch.cuda.get_device_properties(DEVICE).multi_processor_count

    def mlp(m: int, xc: torch.Tensor, xs: torch.Tensor, pdl: bool) -> tuple:
        gu = triton_gemm.mxfp8_linear(xc, xs, guc, gus, torch.bfloat16,
                                      config=triton_gemm.gemm_config(m, 2 * i, k)._replace(pdl=pdl))  # fmt: skip
        cfg = taq.act_mul_config(m, i, sm)._replace(pdl=pdl)
        swizzled = taq.act_mul(gu[:, :i], gu[:, i:], "silu", swizzled=True, emit_y=True, config=cfg)
        codes, scales, y = taq.act_mul(gu[:, :i], gu[:, i:], "silu", emit_y=True, config=cfg)
        out = triton_gemm.mxfp8_linear(codes, scales, dc, ds, torch.bfloat16,
                                       config=triton_gemm.gemm_config(m, k, i)._replace(pdl=pdl))  # fmt: skip
        return gu, swizzled, codes, scales, y, out

    for m in (1, 16, 64, 300):
        xc, xs = reference.quantize_rows(torch.randn(m, k, device=DEVICE, generator=g))
        want = mlp(m, xc, xs, False)
        for _ in range(3):
            assert_bitwise(mlp(m, xc, xs, True), want, f"M={m} PDL")


@gpu_test
def test_fp32_silu_mul_is_inductors_code_for_vllms_native_form():
    """vLLM's `SiluAndMul.forward_native` compiled by Inductor (dynamic M, as vLLM compiles it) keeps fp32
    from the SiLU to the product; `round_each_op=False` is that arithmetic, bit for bit (`exp` libdevice's,
    the division Triton's `/`: mxfuse/ops/triton_fp32_math.py)."""
    from test_act_mul_ops import vllm_silu_and_mul

    compiled = torch.compile(vllm_silu_and_mul, dynamic=True)
    for m, i in ((4096, 1792), (257, 14336)):
        x = gate_up_rows(m, i, seed=m)
        assert_same_values(ops.act_mul(x, "silu", round_each_op=False), compiled(x), f"M {m} I {i}")


@gpu_test
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_bf16_activation_is_torch_eager_on_every_gate_value(activation):
    """With bf16 inputs and `round_each_op=True`, the SiLU and GELU-tanh of every one of the 65536 bf16 gate
    values (up = 1) are torch's eager CUDA bits, although the kernel divides as Inductor does (the rounding
    to bf16 hides the ulp; fp16 shows one SiLU value of 65536 an ulp apart, so fp16 has the bound only)."""
    import torch.nn.functional as F
    from test_act_mul_ops import every_value

    g = every_value(torch.bfloat16).to(DEVICE)
    eager = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    ours = ops.act_mul(torch.cat([g, torch.ones_like(g)], dim=1), activation, round_each_op=True)
    assert_same_values(ours, eager(g), f"{activation} of every bf16 gate value")
