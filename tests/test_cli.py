"""The `mxfuse` command line: `mxfuse demo` on CPU and the entry points."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxfuse import cli

ROOT = Path(__file__).resolve().parents[1]


def test_demo_cpu_report(capsys):
    torch.compiler.reset()
    rc = cli.main(["demo", "--device", "cpu", "--tokens", "64", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "device : cpu" in out
    assert "config : tiny: hidden 256, 2 layers" in out
    assert "tokens : 64" in out
    assert "qkv_proj 512x256" in out
    assert "compiling with torch.compile (inductor) ..." in out
    assert re.search(r"done in \d+\.\d s", out)
    # a column per variant, a time per step for each
    header = next(line for line in out.splitlines() if "eager" in line and "compiled" in line)
    assert header.split() == ["eager", "compiled"]
    times = next(line for line in out.splitlines() if line.strip().startswith("time per step"))
    assert len(re.findall(r"\d+\.\d+ ms", times)) == 2, times
    assert re.search(r"bitwise == eager\s+\(ref\)\s+yes", out)
    assert "bitwise check PASSED: compiled output == eager output (64x256 bfloat16" in out
    assert "FAILED" not in out
    torch.compiler.reset()


def test_run_demo_result_and_stream():
    torch.compiler.reset()
    buf = io.StringIO()
    cfg = cli.ModelConfig.tiny(n_layers=1)
    result = cli.run_demo(cfg, 16, torch.device("cpu"), steps=1, out=buf)
    assert result.passed
    assert [v.name for v in result.variants] == ["eager", "compiled"]
    assert result.variants[1].bitwise_vs_eager is True and result.variants[1].max_abs_diff == 0.0
    assert all(v.step_ms > 0 for v in result.variants)
    assert result.variants[0].output.shape == (16, 256)
    assert "bitwise check PASSED" in buf.getvalue()
    torch.compiler.reset()


def test_bitwise_equal_helper():
    a = torch.tensor([1.0, float("nan"), -0.0]).bfloat16()
    assert cli.bitwise_equal(a, a.clone())
    assert not cli.bitwise_equal(a, torch.tensor([1.0, float("nan"), 0.0]).bfloat16())  # -0 vs +0
    assert not cli.bitwise_equal(a, a.float())
    assert not cli.bitwise_equal(a, a[:2])


def test_main_without_command_prints_help():
    buf = io.StringIO()
    assert cli.main([], out=buf) == 2
    assert "demo" in buf.getvalue()


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--config", "huge"])
    with pytest.raises(SystemExit):
        cli.main(["demo", "--device", "tpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU"):
            cli.pick_device("cuda")
    assert cli.pick_device("cpu") == torch.device("cpu")


def test_python_dash_m_mxfuse():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "mxfuse", "demo", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "--tokens" in proc.stdout and "--config" in proc.stdout and "m3-flash-tp4" in proc.stdout
