"""The gated producers through vLLM 0.33's own compile pipeline on CPU (the method and its stubs:
tests/vllm_pipeline.py): Qwen3.5 and Qwen3-Next, one Gated DeltaNet layer and one attention layer each.

With an independent detector (below, not mxfuse's recognizers) every MXFP8 activation quant is
classified by what feeds it, before mxfuse ran and after: the gated attention output
(`mul(x, sigmoid(gate))` before o_proj) and the GDN's gated RMSNorm (a cast of an fp32 product whose
ancestry holds the norm's `rsqrt` and the gate's `exp` / `sigmoid`, before out_proj) must leave no
standalone quant, and their fused ops must feed vLLM's MXFP8 GEMM. With the act·mul producer (down_proj's
quant) no standalone MXFP8 quant is left in these layers at all (the README's per-layer table).

Stubbed, besides tests/vllm_pipeline.py's list: nothing. The GDN layer's recurrent kernels
(`vllm.gdn_attention_core`, FLA's chunked delta rule) are reached through vLLM's own splitting op, so
the piece holding them is cut out of the compiled graphs as vLLM cuts it; its CUDA kernels never run
(no compiled piece runs: `PiecesNotRun`).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import vllm_pipeline
from test_vllm_models import CASES
from torch import fx
from vllm_pipeline import compile_model, gemm_ops, quant_nodes, source

pytestmark = pytest.mark.vllm
vllm_cpu = vllm_pipeline.vllm_cpu  # the module fixture: vLLM stood up on CPU

aten, prims = torch.ops.aten, torch.ops.prims
QWEN = {c.name: c for c in CASES if c.name in ("qwen3_next", "qwen3_5")}


def _ancestors(node: fx.Node, depth: int) -> set:
    seen, work = set(), [(node, 0)]
    while work:
        n, d = work.pop()
        if n in seen or d > depth:
            continue
        seen.add(n)
        work += [(a, d + 1) for a in n.all_input_nodes]
    return seen


def producer_class(quant: fx.Node) -> str:
    """What feeds an MXFP8 quant: "gate", "gated_norm", "norm", "act_mul" or "other" (independent of mxfuse)."""
    producer, _ = source(quant.args[0])
    if not isinstance(producer, fx.Node) or producer.op != "call_function":
        return "other"
    if producer.target in (torch.ops.vllm_ir.rms_norm.default, torch.ops.vllm_ir.fused_add_rms_norm.default):
        return "norm"
    if producer.target is aten.mul.Tensor and any(
        isinstance(a, fx.Node) and a.target is aten.sigmoid.default for a in producer.args
    ):
        return "gate"
    near = {n.target for n in _ancestors(producer, 12)}
    gated = aten.exp.default in near or aten.sigmoid.default in near
    if producer.target is prims.convert_element_type.default and aten.rsqrt.default in near and gated:
        return "gated_norm"
    if producer.target is aten.mul.Tensor and aten.exp.default in near:
        return "act_mul"
    return "other"


def classified(graphs) -> Counter:
    return Counter(producer_class(q) for g in graphs for q in quant_nodes(g))


def fused_gated(graphs) -> Counter:
    """mxfuse's gated fused ops whose codes reach an MXFP8 GEMM."""
    ops = {
        torch.ops.mxfuse.sigmoid_gate_mxfp8.default: "gate",
        torch.ops.mxfuse.gated_rms_norm_mxfp8.default: "gated_norm",
    }
    found: Counter = Counter()
    for graph in graphs:
        for node in graph.nodes:
            if node.op == "call_function" and node.target in gemm_ops():
                producer, _ = source(node.args[0])
                if isinstance(producer, fx.Node) and producer.target in ops:
                    found[ops[producer.target]] += 1
    return found


@pytest.mark.parametrize("name", sorted(QWEN))
def test_no_gated_quant_left_standalone(vllm_cpu, name):
    """Per model (one GDN layer, one attention layer): one gated-norm site and one gate site before; after
    mxfuse none of them is a standalone quant, each is one fused op feeding the GEMM."""
    record = compile_model(vllm_cpu, QWEN[name])
    before, after = classified(record.before), classified(record.after)
    table = f"{name}: quants before {dict(before)}, standalone after {dict(after)}"
    print(table)
    assert before["gate"] == 1 and before["gated_norm"] == 1, table
    assert after["gate"] == 0 and after["gated_norm"] == 0, table
    assert fused_gated(record.after) == Counter(gate=1, gated_norm=1), table
    assert after["norm"] == 0, table  # the norms fuse as before
    assert not after, table  # the act·mul of down_proj too: no standalone quant left in the layers
    matched = {k: v for k, v in record.matched.items() if "sigmoid_gate" in k or "gated_rms_norm" in k}
    assert sum(matched.values()) == 2, record.matched
