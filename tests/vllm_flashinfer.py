"""vLLM's FlashInfer ops (`vllm.mm_mxfp8`, `vllm.flashinfer_mxfp8_quantize_8x4`) on a machine without CUDA.

vLLM 0.33 registers them (with fake impls) only when `has_flashinfer()` says FlashInfer can
build or load its kernels: flashinfer-cubin installed, or nvcc and ninja found
(`vllm/utils/flashinfer.py:76-106, 817`). FlashInfer itself is installed with vLLM; on a CPU
machine without nvcc that probe is false and the ops are missing, though tracing needs only
their schemas and fake impls. `VLLM_HAS_FLASHINFER_CUBIN=1` (vLLM's own override of that probe)
and a reload of the module register them; they are traced, never run.
"""

from __future__ import annotations

import importlib
import os

import torch


def register_vllm_flashinfer_ops() -> bool:
    """True when `torch.ops.vllm.mm_mxfp8` exists afterwards."""
    import vllm.utils.flashinfer as vllm_flashinfer

    if not hasattr(torch.ops.vllm, "mm_mxfp8"):
        previous = os.environ.get("VLLM_HAS_FLASHINFER_CUBIN")
        os.environ["VLLM_HAS_FLASHINFER_CUBIN"] = "1"
        try:
            importlib.reload(vllm_flashinfer)
        finally:
            if previous is None:
                del os.environ["VLLM_HAS_FLASHINFER_CUBIN"]
            else:
                os.environ["VLLM_HAS_FLASHINFER_CUBIN"] = previous
    return hasattr(torch.ops.vllm, "mm_mxfp8")
