"""The producers' written-out fp32 arithmetic is still the library's, as the Triton installed here compiles it.

mxfuse/ops/triton_fp32_math.py writes out four pieces of NVIDIA code so that the kernels issue fewer
instructions with the same bits: libdevice's `__nv_expf` (its saturate folded into the first FMA),
`n / (1 + e)` by `div.full.f32`'s scaled path (Triton's `/`: the equality rests on that path being the operands
times 1/4 and one `rcp.approx`, which is what these tests pin down), libdevice's `__nv_tanhf` (both sides of
its branch computed, one selected), and the correctly rounded `1 / d` by the fast path of ptxas's own
`rcp.rn.f32` (its instructions and its exponent range pinned here). The GPU tests
(tests/test_gpu_fp32_math.py) prove the bits on the device they run on; these tests, on a CPU, compile
both the library's code and ours for sm_90 and sm_100 and fail if a Triton / libdevice / ptxas update
changed the library's side (a constant, an instruction, a threshold), so the copy cannot go stale unseen.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.language.extra import libdevice  # noqa: E402

from mxfuse.ops.triton_fp32_math import RCP_RN_PACKS, div_one_plus, exp_f32, rcp_rn_f32, tanh_f32  # noqa: E402

ARCHS = (90, 100)


@triton.jit
def _libdevice_exp(x_ptr, y_ptr):
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, libdevice.exp(tl.load(x_ptr + offs)))


@triton.jit
def _our_exp(x_ptr, y_ptr):
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, exp_f32(tl.load(x_ptr + offs), "ptx"))


@triton.jit
def _tritons_division(x_ptr, d_ptr, y_ptr):
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) / tl.load(d_ptr + offs))


@triton.jit
def _our_division(x_ptr, e_ptr, y_ptr):
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, div_one_plus(tl.load(x_ptr + offs), tl.load(e_ptr + offs), "ptx"))


@triton.jit
def _ptxas_rcp_rn(x_ptr, y_ptr):
    offs = tl.arange(0, 128)
    d = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=r,r", [d], tl.float32, True, 1))


@triton.jit
def _our_rcp_rn(x_ptr, y_ptr, PACK: tl.constexpr):
    offs = tl.arange(0, 128)  # one warp: 4 values a thread
    tl.store(y_ptr + offs, rcp_rn_f32(tl.load(x_ptr + offs), "ptx", PACK))


@triton.jit
def _libdevice_tanh(x_ptr, y_ptr):
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, libdevice.tanh(tl.load(x_ptr + offs)))


@triton.jit
def _our_tanh(x_ptr, y_ptr):
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, tanh_f32(tl.load(x_ptr + offs), "ptx"))


def compile_for(kernel, n_pointers: int, arch: int, num_warps: int = 4, **constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = dict.fromkeys(names[:n_pointers], "*fp32") | dict.fromkeys(constexprs, "constexpr")
    # as the producer kernels are launched: no FMA contraction (`KernelLaunch(fp_fusion=False)`)
    options = {"enable_fp_fusion": False, "num_warps": num_warps}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def float_ops(ptx: str) -> list[str]:
    """The opcodes of the PTX instructions that compute (moves, loads, stores and address math left out)."""
    out = []
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@%p\d+\s+)?([a-z][\w.]*)\s+(.*);", line)
        if not m or not re.match(r"(fma|add|mul|cvt\.ftz\.sat|ex2|shl|neg|sub)\b", m[1]):
            continue
        if m[1].startswith(("add.s", "add.u", "mul.wide", "mul.lo", "shl.b64")):
            continue
        out.append(m[1])
    return out


def sass(compiled, keep: str = r"(FSETP|FMUL|MUFU|FFMA|FSEL|FCHK)") -> list[str]:
    from triton.backends.nvidia import compiler as nvidia

    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    lines = [re.sub(r";.*", "", line).split("*/", 1)[-1].strip() for line in text.splitlines()]
    return [line for line in lines if re.match(r"(@!?P\d )?" + keep, line)]


@pytest.mark.parametrize("arch", ARCHS)
def test_exp_f32_is_libdevices_expf_with_the_saturate_folded(arch):
    theirs = compile_for(_libdevice_exp, 2, arch).asm["ptx"]
    ours = compile_for(_our_exp, 2, arch).asm["ptx"]
    constants = set(re.findall(r"0f[0-9A-F]{8}", theirs))
    assert constants == set(re.findall(r"0f[0-9A-F]{8}", ours)), "libdevice's expf constants changed"
    expected = [
        "fma.rn.ftz.f32", "cvt.ftz.sat.f32.f32", "fma.rm.ftz.f32", "add.rn.f32", "neg.f32", "fma.rn.ftz.f32",
        "fma.rn.ftz.f32", "shl.b32", "ex2.approx.ftz.f32", "mul.rn.f32",
    ]  # fmt: skip
    assert float_ops(theirs) == expected, "libdevice's expf compiles to other instructions now"
    assert float_ops(ours) == ["fma.rn.ftz.sat.f32", *expected[2:]]


@pytest.mark.parametrize("arch", ARCHS)
def test_div_one_plus_is_div_fulls_scaled_path(arch):
    theirs = sass(compile_for(_tritons_division, 3, arch))
    ours = sass(compile_for(_our_division, 3, arch))

    def shape(lines):  # registers and predicate numbers aside
        return [re.sub(r"\bR\d+\b", "R", re.sub(r"\bP\d\b", "P", line)).replace(".reuse", "") for line in lines]

    expected_theirs = [
        "FSETP.GT.AND P, PT, |R|, 8.50705917302346158658e+37, PT",
        "FSETP.GEU.AND P, PT, |R|, 1.175494350822287508e-38, PT",
        "@P FMUL R, R, 0.25",
        "@P FMUL R, R, 0.25",
        "@!P FMUL R, R, 16777216",
        "@!P FMUL R, R, 16777216",
        "MUFU.RCP R, R",
        "FMUL R, R, R",
    ]
    assert shape(theirs) == expected_theirs, f"Triton's / (div.full.f32) compiles differently now: {theirs}"
    got = shape(ours)  # (1 + e) / 4 (the 1/4 factor in a register or an immediate), its rcp, n / 4, the product
    got = [line.replace("FFMA R, R, 0.25, 0.25", "FFMA R, R, R, 0.25") for line in got]
    assert sorted(got) == sorted(["FFMA R, R, R, 0.25", "MUFU.RCP R, R", "FMUL R, R, 0.25", "FMUL R, R, R"]), got


def tanh_ops(ptx: str) -> list[str]:
    """The opcodes of `__nv_tanhf`'s computing PTX instructions, in order (`selp.b32` spelled `selp.f32`)."""
    ops = (re.match(r"\s*(?:@%p\d+\s+)?([a-z][\w.]*)\s+.*;", line) for line in ptx.splitlines())
    keep = r"(abs|setp|mul\.rn|fma|ex2|add\.rn|rcp|selp|and\.b32|or\.b32)"
    return [m[1].replace("selp.b32", "selp.f32") for m in ops if m and re.match(keep, m[1])]


