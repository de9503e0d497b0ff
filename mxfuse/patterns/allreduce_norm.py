"""Norms that vLLM's all-reduce fusion took before mxfuse runs: recognized, never fused.

At TP > 1 vLLM 0.33's `AllReduceFusionPass` (FlashInfer, sm90/sm100) or
`RocmAiterAllReduceFusionPass` (ROCm AITER) runs before the custom post pass, for the compile
ranges up to its `max_token_num`, and turns `all_reduce -> [fused_add_]rms_norm` (standard
and Gemma weights) into one node; the MXFP8 quant then reads that node's norm output::

    # FlashInfer, under auto_functionalized (outputs: None, allreduce_in, residual, norm_out, ...)
    af = auto_functionalized(vllm.flashinfer_trtllm_fused_allreduce_norm, allreduce_in=x,
             residual=res, norm_out=out | None, quant_out=None, scale_out=None, rms_gamma=w,
             rms_eps=eps, pattern_code=kARResidualRMSNorm, [weight_bias=1.0,] world_size=..,
             launch_with_pdl=.., fp32_acc=.., max_token_num=N)
    y = af[3] (plain: norm_out given, res = zeros)  |  af[1] (fused add: in place into x)
    res_out = af[1] (plain: the all-reduced x)      |  af[2]
    # AITER, functional
    y, res_out = vllm.rocm_aiter_fused_allreduce_rmsnorm(x, res, w, eps, gemma_norm)
    q, s = mxfp8_quantize(y, ...)

The all-reduce is inside the node, so mxfuse cannot put the quant in the norm's kernel: the
match carries a `difference` with `SharedCode.ALLREDUCE_FUSED`, which rewrite 1 reports and
warns about, and every rewrite leaves the node as it is. Only norm outputs an MXFP8 quant
reads are recognized (the others are no site).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from mxfuse.patterns.fx_utils import constant_float, is_call, single_getitem, vllm_op
from mxfuse.patterns.quants import quant_behind_other_view, quants_through_views
from mxfuse.patterns.results import Reason, SharedCode

FLASHINFER_OP = "flashinfer_trtllm_fused_allreduce_norm"
AITER_OP = "rocm_aiter_fused_allreduce_rmsnorm"
_ZEROS = (torch.ops.aten.zeros_like.default, torch.ops.aten.zeros.default, torch.ops.aten.full.default)


def match_allreduce_norm(y: fx.Node, make):
    """`make(...)` (a `NormMatch`) for the norm output `y` of a fused all-reduce+norm node that an
    MXFP8 quant reads; None otherwise."""
    if not is_call(y, operator.getitem) or not (quants_through_views(y) or quant_behind_other_view(y) is not None):
        return None
    node, index = y.args
    flashinfer, aiter = vllm_op(FLASHINFER_OP), vllm_op(AITER_OP)
    if flashinfer is not None and is_call(node, auto_functionalized) and node.args[0] is flashinfer:
        kw = node.kwargs
        plain = kw.get("norm_out") is not None
        if index != (3 if plain else 1):
            return None
        residual_out = single_getitem(node, 1 if plain else 2)
        x, residual, w, eps = kw["allreduce_in"], kw["residual"], kw["rms_gamma"], kw["rms_eps"]
        bias = kw.get("weight_bias", 0.0)
        if not isinstance(bias, (int, float)):
            return None  # the op's schema has `float weight_bias`: a literal
        offset, limit = float(bias), kw.get("max_token_num")
        form, op = "flashinfer_allreduce", f"vllm.{FLASHINFER_OP}"
    elif aiter is not None and is_call(node, aiter) and index == 0:
        x, residual, w, eps = node.args[:4]
        plain = is_call(residual, *_ZEROS)
        gemma = node.kwargs.get("gemma_norm", node.args[4] if len(node.args) > 4 else False)
        offset, limit, residual_out = (1.0 if gemma else 0.0), None, single_getitem(node, 1)
        form, op = "aiter_allreduce", f"vllm.{AITER_OP}"
    else:
        return None
    eps = constant_float(eps)
    return make(
        form,
        x,
        None if plain else residual,
        w,
        eps,
        y,
        residual_out,
        node,
        weight_offset=offset,
        difference=_reason(op, limit),
    )


def _reason(op: str, max_token_num) -> Reason:
    limit = f"max_token_num={max_token_num}" if isinstance(max_token_num, int) else "its max_token_num"
    return Reason(
        SharedCode.ALLREDUCE_FUSED,
        f"vLLM's all-reduce fusion took this norm into {op} (the all-reduce is inside it) for the compile "
        f"ranges up to {limit}; its MXFP8 quant stays a separate kernel",
    )
