"""Rewrite 2: MXFP8 quantization around the sequence-parallel all-gather (option `sp_gather`).

MXFP8 scales belong to 32 values of ONE row, so quantizing rows before or after a
row-wise (dim 0) all-gather gives the same bits; only 128x4-swizzled scale tiles do
not concatenate by rows. Collectives are recognized in both families by
:mod:`.collectives` (vLLM `vllm::all_gather(x, dim, world_size, group_name)`, and
PyTorch `_c10d_functional.all_gather_into_tensor(x, group_size, group_name)` +
`wait_tensor`); new collectives copy the found node's target, group and world size.

Form A: a producer (a norm of any form of :mod:`.norms`; any family of
:mod:`.producer_registry` with a packed row in `producers.FUSED_OPS`) gathered in bf16, then
quantized::

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

  The producer is fused only where rewrite 1 would fuse it (`fuse_norm_quant` on and its
  `reject_reason(packed=True)` is None); otherwise it stays and
  `mxfuse.mxfp8_quantize_packed(y)` packs its output. With `"mxfp8"` forced and other
  users of `g`, the bf16 gather is kept for them (and `y` emitted).

Form B: quantized BEFORE the gather, codes and scales gathered by two collectives::

    q, s = mxfp8_quantize(y, swizzled)                    # or vllm::mxfp8_quantize
    qg   = gather(q)          # or gather(q.view(uint8)).view(float8_e4m3fn): gloo takes no fp8
    sg   = gather(s)          # or gather(s.view(-1)) etc. (views of one user each, either side)

  With swizzled scales this is WRONG (the gathered buffer is W tiles of pad128(M)
  rows each, not the tiles of the W*M gathered rows) and is always repaired: in
  `"auto"`/`"mxfp8"` to the packed form above (producer fused when the quant reads a
  producer, else `mxfp8_quantize_packed(x)`), in `"bf16"` to `q, s = quant(gather(x),
  swizzled)` with the quant node's own op and arguments. With row-major scales it is
  correct but two collectives: `"auto"`/`"mxfp8"` pack it into one, `"bf16"` leaves it.

Left alone, with a :class:`Skip` (logged, shown by `mxfuse explain`): gather along a
dim other than 0, world size or group name not constants, gathered rows not
`world_size x` local rows, not 2-D rows, K symbolic or not a multiple of 32, dtype
not bf16/fp16, a vLLM quant that pads K, local codes/scales with other users.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import fx

from mxfuse.ops.reference import QuantRule
from mxfuse.patterns import sp_gather_apply
from mxfuse.patterns.collectives import GatherMatch, collective_ops, match_all_gather
from mxfuse.patterns.fx_utils import BYTE_VIEWS, fake, is_call, static_int
from mxfuse.patterns.gather_checks import (
    SpGatherCode,
    gather_reason,
    gathered_shapes_reason,
    rows_reason,
    shape_reads,
)
from mxfuse.patterns.producer_registry import find_producers, match_producer
from mxfuse.patterns.producers import ProducerMatch
from mxfuse.patterns.quants import QuantMatch, QuantSite, find_quants, quant_reject_reason, quant_users
from mxfuse.patterns.results import PlanSite, Reason, RefusalCode, Scope, SharedCode, Skip

NAME = "sp_gather"
MODES = ("auto", "bf16", "mxfp8")

aten = torch.ops.aten
# single-input view ops that may sit between a quant output and its gather (either side)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.cat.default)


def _layout(swizzled: bool) -> str:
    return "swizzled" if swizzled else "rowmajor"


@dataclass(frozen=True)
class PackedGatherKind:
    """Form A rewritten: `producer[(unfused)]->family_gather:mxfp8_packed:layouts[+bf16_gather]`."""

    producer_kind: str
    fuses_producer: bool
    writes_y: bool
    layout: str  # "rowmajor" | "swizzled" | "rowmajor+swizzled"
    gather_form: str  # "c10d" | "vllm"
    keeps_bf16_gather: bool
    rewrite = NAME
    packed_gather = True

    def __str__(self) -> str:
        src = self.producer_kind if self.fuses_producer else f"{self.producer_kind}(unfused)"
        extra = "+bf16_gather" if self.keeps_bf16_gather else ""
        return f"{src}->{self.gather_form}_gather:mxfp8_packed:{self.layout}{extra}"


@dataclass(frozen=True)
class GatheredQuantKind:
    """Form B rewritten: `repair:swizzled` (swizzled codes/scales gathered) or `two_gathers:rowmajor`,
    then `:family_gather->mxfp8_packed | bf16_gather`."""

    producer_kind: str | None
    fuses_producer: bool
    writes_y: bool
    packed_gather: bool
    swizzled: bool
    quant_form: str
    gather_form: str
    rewrite = NAME

    def __str__(self) -> str:
        what = "repair:swizzled" if self.swizzled else "two_gathers:rowmajor"
        return f"{what}:{self.gather_form}_gather->{'mxfp8_packed' if self.packed_gather else 'bf16_gather'}"


@dataclass(frozen=True)
class PackedGather:
    """Form A in mxfp8: producer -> one packed gather -> views for the quant(s)."""

    producer: ProducerMatch
    gather: GatherMatch
    quants: tuple[QuantSite, ...]
    fuse: bool  # the producer goes into the packed fused op
    keep_bf16_gather: bool

    @property
    def site(self) -> fx.Node:
        return self.producer.y

    @property
    def replaced(self) -> list[fx.Node]:
        kept = [] if self.keep_bf16_gather else [self.gather.start]
        return [*kept, *(q.node for q in self.quants)]

    @property
    def keep_y(self) -> bool:
        """The producer's bf16 y is still needed: unfused, kept for the bf16 gather, or read elsewhere."""
        others = any(u is not self.gather.start for u in self.producer.y.users)
        return not self.fuse or self.keep_bf16_gather or others

    @property
    def kind(self) -> PackedGatherKind:
        layout = "+".join(sorted({_layout(q.swizzled) for q in self.quants}))
        return PackedGatherKind(
            self.producer.kind, self.fuse, self.keep_y, layout, self.gather.form, self.keep_bf16_gather
        )


