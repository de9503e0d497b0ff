"""The site transaction (records only what a site touches) and the pass's cost in graph size.

Graphs are the reference model (`mxfuse.models.Model`, tiny config) traced by make_fx with
Inductor's decompositions under fake tensors, as a post-grad pass sees them. A site's
rollback must restore node order, arguments, users (in order) and meta bit for bit; the
pass must stay linear in the graph's size, which is checked by counting work (lines of
mxfuse code executed, and records per site), not by timing, so a loaded machine cannot
make it flaky.
"""

from __future__ import annotations

import sys

import pytest
import torch
from graph_helpers import trace
from torch import fx

import mxfuse
from mxfuse.models import Model, ModelConfig, example_inputs
from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions
from mxfuse.passes.transaction import GraphTransaction, SiteTransaction, site_transaction
from mxfuse.patterns.producer_quant import ProducerQuant

_TRACED: dict[int, fx.GraphModule] = {}


def traced(layers: int) -> fx.GraphModule:
    """A fresh copy of the reference model's traced graph with `layers` layers."""
    if layers not in _TRACED:
        model = Model(ModelConfig.tiny(n_layers=layers))
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        names = list(state)

        def fn(ids, *weights):
            return torch.func.functional_call(model, dict(zip(names, weights)), (ids,))

        _TRACED[layers] = trace(fn, example_inputs(model.config, 8), *state.values(), decompose=True)
    gm = _TRACED[layers]
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def fingerprint(graph: fx.Graph) -> list[tuple]:
    """Everything a rollback must restore, by identity: order, args, kwargs, users in order, meta."""
    return [
        (node, node.name, node.args, node.kwargs, tuple(node.users), tuple((k, id(v)) for k, v in node.meta.items()))
        for node in graph.nodes
    ]


def assert_same(before: list[tuple], graph: fx.Graph) -> None:
    after = fingerprint(graph)
    assert [row[0] for row in after] == [row[0] for row in before], "node order"
    for old, new in zip(before, after):
        assert old[1] == new[1]
        assert old[2] is new[2] or old[2] == new[2], (old[1], "args")
        assert old[3] is new[3] or old[3] == new[3], (old[1], "kwargs")
        assert old[4] == new[4], (old[1], "users (in order)")
        assert old[5] == new[5], (old[1], "meta")
    graph.lint()


def canonical(graph: fx.Graph) -> list[tuple]:
    """The graph with nodes as positions (names differ: a rolled-back node's name stays taken)."""
    index = {node: i for i, node in enumerate(graph.nodes)}
    at = lambda a: fx.node.map_arg(a, lambda n: index[n])  # noqa: E731
    return [(n.op, str(n.target), at(n.args), at(n.kwargs), [index[u] for u in n.users]) for n in graph.nodes]


def planned_fusions(graph: fx.Graph):
    planned = ProducerQuant().plan(graph, lambda rewrite, node, kind, plan: plan())
    fusions = [p for p in planned if not hasattr(p, "code")]
    assert fusions
    return fusions


def test_a_failing_site_is_restored_bit_for_bit():
    """Apply every site but roll each back, one at a time, after it rewired the graph."""
    gm = traced(2)
    before = fingerprint(gm.graph)
    rewrite = ProducerQuant()
    for fusion in planned_fusions(gm.graph):
        transaction = SiteTransaction(gm)
        assert rewrite.apply(gm.graph, fusion) is not None
        assert transaction.inserted and transaction.saved  # it inserted the fused op and rewired readers
        transaction.rollback()
        assert_same(before, gm.graph)
    assert not (gm._create_node_hooks or gm._replace_hooks or gm._erase_node_hooks)


def test_a_rolled_back_site_between_applied_ones_leaves_exactly_the_others():
    """Site 2 of 3 fails: the graph equals the one where only sites 1 and 3 were applied."""

    def apply(graph_module, skip_index=None, fail_index=None):
        rewrite = ProducerQuant()
        for i, fusion in enumerate(planned_fusions(graph_module.graph)):
            if i == skip_index:
                continue
            transaction = SiteTransaction(graph_module)
            rewrite.apply(graph_module.graph, fusion)
            if i == fail_index:
                transaction.rollback()
            transaction.close()
        return canonical(graph_module.graph)

    assert apply(traced(2), fail_index=1) == apply(traced(2), skip_index=1)


def test_a_site_may_not_erase_a_node_it_did_not_insert():
    gm = traced(1)
    before = fingerprint(gm.graph)
    transaction = SiteTransaction(gm)
    dead = gm.graph.call_function(torch.ops.aten.neg.default, (next(iter(gm.graph.nodes)),))
    gm.graph.erase_node(dead)  # its own: fine
    victim = next(n for n in gm.graph.nodes if n.op == "call_function" and not n.users)
    with pytest.raises(RuntimeError, match="did not insert"):
        gm.graph.erase_node(victim)
    transaction.rollback()
    assert_same(before, gm.graph)


