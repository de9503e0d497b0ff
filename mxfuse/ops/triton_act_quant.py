"""Triton kernel for the act·mul ops (CUDA impls of :mod:`mxfuse.ops.activations`).

One kernel, :func:`_act_mul_kernel`: an act·mul prologue (load a `[BM, BC]` tile of gate
and of up, compute `act(gate) * up`, round to the dtype) composed with the MXFP8 epilogue
of the norm kernels (`_mx_quant_tile`, `_store_scales`: the same code, so the same bits).
`QUANT` off is the unfused `act_mul` (it stores y); on, the fused op (codes + scales, y
with `EMIT_Y`). Fused == unfused bitwise on a device by construction: one prologue, and the
quant of the rounded y is the standalone quant's (elementwise but for the block amax,
whose `max` is order-free).

Arithmetic (fp32, no FMA contraction: launched with ``enable_fp_fusion=False``):

- ``exp`` and ``tanh`` are libdevice's (``__nv_expf`` / ``__nv_tanhf`` on NVIDIA, OCML's
  on AMD): accurate to 1-2 ulp, not Triton's ``tl.exp`` (``ex2.approx`` after a multiply,
  which loses a few more bits on large arguments);
- SiLU is ``x / (1 + exp(-x))`` and the sigmoid ``1 / (1 + exp(-x))``, both with the
  correctly rounded ``div_rn`` (torch's decomposition of ``F.silu`` / ``sigmoid``);
- GELU-tanh is torch's formula with torch's constants,
  ``0.5 * x * (1 + tanh(kBeta * (x + 0.044715 * (x * x * x))))``;
- ``ROUND_EACH_OP`` rounds every op's result to the dtype exactly where the reference does
  (:func:`mxfuse.ops.activations.act_mul_rows`); clamps are NaN-propagating (torch's clamp).

Against torch's own CUDA functions the only difference is the last bit or two of an
fp32 ``exp`` / ``tanh``; docs/design.md ("act·mul producers") states the bound and
tests/test_gpu_act_mul.py checks it.

Tiling: a 2-D grid over (row blocks, column blocks of the I dimension); BC columns
(a power of two, 128..1024: 4 scale columns at least, so the swizzled layout's padding
columns are covered by the last column block) and BM rows (:func:`act_mul_config`),
halved while the grid would leave SMs idle (decode sizes). Every tile computes the same
bits, so the choice is free (batch invariance). Swizzled scales: after the tiles of the M
real rows, a few programs per column block only store the zero scale bytes of the padding
rows up to pad128(M) (no loads, no memset).

Importing this module compiles nothing; kernels compile on the first launch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxfuse.ops.mx_layout import padded_rows, padded_scale_columns, scale_columns
from mxfuse.ops.reference import QuantRule
from mxfuse.ops.triton_mx_quant import _mx_quant_tile, _store_scales, out_views, row_stride, rule_name
from mxfuse.ops.triton_norm_quant import _sm_count
from mxfuse.ops.triton_targets import Isa, KernelLaunch, device_isa

__all__ = ["ActMulConfig", "act_mul", "act_mul_config", "act_mul_launch"]

ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1, "swiglu_step": 2, "swiglu_oai": 3}
GELU_BETA = tl.constexpr(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5)
"""torch's `kBeta` (`M_SQRT2 * M_2_SQRTPI * 0.5`), the fp32 constant the decomposition multiplies by."""
GELU_KAPPA = tl.constexpr(0.044715)

MIN_BLOCK_COLS = 128
"""4 scale columns: the F8_128x4 layout's column padding is then inside the last block."""
MAX_BLOCK_COLS = 1024
WIDE_I = 4096
"""From this I on, two rows per tile at large M (measured on the H200: docs/design.md, "act·mul producers")."""
SCALE_PAD_ROWS = 128
"""Rows of swizzled-scale padding one padding program zeroes (per column block)."""


class ActMulConfig(NamedTuple):
    """Launch shape of the act·mul kernel (any value computes the same bits)."""

    block_rows: int
    block_cols: int
    num_warps: int


