"""The `mxfuse` command (also `python -m mxfuse`).

Subcommands:

- ``mxfuse demo``: build the reference MiniMax-M3-style decoder stack
  (:mod:`mxfuse.models`) on the best device present, run it eagerly, under
  ``torch.compile`` and under ``torch.compile`` with the mxfuse passes; print the
  patterns the passes matched, the kernel launches counted in the code Inductor
  generated for each, the bf16 bytes that no longer go to memory, the bitwise check
  (passes == no passes == eager) and the time per step. ``--sp N`` runs the
  sequence-parallel form on N processes (gloo on CPU, NCCL on N GPUs).
- ``mxfuse dump --out DIR``: compile with depyf's debug dump and the passes' own
  before/after graphs; write ``DIR/INDEX.md`` saying which file shows what.
- ``mxfuse explain``: for every Gemma norm of the compiled graph, whether it fused
  and, if not, why (:mod:`mxfuse.passes.explain`).

vLLM is never imported here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import re
import statistics
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import torch

from mxfuse.models import CONFIG_NAMES, Model, ModelConfig, compile_model, example_inputs, local_rows
from mxfuse.passes.options import SP_GATHER_MODES, PassOptions
from mxfuse.passes.post_grad import MxfusePass, PassReport

log = logging.getLogger(__name__)

DEFAULT_TOKENS = {"tiny": 128, "m3-flash-tp4": 1024}


# ------------------------------------------------------------------- helpers


def pick_device(name: str = "auto") -> torch.device:
    """`auto` -> cuda when a GPU is usable, else cpu; `cuda` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mxfuse demo: --device cuda was asked for but no CUDA GPU is available")
    return torch.device(name)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaNs with equal payloads compare equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.element_size() in (1, 2, 4, 8):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """A one-line progress indicator: `label ... done in X s` (a live timer on a terminal)."""

    def __init__(self, label: str, out: TextIO):
        self.label, self.out = label, out
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.out.write(f"{self.label} ...")
        self.out.flush()
        if self.live:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def _tick(self):
        spinner = "|/-\\"
        i = 0
        while not self._stop.wait(0.25):
            elapsed = time.perf_counter() - self.t0
            self.out.write(f"\r{self.label} ... {spinner[i % 4]} {elapsed:5.1f} s")
            self.out.flush()
            i += 1

    def __exit__(self, exc_type, exc, tb):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.elapsed = time.perf_counter() - self.t0
        prefix = f"\r{self.label} ..." if self.live else ""
        status = "failed" if exc_type else "done"
        self.out.write(f"{prefix} {status} in {self.elapsed:.1f} s" + (" " * 8 if self.live else "") + "\n")
        self.out.flush()
        return False




# ------------------------------------------------- what Inductor generated


@contextlib.contextmanager
def capture_wrapper_code(codes: list[str]):
    """Collect the Python wrapper source of every graph Inductor compiles inside the block.

    The hook of `torch._inductor.utils.run_and_get_code` without its `dynamo.reset()`;
    caches are disabled so that every graph is really compiled (and the passes run).
    """
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    with (
        mock.patch.object(GraphLowering, "save_output_code", lambda code: codes.append(code)),
        torch._inductor.config.patch(force_disable_caches=True),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message=".*force disabled by.*force_disable_caches")
        yield codes


_KERNEL_CALL = re.compile(r"(?<![\w.])(cpp_fused_\w+)\(|(?<![\w.])(triton_\w+)\.run\(")
_EXTERN_CALL = re.compile(r"(?<![\w.])torch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\(|(?<![\w.])extern_kernels\.(\w+)\(")
CPP_KERNELS = "Inductor C++ kernels (cpp_fused_*)"
TRITON_KERNELS = "Inductor Triton kernels (triton_*.run)"
NOT_LAUNCHES = ("_c10d_functional.wait_tensor",)
COUNTED = (
    "the calls in call() of its wrapper: cpp_fused_* / triton_*.run kernels,\n"
    "  torch.ops.<ns>.<op> and extern_kernels.* ops; waits not counted"
)


