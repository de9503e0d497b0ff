"""Rewrite 0 (opt-in, `sequence_parallel=True`): tensor-parallel all-reduces become sequence parallelism.

Before (every rank computes all T token rows after each row-parallel GEMM)::

    o        = all_reduce(o_partial)                      # after o_proj / down_proj
    y, res   = gemma_fused_add_rmsnorm(o, res, w, eps)    # T rows, on every rank
    q, s     = mxfp8_quantize(y)                          # -> next GEMM

After (T/W rows per rank between the layers; the residual stream stays sharded)::

    o_l      = reduce_scatter(pad(o_partial))             # this rank's rows of the sum
    y_l, res_l = gemma_fused_add_rmsnorm(o_l, res_l, w, eps)
    y        = all_gather(y_l)                            # rewrite 2 (sp_gather) places the quant here
    q, s     = mxfp8_quantize(y)

It runs BEFORE `sp_gather` and leaves exactly the "norm -> all_gather -> quant" shape
that rewrite emits bf16, packed MXFP8 or auto from. The norm nodes stay what they were
(mxfuse ops, vLLM IR ops, or Hugging Face's decomposed ATen); only their inputs change,
and their fake values are re-derived on the local rows.

- A norm is sequence-parallel when an input (x or residual) is an all-reduce's output or
  an output of another sequence-parallel norm. Its other input, when replicated (the
  first layer's residual: the embedding output), is cut to the local rows by
  `mxfuse::sp_local_rows` (rank read at run time from the group, see `ops/sp_rows.py`).
- Every local value read by anything else (a quant, the LM head, the graph output, a
  residual leaving the graph) is all-gathered first: the final norm is gathered after it.
- Token counts W does not divide: padded (see `docs/sp_notes.md` for why pad, not skip).
  Static T with T % W == 0: no padding. Otherwise the partial sums (and replicated
  inputs) get zero rows up to W * ceil(T/W); zero rows stay zero through the add and
  the norm (eps > 0); gathered values are cut back to T rows, and a quant op (mxfuse's or
  vLLM's) reads the padded gather and its codes/scales are cut (row-major scales are per
  row, so exact). Quants are read through :func:`.quants.quant_users` (every form); one that
  is a chain of ATen nodes (torchao's) reads the cut rows like any other reader: it computes
  on the T rows, exact, and rewrite 2 then sees `norm -> gather -> cut -> quant` (and leaves it).
- All or nothing per graph: if any all-reduce of the graph cannot be rewritten, the
  graph is left exactly as it was with a :class:`Skip` saying which and why. Every
  decision reads only the graph (and the group's world size, the same on every rank),
  so all ranks decide alike and no collective is left unmatched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import mxfuse.ops.sp_rows  # noqa: F401  (registers mxfuse::sp_local_rows, which the rewrite emits)
from mxfuse.patterns.all_reduces import AllReduce, all_reduce_reason, is_all_reduce, match_all_reduce, world_size_of
from mxfuse.patterns.fx_utils import (
    call,
    fake,
    getitem_users,
    known_fake,
    redirect_uses,
    refresh_eager_input_vals,
    static_int,
)
from mxfuse.patterns.norms import NormMatch, find_norms
from mxfuse.patterns.quants import QuantMatch, quant_users
from mxfuse.patterns.results import PlanSite, RefusalCode, Scope, Skip
from mxfuse.patterns.sp_emit import (
    Collectives,
    Rows,
    all_gather,
    comes_before,
    cut,
    padded,
    reduce_scatter,
    refresh,
    row_nodes,
)

NAME = "sequence_parallel"
aten = torch.ops.aten
SUPPORTED_NORM_FORMS = ("mxfuse", "vllm_ir", "hf")  # one node (or ATen chain) whose inputs can be rewired


class SequenceParallelCode(RefusalCode):
    """Refusals of rewrite 0: each leaves the whole graph as it was (the skip names an all-reduce)."""

    @property
    def scope(self) -> Scope:
        return Scope.GRAPH

    ALL_REDUCE_FORM = "an all-reduce that is not a sum over a constant group of 2-D token rows"
    ALL_REDUCE_GROUPS = "all-reduces over more than one group or family"
    WORLD_SIZE_UNKNOWN = "the group's world size is unknown, or 1"
    ROWS_DIFFER = "an input to shard is not 2-D with the all-reduce's token rows"
    ALL_REDUCE_NO_NORM = "an all-reduce feeds no norm"
    NORM_IN_PLACE = "a norm reading an all-reduce is in place (auto_functionalized)"
    SWIZZLED_PADDED = "swizzled scales of rows that may be padded"
    UNGATHERABLE = "a value read outside the local rows has no tensor to gather"


@dataclass(frozen=True)
class SequenceParallelKind:
    """The graph's all-reduces became reduce-scatters (`sequence_parallel:family_all_reduce->reduce_scatter[+pad]`)."""

    family: str  # "c10d" | "vllm"
    padded: bool
    rewrite = NAME
    producer_kind = None
    fuses_producer = False
    writes_y = False
    packed_gather = False

    def __str__(self) -> str:
        return f"sequence_parallel:{self.family}_all_reduce->reduce_scatter{'+pad' if self.padded else ''}"


@dataclass(frozen=True)
class SequenceParallelPlan:
    """The whole-graph rewrite (a :class:`~mxfuse.patterns.results.Fusion`): every all-reduce of the
    group, every norm it makes local."""

    family: str
    group_name: str
    world_size: int
    rows: object  # T: int, or the SymInt of the token count
    pad: bool  # T may not be a multiple of world_size
    all_reduces: tuple[AllReduce, ...]
    norms: tuple[NormMatch, ...]
    region: tuple[fx.Node, ...]  # the nodes computing on local rows (graph order)
    replicated: tuple[fx.Node, ...]  # full tensors cut to the local rows (the first layer's residual)

    @property
    def replaced(self) -> list[fx.Node]:
        return [ar.start for ar in self.all_reduces]

    @property
    def site(self) -> fx.Node:
        return self.all_reduces[0].start

    @property
    def collectives(self) -> Collectives:
        return Collectives(self.family, self.group_name, self.world_size)

    @property
    def kind(self) -> SequenceParallelKind:
        return SequenceParallelKind(self.family, self.pad)


def _skip(all_reduce: fx.Node, code: SequenceParallelCode, reason: str) -> Skip:
    """The whole graph left as it was: named by an all-reduce (the reason names the node at fault)."""
    return Skip(NAME, all_reduce, None, code, reason)


# ------------------------------------------------------------------ plan


def _norm_inputs(norm: NormMatch) -> list[fx.Node]:
    return [n for n in (norm.x, norm.residual) if isinstance(n, fx.Node)]


def _norm_region(norm: NormMatch) -> list[fx.Node]:
    """The nodes between the norm's inputs and its outputs (y, residual_out, getitems)."""
    inputs = set(_norm_inputs(norm))
    ancestors, work = set(), [n for n in (norm.y, norm.residual_out) if n is not None]
    while work:
        node = work.pop()
        if node in ancestors or node in inputs:
            continue
        ancestors.add(node)
        work.extend(node.all_input_nodes)
    region: list[fx.Node] = []
    for node in _graph_order(ancestors):
        if any(i in inputs or i in region for i in node.all_input_nodes):
            region.append(node)
    extra = [g for n in region for gs in getitem_users(n).values() for g in gs if g not in region]
    return region + extra


def _graph_order(nodes) -> list[fx.Node]:
    """`nodes` (distinct) in graph order: FX orders nodes by position, kept current on insert."""
    return sorted(set(nodes))


def _outside_users(node: fx.Node, region: set) -> list[fx.Node]:
    return [u for u in node.users if u not in region]


