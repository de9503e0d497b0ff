"""The `mxfuse` command line on CPU: demo (and --sp 2 on gloo), dump, explain; outputs checked for content."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mxfuse.cli.demo import run_demo
from mxfuse.cli.devices import pick_device
from mxfuse.models import ModelConfig
from mxfuse.passes import explain as ex
from mxfuse.passes.analysis import CPP_KERNELS, TRITON_KERNELS, count_launches, total_launches
from mxfuse.passes.options import PassOptions
from mxfuse.passes.report import PassReport, SiteRecord
from mxfuse.patterns.producer_quant import ProducerQuantKind
from mxfuse.patterns.producers import ProducerFamily
from mxfuse.patterns.results import SharedCode, SkipRecord
from mxfuse.patterns.sequence_parallel import SequenceParallelCode
from mxfuse.patterns.sp_gather import GatheredQuantKind, PackedGatherKind
from mxfuse.testing import bitwise_equal
from mxfuse_cli import args as cli_args, build_parser, main
from mxfuse_cli.dump import MANIFEST, prepare_out_dir

ROOT = Path(__file__).resolve().parents[1]


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(start))


def _launch_row(out: str, what: str) -> list[int]:
    return [int(n) for n in _line(out, what).split()[-2:]]


def test_demo_cpu_report():
    torch.compiler.reset()
    buf = io.StringIO()
    cfg = ModelConfig.tiny(n_layers=1)
    result = run_demo(cfg, 32, torch.device("cpu"), steps=1, out=buf)
    out = buf.getvalue()
    assert result.passed, out
    assert "device : cpu" in out and "config : tiny: hidden 256, 1 layer," in out and "tokens : 32" in out
    assert "qkv_proj 512x256" in out
    # the progress indicator of each compile
    assert re.search(r"compiling with torch.compile \(inductor\) \.\.\. done in \d+\.\d s", out)
    assert re.search(r"compiling with torch.compile \+ the mxfuse passes \.\.\. done in \d+\.\d s", out)
    # three columns, a time per step for each
    header = next(line for line in out.splitlines() if "eager" in line and "compiled" in line)
    assert header.split() == ["eager", "compiled", "mxfuse", "passes"]
    assert len(re.findall(r"\d+\.\d+ ms", _line(out, "time per step"))) == 3
    assert re.search(r"bitwise == eager\s+\(ref\)\s+yes\s+yes", out)
    # launches counted from the generated wrapper: 2 norms, the SwiGLU and 3 of the 4 quants become 3 fused ops
    assert "counted in the code Inductor generated" in out and "cpp_fused_*" in out
    assert _launch_row(out, "mxfuse.gemma_rmsnorm ") == [1, 0]
    assert _launch_row(out, "mxfuse.gemma_rmsnorm_mxfp8 ") == [0, 1]
    assert _launch_row(out, "mxfuse.gemma_fused_add_rmsnorm ") == [2, 1]  # the final norm feeds no quant
    assert _launch_row(out, "mxfuse.gemma_fused_add_rmsnorm_mxfp8 ") == [0, 1]
    assert _launch_row(out, "mxfuse.mxfp8_quantize") == [4, 1]  # o_proj's; down_proj's fused with the SwiGLU
    before, after = _launch_row(out, "total launches")
    assert before - after == 3
    passes = result.variants[2]
    assert passes.launches["mxfuse.mxfp8_linear"] == 4
    # the pass report and the bytes, by the stated formula
    assert re.search(r"mxfuse:plain->mxfuse_quant:rowmajor\s+x1", out)
    assert re.search(r"mxfuse:fused_add->mxfuse_quant:rowmajor\s+x1", out)
    assert "2*M*K*2 B per fused norm (its bf16 y, written once and" in out and "M = 32 rows, K = 256) = 32 KiB" in out
    assert "2 fused norm(s) = 64 KiB per step, 64 KiB per layer (1 layer)" in out
    assert "1 fused act·mul(s) (down_proj's input, 2*M*I*2 B each, I = 512) = 64 KiB" in out
    assert "bitwise check PASSED: compiled output == eager output (32x256 bfloat16, every bit)" in out
    assert "bitwise check PASSED: with the mxfuse passes == without them (compiled output, 32x256 bfloat16)" in out
    assert "FAILED" not in out
    assert passes.bitwise_vs_compiled is True and passes.max_abs_diff == 0.0
    torch.compiler.reset()


@pytest.mark.distributed
def test_demo_sp2_gloo_bitwise_on_every_rank(capsys):
    rc = main(["demo", "--sp", "2", "--device", "cpu", "--layers", "1", "--tokens", "32", "--steps", "1"])
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
    (tmp_path / "notes.txt").write_text("the user's, not the dump's")
    rc = main(["dump", "--out", str(tmp_path), "--layers", "1", "--tokens", "16", "--force"], out=buf)
    out = buf.getvalue()
    assert rc == 0, out
    # the manifest lists exactly the files this dump wrote; the index describes only those
    listed = json.loads((tmp_path / MANIFEST).read_text())["files"]
    on_disk = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert sorted(listed) == [p for p in on_disk if p not in ("notes.txt", MANIFEST)]
    assert "notes.txt" not in (tmp_path / "INDEX.md").read_text()
    assert f"wrote {len(listed)} files under {tmp_path}" in out
    index = (tmp_path / "INDEX.md").read_text()
    before, after = tmp_path / "mxfuse/mxfuse_000.before.py", tmp_path / "mxfuse/mxfuse_000.after.py"
    assert before.exists() and after.exists() and (tmp_path / "mxfuse/mxfuse_000.report.json").exists()
    assert "torch.ops.mxfuse.gemma_rmsnorm_mxfp8" in after.read_text()
    assert "torch.ops.mxfuse.gemma_rmsnorm_mxfp8" not in before.read_text()
    # depyf's files are there and described
    full = list(tmp_path.glob("full_code_for_*.py"))
    assert full and f"| `{full[0].name}` | the compiled function as Python" in index
    assert index.count("START HERE") == 1  # where a user sees the fused ops, not Dynamo's guards
    assert "| `mxfuse/mxfuse_000.after.py` | START HERE: the same graph after the mxfuse passes" in index
    assert re.search(r"\| `[^`]*kernel[^`]*\.py` \| the code Inductor generated", index)
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


def test_dump_hf_minimax_m3(tmp_path, capfd):
    pytest.importorskip("transformers")
    torch.compiler.reset()
    buf = io.StringIO()
    rc = main(["dump", "--out", str(tmp_path), "--model", "hf-minimax-m3", "--tokens", "8"], out=buf)
    assert rc == 0, buf.getvalue()
    assert "[transformers]" not in capfd.readouterr().err  # its warnings on the tiny config: not the user's
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
    rc = main(["explain", "--layers", "1", "--tokens", "16", "--source"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "graph 0: 4 sites (3 norms, 1 act·mul), 3 fused, 1 not fused" in out  # the act·mul: the SwiGLU-OAI
    lines = out.splitlines()

    def verdict(module):
        i = next(i for i, line in enumerate(lines) if f"] {module} at layers.py:" in line)
        return lines[i + 2].strip()  # the line after the source line

    assert verdict("layers.0.input_norm") == "fused: mxfuse:plain->mxfuse_quant:rowmajor"
    assert verdict("layers.0.post_attention_norm") == "fused: mxfuse:fused_add->mxfuse_quant:rowmajor"
    assert verdict("norm") == "not fused: no MXFP8 quant reads its output (read by: the graph output)"
    assert verdict("layers.0") == "fused: mxfuse_models:swiglu_oai_mul+fp32->mxfuse_quant:rowmajor"
    assert "return torch.ops.mxfuse.gemma_fused_add_rmsnorm(x, residual, self.w, self.eps)" in out
    assert "MXFP8 quants not fed by a recognized producer (left as they are): 1" in out
    assert "1 read getitem of aten._scaled_dot_product_flash_attention_for_cpu" in out  # o_proj's
    assert out.rstrip().endswith(
        # two norms of K 256 (4K bytes a token each) and the act·mul of I 512 (4I): 1 + 1 + 2 KiB a token
        "3 of 4 sites fused\n3 sites fused: 3 fewer launches per step, 4 KiB less memory traffic per token "
        "(32 MiB per 8192-token step), derived from the op contracts"
    )
    torch.compiler.reset()


_FACTORY_MODULE = """
import torch
import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)


