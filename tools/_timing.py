"""The benchmarks' timing lives in the package (`mxfuse.cli.timing`, shared with `mxfuse demo`).

Delete once tools/bench_kernels.py and tools/bench_sp_rewrite.py import `mxfuse.cli.timing` (the last users)."""

from mxfuse.cli.timing import (  # noqa: F401
    CALLS,
    L2_BYTES,
    REPLAYS,
    copy_bandwidth_tbs,
    flush_l2,
    n_input_sets,
    time_cuda_graph,
)
