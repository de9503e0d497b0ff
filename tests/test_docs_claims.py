"""Every "compiled" / "not compiled" claim of the docs, checked against vLLM 0.33's own logic.

docs/applicability.md's vLLM table names each row's vLLM class in backticks; README's "Where it
applies" table names the class for the rows that hang on it (MiniMax-M3) and the models by name
for the others, which the applicability table maps to classes. A row claims "not compiled" when it
says "never compiled", "not compiled" or "never reached"; any other row of those tables reports
what mxfuse does inside vLLM's compiled graphs, so it claims "compiled". vLLM's answer: the mode
`VllmConfig._maybe_enable_breakable_cudagraph` leaves for the architecture when the user asks for
`VLLM_COMPILE` (the breakable-CUDA-graph list sets `NONE`), and whether the class reaches
`@support_torch_compile` (tests/vllm_pipeline.py: `compile_mode_by_default`,
`has_support_torch_compile`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm_pipeline import compile_mode_by_default, has_support_torch_compile

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parent.parent
NOT_COMPILED = re.compile(r"never compiled|not compiled|never reached")


def _table_rows(text: str, heading: str) -> list[list[str]]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ][1:]  # the header row


def _architectures(cell: str, registry) -> list[str]:
    return [name for name in re.findall(r"`([A-Za-z0-9_]+)`", cell) if name in registry]


def _vllm_compiles(architecture: str) -> bool:
    from vllm.config import CompilationMode

    compiled_by_mode = compile_mode_by_default(architecture) == CompilationMode.VLLM_COMPILE
    return compiled_by_mode and has_support_torch_compile(architecture)


def _claims():
    """(where, architecture, claims compiled) for every row of both tables that names a vLLM class."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.registry import ModelRegistry

    registry = set(ModelRegistry.get_supported_archs())
    applicability = (ROOT / "docs/applicability.md").read_text()
    claims, by_name = [], {}
    for row in _table_rows(applicability, "## vLLM 0.33"):
        names = _architectures(row[0], registry)
        if names:  # a row's subject is the first class it names
            claims.append((f"docs/applicability.md: {row[0][:60]}", names[0], not NOT_COMPILED.search(" ".join(row))))
            by_name[row[0].split(" (")[0].strip("* ")] = names[0]
    readme = (ROOT / "README.md").read_text()
    for row in _table_rows(readme, "## Where it applies"):
        if not row[0].startswith("vLLM"):
            continue
        named = _architectures(row[0], registry) or [by_name[m] for m in row[1].split(", ") if m in by_name]
        for architecture in named:
            claims.append((f"README.md: {row[0][:40]} / {row[1][:40]}", architecture, not NOT_COMPILED.search(row[-1])))
    return claims


def test_every_compiled_claim_matches_vllms_compile_logic():
    claims = _claims()
    assert len(claims) >= 12, claims  # the tables were found and parsed
    wrong = [(where, arch, said) for where, arch, said in claims if said != _vllm_compiles(arch)]
    assert not wrong, wrong


def test_the_claims_include_both_answers():
    """The check can fail both ways: the tables hold compiled and not-compiled architectures."""
    said = {arch: compiled for _, arch, compiled in _claims()}
    assert said["Gemma3ForCausalLM"] and said["TransformersMoEForCausalLM"]
    assert not said["MiniMaxM3SparseForCausalLM"] and not said["AliceAIForCausalLM"]
