"""GPU tests of the producers' fp32 arithmetic (mxfuse/ops/triton_fp32_math.py), NVIDIA only.

- `exp_f32` ("ptx": libdevice's `__nv_expf` written out, its saturate folded into an FMA) returns
  libdevice's bits on EVERY fp32 input (2**32 of them; NaN for NaN), `exp_neg_f32(v)` those of
  `exp(-v)` (the negation folded into the constants), and `tanh_f32` (branch-free) libdevice's `tanh`;
- `div_one_plus(n, e)` (`div.full.f32`'s scaled path at every divisor) returns the bits of Triton's
  `n / (1 + e)`: for the SiLU's `n = x, e = exp(-x)` on every fp32 x whose quarter is exact (all but those
  below 2**-124 in magnitude: the function's condition) and the sigmoid's `n = 1` on every fp32 x; and for
  random bf16 / fp16 numerators against random `e >= 0` of every exponent, inf, NaN and the 2**126 edge where
  `div.full` rescales;
- `rcp_rn_f32(d)` (ptxas's `rcp.rn.f32` fast path behind one test for PACK values) returns the bits of
  `div_rn(1, d)` on every fp32 d >= 1, inf and NaN, for every PACK, also with fast and slow values mixed in a
  pack; `sigmoid_f32(x, ROUNDED_DIV=True)` those of `div_rn(1, 1 + exp(-x))` on every fp32 x;
- `silu_f32` of every bf16 and every fp16 value is what Inductor computes for `F.silu` of fp32
  (torch.compile, default options: `libdevice.exp`, Triton's `/`), bit for bit.

Marked `gpu`, skipped without CUDA or on ROCm ("portable" is Triton's own code there).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from gpu_helpers import DEVICE, gpu_test
from test_act_mul_ops import every_value
from triton.language.extra import libdevice

from mxfuse.ops.triton_fp32_math import (
    RCP_RN_PACKS,
    div_one_plus,
    exp_f32,
    exp_neg_f32,
    rcp_rn_f32,
    sigmoid_f32,
    silu_f32,
    tanh_f32,
)
from mxfuse.testing import assert_same_values

pytestmark = pytest.mark.skipif(torch.version.hip is not None, reason="the 'ptx' arithmetic is NVIDIA's")

BLOCK = 4096
CHUNK = 1 << 28


@triton.jit
def _same_bits(a, b):
    return (a.to(tl.int32, bitcast=True) == b.to(tl.int32, bitcast=True)) | ((a != a) & (b != b))


@triton.jit
def _mismatches(count_ptr, first_bits, n, BLOCK: tl.constexpr):
    """count_ptr[0]: inputs where `exp_f32` is not libdevice's `exp`; [1]: where `exp_neg_f32(v)` is not
    libdevice's `exp(-v)` (Triton's `-v`: `0 - v`, what the SiLU and sigmoid computed before); [2]: where
    `tanh_f32` is not libdevice's `tanh`."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = (first_bits + offs).to(tl.uint32).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
    live = offs < n
    exp_same = _same_bits(exp_f32(v, "ptx"), libdevice.exp(v))
    tl.atomic_add(count_ptr, tl.sum(tl.where(live & ~exp_same, 1, 0), axis=0))
    neg_same = _same_bits(exp_neg_f32(v, "ptx"), libdevice.exp(-v))
    tl.atomic_add(count_ptr + 1, tl.sum(tl.where(live & ~neg_same, 1, 0), axis=0))
    tanh_same = _same_bits(tanh_f32(v, "ptx"), libdevice.tanh(v))
    tl.atomic_add(count_ptr + 2, tl.sum(tl.where(live & ~tanh_same, 1, 0), axis=0))


