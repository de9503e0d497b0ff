"""Rewrite 2: MXFP8 quantization around the sequence-parallel all-gather (option `sp_gather`).

MXFP8 scales belong to 32 values of ONE row, so quantizing rows before or after a
row-wise (dim 0) all-gather gives the same bits; only 128x4-swizzled scale tiles do
not concatenate by rows. Collectives are recognized in both families by
:mod:`.collectives` (vLLM `vllm::all_gather(x, dim, world_size, group_name)`, and
PyTorch `_c10d_functional.all_gather_into_tensor(x, group_size, group_name)` +
`wait_tensor`); new collectives copy the found node's target, group and world size.

Form A: a Gemma norm (any form of :mod:`.norms`) gathered in bf16, then quantized::

    y, res_out = gemma_fused_add_rmsnorm(x, res, w, eps)           # local rows [M, K]
    g          = wait_tensor(all_gather_into_tensor(y, W, group))  # [W*M, K] bf16
    q, s       = mxfp8_quantize(g, swizzled)                       # -> GEMM(q, s)

- `sp_gather="bf16"`: left as is (it is the correct bf16 form; rewrite 1 never fuses
  across the collective since the quant reads the gather, not the norm).
- `sp_gather="mxfp8"`, or `"auto"` when the gathered bf16 `g` has no user but the
  quant(s), becomes::

    p, res_out, y = gemma_fused_add_rmsnorm_mxfp8_packed(x, res, w, eps, emit_y=<y has other users>)
    pg = wait_tensor(all_gather_into_tensor(p, W, group))   # ONE collective, uint8 [W*M, K + K/32]
    q  = aten.view.dtype(aten.slice.Tensor(pg, 1, 0, K), float8_e4m3fn)   # zero-copy views
    s  = aten.slice.Tensor(pg, 1, K, K + K/32)
    s  = mxfuse.mxfp8_swizzle_scales(s)                     # only for a quant that asked for swizzled
    (vLLM quant with swizzled scales: `aten.view(s, [-1])`, its flat layout)

  The norm is fused only where rewrite 1 would fuse it (`fuse_norm_quant` on and
  :func:`.norms.reject_reason` is None); otherwise the norm stays and
  `mxfuse.mxfp8_quantize_packed(y)` packs its output. With `"mxfp8"` forced and other
  users of `g`, the bf16 gather is kept for them (and `y` emitted).

Form B: quantized BEFORE the gather, codes and scales gathered by two collectives::

    q, s = mxfp8_quantize(y, swizzled)                    # or vllm::mxfp8_quantize
    qg   = gather(q)          # or gather(q.view(uint8)).view(float8_e4m3fn): gloo takes no fp8
    sg   = gather(s)          # or gather(s.view(-1)) etc. (views of one user each, either side)

  With swizzled scales this is WRONG (the gathered buffer is W tiles of pad128(M)
  rows each, not the tiles of the W*M gathered rows) and is always repaired: in
  `"auto"`/`"mxfp8"` to the packed form above (norm fused when the quant reads a
  norm, else `mxfp8_quantize_packed(x)`), in `"bf16"` to `q, s = quant(gather(x),
  swizzled)` with the quant node's own op and arguments. With row-major scales it is
  correct but two collectives: `"auto"`/`"mxfp8"` pack it into one, `"bf16"` leaves it.

Left alone, with a :class:`Skip` (logged, shown by `mxfuse explain`): gather along a
dim other than 0, world size or group name not constants, gathered rows not
`world_size x` local rows, not 2-D rows, K symbolic or not a multiple of 32, dtype
not bf16/fp16, a vLLM quant that pads K, local codes/scales with other users.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from mxfuse.patterns.collectives import GatherMatch, match_all_gather
from mxfuse.patterns.fx_utils import call, fake, getitem, is_call, redirect_uses, refresh_eager_input_vals, static_int
from mxfuse.patterns.norm_quant import insert_fused_norm
from mxfuse.patterns.norms import NormMatch, find_norms, match_norm, reject_reason
from mxfuse.patterns.quants import QuantMatch, match_quant, quant_reject_reason, quant_users

NAME = "sp_gather"

aten = torch.ops.aten
FP8 = torch.float8_e4m3fn
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
# single-input view ops that may sit between a quant output and its gather (either side)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.cat.default)
_VIEWS = (aten.view.dtype, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)


@dataclass(frozen=True)
class QuantSite:
    """Stands in for a NormMatch in a Skip when the quantized tensor is not a norm output."""

    y: fx.Node

    @property
    def kind(self) -> str:
        return "quant_input"


@dataclass(frozen=True)
class PackedGather:
    """Form A in mxfp8: norm -> one packed gather -> views for the quant(s)."""

    norm: NormMatch
    gather: GatherMatch
    quants: tuple[QuantMatch, ...]
    fuse_norm: bool
    keep_bf16_gather: bool

    @property
    def replaced(self) -> list[fx.Node]:
        kept = [] if self.keep_bf16_gather else [self.gather.start]
        return [*kept, *(q.node for q in self.quants)]

    @property
    def kind(self) -> str:
        layouts = "+".join(sorted({"swizzled" if q.swizzled else "rowmajor" for q in self.quants}))
        src = self.norm.kind if self.fuse_norm else f"{self.norm.kind}(unfused)"
        extra = "+bf16_gather" if self.keep_bf16_gather else ""
        return f"{src}->{self.gather.form}_gather:mxfp8_packed:{layouts}{extra}"


@dataclass(frozen=True)
class GatheredQuant:
    """Form B: a quant whose codes and scales each cross an all-gather."""

    quant: QuantMatch
    norm: NormMatch | None  # the norm the quant reads, if any
    codes_gather: GatherMatch
    codes_out: fx.Node  # the node consumers read the gathered codes from
    scales_gather: GatherMatch
    scales_out: fx.Node
    to: str  # "mxfp8" (one packed gather) or "bf16" (gather the input, quant after)
    fuse_norm: bool

    @property
    def replaced(self) -> list[fx.Node]:
        return [self.quant.node, self.codes_gather.start, self.scales_gather.start]

    @property
    def kind(self) -> str:
        what = "repair:swizzled" if self.quant.swizzled else "two_gathers:rowmajor"
        return f"{what}:{self.codes_gather.form}_gather->{'mxfp8_packed' if self.to == 'mxfp8' else 'bf16_gather'}"


@dataclass(frozen=True)
class Skip:
    norm: NormMatch | QuantSite
    reason: str


# ------------------------------------------------------------------ checks


def _rows_reason(t: torch.Tensor | None, what: str) -> str | None:
    if t is None:
        return f"no fake tensor on the {what} (graph not traced with shapes)"
    if t.dim() != 2:
        return f"the {what} is {t.dim()}-D; only 2-D rows [M, K] are gathered by this rewrite"
    if t.dtype not in ACTIVATION_DTYPES:
        return f"the {what} has dtype {t.dtype}; the packed quant takes bfloat16/float16"
    k = static_int(t.shape[-1])
    if k is None:
        return f"hidden size {t.shape[-1]} of the {what} is symbolic"
    if k % 32:
        return f"hidden size K={k} of the {what} is not a multiple of 32"
    return None


def gather_reason(gather: GatherMatch, local: torch.Tensor | None = None) -> str | None:
    """Why this gather cannot be rewritten (None: it can): dim, constants, row count."""
    out = fake(gather.out)
    dim = gather.dim
    if not isinstance(dim, int) or isinstance(dim, bool):
        return f"gather dim {dim!r} is not a constant"
    if out is None:
        return "no fake tensor on the gathered output"
    if dim % max(out.dim(), 1) != 0:
        return f"the all-gather is along dim {dim}, not 0 (rows)"
    ws = static_int(gather.world_size) if not isinstance(gather.world_size, bool) else None
    if ws is None or ws < 1:
        return f"world size {gather.world_size!r} is not a constant the pass can read"
    if not isinstance(gather.group_name, str):
        return f"group {gather.group_name!r} is not a constant group name the pass can read"
    local = fake(gather.x) if local is None else local
    if local is None or local.dim() != out.dim() or out.dim() == 0:
        return "gathered and local tensors differ in rank"
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not statically_known_true(out.shape[0] == ws * local.shape[0]):
        return f"gathered rows {out.shape[0]} are not world_size {ws} x local rows {local.shape[0]}"
    if any(not statically_known_true(a == b) for a, b in zip(out.shape[1:], local.shape[1:])):
        return "gathered and local tensors differ beyond dim 0"
    return None


def _can_fuse(norm: NormMatch | None, options) -> bool:
    if norm is None or (options is not None and not options.fuse_norm_quant):
        return False
    return reject_reason(norm) is None


def _mode(options) -> str:
    return getattr(options, "sp_gather", "auto") if options is not None else "auto"


# ------------------------------------------------------------------ plan


def plan(graph: fx.Graph, options=None) -> tuple[list, list[Skip]]:
    """Decide every rewrite without touching the graph."""
    actions: list = []
    skips: list[Skip] = []
    for node in list(graph.nodes):
        quant = match_quant(node)
        if quant is not None:
            verdict = plan_gathered_quant(quant, options)
            if verdict is not None:
                (skips if isinstance(verdict, Skip) else actions).append(verdict)
    for norm in find_norms(graph):
        if not norm.y.users:
            continue
        for user in list(norm.y.users):
            gather = match_all_gather(user)
            if gather is not None and gather.x is norm.y:
                verdict = plan_norm_gather(norm, gather, options)
                (skips if isinstance(verdict, Skip) else actions).append(verdict)
    return actions, skips


def plan_norm_gather(norm: NormMatch, gather: GatherMatch, options=None) -> PackedGather | Skip:
    """Form A: a norm whose output y is all-gathered, then quantized."""
    mode = _mode(options)
    reason = _rows_reason(fake(norm.y), "norm output") or gather_reason(gather)
    if reason is not None:
        return Skip(norm, reason)
    quants = quant_users(gather.out)
    if not quants:
        if any(is_call(u, *_SPLITS) for u in gather.out.users):
            return Skip(norm, "the all-gather is followed by split/cat: a gather along a dim other than 0 (rows)")
        return Skip(norm, "no MXFP8 quant reads the gathered rows")
    usable = tuple(q for q in quants if quant_reject_reason(q) is None)
    if not usable:
        return Skip(norm, quant_reject_reason(quants[0]))
    if mode == "bf16":
        return Skip(norm, "sp_gather='bf16': the gather carries bf16 and the quant runs after it (kept)")
    if _shape_reads(gather, dims_other_than_0=True):
        return Skip(norm, "a shape read of the gathered tensor along dim != 0 (its width changes when packed)")
    served = {q.node for q in usable} | set(_shape_reads(gather))
    others = [u for u in gather.out.users if u not in served]
    if others and mode == "auto":
        names = ", ".join(u.name for u in others[:3])
        return Skip(norm, f"sp_gather='auto': the gathered bf16 has other users ({names}); it stays a bf16 gather")
    return PackedGather(norm, gather, usable, _can_fuse(norm, options), bool(others))


def _shape_reads(gather: GatherMatch, dims_other_than_0: bool = False) -> list[fx.Node]:
    """`aten.sym_size.int` users of the collective or its output (dim 0 only, or only the others)."""
    found = []
    for node in {gather.start, gather.out}:
        for u in node.users:
            if is_call(u, aten.sym_size.int) and (u.args[1] != 0) == dims_other_than_0:
                found.append(u)
    return found


def _rewire_shape_reads(gather: GatherMatch, new: fx.Node):
    """Row-count reads of the old gather read the new one (same rows: W x local rows)."""
    for u in _shape_reads(gather):
        u.replace_input_with(u.args[0], new)
        refresh_eager_input_vals(u)


def _through_views(node: fx.Node) -> fx.Node:
    """Follow single-user view ops from `node`; returns the last node of the chain."""
    while len(node.users) == 1:
        (user,) = node.users
        if is_call(user, *_VIEWS) and user.args[0] is node:
            node = user
        else:
            break
    return node


def _gather_chain(node: fx.Node | None) -> tuple[GatherMatch, fx.Node] | None:
    """`node` -> [views] -> all-gather -> [views]: (the gather, the node consumers read)."""
    if node is None:
        return None
    last = _through_views(node)
    if len(last.users) != 1:
        return None
    gather = match_all_gather(next(iter(last.users)))
    if gather is None or gather.x is not last:
        return None
    return gather, _through_views(gather.out)


def plan_gathered_quant(quant: QuantMatch, options=None) -> GatheredQuant | Skip | None:
    """Form B: a quant whose codes and scales cross all-gathers (None: not this form)."""
    codes_chain, scales_chain = _gather_chain(quant.codes), _gather_chain(quant.scales)
    if codes_chain is None and scales_chain is None:
        return None
    norm = match_norm(quant.x) if isinstance(quant.x, fx.Node) else None
    site = norm if norm is not None else QuantSite(quant.x)
    what = "swizzled" if quant.swizzled else "row-major"
    if codes_chain is None or scales_chain is None:
        return Skip(site, f"only one of the {what} quant's codes/scales crosses an all-gather (or has other users)")
    (cg, codes_out), (sg, scales_out) = codes_chain, scales_chain
    reason = _rows_reason(fake(quant.x), "quant input") or quant_reject_reason(quant)
    reason = reason or gather_reason(cg) or gather_reason(sg)
    if reason is None and (cg.form, cg.group_name, cg.world_size) != (sg.form, sg.group_name, sg.world_size):
        reason = "codes and scales are gathered by different groups or collective families"
    if reason is None and (_shape_reads(sg) or _shape_reads(sg, True) or _shape_reads(cg, True)):
        reason = "shape reads of the gathered scales (or of the codes along dim != 0)"
    if reason is None:
        reason = _gathered_shapes_reason(quant, codes_out, scales_out, static_int(cg.world_size))
    if reason is not None:
        return Skip(site, f"{what} quant before an all-gather: {reason}")
    mode = _mode(options)
    if mode == "bf16" and not quant.swizzled:
        return Skip(site, "sp_gather='bf16': codes and row-major scales gathered separately are exact (kept)")
    to = "bf16" if mode == "bf16" else "mxfp8"
    return GatheredQuant(quant, norm, cg, codes_out, sg, scales_out, to, _can_fuse(norm, options) and to == "mxfp8")


def _gathered_shapes_reason(quant: QuantMatch, codes_out: fx.Node, scales_out: fx.Node, ws: int) -> str | None:
    """The gathered codes must read as fp8 `[W*M, K]`; gathered row-major scales as `[W*M, K/32]`."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    x, codes, scales = fake(quant.x), fake(codes_out), fake(scales_out)
    if codes is None or scales is None:
        return "no fake tensor on the gathered codes or scales"
    m, k = x.shape
    rows_ok = codes.dim() == 2 and statically_known_true(codes.shape[0] == ws * m)
    if codes.dtype != FP8 or not rows_ok or codes.shape[1] != k:
        return f"gathered codes are {tuple(codes.shape)} {codes.dtype}, not float8_e4m3fn [{ws}*{m}, {k}]"
    if not quant.swizzled and (scales.dim() != 2 or not statically_known_true(scales.shape[0] == ws * m)):
        return f"gathered row-major scales are {tuple(scales.shape)}, not [{ws}*{m}, {k // 32}]"
    if quant.swizzled and scales.dim() not in (1, 2):
        return f"gathered swizzled scales are {scales.dim()}-D"
    return None