@dataclass(frozen=True)
class GatheredQuant:
    """Form B: a quant whose codes and scales each cross an all-gather."""

    quant: QuantMatch
    producer: ProducerMatch | None  # the producer the quant reads, if any
    codes_gather: GatherMatch
    codes_out: fx.Node  # the node consumers read the gathered codes from
    scales_gather: GatherMatch
    scales_out: fx.Node
    to: str  # "mxfp8" (one packed gather) or "bf16" (gather the input, quant after)
    fuse: bool  # the producer goes into the packed fused op

    @property
    def site(self) -> fx.Node:
        return self.quant.x

    @property
    def replaced(self) -> list[fx.Node]:
        return [self.quant.node, self.codes_gather.start, self.scales_gather.start]

    @property
    def kind(self) -> GatheredQuantKind:
        producer_kind = self.producer.kind if self.producer is not None else None
        return GatheredQuantKind(
            producer_kind=producer_kind,
            fuses_producer=self.fuse,
            writes_y=self.to == "bf16" or (producer_kind is not None and not self.fuse),
            packed_gather=self.to == "mxfp8",
            swizzled=self.quant.swizzled,
            quant_form=self.quant.form,
            gather_form=self.codes_gather.form,
        )


def _skip(producer: ProducerMatch | None, node: fx.Node, reason: Reason) -> Skip:
    """A skip at a producer, or at a quant input that is not a producer (`producer` None)."""
    return Skip(NAME, node, producer.kind if producer is not None else None, reason.code, reason.text)


def packed_reason(quant: QuantSite) -> Reason | None:
    """Why the packed gather's views cannot stand in for this quant's outputs (None: they can)."""
    if quant.rule is not QuantRule.DEFAULT:
        return Reason(
            SharedCode.QUANT_UNSUPPORTED,
            f"a {quant.form} quant across the all-gather: the packed ops encode NaN and scale byte 0 "
            f"the default way, not as {quant.form} does ({quant.rule.name}); the gather stays as it is",
        )
    return None


