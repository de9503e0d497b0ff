"""fp32 `exp`, SiLU and sigmoid of the producer kernels: Inductor's arithmetic, in fewer instructions.

What vLLM runs today for an activation is Inductor's code for the decomposed graph (`custom_ops`
`['none']`): `libdevice.exp(-x)`, `+ 1`, and Triton's `/` (`torch/_inductor/codegen/triton.py`,
`exp` and `truediv`; `div_rn` only under `TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1`). On NVIDIA
that `/` is `div.full.f32` (within 2 ulp). The producer kernels compute the same fp32 values
(`MATH` "ptx"), written out so that ptxas gets less to do:

- :func:`exp_f32` is libdevice's `__nv_expf` instruction for instruction (its PTX, read from
  Triton's libdevice), except that the FMA and the saturate that follows it are one
  `fma.rn.ftz.sat.f32` (the same value by the PTX definition of `.sat`): 8 instructions, not 9;
  :func:`exp_neg_f32` is `exp_f32(-x)` with the negation in its constants (the SiLU's and sigmoid's
  `exp(-x)`: Triton's `-x` is an FADD of its own);
- :func:`tanh_f32` is libdevice's `__nv_tanhf` with both sides of its branch computed and one selected
  (GELU-tanh: the branch ran a thread's values one path after the other, with no overlap between them);
- :func:`div_one_plus` is `n / (1 + e)` for `e = exp(-x)` with Triton's `/` (`div.full.f32`: the operands
  scaled by 1/4 when the divisor exceeds 2**126, then `n * rcp.approx(d)`), the same bits in 4 instructions
  (the add included) instead of 9 (6 once the subnormal-divisor branch that `d >= 1` never takes is gone;
  the correctly rounded `div.rn.f32` is 10 and a branch): it always takes `div.full`'s scaled path, which is
  exact where `div.full` does not take it. `(1 + e) / 4` is one FMA (`round((1 + e) / 4)` is
  `round(1 + e) / 4`: a power-of-two scale commutes with rounding in the normal range, and the quotient is at
  least 1/4); `rcp.approx` of `d / 4` is 4 times that of `d` for every `d <= 2**126` (the exponent is
  negated, the mantissa's reciprocal the same), so `(n / 4) * rcp(d / 4)` is the exact product `n * rcp(d)`
  rounded once, provided `n / 4` is exact: true for 1 and every bf16 / fp16 value (the activations' inputs),
  not for fp32 values below 2**-124 with their low bits set;
- :func:`rcp_rn_f32` is the correctly rounded `1 / d` of the gate's eager sigmoid (torch's `div.rn`, not
  Inductor's `/`): ptxas's own `rcp.rn.f32` fast path for every value, one range test for 1, 2 or 4 values,
  `div.rn` for those whose result is subnormal, zero or NaN; 3 instructions a value and the test, not ~10.

The kernel is close to issue-bound (docs/perf_notes.md): the SiLU went from 20 to 11 instructions a
value. Against torch's eager CUDA kernels (`x / (1 + expf(-x))` with `div.rn`) the fp32 values
differ by at most 2 ulp, which the rounding to bf16 / fp16 hides almost always: the bound of
docs/design.md ("act·mul producers"), tested on the GPU (tests/test_gpu_act_mul.py;
tests/test_gpu_fp32_math.py checks `exp_f32` against libdevice on every fp32 input, `div_one_plus`
against `/`, `rcp_rn_f32` against `div_rn` and the SiLU against Inductor's). On a CPU,
tests/test_fp32_math_compiled.py compiles the library's code and ours for sm_90 and sm_100 and fails if
a Triton update changed the library's side: on Blackwell `div.full.f32` is the same instructions, so the
equality carries over there (same MUFU on both sides).

:func:`bf16_bits_to_f32` widens bf16 to fp32 by moving bits (one integer op a value on NVIDIA), the
norms' and the act·mul's shared unpack.

`MATH` "portable" (AMD, or another NVIDIA-less target): libdevice's (OCML's) `exp` and Triton's `/`,
what Inductor emits there; "interpreter": `tl.exp` (Triton's CPU interpreter has no libdevice;
never used to claim bits).
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxfuse.ops.triton_targets import Isa

Math = Literal["ptx", "portable", "interpreter"]

__all__ = [
    "Math",
    "div_one_plus",
    "exp_f32",
    "exp_neg_f32",
    "math_of",
    "rcp_pack",
    "rcp_rn_f32",
    "sigmoid_f32",
    "silu_f32",
    "tanh_f32",
]


def math_of(device: torch.device, isa: Isa) -> Math:
    """The `MATH` constexpr of a launch on `device` compiled for `isa`."""
    if device.type == "cpu":
        return "interpreter"
    return "ptx" if isa == "ptx" else "portable"


def _expf_ptx(sign: str) -> str:
    """libdevice's `__nv_expf` as PTX of `$1` (sign "") or of `-$1` (sign "-": the three products' constants
    negated, so the input needs no negation of its own)."""
    c = {"": ("3BBB989D", "3FB8AA3B", "32A57060"), "-": ("BBBB989D", "BFB8AA3B", "B2A57060")}[sign]
    return f"""{{
            .reg .f32 t, j, f, p;
            .reg .b32 s;
            fma.rn.ftz.sat.f32 t, $1, 0f{c[0]}, 0f3F000000;
            fma.rm.ftz.f32 j, t, 0f437C0000, 0f4B400001;
            add.rn.f32 f, j, 0fCB40007F;
            neg.f32 f, f;
            fma.rn.ftz.f32 f, $1, 0f{c[1]}, f;
            fma.rn.ftz.f32 f, $1, 0f{c[2]}, f;
            shl.b32 s, j, 23;
            ex2.approx.ftz.f32 p, f;
            mul.rn.f32 $0, p, s;
            }}"""


EXPF_PTX = tl.constexpr(_expf_ptx(""))
EXPF_NEG_PTX = tl.constexpr(_expf_ptx("-"))


@triton.jit
def exp_f32(v, MATH: tl.constexpr):
    """fp32 `exp(v)`: CUDA's `expf` bits on NVIDIA (libdevice's sequence, the saturate folded into its FMA)."""
    if MATH == "ptx":
        return tl.inline_asm_elementwise(EXPF_PTX, "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)
    elif MATH == "portable":
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def exp_neg_f32(v, MATH: tl.constexpr):
    """fp32 `exp(-v)`, the bits of `exp_f32(-v)` on every input. Triton's unary minus is `0 - v`, an FADD a
    value that ptxas must keep (it maps -0 to +0); here the negation is folded into the three products'
    constants. Only the input zeros' signs differ from `exp_f32(0 - v)` inside, and both give exp 1 there."""
    if MATH == "ptx":
        return tl.inline_asm_elementwise(EXPF_NEG_PTX, "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)
    elif MATH == "portable":
        return libdevice.exp(-v)
    else:
        return tl.exp(-v)


TANHF_PTX = tl.constexpr(
    """{
    .reg .f32 a, x2, t, p, e, q, r;
    .reg .pred small, big;
    .reg .b32 sign;
    abs.ftz.f32 a, $1;
    setp.ltu.f32 small, a, 0f3F19999A;
    mul.rn.f32 x2, $1, $1;
    fma.rn.ftz.f32 t, 0f3C80F082, x2, 0fBD563CAE;
    fma.rn.ftz.f32 t, t, x2, 0f3E085941;
    fma.rn.ftz.f32 t, t, x2, 0fBEAAA9ED;
    fma.rn.ftz.f32 t, t, x2, 0f00000000;
    fma.rn.ftz.f32 p, t, $1, $1;
    mul.rn.f32 e, a, 0f4038AA3B;
    ex2.approx.ftz.f32 e, e;
    add.rn.f32 e, e, 0f3F800000;
    rcp.approx.ftz.f32 q, e;
    fma.rn.ftz.f32 r, q, 0fC0000000, 0f3F800000;
    setp.ge.f32 big, a, 0f41102CB4;
    selp.f32 r, 0f3F800000, r, big;
    and.b32 sign, $1, 0x80000000;
    or.b32 r, sign, r;
    selp.f32 $0, p, r, small;
    }"""
)
"""libdevice's `__nv_tanhf` without its branch: |x| < 0.6 (or NaN) takes the odd polynomial, else
`1 - 2 / (2**(2|x| log2 e) + 1)` (1 from |x| >= 9.0109) with x's sign; both computed, one selected."""


@triton.jit
def tanh_f32(v, MATH: tl.constexpr):
    """fp32 `tanh(v)`: libdevice's `tanhf` bits on NVIDIA, branch-free (its branch splits a thread's values into
    paths that run one after another; both paths cost ~20 instructions, the branch's bookkeeping aside)."""
    if MATH == "ptx":
        return tl.inline_asm_elementwise(TANHF_PTX, "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)
    elif MATH == "portable":
        return libdevice.tanh(v)
    else:
        return 2.0 / (1.0 + tl.exp(-2.0 * v)) - 1.0


DIV_ONE_PLUS_PTX = tl.constexpr(
    """{
    .reg .f32 q, r, h;
    fma.rn.f32 q, $2, 0f3E800000, 0f3E800000;
    rcp.approx.ftz.f32 r, q;
    mul.rn.f32 h, $1, 0f3E800000;
    mul.rn.f32 $0, h, r;
    }"""
)
"""`($1 / 4) * rcp.approx(($2 + 1) / 4)`: :func:`div_one_plus`."""


@triton.jit
def div_one_plus(n, e, MATH: tl.constexpr):
    """`n / (1 + e)` for `e >= 0`, +inf or NaN, and `n` whose quarter is exact (1, any bf16 / fp16 value): the
    bits of Triton's `n / (1 + e)` (on NVIDIA `div.full.f32` of the rounded sum), by its scaled path at every
    divisor (the module docstring says why that is exact)."""
    if MATH == "ptx":
        return tl.inline_asm_elementwise(DIV_ONE_PLUS_PTX, "=r,r,r", [n, e], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return n / (1.0 + e)


RCP_RN_PACKS = (1, 2, 4)
"""The values one :func:`rcp_rn_f32` block takes (its inline PTX's `pack`)."""


def _rcp_rn_ptx(pack: int) -> str:
    """PTX of :func:`rcp_rn_f32` for `pack` values: outputs `$0..`, inputs `$pack..`. The fast path first, for
    every value (no predicate in front of its reciprocals), then the test and the branch to `div.rn`, which
    overwrites them. `${:uid}` makes the label of each inlined copy unique."""
    ins = [f"${pack + i}" for i in range(pack)]
    lines = ["{", ".reg .pred slow;", ".reg .f32 r, e;"]
    for i, d in enumerate(ins):
        lines += [f"rcp.approx.ftz.f32 r, {d};", f"fma.rn.f32 e, {d}, r, 0fBF800000;", "neg.f32 e, e;",
                  f"fma.rn.f32 ${i}, r, e, r;"]  # fmt: skip
    lines.append(f"setp.geu.f32 slow, {ins[0]}, 0f7E800000;")
    lines += [f"setp.geu.or.f32 slow, {d}, 0f7E800000, slow;" for d in ins[1:]]
    lines.append("@!slow bra RCP_DONE${:uid};")
    lines += [f"div.rn.f32 ${i}, 0f3F800000, {d};" for i, d in enumerate(ins)]
    lines += ["RCP_DONE${:uid}:", "}"]
    return "\n".join(lines)


RCP_RN_PTX_1 = tl.constexpr(_rcp_rn_ptx(1))
RCP_RN_PTX_2 = tl.constexpr(_rcp_rn_ptx(2))
RCP_RN_PTX_4 = tl.constexpr(_rcp_rn_ptx(4))


@triton.jit
def rcp_rn_f32(d, MATH: tl.constexpr, PACK: tl.constexpr = 1):
    """`div_rn(1, d)` for `d >= 1`, +inf or NaN (the sigmoid's `1 + exp(-x)`), the same bits in fewer
    instructions on NVIDIA. ptxas expands `div.rn.f32` into a reciprocal, five FMAs, a range check and a branch
    a value; its own `rcp.rn.f32` is `rcp.approx`, two FMAs and an exponent-range branch a value. Here that fast
    path (`r = rcp.approx(d)`, `r + r * (1 - d * r)`: correctly rounded for every d with an exponent field in
    [1, 252], which ptxas relies on) runs for every value, then one test for PACK values: `d >= 2**126` or NaN
    in any of them recomputes all PACK with `div.rn` (the results that are subnormal, 0 or NaN). ~4
    instructions a value instead of ~10, and nothing in front of the reciprocal (tests/test_gpu_fp32_math.py
    compares it with `div_rn` on every fp32 from 1 up, NaN too). PACK (1, 2 or 4) must divide the values a
    thread holds."""
    if MATH == "ptx":
        if PACK == 4:
            return tl.inline_asm_elementwise(RCP_RN_PTX_4, "=r,=r,=r,=r,r,r,r,r", [d], dtype=tl.float32,
                                             is_pure=True, pack=4)  # fmt: skip
        elif PACK == 2:
            return tl.inline_asm_elementwise(RCP_RN_PTX_2, "=r,=r,r,r", [d], dtype=tl.float32, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(RCP_RN_PTX_1, "=r,r", [d], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)


def rcp_pack(values_per_thread: int) -> int:
    """The largest of `RCP_RN_PACKS` dividing a thread's values."""
    return max(p for p in RCP_RN_PACKS if values_per_thread % p == 0)


@triton.jit
def silu_f32(x, MATH: tl.constexpr):
    """`x / (1 + exp(-x))` (torch's decomposition of `F.silu`) with Inductor's `/` (`div_one_plus`: x is a
    bf16 / fp16 value widened)."""
    return div_one_plus(x, exp_neg_f32(x, MATH), MATH)


@triton.jit
def sigmoid_f32(x, MATH: tl.constexpr, ROUNDED_DIV: tl.constexpr = False, PACK: tl.constexpr = 1):
    """`1 / (1 + exp(-x))`: Inductor's `/`, or with ROUNDED_DIV the correctly rounded division of torch's eager
    CUDA kernels (`rcp_rn_f32`, PACK values at a time)."""
    e = exp_neg_f32(x, MATH)
    if ROUNDED_DIV:
        return rcp_rn_f32(1.0 + e, MATH, PACK)
    else:
        return div_one_plus(tl.full(x.shape, 1.0, tl.float32), e, MATH)


@triton.jit
def bf16_bits_to_f32(v):
    """bf16 -> fp32 on NVIDIA (inline PTX; callers check the target): a bf16 pair's 32-bit word gives its two
    fp32 values by one integer op each (`shl` 16 for the low half, `and` 0xffff0000 for the high one). bf16 ->
    fp32 is exact and moves the bits only (subnormals and NaN payloads too), as ptxas's `cvt.f32.bf16` does, but
    that takes a PRMT and a shift for the high half: the same bits, half an instruction less a value."""
    return tl.inline_asm_elementwise(
        "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }",
        "=r,=r,r",
        [v],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )
