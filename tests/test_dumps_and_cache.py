"""Dumps and the compile cache, as a user meets them (issue 15): a dump for every graph the
pass sees, a `dump_dir` that cannot hold dumps refused when the pass is built, a dump that
fails mid-compile as one warning, and `fresh=True` to get a report although Inductor's FX
graph cache holds the compiled graph."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from graph_helpers import FUSED_PLAIN, check, inputs

import mxfuse
from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions
from mxfuse.patterns.results import SharedCode

mx = torch.ops.mxfuse


def test_a_graph_where_nothing_fuses_is_dumped_with_its_report(tmp_path):
    def fn(x, weight):  # the norm's output is not quantized: nothing to fuse, and the report says why
        return mx.gemma_rmsnorm(x, weight, 1e-6) * 2

    x, _, w = inputs()
    capture = check(fn, (x, w), {FUSED_PLAIN: 0}, dump_dir=str(tmp_path))
    report = json.loads((tmp_path / "mxfuse_000.report.json").read_text())
    assert report["matched"] == {}
    assert [s.code for s in capture.report.skipped] == [SharedCode.NO_QUANT]
    assert report["skipped"] == [s.as_dict() for s in capture.report.skipped]
    assert (tmp_path / "mxfuse_000.before.py").exists() and (tmp_path / "mxfuse_000.after.py").exists()
    assert len(capture.report.dumps) == 3


@pytest.mark.parametrize("bad", ["a_file", "/proc/mxfuse-dumps", "a_file/below"])
def test_a_dump_dir_that_cannot_hold_dumps_is_refused_when_the_pass_is_built(tmp_path, bad):
    (tmp_path / "a_file").write_text("not a directory")
    path = bad if bad.startswith("/") else str(tmp_path / bad)
    with pytest.raises(ValueError, match=r"dump_dir=.* is not a writable directory"):
        mxfuse.post_grad_pass(dump_dir=path)


def test_a_dump_dir_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="dump_dir must be a str or None, got 3"):
        mxfuse.post_grad_pass(dump_dir=3)


def test_a_dump_that_fails_mid_compile_is_one_warning(tmp_path, monkeypatch, caplog):
    def fn(x, weight):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6))

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(post_grad, "_write_dump", disk_full)
    x, _, w = inputs()
    with caplog.at_level(logging.WARNING, logger="mxfuse"):
        capture = check(fn, (x, w), {FUSED_PLAIN: 1}, dump_dir=str(tmp_path))  # fused all the same
    warnings = [r for r in caplog.records if r.name == "mxfuse" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    assert capture.report.dumps == []


def test_fresh_gets_a_report_where_the_fx_graph_cache_would_serve_the_graph(tmp_path, monkeypatch):
    """With Inductor's FX graph cache on (the default outside this suite), the second compile of
    the same graph under the same key is served from the cache: no pass run, no report.
    `fresh=True` gives each pass object its own key, so the pass runs and reports again."""

    def fn(x, weight):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6))

    x, _, w = inputs()

    def compile_once(mxfuse_pass):
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(fn, options={"post_grad_custom_post_pass": mxfuse_pass})(x, w)
        return mxfuse_pass.last_report

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty cache of this test's own
    with torch._inductor.config.patch(fx_graph_cache=True):
        assert compile_once(mxfuse.post_grad_pass()) is not None  # compiled, fused, stored
        assert compile_once(mxfuse.post_grad_pass()) is None  # served from the cache
        report = compile_once(mxfuse.post_grad_pass(fresh=True))
    assert report is not None and sum(report.matched.values()) == 1
    assert PassOptions(fresh=True).cache_key() == PassOptions().cache_key()  # same graph either way