@triton.jit
def _div_pair(x_ptr, e_ptr, ours_ptr, triton_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    e = tl.load(e_ptr + offs, mask=mask, other=0.0)
    tl.store(ours_ptr + offs, div_one_plus(x, e, "ptx"), mask=mask)
    tl.store(triton_ptr + offs, x / (1.0 + e), mask=mask)


@triton.jit
def _division_mismatches(count_ptr, first_bits, n, BLOCK: tl.constexpr):
    """count_ptr[0]: fp32 x with an exact quarter (|x| >= 2**-124, or 0) where `div_one_plus(x, exp(-x))` is not
    Triton's `x / (1 + exp(-x))` (the SiLU); [1]: x where `div_one_plus(1, exp(-x))` is not `1 / (1 + exp(-x))`
    (the sigmoid)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = (first_bits + offs).to(tl.uint32)
    x = bits.to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
    live = offs < n
    quarter_exact = (((bits >> 23) & 0xFF) >= 3) | ((bits & 0x7FFFFFFF) == 0)
    e = exp_neg_f32(x, "ptx")
    silu_same = _same_bits(div_one_plus(x, e, "ptx"), x / (1.0 + e))
    tl.atomic_add(count_ptr, tl.sum(tl.where(live & quarter_exact & ~silu_same, 1, 0), axis=0))
    one = tl.full(x.shape, 1.0, tl.float32)
    sigmoid_same = _same_bits(div_one_plus(one, e, "ptx"), one / (1.0 + e))
    tl.atomic_add(count_ptr + 1, tl.sum(tl.where(live & ~sigmoid_same, 1, 0), axis=0))


@triton.jit
def _rcp_mismatches(count_ptr, first_bits, n, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """count_ptr[0]: fp32 d (bits from first_bits) where `rcp_rn_f32(d)` is not `div_rn(1, d)` bit for bit (NaN
    included); [1]: x where `sigmoid_f32(x, ROUNDED_DIV=True)` is not `div_rn(1, 1 + exp_neg_f32(x))`."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = (first_bits + offs).to(tl.uint32).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
    live = offs < n
    one = tl.full(v.shape, 1.0, tl.float32)
    rcp = rcp_rn_f32(v, "ptx", PACK).to(tl.int32, bitcast=True)
    rcp_same = rcp == tl.math.div_rn(one, v).to(tl.int32, bitcast=True)
    in_domain = (v >= 1.0) | (v != v)
    tl.atomic_add(count_ptr, tl.sum(tl.where(live & in_domain & ~rcp_same, 1, 0), axis=0))
    reference = tl.math.div_rn(one, 1.0 + exp_neg_f32(v, "ptx")).to(tl.int32, bitcast=True)
    sigmoid_same = sigmoid_f32(v, "ptx", ROUNDED_DIV=True, PACK=PACK).to(tl.int32, bitcast=True) == reference
    tl.atomic_add(count_ptr + 1, tl.sum(tl.where(live & ~sigmoid_same, 1, 0), axis=0))


@triton.jit
def _rcp_pair(d_ptr, ours_ptr, theirs_ptr, n, BLOCK: tl.constexpr, PACK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(d_ptr + offs, mask=mask, other=1.0)
    tl.store(ours_ptr + offs, rcp_rn_f32(d, "ptx", PACK), mask=mask)
    tl.store(theirs_ptr + offs, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d), mask=mask)


@triton.jit
def _silu(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, silu_f32(tl.load(x_ptr + offs, mask=mask, other=0.0), "ptx"), mask=mask)


def every_bf16_as_fp32() -> torch.Tensor:
    return every_value(torch.bfloat16).float().flatten().to(DEVICE)


def every_fp16_as_fp32() -> torch.Tensor:
    return every_value(torch.float16).float().flatten().to(DEVICE)


@gpu_test
def test_exp_exp_neg_and_tanh_are_libdevice_on_every_fp32_input():
    count = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for first in range(0, 1 << 32, CHUNK):
        _mismatches[(CHUNK // BLOCK,)](count, first, CHUNK, BLOCK=BLOCK)
    plain, negated, tanh = count.tolist()
    assert plain == 0, f"exp_f32 differs from libdevice.exp on {plain} fp32 inputs"
    assert negated == 0, f"exp_neg_f32(v) differs from libdevice.exp(-v) on {negated} fp32 inputs"
    assert tanh == 0, f"tanh_f32 differs from libdevice.tanh on {tanh} fp32 inputs"


def addends(n: int, g: torch.Generator) -> torch.Tensor:
    """fp32 e >= 0: every exponent (random mantissas, subnormals included), inf, NaN, and around the 2**126 edge
    of `1 + e` where `div.full` rescales."""
    exponent = torch.randint(0, 255, (n,), generator=g, dtype=torch.int32)
    mantissa = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
    e = ((exponent << 23) | mantissa).view(torch.float32)
    edge = torch.tensor([2.0**126, 2.0**127, torch.finfo(torch.float32).max, float("inf"), float("nan"), 0.0, 1.0])
    edge = torch.cat([edge, torch.nextafter(torch.tensor([2.0**126]), torch.tensor([0.0, 1e38]))])
    e[: edge.numel()] = edge
    return e


@gpu_test
def test_div_one_plus_is_tritons_division_on_bf16_and_fp16_numerators():
    g = torch.Generator().manual_seed(0)
    n = 1 << 24
    values = torch.cat([every_bf16_as_fp32(), every_fp16_as_fp32()]).cpu()
    x = values[torch.randint(0, values.numel(), (n,), generator=g)]
    x[: values.numel()] = values
    e = addends(n, g)
    x, e = x.to(DEVICE), e.to(DEVICE)
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    _div_pair[(triton.cdiv(n, BLOCK),)](x, e, ours, theirs, n, BLOCK=BLOCK)
    assert_same_values(ours, theirs, "div_one_plus vs /")


@gpu_test
def test_div_one_plus_is_tritons_division_for_silu_and_sigmoid_on_every_fp32_input():
    count = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for first in range(0, 1 << 32, CHUNK):
        _division_mismatches[(CHUNK // BLOCK,)](count, first, CHUNK, BLOCK=BLOCK)
    silu, sigmoid = count.tolist()
    assert silu == 0, f"div_one_plus(x, exp(-x)) differs from x / (1 + exp(-x)) on {silu} fp32 inputs"
    assert sigmoid == 0, f"div_one_plus(1, exp(-x)) differs from 1 / (1 + exp(-x)) on {sigmoid} fp32 inputs"


@gpu_test
@pytest.mark.parametrize("pack", RCP_RN_PACKS)
def test_rcp_rn_f32_and_the_eager_sigmoid_are_div_rn_on_every_fp32_input(pack):
    count = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for first in range(0, 1 << 32, CHUNK):
        _rcp_mismatches[(CHUNK // BLOCK,)](count, first, CHUNK, BLOCK=BLOCK, PACK=pack)
    rcp, sigmoid = count.tolist()
    assert rcp == 0, f"rcp_rn_f32 (PACK {pack}) differs from div_rn(1, d) on {rcp} fp32 d >= 1 or NaN"
    assert sigmoid == 0, f"sigmoid_f32 (PACK {pack}) differs from div_rn(1, 1 + exp(-x)) on {sigmoid} fp32 x"
    # fast and slow values (d >= 2**126, inf, NaN of either sign) side by side in one pack
    g = torch.Generator().manual_seed(pack)
    n = 1 << 22
    d = 1.0 + addends(n, g)
    d[torch.randperm(n, generator=g)[: n // 8]] = torch.tensor([float("nan"), -float("nan"), 2.0**126, 3e38]).repeat(
        n // 32
    )
    d = d.to(DEVICE)
    ours, theirs = torch.empty_like(d), torch.empty_like(d)
    _rcp_pair[(triton.cdiv(n, BLOCK),)](d, ours, theirs, n, BLOCK=BLOCK, PACK=pack)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), f"rcp_rn_f32 (PACK {pack}) vs div_rn"


@gpu_test
def test_silu_f32_is_inductors_on_every_bf16_and_fp16_value():
    x = torch.cat([every_bf16_as_fp32(), every_fp16_as_fp32()])
    ours = torch.empty_like(x)
    _silu[(triton.cdiv(x.numel(), BLOCK),)](x, ours, x.numel(), BLOCK=BLOCK)
    inductor = torch.compile(torch.nn.functional.silu, dynamic=False)(x)
    assert_same_values(ours, inductor, "silu_f32 vs Inductor's F.silu")
