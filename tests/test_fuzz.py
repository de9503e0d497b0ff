"""Random programs of Gemma norms, act·mul and gated producers, look-alikes and MXFP8 quants, run with
and without the pass.

A seeded generator draws a chain of blocks. Each block is one norm in a form the pass
knows (mxfuse ops, vLLM IR with `w.float() + 1`, Hugging Face's decomposed ATen, Gemma's and
the standard `* w.float()`) or a
look-alike it must refuse (`2 + w`, mean over another dim,
`pow(4)`, statistics of another tensor, eps as a tensor input, weights of shape `[1]`
or `[1, K]`), maybe all-gathered along rows (sequence parallelism, simulated in one
process as in tests/sp_helpers.py), followed by 0-2 quants (mxfuse's or vLLM's, either
layout), maybe a view before a quant, maybe another bf16 user; dtypes bf16/fp16 (and
fp32: refused), K a multiple of 32 or not (tests/fuzz_programs.py). Three more blocks join
each traced program at random places: an act·mul (SiLU, GELU-tanh, the step-clamped SwiGLU,
SwiGLU-OAI in the model dtype and mxfuse's fp32 one, vLLM's SiluAndMulWithClamp with beta 1;
gate and up the halves of one tensor in either order, a chunk, or two tensors; 2-D or 3-D)
or a gated producer (`x * sigmoid(g)` in both roundings, vLLM's native gated RMSNorm per
head in both orders), or a look-alike of one that must be left alone (another GELU
constant, an asymmetric clamp, interleaved halves, SiluAndMulWithClamp's default beta 0, a
per-head gate). They are rank-local (never all-gathered: an activation does not cross a
collective; tests/test_sp_producers.py checks that in a sequence-parallel layer) and each
known form fuses bit for bit. Each program is checked under every option value:

- no exception (the suite runs strict) and nothing logged at WARNING by `mxfuse`;
- outputs bitwise equal to the graph without the pass for mxfuse's own norms and every
  act·mul and gated block, within the README's bound for foreign norms (codes one e4m3
  step, scales one, bf16/fp16 one ulp);
- every fusion the report claims is a fused (or packed) op in the graph (with `emit_y`
  as claimed), every clearly fusable producer is fused, no look-alike is.

Most programs are traced with `make_fx` and Inductor's decompositions (what the
post-grad graph holds) and executed on CPU, with dim 0 symbolic (dynamic M: run at two
row counts). One norm program goes through `torch.compile` itself, with freezing (weights as
frozen parameters) and dynamic=True (norms only: Inductor compiles an unfused activation with
arithmetic of its own, so the compiled act·mul is not the traced source's to the bit).
`MXFUSE_FUZZ_EXAMPLES=N` runs N traced programs instead of the CI set.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random

import pytest
import torch
from fuzz_programs import (
    ACT_MUL_KNOWN,
    FUSED,
    GATED_KNOWN,
    HALVES,
    KNOWN,
    LOOKALIKES,
    MUST,
    PACKED,
    PACKED_FUSED,
    PRODUCER_FORMS,
    Program,
    draw_program,
    program_fn,
    program_inputs,
)
from graph_helpers import CapturingPass, call_arguments, trace
from sp_helpers import simulate
from torch import fx

import mxfuse  # noqa: F401  (registers torch.ops.mxfuse)
from mxfuse.passes import post_grad
from mxfuse.passes.analysis import op_name
from mxfuse.passes.explain import copy_graph
from mxfuse.passes.options import SP_GATHER_MODES, PassOptions
from mxfuse.testing import bits

# ------------------------------------------------------------------ checks


def assert_outputs(actual, expected, foreign):
    assert len(actual) == len(expected) == len(foreign)
    for a, e, is_foreign in zip(actual, expected, foreign):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape, a.dtype, e.dtype)
        if not is_foreign or a.dtype == torch.float32:
            assert torch.equal(bits(a), bits(e))
        elif a.numel():  # README: codes one e4m3 step, scales one, bf16/fp16 one ulp
            assert int((bits(a).int() - bits(e).int()).abs().max()) <= 1


def assert_report_is_real(report, graph, program: Program, options: PassOptions):
    """Each claimed fusion is an op in the graph; each clearly fusable block has one, no look-alike has."""
    assert report.failed is None, report.failed
    ops = {"fused": FUSED, "packed_fused": PACKED_FUSED, "packed": PACKED}
    found = {c: [n for n in graph.nodes if op_name(n) in names] for c, names in ops.items()}
    claimed = {
        "fused": [k for k in report.matched.elements() if k.rewrite == "norm_quant"],
        "packed_fused": [k for k in report.matched.elements() if k.packed_gather and k.fuses_producer],
        "packed": [k for k in report.matched.elements() if k.packed_gather and not k.fuses_producer],
    }
    for category, (least, most) in program.expected(options).items():
        assert len(found[category]) == len(claimed[category]), (category, report.as_dict())
        assert least <= len(found[category]) <= most, (category, program, options, report.as_dict())
    emitting = sum(bool(call_arguments(n)["emit_y"]) for n in found["fused"])
    assert emitting == sum(k.writes_y for k in claimed["fused"]), report.as_dict()


# ------------------------------------------------------------------ traced programs


def options_of(rng: random.Random) -> list[PassOptions]:
    """Every option value, each at least once."""
    return [
        PassOptions.from_env(fuse_norm_quant=fuse, sp_gather=mode)
        for fuse in (True, False)
        for mode in rng.sample(SP_GATHER_MODES, k=1 if not fuse else len(SP_GATHER_MODES))
    ]


def check_traced(program: Program, options_list: list[PassOptions], seed: int, caplog):
    fn, foreign = program_fn(program)
    unfused = trace(fn, *program_inputs(program, 5, seed), dynamic=True, decompose=True)
    runs = {m: program_inputs(program, m, seed + m) for m in (5, 33)}  # dynamic M: one trace, two row counts
    with torch.no_grad():
        expected = {m: simulate(unfused, *args) for m, args in runs.items()}
    for options in options_list:
        gm = fx.GraphModule(unfused, copy_graph(unfused.graph))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mxfuse"):
            report = post_grad.run(gm.graph, options)
        assert not [r for r in caplog.records if _is_pass_failure(r)], caplog.text
        gm.recompile()
        assert_report_is_real(report, gm.graph, program, options)
        with torch.no_grad():
            for m, args in runs.items():
                assert_outputs(simulate(gm, *args), expected[m], foreign)


def _is_pass_failure(record: logging.LogRecord) -> bool:
    """A warning of the pass other than the one that explains look-alikes left unfused (by design)."""
    return record.name.startswith("mxfuse") and "not fused in this graph" not in record.getMessage()


def _vllm_available() -> bool:
    try:
        import vllm.ir.ops
        import vllm.model_executor.layers.quantization.utils.mxfp8_utils  # noqa: F401
    except ImportError:
        return False
    return True


CI_SEEDS = range(12)
SEEDS = range(int(os.environ.get("MXFUSE_FUZZ_EXAMPLES", "0"))) or CI_SEEDS


@pytest.mark.parametrize("seed", SEEDS)
def test_traced_random_program(seed, caplog):
    program, rng = draw_program(seed, with_vllm=_vllm_available())
    check_traced(program, options_of(rng), seed, caplog)


def test_the_generator_covers_every_form():
    """The CI seeds draw every known form and every look-alike (else the set is too small)."""
    blocks = [b for seed in CI_SEEDS for b in draw_program(seed, True)[0].blocks]
    forms = {b.form for b in blocks}
    wanted = set(KNOWN) | set(LOOKALIKES) | set(PRODUCER_FORMS)
    assert forms >= wanted - {"vllm_ir"}, sorted(wanted - forms)
    fused = [  # the blocks the pass must fuse (with every option of fuse_norm_quant=True)
        b
        for seed in CI_SEEDS
        for program in [draw_program(seed, True)[0]]
        for b in program.blocks
        if b.expectation(program.dtype, program.k, PassOptions(), program.frozen)[1] == MUST
    ]
    assert {b.form for b in fused} >= set(ACT_MUL_KNOWN + GATED_KNOWN), sorted({b.form for b in fused})
    act_mul = [b for b in fused if b.form in ACT_MUL_KNOWN]
    assert {b.halves for b in act_mul} == set(HALVES), sorted({b.halves for b in act_mul})
    assert {b.rank3 for b in act_mul} == {b.extra_user for b in act_mul} == {True, False}


# ------------------------------------------------------------------ compiled programs


class Frozen(torch.nn.Module):
    """The program with its weights as frozen parameters (what freezing constant-folds)."""

    def __init__(self, program: Program, weights):
        super().__init__()
        self.fn, self.foreign = program_fn(program)
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])

    def forward(self, residual, eps_tensor, *xs):
        return self.fn(residual, eps_tensor, *(t for i, w in enumerate(self.ws) for t in (*xs[2 * i : 2 * i + 2], w)))


@pytest.mark.parametrize("seed", [132])  # three norms, one with the same quant twice (CSE)
def test_compiled_random_program_with_freezing_and_dynamic_rows(seed, caplog):
    """One program through torch.compile itself (dynamic=True, freezing on), with and without the pass."""
    program, _ = draw_program(seed, with_vllm=False, gathers=False, producers=False)
    program = dataclasses.replace(program, dtype=torch.bfloat16, k=64, frozen=True)
    assert program.expected(PassOptions())["fused"][0] > 0, program  # at least one norm must fuse
    weights = program_inputs(program, 6, seed)[4::3]
    module = Frozen(program, weights).eval()
    options = PassOptions.from_env()
    outs: dict[str, list] = {"with": [], "without": []}
    with torch.no_grad(), torch._inductor.config.patch(freezing=True), caplog.at_level(logging.WARNING, "mxfuse"):
        for name, opts in (("with", options), ("without", None)):
            torch._dynamo.reset()
            capture = CapturingPass(opts)
            compiled = torch.compile(module, dynamic=True, options={"post_grad_custom_post_pass": capture})
            for m in (6, 19):
                args = program_inputs(program, m, seed + m)
                rows = [a for j, a in enumerate(args[2:]) if j % 3 != 2]  # each block's x and x2, not its w
                outs[name].append(compiled(args[0], args[1], *rows))
            if opts is not None:
                assert_report_is_real(capture.report, capture.graph, program, options)
    assert not [r for r in caplog.records if _is_pass_failure(r)], caplog.text
    for with_pass, without in zip(outs["with"], outs["without"]):
        assert_outputs(with_pass, without, module.foreign)
