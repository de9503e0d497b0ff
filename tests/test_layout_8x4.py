"""The 8x4 scale layout of `vllm.flashinfer_mxfp8_quantize_8x4` (tests/layout_8x4.py).

No CPU implementation of that layout exists to compare with: vLLM registers the op for CUDA
only, and FlashInfer's host path raises "layout_8x4 is not supported for mxfp8 quantization on
CPU". So the reference is checked byte by byte against a scalar transcription of TensorRT-LLM's
`get_sf_out_offset_8x4` (FlashInfer csrc), and its size against vLLM's own fake impl.
"""

from __future__ import annotations

import pytest
import torch
from layout_8x4 import scales_8x4_numel, swizzle_scales_8x4, unswizzle_scales_8x4

SHAPES = [(1, 32), (2, 128), (7, 96), (8, 128), (9, 160), (16, 6144), (33, 3072)]


def trtllm_offset(m_idx: int, k_idx: int, num_rows: int, num_cols: int) -> int:
    """`get_sf_out_offset_8x4(batchIdx=0, mIdx, kIdx, numRows, numCols)`, line for line."""
    m_tile = 8
    inner_k_idx, inner_k_stride = k_idx % 4, 1
    inner_m_idx, m_stride = m_idx % m_tile, 4 * inner_k_stride
    k_tile_idx, k_tile_stride = k_idx // 4, m_tile * m_stride
    num_k_tiles = (num_cols + 4 - 1) // 4
    m_tile_idx, m_tile_stride = m_idx // m_tile, num_k_tiles * k_tile_stride
    return (
        m_tile_idx * m_tile_stride + k_tile_idx * k_tile_stride + inner_m_idx * m_stride + inner_k_idx * inner_k_stride
    )


def distinct_scales(m: int, k: int) -> torch.Tensor:
    """Non-zero bytes, so a byte landing in padding (or padding left non-zero) shows."""
    return (torch.arange(m * (k // 32)) % 254 + 1).to(torch.uint8).view(m, k // 32)


@pytest.mark.parametrize("m,k", SHAPES)
def test_every_scale_lands_where_trtllm_writes_it_and_padding_is_zero(m, k):
    scales = distinct_scales(m, k)
    flat = swizzle_scales_8x4(scales)
    assert flat.shape == (scales_8x4_numel(m, k),) and flat.dtype == torch.uint8
    expected = torch.zeros_like(flat)
    for row in range(m):
        for col in range(k // 32):
            expected[trtllm_offset(row, col, m, k // 32)] = scales[row, col]
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("m,k", SHAPES)
def test_unswizzle_inverts_swizzle(m, k):
    scales = torch.randint(0, 256, (m, k // 32), dtype=torch.uint8)
    assert torch.equal(unswizzle_scales_8x4(swizzle_scales_8x4(scales), m, k), scales)


def test_rows_concatenate_in_whole_tiles():
    """8-row tiles stack by rows (the 128x4 layout needs 128): a row-wise gather of 8k-row shards stays valid."""
    a, b = distinct_scales(8, 256), torch.randint(0, 256, (16, 8), dtype=torch.uint8)
    assert torch.equal(swizzle_scales_8x4(torch.cat([a, b])), torch.cat([swizzle_scales_8x4(a), swizzle_scales_8x4(b)]))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="swizzle_scales_8x4: expected 2-D uint8"):
        swizzle_scales_8x4(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="unswizzle_scales_8x4: expected flat uint8 of 32 bytes"):
        unswizzle_scales_8x4(torch.zeros(31, dtype=torch.uint8), 1, 32)
    with pytest.raises(ValueError, match="K=48 is not a multiple of 32"):
        scales_8x4_numel(1, 48)


@pytest.mark.vllm
@pytest.mark.parametrize("m,k", SHAPES)
def test_size_and_dtypes_match_vllms_fake_impl(m, k):
    pytest.importorskip("vllm")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from vllm_flashinfer import register_vllm_flashinfer_ops

    if not register_vllm_flashinfer_ops():
        pytest.skip("vLLM did not register its FlashInfer ops (tests/vllm_flashinfer.py)")
    with FakeTensorMode():
        codes, scales = torch.ops.vllm.flashinfer_mxfp8_quantize_8x4(torch.empty(m, k, dtype=torch.bfloat16))
    assert (tuple(codes.shape), codes.dtype) == ((m, k), torch.float8_e4m3fn)
    assert (tuple(scales.shape), scales.dtype) == ((scales_8x4_numel(m, k),), torch.uint8)
