"""`mxfuse.explain`'s answer, typed (no compile here; the compiled `mxfuse.explain` is tested in
tests/test_norm_forms_compiled.py, `mxfuse explain --model pkg.module:factory` in tests/test_cli.py)."""

from __future__ import annotations

import torch

import mxfuse
from mxfuse.passes.explain import Explanation


def test_explain_is_exported_and_its_answer_is_typed():
    assert "explain" in mxfuse.__all__ and callable(mxfuse.explain)
    empty = Explanation(())
    assert empty.verdicts == () and empty.unfused == () and empty.lines() == []


def test_str_of_the_answer_is_its_lines():
    """`print(mxfuse.explain(...))` shows one line per norm, not a dataclass repr."""
    mx = torch.ops.mxfuse

    def fn(x, w):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, w, 1e-6)), mx.gemma_rmsnorm(x, w, 1e-5)

    x, w = torch.randn(4, 64).bfloat16(), torch.zeros(64).bfloat16()
    answer = mxfuse.explain(fn, x, w, options=mxfuse.PassOptions(strict=True))
    assert str(answer) == "\n".join(answer.lines()) and len(answer.lines()) == 2
    assert "fused: mxfuse:plain->mxfuse_quant:rowmajor" in str(answer) and "not fused" in str(answer)
    assert str(Explanation(())) == "no norm in the compiled graphs"
