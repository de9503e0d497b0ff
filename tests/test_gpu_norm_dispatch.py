"""The norm kernels' dispatch (`norm_quant_config.norm_config`): derived from K, M and the SM count, and
bit-neutral; programmatic dependent launch changes no bit either.

CPU (always): the row layout and the arithmetic are a function of K alone (every M, every SM count); a
row is split only while the grid has an SM for every program; the regimes of the H200 measurements
(docs/perf_notes.md) come out of the rule at 132 SMs; PDL is dropped off NVIDIA.

GPU (`gpu`, skipped without CUDA), at hidden sizes of every layout the sweep covers: the ops' own
dispatch at every M regime (a row split over its chunks, evict_first, the paired rounding, one
row a program, the pipelined persistent loop) gives each row the bits it has alone (M = 1) and
fused == unfused; the dispatch computed for another SM count (another GPU's regimes)
gives the same bits; PDL on the norm and on the GEMM gives the same bits as without.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from mxfuse.ops.norm_quant_config import NormConfig, norm_config, row_chunks

HAS_CUDA = torch.cuda.is_available()
EPS = 1e-6
KS = (160, 2048, 4096, 5120, 8192)
"""Row layouts of the sweep's hidden sizes: 2, 4, 4, 3 and 4 chunks; 4 and 8 warps."""
MS = (1, 17, 40, 64, 300, 1100, 4096)
"""Every regime at 132 SMs: a row split over its chunks (1, 17; 40 at 3 chunks), one program a row with
evict_first (40 at 4 chunks, 64), 300 (past the paired rounding of the plain norm), 1100 (past
evict_first), 4096 (the pipelined loop of the plain norm at 3 chunks)."""

gpu = pytest.mark.gpu


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _same(a, b, what):
    for name, ta, tb in zip(("codes", "scales", "residual_out", "y"), a, b):
        if ta is None or tb is None:
            assert ta is None and tb is None, f"{what}: {name}"
            continue
        assert torch.equal(_u8(ta), _u8(tb)), f"{what}: {name} differs in {int((_u8(ta) != _u8(tb)).sum())} bytes"


