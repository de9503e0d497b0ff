"""The MXFP8 GEMM's launcher on CPU (mxfuse/ops/triton_gemm.py): what it launches, and that it compiles for sm_90.

CI has no GPU, so the kernel's results are checked in tests/test_gpu_gemm.py only; here the
three Triton kernels are replaced by recorders (stubbed: they cannot run on CPU) to check
the launch plan each regime gets from `gemm_config`, and the decode kernel is compiled for
sm_90 with Triton's own compiler (no GPU needed) from the arguments the launcher passed.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from mxfuse.ops import reference, triton_gemm  # noqa: E402  (after the skip: Triton is optional)

KERNELS = ("_mx_gemm_swap_kernel", "_chunk_sum_kernel", "_dequant_rows_kernel")
GEMM_KERNEL = triton_gemm._mx_gemm_swap_kernel  # the real one, for the sm_90 compile


class Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **constexprs)` is recorded."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, tuple(grid), args, kwargs))


@pytest.fixture
def launches(monkeypatch):
    recorded: list = []
    for name in KERNELS:
        monkeypatch.setattr(triton_gemm, name, Recorder(name, recorded))
    return recorded


def _operands(m: int, n: int, k: int):
    g = torch.Generator().manual_seed(m + n + k)
    codes, scales = reference.quantize_rows(torch.randn(m, k, generator=g))
    weight_codes, weight_scales = reference.quantize_rows(torch.randn(n, k, generator=g))
    return codes, scales, weight_codes, weight_scales


def test_decode_splits_over_fixed_k_chunks(launches):
    out = triton_gemm.mxfp8_linear(*_operands(3, 256, 1600), torch.bfloat16)
    assert out.shape == (3, 256) and out.dtype == torch.bfloat16
    assert [name for name, *_ in launches] == ["_dequant_rows_kernel", "_mx_gemm_swap_kernel", "_chunk_sum_kernel"]
    _, grid, args, kw = launches[1]
    n_chunks = 3  # K 1600 zero-padded to whole scale words, 1664 = 768 + 768 + 128: chunks depend on K only
    assert grid == (256 // 64 * 1, n_chunks)
    assert kw["SPLIT"] and kw["X_BF16"] and not kw["W_BF16"] and (kw["BN"], kw["BM"], kw["CHUNK"]) == (64, 16, 768)
    assert args[2].dtype == torch.bfloat16 and args[2].shape == (3, 1664)  # activations dequantized up front
    assert args[4].shape == (n_chunks, 3, 256) and args[4].dtype == torch.float32  # the fp32 workspace
    assert launches[2][3]["N_CHUNKS"] == n_chunks and launches[2][2][1] is out


@pytest.mark.parametrize("m,tile", [(65, (64, 128, 4)), (4096, (128, 128, 8))])
def test_larger_m_dequantizes_both_operands_once(launches, m, tile):
    triton_gemm.mxfp8_linear(*_operands(m, 384, 256), torch.float32)
    assert [name for name, *_ in launches] == ["_dequant_rows_kernel"] * 2 + ["_mx_gemm_swap_kernel"]
    _, grid, _, kw = launches[2]
    assert (kw["BN"], kw["BM"], kw["num_warps"]) == tile and kw["FLAT"] and kw["X_BF16"] and kw["W_BF16"]
    assert not kw["SPLIT"] and kw["CHUNK"] == 768 and grid == (triton.cdiv(384, tile[0]) * triton.cdiv(m, tile[1]),)


def test_explicit_config_is_used_and_block_k_fits_k(launches):
    config = triton_gemm.GemmConfig(128, 32, block_k=256, group=2, num_warps=8, num_stages=2)
    triton_gemm.mxfp8_linear(*_operands(70, 128, 384), torch.bfloat16, config=config)
    (name, grid, _, kw), *rest = launches
    assert name == "_mx_gemm_swap_kernel" and not rest  # nothing dequantized up front
    assert (kw["BN"], kw["BM"], kw["BK"], kw["GROUP_N"], kw["num_warps"], kw["num_stages"]) == (128, 32, 128, 2, 8, 2)
    assert grid == (1 * 3,)


def test_empty_problems_launch_nothing(launches):
    assert triton_gemm.mxfp8_linear(*_operands(0, 64, 128), torch.bfloat16).shape == (0, 64)
    codes, scales = torch.empty(2, 0, dtype=torch.float8_e4m3fn), torch.empty(2, 0, dtype=torch.uint8)
    assert torch.equal(triton_gemm.mxfp8_linear(codes, scales, codes, scales, torch.float32), torch.zeros(2, 2))
    assert launches == []


def test_decode_kernel_compiles_for_sm90(launches):
    """The default decode launch, compiled from the exact arguments the launcher passed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton_gemm.mxfp8_linear(*_operands(1, 256, 1536), torch.bfloat16)
    _, _, args, kw = next(launch for launch in launches if launch[0] == "_mx_gemm_swap_kernel")
    kernel = GEMM_KERNEL
    pointer = {torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kw  # positional args, then the constexprs
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = pointer[value.dtype] if isinstance(value, torch.Tensor) else "i32"
    options = {"num_warps": kw["num_warps"], "num_stages": kw["num_stages"]}
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options
    )
    assert "wgmma" in compiled.asm["ptx"]  # Hopper's async MMA, not an mma.sync fallback


@pytest.mark.parametrize("m,isa,pdl", [(3, "ptx", True), (64, "ptx", True), (65, "ptx", False), (3, "portable", False)])
def test_programmatic_dependent_launch_at_decode_on_nvidia_only(launches, m, isa, pdl):
    """NVIDIA decode (M <= 64): every kernel of the GEMM is launched with `launch_pdl` and compiled with
    its `gdc_wait` (the PDL constexpr); above (the weight-dequant regime, where PDL lost) and off NVIDIA:
    none (Triton's AMD backend has no equivalent)."""
    triton_gemm.mxfp8_linear(*_operands(m, 256, 1024), torch.bfloat16, isa=isa)
    assert launches
    for name, _, _, kw in launches:
        assert kw["PDL"] is pdl and kw.get("launch_pdl", False) is pdl, (name, m, isa)