def test_an_edit_the_record_did_not_see_is_caught_and_the_pass_restores_the_whole_graph(monkeypatch, caplog):
    """A rewire by plain argument assignment bypasses the node hooks: rollback finds the users
    it did not record, raises, and the pass's whole-graph transaction restores everything."""
    gm = traced(1)
    before = gm.graph.python_code("self", verbose=True).src
    real_apply = ProducerQuant.apply

    def sneaky_apply(self, graph, fusion):
        out = real_apply(self, graph, fusion)
        reader = next(u for u in fusion.producer.x.users if u.op == "call_function")
        reader.args = tuple(out if a is fusion.producer.x else a for a in reader.args)  # not through the hooks
        raise RuntimeError("injected failure")

    monkeypatch.setattr(ProducerQuant, "apply", sneaky_apply)
    with caplog.at_level("WARNING", logger="mxfuse"):
        report = post_grad.run(gm.graph, PassOptions(strict=False))
    assert report.failed  # the rollback of the site raised (it found what it did not record)
    assert gm.graph.python_code("self", verbose=True).src == before


def test_a_bare_graph_gets_a_whole_snapshot():
    gm = traced(1)
    bare = fx.Graph()
    bare.output(bare.graph_copy(gm.graph, {}))
    assert isinstance(site_transaction(bare), GraphTransaction)
    assert isinstance(site_transaction(gm.graph), SiteTransaction)


def test_a_site_records_the_same_work_at_any_graph_size(monkeypatch):
    """Records per site (nodes inserted + nodes rewired) do not grow with the graph."""
    per_site: dict[int, list[int]] = {}
    real = post_grad.site_transaction

    for layers in (1, 4):
        opened: list[SiteTransaction] = []

        def record(graph, opened=opened):
            transaction = real(graph)
            opened.append(transaction)
            return transaction

        monkeypatch.setattr(post_grad, "site_transaction", record)
        report = post_grad.run(traced(layers).graph, PassOptions())
        assert len(opened) == len(report.applied) > 0
        per_site[layers] = sorted({t.records for t in opened})
    assert per_site[1] == per_site[4]


def _mxfuse_lines(fn) -> int:
    """Lines of mxfuse code `fn()` executes (loop iterations included): work, not time."""
    root = mxfuse.__file__.rsplit("/", 1)[0]
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
        return local

    def on_call(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(root) else None

    old = sys.gettrace()
    sys.settrace(on_call)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count[0]


def test_the_pass_does_linear_work_in_the_graph_size():
    """Lines of mxfuse code the pass executes on 2 vs 8 layers (4x the nodes): linear work gives 4x;
    a scan of the graph per site (what the whole-graph snapshot per site did) gives ~10x here."""
    options = PassOptions(strict=True)
    small, large = traced(2), traced(8)
    nodes = len(large.graph.nodes) / len(small.graph.nodes)
    ratio = _mxfuse_lines(lambda: post_grad.run(large.graph, options)) / _mxfuse_lines(
        lambda: post_grad.run(small.graph, options)
    )
    assert ratio < 1.5 * nodes, f"{ratio:.1f}x the work for {nodes:.1f}x the nodes"


def test_every_inserted_node_carries_the_fake_value_inductor_recomputes():
    """Inductor's FakeTensorUpdater re-runs every node it has not seen; what it computes for the
    pass's nodes must equal their `meta["val"]` in all but storage (shape, strides, dtype, device,
    offset), so nothing downstream changes shape. (It still re-propagates their downstream: torch
    2.14 treats a fresh storage as a change; docs/perf_notes.md, "Compile time".)"""
    from torch._inductor.fx_utils import _is_fake_tensor_same, get_fake_args_kwargs
    from torch._subclasses.fake_tensor import FakeTensor

    gm = traced(2)
    known = set(gm.graph.nodes)
    report = post_grad.run(gm.graph, PassOptions(strict=True))
    inserted = [n for n in gm.graph.nodes if n not in known and n.op == "call_function"]
    assert report.applied and inserted
    mode = next(v for v in (n.meta.get("val") for n in known) if isinstance(v, FakeTensor)).fake_mode
    for node in inserted:
        valid, args, kwargs = get_fake_args_kwargs(node, gm)
        assert valid, node
        with mode:
            again = node.target(*args, **kwargs)
        assert _is_fake_tensor_same(again, node.meta["val"], {}, check_storage=False), node.format_node()
