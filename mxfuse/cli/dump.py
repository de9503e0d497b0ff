"""`mxfuse dump --out DIR`: depyf's debug dump and the passes' before/after graphs, with `DIR/INDEX.md`.

DIR must be empty or new. With `--force`, a DIR holding an earlier dump is reused: the files
that dump wrote (listed in `DIR/.mxfuse-dump`) are removed first, nothing else is touched,
and the new index lists only the new dump's files.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import TextIO

NAME = "dump"


def _files_under(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}


def run(args: argparse.Namespace, out: TextIO) -> int:
    import depyf

    from mxfuse.cli.depyf_index import write_index
    from mxfuse.cli.recording import RecordingPass, compile_and_run
    from mxfuse.cli.targets import build_target, options_text, pass_options_from

    out_dir: Path = args.out_dir
    manifest: str = args.manifest  # the list of the files this dump writes, that --force removes next time
    if args.cleared:
        print(f"mxfuse dump: removed the {args.cleared} files of the earlier dump in {out_dir}", file=out)
    existing = _files_under(out_dir)
    target = build_target(args, NAME)
    options = pass_options_from(args, dump_dir=str(out_dir / "mxfuse"))
    pass_obj = RecordingPass(options)
    print(f"mxfuse dump: {target.description}; passes: {options_text(options)}", file=out)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with depyf.prepare_debug(str(out_dir)):
                label = "compiling with depyf's dump and the mxfuse passes"
                compiled, codes = compile_and_run(target.fn, target.x, pass_obj, label, out)
        report = pass_obj.merged_report()
        written = sorted(_files_under(out_dir) - existing)
        index = write_index(out_dir, written, target, options, report, codes)
    finally:  # even a failed compile leaves a list, so that --force can clear what it wrote
        written = sorted(_files_under(out_dir) - existing - {Path(manifest)})
        if written:
            (out_dir / manifest).write_text(json.dumps({"files": [str(p) for p in written]}, indent=1) + "\n")
    print(f"wrote {len(written)} files under {out_dir}", file=out)
    matched = ", ".join(f"{k} x{n}" for k, n in report.matched_text()) or "nothing"
    print(f"  passes matched: {matched}", file=out)
    for p in written:
        if p.parts[0] == "mxfuse":
            print(f"  {p}", file=out)
    print(f"  index: {index}  (which file shows what, and the nodes replaced)", file=out)
    del compiled
    return 0 if not report.failed else 1