def act_mul_config(m: int, i: int, sm_count: int) -> ActMulConfig:
    """`[BM, BC]` tiles of 8 values per thread (16 for I > 4096): BC = 1024 columns on 4 warps,
    halved (rows first, then columns, down to 128) while the grid has fewer than 2 programs per SM.

    Measured on the H200 (one run of tools/bench_kernels.py with config variants): 8-16 values
    per thread beat 32 by 15-35% at M >= 4096 (the quant's per-block reduction keeps more
    registers live), and 1024-column blocks beat 256..512 even where I is no multiple of 1024.
    """
    bc = max(MIN_BLOCK_COLS, min(MAX_BLOCK_COLS, triton.next_power_of_2(i)))
    bm = 2 if i > WIDE_I else 1

    def programs(bm: int, bc: int) -> int:
        return triton.cdiv(max(1, m), bm) * triton.cdiv(i, bc)

    while programs(bm, bc) < 2 * sm_count and (bm > 1 or bc > MIN_BLOCK_COLS):
        if bm > 1:
            bm //= 2
        else:
            bc //= 2
    return ActMulConfig(bm, bc, max(1, min(4, bc // 128)))


@triton.jit
def _round(v, DTYPE: tl.constexpr, ON: tl.constexpr):
    if ON:
        return v.to(DTYPE).to(tl.float32)
    else:
        return v


@triton.jit
def _exp_neg(x):
    return libdevice.exp(-x)


@triton.jit
def _silu(x):
    return tl.math.div_rn(x, 1.0 + _exp_neg(x))


@triton.jit
def _act_mul_tile(g, u, alpha, limit, ACT: tl.constexpr, ROUND: tl.constexpr, DTYPE: tl.constexpr):
    """`act(g) * u` of fp32 tiles, rounded to DTYPE and widened back (the value y holds)."""
    if ACT == 0:  # silu
        a = _round(_silu(g), DTYPE, ROUND)
    elif ACT == 1:  # gelu_tanh
        inner = GELU_BETA * (g + GELU_KAPPA * (g * g * g))
        a = _round((0.5 * g) * (1.0 + libdevice.tanh(inner)), DTYPE, ROUND)
    elif ACT == 2:  # swiglu_step
        a = _round(_silu(g), DTYPE, ROUND)
        a = _round(tl.minimum(a, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
        u = _round(tl.clamp(u, -limit, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
    else:  # swiglu_oai
        g = _round(tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
        s = _round(tl.math.div_rn(1.0, 1.0 + _exp_neg(_round(g * alpha, DTYPE, ROUND))), DTYPE, ROUND)
        a = _round(g * s, DTYPE, ROUND)
        u = _round(tl.clamp(u, -limit, limit, propagate_nan=tl.PropagateNan.ALL), DTYPE, ROUND)
        u = _round(u + 1.0, DTYPE, ROUND)
    return (a * u).to(DTYPE).to(tl.float32)


@triton.jit
def _zero_scale_padding(
    sc_ptr,
    p,
    first_row,
    scale_rows,
    scale_cols,
    scale_cols_padded,
    BC: tl.constexpr,
    PAD: tl.constexpr,
    ISA: tl.constexpr,
):
    """Zero the F8_128x4 scales of padding rows `first_row + p * PAD ...` (< scale_rows) in this
    column block: rows no tile of real rows covers, so no program loads or computes for them."""
    rows = first_row + p.to(tl.int64) * PAD + tl.arange(0, PAD)
    scols = tl.program_id(1) * (BC // 32) + tl.arange(0, BC // 32)
    zeros = tl.zeros([PAD, BC // 32], tl.int32)
    _store_scales(sc_ptr, zeros, rows, scols, scale_rows, scale_cols, scale_cols_padded, 0, True, "tl_store", ISA)


@triton.jit(do_not_specialize=["M", "scale_rows", "n_tiles"])
def _act_mul_kernel(
    g_ptr,
    u_ptr,
    y_ptr,
    q_ptr,
    sc_ptr,
    M,
    scale_rows,
    n_tiles,
    I,  # noqa: E741  (the MLP's intermediate size, as the papers name it)
    stride_g,
    stride_u,
    stride_y,
    stride_q,
    stride_s,
    scale_cols,
    scale_cols_padded,
    alpha,
    limit,
    ACT: tl.constexpr,
    ROUND_EACH_OP: tl.constexpr,
    QUANT: tl.constexpr,
    EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    RULE: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    ISA: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid >= n_tiles:  # only in the swizzled layout: a program of padding rows (no loads)
        if SWIZZLED:
            _zero_scale_padding(
                sc_ptr, pid - n_tiles, n_tiles * BM, scale_rows, scale_cols, scale_cols_padded, BC, PAD_ROWS, ISA
            )
    else:
        rows = pid.to(tl.int64) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        r2 = rows[:, None]
        c2 = cols[None, :]
        mask = (r2 < M) & (c2 < I)
        g = tl.load(g_ptr + r2 * stride_g + c2, mask=mask, other=0.0, eviction_policy="evict_first")
        u = tl.load(u_ptr + r2 * stride_u + c2, mask=mask, other=0.0, eviction_policy="evict_first")
        dtype: tl.constexpr = y_ptr.dtype.element_ty
        y = _act_mul_tile(g.to(tl.float32), u.to(tl.float32), alpha, limit, ACT, ROUND_EACH_OP, dtype)
        if EMIT_Y or not QUANT:
            tl.store(y_ptr + r2 * stride_y + c2, y.to(dtype), mask=mask)
        if QUANT:
            y = tl.where(mask, y, 0.0)  # masked rows / columns: zero blocks, scale byte 0
            codes, sb = _mx_quant_tile(y, BM, BC, "hw", RULE, ISA)
            tl.store(q_ptr + r2 * stride_q + c2, codes, mask=mask)
            scols = tl.program_id(1) * (BC // 32) + tl.arange(0, BC // 32)
            _store_scales(
                sc_ptr, sb, rows, scols, scale_rows, scale_cols, scale_cols_padded, stride_s, SWIZZLED, "in_place", ISA
            )


def _check_rows(name: str, t: torch.Tensor):
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"triton_act_quant: {name} must be 2-D with a unit last stride, got {tuple(t.shape)} {t.stride()}"
        )


def act_mul_launch(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    isa: Isa,
    alpha: float = 1.702,
    limit: float = 7.0,
    round_each_op: bool = True,
    quant: bool = True,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    config: ActMulConfig | None = None,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales, y), launch)` without running it (quant False: codes / scales None,
    y always). gate / up: `[M, I]` with a unit last stride (e.g. the two halves of a
    `[M, 2I]` gate_up: any row stride). Outputs on gate's device (a meta device works)."""
    _check_rows("gate", gate)
    _check_rows("up", up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"triton_act_quant: gate {tuple(gate.shape)} and up {tuple(up.shape)} must match")
    if activation not in ACTIVATION_IDS:
        raise ValueError(f"triton_act_quant: activation {activation!r} is not one of {', '.join(ACTIVATION_IDS)}")
    m, i = gate.shape
    if i % 32:
        raise ValueError(f"triton_act_quant: I={i} is not a multiple of 32")
    dev = gate.device
    swizzled = bool(quant and swizzled)
    y = torch.empty((m, i), dtype=gate.dtype, device=dev) if (emit_y or not quant) else None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    if quant:
        codes, scales = out_views(m, i, swizzled, dev, None, None)
    outputs = (codes, scales, y)
    rule_key = rule_name(rule)
    scale_rows = padded_rows(m) if swizzled else m
    if scale_rows == 0 or i == 0:
        return outputs, None
    cfg = config or act_mul_config(m, i, _sm_count(dev))
    n_tiles = triton.cdiv(m, cfg.block_rows)
    n_pad = triton.cdiv(scale_rows - n_tiles * cfg.block_rows, SCALE_PAD_ROWS) if swizzled else 0
    grid = (n_tiles + n_pad, triton.cdiv(i, cfg.block_cols))
    s = scale_columns(i)
    y_arg = y if y is not None else gate
    args = (
        gate, up, y_arg, codes if quant else gate, scales if quant else gate,
        m, scale_rows, n_tiles, i, row_stride(gate, i), row_stride(up, i), row_stride(y_arg, i),
        row_stride(codes, i) if codes is not None else i, row_stride(scales, s) if scales is not None else s,
        s, padded_scale_columns(i), float(alpha), float(limit),
    )  # fmt: skip
    constexprs = dict(
        ACT=ACTIVATION_IDS[activation],
        ROUND_EACH_OP=bool(round_each_op),
        QUANT=bool(quant),
        EMIT_Y=bool(emit_y and quant),
        SWIZZLED=swizzled,
        BM=cfg.block_rows,
        BC=cfg.block_cols,
        RULE=rule_key,
        PAD_ROWS=SCALE_PAD_ROWS,
        ISA=isa,
    )
    return outputs, KernelLaunch(_act_mul_kernel, grid, args, constexprs, cfg.num_warps, fp_fusion=False)


def act_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    round_each_op: bool = True,
    quant: bool = True,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    config: ActMulConfig | None = None,
):
    """`(codes, scales, y)` of `act(gate) * up` (quant False: `(None, None, y)`); one launch."""
    isa = device_isa(gate.device)
    outputs, launch = act_mul_launch(
        gate, up, activation, isa=isa, alpha=alpha, limit=limit, round_each_op=round_each_op, quant=quant,
        swizzled=swizzled, emit_y=emit_y, rule=rule, config=config,
    )  # fmt: skip
    if launch is not None:
        launch.run()
    return outputs
