"""A tiny Hugging Face `MiniMaxM3VLDecoderLayer` whose `nn.Linear`s run the project's MXFP8 ops.

Used by the end-to-end tests and by ``mxfuse dump/explain --model hf-minimax-m3``.
transformers is imported only when a layer is built (``import mxfuse.hf`` does not
need it). The layer's norms are Hugging Face's `MiniMaxM3VLRMSNorm` (Gemma numerics,
decomposed ATen after tracing: the ``hf`` norm form of :mod:`mxfuse.patterns.norms`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mxfuse.layers import MXFP8Linear

HIDDEN = 128


def swap_linears(module: torch.nn.Module, linear: type[MXFP8Linear] = MXFP8Linear) -> None:
    """Replace every `nn.Linear` below `module` by an MXFP8 linear (`linear`, an `MXFP8Linear`
    class) of its weight, in place."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, linear.from_weight(child.weight))
        else:
            swap_linears(child, linear)


def tiny_minimax_m3_layer(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`(layer, rotary)`: one bf16 `MiniMaxM3VLDecoderLayer` (hidden 128, 4 heads / 2 kv heads of 32,
    dense MLP 256, norm weights ~N(0, 0.1)) with MXFP8 linears, and its rotary embedding."""
    from transformers.models.minimax_m3_vl import (
        configuration_minimax_m3_vl as conf,
        modeling_minimax_m3_vl as modeling,
    )

    config = conf.MiniMaxM3VLTextConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rotary_dim=16,
        dense_intermediate_size=256,
        mlp_layer_types=["dense"],
        layer_types=["full_attention"],
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    layer = modeling.MiniMaxM3VLDecoderLayer(config, 0)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        torch.nn.init.normal_(norm.weight, std=0.1)
    layer = layer.to(torch.bfloat16).eval()
    swap_linears(layer)
    rotary = modeling.MiniMaxM3VLRotaryEmbedding(config=config)
    return layer, rotary


def tiny_minimax_m3_example(tokens: int, seed: int = 0) -> tuple[Callable[[torch.Tensor], Any], torch.Tensor]:
    """`(forward, hidden)`: a function of the hidden states `[1, tokens, 128]` running the tiny layer
    (rotary cos/sin computed once, outside the compiled region), and a random input for it."""
    layer, rotary = tiny_minimax_m3_layer(seed)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(1, tokens, HIDDEN, generator=g).to(torch.bfloat16)
    positions = torch.arange(tokens).unsqueeze(0)
    with torch.no_grad():
        cos_sin = rotary(hidden, positions)

    def forward(h: torch.Tensor) -> Any:
        return layer(h, position_embeddings=cos_sin, position_ids=positions)

    return forward, hidden
