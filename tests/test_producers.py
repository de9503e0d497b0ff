"""The producer contract (`mxfuse/patterns/producers.py`): the table of fused ops, and the norms as producers."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import inputs

import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops.reference import QuantRule
from mxfuse.patterns.producer_registry import find_producers
from mxfuse.patterns.producers import FUSED_OPS, ProducerFamily, ProducerMatch, fused_op
from mxfuse.patterns.results import SharedCode

mx = torch.ops.mxfuse


@pytest.mark.parametrize("key", sorted(FUSED_OPS), ids=lambda k: f"{k[0]}-res{int(k[1])}-packed{int(k[2])}")
def test_every_table_row_names_a_registered_op_with_its_outputs_in_order(key):
    _, residual, packed = key
    op = FUSED_OPS[key]
    returns = op.overload._schema.returns
    assert len(returns) == len(op.outputs), (op.name, op.outputs)
    assert op.packed == packed and op.outputs[0] == ("packed" if packed else "codes")
    assert ("residual_out" in op.outputs) == residual and op.outputs[-1] == "y"
    arguments = [a.name for a in op.overload._schema.arguments]
    assert ("residual" in arguments) == residual, arguments


def test_a_producer_without_a_fused_op_is_a_value_error():
    with pytest.raises(ValueError, match="no fused MXFP8 op for producer 'silu_mul'"):
        fused_op("silu_mul", packed=True)


def _traced(fn, *args):
    return torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(*args).graph


def test_norms_are_producers_with_their_fused_call_and_side_outputs():
    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        z = mx.rms_norm(res, weight, 1e-5)
        return y, z, res

    graph = _traced(fn, *inputs())
    first, second = find_producers(graph)
    assert isinstance(first, ProducerMatch) and isinstance(second, ProducerMatch)
    assert (first.family, first.kind, second.kind) == (ProducerFamily.NORM, "mxfuse:fused_add", "mxfuse:rms_norm")
    assert set(first.side_outputs()) == {"residual_out"} and second.side_outputs() == {}

    call = first.fused_call(swizzled=True, emit_y=True, rule=QuantRule.TORCHAO)
    assert call.op.name == "gemma_fused_add_rmsnorm_mxfp8"
    assert call.kwargs["swizzled"] is True and call.kwargs["rule"] == int(QuantRule.TORCHAO)
    packed = second.fused_call(packed=True)  # the standard norm's packed form: the Gemma-named op, offset 0
    assert packed.op.name == "gemma_rmsnorm_mxfp8_packed" and packed.kwargs["weight_offset"] == 0.0
    assert "swizzled" not in packed.kwargs and "rule" not in packed.kwargs


def test_moved_reads_the_inputs_through_what_earlier_sites_replaced():
    def fn(x, residual, weight):
        return mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)

    graph = _traced(fn, *inputs())
    (norm,) = find_producers(graph)
    assert norm.moved({}) is norm
    stand_in = next(n for n in graph.nodes if n.op == "placeholder" and n is not norm.residual)
    moved = norm.moved({norm.residual: stand_in})
    assert moved.residual is stand_in and moved.x is norm.x and moved.y is norm.y
    stand_in._erased = True  # a rollback erased it: the entry no longer holds
    assert norm.moved({norm.residual: stand_in}) is norm


def test_a_producer_refusal_code_carries_its_fix():
    assert SharedCode.ACTIVATION_DTYPE.fix == "run the model in bfloat16 or float16"
    assert SharedCode.NO_QUANT.fix is None and not SharedCode.NO_QUANT.defers
