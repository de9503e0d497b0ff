"""Rewrite 2 (`sp_gather`) on GPUs with NCCL: 2, 4 and 8 processes, one GPU each (each world
size skipped without that many GPUs).

The SP reference model compiled without the pass, with `sp_gather="bf16"` and with
`sp_gather="mxfp8"` must give bitwise the eager SP model's output on every rank (the
fused Triton norm+quant is bitwise equal to the unfused kernels by contract), and the
mxfp8 graph must gather uint8. Also: the packed ops' CUDA impls equal the unpacked ones.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import CapturingPass
from sp_helpers import gather_dtypes, sp_gather_modes

from mxfuse.testing import assert_bitwise, bitwise_equal, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

LOCAL_ROWS = (32, 48, 17)  # per rank, > 1: a size-1 dim would be specialized (recompile)


def tokens(world: int) -> tuple[int, ...]:
    return tuple(world * m for m in LOCAL_ROWS)


def _rank_body(rank, world, port):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import mxfuse  # noqa: F401
    from mxfuse.models import Model, ModelConfig, example_inputs, local_rows

    dev = torch.device("cuda", rank)
    cfg = ModelConfig.tiny()
    model = Model(cfg, sp_group=dist.group.WORLD, device=dev)
    ids = {n: local_rows(example_inputs(cfg, n, seed=n), rank, world).to(dev) for n in tokens(world)}
    results = {}
    with torch.no_grad():
        eager = {n: model(ids[n]) for n in tokens(world)}
        for name, opts in sp_gather_modes():
            torch._dynamo.reset()
            cap = CapturingPass(opts)
            compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": cap})
            same = []
            for i, n in enumerate(tokens(world)):
                x = ids[n].clone()
                if i == 0:
                    torch._dynamo.mark_dynamic(x, 0)
                same.append(bitwise_equal(compiled(x), eager[n]))
            results[name] = {"same": same, "gathers": gather_dtypes(cap.graph), "compiles": cap.calls}
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sp_model_bitwise_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    for rank, results in run_ranks(_rank_body, world, timeout=400).items():
        for mode in ("none", "bf16", "mxfp8"):
            assert results[mode]["same"] == [True] * len(LOCAL_ROWS), (rank, mode, results[mode])
            assert results[mode]["compiles"] == 1, (rank, mode, results[mode])
        assert set(results["bf16"]["gathers"]) == {"torch.bfloat16"}, results
        assert set(results["mxfp8"]["gathers"]) == {"torch.uint8"}, results
        assert len(results["mxfp8"]["gathers"]) == len(results["bf16"]["gathers"]), results


@pytest.mark.parametrize("m", [1, 37, 300])
def test_packed_cuda_equals_unpacked_cuda(m):
    from mxfuse.ops import packed

    mx = torch.ops.mxfuse
    g = torch.Generator().manual_seed(m)
    k = 6144
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    r = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    w = (0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).cuda()
    p, res, y = mx.gemma_fused_add_rmsnorm_mxfp8_packed(x, r, w, 1e-6, emit_y=True)
    codes, scales, res2, y2 = mx.gemma_fused_add_rmsnorm_mxfp8(x, r, w, 1e-6, emit_y=True)
    pc, ps = packed.unpack(p, k)
    assert_bitwise((pc, ps, res, y), (codes, scales, res2, y2))
    p, _ = mx.gemma_rmsnorm_mxfp8_packed(x, w, 1e-6)
    codes, scales, _ = mx.gemma_rmsnorm_mxfp8(x, w, 1e-6)
    pc, ps = packed.unpack(p, k)
    assert_bitwise((pc, ps), (codes, scales))
    assert_bitwise(packed.unpack(mx.mxfp8_quantize_packed(x), k), mx.mxfp8_quantize(x))