# ------------------------------------------------------------------ apply


def apply(graph: fx.Graph, action, options=None) -> fx.Node | None:
    """Rewrite one planned site; returns the new collective (None: the plan no longer applies)."""
    if isinstance(action, PackedGather):
        return _apply_packed_gather(graph, action, options)
    if isinstance(action, GatheredQuant):
        return _apply_gathered_quant(graph, action, options)
    return None


def _emit_packed(graph: fx.Graph, norm: NormMatch | None, x: fx.Node, fuse: bool, keep_y: bool) -> fx.Node:
    """Insert the op that quantizes the local rows into a packed buffer; rewire the norm's outputs."""
    mx = torch.ops.mxfuse
    if not fuse:
        with graph.inserting_after(x):
            return call(graph, mx.mxfp8_quantize_packed.default, (x,))
    out = insert_fused_norm(graph, norm, packed=True, emit_y=keep_y)
    if keep_y:
        redirect_uses(norm.y, out["y"])
    return out["packed"]


def _new_gather(graph: fx.Graph, like: GatherMatch, x: fx.Node) -> fx.Node:
    """A gather of `x` of the same family, group and world size as `like`; returns the gathered node."""
    start = call(graph, like.start.target, (x, *like.start.args[1:]), dict(like.start.kwargs))
    start.meta["stack_trace"] = like.start.meta.get("stack_trace")
    if like.form == "c10d":
        return call(graph, like.out.target, (start,), dict(like.out.kwargs))
    return start


