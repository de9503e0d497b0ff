"""`mxfuse demo` on a CUDA GPU: bitwise checks pass and steps are timed as CUDA-graph replays."""

from __future__ import annotations

import io

import pytest
import torch

from mxfuse.cli.demo import run_demo
from mxfuse.models import ModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_demo_cuda_times_graph_replays():
    torch.compiler.reset()
    buf = io.StringIO()
    result = run_demo(ModelConfig.tiny(n_layers=1), 64, torch.device("cuda"), steps=3, out=buf)
    out = buf.getvalue()
    assert result.passed, out
    assert [v.timing for v in result.variants] == ["cuda graph"] * 3, out
    assert all(v.step_ms > 0 for v in result.variants), out
    assert "GPU time of one step replayed as a CUDA graph; median of 3 steps" in out
