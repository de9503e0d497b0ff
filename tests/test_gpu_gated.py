"""GPU tests of the gated producers' kernels (mxfuse/ops/triton_gated_quant.py; docs/design.md,
"Gated producers").

What is asserted, on CUDA, through `torch.ops.mxfuse.*`:

- fused vs. unfused project ops: BITWISE (codes, scales, y): `sigmoid_gate_mxfp8` against
  `sigmoid_gate` then `mxfp8_quantize`, `gated_rms_norm_mxfp8` against `gated_rms_norm` then
  `mxfp8_quantize`; both scale layouts, both rules, with and without `emit_y`, every variant of the
  ops' arguments, bf16 and fp16; on the hard rows of tests/gpu_helpers.py (zeros, FLT_MIN blocks, huge
  and overflowing values, NaN / Inf rows, a dominant block); M from 1 to 4097, K from 64 to 6144,
  group sizes 64, 128, 96 (not a power of two) and whole rows.
- the gate vs. torch's own CUDA eager `x * torch.sigmoid(gate)`: bitwise (the kernel computes
  `1 / (1 + expf(-g))` with CUDA's precise expf and a correctly rounded divide, as torch's kernel).
- the gated norm vs. its formula in torch CUDA eager (`gated.gated_rms_norm_rows` on CUDA tensors):
  the mean square is summed in another order, so y is within one ulp with vLLM's single rounding and
  within three with Hugging Face's three roundings (`round_normalized`, `round_weighted`).
- batch invariance: a row's bits do not depend on the rows around it.
- launch shapes (`config=`): every tile the benchmark times (tools/bench_kernels.py, `gated_variants`) and
  a few more give the default launch's bits, codes, scales and y, bitwise.

Runs without vLLM (the GPU image has none). Marked `gpu`, skipped without CUDA.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from gpu_helpers import DEVICE, gpu_test, kparams, special_rows

import mxfuse.ops  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops import gated
from mxfuse.testing import assert_bitwise, bits

ops = torch.ops.mxfuse
EPS = 1e-6
MS = (1, 16, 17, 1024, 4097)


def inputs(m, k, dtype=torch.bfloat16, seed=0):
    x, _ = special_rows(m, k, dtype, seed=seed)
    g, _ = special_rows(m, k, dtype, seed=seed + 1, start_kind=3)
    return x, g


# ---------------------------------------------------------------- sigmoid_gate


@gpu_test
@pytest.mark.parametrize("k", kparams(64, 96, 1024, 6144))
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_gate_fused_equals_unfused_bitwise(k, m, swizzled):
    for dtype in (torch.bfloat16, torch.float16):
        x, g = inputs(m, k, dtype)
        for rule in (0, 1):
            for round_gate in (True, False):
                y = ops.sigmoid_gate(x, g, round_gate)
                expected = (*ops.mxfp8_quantize(y, swizzled, rule), y)
                assert_bitwise(ops.sigmoid_gate_mxfp8(x, g, swizzled, True, rule, round_gate), expected)
                codes, scales, _ = ops.sigmoid_gate_mxfp8(x, g, swizzled, False, rule, round_gate)
                assert_bitwise((codes, scales), expected[:2])


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_equals_torch_cuda_eager(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(4096, 2048, generator=g, device=DEVICE).to(dtype)
    gate = (8 * torch.randn(4096, 2048, generator=g, device=DEVICE)).to(dtype)
    assert_bitwise(ops.sigmoid_gate(x, gate), x * torch.sigmoid(gate))
    # the sigmoid's tail, where 1 + exp(-g) >= 2**126 takes the kernel's div.rn (subnormal and zero sigmoids), beside
    # ordinary values in the same rows, and x large enough to carry a subnormal sigmoid into a normal product
    big = torch.finfo(dtype).max / 4
    tail = torch.empty(1024, 2048, device=DEVICE).uniform_(-110, -80, generator=g)
    tail[:, ::5] = 8 * torch.randn(1024, 410, generator=g, device=DEVICE)
    tail[0, :4] = torch.tensor([float("nan"), -float("inf"), float("inf"), -88.72])
    xs = torch.randn(1024, 2048, generator=g, device=DEVICE) * big
    assert_bitwise(ops.sigmoid_gate(xs.to(dtype), tail.to(dtype)), xs.to(dtype) * torch.sigmoid(tail.to(dtype)))


# ---------------------------------------------------------------- gated_rms_norm

VARIANTS = [
    dict(),
    dict(round_normalized=True, round_weighted=True),
    dict(norm_before_gate=False),
    dict(activation="sigmoid"),
]


def weight(n, dtype):
    g = torch.Generator(device="cpu").manual_seed(3)
    return (1 + 0.2 * torch.randn(n, generator=g)).to(device=DEVICE, dtype=dtype)


@gpu_test
@pytest.mark.parametrize("k, group", [(128, 64), (2048, 128), (4096, 128), (288, 96), (6144, 6144), (512, 512)])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_gated_norm_fused_equals_unfused_bitwise(k, group, m, swizzled):
    for dtype in (torch.bfloat16, torch.float16):
        x, z = inputs(m, k, dtype)
        for i, kw in enumerate(VARIANTS):
            w = weight(k if i == 2 else group, dtype)
            for rule in (0, 1):
                y = ops.gated_rms_norm(x, z, w, EPS, group, **kw)
                expected = (*ops.mxfp8_quantize(y, swizzled, rule), y)
                assert_bitwise(ops.gated_rms_norm_mxfp8(x, z, w, EPS, group, swizzled, True, rule, **kw), expected)
            codes, scales, _ = ops.gated_rms_norm_mxfp8(x, z, w, EPS, group, swizzled, False, 0, **kw)
            assert_bitwise((codes, scales), ops.mxfp8_quantize(y, swizzled, 0))


@gpu_test
@pytest.mark.parametrize("variant, ulps", [(0, 1), (1, 3), (2, 1), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_norm_within_the_bound_of_torch_cuda_eager(variant, ulps, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(11)
    m, k, group = 4096, 2048, 128
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    z = (4 * torch.randn(m, k, generator=g, device=DEVICE)).to(dtype)
    w = weight(group, dtype)
    kw = VARIANTS[variant]
    ours = ops.gated_rms_norm(x, z, w, EPS, group, **kw)
    eager = gated.gated_rms_norm_rows(x, z, w, EPS, group, **kw)
    diff = (bits(ours).int() - bits(eager).int()).abs()
    assert diff.max() <= ulps, (int(diff.max()), float((diff > 0).float().mean()))


@gpu_test
def test_batch_invariance():
    k, group = 2048, 128
    x, z = inputs(4097, k)
    w = weight(group, torch.bfloat16)
    full = ops.gated_rms_norm_mxfp8(x, z, w, EPS, group, False, True)
    gate_full = ops.sigmoid_gate_mxfp8(x, z, False, True)
    for rows in (slice(0, 1), slice(5, 6), slice(100, 117), slice(4000, 4097)):
        part = ops.gated_rms_norm_mxfp8(x[rows], z[rows], w, EPS, group, False, True)
        assert_bitwise(part, tuple(t[rows] for t in full))
        gate_part = ops.sigmoid_gate_mxfp8(x[rows], z[rows], False, True)
        assert_bitwise(gate_part, tuple(t[rows] for t in gate_full))


@gpu_test
@pytest.mark.parametrize("k, group", [(4096, 128), (288, 96), (6144, 6144)])
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_gated_norm_grid_order_computes_the_same_bits(k, group, swizzled):
    """Row tiles first or groups first (the default's grid and the other): the same codes, scales and y."""
    from mxfuse.ops import triton_gated_quant as tg

    x, z = inputs(300, k)
    w = weight(group, torch.bfloat16)
    for rule in (0, 1):
        want = tg.gated_rms_norm(x, z, w, EPS, group, quant=True, swizzled=swizzled, emit_y=True, rule=rule)
        other = tg.gated_norm_config(group)
        other = other._replace(groups_first=not other.groups_first)
        got = tg.gated_rms_norm(x, z, w, EPS, group, quant=True, swizzled=swizzled, emit_y=True, rule=rule,
                                config=other)  # fmt: skip
        assert_bitwise(got, want, f"rule={rule}")


# ---------------------------------------------------------------- launch shapes


def bench_variants():
    """tools/bench_kernels.py's `gated_variants()`: the launch shapes the benchmark times, so each is checked here."""
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from bench_kernels import gated_variants

    return gated_variants()


def gate_shapes(k: int) -> set:
    """The gate's default tiles (M 1 and 4096, on this GPU's memory and on a slower one), the benchmark's
    candidates at both M (`gated_variants`), and at M 4096 also 8 codes a thread, a 32-register cap and half
    the columns."""
    from mxfuse.ops.triton_gated_quant import gate_config
    from mxfuse.ops.triton_targets import dram_bytes_per_s, sm_count

    sms, dram = sm_count(torch.device(DEVICE)), dram_bytes_per_s(torch.device(DEVICE))
    gate_variants, _ = bench_variants()
    out = set()
    for m in (1, 4096):
        out |= {gate_config(k, m, sms, 1e9), gate_config(k, m, sms, dram)}
        out |= {pick(k, m) for pick in gate_variants.values()}
    d = gate_config(k, 4096, sms, dram)
    out |= {d._replace(code_vector=8), d._replace(max_registers=32)}
    if d.block_cols >= 256:  # GateConfig: at least 128 columns
        out.add(d._replace(block_cols=d.block_cols // 2, num_warps=max(1, d.num_warps // 2)))
    return out


def norm_shapes(group: int) -> set:
    """The gated norm's defaults (beyond decode sizes and at them) and the benchmark's candidates
    (`gated_variants`), its other grid order, twice the warps, a quarter of the rows on half the warps, and twice
    the rows (32 values a thread)."""
    from mxfuse.ops.triton_gated_quant import gated_norm_config

    _, norm_variants = bench_variants()
    d = gated_norm_config(group)
    out = {d, d._replace(groups_first=not d.groups_first), d._replace(block_rows=2 * d.block_rows)}
    out |= {d._replace(num_warps=min(16, 2 * d.num_warps), code_vector=8)}
    out |= {d._replace(block_rows=max(1, d.block_rows // 4), num_warps=max(1, d.num_warps // 2))}
    out.add(gated_norm_config(group, 1, group))
    return out | {pick(group) for pick in norm_variants.values()}


@gpu_test
@pytest.mark.parametrize("k", kparams(96, 2048, 6144))
def test_every_gate_launch_shape_computes_the_default_bits(k):
    """Elementwise, whole 32-value blocks per tile: any tile gives the default's codes, scales (both layouts,
    both rules) and y; the unfused y too."""
    from mxfuse.ops import triton_gated_quant as tg

    x, g = inputs(300, k, seed=k)
    for swizzled, rule in ((False, 0), (True, 1)):
        want = tg.sigmoid_gate(x, g, quant=True, swizzled=swizzled, emit_y=True, rule=rule)
        for cfg in gate_shapes(k):
            got = tg.sigmoid_gate(x, g, quant=True, swizzled=swizzled, emit_y=True, rule=rule, config=cfg)
            assert_bitwise(got, want, f"K={k} {cfg} swz={swizzled}")
    y = tg.sigmoid_gate(x, g, quant=False)[2]
    for cfg in gate_shapes(k):
        assert_bitwise(tg.sigmoid_gate(x, g, quant=False, config=cfg)[2], y, f"unfused K={k} {cfg}")


@gpu_test
@pytest.mark.parametrize("k, group", [(2048, 128), (288, 96), (4096, 512)])
def test_every_gated_norm_launch_shape_computes_the_default_bits(k, group):
    """The pairwise tree sums a group in the same order for any rows per program, warps or code layout: the
    default's codes, scales (both layouts, both rules, with Hugging Face's roundings) and y; the unfused y."""
    from mxfuse.ops import triton_gated_quant as tg

    x, z = inputs(300, k, seed=k + group)
    w = weight(group, torch.bfloat16)
    for swizzled, rule, kw in ((False, 0, VARIANTS[0]), (True, 1, VARIANTS[1]), (False, 0, VARIANTS[2])):
        wk = weight(k, torch.bfloat16) if kw is VARIANTS[2] else w
        want = tg.gated_rms_norm(x, z, wk, EPS, group, quant=True, swizzled=swizzled, emit_y=True, rule=rule, **kw)
        for cfg in norm_shapes(group):
            got = tg.gated_rms_norm(x, z, wk, EPS, group, quant=True, swizzled=swizzled, emit_y=True, rule=rule,
                                    config=cfg, **kw)  # fmt: skip
            assert_bitwise(got, want, f"K={k} G={group} {cfg} swz={swizzled} {kw}")
    y = tg.gated_rms_norm(x, z, w, EPS, group, quant=False)[2]
    for cfg in norm_shapes(group):
        assert_bitwise(tg.gated_rms_norm(x, z, w, EPS, group, quant=False, config=cfg)[2], y, f"unfused {cfg}")


@gpu_test
def test_pdl_changes_no_bit():
    """Each gated producer followed by the o_proj / out_proj GEMM that reads its codes, both launched with
    programmatic dependent launch, back to back on one stream: the bits of the plain launches."""
    from mxfuse.ops import reference, triton_gated_quant as tg, triton_gemm

    k, n, group = 1024, 256, 128
    g = torch.Generator(device=DEVICE).manual_seed(5)
    wc, ws = reference.quantize_rows(0.05 * torch.randn(n, k, device=DEVICE, generator=g))
    w = weight(group, torch.bfloat16)
    producers = {
        "gate": lambda x, z, m, pdl, **kw: tg.sigmoid_gate(
            x, z, quant=True, config=tg.gate_config(k, m)._replace(pdl=pdl), **kw
        ),
        "gated norm": lambda x, z, m, pdl, **kw: tg.gated_rms_norm(
            x, z, w, EPS, group, quant=True, config=tg.gated_norm_config(group)._replace(pdl=pdl), **kw
        ),
    }
    for m in (1, 16, 64, 300):
        x, z = inputs(m, k, seed=m)
        gemm = triton_gemm.gemm_config(m, n, k)
        for name, producer in producers.items():
            results = []
            for pdl in (False, True, True, True):  # the plain launches, then three PDL chains
                codes, scales, y = producer(x, z, m, pdl, emit_y=True)
                swz = producer(x, z, m, pdl, swizzled=True)[:2]  # codes, scales (no y asked)
                out = triton_gemm.mxfp8_linear(codes, scales, wc, ws, torch.bfloat16, config=gemm._replace(pdl=pdl))
                results.append((codes, scales, y, swz, out))
            for got in results[1:]:
                assert_bitwise(got, results[0], f"{name} -> GEMM, M={m}, PDL")