def plan_graph(graph: fx.Graph) -> SequenceParallelPlan | Skip | None:
    """The whole-graph decision (None: no all-reduce, nothing to do)."""
    starts = [n for n in graph.nodes if is_all_reduce(n)]
    if not starts:
        return None
    ars: list[AllReduce] = []
    for start in starts:
        ar = match_all_reduce(start)
        reason = all_reduce_reason(ar)
        if reason is not None:
            return _skip(start, SequenceParallelCode.ALL_REDUCE_FORM, reason)
        assert ar is not None  # all_reduce_reason refuses None
        ars.append(ar)
    groups = {(ar.family, str(ar.group_name)) for ar in ars}  # all_reduce_reason: each a str
    if len(groups) != 1:
        return _skip(
            ars[0].start, SequenceParallelCode.ALL_REDUCE_GROUPS, f"all_reduces over several groups {sorted(groups)}"
        )
    family, group = groups.pop()
    world = world_size_of(graph, family, group)
    if world is None or world < 2:
        why = "unknown (no collective or process group carries it)" if world is None else f"{world}: nothing to shard"
        return _skip(ars[0].start, SequenceParallelCode.WORLD_SIZE_UNKNOWN, f"world size of group {group!r} {why}")
    rows = known_fake(ars[0].x).shape[0]

    sharded = {ar.out for ar in ars}
    norms: list[NormMatch] = []
    for norm in find_norms(graph):
        if not any(i in sharded for i in _norm_inputs(norm)):
            continue
        if norm.form not in SUPPORTED_NORM_FORMS:
            return _skip(
                ars[0].start,
                SequenceParallelCode.NORM_IN_PLACE,
                f"{norm.kind} norm {norm.y.name} reads an all-reduce; {norm.form} norms (in place, under "
                "auto_functionalized) are not rewritten to local rows",
            )
        norms.append(norm)
        sharded |= {n for n in (norm.y, norm.residual_out) if n is not None}
    read_by_norm = {i for norm in norms for i in _norm_inputs(norm)}
    for ar in ars:
        if ar.out not in read_by_norm:
            return _skip(
                ar.start,
                SequenceParallelCode.ALL_REDUCE_NO_NORM,
                f"all_reduce {ar.start.name} feeds no norm (e.g. an MoE or another reduction); "
                "the graph keeps its all-reduces",
            )
    region_list = [n for norm in norms for n in _norm_region(norm)]
    region = set(region_list)
    replicated = _graph_order({i for i in read_by_norm if i not in sharded})
    for node in [ar.x for ar in ars] + replicated:
        val = fake(node)
        if val is None or val.dim() != 2 or not statically_known_true(val.shape[0] == rows):
            shape = None if val is None else tuple(val.shape)
            text = f"{node.name} {shape} is not 2-D with the {rows} token rows"
            return _skip(ars[0].start, SequenceParallelCode.ROWS_DIFFER, text)
    t = static_int(rows)
    pad = t is None or t % world != 0
    for node in [ar.out for ar in ars] + region_list:
        placed = _padded_quants(node) if pad else {}
        for user in _outside_users(node, region):
            if user.op == "output":
                continue
            if fake(node) is None:
                return _skip(
                    ars[0].start, SequenceParallelCode.UNGATHERABLE, f"{node.name} has no tensor value to gather"
                )
            quant = placed.get(user)
            if quant is not None and quant.swizzled:
                return _skip(
                    ars[0].start,
                    SequenceParallelCode.SWIZZLED_PADDED,
                    f"token count {rows} may not divide world size {world} and quant {user.name} asks for swizzled "
                    "scales (a padded gather's 128x4 tiles do not cut back to T rows)",
                )
    return SequenceParallelPlan(
        family, group, world, rows, pad, tuple(ars), tuple(norms), tuple(_graph_order(region)), tuple(replicated)
    )


# ------------------------------------------------------------------ apply