def call_body(code: str) -> list[str]:
    """The lines of `def call(...)` in an Inductor wrapper module (comments dropped)."""
    lines = code.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\s*def call\(", line)), None)
    if start is None:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if stripped and len(line) - len(line.lstrip()) <= indent:
            break
        if stripped and not stripped.startswith("#"):
            body.append(stripped)
    return body


def count_launches(codes: list[str]) -> collections.Counter:
    """`{what: calls}` over the `call()` of each wrapper: Inductor kernels by family, extern ops by name."""
    counts: collections.Counter = collections.Counter()
    for code in codes:
        for line in call_body(code):
            for cpp, triton in _KERNEL_CALL.findall(line):
                counts[CPP_KERNELS if cpp else TRITON_KERNELS] += 1
            for ns, op, extern in _EXTERN_CALL.findall(line):
                counts[f"{ns}.{op}" if ns else f"extern_kernels.{extern}"] += 1
    return counts


def total_launches(counts: collections.Counter) -> int:
    return sum(n for what, n in counts.items() if what not in NOT_LAUNCHES)


class RecordingPass(MxfusePass):
    """The mxfuse pass, keeping each graph's report (and, with `explain`, the per-norm verdicts)."""

    def __init__(self, options: PassOptions, explain: bool = False):
        super().__init__(options)
        self.explain = explain
        self.reports: list[PassReport] = []
        self.verdicts: list[list] = []
        self.quant_inputs: list[list] = []

    def __call__(self, graph):
        from mxfuse.passes import explain as ex
        from mxfuse.passes import post_grad

        before = ex.copy_graph(graph) if self.explain else None
        self.last_report = post_grad.run(graph, self.options)
        self.reports.append(self.last_report)
        if before is not None:
            self.verdicts.append(ex.explain_run(before, graph, self.last_report, self.options))
            self.quant_inputs.append(ex.unmatched_quant_inputs(before))

    def merged_report(self) -> dict:
        matched: collections.Counter = collections.Counter()
        out = {"matched": matched, "skipped": [], "replaced_nodes": [], "failed": None, "dumps": []}
        for r in self.reports:
            matched.update(r.matched)
            d = r.as_dict()
            for key in ("skipped", "replaced_nodes", "dumps"):
                out[key] += d[key]
            out["failed"] = out["failed"] or r.failed
        out["matched"] = dict(matched)
        return out


def compile_with(fn, pass_obj: MxfusePass | None):
    """`torch.compile(fn, fullgraph=True)` with `pass_obj` as Inductor's post-grad custom pass."""
    options = {"post_grad_custom_post_pass": pass_obj} if pass_obj is not None else None
    return torch.compile(fn, fullgraph=True, options=options)


_NORM_FUSION = re.compile(r"^\w+:(plain|fused_add)->")


def fused_norms(matched: dict) -> tuple[int, int]:
    """`(norms whose bf16 y no longer goes to memory, norms fused that still write y)` from the matched kinds."""
    gone = kept = 0
    for kind, n in matched.items():
        if not _NORM_FUSION.match(kind) or "(unfused)" in kind:
            continue
        if "+y" in kind or "+bf16_gather" in kind:
            kept += n
        else:
            gone += n
    return gone, kept


def _kib(n: float) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n:.0f} B"


# ---------------------------------------------------------------------- demo


@dataclass
class VariantResult:
    name: str
    output: torch.Tensor | None
    step_ms: float
    first_call_s: float
    bitwise_vs_eager: bool | None = None
    max_abs_diff: float | None = None
    bitwise_vs_compiled: bool | None = None  # the passes variant vs. compiled without them
    launches: collections.Counter | None = None
    report: dict | None = None
    output_desc: str = ""
    timing: str = "wall clock"  # how step_ms was measured (see `step_time_ms`)


@dataclass
class DemoResult:
    device: torch.device
    config: ModelConfig
    tokens: int
    variants: list[VariantResult] = field(default_factory=list)
    world: int = 1
    rank_checks: list[dict] = field(default_factory=list)  # SP: per rank, {variant: bitwise flags}
    sp_gather: str = "auto"
    steps: int = 0

    @property
    def rows(self) -> int:
        return self.tokens // self.world

    @property
    def passed(self) -> bool:
        local = all(v.bitwise_vs_eager is not False and v.bitwise_vs_compiled is not False for v in self.variants)
        return local and all(all(flag is not False for flag in r.values()) for r in self.rank_checks)


PASSES_VARIANT = "mxfuse passes"


def demo_variants(model: torch.nn.Module, pass_options: PassOptions | None = None):
    """`(name, callable, progress label or None, pass or None)` of every variant; the first is the reference."""
    pass_obj = RecordingPass(pass_options or PassOptions())
    return [
        ("eager", model, None, None),
        ("compiled", compile_model(model, None, fullgraph=True), "compiling with torch.compile (inductor)", None),
        (PASSES_VARIANT, compile_with(model, pass_obj), "compiling with torch.compile + the mxfuse passes", pass_obj),
    ]


