"""`MxfuseInputError`, the one exception for bad input to an mxfuse op or kernel.

No mxfuse imports: every module of `ops/` raises it (the op checks of
:mod:`mxfuse.ops.inputs`, the Triton launchers, the device check of `triton_targets`)
without loading another. `mxfuse.ops` and `mxfuse.ops.library` re-export it.
"""

from __future__ import annotations

from typing import NoReturn

from torch import Tensor


class MxfuseInputError(ValueError):
    """Bad input to an mxfuse op; the message names the op, the shapes and dtypes."""


def fail(op: str, message: str) -> NoReturn:
    """Raise :class:`MxfuseInputError` as `mxfuse::<op>: <message>`."""
    raise MxfuseInputError(f"mxfuse::{op}: {message}")


def describe(t: Tensor) -> str:
    """`(M, K) bfloat16 on cpu`: a tensor as the messages name it."""
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device.type}"
