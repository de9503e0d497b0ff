"""What `mxfuse demo` prints: the header, the per-variant table, launches, the pass summary, the checks."""

from __future__ import annotations

from typing import TextIO

import torch

from mxfuse.cli.variants import DemoResult
from mxfuse.models import ModelConfig
from mxfuse.ops.mx_layout import packed_width
from mxfuse.passes.analysis import COUNTED, CPP_KERNELS, NOT_LAUNCHES, TRITON_KERNELS, total_launches
from mxfuse.passes.report import PassReport


def counted(n: int, noun: str) -> str:
    """`1 layer`, `2 layers`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def kib(n: float) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n:.0f} B"


def print_header(config: ModelConfig, tokens: int, device: torch.device, steps: int, out: TextIO, sp=None):
    c = config
    print("mxfuse demo: reference MiniMax-M3-style decoder stack (MXFP8 linears, Gemma norms)", file=out)
    dev_desc = str(device)
    if device.type == "cuda":
        dev_desc += f" ({torch.cuda.get_device_name(device)})"
    else:
        dev_desc += f" ({torch.get_num_threads()} threads)"
    print(f"  device : {dev_desc}, torch {torch.__version__}", file=out)
    print(
        f"  config : {c.name}: hidden {c.hidden}, {counted(c.n_layers, 'layer')}, {c.n_heads} heads / "
        f"{c.n_kv_heads} kv heads"
        f" x {c.head_dim}, intermediate {c.intermediate}, vocab {c.vocab}, {str(c.dtype).removeprefix('torch.')}",
        file=out,
    )
    shapes = ", ".join(f"{n} {nk[0]}x{nk[1]}" for n, nk in c.linear_shapes().items())
    print(f"  linears: (N x K) {shapes}", file=out)
    if sp is None:
        print(f"  tokens : {tokens} (one causal sequence), {steps} timed steps", file=out)
    else:
        world, backend, mode = sp
        print(
            f"  tokens : {tokens} (one causal sequence) over {world} ranks: {tokens // world} rows each, "
            f"{steps} timed steps",
            file=out,
        )
        print(f"  SP     : {world} processes, {backend}, bf16 all-gathers; passes sp_gather={mode!r}", file=out)
    out.flush()


def print_report(result: DemoResult, out: TextIO):
    variants = result.variants
    names = [v.name for v in variants]
    width = max(12, *(len(n) + 2 for n in names))
    label_w = 22

    def row(label, cells, w=label_w):
        print(f"  {label:<{w}}" + "".join(f"{cell:>{width}}" for cell in cells), file=out)

    eager_ms = variants[0].step_ms
    print(file=out)
    row("", names)
    row("time per step", [f"{v.step_ms:.3f} ms" for v in variants])
    row("speedup vs eager", [f"{eager_ms / v.step_ms:.2f}x" for v in variants])
    row("first call", [f"{v.first_call_s:.2f} s" for v in variants])
    marks = {None: "(ref)", True: "yes", False: "NO"}
    row("bitwise == eager", [marks[v.bitwise_vs_eager] for v in variants])
    if sum(v.launches is not None for v in variants) > 1:
        print("  (first call: compile included; a later compile of the same model reuses Dynamo's and", file=out)
        print("   Inductor's caches, so the first calls do not compare what the passes cost to compile)", file=out)
    if result.device.type == "cpu":
        print("  (on CPU the mxfuse ops run their plain-PyTorch reference code, not the Triton kernels:", file=out)
        print("   these times say nothing about the GPU)", file=out)
    else:
        timings = sorted({v.timing for v in variants})
        how = {"cuda graph": "GPU time of one step replayed as a CUDA graph", "wall clock": "wall clock, synchronized"}
        print(f"  (time per step: {'; '.join(how[t] for t in timings)}; median of {result.steps} steps)", file=out)

    launches = {v.name: v.launches for v in variants if v.launches is not None}
    if launches:
        print(file=out)
        print(f"kernel launches per step, counted in the code Inductor generated ({COUNTED}):", file=out)
        families = (CPP_KERNELS, TRITON_KERNELS)
        keys = sorted({k for counts in launches.values() for k in counts}, key=lambda k: (k not in families, k))
        w = max(label_w, *(len(k) for k in keys))
        row("", list(launches), w)
        for k in keys:
            row(k + (" (wait)" if k in NOT_LAUNCHES else ""), [str(c.get(k, 0)) for c in launches.values()], w)
        row("total launches", [str(total_launches(c)) for c in launches.values()], w)

    passes = next((v for v in variants if v.report is not None), None)
    if passes is not None and passes.report is not None:
        print_pass_summary(result, passes.report, out)

    print(file=out)
    for v in variants[1:]:
        if v.bitwise_vs_eager:
            print(f"bitwise check PASSED: {v.name} output == eager output ({v.output_desc}, every bit)", file=out)
        else:
            print(f"bitwise check FAILED: {v.name} output != eager output (max |diff| {v.max_abs_diff})", file=out)
    if passes is not None:
        verdict = "PASSED" if passes.bitwise_vs_compiled else "FAILED"
        relation = "==" if passes.bitwise_vs_compiled else "!="
        print(
            f"bitwise check {verdict}: with the mxfuse passes {relation} without them "
            f"(compiled output, {passes.output_desc})",
            file=out,
        )
    if result.rank_checks:
        bad = [i for i, r in enumerate(result.rank_checks) if any(flag is False for flag in r.values())]
        n = len(result.rank_checks)
        if bad:
            print(f"bitwise check FAILED on rank(s) {bad} of {n}: {result.rank_checks}", file=out)
        else:
            print(f"bitwise check PASSED on every rank ({n}/{n}): passes == no passes == eager SP", file=out)
    out.flush()


def print_pass_summary(result: DemoResult, report: PassReport, out: TextIO):
    matched = report.matched_text()
    print(file=out)
    if report.failed:
        print(f"the mxfuse pass FAILED and left the graph unchanged: {report.failed}", file=out)
    print("patterns matched (from the pass report):", file=out)
    if not matched:
        print("  none", file=out)
    kind_w = max((len(k) for k, _ in matched), default=0)
    for kind, n in matched:
        print(f"  {kind:<{kind_w}}  x{n}", file=out)
    if report.skipped:
        print(f"  left alone: {len(report.skipped)} (see `mxfuse explain` for why)", file=out)
    gone, kept = report.fused_producers()
    act_muls = report.fused_act_muls()  # their y is [M, I]: counted on a line of their own below
    gone -= act_muls
    m, k = result.rows, result.config.hidden
    per_norm = 2 * m * k * 2
    total = gone * per_norm + kept * m * k * 2
    layers = result.config.n_layers
    print("bf16 bytes no longer going to memory: 2*M*K*2 B per fused norm (its bf16 y, written once and", file=out)
    rows = f"{m} rows{' per rank' if result.world > 1 else ''}"
    print(f"  read back by the quant; M = {rows}, K = {k}) = {kib(per_norm)}", file=out)
    extra = f" + {kept} fused norm(s) that still write y (read saved: M*K*2 B)" if kept else ""
    print(
        f"  {gone} fused norm(s){extra} = {kib(total)} per step, "
        f"{kib(total / layers)} per layer ({counted(layers, 'layer')})",
        file=out,
    )
    if act_muls:
        i = result.config.intermediate
        saved = kib(act_muls * 2 * m * i * 2)
        print(f"  {act_muls} fused act·mul(s) (down_proj's input, 2*M*I*2 B each, I = {i}) = {saved}", file=out)
    packed = report.packed_gathers()
    if packed and result.world > 1:
        w = result.world
        print(
            f"all-gathers carrying packed MXFP8 instead of bf16: {packed}; each gathers W*M*(K + K/32) B "
            f"= {kib(w * m * packed_width(k))} instead of W*M*K*2 B = {kib(w * m * k * 2)} (W = {w})",
            file=out,
        )