def time_steps(fn: Callable, x: torch.Tensor, steps: int, device: torch.device, warmup: int = 2) -> float:
    """Median wall time of one call in ms over `steps` calls (each synchronized), after `warmup` calls."""
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            fn(x)
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            fn(x)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_graph_step_ms(fn: Callable, x: torch.Tensor, steps: int, device: torch.device, warmup: int = 2) -> float:
    """Median GPU time in ms of one step captured in a CUDA graph, over `steps` replays.

    A ~ms step timed by the wall clock measures the host (Python, launches) as much as the
    GPU and swings by tens of percent between runs on a shared machine; a graph replay
    times the kernels the step launches, which is what the passes change."""
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(x)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x)
        graph.replay()
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def step_time_ms(fn: Callable, x: torch.Tensor, steps: int, device: torch.device, graphs: bool) -> tuple[float, str]:
    """(ms per step, how it was measured): a CUDA-graph replay on CUDA when `graphs`, else
    (CPU, collectives, or a step that cannot be captured) the synchronized wall clock."""
    if graphs and device.type == "cuda":
        try:
            return cuda_graph_step_ms(fn, x, steps, device), "cuda graph"
        except Exception as error:  # noqa: BLE001 - e.g. a host sync inside the step
            torch.cuda.synchronize(device)
            log.debug("CUDA-graph timing failed (%s); wall clock instead", error)
    return time_steps(fn, x, steps, device), "wall clock"


def run_variants(model, x, device, steps, progress: Callable, pass_options: PassOptions | None = None, graphs=True):
    """Run, check and time every demo variant; `progress(label)` is a context manager around each first call."""
    results: list[VariantResult] = []
    for name, fn, label, pass_obj in demo_variants(model, pass_options):
        codes: list[str] = []
        capture = capture_wrapper_code(codes) if label else contextlib.nullcontext()
        with progress(label or f"running {name}") as p, capture, torch.inference_mode():
            y = fn(x)
            _sync(device)
        step_ms, timing = step_time_ms(fn, x, steps, device, graphs)
        v = VariantResult(name, y, step_ms, p.elapsed, timing=timing)
        v.output_desc = f"{'x'.join(str(d) for d in y.shape)} {str(y.dtype).removeprefix('torch.')}"
        if label:
            v.launches = count_launches(codes)
        if pass_obj is not None:
            v.report = pass_obj.merged_report()
        if results:
            ref = results[0].output
            v.bitwise_vs_eager = bitwise_equal(y, ref)
            v.max_abs_diff = (y.float() - ref.float()).abs().max().item() if y.shape == ref.shape else None
        if pass_obj is not None:
            compiled = next(r for r in results if r.name == "compiled")
            v.bitwise_vs_compiled = bitwise_equal(y, compiled.output)
        results.append(v)
    return results


