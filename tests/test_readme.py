"""The README's examples run, print what the README says, and its test command is CI's."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_python_examples_run_and_print_what_the_readme_shows():
    runnable = [block for block in code_blocks("python") if block.lstrip().startswith("import")]
    assert len(runnable) >= 2, "the README lost its torch.compile or its torchao example"
    summaries = []
    for block in runnable:
        printed = io.StringIO()
        torch._dynamo.reset()  # a fresh compile, as on a new machine (conftest keeps Inductor's cache off)
        namespace = {"__name__": "readme_example"}
        with contextlib.redirect_stdout(printed):
            exec(compile(block, "README.md", "exec"), namespace)
        shown = [line.removeprefix("# ").strip() for line in block.splitlines() if line.startswith("# {")]
        if shown:
            assert printed.getvalue().strip().splitlines()[-len(shown) :] == shown
        if namespace.get("report") is not None:
            summaries.append(namespace["report"].summary())
    # the INFO line the README shows is the one its torch.compile example logs
    logged = [line for block in code_blocks("text") for line in block.splitlines() if line.startswith("mxfuse: fused")]
    assert logged and all(line in summaries for line in logged), (logged, summaries)


def _table(heading: str) -> list[list[str]]:
    section = README.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]  # past the header and its rule


def test_the_derived_savings_table_is_the_op_contract():
    """Per model row: per layer two fused norm sites of width K and one act·mul site of width I, each removing
    one launch and 2 x width x 2 bytes per token (the bf16 output written and read back), as `PassReport`
    derives them for the log and `mxfuse explain` from each site's output row (`SiteRecord.row_bytes`)."""
    from mxfuse.passes.report import PassReport, SiteRecord, size_text
    from mxfuse.patterns.producer_quant import ProducerQuantKind
    from mxfuse.patterns.producers import ProducerFamily

    rows = _table("### What a fused site removes, derived")
    assert len(rows) >= 3
    norm = ProducerQuantKind(
        "vllm_ir:fused_add_rms_norm", "vllm", "swizzled", writes_y=False, family=ProducerFamily.NORM
    )
    act_mul = ProducerQuantKind("aten:silu_mul", "vllm", "swizzled", writes_y=False, family=ProducerFamily.ACT_MUL)
    for model, k, i, layers, launches, per_token, decode, prefill in rows:
        sites = [
            *(SiteRecord("norm_quant", norm, f"y{n}", (), row_bytes=2 * int(k)) for n in range(2 * int(layers))),
            *(SiteRecord("norm_quant", act_mul, f"a{n}", (), row_bytes=2 * int(i)) for n in range(int(layers))),
        ]
        report = PassReport(applied=sites)
        per_row, unknown = report.bytes_saved_per_row()
        assert unknown == 0 and int(launches) == report.launches_saved(), model
        assert [per_token, decode, prefill] == [size_text(per_row * t) for t in (1, 64, 8192)], model


@pytest.mark.vllm
def test_the_logging_config_for_vllm_serve_shows_the_mxfuse_lines(tmp_path):
    """`VLLM_LOGGING_CONFIG_PATH=logging.json` with the README's JSON: vLLM loads it (replacing its own), and
    both vLLM's lines and the `mxfuse` logger's INFO lines are printed."""
    pytest.importorskip("vllm")
    (config,) = code_blocks("json")
    (tmp_path / "logging.json").write_text(config)
    code = (
        "import argparse, logging\n"
        "import vllm.logger\n"
        "vllm.logger.configure_logging_from_args(argparse.Namespace())\n"  # what `vllm serve` does first
        "vllm.logger.init_logger('vllm.probe').info('vllm line')\n"
        "logging.getLogger('mxfuse').info('mxfuse: fused 1 of 1 site')\n"
        "logging.getLogger('mxfuse').debug('mxfuse: debug detail')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "logging.json")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("INFO ") and line.endswith("[vllm.probe] vllm line") for line in lines), lines
    assert any(line.startswith("INFO ") and line.endswith("[mxfuse] mxfuse: fused 1 of 1 site") for line in lines)
    assert "debug detail" not in proc.stdout


def test_ci_runs_exactly_the_readme_test_command():
    commands = [line for block in code_blocks("bash") for line in block.splitlines() if "pytest" in line]
    assert len(commands) == 1
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[0].strip() in ci.splitlines()


def test_the_suites_install_path_uses_the_default_index_only():
    """CI and the README's test commands install from PyPI alone: no other index to be unreachable."""
    suite = next(block for block in code_blocks("bash") if "pytest" in block)
    for text in (suite, (ROOT / ".ci" / "run").read_text()):
        assert not re.search(r"--(extra-)?index-url|--find-links|(^|\s)-[if]\s", text), text


def test_no_issue_numbers_users_cannot_see():
    """The README and docs/ speak to users, who do not see the project's issue tracker."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = re.findall(r"issue[ -]?#?\d+|the issue's|\bissue \(", path.read_text(), flags=re.I)
        assert not found, (path.name, found)


def test_readme_names_every_pass_option():
    from dataclasses import fields

    from mxfuse.passes.options import PassOptions

    for option in fields(PassOptions):
        assert f"`{option.name}`" in README


def test_console_excerpts_are_what_the_commands_print(capsys):
    """Every `$ mxfuse ...` block: run it, and each line shown must appear in its output."""
    from mxfuse_cli import main

    blocks = code_blocks("console")
    assert len(blocks) >= 2
    for block in blocks:
        command, *shown = block.strip().splitlines()
        assert command.startswith("$ mxfuse ")
        main(command.removeprefix("$ mxfuse ").split())
        printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
        for line in shown:
            assert line.rstrip() in printed, f"{command}: README shows {line!r}, the command no longer prints it"
