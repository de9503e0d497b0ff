"""Triton kernels of the gated producers (CUDA impls of :mod:`mxfuse.ops.gated`).

Functions (2-D `[M, K]` rows with a unit last stride; any row stride; M may be 0; K % 32 == 0):

- :func:`sigmoid_gate` -- `x * sigmoid(gate)`, quantized to MXFP8 (`quant=True`, codes +
  scales in either layout, `y` too when `emit_y`) or stored as `y` (`quant=False`: the unfused op).
- :func:`gated_rms_norm` -- `rms(x) * w * act(z)` per group of `group_size` values, likewise.

Each has a `*_launch` twin that allocates the outputs and returns them with the launch
(:class:`KernelLaunch`) without running it, for tests/test_targets_compile.py.

Design
======

A prologue computes the producer's `y` of a tile in fp32 and rounds it to the dtype; the
MXFP8 epilogue is rewrite 1's own (`_mx_quant_tile`, `_store_scales` of
:mod:`mxfuse.ops.triton_norm_quant`), reading the ROUNDED `y`. The unfused op is the same
kernel with `QUANT` False storing `y` instead, so fused == unfused + `mxfp8_quantize`
bitwise on the device by construction (the quant kernel computes the same E8M0 function on
the same bf16 values).

Arithmetic (compiled without FMA contraction):

- sigmoid / silu: `1 / (1 + exp(-v))`, `v / (1 + exp(-v))` with libdevice's precise `exp`
  (CUDA's `expf`; never `ex2.approx`) and the correctly rounded divide: what torch's CUDA
  `sigmoid` / `silu` kernels compute (`one / (one + std::exp(-x))` in fp32), bit for bit on
  the elementwise part.
- the gated norm's mean square: a `[BM, GP]` tile holds whole groups (GP = the group padded
  to a power of two, >= 128), summed by `tl.sum` (order fixed by the config, which depends on
  the group size alone: batch invariant), divided by G with `div_rn`; `1/sqrt` is
  `rsqrt.approx.f32` on NVIDIA (what torch's CUDA `rsqrt` and Inductor compute) and
  `tl.math.rsqrt` elsewhere.

Grids: the gate is elementwise: `[BM, BC]` tiles of `quant_config`. The gated norm: one
program per BM rows and one group (`(cdiv(rows, BM), K / G)`); a group's padding lanes and
the swizzled layout's padding rows compute from zeros, and the last group also stores the
zero scale columns past K/32 up to the F8_128x4 padding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxfuse.ops.mx_layout import padded_rows, padded_scale_columns, scale_columns
from mxfuse.ops.norm_quant_config import next_pow2, quant_config
from mxfuse.ops.reference import QuantRule
from mxfuse.ops.triton_mx_quant import _mx_quant_tile, _store_scales, check2d, check_k, out_views, rule_name
from mxfuse.ops.triton_norm_prologue import _pairwise_sum
from mxfuse.ops.triton_targets import Isa, KernelLaunch, device_isa

__all__ = ["gate_launch", "gated_norm_launch", "gated_rms_norm", "sigmoid_gate"]

MIN_GROUP_TILE = 128
"""Columns of a group's tile at least (a multiple of 4 scale columns)."""
TILE_VALUES = 4096
"""Values per program of the gated norm (BM = TILE_VALUES / GP rows, at least 1)."""


# --------------------------------------------------------------------------- prologues


@triton.jit
def _exp(v, PRECISE_EXP: tl.constexpr):
    """fp32 `exp`: libdevice's precise one on a GPU (CUDA's `expf`, ROCm's `__ocml_exp_f32`); `tl.exp`
    only in Triton's CPU interpreter, which has no libdevice (and is never used to claim bits)."""
    if PRECISE_EXP:
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def _sigmoid(v, BM: tl.constexpr, BC: tl.constexpr, PRECISE_EXP: tl.constexpr):
    """fp32 `1 / (1 + exp(-v))`: precise exp, correctly rounded divide (torch's CUDA sigmoid)."""
    return tl.math.div_rn(tl.full([BM, BC], 1.0, tl.float32), _exp(-v, PRECISE_EXP) + 1.0)


