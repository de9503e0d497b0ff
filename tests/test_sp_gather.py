"""Rewrite 2 (`sp_gather`): quantization around the sequence-parallel all-gather, graph level.

Graphs are traced with make_fx under a FakeTensorMode (a world size of 2 and a group
name that no process group backs: the functional collectives' fake impls need none),
the mxfuse pass runs on them, and they are executed in ONE process by an interpreter
that simulates the gather: every rank holds the same local rows, so the gathered
tensor is `world` copies of the local one. That is enough to show the swizzled
form's wrong bits (its padding rows land in the middle) and the rewrites' exactness;
`test_sp_distributed.py` runs real gloo ranks with different rows.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import run_pass, trace
from sp_helpers import (
    GROUP,
    K,
    W,
    c10d_gather,
    gathers,
    local_inputs,
    mx,
    simulate,
    sp_block,
    targets,
    weights,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops.mx_layout import packed_width
from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions
from mxfuse.patterns import sp_gather
from mxfuse.patterns.gather_checks import SpGatherCode, rows_reason
from mxfuse.patterns.results import SharedCode
from mxfuse.testing import assert_bitwise

# ------------------------------------------------------------------ form A: norm -> gather -> quant


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("mode", ["bf16", "mxfp8", "auto"])
def test_c10d_norm_gather_quant_modes(mode, residual):
    args = local_inputs(m=5)
    gm = trace(sp_block(residual=residual), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm, sp_gather=mode)
    got = simulate(gm, *args)
    assert_bitwise(got, expected)
    (gather,) = gathers(gm)
    if mode == "bf16":
        assert gather.meta["val"].dtype == torch.bfloat16
        assert mx.mxfp8_quantize.default in targets(gm)
        assert not report.matched
        assert any(s.rewrite == "sp_gather" and s.code is SpGatherCode.MODE_KEEPS for s in report.skipped)
        return
    # ONE collective, carrying the packed uint8 rows [W*M, K + K/32]
    assert gather.meta["val"].dtype == torch.uint8
    assert tuple(gather.meta["val"].shape) == (W * 5, packed_width(K))
    assert gather.args[1:] == (W, GROUP)
    op = mx.gemma_fused_add_rmsnorm_mxfp8_packed if residual else mx.gemma_rmsnorm_mxfp8_packed
    assert op.default in targets(gm)
    assert mx.mxfp8_quantize.default not in targets(gm)
    assert mx.gemma_fused_add_rmsnorm.default not in targets(gm)
    kind = f"mxfuse:{'fused_add' if residual else 'plain'}->c10d_gather:mxfp8_packed:rowmajor"
    assert report.matched_strings() == {kind: 1}
    # the views are aten.slice + aten.view.dtype, nothing copies
    assert torch.ops.aten.view.dtype in targets(gm)
    assert sum(t is torch.ops.aten.slice.Tensor for t in targets(gm)) == 2


def test_gemm_records_the_strides_of_its_new_inputs():
    """Inductor enforces the strides in a custom op's `eager_input_vals` on its inputs: after
    the rewrite the GEMM must record the strided views it now reads, or Inductor copies them
    into the quant outputs' dense layout (one copy kernel per view; seen on CPU and H200)."""
    args = local_inputs(m=5)
    gm = trace(sp_block(), *args)
    (gemm,) = [n for n in gm.graph.nodes if n.target is mx.mxfp8_linear.default]
    assert "eager_input_vals" in gemm.meta  # make_fx records them for exact-strides ops
    run_pass(gm, sp_gather="mxfp8")
    recorded, _ = gemm.meta["eager_input_vals"]
    for arg, val in zip(gemm.args[:2], recorded[:2]):
        assert arg.target in (torch.ops.aten.view.dtype, torch.ops.aten.slice.Tensor)
        assert val.stride() == arg.meta["val"].stride() == (packed_width(K), 1)


def test_a_failing_rewrite_restores_the_recorded_strides(monkeypatch, caplog):
    args = local_inputs(m=5)
    gm = trace(sp_block(), *args)
    (gemm,) = [n for n in gm.graph.nodes if n.target is mx.mxfp8_linear.default]
    before, code = gemm.meta["eager_input_vals"], gm.code
    real_apply = sp_gather.SpGather.apply

    def apply_then_fail(self, graph, action):
        real_apply(self, graph, action)  # rewires the GEMM first
        raise RuntimeError("injected failure")

    monkeypatch.setattr(sp_gather.SpGather, "apply", apply_then_fail)
    with caplog.at_level("WARNING", logger="mxfuse"):
        # not strict: the site is rolled back and reported; fuse_norm_quant off so nothing else fuses
        report = post_grad.run(gm.graph, PassOptions(sp_gather="mxfp8", fuse_norm_quant=False))
    gm.recompile()
    assert not report.matched and gm.code == code
    (failed,) = [s for s in report.skipped if s.code is SharedCode.REWRITE_FAILED]
    assert failed.rewrite == "sp_gather" and "injected failure" in failed.reason
    assert gemm.meta["eager_input_vals"] is before
    assert "injected failure" in caplog.text


