"""The layers the reference models are built of, on the UNFUSED mxfuse ops.

- :class:`MXFP8Linear`: quantizes its input with ``torch.ops.mxfuse.mxfp8_quantize`` and
  multiplies with ``torch.ops.mxfuse.mxfp8_linear`` (weights quantized once, at construction);
- :class:`GemmaNorm`: ``torch.ops.mxfuse.gemma_rmsnorm`` / ``gemma_fused_add_rmsnorm``;
- :func:`swiglu_oai`: the gpt-oss / MiniMax-M3 clamped SwiGLU, by default one opaque op
  (`mxfuse_models::swiglu_oai`, standing in for vLLM's activation kernel), or plain PyTorch.

So a compiled model holds exactly the norm -> quant -> GEMM chains the mxfuse passes
rewrite. Random weights come from :func:`random_weight`: drawn on the CPU from a seeded
``torch.Generator``, so every device and every process builds the same layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

import mxfuse.ops  # noqa: F401  (registers torch.ops.mxfuse.*)
from mxfuse.ops.mx_layout import BLOCK, FP8_DTYPE, SCALE_DTYPE

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def random_weight(
    gen: torch.Generator, shape: Sequence[int], std: float, dtype: torch.dtype, device: torch.device | str | None
) -> Tensor:
    """Deterministic normal weights: drawn on CPU from `gen`, then cast and moved."""
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std).to(dtype=dtype, device=device)


class MXFP8Linear(nn.Module):
    """`y = x @ W.T` with W and x in MXFP8 (row-major E8M0 scales), output in x's dtype.

    The bf16 random weight is quantized once at construction with
    ``torch.ops.mxfuse.mxfp8_quantize``; only the codes and scales are kept.
    """

    in_features: int
    out_features: int
    weight_codes: Tensor
    """`[out, in]` float8_e4m3fn (a buffer)."""
    weight_scales: Tensor
    """`[out, in/32]` uint8 row-major E8M0 scales (a buffer)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        gen: torch.Generator,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        weight = random_weight(gen, (out_features, in_features), 1.0 / math.sqrt(in_features), dtype, device)
        self.set_weight(*torch.ops.mxfuse.mxfp8_quantize(self._checked(weight)))

    @classmethod
    def from_weight(cls, weight: Tensor) -> MXFP8Linear:
        """An MXFP8 linear of an existing `[out, in]` weight (e.g. a Hugging Face `nn.Linear`'s)."""
        return cls.from_quantized(*torch.ops.mxfuse.mxfp8_quantize(cls._checked(weight.detach())))

    @classmethod
    def from_quantized(cls, codes: Tensor, scales: Tensor) -> MXFP8Linear:
        """An MXFP8 linear of already-quantized weight codes `[out, in]` and row-major scales (kept as given)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.set_weight(codes, scales)
        return layer

    @staticmethod
    def _checked(weight: Tensor) -> Tensor:
        if weight.shape[1] % BLOCK:
            raise ValueError(f"MXFP8Linear: in_features {weight.shape[1]} is not a multiple of {BLOCK}")
        return weight

    def set_weight(self, codes: Tensor, scales: Tensor) -> None:
        """Register the weight's codes and scales as the buffers `weight_codes`, `weight_scales`."""
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_scales", scales)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MXFP8Linear:
        """`.to(dtype)`, `.half()`, `.float()` cast every floating-point buffer, the fp8 weight codes
        too; the codes go through `fn` as their uint8 bytes, so a device move applies and a cast does not."""
        self.weight_codes = self.weight_codes.view(SCALE_DTYPE)
        try:
            return super()._apply(fn, recurse)
        finally:
            self.weight_codes = self.weight_codes.view(FP8_DTYPE)

    def forward(self, x: Tensor) -> Tensor:
        codes, scales = torch.ops.mxfuse.mxfp8_quantize(x)
        return self.forward_quantized(codes, scales, x.dtype)

    def forward_quantized(self, codes: Tensor, scales: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The GEMM on an already-quantized input (row-major scales `[..., K/32]`)."""
        return torch.ops.mxfuse.mxfp8_linear(codes, scales, self.weight_codes, self.weight_scales, out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp8"


class GemmaNorm(nn.Module):
    """Gemma RMSNorm (`normalize(x) * (1 + w)`); with a residual, the fused add+norm."""

    def __init__(
        self,
        hidden: int,
        eps: float,
        gen: torch.Generator,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(random_weight(gen, (hidden,), 0.1, dtype, device), requires_grad=False)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return torch.ops.mxfuse.gemma_rmsnorm(x, self.w, self.eps)
        return torch.ops.mxfuse.gemma_fused_add_rmsnorm(x, residual, self.w, self.eps)


def swiglu_oai_native(gate_up: Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> Tensor:
    """gpt-oss / MiniMax-M3 clamped SwiGLU on chunked halves `[gate | up]`, in plain PyTorch.

    `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    `out = (up + 1) * gate * sigmoid(alpha * gate)`; computed in fp32 and rounded once
    to the input dtype, so Inductor's fp32 codegen matches eager bitwise on CPU. On
    CUDA, Triton's `exp` differs from ATen's in the last bit, so compiled may differ there.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1.0) * (gate * torch.sigmoid(gate * alpha))).to(gate_up.dtype)


def _swiglu_oai_opaque(gate_up: Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> Tensor:
    """:func:`swiglu_oai_native` as one opaque node (like vLLM's own activation kernel).

    Not part of the mxfuse op contract; it exists so the reference model's compiled
    output equals its eager output bitwise on every device.
    """
    return swiglu_oai_native(gate_up, alpha, limit)


def _swiglu_oai_fake(gate_up: Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@functools.cache
def register_activation() -> None:
    """Register `mxfuse_models::swiglu_oai` once: when the first layer that uses it is built (or on
    its first eager call), never when this module is imported (the model's op is not mxfuse's)."""
    op = torch.library.custom_op("mxfuse_models::swiglu_oai", _swiglu_oai_opaque, mutates_args=())
    op.register_fake(_swiglu_oai_fake)


def swiglu_oai(gate_up: Tensor, native: bool = False) -> Tensor:
    """The model's activation: the opaque op by default, plain PyTorch with `native=True`."""
    if native:
        return swiglu_oai_native(gate_up)
    if not torch.compiler.is_compiling():  # a compiled layer registered it when it was built
        register_activation()
    return torch.ops.mxfuse_models.swiglu_oai(gate_up)
