"""`DIR/INDEX.md` of `mxfuse dump`: which file (of depyf's and the passes' dumps) shows what."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import torch

from mxfuse.cli.targets import Target, options_text
from mxfuse.passes.analysis import COUNTED, count_launches, total_launches
from mxfuse.passes.options import PassOptions
from mxfuse.passes.report import PassReport

_DEPYF_FILES = (
    (
        "full_code_for_*.py",
        (
            "the compiled function as Python: Dynamo's transformed bytecode, decompiled, with its guards "
            "and the graphs it calls (no fused op: those are in `mxfuse/*.after.py`)"
        ),
    ),
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


def describe_depyf(name: str) -> str:
    for pattern, what in _DEPYF_FILES:
        if fnmatch.fnmatch(name.replace(" ", "_"), pattern):
            return what
    return "written by depyf"


def write_index(
    out_dir: Path, written: list[Path], target: Target, options: PassOptions, report: PassReport, codes: list[str]
) -> Path:
    """Write `out_dir/INDEX.md` over the files of this dump (`written`, relative to `out_dir`)."""
    lines = [
        "# mxfuse dump",
        "",
        f"- model: {target.description}",
        f"- pass options: {options_text(options)}",
        f"- torch {torch.__version__}",
        "",
        "## Files",
        "",
        "| file | what it shows |",
        "|---|---|",
    ]
    for path in sorted(p for p in written if len(p.parts) == 1 and p.name != "INDEX.md"):
        lines.append(f"| `{path.name}` | {describe_depyf(path.name)} |")
    mx_files = sorted(out_dir / p for p in written if p.parts[0] == "mxfuse" and p.name.startswith("mxfuse_"))
    for path in mx_files:
        stage = path.name.split(".")[-2]
        what = {
            "before": "the post-grad FX graph handed to the mxfuse passes (Inductor's own post-grad passes done)",
            "after": "START HERE: the same graph after the mxfuse passes: the fused `torch.ops.mxfuse.*_mxfp8` ops",
            "report": "the pass report: matched kinds, skipped norms with reasons, replaced nodes",
        }.get(stage, "")
        lines.append(f"| `mxfuse/{path.name}` | {what} |")
    if not mx_files:
        lines.append("| `mxfuse/` | nothing: the passes dumped no graph |")
    lines += ["", "## What the passes did", ""]
    if report.failed:
        lines.append(f"The pass FAILED and left the graph unchanged: {report.failed}")
    matched = report.matched_text()
    lines.append("Matched (kind x count): " + (", ".join(f"`{k}` x{n}" for k, n in matched) or "none"))
    lines.append("")
    replaced = report.replaced_nodes
    lines.append("Replaced nodes (names in the `before` graph): " + (", ".join(f"`{n}`" for n in replaced) or "none"))
    before = [p for p in mx_files if p.name.endswith(".before.py")]
    if before and replaced:
        names = set(replaced)
        code = [
            f"{i + 1:4d}  {line.strip().split(';  ')[0]}"
            for i, line in enumerate(before[0].read_text().splitlines())
            if (m := re.match(r"\s*(\w+)(?:: \"[^\"]*\")? = ", line)) and m.group(1) in names
        ]
        lines += ["", f"Those nodes in `mxfuse/{before[0].name}` (line, code):", "", "```", *code[:40], "```", ""]
    for skip in report.skipped:
        lines.append(f"- left alone by {skip.rewrite}: `{skip.node}` ({skip.label}): {skip.reason}")
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