@triton.jit
def _gate_activation(v, ACTIVATION: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, PRECISE_EXP: tl.constexpr):
    """fp32 silu `v / (1 + exp(-v))` or sigmoid `1 / (1 + exp(-v))` (gated.gate_activation)."""
    if ACTIVATION == "silu":
        return tl.math.div_rn(v, _exp(-v, PRECISE_EXP) + 1.0)
    else:
        return _sigmoid(v, BM, BC, PRECISE_EXP)


@triton.jit
def _rsqrt(v, ISA: tl.constexpr):
    """`1 / sqrt(v)`: `rsqrt.approx.f32` on NVIDIA (not the `.ftz` form), `tl.math.rsqrt` elsewhere."""
    if ISA == "ptx":
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.rsqrt(v)


@triton.jit
def _store_or_quantize(
    y,
    y_ptr,
    q_ptr,
    sc_ptr,
    rows,
    cols,
    scols,
    mask,
    M,
    K,
    scale_rows,
    scale_cols,
    scale_cols_padded,
    QUANT: tl.constexpr,
    EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    RULE: tl.constexpr,
    ISA: tl.constexpr,
):
    """The epilogue: store the rounded `y` tile (unfused, or EMIT_Y) and / or its MXFP8 codes and scales."""
    offs = rows[:, None] * K + cols[None, :]
    if EMIT_Y or not QUANT:
        tl.store(y_ptr + offs, y, mask=mask)
    if QUANT:
        codes, sb = _mx_quant_tile(y.to(tl.float32), BM, BC, QUANT_OPS, RULE, ISA)
        tl.store(q_ptr + offs, codes, mask=mask)
        sb = tl.where((rows < M)[:, None], sb, 0)  # padding rows of F8_128x4: zero (even where y is NaN)
        _store_scales(sc_ptr, sb, rows, scols, scale_rows, scale_cols, scale_cols_padded, scale_cols, SWIZZLED,
                      SCALE_STORE, ISA)  # fmt: skip


