"""Rewrite 2 on vLLM's own collective: `torch.ops.vllm.all_gather` over vLLM's TP group,
stood up on gloo with 2 CPU processes spawned by the test.

A sequence-parallel norm -> vLLM all-gather -> quant -> MXFP8 GEMM, compiled without the
pass and with `sp_gather="bf16"` / `"mxfp8"`: every rank bitwise equal to eager; in
mxfp8 mode the vLLM gather carries the packed uint8 buffer and keeps vLLM's group.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import CapturingPass
from sp_helpers import sp_gather_modes

from mxfuse.testing import bitwise_equal, run_ranks

WORLD = 2
pytestmark = [pytest.mark.vllm, pytest.mark.distributed]


def _vllm_gathers(graph: torch.fx.Graph) -> list[tuple[str, str]]:
    """The dtype and group of each vLLM all-gather of `graph`."""
    gather = torch.ops.vllm.all_gather.default
    return [(str(n.meta["val"].dtype), n.args[3]) for n in graph.nodes if n.target is gather]


def _rank_body(rank: int, world: int, port: int) -> dict:
    import vllm.model_executor.layers.quantization.utils.mxfp8_utils  # noqa: F401  (vllm.mxfp8_quantize)
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    import mxfuse  # noqa: F401

    torch.set_num_threads(1)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        parallel_state.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        results = _checks(rank, parallel_state.get_tp_group().unique_name)
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
    return results


def _checks(rank: int, group: str) -> dict:
    mx = torch.ops.mxfuse
    g = torch.Generator().manual_seed(5)
    w = (0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    wc, ws = mx.mxfp8_quantize((torch.randn(64, 128, generator=g) / 8).to(torch.bfloat16))
    xs = [torch.randn(2, 9, 128, generator=g).to(torch.bfloat16) for _ in range(WORLD)]
    x, residual = xs[rank][0], xs[rank][1]

    def block(x, residual):
        y, residual = mx.gemma_fused_add_rmsnorm(x, residual, w, 1e-6)
        gathered = torch.ops.vllm.all_gather(y, 0, WORLD, group)
        codes, scales = torch.ops.vllm.mxfp8_quantize(gathered, False, 0)
        return mx.mxfp8_linear(codes, scales, wc, ws, torch.bfloat16), residual

    with torch.no_grad():
        eager = block(x, residual)
    results = {}
    for name, options in sp_gather_modes():
        torch._dynamo.reset()
        capture = CapturingPass(options)
        compiled = torch.compile(block, fullgraph=True, options={"post_grad_custom_post_pass": capture})
        with torch.no_grad():
            out = compiled(x, residual)
        results[name] = {
            "same": all(bitwise_equal(a, b) for a, b in zip(out, eager)),
            "gathers": _vllm_gathers(capture.graph),
            "matched": capture.report.matched_strings() if capture.report else {},
        }
    results["group"] = group
    return results


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("vllm")
    return run_ranks(_rank_body, WORLD, timeout=300)


def test_vllm_all_gather_sp_block_bitwise_in_every_mode(reports):
    for rank, results in reports.items():
        for mode in ("none", "bf16", "mxfp8"):
            assert results[mode]["same"], (rank, mode, results[mode])
        group = results["group"]
        assert results["none"]["gathers"] == results["bf16"]["gathers"] == [("torch.bfloat16", group)]
        assert results["mxfp8"]["gathers"] == [("torch.uint8", group)]  # one packed gather, vLLM's group
        assert sum(n for kind, n in results["mxfp8"]["matched"].items() if "vllm_gather" in kind) == 1, results
