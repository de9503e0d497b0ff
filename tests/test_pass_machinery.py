"""The pass machinery on small graphs: a failing site, a failing pass, strict mode, options,
the cache key, dumps, and graphs left by CSE/freezing (issue 19)."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import (
    FUSED_ADD,
    FUSED_PLAIN,
    NORM_ADD,
    NORM_PLAIN,
    QUANT,
    assert_bitwise,
    check,
    compile_with_pass,
    inputs,
)

import mxfuse
from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions
from mxfuse.patterns import producer_quant
from mxfuse.patterns.results import SharedCode

mx = torch.ops.mxfuse


def test_a_failing_site_is_rolled_back_and_the_others_still_fuse(monkeypatch, caplog):
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        z = mx.gemma_rmsnorm(res, weight, 1e-5)
        return (*mx.mxfp8_quantize(y), *mx.mxfp8_quantize(z), res)

    real_apply = producer_quant.ProducerQuant.apply

    def fail_on_fused_add(self, graph, fusion):
        out = real_apply(self, graph, fusion)  # mutate first, so the rollback has work to do
        if fusion.producer.has_residual:
            raise RuntimeError("injected failure")
        return out

    monkeypatch.setattr(producer_quant.ProducerQuant, "apply", fail_on_fused_add)
    with caplog.at_level("WARNING", logger="mxfuse"):
        capture = check(fn, inputs(), {NORM_ADD: 1, FUSED_PLAIN: 1, NORM_PLAIN: 0, QUANT: 1}, strict=False)
    assert capture.report.matched_strings() == {"mxfuse:plain->mxfuse_quant:rowmajor": 1}
    (failed,) = capture.report.skipped
    assert failed.code is SharedCode.REWRITE_FAILED and "injected failure" in failed.reason
    assert failed.producer_kind == "mxfuse:fused_add" and not capture.report.failed
    assert "norm_quant (mxfuse:fused_add->mxfuse_quant:rowmajor)" in caplog.text and "injected failure" in caplog.text


def test_a_failure_outside_a_site_leaves_the_graph_exactly_as_it_was(monkeypatch, caplog):
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        return (*mx.mxfp8_quantize(y), res)

    def sort_then_fail(graph):  # runs after the rewrites: the rollback has work to do
        raise RuntimeError("injected failure")

    graphs = {}

    def run_and_record(graph, options):
        graphs["before"] = str(graph)
        with pytest.MonkeyPatch.context() as patch, caplog.at_level("WARNING", logger="mxfuse"):
            patch.setattr(torch._inductor.pattern_matcher, "stable_topological_sort", sort_then_fail)
            report = real_run(graph, options)
        graphs["after"], graphs["report"] = str(graph), report
        graph.lint()
        return report

    real_run = post_grad.run
    monkeypatch.setattr(post_grad, "run", run_and_record)
    compiled, capture = compile_with_pass(fn, strict=False)
    with torch.no_grad():
        args = inputs()
        assert_bitwise(compiled(*args), fn(*args))
    assert graphs["after"] == graphs["before"]
    assert "topological sort" in caplog.text and "injected failure" in caplog.text
    assert graphs["report"].failed and not graphs["report"].matched
    assert capture.after[NORM_ADD] == 1 and capture.after[QUANT] == 1


def test_strict_mode_raises_instead_of_rolling_back(monkeypatch):
    def fn(x, weight):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6))

    def fail(self, graph, fusion):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(producer_quant.ProducerQuant, "apply", fail)
    x, _, w = inputs()
    compiled, _ = compile_with_pass(fn, strict=True)
    with pytest.raises(Exception, match="injected failure"):
        compiled(x, w)


def test_options_are_validated():
    with pytest.raises(TypeError, match="fuse_norm_qaunt"):
        mxfuse.post_grad_pass(fuse_norm_qaunt=True)
    with pytest.raises(ValueError, match="sp_gather"):
        mxfuse.post_grad_pass(sp_gather="fp8")
    assert isinstance(mxfuse.post_grad_pass(), torch._inductor.custom_graph_pass.CustomGraphPass)


def test_uuid_depends_on_options_but_not_on_dump_dir():
    base = mxfuse.post_grad_pass().uuid()
    assert mxfuse.post_grad_pass(sp_gather="bf16").uuid() != base
    assert mxfuse.post_grad_pass(fuse_norm_quant=False).uuid() != base
    assert mxfuse.post_grad_pass(dump_dir="/tmp/x").uuid() == base
    assert PassOptions().cache_key() == PassOptions(sp_gather="auto").cache_key()


def test_dump_dir_writes_graph_before_and_after(tmp_path):
    def fn(x, weight):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6))

    x, _, w = inputs()
    capture = check(fn, (x, w), {FUSED_PLAIN: 1}, dump_dir=str(tmp_path))
    before = (tmp_path / "mxfuse_000.before.py").read_text()
    after = (tmp_path / "mxfuse_000.after.py").read_text()
    assert "mxfuse.gemma_rmsnorm.default" in before and "mxfuse.mxfp8_quantize.default" in before
    assert "mxfuse.gemma_rmsnorm_mxfp8.default" in after and "mxfuse.mxfp8_quantize.default" not in after
    assert capture.report.dumps[0].endswith("mxfuse_000.before.py")


def test_duplicate_getitems_left_by_freezing_are_folded(caplog):
    """Issue 19's reproduction: under freezing, CSE merges identical calls but keeps their getitems."""

    class Model(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(w, requires_grad=False)

        def forward(self, x, residual):
            y = mx.gemma_rmsnorm(x, self.w, 1e-6)
            a, b = mx.mxfp8_quantize(y), mx.mxfp8_quantize(y)  # the same quant twice
            c, d = mx.mxfp8_quantize(x), mx.mxfp8_quantize(x)  # ... of a graph input
            y1, r1 = mx.gemma_fused_add_rmsnorm(x, residual, self.w, 1e-5)  # the same norm twice
            y2, r2 = mx.gemma_fused_add_rmsnorm(x, residual, self.w, 1e-5)
            return (*a, *b, *c, *d, *mx.mxfp8_quantize(y1), r1, y2, r2)

    x, r, w = inputs()
    model = Model(w).eval()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True), caplog.at_level("WARNING", logger="mxfuse"):
        compiled, capture = compile_with_pass(model)
        assert_bitwise(compiled(x, r), model(x, r))
    assert not capture.report.failed and "mxfuse" not in caplog.text
    assert capture.report.matched_strings() == {
        "mxfuse:plain->mxfuse_quant:rowmajor": 1,
        "mxfuse:fused_add->mxfuse_quant:rowmajor+y": 1,
    }
    assert capture.after[FUSED_PLAIN] == 1 and capture.after[FUSED_ADD] == 1 and capture.after[QUANT] == 1
