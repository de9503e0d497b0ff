"""A reference MiniMax-M3-style decoder stack built from the UNFUSED mxfuse ops.

This is the model the tests, the ``mxfuse demo`` command and the benchmarks compile.
Every norm is ``torch.ops.mxfuse.gemma_rmsnorm`` / ``gemma_fused_add_rmsnorm`` and
every linear quantizes its input with ``torch.ops.mxfuse.mxfp8_quantize`` before
``torch.ops.mxfuse.mxfp8_linear`` (the layers of :mod:`mxfuse.layers`, re-exported here),
so the compiled graph holds exactly the norm -> quant -> GEMM chains that the mxfuse
passes rewrite.

Shape of one layer (rows = tokens, one causal sequence, like vLLM's flat batch)::

    x, res = norm(x[, res])            # plain Gemma norm at layer 0, fused-add after
    [all-gather x rows]                # SP only (functional collective, bf16)
    qkv = qkv_proj(quant(x))           # MXFP8
    a = causal GQA attention(qkv)      # F.scaled_dot_product_attention, no RoPE
    h = o_proj(quant(a))[own rows]     # MXFP8; the row slice stands in for reduce-scatter
    x, res = fused_add_norm(h, res)
    [all-gather x rows]                # SP only
    g = gate_up(quant(x))              # MXFP8, chunked halves [gate | up]
    m = swiglu_oai(g)                  # gpt-oss / M3 clamped SwiGLU
    h = down_proj(quant(m))[own rows]  # MXFP8
    ...
    out, _ = fused_add_norm(h, res)    # final norm of the stack

Weights are random, drawn from a CPU ``torch.Generator`` seeded by the config, so
every device and every process builds the same model. The MXFP8 weights are
quantized once at construction (on the model's device; the op contract makes the
CUDA quantizer bitwise equal to the CPU reference).

Eager vs. compiled bitwise: the mxfuse ops are opaque custom ops, SDPA is the same
ATen kernel in both modes, and the activation is by default one opaque op
(`mxfuse_models::swiglu_oai`, standing in for vLLM's activation kernel). With
`ModelConfig(native_activation=True)` it is plain fp32 PyTorch that Inductor fuses:
still bitwise on CPU, but on CUDA Triton's `exp` differs from ATen's in the last bit
(measured on H200: 240 of 16.8M activation outputs differ in their last bits; the
next MXFP8 quantization often, not always, hides it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mxfuse.layers import (
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    GemmaNorm,
    MXFP8Linear,
    random_weight,
    register_activation,
    swiglu_oai,
    swiglu_oai_native,
)
from mxfuse.ops.mx_layout import BLOCK

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CONFIG_NAMES",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "DecoderLayer",
    "GemmaNorm",
    "MXFP8Linear",
    "Model",
    "ModelConfig",
    "causal_gqa_attention",
    "compile_model",
    "example_inputs",
    "local_rows",
    "register_activation",
    "swiglu_oai",
    "swiglu_oai_native",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the reference decoder stack (one tensor-parallel rank's shard for the big config)."""

    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    name: str = "custom"
    native_activation: bool = False
    """False: SwiGLU is one opaque op (`mxfuse_models::swiglu_oai`, like vLLM's activation
    kernel), so compiled == eager bitwise on every device. True: plain PyTorch that
    Inductor fuses (bitwise vs. eager guaranteed on CPU only)."""

    def __post_init__(self) -> None:
        for what, k in (
            ("hidden (qkv_proj / gate_up K)", self.hidden),
            ("n_heads * head_dim (o_proj K)", self.n_heads * self.head_dim),
            ("intermediate (down_proj K)", self.intermediate),
        ):
            if k % BLOCK:
                raise ValueError(f"ModelConfig {self.name}: {what} = {k} is not a multiple of {BLOCK}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig {self.name}: n_heads {self.n_heads} % n_kv_heads {self.n_kv_heads} != 0")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        """N of qkv_proj."""
        return self.q_size + 2 * self.kv_size

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """`{name: (N, K)}` of the four MXFP8 linears of a layer."""
        return {
            "qkv_proj": (self.qkv_size, self.hidden),
            "o_proj": (self.hidden, self.q_size),
            "gate_up_proj": (2 * self.intermediate, self.hidden),
            "down_proj": (self.hidden, self.intermediate),
        }

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """CPU-test size: hidden 256, 2 layers, 4 heads / 2 kv heads of 64, intermediate 512."""
        base = dict(
            vocab=512, hidden=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, intermediate=512, name="tiny"
        )
        return cls(**{**base, **overrides})

    @classmethod
    def m3_flash_tp4(cls, **overrides: Any) -> ModelConfig:
        """One TP=4 rank's shard of a MiniMax-M3.1-Flash-sized decoder (GPU benchmarks).

        Full model: hidden 6144, 64 query heads and 8 kv heads of 128, dense MLP
        intermediate 16384, vocab ~200k. Per TP4 rank (what this config holds):

        - qkv_proj:     N = 16*128 + 2*2*128 = 2560, K = 6144
        - o_proj:       N = 6144,                   K = 16*128 = 2048
        - gate_up_proj: N = 2*4096 = 8192,          K = 6144
        - down_proj:    N = 6144,                   K = 4096
        - vocab shard 50016 (200064 / 4); every K is a multiple of 32 (and of 128).
        The MoE of the real model is replaced by one dense MLP of the same K; the
        norm -> quant -> GEMM chains the passes rewrite are the same.
        """
        base = dict(
            vocab=50016,
            hidden=6144,
            n_layers=2,
            n_heads=16,
            n_kv_heads=2,
            head_dim=128,
            intermediate=4096,
            name="m3-flash-tp4",
        )
        return cls(**{**base, **overrides})

    @classmethod
    def by_name(cls, name: str, **overrides: Any) -> ModelConfig:
        factories = {"tiny": cls.tiny, "m3-flash-tp4": cls.m3_flash_tp4, "m3_flash_tp4": cls.m3_flash_tp4}
        if name not in factories:
            raise ValueError(f"unknown model config {name!r}; known: tiny, m3-flash-tp4")
        return factories[name](**overrides)