class TwoNorms(torch.nn.Module):
    def __init__(self, k=64):
        super().__init__()
        self.w_gemma = torch.nn.Parameter(torch.randn(k, dtype=torch.bfloat16) / 8, requires_grad=False)
        self.w_llama = torch.nn.Parameter(torch.randn(k, dtype=torch.bfloat16) / 8, requires_grad=False)

    def forward(self, x):
        gemma = torch.ops.mxfuse.gemma_rmsnorm(x, self.w_gemma, 1e-6)
        h = x.float()
        llama = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (2.0 + self.w_llama.float())).to(x.dtype)
        return torch.ops.mxfuse.mxfp8_quantize(gemma), torch.ops.mxfuse.mxfp8_quantize(llama)


def factory():
    return TwoNorms(), torch.randn(8, 64, dtype=torch.bfloat16)
"""


def test_explain_model_factory(tmp_path, monkeypatch, capsys):
    """`--model pkg.module:factory` explains the user's module: a Gemma norm fuses; a look-alike
    (weight `2 + w`, not `1 + w`) feeding the same quant is named, not fused, with the reason and the fix."""
    (tmp_path / "mxfuse_cli_factory.py").write_text(_FACTORY_MODULE)
    monkeypatch.chdir(tmp_path)  # found in the current directory, as `python -m` finds a module
    monkeypatch.setattr(sys, "path", list(sys.path))
    torch.compiler.reset()
    rc = main(["explain", "--model", "mxfuse_cli_factory:factory", "--device", "cpu"])
    out = capsys.readouterr().out
    torch.compiler.reset()
    assert rc == 0, out
    assert "graph 0: 2 sites (2 norms), 1 fused, 1 not fused" in out
    lines = [line.strip() for line in out.splitlines()]
    assert "fused: mxfuse:plain->mxfuse_quant:rowmajor" in lines
    unfused = next(i for i, line in enumerate(lines) if line.startswith("not fused: "))
    assert "[hf:plain] at mxfuse_cli_factory.py:" in lines[unfused - 1]
    assert "nor Gemma's `1 + w`" in lines[unfused]
    assert lines[unfused + 1].startswith("fix: ") and "gemma_rmsnorm" in lines[unfused + 1]
    assert out.rstrip().endswith(
        "1 of 2 sites fused\n1 site fused: 1 fewer launch per step, 256 B less memory traffic per token "
        "(2 MiB per 8192-token step), derived from the op contracts"
    )


_K_ODD_MODULE = """
import torch
import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)