def test_swizzled_consumer_gets_swizzle_after_the_gather():
    args = local_inputs(m=5)
    gm = trace(sp_block(swizzled=True), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm)  # auto
    assert_bitwise(simulate(gm, *args), expected)
    assert report.matched_strings() == {"mxfuse:fused_add->c10d_gather:mxfp8_packed:swizzled": 1}
    (gather,) = gathers(gm)
    assert gather.meta["val"].dtype == torch.uint8
    (swz,) = [n for n in gm.graph.nodes if n.target is mx.mxfp8_swizzle_scales.default]
    assert swz.args[0].target is torch.ops.aten.slice.Tensor  # swizzles the gathered scale view


def test_gathered_bf16_with_another_user_auto_keeps_bf16():
    args = local_inputs(m=5)
    gm = trace(sp_block(extra_gathered_user=True), *args)
    report = run_pass(gm)
    assert not report.matched
    codes = [s.code for s in report.skipped if s.rewrite == "sp_gather"]
    assert codes and codes[0] is SpGatherCode.OTHER_USERS
    (gather,) = gathers(gm)
    assert gather.meta["val"].dtype == torch.bfloat16


def test_gathered_bf16_with_another_user_mxfp8_forced_keeps_both_gathers():
    args = local_inputs(m=5)
    gm = trace(sp_block(extra_gathered_user=True), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm, sp_gather="mxfp8")
    assert_bitwise(simulate(gm, *args), expected)
    assert sorted(str(g.meta["val"].dtype) for g in gathers(gm)) == ["torch.bfloat16", "torch.uint8"]
    assert list(report.matched_strings()) == ["mxfuse:fused_add->c10d_gather:mxfp8_packed:rowmajor+bf16_gather"]
    (fused,) = [n for n in gm.graph.nodes if n.target is mx.gemma_fused_add_rmsnorm_mxfp8_packed.default]
    assert fused.kwargs["emit_y"] is True


def test_local_y_with_another_user_is_emitted():
    args = local_inputs(m=5)
    gm = trace(sp_block(extra_local_user=True), *args)
    expected = simulate(gm, *args)
    report = run_pass(gm)
    assert_bitwise(simulate(gm, *args), expected)
    assert report.matched
    (fused,) = [n for n in gm.graph.nodes if n.target is mx.gemma_fused_add_rmsnorm_mxfp8_packed.default]
    assert fused.kwargs["emit_y"] is True


def test_dynamic_rows():
    args = local_inputs(m=5)
    gm = trace(sp_block(swizzled=True), *args, dynamic=True)
    assert not isinstance(gathers(gm)[0].meta["val"].shape[0], int)  # symbolic rows
    expected = {m: simulate(gm, *local_inputs(m, seed=m)) for m in (1, 5, 130)}
    report = run_pass(gm, sp_gather="mxfp8")
    assert report.matched
    for m in (1, 5, 130):
        assert_bitwise(simulate(gm, *local_inputs(m, seed=m)), expected[m])


def test_gather_along_dim_1_is_left_alone():
    wc, ws = weights(k=2 * K)

    def fn(x, w):
        y = mx.gemma_rmsnorm(x, w, 1e-6)
        g = c10d_gather(y)  # dim 0 collective; the functional all_gather_tensor(gather_dim=1) adds chunk + cat
        g = torch.cat(torch.chunk(g, W, dim=0), dim=1)
        q, s = mx.mxfp8_quantize(g)
        return mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16)

    x, _, w = local_inputs()
    gm = trace(fn, x, w)
    before = targets(gm)
    report = run_pass(gm, sp_gather="mxfp8")
    assert targets(gm) == before and not report.matched
    (code,) = [s.code for s in report.skipped if s.rewrite == "sp_gather"]
    assert code is SpGatherCode.GATHER_SPLIT


def test_world_size_not_a_constant_is_left_alone():
    args = local_inputs()
    gm = trace(sp_block(), *args)
    (gather,) = gathers(gm)
    with gm.graph.inserting_before(gather):
        size = gm.graph.call_function(torch.ops.aten.sym_size.int, (args_node(gm, 0), 0))
    size.meta["val"] = 2
    gather.args = (gather.args[0], size, gather.args[2])
    report = run_pass(gm, sp_gather="mxfp8")
    assert not report.matched
    assert any(s.code is SpGatherCode.GATHER_UNSUPPORTED for s in report.skipped)


def test_group_not_a_constant_is_left_alone():
    args = local_inputs()
    gm = trace(sp_block(), *args)
    (gather,) = gathers(gm)
    gather.args = (gather.args[0], W, args_node(gm, 0))  # a node where the group name belongs
    report = run_pass(gm, sp_gather="mxfp8")
    assert not report.matched
    assert any(s.code is SpGatherCode.GATHER_UNSUPPORTED for s in report.skipped)


def args_node(gm, i):
    return [n for n in gm.graph.nodes if n.op == "placeholder"][i]


def test_rows_reason_guards():
    mode = FakeTensorMode()
    with mode:
        assert rows_reason(torch.empty(4, 48, dtype=torch.bfloat16), "y").code is SharedCode.HIDDEN_SIZE
        assert rows_reason(torch.empty(4, 64), "y").code is SharedCode.ACTIVATION_DTYPE
        assert rows_reason(torch.empty(2, 4, 64, dtype=torch.bfloat16), "y").code is SpGatherCode.NOT_ROWS
        assert rows_reason(torch.empty(4, 64, dtype=torch.float16), "y") is None
