"""Random programs for tests/test_fuzz.py: blocks of Gemma norms (known forms and look-alikes),
optionally all-gathered (sequence parallelism, c10d family, simulated: see tests/sp_helpers.py),
followed by MXFP8 quants; and what the pass must, may and must not do with each block."""

from __future__ import annotations

import dataclasses
import random

import torch
from sp_helpers import GROUP, W

from mxfuse.ops.mx_layout import BLOCK
from mxfuse.passes.options import PassOptions

mx = torch.ops.mxfuse
c10d = torch.ops._c10d_functional
# what the graph holds after the pass, by the kind of rewrite
FUSED = tuple(
    f"mxfuse::{op}_mxfp8" for op in ("gemma_rmsnorm", "gemma_fused_add_rmsnorm", "rms_norm", "fused_add_rms_norm")
)
PACKED_FUSED = ("mxfuse::gemma_rmsnorm_mxfp8_packed", "mxfuse::gemma_fused_add_rmsnorm_mxfp8_packed")
PACKED = ("mxfuse::mxfp8_quantize_packed",)
KNOWN = ("mxfuse", "vllm_ir", "hf", "hf_std")  # hf_std: the standard RMSNorm, `* w.float()`
LOOKALIKES = ("two_plus_w", "mean_dim0", "pow4", "other_stats", "eps_tensor", "w_1", "w_1k")
MUST, MUST_NOT, MAY = "must", "must_not", "may"


@dataclasses.dataclass(frozen=True)
class Block:
    form: str  # one of KNOWN or LOOKALIKES
    residual: bool
    quants: tuple[tuple[str, bool], ...]  # (quant op "mxfuse" | "vllm", swizzled)
    view_before_quant: bool
    extra_user: bool
    eps: float
    gathered: bool = False  # y is all-gathered (rows) before the quants

    @property
    def foreign(self) -> bool:
        return self.form != "mxfuse"

    def expectation(self, dtype: torch.dtype, k: int, options: PassOptions, frozen: bool) -> tuple[str, str]:
        """(the ops that stand for this block after the pass: FUSED, PACKED_FUSED or PACKED; MUST/MAY/MUST_NOT)."""
        if not self.gathered:  # noqa: SIM108 (a nested ternary reads worse)
            category = "fused"
        else:
            category = "packed_fused" if options.fuse_norm_quant else "packed"
        if dtype == torch.float32 or k % BLOCK or not self.quants:
            return category, MUST_NOT
        if self.form in LOOKALIKES and not (self.form == "eps_tensor" and not self.gathered):
            # never fused; each is recognized as a norm and refused with a code, so a gathered one
            # may still have its quant packed before the gather (exact either way)
            return "packed", MAY if self.gathered and options.sp_gather != "bf16" else MUST_NOT
        if (category == "fused" and not options.fuse_norm_quant) or (self.gathered and options.sp_gather == "bf16"):
            return category, MUST_NOT
        if self.view_before_quant:  # a quant reading a view of y: not a form the pass promises
            return category, MAY
        if frozen and self.form != "mxfuse":  # freezing folds `1 + w` (issue 19: not recognized yet)
            return category, MAY
        return category, MUST


@dataclasses.dataclass(frozen=True)
class Program:
    blocks: tuple[Block, ...]
    dtype: torch.dtype
    k: int
    frozen: bool = False

    def expected(self, options: PassOptions) -> dict[str, tuple[int, int]]:
        """{category: (ops at least, at most)} after the pass."""
        out = {"fused": [0, 0], "packed_fused": [0, 0], "packed": [0, 0]}
        for block in self.blocks:
            category, verdict = block.expectation(self.dtype, self.k, options, self.frozen)
            out[category][0] += verdict == MUST
            out[category][1] += verdict in (MUST, MAY)
        return {c: (least, most) for c, (least, most) in out.items()}