class SpGather:
    """Rewrite 2 (see the module docstring), built with its mode and whether it may fuse the producer
    (`fuse_norm`: the option `fuse_norm_quant`)."""

    name = NAME
    warning_head = ""
    undo = Scope.SITE

    def __init__(self, mode: str = "auto", fuse_norm: bool = True):
        if mode not in MODES:
            raise ValueError(f"SpGather: mode {mode!r} is not one of {MODES}")
        self.mode, self.fuse_norm = mode, fuse_norm
        self._moved: dict[fx.Node, fx.Node] = {}  # planned node -> what replaced it, in this run's applies

    def plan(self, graph: fx.Graph, plan_site: PlanSite) -> list[PackedGather | GatheredQuant | Skip]:
        """Decide every rewrite without touching the graph."""
        if not any(graph.find_nodes(op="call_function", target=op) for op in collective_ops()):
            return []
        planned: list[PackedGather | GatheredQuant | Skip] = []
        for quant in find_quants(graph):
            site = quant.x if isinstance(quant.x, fx.Node) else quant.node
            verdict = plan_site(NAME, site, None, partial(self.plan_gathered_quant, quant))
            if verdict is not None:
                planned.append(verdict)
        for producer in find_producers(graph):
            y = producer.y
            for user in list(y.users):
                gather = match_all_gather(user)
                if gather is not None and gather.x is y:
                    plan = partial(self.plan_producer_gather, producer, gather)
                    planned.append(plan_site(NAME, y, producer.kind, plan))
        return planned

    def apply(self, graph: fx.Graph, fusion: PackedGather | GatheredQuant) -> fx.Node | None:
        """Rewrite one planned site; returns the new collective (None: the plan no longer applies)."""
        producer: ProducerMatch | None
        if isinstance(fusion, PackedGather):
            producer = fusion.producer.moved(self._moved)
            if fusion.gather.start not in producer.y.users:
                return None
            done = sp_gather_apply.apply_packed_gather(
                graph, producer, fusion.gather, fusion.quants, fusion.fuse, fusion.keep_bf16_gather, fusion.keep_y
            )
        else:
            producer = fusion.producer.moved(self._moved) if fusion.producer is not None and fusion.fuse else None
            done = sp_gather_apply.apply_gathered_quant(
                graph,
                fusion.quant,
                producer,
                (fusion.codes_gather, fusion.codes_out),
                (fusion.scales_gather, fusion.scales_out),
                fusion.to,
            )
        gathered, sides = done
        if producer is not None:
            for name, node in producer.side_outputs().items():
                if name in sides:  # the fused op's output now stands for it
                    self._moved[node] = sides[name]
        return gathered

    def _can_fuse(self, producer: ProducerMatch | None) -> bool:
        return producer is not None and self.fuse_norm and producer.reject_reason(packed=True) is None

    def plan_producer_gather(self, producer: ProducerMatch, gather: GatherMatch) -> PackedGather | Skip:
        """Form A: a producer whose output y is all-gathered, then quantized."""
        return _plan_producer_gather(producer, gather, self.mode, self._can_fuse(producer))

    def plan_gathered_quant(self, quant: QuantSite) -> GatheredQuant | Skip | None:
        """Form B: a quant whose codes and scales cross all-gathers (None: not this form)."""
        return _plan_gathered_quant(quant, self.mode, self._can_fuse)


