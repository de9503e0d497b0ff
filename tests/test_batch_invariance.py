"""Batch invariance of the CPU ops: a row's bits never depend on how many rows share the call.

On CPU this is true by construction (the reference normalizes and quantizes row by row, and the
fused ops call the same reference: tests/norm_families.py), so this is a cheap plumbing check:
the probe row, last in batches of M = 1, 7 and 130 (two 128-row tiles of the swizzled scales), gets
the same codes, scales, residual_out and y each time, in both layouts and both families, and
fused == unfused at every M. The act·mul producers (every activation, gate_up in both half orders
and the two-tensor form, the fp32 SwiGLU-OAI) and the gated ones (the sigmoid gate in both roundings,
the gated RMSNorm in groups of 32 in vLLM's, Hugging Face's and the gate-first arithmetic) get the
same check, with their `y` emitted. The arithmetic claim, at M up to 16384, is the GPU kernels' test
(tests/test_gpu_norms.py, test_batch_invariance).
"""

from __future__ import annotations

import pytest
import torch
from norm_families import FAMILIES, family_weight, fused, unfused

from mxfuse.ops import reference
from mxfuse.ops.mx_layout import scale_columns
from mxfuse.testing import assert_bitwise

BATCHES = (1, 7, 130)
K = 160


def rows(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16) * 3


def row_major(out, m: int, swizzled: bool) -> list[torch.Tensor]:
    """The outputs with the scales in row-major order (a swizzled row's scales sit in its tile)."""
    codes, scales, *rest = out
    if swizzled:
        scales = reference.unswizzle_scales(scales, m, scale_columns(K))
    return [codes, scales, *rest]


@pytest.mark.parametrize("add", [True, False], ids=["fused_add", "plain"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_gets_the_same_bits_in_every_batch(family, add, swizzled):
    weight = family_weight(family, K, seed=3)
    round_normalized = family == "standard"  # vLLM's and Hugging Face's standard form
    probe, probe_res = rows(1, 1), rows(1, 2)
    expected = None
    for m in BATCHES:
        x = torch.cat([rows(m - 1, 10 + m), probe])
        residual = torch.cat([rows(m - 1, 20 + m), probe_res]) if add else None
        out = fused(family, x, residual, weight, 1e-6, swizzled, round_normalized=round_normalized)
        assert_bitwise(out, unfused(family, x, residual, weight, 1e-6, swizzled, round_normalized=round_normalized))
        probe_out = [t[-1:] for t in row_major(out, m, swizzled)]
        if expected is None:
            expected = probe_out
        assert_bitwise(probe_out, expected)


# ------------------------------------------------------------------ the act·mul and gated producers

mx = torch.ops.mxfuse
INTER, GROUP = K, 32  # act·mul: gate_up [M, 2 * INTER]; gated norm: rows of K in groups of 32 (five per row)


def _act_mul(activation: str, gate_first: bool = True, **params):
    def run(xs, swizzled, fused):
        (gate_up,) = xs
        if fused:
            return mx.act_mul_mxfp8(gate_up, activation, gate_first, swizzled, True, **params)
        return (*mx.mxfp8_quantize(y := mx.act_mul(gate_up, activation, gate_first, **params), swizzled), y)

    return run, 1, 2 * INTER


def _act_mul_pair(activation: str, **params):
    def run(xs, swizzled, fused):
        gate, up = xs
        if fused:
            return mx.act_mul_pair_mxfp8(gate, up, activation, swizzled, True, **params)
        y = mx.act_mul(torch.cat((gate, up), dim=-1), activation, **params)  # the pair's arithmetic on halves
        return (*mx.mxfp8_quantize(y, swizzled), y)

    return run, 2, INTER


def _sigmoid_gate(round_gate: bool):
    def run(xs, swizzled, fused):
        x, gate = xs
        if fused:
            return mx.sigmoid_gate_mxfp8(x, gate, swizzled, True, 0, round_gate)
        return (*mx.mxfp8_quantize(y := mx.sigmoid_gate(x, gate, round_gate), swizzled), y)

    return run, 2, K


def _gated_norm(norm_before_gate: bool, round_normalized: bool):
    weight = torch.randn(GROUP, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    flags = dict(norm_before_gate=norm_before_gate, round_normalized=round_normalized, round_weighted=round_normalized)

    def run(xs, swizzled, fused):
        x, z = xs
        if fused:
            return mx.gated_rms_norm_mxfp8(x, z, weight, 1e-6, GROUP, swizzled, True, **flags)
        y = mx.gated_rms_norm(x, z, weight, 1e-6, GROUP, **flags)
        return (*mx.mxfp8_quantize(y, swizzled), y)

    return run, 2, K


PRODUCERS = {
    "act_mul:silu": _act_mul("silu"),
    "act_mul:gelu_tanh:up_first": _act_mul("gelu_tanh", gate_first=False),
    "act_mul:swiglu_step": _act_mul("swiglu_step", limit=7.0),
    "act_mul:swiglu_oai+fp32": _act_mul("swiglu_oai", alpha=1.702, limit=7.0, round_each_op=False),
    "act_mul_pair:silu": _act_mul_pair("silu"),
    "act_mul_pair:swiglu_oai": _act_mul_pair("swiglu_oai", alpha=1.702, limit=7.0),
    "sigmoid_gate": _sigmoid_gate(True),
    "sigmoid_gate:fp32": _sigmoid_gate(False),
    "gated_rms_norm:vllm": _gated_norm(True, False),
    "gated_rms_norm:hf": _gated_norm(True, True),
    "gated_rms_norm:gate_first": _gated_norm(False, False),
}


@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_act_mul_and_gated_rows_get_the_same_bits_in_every_batch(producer, swizzled):
    """The same for the act·mul and gated producers' fused ops: codes, scales and the emitted y of the probe
    row, fused == the producer op then the quant at every M."""
    run, n_inputs, width = PRODUCERS[producer]

    def tensors(m: int, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(m, width, generator=g) * 3).to(torch.bfloat16) for _ in range(n_inputs)]

    probe = tensors(1, 1)
    expected = None
    for m in BATCHES:
        xs = [torch.cat([rest, p]) for rest, p in zip(tensors(m - 1, 10 + m), probe)]
        out = run(xs, swizzled, fused=True)
        assert_bitwise(out, run(xs, swizzled, fused=False))
        probe_out = [t[-1:] for t in row_major(out, m, swizzled)]
        if expected is None:
            expected = probe_out
        assert_bitwise(probe_out, expected)