def draw_program(seed: int, with_vllm: bool, gathers: bool = True) -> tuple[Program, random.Random]:
    """A program from `seed` (its first block's form cycles through them all) and the rng, to draw on."""
    rng = random.Random(seed)
    forms = list(KNOWN) * 4 + list(LOOKALIKES)
    every = KNOWN + LOOKALIKES
    blocks = []
    for i in range(rng.randint(2, 3)):
        form = every[seed % len(every)] if i == 0 else rng.choice(forms)
        form = "hf" if form == "vllm_ir" and not with_vllm else form
        quant_ops = ("mxfuse", "vllm") if with_vllm else ("mxfuse",)
        n_quants = rng.choice((1, 1, 1, 2, 0) if form in KNOWN else (1, 1, 2))  # a look-alike feeds a quant
        quants = tuple((rng.choice(quant_ops), rng.random() < 0.5) for _ in range(n_quants))
        blocks.append(
            Block(
                form=form,
                residual=rng.random() < 0.5,
                quants=quants,
                view_before_quant=rng.random() < 0.15,
                extra_user=rng.random() < 0.3,
                eps=rng.choice((1e-6, 1e-5, 3.7e-7)),
                gathered=gathers and rng.random() < 0.3,
            )
        )
    dtype = rng.choices((torch.bfloat16, torch.float16, torch.float32), weights=(6, 3, 1))[0]
    k = rng.choices((64, 96, 48), weights=(5, 4, 1))[0]
    if k % BLOCK or dtype == torch.float32:  # mxfuse's and vLLM's ops refuse these: Hugging Face forms only
        own = ("mxfuse", "vllm_ir")
        blocks = [dataclasses.replace(b, form="hf") if b.form in own else b for b in blocks]
        if k % BLOCK:
            blocks = [dataclasses.replace(b, quants=()) for b in blocks]
    return Program(tuple(blocks), dtype, k), rng


# ------------------------------------------------------------------ the norms


def hf_norm(h, w, eps, *, offset=1.0, dim=-1, power=2, stats=None):
    """transformers' GemmaRMSNorm (offset 1.0), or a look-alike of it by one argument."""
    x = h.float()
    s = x if stats is None else stats.float()
    x = x * torch.rsqrt(s.pow(power).mean(dim, keepdim=True) + eps)
    scale = w.float() if offset is None else offset + w.float()
    return (x * scale).type_as(h)


def norm(block: Block, x, residual, w, eps_tensor):
    """`(y, residual_out)` of one block (residual_out is None without a residual)."""
    if block.residual:
        if block.form == "mxfuse":
            return mx.gemma_fused_add_rmsnorm(x, residual, w, block.eps)
        if block.form == "vllm_ir":
            return torch.ops.vllm_ir.fused_add_rms_norm(x, residual, w.float() + 1.0, block.eps)
        h = residual + x
        return plain_norm(block, h, w, eps_tensor), h
    return plain_norm(block, x, w, eps_tensor), None


def plain_norm(block: Block, x, w, eps_tensor):
    form, eps = block.form, block.eps
    if form == "mxfuse":
        return mx.gemma_rmsnorm(x, w, eps)
    if form == "vllm_ir":
        return torch.ops.vllm_ir.rms_norm(x, w.float() + 1.0, eps)
    looks = {
        "hf": {},
        "hf_std": {"offset": None},
        "two_plus_w": {"offset": 2.0},
        "mean_dim0": {"dim": 0},
        "pow4": {"power": 4},
        "other_stats": {"stats": x * 0.5},
        "w_1": {},
        "w_1k": {},
    }
    if form == "eps_tensor":
        return hf_norm(x, w, eps_tensor)
    if form == "w_1":
        w = w[:1]
    elif form == "w_1k":
        w = w.view(1, -1)
    return hf_norm(x, w, eps, **looks[form])


def quantize(op: str, y, swizzled: bool):
    if op == "vllm":
        return torch.ops.vllm.mxfp8_quantize(y, swizzled, 0)
    return mx.mxfp8_quantize(y, swizzled)


def program_fn(program: Program):
    """`fn(residual, eps_tensor, *per block: x, w)` returning every output, and which are foreign."""
    foreign: list[bool] = []

    def fn(residual, eps_tensor, *xs_ws):
        foreign.clear()
        outs = []
        for i, block in enumerate(program.blocks):
            x, w = xs_ws[2 * i], xs_ws[2 * i + 1]
            y, res_out = norm(block, x, residual, w, eps_tensor)
            if res_out is not None:
                residual = res_out
            rows = c10d.wait_tensor(c10d.all_gather_into_tensor(y, W, GROUP)) if block.gathered else y
            for op, swizzled in block.quants:
                quant_in = rows.view(-1, rows.shape[-1]) if block.view_before_quant else rows
                outs += list(quantize(op, quant_in, swizzled))
            if block.extra_user or not block.quants:
                outs.append(y * 2)
            foreign.extend([block.foreign] * (len(outs) - len(foreign)))
        outs.append(residual)
        foreign.append(any(b.foreign for b in program.blocks))
        return tuple(outs)

    return fn, foreign


def program_inputs(program: Program, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k, dtype = program.k, program.dtype

    def rows():
        return torch.randn(m, k, generator=g).to(dtype)

    args = [rows(), torch.tensor(1e-6)]
    for _ in program.blocks:
        args += [rows(), (0.1 * torch.randn(k, generator=g)).to(dtype)]
    return args