def _rewrite(graph: fx.Graph, action: SequenceParallelPlan) -> fx.Node | None:
    """Rewrite the whole graph as planned; returns the last reduce-scatter (None: plan stale)."""
    if any(ar.start.graph is not graph for ar in action.all_reduces):
        return None
    region, coll = set(action.region), action.collectives
    first = _graph_order([ar.x for ar in action.all_reduces] + list(action.replicated))[0]
    rows = row_nodes(graph, action.rows, action.world_size, first)
    local: dict[fx.Node, fx.Node] = {}
    for ar in action.all_reduces:
        with graph.inserting_before(ar.start):
            local[ar.out] = reduce_scatter(graph, coll, padded(graph, ar.x, rows))
    for full in action.replicated:
        anchor = rows.pad if isinstance(rows.pad, fx.Node) and comes_before(full, rows.pad) else full
        with graph.inserting_after(anchor):
            full_rows = padded(graph, full, rows)
        with graph.inserting_after(full_rows):
            args, flags = (full_rows, action.world_size, action.group_name), {"vllm": action.collectives.vllm}
            local[full] = call(graph, torch.ops.mxfuse.sp_local_rows.default, args, flags)
    for node in action.region:
        for old, new in local.items():
            if old in node.all_input_nodes:
                node.replace_input_with(old, new)
        refresh(node)
    sources = [(ar.out, local[ar.out]) for ar in action.all_reduces] + [(n, n) for n in action.region]
    for full_node, local_node in sources:
        outside = _outside_users(full_node, region)
        if outside:
            _gather_for(graph, action, rows, full_node, local_node, outside)
    return local[action.all_reduces[-1].out]


def _padded_quants(node: fx.Node) -> dict[fx.Node, QuantMatch]:
    """The quant ops reading `node` (of :func:`quant_users`, every form), by the node that reads it: with
    padded rows they read the padded gather and their outputs are cut; other forms read the cut rows."""
    return {q.reads: q for q in quant_users(node) if isinstance(q, QuantMatch)}


def _gather_for(
    graph: fx.Graph,
    action: SequenceParallelPlan,
    rows: Rows,
    full_node: fx.Node,
    local_node: fx.Node,
    users: list[fx.Node],
) -> None:
    """All-gather `local_node` for `users` (which read `full_node`); cut padding rows back off."""
    placed = _padded_quants(full_node) if action.pad else {}
    with graph.inserting_after(local_node):
        gathered = all_gather(graph, action.collectives, local_node)
    cut_rows = None
    for user in users:
        quant = placed.get(user)
        if quant is not None:
            _quant_on_padded(graph, quant.node, full_node, gathered, rows)
            continue
        if action.pad and cut_rows is None:
            with graph.inserting_after(gathered):
                cut_rows = cut(graph, gathered, rows)
        user.replace_input_with(full_node, cut_rows if cut_rows is not None else gathered)
        refresh_eager_input_vals(user)


def _quant_on_padded(graph: fx.Graph, quant: fx.Node, full_node: fx.Node, gathered: fx.Node, rows: Rows) -> None:
    """The quant reads the padded gather (so sp_gather still sees norm -> gather -> quant);
    its codes and row-major scales are cut back to T rows (each row's scales are its own)."""
    quant.replace_input_with(full_node, gathered)
    refresh(quant)
    for outputs in getitem_users(quant).values():
        for out in outputs:
            refresh(out)
            with graph.inserting_after(out):
                out_rows = cut(graph, out, rows)
            redirect_uses(out, out_rows, keep=lambda user, out_rows=out_rows: user is out_rows)


class SequenceParallelRewrite:
    """Rewrite 0 (see the module docstring; built by the pass only with `sequence_parallel=True`): one
    plan item per graph, a fusion or a whole-graph skip."""

    name = NAME
    warning_head = ""
    undo = Scope.GRAPH  # its one site is the whole graph, and it re-derives the metadata of nodes whose
    # inputs it does not replace, which a site record does not see: the pass snapshots the graph

    def plan(self, graph: fx.Graph, plan_site: PlanSite) -> list[SequenceParallelPlan | Skip]:
        """The whole-graph decision (none: no all-reduce)."""
        starts = [n for n in graph.nodes if is_all_reduce(n)]
        if not starts:
            return []
        verdict = plan_site(NAME, starts[0], None, lambda: plan_graph(graph))
        return [] if verdict is None else [verdict]

    def apply(self, graph: fx.Graph, fusion: SequenceParallelPlan) -> fx.Node | None:
        """Rewrite the whole graph as planned; returns the last reduce-scatter (None: the plan is stale)."""
        return _rewrite(graph, fusion)


__all__ = [
    "NAME",
    "AllReduce",
    "SequenceParallelCode",
    "SequenceParallelKind",
    "SequenceParallelPlan",
    "SequenceParallelRewrite",
    "match_all_reduce",
    "plan_graph",
    "world_size_of",
]