@pytest.mark.parametrize("arch", ARCHS)
def test_tanh_f32_is_libdevices_tanhf_without_its_branch(arch):
    theirs = compile_for(_libdevice_tanh, 2, arch).asm["ptx"]
    ours = compile_for(_our_tanh, 2, arch).asm["ptx"]
    constants = set(re.findall(r"0f[0-9A-F]{8}", theirs))
    assert constants == set(re.findall(r"0f[0-9A-F]{8}", ours)), "libdevice's tanhf constants changed"
    polynomial = ["mul.rn.f32", *["fma.rn.ftz.f32"] * 5]  # |x| < 0.6: x + x^3 p(x^2)
    exponential = ["mul.rn.f32", "ex2.approx.ftz.f32", "add.rn.f32", "rcp.approx.ftz.f32", "fma.rn.ftz.f32"]
    sign = ["setp.ge.f32", "selp.f32", "and.b32", "or.b32"]  # 1 from |x| >= 9.0109, x's sign
    expected = ["and.b32", "abs.ftz.f32", "setp.ltu.f32", *polynomial, *exponential, *sign]  # and.b32: addressing
    assert tanh_ops(theirs) == expected, "libdevice's tanhf compiles to other instructions now"
    assert tanh_ops(ours) == [*expected, "selp.f32"]  # the branch, as a select


def _shape(lines: list[str]) -> list[str]:
    """SASS lines with registers, predicates and branch targets generalized."""
    lines = [re.sub(r"\bR\d+\b", "R", re.sub(r"\bP\d\b", "P", line)).replace(".reuse", "") for line in lines]
    return [re.sub(r"BRA\b.*", "BRA", line) for line in lines]


def _has_run(lines: list[str], run: list[str]) -> bool:
    return any(lines[i : i + len(run)] == run for i in range(len(lines)))


@pytest.mark.parametrize("arch", ARCHS)
def test_rcp_rn_f32_is_ptxas_rcp_rn_fast_path_behind_one_test(arch):
    """ptxas's `rcp.rn.f32`: an exponent-field test (fields 1..252 take the fast path), then `MUFU.RCP` and
    `r + r * -(d * r - 1)`. Ours: PACK times the same instructions (the negation folded into the last FMA) and
    one test, `d >= 2**126` or NaN in any of the PACK values (for d >= 1 the same range), whose branch skips the
    `div.rn` that would overwrite them."""
    keep = r"(FSETP|FADD|MUFU|FFMA|FCHK|VIADD|LOP3|ISETP|BRA)"
    theirs = _shape(sass(compile_for(_ptxas_rcp_rn, 2, arch), keep))
    check = ["VIADD R, R, 0x1800000", "LOP3.LUT R, R, 0x7f800000, RZ, 0xc0, !PT"]
    check.append("ISETP.GT.U32.AND P, PT, R, 0x1ffffff, PT")
    fast = ["MUFU.RCP R, R", "FFMA R, R, R, -1", "FADD.FTZ R, -R, -RZ", "FFMA R, R, R, R"]
    assert _has_run(theirs, check) and _has_run(theirs, fast), f"ptxas's rcp.rn.f32 compiles differently now: {theirs}"
    for pack in RCP_RN_PACKS:  # one warp, 128 values: 4 a thread, 4 / PACK tests
        ours = _shape(sass(compile_for(_our_rcp_rn, 2, arch, num_warps=1, PACK=pack), r"(FSETP|MUFU|FFMA|FCHK|BRA)"))
        first = ours[: next(i for i, line in enumerate(ours) if line.endswith("BRA"))]  # then a branch past div.rn
        first = [line.replace("FSETP.LT.AND", "FSETP.GEU.AND") for line in first]  # or the inverted test
        test = ["FSETP.GEU.AND P, PT, R, 8.50705917302346158658e+37, PT"]
        test += ["FSETP.GEU.OR P, PT, R, 8.50705917302346158658e+37, P"] * (pack - 1)
        fast = ["MUFU.RCP R, R", "FFMA R, R, R, -1", "FFMA R, R, -R, R"] * pack
        assert sorted(first) == sorted(test + fast), (pack, ours)
