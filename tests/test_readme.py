"""The README's examples run, print what the README says, and its test command is CI's."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_python_examples_run_and_print_what_the_readme_shows():
    runnable = [block for block in code_blocks("python") if block.lstrip().startswith("import")]
    assert runnable, "the README lost its torch.compile example"
    for block in runnable:
        printed = io.StringIO()
        torch._dynamo.reset()  # a fresh compile, as on a new machine (conftest keeps Inductor's cache off)
        with contextlib.redirect_stdout(printed):
            exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})
        shown = [line.removeprefix("# ").strip() for line in block.splitlines() if line.startswith("# {")]
        if shown:
            assert printed.getvalue().strip().splitlines()[-len(shown) :] == shown


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
