"""Hashes of every output of the norm / quant kernels over a grid of shapes and flags (CUDA GPU).

Same seed, same inputs: two trees whose kernels compute the same bits print the same lines,
so `diff` of two runs is the before/after "same bits" check of a refactor (docs/perf_notes.md).

    PYTHONPATH=. python3 tools/kernel_hashes.py > hashes.txt
"""

from __future__ import annotations

import hashlib
import itertools

import torch


def _h(t) -> str:
    if t is None:
        return "-"
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    from mxfuse.ops import triton_norm_quant as tnq

    for k, m in itertools.product((160, 3072, 6144), (1, 64, 4096)):
        g = torch.Generator(device="cuda").manual_seed(k * 100003 + m)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        r = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(k, device="cuda", generator=g).to(torch.bfloat16)
        forms = [(False, 0, 1.0), (True, 1, 0.0)]  # (emit_y, rule, weight offset: 0.0 = the standard norm)
        for has_res, swz, (emit_y, rule, offset) in itertools.product((False, True), (False, True), forms):
            outs = tnq.fused_norm_quant(x, r if has_res else None, w, 1e-6, swizzled=swz, emit_y=emit_y, rule=rule,
                                        weight_offset=offset, round_normalized=offset == 0.0)  # fmt: skip
            print(k, m, "fused", has_res, swz, emit_y, rule, offset, *map(_h, outs))
        for has_res in (False, True):
            print(k, m, "norm", has_res, *map(_h, tnq.gemma_norm(x, r if has_res else None, w, 1e-6)))
        for swz, rule in itertools.product((False, True), (0, 1)):
            print(k, m, "quant", swz, rule, *map(_h, tnq.quantize(x, swz, rule=rule)))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