CONFIG_NAMES = ("tiny", "m3-flash-tp4")


# ------------------------------------------------------------------ the stack


def causal_gqa_attention(config: ModelConfig, qkv: Tensor) -> Tensor:
    """Causal GQA attention over all rows of `qkv` `[T, q + 2 kv]` -> `[T, q]` (the heads of `config`)."""
    c = config
    t = qkv.shape[0]
    q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
    q = q.view(t, c.n_heads, c.head_dim).transpose(0, 1)
    k = k.view(t, c.n_kv_heads, c.head_dim).transpose(0, 1)
    v = v.view(t, c.n_kv_heads, c.head_dim).transpose(0, 1)
    rep = c.n_heads // c.n_kv_heads
    if rep > 1:
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True)
    return out.squeeze(0).transpose(0, 1).reshape(t, c.q_size)


class DecoderLayer(nn.Module):
    """One layer of the stack (the shape in the module docstring); on this rank's rows under SP."""

    def __init__(self, config: ModelConfig, index: int, gen: torch.Generator, device: torch.device | str | None = None):
        super().__init__()
        c = config
        self.config, self.index = c, index
        dt = c.dtype
        self.input_norm = GemmaNorm(c.hidden, c.eps, gen, dt, device)
        self.qkv_proj = MXFP8Linear(c.hidden, c.qkv_size, gen, dt, device)
        self.o_proj = MXFP8Linear(c.q_size, c.hidden, gen, dt, device)
        self.post_attention_norm = GemmaNorm(c.hidden, c.eps, gen, dt, device)
        self.gate_up_proj = MXFP8Linear(c.hidden, 2 * c.intermediate, gen, dt, device)
        self.down_proj = MXFP8Linear(c.intermediate, c.hidden, gen, dt, device)
        register_activation()

    def attention(self, qkv: Tensor) -> Tensor:
        """Causal GQA attention over all rows of `qkv` (:func:`causal_gqa_attention`)."""
        return causal_gqa_attention(self.config, qkv)

    def forward(self, h: Tensor, residual: Tensor | None, sp: _SP | None = None) -> tuple[Tensor, Tensor]:
        c = self.config
        if residual is None:
            x = self.input_norm(h)
            residual = h
        else:
            x, residual = self.input_norm(h, residual)
        x = _gather(x, sp)
        attn = self.attention(self.qkv_proj(x))
        h = _own_rows(self.o_proj(attn), sp)
        x, residual = self.post_attention_norm(h, residual)
        x = _gather(x, sp)
        h = _own_rows(self.down_proj(swiglu_oai(self.gate_up_proj(x), c.native_activation)), sp)
        return h, residual


