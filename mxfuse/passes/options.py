"""The options of the mxfuse passes: one frozen dataclass of plain data, validated, hashable into the cache key.

`PassOptions(...)` never reads the environment; :meth:`PassOptions.from_env` is the one
place that does, for both entry points (`mxfuse.post_grad_pass()` and the vLLM pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal

SP_GATHER_MODES = ("auto", "bf16", "mxfp8")
OPTIONS_ENV = "MXFUSE_OPTIONS"
DUMP_DIR_ENV = "MXFUSE_DUMP_DIR"
STRICT_ENV = "MXFUSE_STRICT"

# metadata of the fields that do not change the rewritten graph (left out of the cache key)
_NOT_IN_CACHE_KEY = {"cache_key": False}


class MxfuseOptionError(ValueError, TypeError):
    """A bad mxfuse option: an unknown name, a value of the wrong type, a value out of range.

    A `ValueError` so that the frameworks which build the pass while validating their own config
    show its message: pydantic (vLLM's `CompilationConfig`, parsed by `vllm serve
    --compilation-config`) turns a `ValueError` into its validation error and lets a `TypeError`
    through, which argparse then replaces with its generic "invalid ... value" line. Also a
    `TypeError`, as Python raises for an unknown keyword argument.
    """


@dataclass(frozen=True)
class PassOptions:
    """What the passes do.

    fuse_norm_quant: rewrite 1 (norm -> quant into one fused op).
    sp_gather: rewrite 2, where quantization goes around a sequence-parallel all-gather:
        "bf16" gathers bf16 and quantizes after; "mxfp8" quantizes the local rows
        (fused) and gathers one packed byte buffer; "auto" picks "mxfp8" when exact.
    sequence_parallel: rewrite tensor-parallel all-reduce -> Gemma norm chains into
        reduce-scatter -> norm on the local rows -> all-gather (off by default: it changes
        the order of the sum; see docs/sp_notes.md).
    dump_dir: write each graph before and after the passes there (None: no dump).
    strict: raise an exception from inside the pass instead of rolling back and logging
        it (for tests and debugging: a bug cannot hide behind the rollback).
    fresh: give each pass object its own cache key, so Inductor's (and vLLM's) compile
        cache cannot serve a graph compiled earlier: the pass runs again and writes its
        report and dumps (a cached graph was fused before, but has no new report).
    """

    fuse_norm_quant: bool = True
    sp_gather: Literal["auto", "bf16", "mxfp8"] = "auto"
    sequence_parallel: bool = False
    dump_dir: str | None = field(default=None, metadata=_NOT_IN_CACHE_KEY)
    strict: bool = field(default=False, metadata=_NOT_IN_CACHE_KEY)
    fresh: bool = field(default=False, metadata=_NOT_IN_CACHE_KEY)

    def __post_init__(self):
        if isinstance(self.dump_dir, os.PathLike):
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
        for name in ("fuse_norm_quant", "sequence_parallel", "strict", "fresh"):
            if not isinstance(getattr(self, name), bool):
                raise MxfuseOptionError(f"mxfuse option {name} must be a bool, got {getattr(self, name)!r}")
        if self.sp_gather not in SP_GATHER_MODES:
            raise MxfuseOptionError(f"mxfuse option sp_gather must be one of {SP_GATHER_MODES}, got {self.sp_gather!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            raise MxfuseOptionError(f"mxfuse option dump_dir must be a str or None, got {self.dump_dir!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> PassOptions:
        """Options from names and values (unknown names raise, listing the known ones and the closest)."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            close = [m for name in unknown for m in difflib.get_close_matches(name, known, n=1)]
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise MxfuseOptionError(
                f"unknown mxfuse option(s) {', '.join(map(repr, unknown))}{hint}; known: {', '.join(known)}"
            )
        return cls(**kwargs)

    @classmethod
    def from_env(cls, **overrides: Any) -> PassOptions:
        """Options from the environment, `overrides` winning over it.

        One rule, lowest to highest: the defaults; `MXFUSE_DUMP_DIR` (dump_dir) and
        `MXFUSE_STRICT=1` (strict); `MXFUSE_OPTIONS` (a JSON object of any options);
        the keyword arguments (`dump_dir=None` turns a dump set in the environment off).
        A bad value taken from the environment raises naming its variable.
        """
        values: dict[str, Any] = {}
        for variable, given in _env_options().items():
            kept = {k: v for k, v in given.items() if k not in overrides}
            with _naming(variable):
                cls.from_kwargs(**kept)  # checked on its own, so that its error names it
            values.update(kept)
        values.update(overrides)
        return cls.from_kwargs(**values)

    @classmethod
    def for_pass(cls, **overrides: Any) -> PassOptions:
        """`from_env(**overrides)` with the dump directory probed (:meth:`check_dump_dir`), for the two entry
        points: a bad value, and a dump directory that cannot hold dumps, fail when the pass is built,
        naming the environment variable they came from."""
        options = cls.from_env(**overrides)
        source = next((v for v, given in _env_options().items() if "dump_dir" in given), None)
        with _naming(source if "dump_dir" not in overrides else None):
            options.check_dump_dir()
        return options

    def check_dump_dir(self) -> None:
        """Create `dump_dir` and write a probe file in it, so a path that cannot hold dumps (a
        file, `/proc/x`, a read-only place) fails when the pass is built, not mid-compile."""
        if self.dump_dir is None:
            return
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.dump_dir):
                pass
        except OSError as e:
            raise MxfuseOptionError(
                f"mxfuse option dump_dir={self.dump_dir!r} is not a writable directory ({e.strerror or e})"
            ) from None

    def cache_key(self) -> str:
        """The options that change the compiled graph (all fields but dump_dir, strict and fresh)."""
        keyed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("cache_key", True)}
        return json.dumps(keyed, sort_keys=True)


def _env_options() -> dict[str, dict[str, Any]]:
    """`{variable: {option: value}}` of the variables that are set, lowest precedence first."""
    found: dict[str, dict[str, Any]] = {}
    for variable, parse in ((DUMP_DIR_ENV, _dump_dir), (STRICT_ENV, _strict), (OPTIONS_ENV, _json_options)):
        raw = os.environ.get(variable, "").strip()
        if raw:
            with _naming(variable):
                found[variable] = parse(raw)
    return found


def _dump_dir(raw: str) -> dict[str, Any]:
    return {"dump_dir": raw}


def _strict(raw: str) -> dict[str, Any]:
    if raw not in ("0", "1"):
        raise MxfuseOptionError("must be 0 or 1")
    return {"strict": raw == "1"}


def _json_options(raw: str) -> dict[str, Any]:
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise MxfuseOptionError(f"not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise MxfuseOptionError("must be a JSON object of mxfuse options")
    return values


@contextlib.contextmanager
def _naming(variable: str | None):
    """Re-raise an option error with the environment variable it came from in front (one line)."""
    try:
        yield
    except MxfuseOptionError as e:
        if variable is None:
            raise
        raise MxfuseOptionError(f"{variable}={os.environ[variable]!r}: {e}") from None
