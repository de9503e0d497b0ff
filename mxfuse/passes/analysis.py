"""What a compile produced, counted: the ops of an FX graph, and the launches in Inductor's generated code.

Used by the `mxfuse` command (kernel-launch tables, the dump index) and by the tests. Launches
are read off the Python wrapper module Inductor writes for each graph: the calls inside its
`call()` function (`cpp_fused_*` / `triton_*.run` kernels, `torch.ops.<ns>.<op>` and
`extern_kernels.*` ops). Collective waits are counted but are not launches.
"""

from __future__ import annotations

import collections
import contextlib
import re
import warnings
from collections.abc import Iterator

import torch
from torch import fx

from mxfuse.patterns.fx_utils import op_name

CPP_KERNELS = "Inductor C++ kernels (cpp_fused_*)"
TRITON_KERNELS = "Inductor Triton kernels (triton_*.run)"
NOT_LAUNCHES = ("_c10d_functional.wait_tensor",)
COUNTED = (
    "the calls in call() of its wrapper: cpp_fused_* / triton_*.run kernels,\n"
    "  torch.ops.<ns>.<op> and extern_kernels.* ops; waits not counted"
)

_KERNEL_CALL = re.compile(r"(?<![\w.])(cpp_fused_\w+)\(|(?<![\w.])(triton_\w+)\.run\(")
_EXTERN_CALL = re.compile(r"(?<![\w.])torch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\(|(?<![\w.])extern_kernels\.(\w+)\(")
_CALL_DEF = re.compile(r"\s*def call\(")


@contextlib.contextmanager
def capture_wrapper_code(codes: list[str]) -> Iterator[list[str]]:
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


def call_body(code: str) -> list[str]:
    """The lines of `def call(...)` in an Inductor wrapper module (comments dropped)."""
    lines = code.splitlines()
    start = next((i for i, line in enumerate(lines) if _CALL_DEF.match(line)), None)
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
            for cpp, _triton in _KERNEL_CALL.findall(line):
                counts[CPP_KERNELS if cpp else TRITON_KERNELS] += 1
            for ns, op, extern in _EXTERN_CALL.findall(line):
                counts[f"{ns}.{op}" if ns else f"extern_kernels.{extern}"] += 1
    return counts


def total_launches(counts: collections.Counter) -> int:
    """Every counted call but the collective waits."""
    return sum(n for what, n in counts.items() if what not in NOT_LAUNCHES)


def op_counts(graph: fx.Graph) -> collections.Counter:
    """`{op name: nodes}` of an FX graph (names as `fx_utils.op_name` gives them)."""
    return collections.Counter(filter(None, map(op_name, graph.nodes)))
