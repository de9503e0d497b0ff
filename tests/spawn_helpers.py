"""Kept so that `from spawn_helpers import run_ranks` still works: the helpers live in `mxfuse.testing`.

Delete once tests/test_sp_rewrite.py and tests/test_vllm_models.py import `mxfuse.testing` (the last users)."""

from mxfuse.testing import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
