"""The act·mul and gated producers in a sequence-parallel layer: fused locally, nothing crosses a collective.

An activation (and a gate) is local to a rank: in a sequence-parallel layer it sits between the
all-gather that feeds the column-parallel GEMM (gate_up, or the attention's qkv) and the
reduce-scatter after the row-parallel one (down_proj, o_proj / out_proj)::

    reduce_scatter -> norm -> all_gather -> quant -> gate_up GEMM -> act·mul -> quant -> down_proj
                                                                     (fused here, on the T gathered rows)
    -> reduce_scatter -> next norm ...

and likewise `attn * sigmoid(gate)` / the gated RMSNorm before o_proj / out_proj. With every
rewrite on (the sequence-parallel rewrite, rewrite 2's `sp_gather` in both modes, rewrite 1),
each act·mul / gated producer must be fused with its own quant, its codes and scales must
reach their GEMM with no collective in between, no collective may be added or moved, and every
rank must compute the same bits as the graph without the pass.

Two sources of the layer: tensor-parallel (`all_reduce` after the row-parallel GEMMs; the
sequence-parallel rewrite turns it into the form above) and already sequence-parallel (the shape
vLLM's own `SequenceParallelismPass` leaves: reduce_scatter -> norm -> all_gather).

What stands in for what (as in tests/test_sp_rewrite.py's graph-level tests): no processes. The
group is a `FakeProcessGroup` registered under a test name (the pass reads its world size from
it); the graphs are traced with make_fx and Inductor's decompositions (what the post-grad pass
receives) and run for all W = 2 ranks in lockstep (`LockstepRanks`: each collective combines the
ranks' values; its reduce-scatter and all-reduce sum alike, and a 2-term bf16 sum rounds once
in either order, so the rewritten graph must equal the all-reduce graph bit for bit). vLLM's own
sequence-parallelism pass is not driven: it needs vLLM's CUDA-only fused collective ops and
compiled ranges; the repository's vLLM SP tests (tests/test_sp_vllm.py, the distributed part of
tests/test_sp_rewrite.py) drive vLLM's collectives with mxfuse's rewrite, not vLLM's pass, too.
The MXFP8 GEMM is mxfuse's CPU reference (`mxfp8_linear`).
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch._C._distributed_c10d as c10d_cpp
import torch.nn.functional as F
from graph_helpers import run_pass, trace
from test_sp_rewrite import LockstepRanks, counts

import mxfuse  # noqa: F401
from mxfuse.passes.analysis import op_counts, op_name
from mxfuse.patterns.producers import ProducerFamily
from mxfuse.testing import assert_bitwise

mx = torch.ops.mxfuse
c10d = torch.ops._c10d_functional
GROUP = "sp_producers_test"
WORLD = 2
K, INTER, D = 64, 64, 32  # hidden, intermediate per rank, head dim (the rank's attention output: 2 heads)
COLLECTIVES = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default)
VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
PRODUCER_OPS = tuple(f"mxfuse::{op}_mxfp8" for op in ("act_mul", "act_mul_pair", "sigmoid_gate", "gated_rms_norm"))
PRODUCER_FAMILIES = (ProducerFamily.ACT_MUL, ProducerFamily.GATE, ProducerFamily.GATED_NORM)


@pytest.fixture(scope="module")
def group():
    pg = c10d_cpp.ProcessGroup(c10d_cpp.FakeStore(), 0, WORLD)
    backend = c10d_cpp.FakeProcessGroup._create_internal(0, WORLD)
    pg._register_backend(torch.device("cpu"), c10d_cpp.ProcessGroup.BackendType.CUSTOM, backend)
    c10d_cpp._register_process_group(GROUP, pg)
    yield GROUP
    c10d_cpp._unregister_process_group(GROUP)


# ------------------------------------------------------------------ the layer


def all_reduce(x):
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", GROUP))


def reduce_scatter(x):
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", WORLD, GROUP))


def all_gather(x):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, GROUP))


def linear(x, wc, ws):
    return mx.mxfp8_linear(*mx.mxfp8_quantize(x), wc, ws, torch.bfloat16)


def attention_output(form: str, attn, gate, wn):
    """o_proj's input: the attention output as it is, gated (`attn * sigmoid(gate)`, Qwen3.5's gated
    attention), or the gated RMSNorm per head (vLLM's RMSNormGated native form, a GDN layer's out_proj)."""
    if form == "gate":
        return attn * torch.sigmoid(gate)
    if form == "gated_norm":
        x32, z32 = attn.view(-1, 2, D).float(), gate.view(-1, 2, D).float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * wn.float()
        return (out * F.silu(z32)).to(attn.dtype).flatten(-2)
    return attn


def mlp(form: str, y, w):
    """down_proj's partial sums: the gate_up GEMM (or gate_proj and up_proj), the act·mul, down_proj."""
    if form == "gelu_tanh_pair":  # Hugging Face's two projections
        return linear(F.gelu(linear(y, *w["g"]), approximate="tanh") * linear(y, *w["u"]), *w["d"])
    gate_up = linear(y, *w["gu"])
    if form == "swiglu_step_chunk":  # vLLM's SwigluStepAndMul
        g, u = gate_up.chunk(2, dim=-1)
        act = F.silu(g).clamp(max=7.0) * u.clamp(min=-7.0, max=7.0)
    else:  # vLLM's SiluAndMul
        act = F.silu(gate_up[..., :INTER]) * gate_up[..., INTER:]
    return linear(act, *w["d"])


