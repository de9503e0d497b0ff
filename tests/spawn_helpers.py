"""Kept so that `from spawn_helpers import run_ranks` still works: the helpers live in `mxfuse.testing`."""

from mxfuse.testing import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
