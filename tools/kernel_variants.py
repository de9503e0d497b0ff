"""The norm / quant kernel variants that the default dispatch was chosen against (benchmarks and GPU tests only).

Each variant is a `NormConfig` (mxfuse/ops/norm_quant_config.py) passed explicitly to
`triton_norm_quant.fused_norm_quant` / `gemma_norm` (`config=`): tools/bench_kernels.py
times them all in one run, tests/test_gpu_norms.py checks each bitwise (fused ==
unfused, batch invariance, the same bits for the same arithmetic), and docs/perf_notes.md
has their numbers. Import with `tools/` on `sys.path` (as bench_kernels does). Run 10's:
`split2-bf16x2` (a row over 2 programs instead of one per chunk: lost at 64 and 256 rows) and the
`pdl-*` forms of the decode configs (programmatic dependent launch, NVIDIA only: the GPU tests
check that they give the same bits; their speed only shows between PDL launches,
tools/bench_gemm.py --pdl-only).

The `dispatch-*` variants (issue #31) are the default dispatch itself (`norm_config(k, m)`, every
choice that follows M) with one change (`DISPATCH`): `dispatch-bits` unpacks bf16 with one integer
op a value (same bits as the default); `dispatch-ch8` and `dispatch-w8` another row layout, a
function of K only (`norm_quant_config.wide_chunk_layout`: chunks of at least 8 values a thread,
at least 4 or 8 warps a row), so other bits than the default at the K where the layout differs
(K 288..2048 for ch8, K 288..4096 for w8), the same bits fused and unfused, and batch invariant.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from mxfuse.ops.norm_quant_config import NormConfig, norm_config, row_chunks, wide_chunk_layout

VARIANTS: Mapping[str, NormConfig] = MappingProxyType(
    {
        "v3-ops": NormConfig(
            tree="pairwise", rsqrt="rn", quant_ops="explicit", scale_store="tl_store", load_fence=False
        ),
        "pairwise": NormConfig(tree="pairwise", rsqrt="rn", load_fence=False),
        "native-rn": NormConfig(rsqrt="rn", load_fence=False),
        "native-nofence": NormConfig(load_fence=False),
        "native": NormConfig(),
        "native-rn-split": NormConfig(rsqrt="rn", split=2),
        "native-split-nofence": NormConfig(split=2, load_fence=False),
        "native-split": NormConfig(split=2),
        "native-2rows": NormConfig(block_rows=2),
        "native-evict": NormConfig(evict_first=True),
        "native-persist": NormConfig(persistent=3),
        "native-persist4": NormConfig(persistent=4),
        "persist-pipe2": NormConfig(persistent=3, loop_stages=2, load_fence=False),
        "persist-pipe3": NormConfig(persistent=3, loop_stages=3, load_fence=False),
        "native-padnorm": NormConfig(scale_padding="norm"),
        "native-bf16x2": NormConfig(quant_ops="hw-bf16x2"),
        "native-split-padnorm": NormConfig(split=2, scale_padding="norm"),
        "split-bf16x2": NormConfig(split=2, quant_ops="hw-bf16x2"),
        "evict-bf16x2": NormConfig(evict_first=True, quant_ops="hw-bf16x2"),
        "split-2xwarps": NormConfig(split=2, quant_ops="hw-bf16x2"),
        "split2-bf16x2": NormConfig(split=2, quant_ops="hw-bf16x2"),
        "pdl-split-bf16x2": NormConfig(split=2, quant_ops="hw-bf16x2", pdl=True),
        "pdl-evict-bf16x2": NormConfig(evict_first=True, quant_ops="hw-bf16x2", pdl=True),
        # the default dispatch with one change (DISPATCH); the entry's own fields are not used
        "dispatch-bits": NormConfig(unpack="bits"),
        "dispatch-cvt": NormConfig(unpack="cvt"),
        "dispatch-ch8": NormConfig(),
        "dispatch-w8": NormConfig(),
    }
)
DISPATCH: Mapping[str, tuple[dict, int | None]] = MappingProxyType(
    {
        "dispatch-bits": (dict(unpack="bits"), None),
        "dispatch-cvt": (dict(unpack="cvt"), None),  # the dispatch before run 13 (Triton's converts)
        "dispatch-ch8": ({}, 4),
        "dispatch-w8": ({}, 8),
    }
)
"""Variants that are `norm_config(k, m, layout=...)` with these field changes: (fields, min_warps
of `wide_chunk_layout`, None: the default row layout)."""
WARPS_FACTOR = {"split-2xwarps": 2}
"""Variants with another row layout than their K's default (so other bits: a decode-size probe only)."""
SPLIT_PARTS = {"split2-bf16x2": 2}
"""Variants whose row is split over this many programs (the others: `split` > 1 means one per chunk)."""


def variant(name: str, k: int, m: int | None = None, plain_quant: bool = False) -> NormConfig:
    """`VARIANTS[name]` with the default launch shape for K: its block_rows multiply a
    one-row default tile (K >= 2048; the rows then sit in registers of the same threads,
    the same per-row layout), split > 1 means one program per chunk, and `persistent` counts
    programs of 8 warps per SM (the loop, its weight hoisted, takes 64-78 registers a thread
    from ptxas for sm_90: 3 programs of 8 warps fit at 78, 4 at 64).

    A `DISPATCH` variant is the default dispatch for (K, M, plain_quant) with its change (M
    None: its config at M = 1, a row split over its chunks)."""
    if name in DISPATCH:
        fields, min_warps = DISPATCH[name]
        layout = None if min_warps is None else wide_chunk_layout(k, min_warps)
        return norm_config(k, 1 if m is None else m, plain_quant=plain_quant, layout=layout).replace(**fields)
    base = norm_config(k)
    entry = VARIANTS[name]
    cfg = entry.replace(
        block_rows=entry.block_rows if base.block_rows == 1 else base.block_rows,
        num_warps=base.num_warps * WARPS_FACTOR.get(name, 1),
        split=SPLIT_PARTS.get(name, row_chunks(k)[1]) if entry.split > 1 else 1,
    )
    if cfg.persistent:
        cfg = cfg.replace(persistent=max(1, entry.persistent * 8 // cfg.num_warps))
    return cfg


def layout_of(name: str, k: int) -> tuple[int, int]:
    """(num_warps, chunk columns) of the row layout variant `name` runs at K: the default's,
    but for WARPS_FACTOR and the `DISPATCH` layouts."""
    cfg = variant(name, k)
    return cfg.num_warps, row_chunks(k, cfg.chunk_cols)[0]


def variant_of(config: NormConfig, k: int) -> str | None:
    """The name of the variant whose config for K is `config` (None if none is)."""
    return next((name for name in VARIANTS if variant(name, k) == config), None)
