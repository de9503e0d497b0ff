"""Which GPUs the Triton kernels support, and the code each one gets.

The kernels are plain Triton except for a few NVIDIA pieces (inline PTX: `rsqrt.approx.f32`,
`cvt.rn.bf16x2.f32`, a predicated `st.global.u8`; and the saturating e4m3 convert the
"hw" quant relies on). Each such piece sits behind the kernels' `ISA` constexpr, which
the launcher sets from the device, never a runtime branch:

- "ptx" (NVIDIA, compute capability >= 9.0: Hopper, Blackwell): the PTX pieces;
- "portable" (AMD gfx942 / gfx950, and Triton's CPU interpreter): Triton ops that
  compute the same function (see triton_norm_quant's docstring, "Targets").

Any other GPU gets one :class:`MxfuseInputError` before anything compiles. The set of
targets CI compiles for (tests/test_targets_compile.py) is :data:`COMPILE_TARGETS`.

Programmatic dependent launch (PDL, :attr:`KernelLaunch.pdl`) is NVIDIA-only as well: the
launch carries CUDA's programmatic-stream-serialization attribute (Triton's `launch_pdl`)
and the kernel runs `griddepcontrol.wait` before it reads what an earlier kernel wrote and
`griddepcontrol.launch_dependents` to let the next one start (`gdc_wait` /
`gdc_launch_dependents` of `triton.language.extra.cuda`, sm_90 on). Triton's AMD backend
has no equivalent (no launch attribute, no instruction), so a "portable" launch drops the
hint and runs the same kernel plainly (:func:`launch_hints`, which drops the register cap there too; the bits
are the same either way).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mxfuse.ops.errors import MxfuseInputError
from mxfuse.ops.norm_quant_config import NOMINAL_SMS

Isa = Literal["ptx", "portable"]

MIN_CUDA_CAPABILITY = (9, 0)
"""NVIDIA: e4m3 converts in hardware from Hopper (sm_90) on."""
AMD_ARCHS = ("gfx942", "gfx950")
"""AMD: MI300 (CDNA3, gfx942: fp8 by a software OCP convert) and MI350 / MI355X (CDNA4, gfx950)."""
COMPILE_TARGETS = ("hip:gfx950", "hip:gfx942", "cuda:90", "cuda:100", "cuda:103")
"""`backend:arch` of every target the kernels must compile for, without spills."""


def isa_of_target(backend: str) -> Isa:
    """The `ISA` constexpr for a Triton target backend ("cuda" or "hip")."""
    return "ptx" if backend == "cuda" else "portable"


@functools.cache
def _gpu_isa(index: int) -> Isa:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = props.gcnArchName.split(":")[0]
        if arch in AMD_ARCHS:
            return "portable"
        need = "an AMD GPU of arch " + " or ".join(AMD_ARCHS) + " (MI300, MI350 / MI355X)"
        found = f"{props.name} ({arch})"
    else:
        if (props.major, props.minor) >= MIN_CUDA_CAPABILITY:
            return "ptx"
        need = "an NVIDIA GPU of compute capability >= {}.{} (Hopper, Blackwell)".format(*MIN_CUDA_CAPABILITY)
        found = f"{props.name} (compute capability {props.major}.{props.minor})"
    raise MxfuseInputError(f"mxfuse: the MXFP8 Triton kernels need {need}; cuda:{index} is {found}")


def sm_count(dev: torch.device) -> int:
    """Multiprocessors (NVIDIA) / compute units (AMD) of a GPU; on a meta or CPU device (a described
    launch) `NOMINAL_SMS`, an H200's, so a described launch has the shape it has there."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else NOMINAL_SMS


NOMINAL_L2_BYTES = 50 * 2**20
"""L2 bytes a launch described on a meta or CPU tensor is dispatched for (an H200's)."""


def l2_bytes(dev: torch.device) -> int:
    """L2 cache bytes of a GPU; `NOMINAL_L2_BYTES` on a meta or CPU device (as `sm_count`)."""
    return torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else NOMINAL_L2_BYTES


NOMINAL_DRAM_BYTES_PER_S = 4.8e12
"""Peak DRAM bandwidth a launch described on a meta or CPU tensor is dispatched for (an H200's)."""


def dram_bytes_per_s(dev: torch.device) -> float:
    """Peak DRAM bandwidth of a GPU from its memory clock and bus width (double data rate: H100 SXM 3.35e12,
    H200 4.9e12); `NOMINAL_DRAM_BYTES_PER_S` on a meta or CPU device, or where the driver reports neither."""
    if dev.type != "cuda":
        return NOMINAL_DRAM_BYTES_PER_S
    props = torch.cuda.get_device_properties(dev)
    khz, bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2.0 * khz * 1e3 * bits / 8 if khz and bits else NOMINAL_DRAM_BYTES_PER_S


def pdl_allowed(isa: Isa) -> bool:
    """Whether kernels of this ISA may be launched with programmatic dependent launch (NVIDIA only)."""
    return isa == "ptx"


class LaunchHints(NamedTuple):
    """A config's NVIDIA-only launch hints, as a launch for one ISA takes them."""

    pdl: bool
    """Programmatic dependent launch (the kernel's `PDL` constexpr and `KernelLaunch.pdl`)."""
    max_registers: int
    """`KernelLaunch.max_registers` (0: ptxas's choice)."""


def launch_hints(isa: Isa, pdl: bool, max_registers: int = 0) -> LaunchHints:
    """`pdl` and `max_registers` on NVIDIA; both off elsewhere, where the same kernel launches plainly (a config
    means the same launch on every GPU, its NVIDIA hints aside)."""
    nvidia = pdl_allowed(isa)
    return LaunchHints(bool(pdl) and nvidia, max_registers if nvidia else 0)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first step under programmatic dependent launch, before any load or store: wait until the
    kernels before this one completed (their writes visible, their reads of memory this one may overwrite
    done), then let the next kernel launch (it waits for this one in turn)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def device_isa(device: torch.device) -> Isa:
    """The `ISA` constexpr for tensors on `device`; :class:`MxfuseInputError` for a GPU the
    kernels do not support. A CPU device (Triton's interpreter) gets the portable code."""
    if device.type != "cuda":
        return "portable"
    return _gpu_isa(torch.cuda.current_device() if device.index is None else device.index)


class KernelLaunch(NamedTuple):
    """One kernel launch, described before it runs: tools/compile_targets.py compiles the
    same arguments and constexprs for every target that :meth:`run` passes on the GPU."""

    kernel: Any
    """The `triton.jit` function."""
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int | None = None
    fp_fusion: bool = True
    """Triton's `enable_fp_fusion` (False: no multiply-add contracted into an FMA)."""
    pdl: bool = False
    """Launched with programmatic dependent launch (Triton's `launch_pdl`; NVIDIA sm_90+ only:
    the kernel must `gdc_wait` before its first read of an earlier kernel's output)."""
    max_registers: int = 0
    """Registers a thread may use at most (Triton's `maxnreg`, NVIDIA only; 0: ptxas's choice). A cap that
    keeps a kernel at 32 lets an SM hold 2048 threads instead of 1536 at 33-40 (sm_90 allocates registers
    8 a thread at a time)."""

    def options(self) -> dict[str, Any]:
        """The launch options besides the constexprs."""
        opts: dict[str, Any] = {"num_warps": self.num_warps, "enable_fp_fusion": self.fp_fusion}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        if self.pdl:
            opts["launch_pdl"] = True
        if self.max_registers:
            opts["maxnreg"] = self.max_registers
        return opts

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options())
