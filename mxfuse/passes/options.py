"""The options of the mxfuse passes: one frozen dataclass, validated, hashable into the cache key."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Literal

SP_GATHER_MODES = ("auto", "bf16", "mxfp8")
OPTIONS_ENV = "MXFUSE_OPTIONS"
DUMP_DIR_ENV = "MXFUSE_DUMP_DIR"


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
    dump_dir: write each graph before and after the passes there
        (default: the MXFUSE_DUMP_DIR environment variable, else no dump).
    """

    fuse_norm_quant: bool = True
    sp_gather: Literal["auto", "bf16", "mxfp8"] = "auto"
    sequence_parallel: bool = False
    dump_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.fuse_norm_quant, bool):
            raise TypeError(f"mxfuse option fuse_norm_quant must be a bool, got {self.fuse_norm_quant!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"mxfuse option sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.sp_gather not in SP_GATHER_MODES:
            raise ValueError(f"mxfuse option sp_gather must be one of {SP_GATHER_MODES}, got {self.sp_gather!r}")
        if self.dump_dir is None and os.environ.get(DUMP_DIR_ENV):
            object.__setattr__(self, "dump_dir", os.environ[DUMP_DIR_ENV])

    @classmethod
    def from_kwargs(cls, **kwargs) -> PassOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown mxfuse option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @classmethod
    def from_env(cls) -> PassOptions:
        """Options from the MXFUSE_OPTIONS environment variable (JSON), for vLLM users."""
        raw = os.environ.get(OPTIONS_ENV, "").strip()
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{OPTIONS_ENV} is not valid JSON ({e}): {raw!r}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{OPTIONS_ENV} must be a JSON object, got {raw!r}")
        return cls.from_kwargs(**values)

    def cache_key(self) -> str:
        """The options that change the compiled graph (dump_dir does not)."""
        keys = {"fuse_norm_quant": self.fuse_norm_quant, "sp_gather": self.sp_gather}
        if self.sequence_parallel:  # only when on: default-option keys (and caches) stay as they were
            keys["sequence_parallel"] = True
        return json.dumps(keys, sort_keys=True)