def layer_fn(attn_form: str, mlp_form: str, authored_sp: bool):
    """One decoder layer's tail on one rank, from the attention output to the next layer's first quant.

    TP (`authored_sp=False`): rows are all T tokens; `all_reduce` after o_proj and down_proj. Authored SP:
    the residual holds this rank's T/W rows; `reduce_scatter` after each row-parallel GEMM and an
    `all_gather` of each norm's output before the next column-parallel GEMM."""
    combine = reduce_scatter if authored_sp else all_reduce
    spread = all_gather if authored_sp else (lambda t: t)

    def fn(attn, gate, residual, wn, w1, w2, *ws):
        w = dict(zip(("o", "gu", "g", "u", "d"), zip(ws[0::2], ws[1::2])))
        o = combine(linear(attention_output(attn_form, attn, gate, wn), *w["o"]))
        y, residual = mx.gemma_fused_add_rmsnorm(o, residual, w1, 1e-6)
        d = combine(mlp(mlp_form, spread(y), w))
        y2, residual = mx.gemma_fused_add_rmsnorm(d, residual, w2, 1e-6)
        return (*mx.mxfp8_quantize(spread(y2)), residual)

    return fn


def rank_inputs(t: int, authored_sp: bool) -> list[tuple]:
    """Each rank's inputs: its heads' attention output and gate, the residual (the same rows on every rank in
    TP, the rank's own rows in authored SP), the norms' weights, its shards of the MXFP8 weights."""

    def rand(*shape, seed, scale=1.0):
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)

    def weight(n, k, seed):
        return mx.mxfp8_quantize(rand(n, k, seed=seed, scale=0.125))

    residual = rand(t, K, seed=1)
    out = []
    for r in range(WORLD):
        own = residual.chunk(WORLD)[r].clone() if authored_sp else residual
        shards = [weight(K, 2 * D, 10 + r), weight(2 * INTER, K, 20 + r), weight(INTER, K, 30 + r)]
        shards += [weight(INTER, K, 40 + r), weight(K, INTER, 50 + r)]
        norms = (rand(D, seed=2).add(1), rand(K, seed=3, scale=0.1), rand(K, seed=4, scale=0.1))
        out.append((rand(t, 2 * D, seed=60 + r), rand(t, 2 * D, seed=70 + r, scale=3.0), own, *norms,
                    *(t for pair in shards for t in pair)))  # fmt: skip
    return out


# ------------------------------------------------------------------ checks


def producer_nodes(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if op_name(n) in PRODUCER_OPS]


def readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What reads `node`'s value, through getitems and views."""
    found = []
    for user in node.users:
        passing = user.target in VIEWS or user.target is operator.getitem
        found += readers(user) if passing else [user]
    return found


def assert_local(gm, t: int):
    """Each fused producer reads the T gathered rows and its codes and scales go straight to one MXFP8 GEMM."""
    for node in producer_nodes(gm):
        assert node.args[0].meta["val"].shape[0] == t, (node, node.args[0].meta["val"].shape)  # not a rank's T/W
        quant_outputs = [u for u in node.users if u.args[1] in (0, 1) and u.users]
        assert len(quant_outputs) == 2, node
        for out in quant_outputs:
            assert [r.target for r in readers(out)] == [mx.mxfp8_linear.default], (node, readers(out))


CASES = [
    ("plain", "silu"),
    ("gate", "gelu_tanh_pair"),
    ("gated_norm", "swiglu_step_chunk"),
]


@pytest.mark.parametrize("authored_sp", [False, True], ids=["tp_rewritten", "sp_authored"])
@pytest.mark.parametrize("attn_form, mlp_form", CASES, ids=["+".join(c) for c in CASES])
def test_producers_fuse_locally_and_nothing_crosses_a_collective(group, attn_form, mlp_form, authored_sp):
    t = 8 if authored_sp else 9  # the TP graph's 9 rows: the rewrite pads them to 10 for the reduce-scatter
    args = rank_inputs(t, authored_sp)
    source = trace(layer_fn(attn_form, mlp_form, authored_sp), *args[0], decompose=True)
    expected = LockstepRanks(source, WORLD).run(args)
    reference = copy.deepcopy(source)
    run_pass(reference, sequence_parallel=not authored_sp, fuse_norm_quant=False, sp_gather="bf16")
    collectives = counts(reference)
    assert collectives["all_reduce"] == 0 and collectives["reduce_scatter"] == 2, collectives
    producers = 1 + (attn_form != "plain")  # the act·mul, and the gate or the gated norm
    for mode in ("bf16", "mxfp8"):
        gm = copy.deepcopy(source)
        report = run_pass(gm, sequence_parallel=not authored_sp, sp_gather=mode)
        assert counts(gm) == collectives, (mode, counts(gm), collectives)  # none added, none removed
        fused = [k for k in report.matched.elements() if getattr(k, "family", None) in PRODUCER_FAMILIES]
        assert len(fused) == producers and not any(k.packed_gather for k in fused), report.matched
        assert len(producer_nodes(gm)) == producers, op_counts(gm.graph)
        packed = sum(n for k, n in report.matched.items() if k.packed_gather)  # the norms' quants, before the gathers
        assert packed == (2 if mode == "mxfp8" else 0), report.matched
        assert_local(gm, t)
        for rank, (got, want) in enumerate(zip(LockstepRanks(gm, WORLD).run(args), expected)):
            assert_bitwise(got, want, f"rank {rank}, sp_gather={mode}")