def _views(graph: fx.Graph, gathered: fx.Node, k: int) -> tuple[fx.Node, fx.Node]:
    codes = call(graph, aten.slice.Tensor, (gathered, 1, 0, k))
    codes = call(graph, aten.view.dtype, (codes, FP8))
    scales = call(graph, aten.slice.Tensor, (gathered, 1, k, k + k // 32))
    return codes, scales


def _scales_for(graph: fx.Graph, rowmajor: fx.Node, swizzled: bool, flat: bool, cache: dict) -> fx.Node:
    key = (swizzled, flat)
    if key not in cache:
        node = rowmajor
        if swizzled:
            node = call(graph, torch.ops.mxfuse.mxfp8_swizzle_scales.default, (node,))
            if flat:
                node = call(graph, aten.view.default, (node, [-1]))
        cache[key] = node
    return cache[key]


def _apply_packed_gather(graph: fx.Graph, action: PackedGather, options) -> fx.Node | None:
    norm = match_norm(action.norm.y)
    if norm is None or action.gather.start not in norm.y.users:
        return None
    gather = action.gather
    k = static_int(fake(norm.y).shape[-1])
    others = [u for u in norm.y.users if u is not gather.start]
    packed = _emit_packed(graph, norm, norm.y, action.fuse_norm, action.keep_bf16_gather or bool(others))
    with graph.inserting_before(gather.out):
        gathered = _new_gather(graph, gather, packed)
        codes, scales = _views(graph, gathered, k)
        if not action.keep_bf16_gather:
            _rewire_shape_reads(gather, gathered)
        cache: dict = {}
        for q in action.quants:
            if q.codes is not None:
                redirect_uses(q.codes, codes)
            if q.scales is not None:
                redirect_uses(q.scales, _scales_for(graph, scales, q.swizzled, q.flat_swizzled_scales, cache))
    return gathered


def _apply_gathered_quant(graph: fx.Graph, action: GatheredQuant, options) -> fx.Node | None:
    quant = match_quant(action.quant.node)
    if quant is None:
        return None
    k = static_int(fake(quant.x).shape[-1])
    swizzled = quant.swizzled
    flat = fake(action.scales_out).dim() == 1
    if action.to == "mxfp8":
        norm = action.norm if action.fuse_norm else None
        if norm is not None:
            norm = match_norm(norm.y)
        if norm is not None:
            others = [u for u in norm.y.users if u is not quant.node]
            packed = _emit_packed(graph, norm, norm.y, True, bool(others))
        else:
            packed = _emit_packed(graph, None, quant.x, False, True)
        with graph.inserting_before(action.codes_gather.start):
            gathered = _new_gather(graph, action.codes_gather, packed)
            codes, scales = _views(graph, gathered, k)
            scales = _scales_for(graph, scales, swizzled, flat, {})
        new_codes, new_scales = codes, scales
        result = gathered
    else:  # bf16: gather the quant's input, quantize after the gather with the quant's own op and flags
        with graph.inserting_before(action.codes_gather.start):
            gathered = _new_gather(graph, action.codes_gather, quant.x)
            new_quant = call(graph, quant.node.target, (gathered, *quant.node.args[1:]), dict(quant.node.kwargs))
            new_codes, new_scales = getitem(graph, new_quant, 0), getitem(graph, new_quant, 1)
            if fake(new_scales).dim() != fake(action.scales_out).dim():  # flattened (or unflattened) around the gather
                shape = [-1] if flat else [-1, (k // 32 + 3) // 4 * 4]
                new_scales = call(graph, aten.view.default, (new_scales, shape))
        result = new_quant
    _rewire_shape_reads(action.codes_gather, new_codes)
    redirect_uses(action.codes_out, new_codes)
    redirect_uses(action.scales_out, new_scales)
    return result


def example_inputs(m: int = 4, k: int = 64, dtype=torch.bfloat16):
    """Small `(x, residual, weight, eps)` local rows for tests (same as rewrite 1's)."""
    from mxfuse.patterns.norm_quant import example_inputs as ex

    return ex(m, k, dtype)


__all__ = [
    "NAME",
    "GatheredQuant",
    "PackedGather",
    "QuantSite",
    "Skip",
    "apply",
    "gather_reason",
    "plan",
    "plan_gathered_quant",
    "plan_norm_gather",
]
