"""The `mxfuse` command line on CPU: demo (and --sp 2 on gloo), dump, explain; outputs checked for content."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxfuse import cli
from mxfuse.passes import explain as ex
from mxfuse.passes.options import PassOptions

ROOT = Path(__file__).resolve().parents[1]


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(start))


def _launch_row(out: str, what: str) -> list[int]:
    return [int(n) for n in _line(out, what).split()[-2:]]


def test_demo_cpu_report():
    torch.compiler.reset()
    buf = io.StringIO()
    cfg = cli.ModelConfig.tiny(n_layers=1)
    result = cli.run_demo(cfg, 32, torch.device("cpu"), steps=1, out=buf)
    out = buf.getvalue()
    assert result.passed, out
    assert "device : cpu" in out and "config : tiny: hidden 256, 1 layers" in out and "tokens : 32" in out
    assert "qkv_proj 512x256" in out
    # the progress indicator of each compile
    assert re.search(r"compiling with torch.compile \(inductor\) \.\.\. done in \d+\.\d s", out)
    assert re.search(r"compiling with torch.compile \+ the mxfuse passes \.\.\. done in \d+\.\d s", out)
    # three columns, a time per step for each
    header = next(line for line in out.splitlines() if "eager" in line and "compiled" in line)
    assert header.split() == ["eager", "compiled", "mxfuse", "passes"]
    assert len(re.findall(r"\d+\.\d+ ms", _line(out, "time per step"))) == 3
    assert re.search(r"bitwise == eager\s+\(ref\)\s+yes\s+yes", out)
    # launches counted from the generated wrapper: 2 norms + 2 of the 4 quants become 2 fused ops
    assert "counted in the code Inductor generated" in out and "cpp_fused_*" in out
    assert _launch_row(out, "mxfuse.gemma_rmsnorm ") == [1, 0]
    assert _launch_row(out, "mxfuse.gemma_rmsnorm_mxfp8 ") == [0, 1]
    assert _launch_row(out, "mxfuse.gemma_fused_add_rmsnorm ") == [2, 1]  # the final norm feeds no quant
    assert _launch_row(out, "mxfuse.gemma_fused_add_rmsnorm_mxfp8 ") == [0, 1]
    assert _launch_row(out, "mxfuse.mxfp8_quantize") == [4, 2]
    before, after = _launch_row(out, "total launches")
    assert before - after == 2
    passes = result.variants[2]
    assert passes.launches["mxfuse.mxfp8_linear"] == 4
    # the pass report and the bytes, by the stated formula
    assert re.search(r"mxfuse:plain->mxfuse_quant:rowmajor\s+x1", out)
    assert re.search(r"mxfuse:fused_add->mxfuse_quant:rowmajor\s+x1", out)
    assert "2*M*K*2 B per fused norm (its bf16 y, written once and" in out and "M = 32 rows, K = 256) = 32 KiB" in out
    assert "2 fused norm(s) = 64 KiB per step, 64 KiB per layer (1 layer)" in out
    assert "bitwise check PASSED: compiled output == eager output (32x256 bfloat16, every bit)" in out
    assert "bitwise check PASSED: with the mxfuse passes == without them (compiled output, 32x256 bfloat16)" in out
    assert "FAILED" not in out
    assert passes.bitwise_vs_compiled is True and passes.max_abs_diff == 0.0
    torch.compiler.reset()


@pytest.mark.distributed
def test_demo_sp2_gloo_bitwise_on_every_rank(capsys):
    rc = cli.main(["demo", "--sp", "2", "--device", "cpu", "--layers", "1", "--tokens", "32", "--steps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "over 2 ranks: 16 rows each" in out and "2 processes, gloo on cpu" in out
    assert re.search(r"\[rank 0\] compiling with torch.compile \+ the mxfuse passes \.\.\. done in", out)
    assert "bitwise check PASSED on every rank (2/2)" in out
    assert "bitwise check PASSED: with the mxfuse passes == without them" in out
    assert "_c10d_functional.all_gather_into_tensor" in out  # the collectives are counted too
    assert "patterns matched (from the pass report):" in out and "FAILED" not in out


def test_dump_reference(tmp_path):
    torch.compiler.reset()
    buf = io.StringIO()
    rc = cli.main(["dump", "--out", str(tmp_path), "--layers", "1", "--tokens", "16"], out=buf)
    out = buf.getvalue()
    assert rc == 0, out
    index = (tmp_path / "INDEX.md").read_text()
    before, after = tmp_path / "mxfuse/mxfuse_000.before.py", tmp_path / "mxfuse/mxfuse_000.after.py"
    assert before.exists() and after.exists() and (tmp_path / "mxfuse/mxfuse_000.report.json").exists()
    assert "torch.ops.mxfuse.gemma_rmsnorm_mxfp8" in after.read_text()
    assert "torch.ops.mxfuse.gemma_rmsnorm_mxfp8" not in before.read_text()
    # depyf's files are there and described
    full = list(tmp_path.glob("full_code_for_*.py"))
    assert full and f"| `{full[0].name}` | START HERE" in index
    assert re.search(r"\| `[^`]*kernel[^`]*\.py` \| the code Inductor generated", index)
    assert "| `mxfuse/mxfuse_000.after.py` | the same graph after the mxfuse passes" in index
    assert "| `mxfuse/mxfuse_000.before.py` |" in index and "| `mxfuse/mxfuse_000.report.json` |" in index
    # what the passes replaced, from the report
    report = json.loads((tmp_path / "mxfuse/mxfuse_000.report.json").read_text())
    assert "`mxfuse:plain->mxfuse_quant:rowmajor` x1" in index
    replaced = ", ".join(f"`{n}`" for n in report["replaced_nodes"])
    assert f"Replaced nodes (names in the `before` graph): {replaced}" in index
    assert re.search(r"\d+  gemma_rmsnorm: .* = torch.ops.mxfuse.gemma_rmsnorm.default\(", index)
    assert "left alone by norm_quant: " in index and "no MXFP8 quant reads its output" in index
    assert re.search(r"\d+  gemma_rmsnorm_mxfp8_default = torch.ops.mxfuse.gemma_rmsnorm_mxfp8.default\(", index)
    assert "passes matched: mxfuse:fused_add->mxfuse_quant:rowmajor x1, mxfuse:plain->mxfuse_quant:rowmajor x1" in out
    assert f"index: {tmp_path / 'INDEX.md'}" in out
    torch.compiler.reset()


def test_dump_hf_minimax_m3(tmp_path):
    pytest.importorskip("transformers")
    torch.compiler.reset()
    buf = io.StringIO()
    rc = cli.main(["dump", "--out", str(tmp_path), "--model", "hf-minimax-m3", "--tokens", "8"], out=buf)
    assert rc == 0, buf.getvalue()
    index = (tmp_path / "INDEX.md").read_text()
    assert "Hugging Face MiniMaxM3VLDecoderLayer" in index
    assert "`hf:plain->mxfuse_quant:rowmajor` x1" in index and "`hf:fused_add->mxfuse_quant:rowmajor` x1" in index
    after = (tmp_path / "mxfuse/mxfuse_000.after.py").read_text()
    assert "torch.ops.mxfuse.gemma_fused_add_rmsnorm_mxfp8.default" in after
    assert "torch.ops.mxfuse.gemma_rmsnorm_mxfp8.default" in after
    # the per-head q/k norms feed RoPE: left alone, with the reason
    assert index.count("left alone by norm_quant") == 2
    torch.compiler.reset()


def test_explain_reference(capsys):
    torch.compiler.reset()
    rc = cli.main(["explain", "--layers", "1", "--tokens", "16", "--source"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "graph 0: 3 Gemma norms, 2 fused, 1 not fused" in out
    lines = out.splitlines()

    def verdict(module):
        i = next(i for i, line in enumerate(lines) if f"] {module} at models.py:" in line)
        return lines[i + 2].strip()  # the line after the source line

    assert verdict("layers.0.input_norm") == "fused: mxfuse:plain->mxfuse_quant:rowmajor"
    assert verdict("layers.0.post_attention_norm") == "fused: mxfuse:fused_add->mxfuse_quant:rowmajor"
    assert verdict("norm") == "not fused: no MXFP8 quant reads its output (read by: the graph output)"
    assert "return torch.ops.mxfuse.gemma_fused_add_rmsnorm(x, residual, self.w, self.eps)" in out
    assert "MXFP8 quants not fed by a Gemma norm (left as they are): 2" in out
    assert "1 read mxfuse_models.swiglu_oai" in out
    assert out.rstrip().endswith("2 of 3 Gemma norms fused")
    torch.compiler.reset()


def test_explain_is_pure_and_reports_each_reason():
    """explain() on a hand-made graph: the graph is untouched; K % 32, no quant, fused, option off."""
    mx = torch.ops.mxfuse

    def hf_norm(x, w, eps=1e-6):  # Hugging Face's Gemma RMSNorm, decomposed
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)

    def fn(x, r, w, x40, w40):
        y, r2 = mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        q, s = mx.mxfp8_quantize(y)
        z = hf_norm(x40, w40)  # K = 40: not a multiple of 32
        return q, s, r2, z, mx.gemma_rmsnorm(r2, w, 1e-5)

    args = (torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16())
    args += (torch.randn(4, 40).bfloat16(), torch.randn(40).bfloat16())
    graphs = []

    class Grab(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            text = str(graph)
            graphs.append(ex.explain(graph))
            graphs.append(ex.explain(graph, PassOptions(fuse_norm_quant=False)))
            assert str(graph) == text  # not touched

        def uuid(self):
            return None

    torch._dynamo.reset()
    torch.compile(fn, options={"post_grad_custom_post_pass": Grab()})(*args)
    on, off = graphs
    details = {v.kind: (v.fused, v.detail) for v in on}
    assert details == {
        "mxfuse:fused_add": (True, "mxfuse:fused_add->mxfuse_quant:rowmajor"),
        "hf:plain": (False, "hidden size K=40 is not a multiple of 32"),
        "mxfuse:plain": (False, "no MXFP8 quant reads its output (read by: the graph output)"),
    }
    assert all(v.source and v.source.startswith("test_cli.py:") for v in on)
    assert [v.fused for v in off] == [False] * 3
    assert {v.detail for v in off} >= {"the option fuse_norm_quant is off"}


def test_count_launches_of_a_wrapper():
    code = """
