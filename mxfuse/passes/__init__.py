"""Inductor integration: options, the post-grad pass, its report, vLLM glue."""

from mxfuse.passes.options import PassOptions
from mxfuse.passes.post_grad import MxfusePass, cache_key, run
from mxfuse.passes.report import PassReport

__all__ = ["MxfusePass", "PassOptions", "PassReport", "cache_key", "run"]
