"""Undo for in-place FX graph edits, so a failing rewrite leaves the graph exactly as it was.

Two forms. :class:`GraphTransaction` snapshots the whole graph (the pass opens one, the
last line of defence, and one for a rewrite whose site is the whole graph).
:class:`SiteTransaction` records only what one site touches, through the graph module's
node hooks, so that a pass over S sites of an N-node graph costs O(N + S), not O(N x S).
"""

from __future__ import annotations

from typing import Protocol

from torch import fx


class Transaction(Protocol):
    def rollback(self) -> None: ...

    def close(self) -> None: ...


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

    def close(self):
        """Nothing to release: a snapshot holds no hooks."""

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


class SiteTransaction:
    """Records what one site does to a graph module's graph, as it does it; `rollback()` undoes it.

    Through the module's create / replace / erase node hooks it records the nodes inserted,
    and, before a node's inputs are first replaced, that node's arguments, its `meta` (the
    rewires re-derive it: `eager_input_vals`) and the `users` order of its inputs. Rollback
    restores those and erases the inserted nodes: node order, arguments, users (in order)
    and meta as they were. The contract it relies on: a site edits existing nodes only by
    replacing their inputs (`replace_input_with`, `replace_all_uses_with`) and their meta
    only together with those inputs; it never moves or erases them (erasing one raises).
    :meth:`close` (or a rollback) removes the hooks.
    """

    def __init__(self, module: fx.GraphModule):
        self.graph = module.graph
        self.module = module
        self.inserted: list[fx.Node] = []
        self.inserted_set: set[fx.Node] = set()
        self.saved: dict[fx.Node, tuple[tuple, dict, dict]] = {}
        self.users_order: dict[fx.Node, list[fx.Node]] = {}
        module._register_create_node_hook(self._on_create)
        module._register_replace_node_hook(self._on_replace)
        module._register_erase_node_hook(self._on_erase)
        self.open = True

    @property
    def records(self) -> int:
        """How many nodes this site touched (inserted or rewired): the work its rollback would do."""
        return len(self.inserted) + len(self.saved)

    def _on_create(self, node: fx.Node) -> None:
        self.inserted.append(node)
        self.inserted_set.add(node)

    def _on_replace(self, old: fx.Node, new: str, user: fx.Node) -> None:
        if user in self.inserted_set or user in self.saved:
            return
        self.saved[user] = (user.args, user.kwargs, dict(user.meta))
        for node in user.all_input_nodes:
            self.users_order.setdefault(node, list(node.users))

    def _on_erase(self, node: fx.Node) -> None:
        if node not in self.inserted_set:
            raise RuntimeError(f"a site erased {node}, which it did not insert (erase dead nodes after the pass)")

    def rollback(self) -> None:
        try:
            for node, (args, kwargs, meta) in self.saved.items():
                node.args, node.kwargs = args, kwargs
                node.meta.clear()
                node.meta.update(meta)
            alive = [n for n in reversed(self.inserted) if not n._erased]
            for node in alive:
                node.args, node.kwargs = (), {}
            for node in alive:
                self.graph.erase_node(node)
            for node, seen in self.users_order.items():
                users = [u for u in seen if u not in self.inserted_set]  # seen mid-site: may list inserted nodes
                if list(node.users) != users:
                    if set(node.users) != set(users):
                        raise RuntimeError(f"users of {node} changed in a way the site transaction did not record")
                    node.users.clear()
                    node.users.update(dict.fromkeys(users))
        finally:
            self.close()

    def close(self) -> None:
        if self.open:
            self.module._unregister_create_node_hook(self._on_create)
            self.module._unregister_replace_node_hook(self._on_replace)
            self.module._unregister_erase_node_hook(self._on_erase)
            self.open = False


def site_transaction(graph: fx.Graph) -> Transaction:
    """A :class:`SiteTransaction` for a graph module's graph; a whole snapshot for a bare graph
    (no module to carry the hooks: hand-built graphs only, Inductor always passes a module's)."""
    module = graph.owning_module
    return SiteTransaction(module) if isinstance(module, fx.GraphModule) else GraphTransaction(graph)


def _is_functional_wait(node) -> bool:
    """`_c10d_functional.wait_tensor` (which torch marks side-effectful): once a rewrite left
    it without users, it and its collective are dead on every rank (SPMD graph) and erasable."""
    import torch

    return node.target is torch.ops._c10d_functional.wait_tensor.default
