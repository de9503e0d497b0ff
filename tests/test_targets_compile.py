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
    assert {"_norm_kernel", "_quant_kernel", "_swizzle_kernel", "_mx_gemm_swap_kernel"} <= kernels
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
