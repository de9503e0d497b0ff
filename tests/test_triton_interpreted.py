"""The Triton kernels run by Triton's interpreter on CPU, checked on what it computes exactly.

The interpreter rounds fp8 casts and bf16 arithmetic unlike a GPU (docs/design.md,
"Fidelity": 116 of the 4096 fp32 -> e4m3 roundings and some bf16 products differ from
torch's), so it cannot check the codes of arbitrary values. What it computes exactly, and
what these tests pin bit for bit:

- the E8M0 scale bytes: integer work on the bits of the block amax. Blocks whose amax sits
  just below, at and just above 448 * 2**e for every fp32 exponent (subnormals included),
  and NaN, +-Inf, zero and subnormal blocks, under both quant rules (`QuantRule`): the
  quant kernel against `reference.quantize_rows`. A change of the kernel's rule (`>` to
  `>=` on the mantissa, say) fails here. The amax taken as an integer max of the
  magnitudes' bits (`MxSpec.WARP_AMAX`) too.
- the codes of values that are exact in e4m3 after scaling (an e4m3 value times a power of
  two: any rounding gives the same code): every code store's index math.
- every store of both layouts: row-major scales with any row stride, F8_128x4 offsets and
  their padding zeros (outputs poisoned before each launch) against `reference.swizzle_scales`;
- the norm kernel in every config the default dispatch picks at small shapes (split rows,
  evict_first, several rows per tile, 1-4 chunks a row, paired bf16 rounding or not, the
  swizzled padding fill), plain and with the residual, both rules: its scales equal the
  reference scales of the y it emits (exact: the scale is a function of y), its codes
  the quant kernel's codes of that y (the interpreter's cast on the same values), and
  without emit_y the same bytes;
- the packed SP kernels (codes and row-major scales written into the two views of one
  `[M, K + K/32]` byte buffer): every byte, against the unpacked outputs;
- the standalone swizzle kernel (uint8 moves only): against `reference.swizzle_scales`.

The interpreter is chosen when Triton decorates a kernel, so the checks run in a fresh
process (CUDA hidden), one for all of them. The interpreter runs one program at a time, and a
generic `tl.reduce` (TORCHAO's NaN-propagating amax) one element at a time: the checks keep
the launches small where a larger one would only repeat the same index math (each check's
comments say where).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

PRELUDE = textwrap.dedent(
    """
    import itertools, sys
    import torch
    from mxfuse.ops import reference, triton_mx_quant, triton_norm_quant
    from mxfuse.ops.norm_quant_config import QuantConfig, norm_config, quant_config, row_chunks
    from mxfuse.ops.reference import QuantRule

    POISON = 0xAB
    RULES = (QuantRule.DEFAULT, QuantRule.TORCHAO)
    g = torch.Generator().manual_seed(0)

    def u8(t):
        return t.view(torch.uint8)

    def poisoned(outputs):
        for t in outputs:
            if t is not None:
                u8(t).fill_(POISON)
        return outputs

    def run_quant(x, swizzled, rule, config=None, out_codes=None, out_scales=None):
        outputs, launch = triton_mx_quant.quant_launch(
            x, swizzled, isa="portable", rule=rule, config=config, out_codes=out_codes, out_scales=out_scales
        )
        if out_codes is None:
            poisoned(outputs)
        launch.run()
        return outputs

    def want_scales(x, swizzled, rule):
        codes, scales = reference.quantize_rows(x, rule)
        return codes, reference.swizzle_scales(scales) if swizzled else scales

    def where(a, b):
        bad = (a != b).nonzero()
        return f"{bad.shape[0]} differ, first {bad[:4].tolist()}"
    """
)

CHECK_SCALES = textwrap.dedent(
    """
    # one block per amax: just below, at and just above 448 * 2**e for every exponent whose
    # value is a positive finite fp32 (the boundary of scale byte e + 127 and the next)
    amax = []
    for e in range(-160, 130):
        b = torch.tensor(448.0 * 2.0 ** e, dtype=torch.float64).float()
        if torch.isfinite(b) and b > 0:
            for v in (torch.nextafter(b, torch.tensor(0.0)), b, torch.nextafter(b, torch.tensor(float("inf")))):
                amax.append(v)
    tiny = torch.finfo(torch.float32).tiny
    amax += [torch.tensor(v) for v in (tiny, tiny / 2, 1e-45, torch.finfo(torch.float32).max, 448.0, 1.0)]
    amax = torch.stack(amax).float()
    n = amax.shape[0]
    assert n > 3 * 254, n
    blocks = torch.rand(n, 32, generator=g) * amax[:, None] * 0.999
    blocks = torch.where(torch.rand(n, 32, generator=g) < 0.5, -blocks, blocks)
    pos = torch.randint(0, 32, (n,), generator=g)
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    blocks[torch.arange(n), pos] = amax * sign
    special = torch.rand(8, 32, generator=g)
    special[0] = 0.0                                  # zero block
    special[1] = torch.rand(32, generator=g) * 1e-40  # subnormal block
    special[2, 5] = float("nan")                      # one NaN among values
    special[3] = float("nan")                         # only NaN
    special[4, 9] = float("inf")                      # +Inf
    special[5, 0] = -float("inf")                     # -Inf
    special[6, 3], special[6, 4] = float("nan"), float("inf")
    special[7] = -0.0
    blocks = torch.cat([blocks, special])
    k = 256  # ~110 rows: the swizzled layout's padding to 128 rows adds little
    pad = (-blocks.shape[0]) % (k // 32)
    blocks = torch.cat([blocks, torch.rand(pad, 32, generator=g)])
    x = blocks.reshape(-1, k)
    m = x.shape[0]
    # both rules in both layouts; tiles of one row by 4 scale columns (a program holding one
    # F8_128x4 column group of one row) under the default rule: the store does not read the rule
    small_tiles = QuantConfig(block_rows=1, block_cols=128, num_warps=4)
    for rule, swizzled, config in [*itertools.product(RULES, (False, True), [None]), (RULES[0], True, small_tiles)]:
        codes, scales = run_quant(x, swizzled, rule, config)
        _, want = want_scales(x, swizzled, rule)
        assert torch.equal(scales, want), (rule, swizzled, config, where(scales, want))
    # the block amax on the magnitudes' bits (`MxSpec.WARP_AMAX`, the one-value-a-thread tiles' redux on NVIDIA,
    # set by the launch only there): forced on here, integer arithmetic the interpreter computes exactly
    outputs, launch = triton_mx_quant.quant_launch(x, False, isa="portable", config=small_tiles)
    launch.constexprs["MX"] = launch.constexprs["MX"]._replace(WARP_AMAX=True)
    poisoned(outputs)
    launch.run()
    _, want = want_scales(x, False, RULES[0])
    assert torch.equal(outputs[1], want), ("WARP_AMAX", where(outputs[1], want))
    """
)

CHECK_QUANT_STORES = textwrap.dedent(
    """
    # values exact in e4m3 after scaling (an e4m3 value times a power of two): the codes
    # too are exact, whatever the rounding; bf16 / fp32 inputs, every quant_config tile
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite)]

    def exact_rows(m, k, dtype):
        v = finite[torch.randint(0, finite.numel(), (m, k), generator=g)]
        e = torch.randint(-20, 20, (m, k // 32, 1), generator=g).float()
        return (v.reshape(m, k // 32, 32) * torch.exp2(e)).reshape(m, k).to(dtype)

    # shapes: one block, three (scale columns padded to 4), one whole 1024-column tile, three
    # column tiles with a partial last one (65 scale columns), two 128-row tiles; tiles: the
    # smallest and the largest quant_config picks (M 1 and 4096). The swizzled layout pads M to
    # 128 rows and the interpreter runs a program at a time, so there the one-row tile runs on
    # the shapes of one tile only, and TORCHAO (whose NaN-propagating amax is a generic
    # `tl.reduce`: one element at a time) at K <= 128 only; the stores' index math reads neither
    # the rule nor the input dtype.
    for (m, k), (dtype, rule) in itertools.product(
        [(1, 32), (3, 96), (2, 1024), (5, 2080), (130, 160)],
        [(torch.bfloat16, QuantRule.DEFAULT), (torch.float32, QuantRule.TORCHAO)],
    ):
        x = exact_rows(m, k, dtype)
        want_codes, want_rm = reference.quantize_rows(x, rule)
        for swizzled, tile_m in itertools.product((False, True), (1, 4096)):
            one_tile = m <= 128 and k <= 1024
            if swizzled and ((tile_m == 1 and not one_tile) or (rule == QuantRule.TORCHAO and k > 128)):
                continue
            config = quant_config(k, tile_m)
            codes, scales = run_quant(x, swizzled, rule, config)
            want = reference.swizzle_scales(want_rm) if swizzled else want_rm
            assert torch.equal(u8(codes), u8(want_codes)), (m, k, config, where(u8(codes), u8(want_codes)))
            assert torch.equal(scales, want), (m, k, swizzled, config, where(scales, want))
    # a strided input and strided outputs: the packed SP quant (codes, then scales, in one row)
    m, k = 37, 192
    x = exact_rows(m, k + 64, torch.bfloat16)[:, 64:]
    packed = torch.full((m, k + k // 32), POISON, dtype=torch.uint8)
    run_quant(x, False, QuantRule.DEFAULT, None, packed[:, :k].view(torch.float8_e4m3fn), packed[:, k:])
    want_codes, want_rm = reference.quantize_rows(x)
    assert torch.equal(packed, torch.cat([u8(want_codes), want_rm], dim=1)), where(packed[:, k:], want_rm)
    # the standalone swizzle (uint8 moves): block widths, dense and strided sources
    swizzle_block_cols = triton_mx_quant.SWIZZLE_BLOCK_COLS
    for block_cols in (4, 16):
        triton_mx_quant.SWIZZLE_BLOCK_COLS = block_cols
        for m, s in itertools.product([1, 129, 300], [5, 17]):
            src = torch.randint(0, 255, (m, s + 40), generator=g, dtype=torch.uint8)
            for scales in (src[:, 40:].contiguous(), src[:, 40:]):
                out = triton_mx_quant.swizzle_scales(scales)
                want = reference.swizzle_scales(scales.contiguous())
                assert torch.equal(out, want), (block_cols, m, s, scales.stride(), where(out, want))
    triton_mx_quant.SWIZZLE_BLOCK_COLS = swizzle_block_cols
    """
)

CHECK_NORM = textwrap.dedent(
    """
    # every config the default dispatch picks at these shapes (portable ISA: the interpreter's)
    seen = set()

    def fused(x, r, w, **kw):
        outputs, launch = triton_norm_quant.norm_launch(x, r, w, 1e-6, quant=True, isa="portable", **kw)
        poisoned(outputs)
        launch.run()
        return outputs

    shapes = [(1, 32), (5, 96), (17, 160), (3, 1024), (2, 2080), (300, 32)]
    for (m, k), has_res in itertools.product(shapes, (False, True)):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        r = torch.randn(m, k, generator=g).to(torch.bfloat16) if has_res else None
        w = torch.randn(k, generator=g).to(torch.bfloat16)
        seen.add(norm_config(k, m, plain_quant=not has_res, isa="portable"))
        forms = ((False, QuantRule.DEFAULT), (True, QuantRule.TORCHAO), (not has_res, QuantRule(int(has_res))))
        if m > 256:  # the many rows of the "hw" config: the default rule (TORCHAO's amax: as in quant_stores)
            forms = ((False, QuantRule.DEFAULT), (True, QuantRule.DEFAULT))
        for swizzled, rule in forms:
            kw = dict(swizzled=swizzled, rule=rule, round_sum=has_res and rule == QuantRule.TORCHAO)
            codes, scales, res, y = fused(x, r, w, emit_y=True, **kw)
            want_codes, want = want_scales(y, swizzled, rule)
            assert torch.equal(scales, want), (m, k, has_res, swizzled, rule, where(scales, want))
            q_codes, _ = run_quant(y, False, rule)
            assert torch.equal(u8(codes), u8(q_codes)), (m, k, has_res, swizzled, rule, where(u8(codes), u8(q_codes)))
            # without y (paired bf16 rounding at these M): the same codes and scales
            codes2, scales2, res2, _ = fused(x, r, w, **kw)
            assert torch.equal(u8(codes2), u8(codes)) and torch.equal(scales2, scales), (m, k, swizzled, rule)
            if not swizzled:
                # the packed SP kernel: codes then row-major scales in one [M, K + K/32] byte row
                packed = torch.full((m, k + k // 32), POISON, dtype=torch.uint8)
                fused(x, r, w, out_codes=packed[:, :k].view(torch.float8_e4m3fn), out_scales=packed[:, k:], **kw)
                assert torch.equal(packed, torch.cat([u8(codes), scales], dim=1)), (m, k, has_res, rule)
        # the unfused norm: the same y and residual_out (rounded by the interpreter alike)
        rs = kw["round_sum"]  # the last form's
        outputs, launch = triton_norm_quant.norm_launch(x, r, w, 1e-6, quant=False, isa="portable", round_sum=rs)
        poisoned(outputs)
        launch.run()
        assert torch.equal(outputs[3], y), (m, k, has_res)
        if has_res:
            assert torch.equal(outputs[2], res), (m, k, where(outputs[2], res))
    # the configs these shapes reach: split rows, evict_first, several rows a tile, 1..4
    # chunks, paired bf16 or not (norm_config's regimes below the persistent loop)
    assert {c.split > 1 for c in seen} == {True, False}, seen
    assert {c.evict_first for c in seen} == {True, False}, seen
    assert {c.block_rows for c in seen} >= {1, 16} and {row_chunks(k)[1] for _, k in shapes} == {1, 2, 3, 4}, seen
    assert {c.quant_ops for c in seen} == {"hw", "hw-bf16x2"}, seen
    """
)

CHECK_NORM_LAYOUTS = textwrap.dedent(
    """
    # the candidate row layouts of tools/kernel_variants.py (`wide_chunk_layout`: other chunk
    # widths and warps, NormConfig.chunk_cols) at the dispatch's configs of a few M: the index
    # math of every load and store (scales of the emitted y, codes, y against the CPU reference
    # within a bf16 bound, the unfused norm's y and residual_out, the packed form)
    from mxfuse.ops.norm_quant_config import wide_chunk_layout

    def launch(x, r, w, quant, config, **kw):
        outputs, launch = triton_norm_quant.norm_launch(x, r, w, 1e-6, quant=quant, isa="portable", config=config,
                                                        **kw)
        poisoned(outputs)
        launch.run()
        return outputs

    seen = set()
    for (m, k), min_warps, has_res in itertools.product([(2, 1024), (1, 2048), (67, 2048), (3, 2560)], (4, 8),
                                                        (False, True)):
        layout = wide_chunk_layout(k, min_warps)
        cfg = norm_config(k, m, plain_quant=not has_res, isa="portable", layout=layout)
        seen.add((k, cfg.num_warps, row_chunks(k, cfg.chunk_cols), cfg.split))
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        r = torch.randn(m, k, generator=g).to(torch.bfloat16) if has_res else None
        w = torch.randn(k, generator=g).to(torch.bfloat16)
        want_y = (reference.gemma_fused_add_rmsnorm(x, r, w, 1e-6)[0] if has_res
                  else reference.gemma_rmsnorm(x, w, 1e-6))
        for swizzled in (False, True):
            codes, scales, res, y = launch(x, r, w, True, cfg, swizzled=swizzled, emit_y=True)
            assert torch.allclose(y.float(), want_y.float(), rtol=2**-6, atol=1e-3), (m, k, min_warps, swizzled)
            _, want = want_scales(y, swizzled, QuantRule.DEFAULT)
            assert torch.equal(scales, want), (m, k, min_warps, swizzled, where(scales, want))
            q_codes, _ = run_quant(y, False, QuantRule.DEFAULT)
            assert torch.equal(u8(codes), u8(q_codes)), (m, k, min_warps, swizzled, where(u8(codes), u8(q_codes)))
            codes2, scales2, _, _ = launch(x, r, w, True, cfg, swizzled=swizzled)
            assert torch.equal(u8(codes2), u8(codes)) and torch.equal(scales2, scales), (m, k, min_warps, swizzled)
        packed = torch.full((m, k + k // 32), POISON, dtype=torch.uint8)
        launch(x, r, w, True, cfg, out_codes=packed[:, :k].view(torch.float8_e4m3fn), out_scales=packed[:, k:])
        codes, scales, _, _ = launch(x, r, w, True, cfg)
        assert torch.equal(packed, torch.cat([u8(codes), scales], dim=1)), (m, k, min_warps, has_res)
        _, _, res_n, y_n = launch(x, r, w, False, norm_config(k, m, isa="portable", layout=layout))
        assert torch.equal(y_n, y), (m, k, min_warps, has_res)
        if has_res:
            assert torch.equal(res_n, res), (m, k, min_warps, where(res_n, res))
    # 1, 2 and 3 chunks of the new widths, 4 and 8 warps, split rows and not
    assert {nch for _, _, (_, nch), _ in seen} == {1, 2, 3}, seen
    assert {nw for _, nw, _, _ in seen} == {4, 8} and {sp > 1 for *_, sp in seen} == {True, False}, seen
    """
)

CHECKS = {"scales": CHECK_SCALES, "quant_stores": CHECK_QUANT_STORES, "norm": CHECK_NORM,
          "norm_layouts": CHECK_NORM_LAYOUTS}  # fmt: skip

RUNNER = textwrap.dedent(
    """
    import json, sys, traceback
    sources = json.load(sys.stdin)
    prelude = {}
    exec(compile(sources.pop("prelude"), "<prelude>", "exec"), prelude)
    for name, source in sources.items():
        try:
            exec(compile(source, f"<check {name}>", "exec"), dict(prelude))
        except BaseException:
            print(f"### check {name}: failed", traceback.format_exc(), sep="\\n", flush=True)
        else:
            print(f"### check {name}: ok", flush=True)
    """
)


@pytest.fixture(scope="module")
def interpreted(request) -> dict[str, str]:
    """The selected checks in one interpreter process (one import of torch and Triton): `{check:
    "ok" or its traceback}`; a check missing from it did not finish (the process's stderr says why)."""
    module = request.node.nodeid
    selected = [item.callspec.params["check"] for item in request.session.items if item.nodeid.startswith(module)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps({"prelude": PRELUDE, **{name: CHECKS[name] for name in selected}}),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = {}
    for block in done.stdout.split("### check ")[1:]:
        name, _, rest = block.partition(": ")
        results[name] = "ok" if rest.strip() == "ok" else rest.partition("\n")[2]  # the traceback
    results["stderr"] = done.stderr[-3000:]
    return results


@pytest.mark.parametrize("check", list(CHECKS))
def test_interpreted(check, interpreted):
    result = interpreted.get(check)
    if result != "ok":
        pytest.fail(result or f"the interpreter process did not finish:\n{interpreted['stderr']}", pytrace=False)
