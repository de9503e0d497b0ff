"""Compile every Triton kernel the ops can launch for every target, on a CPU (no GPU needed).

The launches are the launchers' own (`triton_norm_quant.norm_launch`, `triton_mx_quant.quant_launch` /
`swizzle_launch`, `triton_gemm.mxfp8_linear(run=...)`, `triton_act_quant.act_mul_launch`,
`triton_gated_quant.gate_launch` / `gated_norm_launch`) on meta tensors, with the `ISA` a
device of that target gets; each is compiled through Triton's own launch path (the JIT's
argument specialization, then `triton.compile(ASTSource(...), target=GPUTarget(...))`),
so what compiles here is what a launch on that GPU compiles.

Per target it reports registers (NVIDIA: `cuobjdump -res-usage`; AMD: VGPRs / AGPRs /
SGPRs from the AMDGCN metadata), spills and scratch (NVIDIA: local memory and stack
frame; AMD: `.vgpr_spill_count`, `.sgpr_spill_count`, the private segment), shared
memory / LDS, and static machine instructions per element (SASS or AMDGCN instructions
of the kernel over the values one thread holds: the norm kernels have no loop, so the
whole program is the hot path; it includes cold paths such as the swizzled padding fill).

    PYTHONPATH=. python3 tools/compile_targets.py                 # the table for docs/perf_notes.md
    PYTHONPATH=. python3 tools/compile_targets.py --targets cuda:90 --jobs 2
    PYTHONPATH=. python3 tools/compile_targets.py --targets cuda:90,cuda:100,hip:gfx950 --variants dispatch-w8

tests/test_targets_compile.py compiles the same cases and fails on any compile error,
spill or scratch use. Works with Triton 3.6 and 3.8.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch

from mxfuse.ops.mx_layout import FP8_DTYPE, scale_columns
from mxfuse.ops.norm_quant_config import norm_config, padded_row, quant_config, row_chunks
from mxfuse.ops.reference import QuantRule
from mxfuse.ops.triton_targets import COMPILE_TARGETS, NOMINAL_DRAM_BYTES_PER_S, KernelLaunch, isa_of_target

MODEL_KS = (6144, 3072)
"""Hidden sizes of the models served (M3.1 Flash and a smaller one): every flag is compiled at these."""
MAX_K = 16384
"""The K classes go up to this hidden size."""


SHARED_LIMITS = {"cuda:90": 232448, "cuda:100": 232448, "cuda:103": 232448, "hip:gfx942": 65536, "hip:gfx950": 163840}
"""Shared memory / LDS one program may use, bytes (227 KB on Hopper and Blackwell; an AMD CU's LDS)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One launch to compile: a name, the launch, and the values its program holds (0: not a row kernel)."""

    name: str
    launch: KernelLaunch
    values_per_program: int

    def values_per_thread(self, spec: str) -> float:
        lanes = 32 if spec.startswith("cuda") else 64
        return self.values_per_program / (lanes * self.launch.num_warps)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def k_classes(max_k: int = MAX_K, exhaustive: bool = False) -> list[int]:
    """One K per row layout `norm_config` / `row_chunks` produce up to max_k (rows per tile,
    warps, chunks; `exhaustive`: and chunk width), the largest of each (the most values per
    thread), and the model's hidden sizes."""
    by_layout: dict[tuple, int] = {}
    for k in range(32, max_k + 1, 32):
        cfg, (ch, nch) = norm_config(k), row_chunks(k)
        by_layout[(cfg, nch, ch if exhaustive else None)] = k
    return sorted(set(by_layout.values()) | set(MODEL_KS))


M_CLASSES = {"split": 1, "evict": 64, "large": 4096}
"""One M per launch choice `norm_config(k, m)` makes on an H200 (132 SMs): a split row (tiles x
chunks <= SMs), evict_first (up to 8 programs per SM), neither; at 3 chunks a row "large" is
also where the fused plain norm runs the pipelined persistent loop (NVIDIA)."""
HEAVY = dict(swizzled=True, emit_y=True, round_sum=True, round_normalized=True, rule=QuantRule.TORCHAO)
"""Every output flag on: the most live values (residual add with round_sum, y, swizzled scales
and their padding fill, the torchao rule, round_normalized)."""


def _norm_case(name, isa, k, m, *, residual=True, quant=True, **kw) -> Case:
    from mxfuse.ops import triton_norm_quant as tnq

    x, r, w = _meta(m, k), _meta(m, k), _meta(k)
    _, launch = tnq.norm_launch(x, r if residual else None, w, 1e-6, quant=quant, isa=isa, **kw)
    cfg = kw.get("config") or norm_config(k, m, plain_quant=quant and not residual, isa=isa)
    return Case(name, launch, cfg.block_rows * padded_row(k))


def norm_cases(isa: str, exhaustive: bool = False) -> list[Case]:
    """The norm kernel. Every row layout with every flag on (HEAVY); at the model's K the
    split row with every flag on, the fused plain norm (two rows per tile at K 3072), and
    the default forms the ops run most (fused add, row-major; the unfused norm with
    round_normalized and plain). `exhaustive`: every layout at every M class, each flag alone."""
    cases = []
    for k in k_classes(exhaustive=exhaustive):
        for mname, m in (M_CLASSES if exhaustive else {"large": 4096}).items():
            cases.append(_norm_case(f"fused add all-flags K{k} {mname}", isa, k, m, **HEAVY))
    for k in MODEL_KS:
        if not exhaustive:
            cases.append(_norm_case(f"fused add all-flags K{k} split", isa, k, 1, **HEAVY))
        cases.append(_norm_case(f"fused plain all-flags K{k} large", isa, k, 4096, residual=False, **HEAVY))
        for mname, m in M_CLASSES.items():
            if exhaustive or mname != "evict":
                cases.append(_norm_case(f"fused add K{k} {mname}", isa, k, m))
        cases.append(_norm_case(f"norm add round_normalized K{k} large", isa, k, 4096, quant=False,
                                round_normalized=True))  # fmt: skip
        cases.append(_norm_case(f"norm plain K{k} large", isa, k, 4096, residual=False, quant=False))
        if isa == "ptx":  # programmatic dependent launch (NVIDIA only): gdc_wait / launch_dependents
            pdl = norm_config(k, 1).replace(pdl=True)
            cases.append(_norm_case(f"fused add pdl K{k} split", isa, k, 1, config=pdl, swizzled=True))
        if exhaustive:
            cases.append(_norm_case(f"fused plain K{k} large", isa, k, 4096, residual=False))
            for flag, value in HEAVY.items():
                cases.append(_norm_case(f"fused add {flag} K{k} large", isa, k, 4096, **{flag: value}))
    return cases


def quant_cases(isa: str, exhaustive: bool = False) -> list[Case]:
    """The quant kernel: each distinct `quant_config` tile at the model's K and the smallest
    K classes, swizzled with the torchao rule, and the default row-major form."""
    from mxfuse.ops import triton_norm_quant as tnq

    cases, seen = [], set()
    for k in k_classes(exhaustive=True) if exhaustive else (*MODEL_KS, 32):
        for m in (1, 2, 4096) if exhaustive else (1, 4096):
            cfg = quant_config(k, m)
            if cfg in seen:
                continue
            seen.add(cfg)
            forms = [(True, QuantRule.TORCHAO), (False, QuantRule.DEFAULT)]
            for swz, rule in forms if exhaustive or m == 4096 else forms[:1]:
                _, launch = tnq.quant_launch(_meta(m, k), swz, isa=isa, rule=rule)
                what = f"quant K{k} M{m} {'swizzled' if swz else 'rowmajor'} {rule.name.lower()}"
                cases.append(Case(what, launch, cfg.block_rows * cfg.block_cols))
    return cases


def swizzle_cases(isa: str, exhaustive: bool = False) -> list[Case]:
    from mxfuse.ops import triton_norm_quant as tnq

    del isa, exhaustive  # byte moves only, one shape
    _, launch = tnq.swizzle_launch(_meta(37, 192, dtype=torch.uint8))
    return [Case("swizzle", launch, 128 * 16)]


def gemm_cases(isa: str, exhaustive: bool = False) -> list[Case]:
    """The GEMM's kernels in each regime of `gemm_config` (decode split, M < 2048, large M)."""
    from mxfuse.ops import triton_gemm

    del exhaustive  # the regimes are all of gemm_config
    cases = []
    n, k = 4096, 6144
    for m in (16, 512, 4096):
        launches: list[KernelLaunch] = []
        codes, wcodes = _meta(m, k, dtype=FP8_DTYPE), _meta(n, k, dtype=FP8_DTYPE)
        sc, wsc = _meta(m, scale_columns(k), dtype=torch.uint8), _meta(n, scale_columns(k), dtype=torch.uint8)
        triton_gemm.mxfp8_linear(codes, sc, wcodes, wsc, torch.bfloat16, run=launches.append, isa=isa)
        for launch in launches:
            cases.append(Case(f"gemm M{m} {launch.kernel.__name__}", launch, 0))
    return cases


def act_mul_cases(isa: str, exhaustive: bool = False) -> list[Case]:
    """The act·mul kernel (I 1792: a TP-8 shard of 14336): at M 4096 every activation fused (swizzled,
    torchao rule), the unfused SiLU and the fp32 SwiGLU-OAI; at M 1 (the decode tile) the fused SiLU; and
    the fused SiLU in every large-M tile `act_mul_config` picks at the benchmark's I (128..1024 columns,
    1..16 rows; on an H200's memory and on an H100's) and in a mid-M tile of 4, of 8 and of 16 values a
    thread; on NVIDIA the decode tile launched with PDL; SiLU and GELU-tanh at M 1024 with the default launch's
    register cap (`load_first_registers`, an H100's tiles) and GELU-tanh's H100 default at M 4096
    (`issue_bound_tile`). `exhaustive`: every activation x {fused, unfused, fp32} at M 1, 2 and 4096."""
    from mxfuse.ops import triton_act_quant as taq
    from mxfuse.ops.activations import ACTIVATIONS

    forms = [(True, True), (False, True), (True, False)]  # (quant, round_each_op)
    if exhaustive:
        plan = [(m, 1792, act, f) for m in (1, 2, 4096) for act in ACTIVATIONS for f in forms]
    else:
        plan = [(4096, 1792, act, forms[0]) for act in ACTIVATIONS]
        plan += [(4096, 1792, "silu", forms[1]), (4096, 1792, "swiglu_oai", forms[2]), (1, 1792, "silu", forms[0])]
    fast, slow = NOMINAL_DRAM_BYTES_PER_S, 3.35e12  # an H200's memory and an H100's: 16 / 8 a thread at large M
    plan = [(*p, fast) for p in plan]
    plan += [(16384, i, "silu", forms[0], dram) for i in (14336, 3584, 2176) for dram in (fast, slow)]
    plan += [(64, 14336, "silu", forms[0], fast), (1024, 1792, "silu", forms[0], fast)]  # 4 and 8 a thread
    plan += [(1024, 2176, "silu", forms[0], slow)]  # one wave at 8's limit: 16 values and 16 codes a thread
    cases = []
    for m, i, act, (quant, round_each_op), dram in plan:
        _, launch = taq.act_mul_launch(
            _meta(m, i), _meta(m, i), act, isa=isa, quant=quant, swizzled=quant, rule=QuantRule.TORCHAO,
            round_each_op=round_each_op, config=taq.act_mul_config(m, i, 132, dram_bytes_per_s=dram),
        )  # fmt: skip
        if launch is None:
            continue
        mem = "" if dram == fast else " slow-memory"
        what = f"act_mul {act} I{i} M{m} {'fused' if quant else 'unfused'}{'' if round_each_op else ' fp32'}{mem}"
        cases.append(Case(what, launch, launch.constexprs["BM"] * launch.constexprs["BC"]))
    if isa == "ptx":  # programmatic dependent launch (NVIDIA only): gdc_wait / launch_dependents
        pdl = taq.act_mul_config(1, 1792, 132)._replace(pdl=True)
        _, launch = taq.act_mul_launch(_meta(1, 1792), _meta(1, 1792), "silu", isa=isa, swizzled=True, config=pdl)
        cases.append(Case("act_mul silu I1792 M1 fused pdl", launch, launch.constexprs["BM"] * launch.constexprs["BC"]))
    # an H100's default launches: the cap (`load_first_registers`), GELU-tanh's 16-values tile (`issue_bound_tile`)
    for act, i, m, what in (("silu", 1536, 1024, "capped"), ("gelu_tanh", 2688, 1024, "capped"),
                            ("gelu_tanh", 2688, 4096, "issue-bound tile")):  # fmt: skip
        default = taq.default_launch_config(act, m, i, swizzled=False, isa="ptx", sm_count=132, dram_bytes_per_s=slow)
        _, launch = taq.act_mul_launch(_meta(m, i), _meta(m, i), act, isa=isa, config=default)
        cases.append(Case(f"act_mul {act} I{i} M{m} fused {what}", launch,
                          launch.constexprs["BM"] * launch.constexprs["BC"]))  # fmt: skip
    for m, i in ((1, 21504), (4096, 14336)):  # up's bits joined into the gate's (`join_loads`)
        join = taq.act_mul_config(m, i, 132)._replace(join_loads=True)
        _, launch = taq.act_mul_launch(_meta(m, i), _meta(m, i), "gelu_tanh", isa=isa, swizzled=True, config=join)
        cases.append(Case(f"act_mul gelu_tanh I{i} M{m} fused join_loads", launch,
                          launch.constexprs["BM"] * launch.constexprs["BC"]))  # fmt: skip
    return cases


def gated_cases(isa: str, exhaustive: bool = False) -> list[Case]:
    """The gated producers (K 4096, groups of 128), fused row-major: the gate at M 4096 and M 1 and the gated
    norm at M 4096 in the default launch shape and in each of tools/bench_kernels.py's `gated_variants()`
    (the benchmark's candidates); on NVIDIA both launched with PDL. tests/test_targets_compile.py's `gated_cases`
    has the flags' variants."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)  # bench_kernels sits next to this file
    from bench_kernels import gated_variants

    from mxfuse.ops import triton_gated_quant as tg

    k, group = 4096, 128
    gate_variants, norm_variants = gated_variants()
    cases = []
    for m in (4096, 1):
        for name, pick in {"default": tg.gate_config, **gate_variants}.items():
            _, launch = tg.gate_launch(_meta(m, k), _meta(m, k), quant=True, isa=isa, config=pick(k, m))
            cases.append(Case(f"gate {name} K{k} M{m}", launch, launch.constexprs["BM"] * launch.constexprs["BC"]))
    decode = {"default M1": lambda g: tg.gated_norm_config(g, 1, k)}
    for name, pick in {"default": tg.gated_norm_config, **decode, **norm_variants}.items():
        _, launch = tg.gated_norm_launch(_meta(4096, k), _meta(4096, k), _meta(group), 1e-6, group, quant=True, isa=isa,
                                         config=pick(group))  # fmt: skip
        values = launch.constexprs["BM"] * launch.constexprs["GP"]
        cases.append(Case(f"gated norm {name} K{k} G{group}", launch, values))
    if isa == "ptx":  # programmatic dependent launch (NVIDIA only): gdc_wait / launch_dependents
        _, launch = tg.gate_launch(_meta(16, k), _meta(16, k), quant=True, isa=isa, swizzled=True,
                                   config=tg.gate_config(k, 16)._replace(pdl=True))  # fmt: skip
        cases.append(Case(f"gate pdl K{k} M16", launch, launch.constexprs["BM"] * launch.constexprs["BC"]))
        pdl = tg.gated_norm_config(group)._replace(pdl=True)
        _, launch = tg.gated_norm_launch(_meta(16, k), _meta(16, k), _meta(group), 1e-6, group, quant=True, isa=isa,
                                         swizzled=True, config=pdl)  # fmt: skip
        cases.append(Case(f"gated norm pdl K{k} G{group}", launch, launch.constexprs["BM"] * launch.constexprs["GP"]))
    return cases


VARIANT_KS = (2048, 3072, 4096)
"""Hidden sizes `--variants` compiles the benchmark variants at (the decode gap of issue #31)."""


def variant_cases(isa: str, names: list[str]) -> list[Case]:
    """tools/kernel_variants.py's variants `names` at VARIANT_KS, each in the launch shapes the
    dispatch picks for it: the split row (M 1) with every flag on, the fused add at M 64
    (evict_first or a split row), and at M 16384 the fused plain norm (swizzled; where the
    pipelined persistent loop runs) and the unfused plain norm."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)  # kernel_variants sits next to this file
    import kernel_variants as kv

    cases = []
    for name in names:
        for k in VARIANT_KS:
            plan = [("fused add all-flags", 1, True, True, HEAVY), ("fused add", 64, True, True, {}),
                    ("fused plain swizzled", 16384, False, True, dict(swizzled=True)),
                    ("norm plain", 16384, False, False, {})]  # fmt: skip
            for what, m, residual, quant, flags in plan:
                cfg = kv.variant(name, k, m, plain_quant=quant and not residual)
                case = _norm_case(f"{name} {what} K{k} M{m}", isa, k, m, residual=residual, quant=quant, config=cfg,
                                  **flags)  # fmt: skip
                cases.append(case)
    return cases


CASE_SOURCES: tuple[Callable[..., list[Case]], ...] = (
    norm_cases,
    quant_cases,
    swizzle_cases,
    gemm_cases,
    act_mul_cases,
    gated_cases,
)


def cases_for(target: str, exhaustive: bool = False, variants: tuple[str, ...] = ()) -> list[Case]:
    """Every case for `backend:arch`, each distinct compile once (same kernel, arguments'
    specialization and constexprs: the same binary); `variants`: instead, the cases of
    :func:`variant_cases` for these kernel variants."""
    isa = isa_of_target(target.split(":")[0])
    out, seen = [], set()
    sources = [lambda isa, exhaustive: variant_cases(isa, list(variants))] if variants else CASE_SOURCES
    for source in sources:
        for case in source(isa, exhaustive):
            key = _compile_key(case.launch)
            if key not in seen:
                seen.add(key)
                out.append(case)
    return out


# ------------------------------------------------------------------ compiling


def gpu_target(spec: str):
    from triton.backends.compiler import GPUTarget

    backend, arch = spec.split(":")
    return GPUTarget("cuda", int(arch), 32) if backend == "cuda" else GPUTarget("hip", arch, 64)


def _mock(arg):
    """Tensors replaced by Triton's MockTensor, inside argument bundles (tuples, NamedTuples) too."""
    from triton.runtime.jit import MockTensor

    if isinstance(arg, torch.Tensor):
        return MockTensor(arg.dtype)
    if isinstance(arg, tuple):
        items = [_mock(a) for a in arg]
        return type(arg)(*items) if hasattr(arg, "_fields") else tuple(items)
    return arg


def _leaves(args):
    """The arguments with bundles (tuples, NamedTuples) flattened, in order."""
    for a in args:
        if isinstance(a, tuple):
            yield from _leaves(a)
        else:
            yield a


def _specialize(launch: KernelLaunch, target):
    """(signature, constexprs, attrs, options) as a launch on `target` specializes them."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.constexprs, **launch.options(), "debug": False}
    bound, specialization, options = binder(*map(_mock, launch.args), **kwargs)
    return fn._pack_args(backend, kwargs, bound, specialization, options)


def _compile_key(launch: KernelLaunch) -> tuple:
    leaves = list(_leaves(launch.args))
    ints = tuple(a % 16 == 0 or a == 1 for a in leaves if isinstance(a, int) and not isinstance(a, bool))
    dtypes = tuple(str(a.dtype) for a in leaves if isinstance(a, torch.Tensor))
    return (launch.kernel.__name__, tuple(sorted(launch.constexprs.items())), tuple(sorted(launch.options().items())),
            ints, dtypes)  # fmt: skip


def compile_launch(launch: KernelLaunch, spec: str):
    """(compiled kernel, ptxas log) of `launch` for target `backend:arch` (Triton's CompiledKernel;
    the log of `ptxas -v` when ptxas ran, "" for AMD or a kernel found in Triton's cache)."""
    import triton
    from triton.compiler import ASTSource

    target = gpu_target(spec)
    options, signature, constexprs, attrs = _specialize(launch, target)
    log = io.StringIO()
    with _ptxas_log(), contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)  # fmt: skip
    return compiled, log.getvalue()


@contextlib.contextmanager
def _ptxas_log():
    from triton import knobs

    before = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        yield
    finally:
        knobs.nvidia.dump_ptxas_log = before


@dataclasses.dataclass(frozen=True)
class Resources:
    """What the compiled code object uses: registers, spills and scratch, shared memory / LDS, instructions."""

    registers: int
    """NVIDIA: registers per thread; AMD: arch VGPRs + AGPRs per lane."""
    sgprs: int
    spills: int
    """NVIDIA: local-memory bytes (spill slots); AMD: VGPR + SGPR spill count."""
    scratch: int
    """NVIDIA: stack frame bytes; AMD: private segment bytes per lane."""
    shared: int
    """Shared memory / LDS bytes (Triton's metadata)."""
    instructions: int
    """Machine instructions of the kernel, NOPs aside (0: not counted; -1: no disassembler for the arch)."""


def _nvidia_bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(compiled, spec: str, ptxas_log: str = "", instructions: bool = True) -> Resources:
    """What `compiled` uses; NVIDIA registers and spills from the ptxas log when there is one
    (else `cuobjdump -res-usage`); `instructions=False` skips the SASS dump (the count is 0)."""
    shared = int(compiled.metadata.shared)
    if spec.startswith("cuda"):
        used = re.search(r"Used (\d+) registers", ptxas_log)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        try:
            if used and frame:
                regs, scratch, spills = int(used[1]), int(frame[1]), int(frame[2]) + int(frame[3])
            else:
                usage = subprocess.run([_nvidia_bin("cuobjdump"), "-res-usage", f.name], capture_output=True,
                                       text=True, check=True).stdout  # fmt: skip
                fields = dict(re.findall(r"(\w+):(\d+)", usage.splitlines()[-1]))
                regs, scratch, spills = int(fields["REG"]), int(fields["STACK"]), int(fields["LOCAL"])
            n_ins = 0
            if instructions:  # -1: this cuobjdump cannot disassemble the arch (Triton 3.6's and sm_103)
                sass = subprocess.run([_nvidia_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True)
                lines = sass.stdout.splitlines() if sass.returncode == 0 else []
                n_ins = sum(1 for line in lines if re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?!NOP)", line)) or -1
        finally:
            os.unlink(f.name)
        return Resources(regs, 0, spills, scratch, shared, n_ins)
    gcn = compiled.asm["amdgcn"]

    def meta(key: str) -> int:
        found = re.findall(rf"\.{key}:\s+(\d+)", gcn)
        return int(found[0]) if found else 0

    private = int(re.findall(r"\.amdhsa_private_segment_fixed_size\s+(\d+)", gcn)[0])
    body = gcn.split(".Lfunc_begin0:")[1].split(".Lfunc_end0:")[0]
    n_ins = sum(1 for line in body.splitlines() if re.match(r"\s+[sv]_|\s+(global|buffer|ds|flat)_", line))
    return Resources(
        meta("vgpr_count") + meta("agpr_count"),
        meta("sgpr_count"),
        meta("vgpr_spill_count") + meta("sgpr_spill_count"),
        private,
        shared,
        n_ins,
    )


def compile_case(spec: str, case: Case, instructions: bool = True) -> tuple[Resources | None, str]:
    """(resources, error text) of one case; a compile error is reported, not raised."""
    try:
        compiled, log = compile_launch(case.launch, spec)
        return resources(compiled, spec, log, instructions), ""
    except Exception as e:  # every failing case is reported (one error must not hide the others)
        return None, f"{type(e).__name__}: {str(e)[:2000]}"


@functools.cache
def _cases(spec: str, exhaustive: bool, variants: tuple[str, ...] = ()) -> list[Case]:
    return cases_for(spec, exhaustive, variants)


def _compile_indexed(
    spec: str, exhaustive: bool, index: int, instructions: bool, variants: tuple[str, ...] = ()
) -> tuple[Resources | None, str]:
    """`compile_case` of case `index` of `spec` (a worker rebuilds the cases: launches do not pickle)."""
    return compile_case(spec, _cases(spec, exhaustive, variants)[index], instructions)


def compile_all(
    specs, jobs: int = 1, exhaustive: bool = False, instructions: bool = True, variants: tuple[str, ...] = ()
) -> dict[str, list[tuple[Case, Resources | None, str]]]:
    """{target: [(case, resources, error)]} over every case of every target, on `jobs` processes
    (`instructions=False`: no instruction counts, which need a SASS dump per NVIDIA case;
    `variants`: the kernel variants' cases instead, :func:`variant_cases`).

    Each target gets its own worker processes: Triton 3.6 carries gfx950's fp8 lowering into a
    later gfx942 compile in the same process (`v_cvt_scalef32_pk_fp8_f32` "not supported on
    this GPU"); alone, each target compiles."""
    out: dict[str, list] = {}
    for spec in specs:
        n = len(_cases(spec, exhaustive, variants))
        with ProcessPoolExecutor(max(1, jobs)) as pool:
            results = list(pool.map(_compile_indexed, [spec] * n, [exhaustive] * n, range(n), [instructions] * n,
                                    [variants] * n))  # fmt: skip
        out[spec] = [(case, res, err) for case, (res, err) in zip(_cases(spec, exhaustive, variants), results)]
    return out


def problems(spec: str, res: Resources | None, err: str) -> list[str]:
    """What is wrong with one compiled case: a compile error, spills, scratch, too much shared memory."""
    if res is None:
        return [f"compile error: {err}"]
    out = []
    if res.spills:
        out.append(f"{res.spills} spills")
    if res.scratch:
        out.append(f"{res.scratch} B of scratch")
    if res.shared > SHARED_LIMITS[spec]:
        out.append(f"{res.shared} B of shared memory > {SHARED_LIMITS[spec]}")
    return out


def table(spec: str, rows) -> str:
    regs = "VGPR+AGPR" if spec.startswith("hip") else "registers"
    lines = [
        f"\n#### {spec}\n",
        f"| kernel / case | {regs} | spills | scratch B | shared B | instructions | per value |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, res, err in rows:
        if res is None:
            lines.append(f"| {case.name} | COMPILE ERROR: {err.splitlines()[0] if err else '?'} | | | | | |")
            continue
        per = f"{res.instructions / case.values_per_thread(spec):.1f}" if case.values_per_program else "-"
        if res.instructions < 0:
            per = "n/a (no disassembler for this arch)"
        flag = " **over the limit**" if res.shared > SHARED_LIMITS[spec] else ""
        lines.append(
            f"| {case.name} | {res.registers} | {res.spills} | {res.scratch} | {res.shared}{flag} | {res.instructions} "
            f"| {per} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(COMPILE_TARGETS), help="backend:arch, comma separated")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--only", default="", help="keep the cases whose name contains this")
    ap.add_argument("--exhaustive", action="store_true", help="every K class at every M class, each flag alone")
    ap.add_argument(
        "--variants", default="", help="instead: these tools/kernel_variants.py variants (comma-separated), K 2048-4096"
    )
    args = ap.parse_args(argv)
    specs = [s for s in args.targets.split(",") if s]
    variants = tuple(v for v in args.variants.split(",") if v)
    if variants:
        variant_cases("ptx", [])  # puts tools/ on sys.path
        import kernel_variants

        unknown = [v for v in variants if v not in kernel_variants.VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}; known: {list(kernel_variants.VARIANTS)}")
    results = compile_all(specs, args.jobs, args.exhaustive, variants=variants)
    bad = 0
    for spec in specs:
        rows = [r for r in results[spec] if args.only in r[0].name]
        print(table(spec, rows), flush=True)
        bad += sum(1 for _, res, err in rows if problems(spec, res, err))
    import triton

    print(
        f"\ntriton {triton.__version__}; {bad} cases with a compile error, a spill, scratch or too much shared memory"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
