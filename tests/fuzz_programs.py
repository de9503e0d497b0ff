"""Random programs for tests/test_fuzz.py: blocks of Gemma norms (known forms and look-alikes),
optionally all-gathered (sequence parallelism, c10d family, simulated: see tests/sp_helpers.py),
and blocks of the other producers (act·mul and gated, known forms and look-alikes; rank-local, never
gathered), followed by MXFP8 quants; and what the pass must, may and must not do with each block."""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn.functional as F
from sp_helpers import GROUP, W

from mxfuse.ops.mx_layout import BLOCK
from mxfuse.passes.options import PassOptions

mx = torch.ops.mxfuse
c10d = torch.ops._c10d_functional
# what the graph holds after the pass, by the kind of rewrite
FUSED = tuple(
    f"mxfuse::{op}_mxfp8"
    for op in (
        *("gemma_rmsnorm", "gemma_fused_add_rmsnorm", "rms_norm", "fused_add_rms_norm"),
        *("act_mul", "act_mul_pair", "sigmoid_gate", "gated_rms_norm"),
    )
)
PACKED_FUSED = ("mxfuse::gemma_rmsnorm_mxfp8_packed", "mxfuse::gemma_fused_add_rmsnorm_mxfp8_packed")
PACKED = ("mxfuse::mxfp8_quantize_packed",)
KNOWN = ("mxfuse", "vllm_ir", "hf", "hf_std")  # hf_std: the standard RMSNorm, `* w.float()`
LOOKALIKES = ("two_plus_w", "mean_dim0", "pow4", "other_stats", "eps_tensor", "w_1", "w_1k")
# the other producers (rank-local: never all-gathered); every known form fuses bit for bit
ACT_MUL_KNOWN = ("silu", "gelu_tanh", "swiglu_step", "swiglu_oai", "swiglu_oai_fp32", "silu_clamp_beta1")
ACT_MUL_LOOKALIKES = ("gelu_kappa", "clamp_asym", "interleaved", "silu_clamp")  # each left as it was
GATED_KNOWN = ("gate", "gate_fp32", "gated_norm", "gated_norm_gate_first")
GATED_LOOKALIKES = ("gate_per_head",)
PRODUCER_FORMS = ACT_MUL_KNOWN + ACT_MUL_LOOKALIKES + GATED_KNOWN + GATED_LOOKALIKES
HALVES = ("gate_first", "up_first", "chunk", "pair")  # how an act·mul reads its gate and up
HEAD_DIM = 32  # the gated norm's group (k // 32 heads)
PRODUCER_BLOCKS = 3  # per traced program
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
    halves: str = "gate_first"  # an act·mul's gate and up: one of HALVES
    rank3: bool = False  # an act·mul on `[1, M, ...]` (the Transformers backend's batch dim), quantized as rows

    @property
    def producer(self) -> bool:
        """An act·mul or gated block (else a norm)."""
        return self.form in PRODUCER_FORMS

    @property
    def foreign(self) -> bool:
        return self.form != "mxfuse" and not self.producer  # the act·mul and gated ops are each form's bits

    def expectation(self, dtype: torch.dtype, k: int, options: PassOptions, frozen: bool) -> tuple[str, str]:
        """(the ops that stand for this block after the pass: FUSED, PACKED_FUSED or PACKED; MUST/MAY/MUST_NOT)."""
        if self.producer:
            lookalike = self.form in ACT_MUL_LOOKALIKES + GATED_LOOKALIKES
            if dtype == torch.float32 or k % BLOCK or not self.quants or lookalike or not options.fuse_norm_quant:
                return "fused", MUST_NOT
            return "fused", MAY if self.view_before_quant else MUST
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


def draw_program(
    seed: int, with_vllm: bool, gathers: bool = True, producers: bool = True
) -> tuple[Program, random.Random]:
    """A program from `seed` (its first block's form cycles through them all) and the rng, to draw on.

    With `producers`, PRODUCER_BLOCKS act·mul / gated blocks join the norm blocks at random places (drawn
    from an rng of their own, so the norm blocks and the rng returned are those of the norm-only program);
    their forms cycle through PRODUCER_FORMS with the seed."""
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
    if producers:
        blocks = _with_producer_blocks(blocks, seed, with_vllm, k)
    return Program(tuple(blocks), dtype, k), rng


def _with_producer_blocks(blocks: list[Block], seed: int, with_vllm: bool, k: int) -> list[Block]:
    rng = random.Random(1_000_003 * (seed + 1))
    quant_ops = ("mxfuse", "vllm") if with_vllm else ("mxfuse",)
    for j in range(PRODUCER_BLOCKS):
        form = PRODUCER_FORMS[(PRODUCER_BLOCKS * seed + j) % len(PRODUCER_FORMS)]
        n_quants = 0 if k % BLOCK else rng.choice((1, 1, 1, 2))
        block = Block(
            form=form,
            residual=False,
            quants=tuple((rng.choice(quant_ops), rng.random() < 0.5) for _ in range(n_quants)),
            view_before_quant=rng.random() < 0.15,
            extra_user=rng.random() < 0.4,
            eps=rng.choice((1e-6, 1e-5)),
            halves=rng.choice(HALVES),
            rank3=rng.random() < 0.3,
        )
        blocks.insert(rng.randint(0, len(blocks)), block)
    return blocks


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


# ------------------------------------------------------------------ the act·mul and gated producers


