"""Run the fused SiLU·mul + MXFP8 op at one (I, M) in one of bench_kernels' launch shapes, for a profiler.

Three calls on fresh inputs (the first compiles); profile the last with Nsight Compute, e.g.

    ncu --kernel-name regex:_act_mul_kernel --launch-skip 2 --launch-count 1 \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
    sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread \\
        python3 tools/profile_act_mul.py --i 1792 --m 16384 --variant regs32

`--variant default` is the ops' own dispatch; the others are `bench_kernels.act_variants()`.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    from bench_kernels import act_variants

    from mxfuse.ops import triton_act_quant as taq

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--i", type=int, required=True)
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--variant", default="default")
    args = ap.parse_args(argv)
    i, m = args.i, args.m
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    config = None if args.variant == "default" else act_variants()[args.variant](m, i, sm)
    for _ in range(3):
        x = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16)
        taq.act_mul(x[:, :i], x[:, i:], "silu", config=config)
    torch.cuda.synchronize()
    print(f"I {i} M {m} {args.variant}: {config or taq.act_mul_config(m, i, sm)}")


if __name__ == "__main__":
    main()
