"""The Triton kernels compile for every GPU the project serves, on a CPU, without spills.

For each target of `triton_targets.COMPILE_TARGETS` (hip:gfx950, hip:gfx942, cuda:90,
cuda:100, cuda:103), tools/compile_targets.py builds the launches the ops make (the
launchers' own arguments on meta tensors, with the ISA a device of that target gets)
for every row layout the default dispatch can pick, its launch choices at the model's
hidden sizes (split rows, two rows per tile), both scale layouts, y, both quant rules,
round_sum and round_normalized, the quant and swizzle kernels and the GEMM's regimes,
and compiles each distinct one once through Triton's launch specialization. A case fails
on a compile error, on any spill or scratch use (NVIDIA: local memory and stack frame
from `ptxas -v`; AMD: `.vgpr_spill_count` / `.sgpr_spill_count` and the
private segment of the AMDGCN) and on more shared memory / LDS than the target has.
Compiles run in a process pool; Triton's on-disk cache makes a rerun fast.

The device check (an unsupported GPU gets one MxfuseInputError before any compile) is
tested with `torch.cuda.get_device_properties` stubbed: no GPU is here.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

from mxfuse.ops import MxfuseInputError, triton_targets  # noqa: E402

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


@pytest.fixture(scope="module")
def compiled():
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import compile_targets

    return compile_targets, compile_targets.compile_all(
        triton_targets.COMPILE_TARGETS, jobs=min(4, os.cpu_count() or 1)
    )


@pytest.mark.parametrize("target", triton_targets.COMPILE_TARGETS)
def test_kernels_compile_without_spills(compiled, target):
    tool, results = compiled
    rows = results[target]
    kernels = {case.launch.kernel.__name__ for case, _, _ in rows}
    assert {"_norm_kernel", "_quant_kernel", "_swizzle_kernel", "_mx_gemm_swap_kernel", "_act_mul_kernel"} <= kernels
    bad = {case.name: tool.problems(target, res, err) for case, res, err in rows if tool.problems(target, res, err)}
    assert not bad, f"{target}: {len(bad)} of {len(rows)} cases: {bad}"
    isa = triton_targets.isa_of_target(target.split(":")[0])
    norm = [case for case, _, _ in rows if case.launch.kernel.__name__ == "_norm_kernel"]
    assert norm and all(isa == case.launch.constexprs["MX"].ISA for case in norm)


def _props(**kw):
    return types.SimpleNamespace(name="GPU", major=0, minor=0, gcnArchName="", multi_processor_count=1, **kw)


@pytest.mark.parametrize(
    "hip, props, isa",
    [
        (None, dict(major=9, minor=0), "ptx"),
        (None, dict(major=10, minor=3), "ptx"),
        (None, dict(major=8, minor=0), None),
        ("6.4", dict(gcnArchName="gfx950:sramecc+:xnack-"), "portable"),
        ("6.4", dict(gcnArchName="gfx942:sramecc+:xnack-"), "portable"),
        ("6.4", dict(gcnArchName="gfx90a:sramecc+:xnack-"), None),
    ],
    ids=["sm90", "sm103", "sm80-refused", "gfx950", "gfx942", "gfx90a-refused"],
)
def test_device_isa_or_one_clear_error(monkeypatch, hip, props, isa):
    """A supported GPU gets its ISA; any other one MxfuseInputError naming the device and what
    the kernels need (raised before the launchers reach Triton)."""
    p = {k: v for k, v in _props().__dict__.items() if k not in props} | props
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(**p))
    triton_targets._gpu_isa.cache_clear()
    try:
        if isa is not None:
            assert triton_targets.device_isa(torch.device("cuda", 0)) == isa
        else:
            with pytest.raises(MxfuseInputError, match=r"cuda:0 is GPU .*(gfx90a|8\.0)") as e:
                triton_targets.device_isa(torch.device("cuda", 0))
            assert ("gfx942" in str(e.value)) if hip else ("9.0" in str(e.value))
    finally:
        triton_targets._gpu_isa.cache_clear()
    assert triton_targets.device_isa(torch.device("cpu")) == "portable"  # Triton's interpreter


def gated_cases(isa: str) -> list:
    """The gated producers' kernels (mxfuse/ops/triton_gated_quant.py): fused with every flag that changes
    the code (swizzled, torchao, y, Hugging Face's roundings, the other gate order, sigmoid) and unfused, at
    the model's sizes (K 6144 for the gate; heads of 128, a group of 96 and a whole row for the norm)."""
    from compile_targets import Case, _meta

    from mxfuse.ops import triton_gated_quant as tg

    def gate(m, k, **kw):
        return tg.gate_launch(_meta(m, k), _meta(m, k), isa=isa, **kw)[1]

    def norm(m, k, group, **kw):
        return tg.gated_norm_launch(_meta(m, k), _meta(m, k), _meta(group), 1e-6, group, isa=isa, **kw)[1]

    hf = dict(round_normalized=True, round_weighted=True)
    return [
        Case("gate fused swizzled torchao y", gate(4096, 6144, quant=True, swizzled=True, emit_y=True, rule=1), 0),
        Case("gate fused rowmajor fp32 gate", gate(1, 6144, quant=True, round_gate=False), 0),
        Case("gate unfused", gate(4096, 6144, quant=False), 0),
        Case("gated norm fused swizzled y", norm(4096, 4096, 128, quant=True, swizzled=True, emit_y=True), 0),
        Case("gated norm fused hf torchao", norm(4096, 4096, 128, quant=True, rule=1, **hf), 0),
        Case(
            "gated norm fused gate first sigmoid",
            norm(1, 2048, 128, quant=True, norm_before_gate=False, activation="sigmoid"),
            0,
        ),
        Case("gated norm unfused", norm(4096, 4096, 128, quant=False), 0),
        Case("gated norm group 96 swizzled", norm(16, 288, 96, quant=True, swizzled=True), 0),
        Case("gated norm whole row 6144", norm(1, 6144, 6144, quant=True), 0),
    ]


@pytest.mark.parametrize("target", triton_targets.COMPILE_TARGETS)
def test_gated_kernels_compile_without_spills(target):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import compile_targets as tool

    isa = triton_targets.isa_of_target(target.split(":")[0])
    bad = {}
    for case in gated_cases(isa):
        res, err = tool.compile_case(target, case, instructions=False)
        if tool.problems(target, res, err):
            bad[case.name] = tool.problems(target, res, err)
    assert not bad, f"{target}: {bad}"


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_act_mul_register_cap_changes_nothing_but_the_register_budget(target):
    """The act·mul's default register cap (`load_first_registers`) is a ptxas budget only: the capped launch's PTX
    is the uncapped one's with one `.maxnreg` line more, and every fp32 operation in it carries its rounding mode
    (`.rn` / `.rm`), which ptxas may neither contract nor reassociate. So the bits of the launches the GPU tests
    checked without a cap hold with it (tests/test_gpu_act_mul.py also runs the capped default launches)."""
    import re

    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import compile_targets as tool

    from mxfuse.ops import triton_act_quant as taq

    gate_up = torch.empty(1024, 2 * 1536, device="meta", dtype=torch.bfloat16)
    halves = (gate_up[:, :1536], gate_up[:, 1536:])
    _, capped = taq.act_mul_launch(*halves, "silu", isa="ptx")
    _, plain = taq.act_mul_launch(*halves, "silu", isa="ptx", config=taq.act_mul_config(1024, 1536, 132))
    assert (capped.max_registers, plain.max_registers) == (taq.LOAD_FIRST_REGISTERS, 0)
    capped_ptx = tool.compile_launch(capped, target)[0].asm["ptx"].splitlines()
    plain_ptx = tool.compile_launch(plain, target)[0].asm["ptx"].splitlines()
    assert [line for line in capped_ptx if line not in plain_ptx] == [f".maxnreg {taq.LOAD_FIRST_REGISTERS}"]
    assert [line for line in plain_ptx if line not in capped_ptx] == []
    fp32_ops = re.findall(r"\b(?:add|sub|mul|fma|div)(?:\.\w+)*\.f32\b", "\n".join(capped_ptx))
    assert fp32_ops and all(re.search(r"\.r[nmpz]\b", op) or op.startswith("div.full") for op in fp32_ops), fp32_ops
