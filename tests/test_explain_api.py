"""`mxfuse explain --model pkg.module:factory` loads the user's model through `load_factory` (no compile here;
the compiled `mxfuse.explain` is tested in tests/test_norm_forms_compiled.py)."""

from __future__ import annotations

import pytest
import torch

import mxfuse
from mxfuse.passes.explain import Explanation, load_factory


def tiny_factory():
    return torch.nn.Linear(32, 32), torch.randn(2, 32)


def factory_with_tuple():
    return torch.nn.Identity(), (torch.randn(2, 32), torch.randn(2, 32))


def not_a_factory():
    return torch.nn.Identity()


def test_factory_spec_returns_the_module_and_a_tuple_of_inputs():
    module, inputs = load_factory(f"{__name__}:tiny_factory")
    assert isinstance(module, torch.nn.Linear) and len(inputs) == 1 and inputs[0].shape == (2, 32)
    _, inputs = load_factory(f"{__name__}:factory_with_tuple")
    assert len(inputs) == 2


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ("no_colon", ValueError, "pkg.module:factory"),
        (f"{__name__}:not_a_factory", ValueError, "must return (module, example_inputs)"),
        (f"{__name__}:missing", AttributeError, "missing"),
        ("no_such_module_xyz:f", ImportError, "no_such_module_xyz"),
    ],
)
def test_bad_factory_specs_say_what_is_wrong(spec, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_factory(spec)


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
    assert str(Explanation(())) == "no Gemma norm in the compiled graphs"
