"""Inductor integration: options, the post-grad pass, vLLM glue."""

from mxfuse.passes.options import PassOptions
from mxfuse.passes.post_grad import MxfusePass, PassReport, cache_key, run

__all__ = ["MxfusePass", "PassOptions", "PassReport", "cache_key", "run"]