def gelu_kappa(g, u):  # GELU-tanh's shape with another cubic coefficient: no GELU
    x = g.float()
    return ((x * 0.5) * (1 + torch.tanh(0.7978845608028654 * (x + 0.05 * (x * x * x))))).to(g.dtype) * u


def silu_clamp(g, u, alpha=1.0, beta=0.0, limit=7.0):  # vLLM's SiluAndMulWithClamp.forward_native
    g = torch.clamp(g, max=limit)
    u = torch.clamp(u, min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + beta)


def swiglu_oai(g, u, alpha=1.702, limit=7.0):  # gpt-oss / MiniMax-M3's clamped SwiGLU, in the tensors' dtype
    g = g.clamp(min=None, max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


ACTIVATIONS = {
    "silu": lambda g, u: F.silu(g) * u,  # vLLM's SiluAndMul, Hugging Face's LlamaMLP
    "gelu_tanh": lambda g, u: F.gelu(g, approximate="tanh") * u,
    "swiglu_step": lambda g, u: F.silu(g).clamp(max=7.0) * u.clamp(min=-7.0, max=7.0),  # SwigluStepAndMul
    "swiglu_oai": swiglu_oai,
    "swiglu_oai_fp32": lambda g, u: swiglu_oai(g, u, limit=7.0),  # on fp32 gate / up: mxfuse's native form
    "silu_clamp_beta1": lambda g, u: silu_clamp(g, u, alpha=1.702, beta=1.0),
    "gelu_kappa": gelu_kappa,
    "clamp_asym": lambda g, u: F.silu(g).clamp(max=7.0) * u.clamp(min=-6.0, max=7.0),
    "interleaved": swiglu_oai,  # on x[..., ::2], x[..., 1::2]: vLLM's SwigluOAIAndMul
    "silu_clamp": silu_clamp,
}


def act_mul(block: Block, x, x2):
    """`y` of an act·mul block: gate and up the halves of `[x | x2]` (either order, slices or a chunk) or the
    two tensors; on `[1, M, ...]` when `rank3`."""
    if block.rank3:
        x, x2 = x.unsqueeze(0), x2.unsqueeze(0)
    fp32 = block.form == "swiglu_oai_fp32"
    if block.halves == "pair" and block.form != "interleaved":
        g, u = (x.float(), x2.float()) if fp32 else (x, x2)
    else:
        gate_up = torch.cat((x, x2), dim=-1)
        gate_up = gate_up.float() if fp32 else gate_up
        i = gate_up.shape[-1] // 2
        if block.form == "interleaved":
            g, u = gate_up[..., ::2], gate_up[..., 1::2]
        elif block.halves == "chunk":
            g, u = gate_up.chunk(2, dim=-1)
        elif block.halves == "up_first":
            u, g = gate_up[..., :i], gate_up[..., i:]
        else:
            g, u = gate_up[..., :i], gate_up[..., i:]
    y = ACTIVATIONS[block.form](g, u)
    return y.to(x.dtype) if fp32 else y


def gated(block: Block, x, x2, w):
    """`y` (`[M, K]` rows) of a gated block: the gated attention output, or vLLM's RMSNormGated (native form,
    `[M, H, D]` heads, then flattened), or a per-head gate (no elementwise gate: refused)."""
    if block.form == "gate":
        return x * torch.sigmoid(x2)
    if block.form == "gate_fp32":
        return (x.float() * torch.sigmoid(x2.float())).to(x.dtype)
    d = HEAD_DIM if x.shape[-1] % HEAD_DIM == 0 else x.shape[-1]
    heads, z = x.view(-1, x.shape[-1] // d, d), x2.view(-1, x.shape[-1] // d, d)
    if block.form == "gate_per_head":
        return (heads * torch.sigmoid(z[..., :1])).flatten(-2)
    x32, z32, w32 = heads.float(), z.float(), w[:d].float()  # RMSNormGated.forward_static, group_size None
    if block.form == "gated_norm_gate_first":
        x32 = x32 * F.silu(z32)
    out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + block.eps) * w32
    if block.form == "gated_norm":
        out = out * F.silu(z32)
    return out.to(x.dtype).flatten(-2)


def quantize(op: str, y, swizzled: bool):
    if op == "vllm":
        return torch.ops.vllm.mxfp8_quantize(y, swizzled, 0)
    return mx.mxfp8_quantize(y, swizzled)


def program_fn(program: Program):
    """`fn(residual, eps_tensor, *per block: x, x2, w)` returning every output, and which are foreign
    (a norm block reads x and w, an act·mul block x and x2, a gated block all three)."""
    foreign: list[bool] = []

    def fn(residual, eps_tensor, *inputs):
        foreign.clear()
        outs = []
        for i, block in enumerate(program.blocks):
            x, x2, w = inputs[3 * i : 3 * i + 3]
            if block.form in PRODUCER_FORMS:
                y = gated(block, x, x2, w) if block.form in GATED_KNOWN + GATED_LOOKALIKES else act_mul(block, x, x2)
                res_out = None
            else:
                y, res_out = norm(block, x, residual, w, eps_tensor)
            if res_out is not None:
                residual = res_out
            rows = c10d.wait_tensor(c10d.all_gather_into_tensor(y, W, GROUP)) if block.gathered else y
            for op, swizzled in block.quants:
                quant_in = rows.reshape(-1, rows.shape[-1]) if block.rank3 else rows
                quant_in = quant_in.view(-1, quant_in.shape[-1]) if block.view_before_quant else quant_in
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
        args += [rows(), rows(), (0.1 * torch.randn(k, generator=g)).to(dtype)]
    return args
