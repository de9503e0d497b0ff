"""What a user sees of the pass in a log: one INFO line per compiled graph on the `mxfuse` logger
(sites fused, left and why, what that saves, derived from the op contracts), and, on a compile-cache
hit where the pass does not run, the served code still naming the fused ops (README: "Did it help?")."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from graph_helpers import FUSED_PLAIN, check, inputs

from mxfuse.passes.report import PassReport, SiteRecord, size_text
from mxfuse.patterns.producer_quant import ProducerQuantKind
from mxfuse.patterns.producers import ProducerFamily

ROOT = Path(__file__).resolve().parent.parent
mx = torch.ops.mxfuse


def test_one_info_line_per_compiled_graph_says_what_fused_what_was_left_and_what_it_saves(caplog):
    def fn(x, weight):  # one norm feeds a quant (fused), one feeds only the output (left: nothing to fuse)
        kept = mx.gemma_rmsnorm(x * 2, weight, 1e-6)
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6)), kept

    x, _, w = inputs(m=5, k=64)
    with caplog.at_level(logging.INFO, logger="mxfuse"):
        check(fn, (x, w), {FUSED_PLAIN: 1})
    lines = [r.getMessage() for r in caplog.records if r.name == "mxfuse" and r.levelno == logging.INFO]
    assert lines == [
        "mxfuse: fused 1 of 2 sites (mxfuse:plain->mxfuse_quant:rowmajor x1); left 1 (no MXFP8 quant reads the "
        "output x1; `mxfuse explain` names each); 1 fewer launch per step, 256 B less memory traffic per token "
        "(2 MiB per 8192-token step)"
    ]


def test_a_graph_with_nothing_to_look_at_is_not_an_info_line(caplog):
    def fn(x):
        return x * 2

    with caplog.at_level(logging.INFO, logger="mxfuse"):
        check(fn, (inputs()[0],), {})
    assert not [r for r in caplog.records if r.name == "mxfuse" and r.levelno >= logging.INFO]


def test_savings_are_derived_per_site_from_the_op_contract():
    """Per row (token) of hidden size K in bf16: a fused norm no longer writes y (2K bytes) nor has the quant
    read it back (2K); when y is still needed, the fused op writes it, and only the read is saved."""
    dropped = ProducerQuantKind("mxfuse:fused_add", "mxfuse", "rowmajor", writes_y=False, family=ProducerFamily.NORM)
    emitted = ProducerQuantKind("mxfuse:plain", "mxfuse", "rowmajor", writes_y=True, family=ProducerFamily.NORM)
    k = 6144
    report = PassReport(
        applied=[
            SiteRecord("norm_quant", dropped, "a", (), row_bytes=2 * k),
            SiteRecord("norm_quant", emitted, "b", (), row_bytes=2 * k),
            SiteRecord("norm_quant", dropped, "c", (), row_bytes=None),  # symbolic K
        ]
    )
    assert report.launches_saved() == 3
    assert report.bytes_saved_per_row() == (4 * k + 2 * k, 1)
    assert report.savings_text() == (
        "3 fewer launches per step, 36 KiB less memory traffic per token (288 MiB per 8192-token step) "
        "+ 1 site(s) of symbolic hidden size"
    )
    assert report.as_dict()["bytes_saved_per_token"] == 6 * k
    assert [size_text(n) for n in (256, 1536, 2**25, 22.5 * 2**30)] == ["256 B", "1.5 KiB", "32 MiB", "22.5 GiB"]


_COMPILE = """
import torch
import mxfuse

mx = torch.ops.mxfuse
x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
mxfuse_pass = mxfuse.post_grad_pass()
with torch.no_grad():
    torch.compile(lambda x, w: mx.mxfp8_quantize(mx.gemma_rmsnorm(x, w, 1e-6)),
                  options={"post_grad_custom_post_pass": mxfuse_pass})(x, w)
print("pass ran" if mxfuse_pass.last_report is not None else "served from the cache")
"""


def test_a_graph_served_from_inductors_cache_still_shows_its_fused_ops_under_torch_logs(tmp_path):
    """The README's way to see what a cached artifact contains: `TORCH_LOGS=output_code` logs the code
    Inductor runs, also when its FX graph cache serves it (the pass does not run then, so no INFO line)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCH_LOGS": "output_code",
    }
    runs = [subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, check=True)]
    runs.append(subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, check=True))
    assert [r.stdout.strip() for r in runs] == ["pass ran", "served from the cache"]
    served = runs[1].stderr
    assert "codecache.py" in served and "torch.ops.mxfuse.gemma_rmsnorm_mxfp8.default(" in served, served[-3000:]
    assert "torch.ops.mxfuse.gemma_rmsnorm.default(" not in served
