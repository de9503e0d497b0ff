"""Undo for in-place FX graph edits, so a failing rewrite leaves the graph exactly as it was."""

from __future__ import annotations

from torch import fx


class GraphTransaction:
    """Records a graph's nodes, their order, arguments and `eager_input_vals`; `rollback()`
    restores them.

    Rewrites inside a transaction may add nodes, rewire arguments and reorder nodes,
    but must not erase nodes that existed before (erase after `commit`).
    """

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.order = list(graph.nodes)
        self.known = set(self.order)
        self.args = {node: (node.args, node.kwargs) for node in self.order}
        # rewires re-record their users' eager_input_vals (fx_utils.redirect_uses)
        self.eager_vals = {
            node: node.meta["eager_input_vals"] for node in self.order if "eager_input_vals" in node.meta
        }

    def rollback(self):
        for node, (args, kwargs) in self.args.items():
            if node.args is not args or node.kwargs is not kwargs:
                node.args, node.kwargs = args, kwargs
        for node, vals in self.eager_vals.items():
            node.meta["eager_input_vals"] = vals
        for node in reversed(list(self.graph.nodes)):
            if node not in self.known:
                node.args, node.kwargs = (), {}
        for node in reversed(list(self.graph.nodes)):
            if node not in self.known:
                self.graph.erase_node(node)
        for before, after in zip(self.order, self.order[1:]):
            if before.next is not after:
                before.append(after)

    def erase_dead(self, roots):
        """Erase the nodes made dead by the rewrites, starting from `roots` (not the rest)."""
        work = list(roots)
        while work:
            node = work.pop()
            if getattr(node, "_erased", False) or node.op != "call_function" or node.users:
                continue
            if node.is_impure() and not _is_functional_wait(node):
                continue
            inputs = node.all_input_nodes
            self.graph.erase_node(node)
            work.extend(inputs)


def _is_functional_wait(node) -> bool:
    """`_c10d_functional.wait_tensor` (which torch marks side-effectful): once a rewrite left
    it without users, it and its collective are dead on every rank (SPMD graph) and erasable."""
    import torch

    return node.target is torch.ops._c10d_functional.wait_tensor.default