def _rows(m, k, seed):
    """Random rows with a zero row, a NaN, an Inf and huge values among them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    r = torch.randn(m, k, device="cuda", generator=g)
    x[m // 2] = 0.0
    r[m // 2] = 0.0
    x[m // 3, k // 2] = float("nan")
    x[(2 * m) // 3, 3] = float("inf")
    x[m - 1] *= 1e18
    return x.bfloat16(), r.bfloat16()


# ------------------------------------------------------------------ the rule (CPU)


@pytest.mark.parametrize("k", [32, 64, 96, 160, 1000, 2048, 2080, 3072, 4096, 6144, 8192, 12288, 16384])
def test_layout_and_arithmetic_depend_on_k_alone(k):
    base = norm_config(k)
    for sms in (1, 78, 132, 148, 304):
        for m in (0, 1, 2, 16, 17, 33, 64, 65, 256, 1000, 1024, 4096, 16384, 10**6):
            for plain in (False, True):
                for isa in ("ptx", "portable"):
                    cfg = norm_config(k, m, plain_quant=plain, isa=isa, sms=sms)
                    assert (cfg.tree, cfg.rsqrt, cfg.num_warps) == (base.tree, base.rsqrt, base.num_warps), (k, m)
                    assert cfg.block_rows == base.block_rows or cfg.persistent, (k, m)
                    tiles = max(1, -(-m // base.block_rows))
                    assert cfg.split in (1, row_chunks(k)[1]), (k, m, sms, cfg)
                    assert cfg.split == 1 or tiles * cfg.split <= sms, (k, m, sms, cfg)
                    assert not cfg.pdl


def test_the_rule_gives_the_measured_regimes_on_an_h200():
    """132 SMs: a row over its chunks at M <= 16 (and to 44 / 33 rows at 3 / 4 chunks), evict_first
    from there to 1024, the paired rounding to 256 (1024 with a residual),
    the pipelined loop of the plain norm at 3 chunks from 4096 rows (1584 at 8 warps); bf16 unpacked by
    bits on NVIDIA outside that loop."""
    for k, nch in ((6144, 3), (4096, 4), (3072, 3), (2048, 4)):
        assert row_chunks(k)[1] == nch
        assert norm_config(k, 16, sms=132).split == nch
        assert norm_config(k, 132 // nch, sms=132).split == nch
        assert norm_config(k, 132 // nch + 1, sms=132).split == 1
        assert norm_config(k, 64, sms=132) == NormConfig(num_warps=norm_config(k).num_warps, evict_first=True,
                                                         quant_ops="hw-bf16x2", unpack="bits")  # fmt: skip
        assert norm_config(k, 64, isa="portable").unpack == "cvt"  # the bit moves are NVIDIA's only
        assert norm_config(k, 1024, sms=132).evict_first and not norm_config(k, 4096, sms=132).evict_first
        assert norm_config(k, 256, plain_quant=True).quant_ops == "hw-bf16x2"
        assert norm_config(k, 1024, plain_quant=True).quant_ops == "hw"
        assert norm_config(k, 1024).quant_ops == "hw-bf16x2"
        pipelined = norm_config(k, 4096, plain_quant=True, sms=132)
        assert bool(pipelined.persistent) == (nch == 3), k
        assert pipelined.unpack == ("cvt" if nch == 3 else "bits"), k  # the pipelined loop keeps cvt
        assert not norm_config(k, 4096, plain_quant=True, isa="portable").persistent
    assert norm_config(6144, 1584, plain_quant=True).persistent
    assert not norm_config(6144, 1583, plain_quant=True).persistent


def test_pdl_is_nvidia_only():
    """A PDL config launches with `launch_pdl` and the kernels' PDL constexpr on NVIDIA; other targets
    (Triton's AMD backend has no equivalent) drop the hint and launch the same kernel plainly."""
    from mxfuse.ops import triton_gemm, triton_norm_quant as tnq

    x = torch.empty(4, 256, dtype=torch.bfloat16, device="meta")
    w = torch.empty(256, dtype=torch.bfloat16, device="meta")
    cfg = norm_config(256).replace(pdl=True)
    codes = torch.empty(4, 256, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(4, 8, dtype=torch.uint8, device="meta")
    gcfg = triton_gemm.gemm_config(4, 64, 256)._replace(pdl=True)
    for isa, pdl in (("ptx", True), ("portable", False)):
        _, launch = tnq.norm_launch(x, None, w, EPS, quant=True, isa=isa, config=cfg)
        assert (
            launch.pdl is pdl and launch.options().get("launch_pdl", False) is pdl and launch.constexprs["F"].PDL is pdl
        )
        launches = []
        triton_gemm.mxfp8_linear(codes, scales, codes[:1].expand(64, 256), scales[:1].expand(64, 8), torch.bfloat16,
                                 config=gcfg, run=launches.append, isa=isa)  # fmt: skip
        assert launches and all(lc.pdl is pdl and lc.constexprs["PDL"] is pdl for lc in launches), isa


# ------------------------------------------------------------------ the bits (GPU)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("k", KS)
def test_every_regime_gives_a_row_its_bits(k, swizzled):
    """At every M regime of the dispatch: fused == unfused bitwise, and each checked row has the bits it
    has alone; the dispatch of another SM count (another GPU's regimes) gives the same bits."""
    from mxfuse.ops import triton_norm_quant as tnq

    g = torch.Generator(device="cuda").manual_seed(k)
    w = (0.5 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    for m in MS:
        x, r = _rows(m, k, seed=k + m)
        for res in (r, None):
            what = f"K={k} M={m} {'add' if res is not None else 'plain'} {'swizzled' if swizzled else 'row-major'}"
            got = tnq.fused_norm_quant(x, res, w, EPS, swizzled=swizzled, emit_y=True)
            y, ro = tnq.gemma_norm(x, res, w, EPS)
            _same(got, (*tnq.quantize(y, swizzled), ro, y), f"{what} fused vs unfused")
            no_y = tnq.fused_norm_quant(x, res, w, EPS, swizzled=swizzled)
            _same(no_y[:3], got[:3], f"{what} without y")
            for sms in (16, 1000):  # other GPUs' regimes: other splits, evict / paired ranges
                plain = res is None
                cfg = norm_config(k, m, plain_quant=plain, sms=sms)
                other = tnq.fused_norm_quant(x, res, w, EPS, swizzled=swizzled, emit_y=True, config=cfg)
                _same(other, got, f"{what} dispatched for {sms} SMs")
            row = tnq.fused_norm_quant(x, res, w, EPS, emit_y=True)  # row-major, as the rows alone below
            for i in sorted({0, m // 3, m // 2, m - 1}):
                alone = tnq.fused_norm_quant(x[i : i + 1], None if res is None else res[i : i + 1], w, EPS,
                                             emit_y=True)  # fmt: skip
                _same([t[i : i + 1] if t is not None else None for t in row], alone, f"{what} row {i} alone")


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", (2048, 4096, 6144))
def test_pdl_changes_no_bit(k):
    """The fused and unfused norm and the GEMM after them, launched with programmatic dependent launch,
    back to back on one stream: the same bits as the plain launches."""
    from mxfuse.ops import reference, triton_gemm, triton_norm_quant as tnq

    g = torch.Generator(device="cuda").manual_seed(7 * k)
    w = (0.5 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    n = 384
    wc, ws = reference.quantize_rows(0.02 * torch.randn(n, k, device="cuda", generator=g))
    for m in (1, 16, 64, 300, 4096):
        x, r = _rows(m, k, seed=m)
        for res in (r, None):
            for swizzled in (False, True):
                cfg = norm_config(k, m, plain_quant=res is None)
                plain = tnq.fused_norm_quant(x, res, w, EPS, swizzled=swizzled, emit_y=True, config=cfg)
                pdl = tnq.fused_norm_quant(x, res, w, EPS, swizzled=swizzled, emit_y=True, config=cfg.replace(pdl=True))
                _same(pdl, plain, f"K={k} M={m} fused, PDL")
            y, ro = tnq.gemma_norm(x, res, w, EPS, config=norm_config(k, m).replace(pdl=True))
            _same((y, ro), tnq.gemma_norm(x, res, w, EPS), f"K={k} M={m} norm, PDL")
            codes, scales = tnq.fused_norm_quant(x, res, w, EPS)[:2]
            gcfg = triton_gemm.gemm_config(m, n, k)
            want = triton_gemm.mxfp8_linear(codes, scales, wc, ws, torch.bfloat16, config=gcfg)
            for _ in range(3):  # norm -> GEMM, both PDL, back to back
                c2, s2, _, _ = tnq.fused_norm_quant(x, res, w, EPS, config=norm_config(k, m).replace(pdl=True))
                got = triton_gemm.mxfp8_linear(c2, s2, wc, ws, torch.bfloat16, config=gcfg._replace(pdl=True))
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"K={k} M={m} GEMM, PDL"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))
