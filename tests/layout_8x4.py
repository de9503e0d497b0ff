"""The 8x4-swizzled MXFP8 scale layout of FlashInfer/TensorRT-LLM, in plain PyTorch.

`torch.ops.vllm.flashinfer_mxfp8_quantize_8x4(a: [M, K] bf16) -> (codes [M, K] e4m3, scales)`
(vLLM 0.33, `vllm/utils/flashinfer.py`, used by `FlashInferTrtllmMxfp8LinearKernel`) returns its
E8M0 scales as ONE flat uint8 tensor of `pad(M, 8) * pad(K/32, 4)` bytes: the row-major
`[M, K/32]` scales, zero-padded to a multiple of 8 rows and 4 scale columns, cut into 8x4 tiles
stored tile-row by tile-row, each tile row-major (32 bytes). The byte of scale `(m, c)` lies at

    (m // 8) * (pad(K/32, 4) * 32) + (c // 4) * 32 + (m % 8) * 4 + (c % 4)

(TensorRT-LLM's `get_sf_out_offset_8x4` in FlashInfer's
`csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh`, and
`compute_sf_index_swizzled_8x4_gpu` in `flashinfer/quantization/quantization_cute_dsl_utils.py`).
The kernel writes 0x00 into every padding byte. Unlike the 128x4 layout, tiles of 8 rows can be
concatenated by rows when M is a multiple of 8.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROW_TILE = 8
COL_TILE = 4
BLOCK = 32


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def scales_8x4_numel(m: int, k: int) -> int:
    """Bytes of 8x4 scales for `m` rows of `k` values (what vLLM's fake impl allocates)."""
    if k % BLOCK:
        raise ValueError(f"8x4 MXFP8 scales: K={k} is not a multiple of {BLOCK}")
    return _pad(m, ROW_TILE) * _pad(k // BLOCK, COL_TILE)


def swizzle_scales_8x4(scales: Tensor) -> Tensor:
    """Row-major `[M, K/32]` uint8 scales -> the flat 8x4-swizzled buffer (padding bytes 0)."""
    if scales.dim() != 2 or scales.dtype != torch.uint8:
        raise ValueError(
            f"swizzle_scales_8x4: expected 2-D uint8 scales [M, K/32], got {tuple(scales.shape)} {scales.dtype}"
        )
    m, cols = scales.shape
    rows_p, cols_p = _pad(m, ROW_TILE), _pad(cols, COL_TILE)
    padded = scales.new_zeros(rows_p, cols_p)
    padded[:m, :cols] = scales
    tiles = padded.view(rows_p // ROW_TILE, ROW_TILE, cols_p // COL_TILE, COL_TILE)
    return tiles.permute(0, 2, 1, 3).reshape(-1)


def unswizzle_scales_8x4(flat: Tensor, m: int, k: int) -> Tensor:
    """The flat 8x4-swizzled buffer of `m` rows of `k` values -> row-major `[m, k/32]` scales."""
    numel = scales_8x4_numel(m, k)
    if flat.dim() != 1 or flat.dtype != torch.uint8 or flat.numel() != numel:
        raise ValueError(
            f"unswizzle_scales_8x4: expected flat uint8 of {numel} bytes for M={m}, K={k}, "
            f"got {tuple(flat.shape)} {flat.dtype}"
        )
    rows_p, cols_p = _pad(m, ROW_TILE), _pad(k // BLOCK, COL_TILE)
    tiles = flat.view(rows_p // ROW_TILE, cols_p // COL_TILE, ROW_TILE, COL_TILE)
    return tiles.permute(0, 2, 1, 3).reshape(rows_p, cols_p)[:m, : k // BLOCK].contiguous()
