"""`mxfuse dump --out DIR`: its arguments and their checks, DIR prepared (what it runs: :mod:`mxfuse.cli.dump`).

DIR must be empty or new. With `--force`, a DIR holding an earlier dump is reused: the files
that dump wrote (listed in `DIR/.mxfuse-dump`) are removed first, nothing else is touched,
and the new index lists only the new dump's files.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mxfuse_cli.args import add_model_args, check_model_args, require

NAME = "dump"
MANIFEST = ".mxfuse-dump"  # the files the last dump wrote, relative to DIR


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="compile with depyf's debug dump and the passes' before/after graphs; write DIR/INDEX.md",
        description="Compile a model with depyf.prepare_debug(DIR) and the mxfuse passes dumping their graphs "
        "to DIR/mxfuse, then write DIR/INDEX.md: which file shows what, and which nodes the passes replaced.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty DIR, first removing the files an earlier mxfuse dump wrote there (only those)",
    )
    add_model_args(p)
    p.set_defaults(check=check)
    return p


def check(args: argparse.Namespace, parser: argparse.ArgumentParser):
    check_model_args(args, parser)
    require("depyf", f"mxfuse {NAME}")
    args.out_dir, args.cleared = prepare_out_dir(args.out, args.force)
    args.manifest = MANIFEST


def _fail(message: str):
    raise SystemExit(f"mxfuse {NAME}: {message}")


def prepare_out_dir(text: str, force: bool) -> tuple[Path, int]:
    """`(DIR, files of an earlier dump removed)`: DIR exists, is writable, and is empty unless `force`."""
    out = Path(text).expanduser()
    if out.exists() and not out.is_dir():
        _fail(f"--out {text} is a file, not a directory")
    cleared = 0
    if out.is_dir():
        if any(out.iterdir()):
            if not force:
                _fail(
                    f"--out {text} is not empty; pass --force to write there anyway "
                    "(it removes the files of an earlier mxfuse dump, and only those)"
                )
            cleared = clear_earlier_dump(out)
    else:
        try:
            out.mkdir(parents=True)
        except OSError as error:
            _fail(f"cannot create --out {text}: {error.strerror or error}")
    if not os.access(out, os.W_OK | os.X_OK):
        _fail(f"--out {text} is not writable")
    return out.resolve(), cleared


def clear_earlier_dump(out: Path) -> int:
    """Remove the files the manifest of an earlier dump names (inside `out` only), and the folders they empty."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return 0
    try:
        names = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        _fail(f"cannot read {manifest} (the list of an earlier dump's files): {error}")
    root = out.resolve()
    removed = 0
    folders: set[Path] = set()
    for name in names:
        path = (root / name).resolve()
        if path.parent != root and root not in path.parents:
            continue  # never outside DIR
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed += 1
            folders.update(p for p in path.parents if root in p.parents)
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    manifest.unlink()
    return removed