@dataclass(frozen=True)
class _SP:
    """Sequence parallelism of the stack: the group, this rank and the world size."""

    group: ProcessGroup
    rank: int
    world: int


def _gather(x: Tensor, sp: _SP | None) -> Tensor:
    """All-gather the local rows (bf16) along dim 0 with a PyTorch functional collective."""
    if sp is None:
        return x
    from torch.distributed import _functional_collectives as fc

    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # the newer name since torch 2.14
    return gather(x, 0, sp.group)


def _own_rows(x: Tensor, sp: _SP | None) -> Tensor:
    """This rank's row slice of a full-`T` output (stands in for the reduce-scatter)."""
    if sp is None:
        return x
    t_local = x.shape[0] // sp.world
    return x[sp.rank * t_local : (sp.rank + 1) * t_local]


class Model(nn.Module):
    """Embedding, `n_layers` decoder layers, final fused-add Gemma norm: ids `[T]` -> hidden `[T, hidden]`.

    With ``sp_group`` (a process group of world size W), each rank holds all weights
    and only its local token ids (`T/W` rows of one sequence, in rank order); its
    output equals the same rows of the non-SP model's output, bit for bit.
    """

    def __init__(
        self, config: ModelConfig, sp_group: ProcessGroup | None = None, device: torch.device | str | None = None
    ):
        super().__init__()
        self.config = config
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        embed = random_weight(gen, (config.vocab, config.hidden), 1.0, config.dtype, device)
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, gen, device) for i in range(config.n_layers))
        self.norm = GemmaNorm(config.hidden, config.eps, gen, config.dtype, device)
        self.sp_group = sp_group
        self._sp: _SP | None = None
        if sp_group is not None:
            import torch.distributed as dist

            self._sp = _SP(sp_group, dist.get_rank(sp_group), dist.get_world_size(sp_group))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, input_ids: Tensor) -> Tensor:
        h = F.embedding(input_ids, self.embed)
        residual: Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, self._sp)
        out, _ = self.norm(h, residual)
        return out


def example_inputs(
    config: ModelConfig, n_tokens: int, device: torch.device | str | None = None, seed: int | None = None
) -> Tensor:
    """Deterministic token ids `[n_tokens]` (int64) for `config` (seeded by `seed`, default config.seed + 1)."""
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1 if seed is None else seed)
    return torch.randint(0, config.vocab, (n_tokens,), generator=gen).to(device)


def local_rows(x: Tensor, rank: int, world: int) -> Tensor:
    """Rank `rank`'s contiguous slice of `world` equal row slices of `x` (the SP input split)."""
    if x.shape[0] % world:
        raise ValueError(f"{x.shape[0]} tokens do not split evenly over {world} ranks")
    t = x.shape[0] // world
    return x[rank * t : (rank + 1) * t]


def compile_model(
    model: nn.Module, passes: dict[str, Any] | None = None, *, dynamic: bool | None = None, fullgraph: bool = True
) -> Any:
    """`torch.compile(model)` with Inductor; with `passes` (a dict of options, possibly empty)
    the mxfuse post-grad pass `mxfuse.post_grad_pass(**passes)` is installed as
    Inductor's `post_grad_custom_post_pass`."""
    options = None
    if passes is not None:
        import mxfuse

        post_grad_pass = getattr(mxfuse, "post_grad_pass", None)
        if post_grad_pass is None:
            raise RuntimeError("mxfuse.post_grad_pass is not available in this version of mxfuse")
        options = {"post_grad_custom_post_pass": post_grad_pass(**passes)}
    return torch.compile(model, fullgraph=fullgraph, dynamic=dynamic, options=options)
