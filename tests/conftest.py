"""Every test compiles afresh: a graph served from Inductor's on-disk FX graph cache (kept
between runs on one machine) skips the post-grad passes, and with them the reports the
tests read. The cache key itself is tested through `uuid()` (tests/test_integration.py).

The suite runs the pass strict (MXFUSE_STRICT=1, inherited by the subprocesses the tests
start): an exception inside the pass fails the test instead of hiding behind the
rollback. Tests of the rollback pass `strict=False` explicitly."""

import os

import pytest
import torch
import torch._functorch.config

os.environ.setdefault("MXFUSE_STRICT", "1")


@pytest.fixture(autouse=True, scope="session")
def _compile_afresh():
    with (
        torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


@pytest.fixture(scope="session")
def vllm_ops():
    """`torch.ops.vllm` with the ops the vLLM graph tests trace (skips without vLLM)."""
    pytest.importorskip("vllm")
    import vllm.distributed.parallel_state  # noqa: F401  (vllm.all_gather)
    import vllm.ir.ops  # noqa: F401  (vllm_ir.rms_norm / fused_add_rms_norm)
    import vllm.model_executor.layers.quantization.utils.mxfp8_utils  # noqa: F401  (vllm.mxfp8_quantize)

    return torch.ops.vllm