def _print_header(config: ModelConfig, tokens: int, device: torch.device, steps: int, out: TextIO, sp=None):
    c = config
    print("mxfuse demo: reference MiniMax-M3-style decoder stack (MXFP8 linears, Gemma norms)", file=out)
    dev_desc = str(device)
    if device.type == "cuda":
        dev_desc += f" ({torch.cuda.get_device_name(device)})"
    else:
        dev_desc += f" ({torch.get_num_threads()} threads)"
    print(f"  device : {dev_desc}, torch {torch.__version__}", file=out)
    print(
        f"  config : {c.name}: hidden {c.hidden}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv heads"
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


def run_demo(
    config: ModelConfig,
    tokens: int,
    device: torch.device,
    steps: int = 5,
    out: TextIO | None = None,
    pass_options: PassOptions | None = None,
) -> DemoResult:
    out = out or sys.stdout
    _print_header(config, tokens, device, steps, out)
    with Progress(f"building the model on {device}", out):
        model = Model(config, device=device).eval()
        x = example_inputs(config, tokens, device)
    result = DemoResult(device, config, tokens, sp_gather=(pass_options or PassOptions()).sp_gather, steps=steps)
    result.variants = run_variants(model, x, device, steps, lambda label: Progress(label, out), pass_options)
    print_report(result, out)
    return result


def print_report(result: DemoResult, out: TextIO):
    variants = result.variants
    names = [v.name for v in variants]
    width = max(12, *(len(n) + 2 for n in names))
    label_w = 22

    def row(label, cells, w=label_w):
        print(f"  {label:<{w}}" + "".join(f"{cell:>{width}}" for cell in cells), file=out)

    eager_ms = variants[0].step_ms
    print("", file=out)
    row("", names)
    row("time per step", [f"{v.step_ms:.3f} ms" for v in variants])
    row("speedup vs eager", [f"{eager_ms / v.step_ms:.2f}x" for v in variants])
    row("first call", [f"{v.first_call_s:.2f} s" for v in variants])
    marks = {None: "(ref)", True: "yes", False: "NO"}
    row("bitwise == eager", [marks[v.bitwise_vs_eager] for v in variants])
    if result.device.type == "cpu":
        print("  (on CPU the mxfuse ops run their plain-PyTorch reference code, not the Triton kernels:", file=out)
        print("   these times say nothing about the GPU)", file=out)
    else:
        timings = sorted({v.timing for v in variants})
        how = {"cuda graph": "GPU time of one step replayed as a CUDA graph", "wall clock": "wall clock, synchronized"}
        print(f"  (time per step: {'; '.join(how[t] for t in timings)}; median of {result.steps} steps)", file=out)

    compiled = [v for v in variants if v.launches is not None]
    if compiled:
        print("", file=out)
        print(f"kernel launches per step, counted in the code Inductor generated ({COUNTED}):", file=out)
        families = (CPP_KERNELS, TRITON_KERNELS)
        keys = sorted({k for v in compiled for k in v.launches}, key=lambda k: (k not in families, k))
        w = max(label_w, *(len(k) for k in keys))
        row("", [v.name for v in compiled], w)
        for k in keys:
            row(k + (" (wait)" if k in NOT_LAUNCHES else ""), [str(v.launches.get(k, 0)) for v in compiled], w)
        row("total launches", [str(total_launches(v.launches)) for v in compiled], w)

    passes = next((v for v in variants if v.report is not None), None)
    if passes is not None:
        _print_pass_summary(result, passes, out)

    print("", file=out)
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


def _print_pass_summary(result: DemoResult, passes: VariantResult, out: TextIO):
    report = passes.report
    matched = report["matched"]
    print("", file=out)
    if report["failed"]:
        print(f"the mxfuse pass FAILED and left the graph unchanged: {report['failed']}", file=out)
    print("patterns matched (from the pass report):", file=out)
    if not matched:
        print("  none", file=out)
    kind_w = max((len(k) for k in matched), default=0)
    for kind, n in sorted(matched.items()):
        print(f"  {kind:<{kind_w}}  x{n}", file=out)
    if report["skipped"]:
        print(f"  left alone: {len(report['skipped'])} (see `mxfuse explain` for why)", file=out)
    gone, kept = fused_norms(matched)
    m, k = result.rows, result.config.hidden
    per_norm = 2 * m * k * 2
    total = gone * per_norm + kept * m * k * 2
    layers = result.config.n_layers
    print("bf16 bytes no longer going to memory: 2*M*K*2 B per fused norm (its bf16 y, written once and", file=out)
    rows = f"{m} rows{' per rank' if result.world > 1 else ''}"
    print(f"  read back by the quant; M = {rows}, K = {k}) = {_kib(per_norm)}", file=out)
    extra = f" + {kept} fused norm(s) that still write y (read saved: M*K*2 B)" if kept else ""
    plural = "s" if layers > 1 else ""
    print(
        f"  {gone} fused norm(s){extra} = {_kib(total)} per step, "
        f"{_kib(total / layers)} per layer ({layers} layer{plural})",
        file=out,
    )
    packed = sum(n for kind, n in matched.items() if "mxfp8_packed" in kind)
    if packed and result.world > 1:
        w = result.world
        print(
            f"all-gathers carrying packed MXFP8 instead of bf16: {packed}; each gathers W*M*(K + K/32) B "
            f"= {_kib(w * m * (k + k // 32))} instead of W*M*K*2 B = {_kib(w * m * k * 2)} (W = {w})",
            file=out,
        )


# --------------------------------------------------------------- demo --sp N


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _QueueProgress:
    """Progress events of rank 0 sent to the parent process (which draws the indicator)."""

    def __init__(self, queue, label, enabled):
        self.queue, self.label, self.enabled = queue, label, enabled

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.enabled:
            self.queue.put(("start", self.label))
        return self

    def __exit__(self, exc_type, exc, tb):
        self.elapsed = time.perf_counter() - self.t0
        if self.enabled:
            self.queue.put(("end", exc_type is None))
        return False


def _sp_worker(rank, world, port, backend, config, tokens, steps, pass_options, queue):
    try:
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        warnings.filterwarnings("ignore")
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(backend, rank=rank, world_size=world)
        with _QueueProgress(queue, f"building the SP model on {world} ranks", rank == 0):
            model = Model(config, sp_group=dist.group.WORLD, device=device).eval()
            x = local_rows(example_inputs(config, tokens, device), rank, world)
        variants = run_variants(  # wall clock: NCCL collectives are not captured into graphs here
            model, x, device, steps, lambda label: _QueueProgress(queue, label, rank == 0), pass_options, graphs=False
        )
        checks = {}
        for v in variants:
            v.output = None  # tensors stay in the worker
            if v.bitwise_vs_eager is not None:
                checks[f"{v.name} == eager"] = v.bitwise_vs_eager
            if v.bitwise_vs_compiled is not None:
                checks[f"{v.name} == compiled"] = v.bitwise_vs_compiled
        dist.barrier()
        dist.destroy_process_group()
        queue.put(("result", rank, variants if rank == 0 else None, checks, str(device)))
    except BaseException:  # report, never hang the parent
        queue.put(("error", rank, traceback.format_exc()))


def run_demo_sp(
    config: ModelConfig,
    tokens: int,
    world: int,
    device_name: str = "auto",
    steps: int = 5,
    out: TextIO | None = None,
    pass_options: PassOptions | None = None,
    timeout_s: float = 900,
) -> DemoResult:
    """The demo on `world` local processes with the SP model: gloo on CPU, NCCL when `world` GPUs exist."""
    import torch.multiprocessing as mp

    out = out or sys.stdout
    pass_options = pass_options or PassOptions()
    if tokens % world:
        raise SystemExit(f"mxfuse demo --sp {world}: --tokens {tokens} is not a multiple of {world}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_name == "cuda" and gpus < world:
        raise SystemExit(f"mxfuse demo --sp {world} --device cuda: only {gpus} GPU(s) present")
    use_gpus = device_name in ("auto", "cuda") and gpus >= world
    backend, device = ("nccl", torch.device("cuda", 0)) if use_gpus else ("gloo", torch.device("cpu"))
    _print_header(config, tokens, device, steps, out, sp=(world, f"{backend} on {device.type}", pass_options.sp_gather))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    args = (world, port, backend, config, tokens, steps, pass_options, queue)
    procs = [ctx.Process(target=_sp_worker, args=(rank, *args), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    progress = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            msg = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if msg[0] == "start":
                progress = Progress(f"[rank 0] {msg[1]}", out).__enter__()
            elif msg[0] == "end" and progress is not None:
                progress.__exit__(None if msg[1] else RuntimeError, None, None)
                progress = None
            elif msg[0] == "error":
                if progress is not None:
                    progress.__exit__(RuntimeError, None, None)
                raise SystemExit(f"mxfuse demo --sp {world}: rank {msg[1]} failed:\n{msg[2]}")
            elif msg[0] == "result":
                results[msg[1]] = msg[2:]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    result = DemoResult(device, config, tokens, world=world, sp_gather=pass_options.sp_gather, steps=steps)
    result.variants = results[0][0]
    result.rank_checks = [results[r][1] for r in range(world)]
    print_report(result, out)
    return result


# ---------------------------------------------------------- dump / explain

MODEL_NAMES = ("reference", "hf-minimax-m3")


@dataclass
class Target:
    """What dump/explain compile: a callable, its input, and words about it."""

    fn: Callable
    x: torch.Tensor
    description: str


def build_target(args, device: torch.device) -> Target:
    if args.model == "hf-minimax-m3":
        try:
            from mxfuse.hf import tiny_minimax_m3_example

            fn, x = tiny_minimax_m3_example(args.tokens)
        except ImportError as e:
            raise SystemExit(f"mxfuse: --model hf-minimax-m3 needs transformers with MiniMax-M3 ({e})") from None
        desc = f"Hugging Face MiniMaxM3VLDecoderLayer (tiny: hidden 128, MXFP8 linears), {args.tokens} tokens, cpu"
        return Target(fn, x, desc)
    overrides = {"n_layers": args.layers} if args.layers is not None else {}
    config = ModelConfig.by_name(args.config, **overrides)
    model = Model(config, device=device).eval()
    desc = f"reference decoder ({config.name}: hidden {config.hidden}, {config.n_layers} layers)"
    desc += f", {args.tokens} tokens, {device}"
    return Target(model, example_inputs(config, args.tokens, device), desc)


def pass_options_from(args, dump_dir: str | None = None) -> PassOptions:
    return PassOptions(fuse_norm_quant=not args.no_fuse_norm_quant, sp_gather=args.sp_gather, dump_dir=dump_dir)


def _options_text(options: PassOptions) -> str:
    return f"fuse_norm_quant={options.fuse_norm_quant}, sp_gather={options.sp_gather!r}"


def compile_and_run(target: Target, pass_obj: MxfusePass, label: str, out: TextIO):
    torch._dynamo.reset()
    compiled = compile_with(target.fn, pass_obj)
    codes: list[str] = []
    with Progress(label, out), capture_wrapper_code(codes), torch.inference_mode():
        compiled(target.x)
    return compiled, codes


_DEPYF_FILES = (
    ("full_code_for_*.py", "START HERE: the compiled function as Python: Dynamo's transformed bytecode, decompiled, "
     "with the source of every graph and guard it calls"),
    ("__transformed_code_*.py", "Dynamo's rewritten Python for one function (calls __compiled_fn_*)"),
    ("*BEFORE_PRE_GRAD*.py", "the FX graph Dynamo captured (torch-level ops), as Inductor receives it"),
    ("*pre_insert_deferred_runtime_asserts*.py", "Dynamo's graph before its runtime asserts were inserted (internal)"),
    ("__compiled_fn_*.__compiled_fn_*.py", "the FX graph Dynamo captured (torch-level ops)"),
    ("*Captured_Graph*.py", "the FX graph Dynamo captured (torch-level ops)"),
    ("*tensorify_python_scalars*.py", "AOTAutograd's graph after its tensorify-scalars pass (ATen ops)"),
    ("*Forward_graph*.py", "AOTAutograd's forward graph (ATen ops): what Inductor lowers, before its post-grad passes"),
    ("*AFTER_POST_GRAD*.py", "the graph after Inductor's post-grad passes, mxfuse's included (fused ops here)"),
    ("*kernel*.py", "the code Inductor generated: kernels and the wrapper whose call() launches them"),
)


def _describe_depyf(name: str) -> str:
    import fnmatch

    for pattern, what in _DEPYF_FILES:
        if fnmatch.fnmatch(name.replace(" ", "_"), pattern):
            return what
    return "written by depyf"


def write_index(out_dir: Path, target: Target, options: PassOptions, report: dict, codes: list[str]) -> Path:
    mx_dir = out_dir / "mxfuse"
    lines = [
        "# mxfuse dump",
        "",
        f"- model: {target.description}",
        f"- pass options: {_options_text(options)}",
        f"- torch {torch.__version__}",
        "",
        "## Files",
        "",
        "| file | what it shows |",
        "|---|---|",
    ]
    for path in sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != "INDEX.md"):
        lines.append(f"| `{path.name}` | {_describe_depyf(path.name)} |")
    mx_files = sorted(mx_dir.glob("mxfuse_*")) if mx_dir.is_dir() else []
    for path in mx_files:
        stage = path.name.split(".")[-2]
        what = {
            "before": "the post-grad FX graph handed to the mxfuse passes (Inductor's own post-grad passes done)",
            "after": "the same graph after the mxfuse passes: the fused `torch.ops.mxfuse.*_mxfp8` ops",
            "report": "the pass report: matched kinds, skipped norms with reasons, replaced nodes",
        }.get(stage, "")
        lines.append(f"| `mxfuse/{path.name}` | {what} |")
    if not mx_files:
        lines.append("| `mxfuse/` | nothing: the passes changed no graph (they dump only graphs they changed) |")
    lines += ["", "## What the passes did", ""]
    if report["failed"]:
        lines.append(f"The pass FAILED and left the graph unchanged: {report['failed']}")
    matched = report["matched"]
    lines.append("Matched (kind x count): " + (", ".join(f"`{k}` x{n}" for k, n in sorted(matched.items())) or "none"))
    lines.append("")
    replaced = report["replaced_nodes"]
    lines.append(
        "Replaced nodes (names in the `before` graph): " + (", ".join(f"`{n}`" for n in replaced) or "none")
    )
    before = [p for p in mx_files if p.name.endswith(".before.py")]
    if before and replaced:
        names = set(replaced)
        code = [
            f"{i + 1:4d}  {line.strip().split(';  ')[0]}"
            for i, line in enumerate(before[0].read_text().splitlines())
            if (m := re.match(r"\s*(\w+)(?:: \"[^\"]*\")? = ", line)) and m.group(1) in names
        ]
        lines += ["", f"Those nodes in `mxfuse/{before[0].name}` (line, code):", "", "```", *code[:40], "```", ""]
    for rewrite, kind, node, reason in (tuple(s.values()) for s in report["skipped"]):
        lines.append(f"- left alone by {rewrite}: `{node}` ({kind}): {reason}")
    after = [p for p in mx_files if p.name.endswith(".after.py")]
    if after:
        fused = [
            f"{i + 1:4d}  {line.strip().split(';  ')[0]}"
            for i, line in enumerate(after[0].read_text().splitlines())
            if re.search(r"torch\.ops\.mxfuse\.\w+_mxfp8\w*\.", line)
        ]
        lines += ["", f"Fused ops in `mxfuse/{after[0].name}` (line, code):", "", "```", *fused[:20], "```"]
    counts = count_launches(codes)
    counted = COUNTED.replace("\n ", "")
    lines += ["", f"Kernel launches in the code Inductor generated ({counted}): {total_launches(counts)}", ""]
    lines += [f"- {k}: {n}" for k, n in sorted(counts.items())]
    index = out_dir / "INDEX.md"
    index.write_text("\n".join(lines) + "\n")
    return index


def _cmd_dump(args, out: TextIO) -> int:
    try:
        import depyf
    except ImportError:
        raise SystemExit("mxfuse dump needs depyf: pip install depyf") from None
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device) if args.model == "reference" else torch.device("cpu")
    target = build_target(args, device)
    options = pass_options_from(args, dump_dir=str(out_dir / "mxfuse"))
    pass_obj = RecordingPass(options)
    print(f"mxfuse dump: {target.description}; passes: {_options_text(options)}", file=out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with depyf.prepare_debug(str(out_dir)):
            label = "compiling with depyf's dump and the mxfuse passes"
            compiled, codes = compile_and_run(target, pass_obj, label, out)
    report = pass_obj.merged_report()
    index = write_index(out_dir, target, options, report, codes)
    files = sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file())
    print(f"wrote {len(files)} files under {out_dir}", file=out)
    matched = ", ".join(f"{k} x{n}" for k, n in sorted(report["matched"].items())) or "nothing"
    print(f"  passes matched: {matched}", file=out)
    for p in files:
        if p.parts[0] == "mxfuse":
            print(f"  {p}", file=out)
    print(f"  index: {index}  (which file shows what, and the nodes replaced)", file=out)
    del compiled
    return 0 if not report["failed"] else 1


def _cmd_explain(args, out: TextIO) -> int:
    device = pick_device(args.device) if args.model == "reference" else torch.device("cpu")
    target = build_target(args, device)
    options = pass_options_from(args)
    pass_obj = RecordingPass(options, explain=True)
    print(f"mxfuse explain: {target.description}; passes: {_options_text(options)}", file=out)
    compile_and_run(target, pass_obj, "compiling", out)
    n_fused = n_total = 0
    for i, (verdicts, quants) in enumerate(zip(pass_obj.verdicts, pass_obj.quant_inputs)):
        fused = sum(v.fused for v in verdicts)
        n_fused, n_total = n_fused + fused, n_total + len(verdicts)
        print(f"graph {i}: {len(verdicts)} Gemma norms, {fused} fused, {len(verdicts) - fused} not fused", file=out)
        for v in verdicts:
            where = " ".join(filter(None, (v.module, f"at {v.source}" if v.source else None)))
            print(f"  {v.node} [{v.kind}] {where}".rstrip(), file=out)
            if v.source_line and args.source:
                print(f"      {v.source_line}", file=out)
            print(f"    {'fused: ' if v.fused else 'not fused: '}{v.detail}", file=out)
        if quants:
            producers = collections.Counter(q.producer for q in quants)
            print(f"  MXFP8 quants not fed by a Gemma norm (left as they are): {len(quants)}", file=out)
            for p, n in sorted(producers.items()):
                print(f"    {n} read {p}", file=out)
            for q in quants:
                if q.looks_like_norm:
                    print(f"    {q.quant}: its input comes from {q.producer}, which looks like a norm but is not a "
                          "form the recognizers know (mxfuse, flashinfer, vllm_ir, Hugging Face ATen)", file=out)
    print(f"{n_fused} of {n_total} Gemma norms fused", file=out)
    return 0 if not pass_obj.merged_report()["failed"] else 1


# ----------------------------------------------------------------------- CLI


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", choices=MODEL_NAMES, default="reference", help="what to compile (default: reference)")
    p.add_argument("--tokens", type=int, default=64, help="tokens (rows) of the input (default 64)")
    p.add_argument("--config", choices=CONFIG_NAMES, default="tiny", help="reference model shapes (default: tiny)")
    p.add_argument("--layers", type=int, default=None, help="reference model: override the number of layers")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="cpu", help="reference model device (default cpu)"
    )
    _add_pass_args(p)


def _add_pass_args(p: argparse.ArgumentParser):
    p.add_argument("--sp-gather", choices=SP_GATHER_MODES, default="auto", help="pass option sp_gather (default auto)")
    p.add_argument("--no-fuse-norm-quant", action="store_true", help="pass option fuse_norm_quant=False")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxfuse", description="Inductor passes that fuse Gemma RMSNorm with MXFP8 quantization."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run the reference MXFP8 decoder eagerly, compiled, and compiled with the passes; compare and time",
        description="Build the reference MiniMax-M3-style decoder (random weights, MXFP8 linears, Gemma norms), "
        "run it eagerly, under torch.compile and under torch.compile with the mxfuse passes; print the patterns "
        "matched, the kernel launches counted in Inductor's generated code, the bytes saved, the bitwise checks "
        "and the time per step.",
    )
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if present")
    demo.add_argument("--tokens", type=int, default=None, help="tokens (rows); default 128 (tiny) / 1024 (m3)")
    demo.add_argument("--config", choices=CONFIG_NAMES, default="tiny", help="model shapes (default: tiny)")
    demo.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    demo.add_argument("--steps", type=int, default=10, help="timed steps per variant, median reported (default 10)")
    demo.add_argument(
        "--native-activation",
        action="store_true",
        help="SwiGLU as plain PyTorch that Inductor fuses (bitwise vs. eager guaranteed only on CPU)",
    )
    demo.add_argument(
        "--sp", type=int, default=None, metavar="N",
        help="sequence parallel on N local processes (gloo on CPU; NCCL when N GPUs exist)",
    )
    _add_pass_args(demo)
    demo.set_defaults(func=_cmd_demo)

    dump = sub.add_parser(
        "dump",
        help="compile with depyf's debug dump and the passes' before/after graphs; write DIR/INDEX.md",
        description="Compile a model with depyf.prepare_debug(DIR) and the mxfuse passes dumping their graphs "
        "to DIR/mxfuse, then write DIR/INDEX.md: which file shows what, and which nodes the passes replaced.",
    )
    dump.add_argument("--out", required=True, help="output directory")
    _add_model_args(dump)
    dump.set_defaults(func=_cmd_dump)

    explain = sub.add_parser(
        "explain",
        help="for every Gemma norm of the compiled graph: fused or not, and why",
        description="Compile a model with the mxfuse passes and say, for every Gemma norm of the graph, whether "
        "it fused and if not why, with its module and source line.",
    )
    _add_model_args(explain)
    explain.add_argument("--source", action="store_true", help="also print the source line of each norm")
    explain.set_defaults(func=_cmd_explain)
    return parser


def _cmd_demo(args, out: TextIO) -> int:
    overrides = {}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    if args.native_activation:
        overrides["native_activation"] = True
    config = ModelConfig.by_name(args.config, **overrides)
    tokens = args.tokens if args.tokens is not None else DEFAULT_TOKENS[config.name]
    if tokens < 1 or args.steps < 1:
        raise SystemExit("mxfuse demo: --tokens and --steps must be positive")
    options = pass_options_from(args)
    if args.sp is not None:
        if args.sp < 1:
            raise SystemExit("mxfuse demo: --sp must be positive")
        result = run_demo_sp(config, tokens, args.sp, args.device, steps=args.steps, out=out, pass_options=options)
    else:
        result = run_demo(config, tokens, pick_device(args.device), steps=args.steps, out=out, pass_options=options)
    return 0 if result.passed else 1


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(out or sys.stdout)
        return 2
    if getattr(args, "tokens", None) is not None and args.tokens < 1:
        raise SystemExit("mxfuse: --tokens must be positive")
    return args.func(args, out or sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
