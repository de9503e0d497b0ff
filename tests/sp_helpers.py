"""Graph-level helpers of the sp_gather tests (graphs from `graph_helpers.trace`): a simulated
all-gather (every rank holds the same rows), and small SP blocks (see test_sp_gather.py)."""

from __future__ import annotations

import torch
from graph_helpers import example_inputs
from torch import fx

import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.ops import reference
from mxfuse.ops.mx_layout import padded_rows, padded_scale_columns, scale_columns
from mxfuse.passes.options import PassOptions

mx = torch.ops.mxfuse
c10d = torch.ops._c10d_functional
K = 64
W = 2
GROUP = "sp_test_group"


# --------------------------------------------------- a GEMM that reads swizzled scales


@torch.library.custom_op("mxfuse_sp_test::linear_swizzled", mutates_args=())
def linear_swizzled(codes: torch.Tensor, scales: torch.Tensor, wc: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """An MXFP8 GEMM whose activation scales are F8_128x4-swizzled (2-D, or vLLM's flat 1-D)."""
    m, k = codes.shape
    tiles = scales.reshape(-1, padded_scale_columns(k))[: padded_rows(m)]
    rowmajor = reference.unswizzle_scales(tiles, m, scale_columns(k))
    return reference.mxfp8_linear(codes, rowmajor, wc, ws, torch.bfloat16)


@linear_swizzled.register_fake
def _(codes, scales, wc, ws):
    return codes.new_empty((codes.shape[0], wc.shape[0]), dtype=torch.bfloat16)


# ------------------------------------------------------------------ helpers


def sp_gather_modes() -> list[tuple[str, PassOptions | None]]:
    """`(name, options)` of the model-level SP checks: no pass, then `sp_gather` "bf16" and "mxfp8"
    (strict where the environment says so: MXFUSE_STRICT=1 from conftest, inherited by spawned ranks)."""
    return [("none", None), *((mode, PassOptions.from_env(sp_gather=mode)) for mode in ("bf16", "mxfp8"))]


def gather_dtypes(graph: fx.Graph) -> list[str]:
    """The dtype of each functional-collective all-gather of `graph` (a capture's copy, say)."""
    ag = c10d.all_gather_into_tensor.default
    return [str(n.meta["val"].dtype) for n in graph.nodes if n.target is ag]


def weights(n=48, k=K):
    g = torch.Generator().manual_seed(7)
    return mx.mxfp8_quantize((torch.randn(n, k, generator=g) / 8).to(torch.bfloat16))


def local_inputs(m=5, k=K, seed=0):
    x, r, w, _ = example_inputs(m, k)
    if seed:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        r = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, r, w


class SimulatedWorld(fx.Interpreter):
    """Runs a graph as every one of `world` ranks holding the same local rows would."""

    def __init__(self, gm, world=W):
        super().__init__(gm)
        self.world = world

    def call_function(self, target, args, kwargs):
        if target is c10d.all_gather_into_tensor.default:
            return torch.cat([args[0]] * self.world)
        if target is c10d.wait_tensor.default:
            return args[0]
        if _vllm_all_gather() is not None and target is _vllm_all_gather():
            return torch.cat([args[0]] * self.world, dim=args[1])
        return super().call_function(target, args, kwargs)


def _vllm_all_gather():
    ns = torch.ops.vllm
    return ns.all_gather.default if hasattr(ns, "all_gather") else None


def simulate(gm, *args):
    with torch.no_grad():
        out = SimulatedWorld(gm).run(*args)
    return out if isinstance(out, (tuple, list)) else (out,)


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def gathers(gm) -> list[fx.Node]:
    ops = {c10d.all_gather_into_tensor.default, _vllm_all_gather()} - {None}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]


def c10d_gather(t, dim_group=(W, GROUP)):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(t, *dim_group))


def gemma_norm(x, r, w, residual):
    """(y, residual out): the fused-add norm, or the plain norm passing `r` through."""
    if residual:
        return mx.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
    return mx.gemma_rmsnorm(x, w, 1e-6), r


def sp_block(swizzled=False, residual=True, extra_gathered_user=False, extra_local_user=False):
    """norm -> c10d all-gather (bf16) -> quant -> GEMM: the correct bf16 form."""
    wc, ws = weights()

    def fn(x, r, w):
        y, res = gemma_norm(x, r, w, residual)
        g = c10d_gather(y)
        q, s = mx.mxfp8_quantize(g, swizzled)
        out = linear_swizzled(q, s, wc, ws) if swizzled else mx.mxfp8_linear(q, s, wc, ws, torch.bfloat16)
        outs = [out, res]
        if extra_gathered_user:
            outs.append(g * 2)
        if extra_local_user:
            outs.append(y + 1)
        return tuple(outs)

    return fn