class Runner:
    def call(self, args):
        buf0 = empty_strided_cpu((4, 4), (4, 1), torch.bfloat16)
        cpp_fused_embedding_0(arg1_1, buf0)
        # cpp_fused_comment_1(buf0)
        buf1 = torch.ops.mxfuse.gemma_rmsnorm_mxfp8.default(buf0, arg2_1, 1e-06)
        assert_tensor_metadata(buf2, (4, 4), (4, 1), torch.uint8, 'torch.ops.mxfuse.gemma_rmsnorm_mxfp8.default')
        triton_poi_fused_0.run(buf0, buf1, 16, stream=stream0)
        extern_kernels.mm(buf0, buf1, out=buf3)
        buf4 = torch.ops._c10d_functional.wait_tensor.default(buf3)
        return (buf4, )

def benchmark_compiled_module():
    cpp_fused_embedding_0(a, b)
"""
    counts = cli.count_launches([code])
    assert counts == {
        cli.CPP_KERNELS: 1,
        "mxfuse.gemma_rmsnorm_mxfp8": 1,
        cli.TRITON_KERNELS: 1,
        "extern_kernels.mm": 1,
        "_c10d_functional.wait_tensor": 1,
    }
    assert cli.total_launches(counts) == 4  # the wait is not a launch


def test_fused_norms_from_matched_kinds():
    matched = {
        "mxfuse:plain->mxfuse_quant:rowmajor": 1,
        "hf:fused_add->vllm_quant:swizzled+y": 2,
        "mxfuse:fused_add(unfused)->c10d_gather:mxfp8_packed:rowmajor": 1,
        "repair:swizzled:c10d_gather->bf16_gather": 1,
    }
    assert cli.fused_norms(matched) == (1, 2)


def test_bitwise_equal_helper():
    a = torch.tensor([1.0, float("nan"), -0.0]).bfloat16()
    assert cli.bitwise_equal(a, a.clone())
    assert not cli.bitwise_equal(a, torch.tensor([1.0, float("nan"), 0.0]).bfloat16())  # -0 vs +0
    assert not cli.bitwise_equal(a, a.float())
    assert not cli.bitwise_equal(a, a[:2])


def test_main_without_command_prints_help():
    buf = io.StringIO()
    assert cli.main([], out=buf) == 2
    assert "demo" in buf.getvalue() and "dump" in buf.getvalue() and "explain" in buf.getvalue()


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--config", "huge"])
    with pytest.raises(SystemExit):
        cli.main(["demo", "--device", "tpu"])
    with pytest.raises(SystemExit):
        cli.main(["demo", "--sp-gather", "fp4"])
    with pytest.raises(SystemExit):
        cli.main(["dump"])  # --out is required
    with pytest.raises(SystemExit, match="not a multiple of 2"):
        cli.main(["demo", "--sp", "2", "--tokens", "33"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU"):
            cli.pick_device("cuda")
    assert cli.pick_device("cpu") == torch.device("cpu")


def test_python_dash_m_mxfuse_without_vllm():
    """`python -m mxfuse` works and never imports vLLM (the CLI must work without it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = (
        "import sys, runpy; sys.argv = ['mxfuse', 'demo', '--help']\n"
        "try:\n    runpy.run_module('mxfuse', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--tokens", "--config", "m3-flash-tp4", "--sp N", "--sp-gather"):
        assert flag in proc.stdout
