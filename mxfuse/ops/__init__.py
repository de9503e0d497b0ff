"""MXFP8 and RMSNorm (Gemma and standard) operators (`torch.ops.mxfuse.*`), their references and kernels.

Importing this package registers the ops of :data:`OPS` with torch.library (the only
global state mxfuse keeps) and exports each under its name (`mxfuse.ops.mxfp8_quantize`,
...). Triton kernels load on the first CUDA call, never at import.
"""

from mxfuse.ops import activations, gated, library, linear, packed, sp_rows
from mxfuse.ops.errors import MxfuseInputError
from mxfuse.ops.mx_layout import BLOCK
from mxfuse.ops.reference import dequantize
from mxfuse.ops.registry import OpSpec, register

OPS: tuple[OpSpec, ...] = (*library.OPS, *linear.OPS, *packed.OPS, *sp_rows.OPS, *gated.OPS, *activations.OPS)
"""Every `mxfuse::` op, the one table: each op's registration, export and autograd formula come
from its entry (:mod:`mxfuse.ops.registry`). A module of new ops adds its `OPS` here."""

_registered = register(OPS)
globals().update(_registered)

__all__ = ["BLOCK", "OPS", "MxfuseInputError", "dequantize", *sorted(_registered)]
