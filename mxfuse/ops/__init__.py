"""MXFP8 and RMSNorm (Gemma and standard) operators (`torch.ops.mxfuse.*`), their references and kernels.

Importing this package registers the ops with torch.library (the only global state
mxfuse keeps). Triton kernels load on the first CUDA call, never at import.
"""

from mxfuse.ops import autograd, sp_rows  # noqa: F401  (sp_rows: mxfuse::sp_local_rows, for cached graphs)
from mxfuse.ops.act_mul import act_mul, act_mul_mxfp8, act_mul_pair, act_mul_pair_mxfp8
from mxfuse.ops.library import (
    MxfuseInputError,
    fused_add_rms_norm,
    fused_add_rms_norm_mxfp8,
    gemma_fused_add_rmsnorm,
    gemma_fused_add_rmsnorm_mxfp8,
    gemma_rmsnorm,
    gemma_rmsnorm_mxfp8,
    mxfp8_linear,
    mxfp8_quantize,
    mxfp8_swizzle_scales,
    rms_norm,
    rms_norm_mxfp8,
)
from mxfuse.ops.mx_layout import BLOCK
from mxfuse.ops.packed import (
    gemma_fused_add_rmsnorm_mxfp8_packed,
    gemma_rmsnorm_mxfp8_packed,
    mxfp8_quantize_packed,
)
from mxfuse.ops.reference import dequantize

autograd.register()

__all__ = [
    "BLOCK",
    "MxfuseInputError",
    "act_mul",
    "act_mul_mxfp8",
    "act_mul_pair",
    "act_mul_pair_mxfp8",
    "dequantize",
    "fused_add_rms_norm",
    "fused_add_rms_norm_mxfp8",
    "gemma_fused_add_rmsnorm",
    "gemma_fused_add_rmsnorm_mxfp8",
    "gemma_fused_add_rmsnorm_mxfp8_packed",
    "gemma_rmsnorm",
    "gemma_rmsnorm_mxfp8",
    "gemma_rmsnorm_mxfp8_packed",
    "mxfp8_linear",
    "mxfp8_quantize",
    "mxfp8_quantize_packed",
    "mxfp8_swizzle_scales",
    "rms_norm",
    "rms_norm_mxfp8",
]