# --------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M", "scale_rows"])
def _gate_kernel(
    x_ptr,
    g_ptr,
    y_ptr,
    q_ptr,
    sc_ptr,
    M,
    scale_rows,
    K,
    stride_x,
    stride_g,
    scale_cols,
    scale_cols_padded,
    QUANT: tl.constexpr,
    EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROUND_GATE: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    RULE: tl.constexpr,
    ISA: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
):
    """`y = x * sigmoid(gate)` of a `[BM, BC]` tile (the sigmoid rounded to the dtype first when ROUND_GATE)."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    s = _sigmoid(g.to(tl.float32), BM, BC, PRECISE_EXP)
    if ROUND_GATE:
        s = s.to(x.dtype).to(tl.float32)
    y = (x.to(tl.float32) * s).to(x.dtype)
    scols = tl.program_id(1) * (BC // 32) + tl.arange(0, BC // 32)
    _store_or_quantize(y, y_ptr, q_ptr, sc_ptr, rows, cols, scols, mask, M, K, scale_rows, scale_cols,
                       scale_cols_padded, QUANT, EMIT_Y, SWIZZLED, BM, BC, QUANT_OPS, SCALE_STORE, RULE,
                       ISA)  # fmt: skip


@triton.jit(do_not_specialize=["M", "scale_rows"])
def _gated_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    sc_ptr,
    M,
    scale_rows,
    K,
    stride_x,
    stride_z,
    group_size,
    scale_cols,
    scale_cols_padded,
    eps,
    G: tl.constexpr,
    GP: tl.constexpr,
    W_FULL: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr,
    ROUND_WEIGHTED: tl.constexpr,
    QUANT: tl.constexpr,
    EMIT_Y: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BM: tl.constexpr,
    QUANT_OPS: tl.constexpr,
    SCALE_STORE: tl.constexpr,
    RULE: tl.constexpr,
    ISA: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
):
    """The gated RMSNorm of BM rows' group `program_id(1)` (G values, padded to GP lanes)."""
    group = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    j = tl.arange(0, GP)
    cols = group * G + j
    mask = (rows < M)[:, None] & (j < G)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
    w_offs = cols if W_FULL else j
    w = tl.load(w_ptr + w_offs[None, :], mask=(j < G)[None, :], other=0.0).to(tl.float32)
    act = _gate_activation(z.to(tl.float32), ACTIVATION, BM, GP, PRECISE_EXP)
    s = x.to(tl.float32)
    if not NORM_BEFORE_GATE:
        s = s * act
    # a fixed-tree sum: `tl.sum`'s order follows the register layout, which the quant epilogue's
    # reshapes change (seen in the sm_90 TTGIR: [1, 8] x [2, 16] lanes unfused, [1, 16] x [4, 8] fused),
    # so fused and unfused would round the mean square differently; the pairwise tree does not
    var = tl.math.div_rn(_pairwise_sum(s * s, BM, GP), group_size.to(tl.float32))
    n = s * _rsqrt(var + eps, ISA)[:, None]
    if ROUND_NORMALIZED:
        n = n.to(x.dtype).to(tl.float32)
    out = n * w
    if ROUND_WEIGHTED:
        out = out.to(x.dtype).to(tl.float32)
    if NORM_BEFORE_GATE:
        out = out * act
    y = out.to(x.dtype)
    jb = tl.arange(0, GP // 32)
    # a group's padding blocks store nothing (they are the next group's columns)
    scols = tl.where(jb < G // 32, group * (G // 32) + jb, scale_cols_padded)
    _store_or_quantize(y, y_ptr, q_ptr, sc_ptr, rows, cols, scols, mask, M, K, scale_rows, scale_cols,
                       scale_cols_padded, QUANT, EMIT_Y, SWIZZLED, BM, GP, QUANT_OPS, SCALE_STORE, RULE,
                       ISA)  # fmt: skip
    if QUANT and SWIZZLED:  # noqa: SIM102  (a constexpr branch around a runtime one)
        if group == tl.num_programs(1) - 1:  # the zero scale columns K/32 .. pad4(K/32) of the F8_128x4 layout
            pad = scale_cols + tl.arange(0, 4)
            zeros = tl.zeros([BM, 4], dtype=tl.int32)
            _store_scales(sc_ptr, zeros, rows, pad, scale_rows, scale_cols, scale_cols_padded, scale_cols, SWIZZLED,
                          "tl_store", ISA)  # fmt: skip


# --------------------------------------------------------------------------- launches


def _outputs(x: torch.Tensor, quant: bool, swizzled: bool, emit_y: bool):
    m, k = x.shape
    y = torch.empty((m, k), dtype=x.dtype, device=x.device) if (emit_y or not quant) else None
    codes = scales = None
    if quant:
        codes, scales = out_views(m, k, swizzled, x.device, None, None)
    return codes, scales, y


def gate_launch(
    x: torch.Tensor,
    gate: torch.Tensor,
    *,
    quant: bool,
    isa: Isa,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    round_gate: bool = True,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales, y), launch)` of the gate kernel, not run (quant False: codes / scales None)."""
    check2d("x", x)
    check2d("gate", gate)
    m, k = x.shape
    check_k(k)
    if gate.shape != x.shape:
        raise ValueError(f"triton_gated_quant: gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    swizzled = bool(quant and swizzled)
    codes, scales, y = _outputs(x, quant, swizzled, emit_y)
    scale_rows = padded_rows(m) if swizzled else m
    rule_key = rule_name(rule)
    if scale_rows == 0:
        return (codes, scales, y), None
    cfg = quant_config(k, m)
    grid = (triton.cdiv(scale_rows, cfg.block_rows), triton.cdiv(k, cfg.block_cols))
    args = (
        x, gate, y if y is not None else x, codes if quant else x, scales if quant else x,
        m, scale_rows, k, x.stride(0) if m > 1 else k, gate.stride(0) if m > 1 else k,
        scale_columns(k), padded_scale_columns(k),
    )  # fmt: skip
    constexprs = dict(
        QUANT=bool(quant),
        EMIT_Y=bool(emit_y and quant),
        SWIZZLED=swizzled,
        ROUND_GATE=bool(round_gate),
        BM=cfg.block_rows,
        BC=cfg.block_cols,
        QUANT_OPS=cfg.quant_ops,
        SCALE_STORE=cfg.scale_store,
        RULE=rule_key,
        ISA=isa,
        PRECISE_EXP=x.device.type != "cpu",
    )
    return (codes, scales, y), KernelLaunch(_gate_kernel, grid, args, constexprs, cfg.num_warps, fp_fusion=False)


def gated_norm_tile(group_size: int) -> tuple[int, int, int]:
    """(GP, BM, num_warps) of the gated norm for a group size: a function of G alone (batch invariant)."""
    gp = max(MIN_GROUP_TILE, next_pow2(group_size))
    bm = max(1, TILE_VALUES // gp)
    return gp, bm, max(4, min(16, bm * gp // 512))


def gated_norm_launch(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    *,
    quant: bool,
    isa: Isa,
    swizzled: bool = False,
    emit_y: bool = False,
    rule: int = QuantRule.DEFAULT,
    norm_before_gate: bool = True,
    activation: str = "silu",
    round_normalized: bool = False,
    round_weighted: bool = False,
) -> tuple[tuple, KernelLaunch | None]:
    """`((codes, scales, y), launch)` of the gated-norm kernel, not run (quant False: codes / scales None)."""
    check2d("x", x)
    check2d("z", z)
    m, k = x.shape
    check_k(k)
    if z.shape != x.shape:
        raise ValueError(f"triton_gated_quant: z {tuple(z.shape)} must match x {tuple(x.shape)}")
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"triton_gated_quant: group_size={group_size} must be a multiple of 32 dividing K={k}")
    weight = weight.contiguous()
    if weight.shape not in ((group_size,), (k,)):
        raise ValueError(f"triton_gated_quant: weight {tuple(weight.shape)} must be ({group_size},) or ({k},)")
    swizzled = bool(quant and swizzled)
    codes, scales, y = _outputs(x, quant, swizzled, emit_y)
    scale_rows = padded_rows(m) if swizzled else m
    rule_key = rule_name(rule)
    if scale_rows == 0:
        return (codes, scales, y), None
    gp, bm, warps = gated_norm_tile(group_size)
    grid = (triton.cdiv(scale_rows, bm), k // group_size)
    cfg = quant_config(k, m)  # the quant variant (quant_ops, scale_store) of the quant kernel
    args = (
        x, z, weight, y if y is not None else x, codes if quant else x, scales if quant else x,
        m, scale_rows, k, x.stride(0) if m > 1 else k, z.stride(0) if m > 1 else k, group_size,
        scale_columns(k), padded_scale_columns(k), float(eps),
    )  # fmt: skip
    constexprs = dict(
        G=group_size,
        GP=gp,
        W_FULL=weight.shape[0] == k and k != group_size,
        NORM_BEFORE_GATE=bool(norm_before_gate),
        ACTIVATION=activation,
        ROUND_NORMALIZED=bool(round_normalized),
        ROUND_WEIGHTED=bool(round_weighted),
        QUANT=bool(quant),
        EMIT_Y=bool(emit_y and quant),
        SWIZZLED=swizzled,
        BM=bm,
        QUANT_OPS=cfg.quant_ops,
        SCALE_STORE=cfg.scale_store,
        RULE=rule_key,
        ISA=isa,
        PRECISE_EXP=x.device.type != "cpu",
    )
    return (codes, scales, y), KernelLaunch(_gated_norm_kernel, grid, args, constexprs, warps, fp_fusion=False)


def _run(outputs: tuple, launch: KernelLaunch | None) -> tuple:
    if launch is not None:
        launch.run()
    return outputs


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, *, quant: bool, **kw) -> tuple:
    """`(codes, scales, y)` of `x * sigmoid(gate)` (keywords of :func:`gate_launch`); None where not computed."""
    return _run(*gate_launch(x, gate, quant=quant, isa=device_isa(x.device), **kw))


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, *, quant: bool, **kw
) -> tuple:
    """`(codes, scales, y)` of the gated RMSNorm (keywords of :func:`gated_norm_launch`); None where not computed."""
    return _run(*gated_norm_launch(x, z, weight, eps, group_size, quant=quant, isa=device_isa(x.device), **kw))
