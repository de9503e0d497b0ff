"""`mxfuse explain --model pkg.module:factory`: the spec checked, the module found, the factory called.

The module is looked up as `python -m` looks it up: the current directory first, then
`sys.path`. What can be checked without importing anything (the form, a path given
instead of a module name, a top-level module that does not exist) is checked when the
arguments are parsed, before torch is imported; the rest when the factory is loaded.
Every mistake is a `ModelSpecError`: one line naming the spec and what was expected (the
command puts `--model ` before it).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

FORM = "pkg.module:factory"
RETURNS = "(module, example_inputs)"


class ModelSpecError(ValueError):
    """A `--model pkg.module:factory` that cannot give a module and its inputs; the message is one line."""


@dataclass(frozen=True)
class ModelSpec:
    module: str
    attr: str

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"

    def load(self) -> tuple[Any, tuple]:
        """`(module, example_inputs)` from the factory (:func:`load`)."""
        return load(self)


def _dotted_names(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def parse(text: str) -> ModelSpec:
    """The spec's form: a dotted module name, `:`, a dotted attribute name (no file paths)."""
    module, sep, attr = text.rpartition(":") if text.count(":") == 1 else ("", "", "")
    if not sep or not module or not attr:
        raise ModelSpecError(f"{text}: expected {FORM}")
    if "/" in module or os.sep in module or module.endswith(".py"):
        name = os.path.splitext(os.path.basename(module))[0]
        raise ModelSpecError(
            f"{text}: expected a module name, not a file path: run from the file's directory "
            f"with --model {name}:{attr} (the current directory is searched first, as by python -m)"
        )
    if not _dotted_names(module):
        raise ModelSpecError(f"{text}: {module!r} is not a module name (expected {FORM})")
    if not _dotted_names(attr):
        raise ModelSpecError(f"{text}: {attr!r} is not an attribute name (expected {FORM})")
    return ModelSpec(module, attr)


def _cwd_on_path():
    """The current directory first on `sys.path`, as `python -m` puts it."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def check_findable(spec: ModelSpec):
    """The spec's top-level package exists (found without importing it: no torch, no user code run)."""
    _cwd_on_path()
    top = spec.module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise ModelSpecError(f"{spec}: no module named {top!r} in the current directory ({os.getcwd()}) or on sys.path")


def load(spec: ModelSpec) -> tuple[Any, tuple]:
    """`(module, example_inputs)` from the factory: it takes no arguments and returns `(module, (x, ...))`
    or `(module, x)`. Errors raised by the user's own code (inside the module or the factory) propagate."""
    _cwd_on_path()
    try:
        obj: Any = importlib.import_module(spec.module)
    except ModuleNotFoundError as e:
        if e.name is None or not (spec.module == e.name or spec.module.startswith(e.name + ".")):
            raise  # an import inside the user's module failed: their traceback says where
        raise ModelSpecError(f"{spec}: no module named {e.name!r}") from None
    for part in spec.attr.split("."):
        if not hasattr(obj, part):
            raise ModelSpecError(f"{spec}: {getattr(obj, '__name__', obj)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelSpecError(f"{spec}: is {_a(type(obj).__name__)}, expected a factory function returning {RETURNS}")
    try:
        inspect.signature(obj).bind()
    except TypeError:
        raise ModelSpecError(
            f"{spec}: the factory takes arguments {inspect.signature(obj)}; expected one called with none, "
            f"returning {RETURNS}"
        ) from None
    except ValueError:  # no signature to read (a builtin): calling it says
        pass
    made = obj()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise ModelSpecError(f"{spec}: the factory returned {_describe(made)}, expected {RETURNS}")
    model, inputs = made
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _a(noun: str) -> str:
    """`noun` with its indefinite article ("an int", "a tuple")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return _a(type(value).__name__)
