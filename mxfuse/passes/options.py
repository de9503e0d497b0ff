"""The options of the mxfuse passes: one frozen dataclass of plain data, validated, hashable into the cache key.

`PassOptions(...)` never reads the environment; :meth:`PassOptions.from_env` is the one
place that does, for both entry points (`mxfuse.post_grad_pass()` and the vLLM pass).
"""

from __future__ import annotations

import dataclasses
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
                raise TypeError(f"mxfuse option {name} must be a bool, got {getattr(self, name)!r}")
        if self.sp_gather not in SP_GATHER_MODES:
            raise ValueError(f"mxfuse option sp_gather must be one of {SP_GATHER_MODES}, got {self.sp_gather!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            raise TypeError(f"mxfuse option dump_dir must be a str or None, got {self.dump_dir!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> PassOptions:
        """Options from names and values (unknown names raise, listing the known ones)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown mxfuse option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @classmethod
    def from_env(cls, **overrides: Any) -> PassOptions:
        """Options from the environment, `overrides` winning over it.

        One rule, lowest to highest: the defaults; `MXFUSE_DUMP_DIR` (dump_dir) and
        `MXFUSE_STRICT=1` (strict); `MXFUSE_OPTIONS` (a JSON object of any options);
        the keyword arguments (`dump_dir=None` turns a dump set in the environment off).
        """
        values: dict[str, Any] = {}
        if os.environ.get(DUMP_DIR_ENV):
            values["dump_dir"] = os.environ[DUMP_DIR_ENV]
        strict = os.environ.get(STRICT_ENV, "").strip()
        if strict:
            if strict not in ("0", "1"):
                raise ValueError(f"{STRICT_ENV} must be 0 or 1, got {strict!r}")
            values["strict"] = strict == "1"
        values.update(_json_options())
        values.update(overrides)
        return cls.from_kwargs(**values)

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
            raise ValueError(
                f"mxfuse option dump_dir={self.dump_dir!r} is not a writable directory ({e.strerror or e})"
            ) from None

    def cache_key(self) -> str:
        """The options that change the compiled graph (all fields but dump_dir, strict and fresh)."""
        keyed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("cache_key", True)}
        return json.dumps(keyed, sort_keys=True)


def _json_options() -> dict[str, Any]:
    raw = os.environ.get(OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{OPTIONS_ENV} is not valid JSON ({e}): {raw!r}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{OPTIONS_ENV} must be a JSON object, got {raw!r}")  # noqa: TRY004 - a bad value
    return values