def _plan_producer_gather(
    producer: ProducerMatch, gather: GatherMatch, mode: str, can_fuse: bool
) -> PackedGather | Skip:
    y = producer.y

    def no(code: RefusalCode, text: str) -> Skip:
        return _skip(producer, y, Reason(code, text))

    reason = rows_reason(fake(y), "norm output") or gather_reason(gather)
    if reason is not None:
        return _skip(producer, y, reason)
    quants = quant_users(gather.out)
    if not quants:
        if any(is_call(u, *_SPLITS) for u in gather.out.users):
            return no(
                SpGatherCode.GATHER_SPLIT,
                "the all-gather is followed by split/cat: a gather along a dim other than 0 (rows)",
            )
        return no(SharedCode.NO_QUANT, "no MXFP8 quant reads the gathered rows")
    usable = tuple(q for q in quants if quant_reject_reason(q) is None and packed_reason(q) is None)
    if not usable:
        refused = quant_reject_reason(quants[0]) or packed_reason(quants[0])
        assert refused is not None  # no quant is usable
        return _skip(producer, y, refused)
    if mode == "bf16":
        return no(
            SpGatherCode.MODE_KEEPS, "sp_gather='bf16': the gather carries bf16 and the quant runs after it (kept)"
        )
    if shape_reads(gather, dims_other_than_0=True):
        return no(
            SpGatherCode.SHAPE_READS,
            "a shape read of the gathered tensor along dim != 0 (its width changes when packed)",
        )
    served = {q.reads for q in usable} | set(shape_reads(gather))
    others = [u for u in gather.out.users if u not in served]
    if others and mode == "auto":
        names = ", ".join(u.name for u in others[:3])
        return no(
            SpGatherCode.OTHER_USERS,
            f"sp_gather='auto': the gathered bf16 has other users ({names}); it stays a bf16 gather",
        )
    return PackedGather(producer, gather, usable, can_fuse, bool(others))


def _through_views(node: fx.Node) -> fx.Node:
    """Follow single-user view ops from `node`; returns the last node of the chain."""
    while len(node.users) == 1:
        (user,) = node.users
        if is_call(user, *BYTE_VIEWS) and user.args[0] is node:
            node = user
        else:
            break
    return node


def gather_chain(node: fx.Node | None) -> tuple[GatherMatch, fx.Node] | None:
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


def _plan_gathered_quant(
    quant: QuantSite, mode: str, can_fuse: Callable[[ProducerMatch | None], bool]
) -> GatheredQuant | Skip | None:
    codes_chain, scales_chain = gather_chain(quant.codes), gather_chain(quant.scales)
    if codes_chain is None and scales_chain is None:
        return None
    producer = match_producer(quant.x)
    site = producer.y if producer is not None else quant.x
    what = "swizzled" if quant.swizzled else "row-major"
    if not isinstance(quant, QuantMatch):  # torchao's chain: its codes/scales gathered
        text = f"a {quant.form} quant's codes/scales cross an all-gather; the rewrite repairs only quant ops"
        return _skip(producer, site, Reason(SharedCode.QUANT_UNSUPPORTED, text))
    if codes_chain is None or scales_chain is None:
        text = f"only one of the {what} quant's codes/scales crosses an all-gather (or has other users)"
        return _skip(producer, site, Reason(SpGatherCode.PARTIAL_GATHER, text))
    (cg, codes_out), (sg, scales_out) = codes_chain, scales_chain
    reason = rows_reason(fake(quant.x), "quant input") or quant_reject_reason(quant)
    reason = reason or gather_reason(cg) or gather_reason(sg)
    if reason is None and (cg.form, cg.group_name, cg.world_size) != (sg.form, sg.group_name, sg.world_size):
        text = "codes and scales are gathered by different groups or collective families"
        reason = Reason(SpGatherCode.GROUP_MISMATCH, text)
    if reason is None and (shape_reads(sg) or shape_reads(sg, True) or shape_reads(cg, True)):
        reason = Reason(SpGatherCode.SHAPE_READS, "shape reads of the gathered scales (or of the codes along dim != 0)")
    world_size = static_int(cg.world_size)
    if reason is None and world_size is not None:  # gather_reason refused a world size that is not static
        reason = gathered_shapes_reason(quant, codes_out, scales_out, world_size)
    if reason is not None:
        return _skip(producer, site, reason.prefixed(f"{what} quant before an all-gather: "))
    if mode == "bf16" and not quant.swizzled:
        text = "sp_gather='bf16': codes and row-major scales gathered separately are exact (kept)"
        return _skip(producer, site, Reason(SpGatherCode.MODE_KEEPS, text))
    to = "bf16" if mode == "bf16" else "mxfp8"
    return GatheredQuant(quant, producer, cg, codes_out, sg, scales_out, to, can_fuse(producer) and to == "mxfp8")