class LlamaRMSNorm(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(k, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class Attention(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.norm = LlamaRMSNorm(k)

    def forward(self, x):
        return torch.ops.mxfuse.mxfp8_quantize(self.norm(x))


class Layer(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.attn = Attention(k)

    def forward(self, x):
        return self.attn(x)


def llama_k_odd():
    return Layer(120), torch.randn(8, 120, dtype=torch.bfloat16)
"""


def test_explain_a_model_that_fails_to_compile_is_one_line(tmp_path, monkeypatch, capsys):
    """An op that refuses the user's shapes while Dynamo traces (hidden size 120) is one line naming the op,
    the shape and the submodule that called it, not Dynamo's traceback; `--verbose` raises it whole."""
    (tmp_path / "mxfuse_k_odd.py").write_text(_K_ODD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    torch.compiler.reset()
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--model", "mxfuse_k_odd:llama_k_odd"])
    assert str(exit_info.value.code) == (
        "mxfuse explain: mxfuse_k_odd:llama_k_odd did not compile: mxfuse::mxfp8_quantize: hidden size K=120 of "
        "x (8, 120) bfloat16 on cpu is not a multiple of 32 (in attn (Attention.forward) at mxfuse_k_odd.py:22); "
        "--verbose shows the traceback"
    )
    assert "mxfuse explain: mxfuse_k_odd:llama_k_odd on inputs bfloat16[8, 120]; " in capsys.readouterr().out
    torch.compiler.reset()
    with pytest.raises(Exception, match=r"K=120 of x \(8, 120\)") as raised:
        main(["explain", "--model", "mxfuse_k_odd:llama_k_odd", "--verbose"])
    assert not isinstance(raised.value, SystemExit)
    torch.compiler.reset()


def test_explain_flags_that_do_not_apply_to_a_factory_are_errors(tmp_path, monkeypatch, capsys):
    """A factory returns its own inputs: `--tokens` with it is an error, not silently ignored; a file path
    without `:factory` says what to write instead."""
    (tmp_path / "mxfuse_k_odd.py").write_text(_K_ODD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    line = _argparse_error(capsys, ["explain", "--model", "mxfuse_k_odd:llama_k_odd", "--tokens", "16"])
    assert line == (
        "mxfuse explain: error: --tokens applies to --model reference and hf-minimax-m3; "
        "mxfuse_k_odd:llama_k_odd returns its own inputs"
    )
    line = _argparse_error(capsys, ["explain", "--model", "./mxfuse_k_odd.py"])
    assert line == (
        "mxfuse explain: error: argument --model: ./mxfuse_k_odd.py: expected pkg.module:factory, not a file "
        "path: run from the file's directory with --model mxfuse_k_odd:FACTORY, FACTORY the function that "
        "returns (module, example_inputs)"
    )


def test_a_warning_during_a_progress_line_is_printed_after_the_line():
    """The pass's warning (a norm it left) is logged mid-compile: it comes after `compiling ... done`, not
    inside the line; the logger's handlers are back afterwards."""
    import logging

    from mxfuse.cli.progress import Progress

    shared = io.StringIO()  # the terminal: stdout and the log handler write to the same place
    logger = logging.getLogger("mxfuse")
    handler = logging.StreamHandler(shared)
    logger.addHandler(handler)
    try:
        with Progress("compiling", shared):
            logger.warning("mxfuse: 1 norm(s) feed an MXFP8 quant but were not fused")
        assert logger.handlers[-1] is handler
    finally:
        logger.removeHandler(handler)
    lines = shared.getvalue().splitlines()
    assert lines[0].startswith("compiling ... done in "), lines
    assert lines[1] == "mxfuse: 1 norm(s) feed an MXFP8 quant but were not fused"


def test_the_runner_package_never_imports_the_parser_package():
    """`mxfuse_cli` (parser, checks, no torch) imports `mxfuse.cli.<command>` to run it; `mxfuse.cli` takes
    what it needs from `args` and never imports `mxfuse_cli`: one direction between the two."""
    import ast

    for path in sorted((ROOT / "mxfuse" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "mxfuse_cli" or n.startswith("mxfuse_cli.") for n in names), (path.name, names)


def test_explain_model_factory_bad_spec(capsys, tmp_path, monkeypatch):
    """Every `--model` mistake is one line naming the spec and what was expected; the form, a path and a
    missing module are caught while parsing (before torch is imported: see the test below)."""
    line = _argparse_error(capsys, ["explain", "--model", "nonsense"])
    assert line == (
        "mxfuse explain: error: argument --model: expected one of reference, hf-minimax-m3 or "
        "pkg.module:factory, got 'nonsense'"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    line = _argparse_error(capsys, ["explain", "--model", "./mymodels.py:f"])
    assert line == (
        "mxfuse explain: error: argument --model: ./mymodels.py:f: expected a module name, not a file path: run "
        "from the file's directory with --model mymodels:f (the current directory is searched first, as by python -m)"
    )
    line = _argparse_error(capsys, ["explain", "--model", "mxfuse_no_such_module:factory"])
    assert line == (
        "mxfuse explain: error: argument --model: mxfuse_no_such_module:factory: no module named "
        f"'mxfuse_no_such_module' in the current directory ({tmp_path}) or on sys.path"
    )
    (tmp_path / "mxfuse_bad_factories.py").write_text(
        "import torch\n"
        "three = 3\n"
        "def needs(a, b=1):\n    return torch.nn.Identity(), torch.zeros(1)\n"
        "def wrong():\n    return torch.nn.Identity()\n"
        "def three_things():\n    return 1, 2, 3\n"
    )
    expected = {
        "three": "is an int, expected a factory function returning (module, example_inputs)",
        "needs": "the factory takes arguments (a, b=1); expected one called with none, returning "
        "(module, example_inputs)",
        "wrong": "the factory returned an Identity, expected (module, example_inputs)",
        "three_things": "the factory returned a tuple of 3 (int, int, int), expected (module, example_inputs)",
        "missing": "'mxfuse_bad_factories' has no attribute 'missing'",
    }
    for attr, words in expected.items():
        spec = f"mxfuse_bad_factories:{attr}"
        with pytest.raises(SystemExit) as exit_info:
            main(["explain", "--model", spec])
        assert str(exit_info.value.code) == f"mxfuse explain: --model {spec}: {words}"
    (tmp_path / "mxfuse_imports_missing.py").write_text("import mxfuse_not_installed_xyz\n")
    with pytest.raises(ModuleNotFoundError, match="mxfuse_not_installed_xyz"):  # the user's own import: traceback
        main(["explain", "--model", "mxfuse_imports_missing:f"])


def test_explain_is_pure_and_reports_each_reason():
    """explain() on a hand-made graph: the graph is untouched; no quant (before any other reason: a norm no
    quant reads is not fused whatever its K or dtype), fused, option off."""
    mx = torch.ops.mxfuse

    def hf_norm(x, w, eps=1e-6):  # Hugging Face's Gemma RMSNorm, decomposed
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)

    def fn(x, r, w, x40, w40):
        y, r2 = mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        q, s = mx.mxfp8_quantize(y)
        z = hf_norm(x40, w40)  # K = 40, not a multiple of 32, but what leaves it is that no quant reads it
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
        "hf:plain": (False, "no MXFP8 quant reads its output (read by: the graph output)"),
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
    counts = count_launches([code])
    assert counts == {
        CPP_KERNELS: 1,
        "mxfuse.gemma_rmsnorm_mxfp8": 1,
        TRITON_KERNELS: 1,
        "extern_kernels.mm": 1,
        "_c10d_functional.wait_tensor": 1,
    }
    assert total_launches(counts) == 4  # the wait is not a launch


def _record(kind) -> SiteRecord:
    return SiteRecord(kind.rewrite, kind, "y", ("y",))


def test_pass_summary_reads_kinds_by_their_fields():
    plain = ProducerQuantKind("mxfuse:plain", "mxfuse", "rowmajor", writes_y=False, family=ProducerFamily.NORM)
    with_y = ProducerQuantKind("hf:fused_add", "vllm", "swizzled", writes_y=True, family=ProducerFamily.NORM)
    packed = PackedGatherKind("mxfuse:fused_add", True, False, "rowmajor", "c10d", keeps_bf16_gather=False)
    unfused = PackedGatherKind("mxfuse:fused_add", False, True, "rowmajor", "c10d", keeps_bf16_gather=False)
    repair = GatheredQuantKind(None, False, True, False, swizzled=True, quant_form="mxfuse", gather_form="c10d")
    kinds = [plain, with_y, with_y, packed, packed, packed, unfused, repair]
    report = PassReport(applied=[_record(k) for k in kinds])
    assert report.fused_producers() == (4, 2)
    assert report.packed_gathers() == 4
    assert report.matched_text()[0] == ("hf:fused_add->vllm_quant:swizzled+y", 2)
    assert PassReport.merge([report, report]).matched_text()[0] == ("hf:fused_add->vllm_quant:swizzled+y", 4)


def test_skips_read_by_their_fields():
    code = SharedCode.NO_QUANT
    norm = SkipRecord("norm_quant", "hf:plain", "convert_element_type_5", code, "no MXFP8 quant reads its output")
    quant = SkipRecord("sp_gather", None, "mxfp8_quantize_3", SharedCode.QUANT_UNSUPPORTED, "a quant it cannot replace")
    assert norm.label == "hf:plain"
    assert quant.label == "quant_input"  # the report's word for a site with no norm
    whole = SkipRecord(
        "sequence_parallel", None, "all_reduce_1", SequenceParallelCode.ALL_REDUCE_FORM, "not an all-reduce it knows"
    )
    assert whole.label == "whole_graph"  # the rewrite left the whole graph, not a norm


def test_kinds_read_by_their_fields():
    """The summaries read the typed kinds' fields; their strings are the report's."""
    kinds = {
        ProducerQuantKind("mxfuse:plain", "mxfuse", "rowmajor", writes_y=False, family=ProducerFamily.NORM): (
            "mxfuse:plain->mxfuse_quant:rowmajor",
            (True, False, False),
        ),
        ProducerQuantKind("hf:fused_add", "vllm", "swizzled", writes_y=True, family=ProducerFamily.NORM): (
            "hf:fused_add->vllm_quant:swizzled+y",
            (True, True, False),
        ),
        PackedGatherKind("mxfuse:fused_add", False, False, "rowmajor", "c10d", keeps_bf16_gather=False): (
            "mxfuse:fused_add(unfused)->c10d_gather:mxfp8_packed:rowmajor",
            (False, False, True),
        ),
        GatheredQuantKind(None, False, False, True, swizzled=True, quant_form="mxfuse", gather_form="c10d"): (
            "repair:swizzled:c10d_gather->mxfp8_packed",
            (False, False, True),
        ),
    }
    fields = {str(k): (k.fuses_producer, k.writes_y, k.packed_gather) for k in kinds}
    assert fields == dict(kinds.values())


def test_bitwise_equal_helper():
    a = torch.tensor([1.0, float("nan"), -0.0]).bfloat16()
    assert bitwise_equal(a, a.clone())
    assert not bitwise_equal(a, torch.tensor([1.0, float("nan"), 0.0]).bfloat16())  # -0 vs +0
    assert not bitwise_equal(a, a.float())
    assert not bitwise_equal(a, a[:2])
    assert bitwise_equal(torch.tensor([True, False]), torch.tensor([True, False]))


def test_main_without_command_prints_help():
    buf = io.StringIO()
    assert main([], out=buf) == 2
    assert "demo" in buf.getvalue() and "dump" in buf.getvalue() and "explain" in buf.getvalue()


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        main(["demo", "--config", "huge"])
    with pytest.raises(SystemExit):
        main(["demo", "--device", "tpu"])
    with pytest.raises(SystemExit):
        main(["demo", "--sp-gather", "fp4"])
    with pytest.raises(SystemExit):
        main(["dump"])  # --out is required
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU"):
            pick_device("cuda", "demo")
    assert pick_device("cpu", "demo") == torch.device("cpu")


def _argparse_error(capsys, argv) -> str:
    """The one error line argparse printed for `argv` (after the subcommand's usage), exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--layers", "0"],
        ["demo", "--tokens", "-3"],
        ["demo", "--steps", "0"],
        ["demo", "--sp", "0"],
        ["demo", "--tokens", "x"],
        ["explain", "--layers", "0"],
        ["dump", "--out", "unused", "--tokens", "0"],
    ],
)
def test_bad_values_end_in_one_error_line(capsys, argv):
    command, flag, value = argv[0], argv[-2], argv[-1]
    line = _argparse_error(capsys, argv)
    assert line.startswith(f"mxfuse {command}: error: argument {flag}: ") and value in line


def test_tokens_not_a_multiple_of_sp_is_refused_before_any_work(capsys):
    line = _argparse_error(capsys, ["demo", "--sp", "2", "--tokens", "33"])
    assert line == "mxfuse demo: error: --tokens 33 is not a multiple of --sp 2"
    line = _argparse_error(capsys, ["demo", "--sp", "3"])  # the default 128 tokens of tiny
    assert line == "mxfuse demo: error: --tokens 128 is not a multiple of --sp 3"


def test_unknown_flag_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--foo"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("usage: mxfuse demo ") and "--native-activation" in err
    assert err.strip().splitlines()[-1] == "mxfuse demo: error: unrecognized arguments: --foo"


def test_version(capsys):
    import mxfuse

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"mxfuse {mxfuse.__version__}\n"


def test_subcommands_agree_on_the_default_device():
    parser = build_parser()
    devices = {
        cmd: parser.parse_args([cmd, *extra]).device
        for cmd, extra in (("demo", []), ("explain", []), ("dump", ["--out", "x"]))
    }
    assert devices == {"demo": "auto", "explain": "auto", "dump": "auto"}


def test_reference_flags_with_the_hf_layer_are_errors(capsys):
    line = _argparse_error(capsys, ["explain", "--model", "hf-minimax-m3", "--layers", "2"])
    assert line == "mxfuse explain: error: --layers applies to --model reference, not hf-minimax-m3"


def test_argument_lists_match_the_package():
    from mxfuse.models import CONFIG_NAMES
    from mxfuse.passes.options import SP_GATHER_MODES

    assert cli_args.CONFIG_NAMES == CONFIG_NAMES and cli_args.SP_GATHER_MODES == SP_GATHER_MODES


def test_dump_out_that_cannot_be_a_directory_is_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out, message in (
        (a_file, f"mxfuse dump: --out {a_file} is a file, not a directory"),
        (a_file / "sub", f"mxfuse dump: cannot create --out {a_file / 'sub'}: "),
        (Path("/sys/mxfuse-test"), "mxfuse dump: cannot create --out /sys/mxfuse-test: "),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["dump", "--out", str(out)])
        error = str(exit_info.value.code)
        assert error.startswith(message) and "\n" not in error
    assert not Path("/sys/mxfuse-test").exists()


def test_dump_refuses_a_used_directory_and_force_clears_only_an_earlier_dump(tmp_path):
    out = tmp_path / "dump"
    (out / "mxfuse").mkdir(parents=True)
    ours = ["full_code_for_forward_0.py", "INDEX.md", "mxfuse/mxfuse_000.before.py"]
    for name in ours:
        (out / name).write_text("old")
    (out / "notes.txt").write_text("the user's")
    (tmp_path / "outside.py").write_text("not in DIR")
    (out / MANIFEST).write_text(json.dumps({"files": [*ours, "../outside.py"]}))
    with pytest.raises(SystemExit) as exit_info:
        main(["dump", "--out", str(out)])
    assert str(exit_info.value.code).startswith(f"mxfuse dump: --out {out} is not empty; pass --force")
    assert all((out / name).exists() for name in ours)  # refused: nothing touched

    assert prepare_out_dir(str(out), force=True) == (out.resolve(), 3)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # the emptied mxfuse/ is gone too
    assert (tmp_path / "outside.py").exists()
    assert prepare_out_dir(str(out), force=True) == (out.resolve(), 0)  # no manifest: nothing to clear


def test_missing_optional_dependencies_name_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf fails, find_spec finds nothing
    with pytest.raises(SystemExit, match=r"^mxfuse dump needs depyf: pip install 'mxfuse\[dump\]'$"):
        main(["dump", "--out", str(tmp_path / "d")])
    assert not (tmp_path / "d").exists()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit, match=r"needs transformers: pip install 'mxfuse\[hf\]'$"):
        main(["explain", "--model", "hf-minimax-m3"])


def _python(code: str, env: dict | None = None, timeout: float | None = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


def test_parsing_and_argument_checks_never_import_torch(tmp_path):
    """The `mxfuse` command (`mxfuse_cli:main`) answers --help, --version and bad arguments before torch
    or the `mxfuse` package (which imports torch to register its ops) is imported."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    code = f"""
import sys
from mxfuse_cli import main
for argv in (["--help"], ["demo", "--help"], ["--version"], ["demo", "--layers", "0"], ["demo", "--foo"],
             ["dump", "--out", {str(a_file)!r}], ["explain", "--model", "./mymodels.py:f"]):
    try:
        main(argv)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
assert "torch" not in sys.modules, "torch imported"
assert "mxfuse" not in sys.modules, "mxfuse imported"
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "is a file, not a directory" in proc.stderr and "must be a positive integer, got 0" in proc.stderr
    assert "./mymodels.py:f" in proc.stderr


def test_python_dash_m_mxfuse_help_never_imports_vllm():
    """`python -m mxfuse demo --help`: never vLLM (the CLI must work without it)."""
    code = (
        "import sys, runpy; sys.argv = ['mxfuse', 'demo', '--help']\n"
        "try:\n    runpy.run_module('mxfuse', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--tokens", "--config", "m3-flash-tp4", "--sp N", "--sp-gather"):
        assert flag in proc.stdout


def test_a_program_named_mxfuse_gets_the_ops(tmp_path):
    """`import mxfuse` registers its ops whatever the program is called (argv[0] `mxfuse` included)."""
    script = tmp_path / "mxfuse"
    script.write_text("import torch, mxfuse\nprint(hasattr(torch.ops.mxfuse, 'gemma_rmsnorm_mxfp8'))\n")
    proc = _python(f"import runpy, sys; sys.argv = [{str(script)!r}]; runpy.run_path({str(script)!r})")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_dir_of_the_package_shows_its_api_only():
    import mxfuse

    names = dir(mxfuse)
    assert {"post_grad_pass", "explain", "PassOptions", "MxfusePass", "__version__"} <= set(names)
    assert not {"Literal", "TYPE_CHECKING", "importlib", "os", "sys", "annotations", "mxfuse"} & set(names)


def test_no_cuda_runtime_notice_inside_the_commands_output(tmp_path):
    """Inductor imports torch.utils.cpp_extension mid-compile; without a GPU it logs "No CUDA runtime
    is found" into the middle of a progress line. The command imports it quietly before it starts."""
    code = """
from mxfuse_cli import main
try:
    main(["explain", "--device", "cuda"])
except SystemExit as e:
    print(e)
import torch.utils.cpp_extension  # what a compile would import next
"""
    env = {"CUDA_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = _python(code, env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.strip() == "mxfuse explain: --device cuda was asked for but no CUDA GPU is available"
    assert "No CUDA runtime" not in out


def _rank_body_that_fails_on_rank_1(rank, world, port, word, events):
    events.send("hello", word)
    if rank == 1:
        raise ValueError(f"rank {rank} of {world} gives up")
    return word


@pytest.mark.distributed
def test_run_ranks_streams_events_and_reports_the_failing_rank():
    """The spawn helper of the demo, tools and tests: events reach the parent; a failing rank ends the wait."""
    from mxfuse.testing import RankFailed, run_ranks

    seen = []
    with pytest.raises(RankFailed) as failure:
        run_ranks(_rank_body_that_fails_on_rank_1, 2, timeout=120, args=("hi",), on_event=lambda r, e: seen.append(e))
    assert failure.value.rank == 1 and "ValueError: rank 1 of 2 gives up" in failure.value.trace
    assert ("hello", "hi") in seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs --device cuda to fail")
def test_dump_that_fails_before_writing_leaves_an_empty_directory(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(SystemExit, match=r"^mxfuse dump: --device cuda was asked for but no CUDA GPU"):
        main(["dump", "--out", str(out), "--device", "cuda"])
    assert out.is_dir() and not any(out.iterdir())  # a second run needs no --force


def test_timing_sizes_the_l2_flush_and_input_sets_from_the_device(monkeypatch):
    """`mxfuse.timing` reads the L2 size from the device (no GPU's size hard-coded)."""
    from types import SimpleNamespace

    from mxfuse import timing

    for l2 in (50 * 2**20, 256 * 2**20):
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda device, l2=l2: SimpleNamespace(L2_cache_size=l2)
        )
        assert timing.l2_bytes() == l2
        assert timing.n_input_sets(2**20, calls=1000) == 3 * l2 // 2**20


# ------------------------------------------------ options from the environment and keywords


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("MXFUSE_OPTIONS", '{"sp_gather": "fp8"}', "sp_gather must be one of ('auto', 'bf16', 'mxfp8')"),
        ("MXFUSE_OPTIONS", '{"fresh": 1}', "fresh must be a bool, got 1"),
        ("MXFUSE_OPTIONS", '{"strict": "yes"}', "strict must be a bool, got 'yes'"),
        ("MXFUSE_OPTIONS", '{"sp_gaterh": "bf16"}', "unknown mxfuse option(s) 'sp_gaterh' (did you mean 'sp_gather'?)"),
        ("MXFUSE_OPTIONS", '{"dump_dir": 3}', "dump_dir must be a str or None, got 3"),
        ("MXFUSE_OPTIONS", "sp_gather=bf16", "not valid JSON"),
        ("MXFUSE_OPTIONS", '["bf16"]', "must be a JSON object of mxfuse options"),
        ("MXFUSE_STRICT", "yes", "must be 0 or 1"),
        ("MXFUSE_DUMP_DIR", "/etc/passwd", "dump_dir='/etc/passwd' is not a writable directory"),
    ],
)
def test_bad_options_from_the_environment_name_the_variable(monkeypatch, variable, value, words):
    """Every bad value is one `MxfuseOptionError` line naming the variable. It is a ValueError: pydantic
    (vLLM's config) shows a ValueError's message and lets a TypeError through to argparse, which hides it."""
    import mxfuse
    from mxfuse.passes.options import MxfuseOptionError

    monkeypatch.setenv(variable, value)
    with pytest.raises(MxfuseOptionError) as info:
        mxfuse.post_grad_pass()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(f"{variable}={value!r}: ") and words in message and "\n" not in message
    if "mxfuse option " in words:  # a bad value of a known option: a keyword argument overrides it
        assert mxfuse.post_grad_pass(sp_gather="bf16", fresh=True, dump_dir=None, strict=True)


def test_a_misspelled_option_lists_the_known_ones_and_the_closest(monkeypatch):
    import mxfuse

    known = "known: fuse_norm_quant, sp_gather, sequence_parallel, dump_dir, strict, fresh"
    with pytest.raises(TypeError) as info:
        mxfuse.post_grad_pass(fuse_norm_qaunt=True)
    assert str(info.value) == f"unknown mxfuse option(s) 'fuse_norm_qaunt' (did you mean 'fuse_norm_quant'?); {known}"
    monkeypatch.setenv("MXFUSE_OPTIONS", '{"fuse_norm_qaunt": true}')
    with pytest.raises(TypeError) as info:
        mxfuse.post_grad_pass()
    assert str(info.value) == (
        """MXFUSE_OPTIONS='{"fuse_norm_qaunt": true}': unknown mxfuse option(s) 'fuse_norm_qaunt' """
        f"(did you mean 'fuse_norm_quant'?); {known}"
    )


@pytest.mark.vllm
def test_a_bad_mxfuse_options_fails_when_vllm_builds_its_config():
    """vLLM resolves "mxfuse.vllm_pass" in `CompilationConfig.__post_init__` (`__import__("mxfuse")`, which
    builds the pass): the bad value is refused there, naming the variable, not at the first compile."""
    pytest.importorskip("vllm")
    code = (
        "from vllm.config import CompilationConfig\n"
        "try:\n"
        "    CompilationConfig(inductor_passes={'post_grad_custom_post_pass': 'mxfuse.vllm_pass'})\n"
        "except Exception as e:\n"
        "    print('refused:', type(e).__name__, e)\n"
        "else:\n"
        "    print('accepted')\n"
    )
    proc = _python(code, {"MXFUSE_OPTIONS": '{"sp_gather": "fp8"}'})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused: ValidationError"), proc.stdout
    assert """MXFUSE_OPTIONS='{"sp_gather": "fp8"}': mxfuse option sp_gather must be one of""" in proc.stdout


_VLLM_SERVE_PARSE = """
import sys
from unittest import mock
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser

with mock.patch.object(type(current_platform), "device_type", "cpu"):  # vLLM's CUDA wheel on a CPU machine
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
parser.parse_args(["--compilation-config", sys.argv[1]])
print("parsed")
"""


@pytest.mark.vllm
def test_a_bad_mxfuse_options_is_shown_by_vllm_serves_own_argument_parser():
    """`vllm serve --compilation-config '<the README's JSON>'` through vLLM's real parser
    (`EngineArgs.add_cli_args`): each bad value's message reaches the user, naming the variable and, for
    a typo, the closest option, instead of argparse's "invalid parse_dataclass value"."""
    pytest.importorskip("vllm")
    config = re.search(r"--compilation-config '(\{.*?\})'", (ROOT / "README.md").read_text())
    assert config is not None and "mxfuse.vllm_pass" in config.group(1)
    cases = {
        '{"sp_gaterh": "bf16"}': "unknown mxfuse option(s) 'sp_gaterh' (did you mean 'sp_gather'?)",
        '{"strict": "yes"}': "mxfuse option strict must be a bool, got 'yes'",
        '{"sp_gather": "fp8"}': "mxfuse option sp_gather must be one of",
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = {  # one process each: vLLM builds the pass once, when its config first names it
        value: subprocess.Popen(
            [sys.executable, "-c", _VLLM_SERVE_PARSE, config.group(1)],
            env={**env, "MXFUSE_OPTIONS": value},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for value in cases
    }
    for value, words in cases.items():
        stdout, stderr = procs[value].communicate(timeout=900)
        assert procs[value].returncode == 2, (stdout, stderr[-3000:])  # argparse's error exit
        error = next(line for line in stderr.splitlines() if line.startswith("vllm serve: error:"))
        assert "invalid parse_dataclass value" not in error, error
        assert f"MXFUSE_OPTIONS={value!r}: {words}" in stderr, stderr[-3000:]


def _rank_body_that_idles(rank, world, port, seconds):
    time.sleep(seconds)  # no CPU: what a deadlock looks like
    return rank


def _rank_body_that_works(rank, world, port, seconds):
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:  # CPU seconds: slower on a loaded machine, never cut short
        pass
    return rank


def _rank_body_that_dies(rank, world, port):
    if rank == 1:
        os._exit(3)
    time.sleep(600)


@pytest.mark.distributed
def test_run_ranks_waits_for_work_not_for_a_clock():
    """`timeout` is time without progress: ranks that compute longer than it finish; ranks that use no CPU
    for that long time out; a rank that dies ends the wait at once, not after the timeout."""
    from mxfuse.testing import RankFailed, run_ranks

    assert run_ranks(_rank_body_that_works, 2, timeout=5, args=(8,)) == {0: 0, 1: 1}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"made no progress for 5 s \(deadlocked\?\)"):
        run_ranks(_rank_body_that_idles, 2, timeout=5, args=(600,))
    with pytest.raises(RankFailed, match="exited with code 3 without a result") as failure:
        run_ranks(_rank_body_that_dies, 2, timeout=600)
    assert failure.value.rank == 1
    assert time.monotonic() - t0 < 600  # neither waited for the sleeping rank


def _rank_body_that_sends_then_sleeps(rank, world, port, events):
    events.send("started")
    time.sleep(600)


def _interrupt(rank, event):
    raise KeyboardInterrupt


@pytest.mark.distributed
def test_run_ranks_interrupted_leaves_no_process_behind():
    """Ctrl-C while the ranks run (here: raised from the event callback) ends every rank before it returns."""
    import multiprocessing

    from mxfuse.testing import run_ranks

    with pytest.raises(KeyboardInterrupt):
        run_ranks(_rank_body_that_sends_then_sleeps, 3, on_event=_interrupt)
    assert multiprocessing.active_children() == []


def test_demo_refuses_what_the_machine_cannot_run_before_building_anything():
    """`demo --device cuda` without a GPU and `demo --sp N` beyond the cores (no GPUs) end in one line, before
    the model, the passes or any rank exist."""
    code = """
import multiprocessing, os, sys
from mxfuse_cli import main
for argv in (["demo", "--device", "cuda"], ["demo", "--sp", "64", "--tokens", "64"]):
    try:
        main(argv)
    except SystemExit as e:
        print(e)
assert multiprocessing.active_children() == []
print("built:", [m for m in ("mxfuse.models", "mxfuse.cli.variants", "torch._inductor") if m in sys.modules])
print("cores:", len(os.sched_getaffinity(0)))
"""
    proc = _python(code, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    cores = int(lines[3].split()[-1])
    assert lines[0] == "mxfuse demo: --device cuda was asked for but no CUDA GPU is available"
    if cores < 64:
        assert lines[1] == (
            f"mxfuse demo --sp 64: this machine has {cores} CPU core(s); gloo on CPU runs one rank per core, "
            f"so use --sp {max(2, cores)} or fewer"
        )
    assert lines[2] == "built: []"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_ticks_on_a_terminal_and_adds_nothing_elsewhere():
    """A long step shows a spinner and the seconds so far on a TTY; piped output gets one plain line."""
    from mxfuse.cli.progress import Progress

    for out in (_Terminal(), io.StringIO()):
        with Progress("compiling", out) as p:
            time.sleep(0.8)
        text = out.getvalue()
        assert text.endswith(f" done in {p.elapsed:.1f} s" + (" " * 8 if out.isatty() else "") + "\n")
        if out.isatty():
            ticks = re.findall(r"\rcompiling \.\.\. [|/\\-] +(\d+\.\d) s", text)
            assert ticks and float(ticks[-1]) > 0, text  # the elapsed time, redrawn while it runs
        else:
            assert text == f"compiling ... done in {p.elapsed:.1f} s\n"


def test_sp_progress_shows_the_ranks_starting_until_their_first_step():
    from mxfuse.cli.progress import ProgressFromEvents

    out = io.StringIO()
    progress = ProgressFromEvents(out, starting="starting 2 processes")
    progress(0, ("start", "building"))
    progress(0, ("end", True))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("starting 2 processes ... done in ")
    assert lines[1].startswith("[rank 0] building ... done in ")
