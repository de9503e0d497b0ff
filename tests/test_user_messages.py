"""Messages a user meets on their own models: the verdict names the real reason, the reader and the norm's
family; `mxfuse.explain` refuses a non-callable in one line; the command is quiet about a missing numpy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mxfuse
from mxfuse.patterns.results import SharedCode

ROOT = Path(__file__).resolve().parent.parent


class _Norm(torch.nn.Module):
    """Hugging Face's standard RMSNorm (LlamaRMSNorm), then `head`: a quant, a linear, or nothing."""

    def __init__(self, head: str, k: int = 64, dtype=torch.bfloat16):
        super().__init__()
        self.head = head
        self.weight = torch.nn.Parameter(torch.ones(k, dtype=dtype), requires_grad=False)
        self.linear = torch.nn.Linear(k, 32, bias=False, dtype=dtype)

    def forward(self, x):
        h = x.float()
        y = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return self.linear(y) if self.head == "linear" else y


def _only_verdict(module, x):
    torch.compiler.reset()
    verdicts = mxfuse.explain(module, x).verdicts
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def test_an_fp32_norm_no_quant_reads_is_not_blamed_on_its_dtype():
    verdict = _only_verdict(_Norm("none", dtype=torch.float32), torch.randn(8, 64))
    assert verdict.code is SharedCode.NO_QUANT, verdict
    assert verdict.fix is None


def test_a_norm_read_by_an_unquantized_linear_says_so():
    verdict = _only_verdict(_Norm("linear"), torch.randn(2, 8, 64, dtype=torch.bfloat16))
    assert re.fullmatch(
        r"no MXFP8 quant reads its output \(read by: aten\.mm via aten\.(view|reshape|_unsafe_view), "
        r"an unquantized linear\)",
        verdict.detail,
    ), verdict.detail


class _CohereLayerNorm(torch.nn.Module):
    """transformers' CohereLayerNorm (mean-centred, no bias), its output quantized."""

    def __init__(self, k: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(k, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(variance + 1e-5)
        h = self.weight.to(torch.float32) * h
        return torch.ops.mxfuse.mxfp8_quantize(h.to(dtype))


def test_coheres_layer_norm_is_named_a_layer_norm_with_no_fix_that_would_change_it():
    verdict = _only_verdict(_CohereLayerNorm(), torch.randn(8, 64, dtype=torch.bfloat16))
    assert not verdict.fused
    assert verdict.kind == "hf:layer_norm" and verdict.code is SharedCode.NORM_CENTERED, verdict
    assert "LayerNorm" in verdict.detail and verdict.fix is None


def test_explain_refuses_what_it_cannot_call_in_one_line():
    with pytest.raises(TypeError, match=r"^mxfuse.explain\(module, \*example_inputs\): module must be an nn.Module"):
        mxfuse.explain("x")


def test_the_command_does_not_warn_about_numpy_which_it_does_not_need(tmp_path):
    """A fresh `pip install -e .` has no numpy (torch does not require it): torch's import warns
    "Failed to initialize NumPy"; the command's first line must be its own."""
    (tmp_path / "mxfuse_np_probe.py").write_text("x = 1\n")
    code = (
        "import sys\n"
        "sys.modules['numpy'] = None  # as on a machine without numpy\n"
        "from mxfuse_cli import main\n"
        "main(['explain', '--model', 'mxfuse_np_probe:missing'])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (
        proc.stderr.strip()
        == "mxfuse explain: --model mxfuse_np_probe:missing: 'mxfuse_np_probe' has no attribute 'missing'"
    )
