"""`mxfuse.explain`'s answer, typed (no compile here; the compiled `mxfuse.explain` is tested in
tests/test_norm_forms_compiled.py, `mxfuse explain --model pkg.module:factory` in tests/test_cli.py)."""

from __future__ import annotations

import mxfuse
from mxfuse.passes.explain import Explanation


def test_explain_is_exported_and_its_answer_is_typed():
    assert "explain" in mxfuse.__all__ and callable(mxfuse.explain)
    empty = Explanation(())
    assert empty.verdicts == () and empty.unfused == () and empty.lines() == []
