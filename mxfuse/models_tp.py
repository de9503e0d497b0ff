"""The reference decoder (:mod:`mxfuse.models`) in tensor-parallel form, for the sequence-parallel rewrite.

Megatron-style TP over W ranks, every rank holding all T token rows::

    x, res = norm(h[, res])              # replicated: every rank, all rows
    qkv = qkv_proj(quant(x))             # column-parallel: this rank's heads
    a = attention(qkv)
    h = all_reduce(o_proj(quant(a)))     # row-parallel: partial sums, then the reduction
    x, res = fused_add_norm(h, res)
    m = swiglu(gate_up(quant(x)))        # column-parallel: this rank's intermediate slice
    h = all_reduce(down_proj(quant(m)))  # row-parallel
    ...
    out, _ = fused_add_norm(h, res)      # final norm
    logits = lm_head(quant(out))         # replicated MXFP8 LM head (optional)

The shards are cut from the full :class:`mxfuse.models.Model` of the same config
(codes and E8M0 scales sliced by rows for column-parallel, by 32-column blocks for
row-parallel), so the TP model is the same network; only its sums are split. The
embedding is replicated: the first layer's residual is the full embedding output
(what the rewrite cuts to the local rows). The all-reduce is a callable so one model
serves both collective families: :func:`c10d_all_reduce` (PyTorch functional
collectives) and :func:`vllm_all_reduce` (`torch.ops.vllm.all_reduce` over vLLM's group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mxfuse.layers import GemmaNorm, MXFP8Linear, swiglu_oai
from mxfuse.models import DecoderLayer, Model, ModelConfig, causal_gqa_attention
from mxfuse.ops.mx_layout import BLOCK

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def c10d_all_reduce(group: ProcessGroup) -> Callable[[Tensor], Tensor]:
    """Sum over `group` with a functional collective (`_c10d_functional.all_reduce` + `wait_tensor`)."""
    from torch.distributed import _functional_collectives as fc

    return lambda x: fc.all_reduce(x, "sum", group)


def vllm_all_reduce(group_name: str) -> Callable[[Tensor], Tensor]:
    """Sum over vLLM's group `group_name` (`torch.ops.vllm.all_reduce`, what vLLM's RowParallelLinear calls)."""
    return lambda x: torch.ops.vllm.all_reduce(x, group_name)


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """One rank's config: heads and intermediate divided by `world` (each K a multiple of 32)."""
    for what, n in (
        ("n_heads", config.n_heads),
        ("n_kv_heads", config.n_kv_heads),
        ("intermediate", config.intermediate),
    ):
        if n % world:
            raise ValueError(f"TP {world}: {what} = {n} does not split evenly")
    return config.replace(
        n_heads=config.n_heads // world,
        n_kv_heads=config.n_kv_heads // world,
        intermediate=config.intermediate // world,
    )


def column_shard(linear: MXFP8Linear, splits: list[int], rank: int, world: int) -> MXFP8Linear:
    """Output rows of each part in `splits` (e.g. [q, k, v]) cut to this rank's share, parts kept in order."""
    codes, scales = linear.weight_codes.split(splits), linear.weight_scales.split(splits)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(world)[rank]

    return MXFP8Linear.from_quantized(torch.cat([pick(c) for c in codes]), torch.cat([pick(s) for s in scales]))


def row_shard(linear: MXFP8Linear, rank: int, world: int) -> MXFP8Linear:
    """Input columns (K) cut to this rank's share; K / world must be a multiple of 32."""
    k = linear.in_features // world
    if k % BLOCK:
        raise ValueError(f"row-parallel shard K = {k} is not a multiple of {BLOCK}")
    codes = linear.weight_codes[:, rank * k : (rank + 1) * k]
    scales = linear.weight_scales[:, rank * k // BLOCK : (rank + 1) * k // BLOCK]
    return MXFP8Linear.from_quantized(codes.contiguous(), scales.contiguous())


NormLayer = Callable[[GemmaNorm], nn.Module]


class TPDecoderLayer(nn.Module):
    """A :class:`~mxfuse.models.DecoderLayer` cut to this rank's heads and intermediate slice."""

    def __init__(
        self, full: DecoderLayer, rank: int, world: int, all_reduce: Callable[[Tensor], Tensor], norm: NormLayer
    ):
        super().__init__()
        c = full.config
        self.config = shard_config(c, world)
        self.all_reduce = all_reduce
        self.input_norm, self.post_attention_norm = norm(full.input_norm), norm(full.post_attention_norm)
        self.qkv_proj = column_shard(full.qkv_proj, [c.q_size, c.kv_size, c.kv_size], rank, world)
        self.o_proj = row_shard(full.o_proj, rank, world)
        self.gate_up_proj = column_shard(full.gate_up_proj, [c.intermediate, c.intermediate], rank, world)
        self.down_proj = row_shard(full.down_proj, rank, world)

    def attention(self, qkv: Tensor) -> Tensor:
        """Causal GQA attention over all rows, on this rank's heads."""
        return causal_gqa_attention(self.config, qkv)

    def forward(self, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            x = self.input_norm(h)
            residual = h
        else:
            x, residual = self.input_norm(h, residual)
        h = self.all_reduce(self.o_proj(self.attention(self.qkv_proj(x))))
        x, residual = self.post_attention_norm(h, residual)
        gate_up = self.gate_up_proj(x)
        h = self.all_reduce(self.down_proj(swiglu_oai(gate_up, self.config.native_activation)))
        return h, residual


class TPModel(nn.Module):
    """Rank `rank` of `world` of the reference model: ids `[T]` (all rows, every rank) -> `[T, hidden]`
    (or logits `[T, vocab]` with `lm_head=True`).

    `norm` maps each of the full model's Gemma norms to the layer used (default: itself);
    e.g. to vLLM's `GemmaRMSNorm` with the same weight, which emits vLLM's IR norm ops."""

    def __init__(
        self,
        config: ModelConfig,
        rank: int,
        world: int,
        all_reduce: Callable[[Tensor], Tensor],
        lm_head: bool = True,
        full: Model | None = None,
        norm: NormLayer | None = None,
    ):
        super().__init__()
        full = full if full is not None else Model(config)
        self.config = config
        self.embed = full.embed
        norm = norm or (lambda layer: layer)
        layers = []
        for layer in full.layers:
            assert isinstance(layer, DecoderLayer), type(layer)
            layers.append(TPDecoderLayer(layer, rank, world, all_reduce, norm))
        self.layers = nn.ModuleList(layers)
        self.norm = norm(full.norm)
        self.lm_head: MXFP8Linear | None = None
        if lm_head:
            gen = torch.Generator(device="cpu").manual_seed(config.seed + 7)
            self.lm_head = MXFP8Linear(config.hidden, config.vocab, gen, config.dtype, full.embed.device)

    def forward(self, input_ids: Tensor) -> Tensor:
        h = torch.nn.functional.embedding(input_ids, self.embed)
        residual: Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual)
        out, _ = self.norm(h, residual)
        return self.lm_head(out) if self.lm_head is not None else out
