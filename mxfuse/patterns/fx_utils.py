"""Small, pure helpers over FX nodes shared by the rewrites and `explain`: node values, the view-op
lists, graph edits, and how a node is named for people (its op, its source line)."""

from __future__ import annotations

import operator
import re
from typing import Any, TypeGuard

import torch
from torch import fx

aten = torch.ops.aten

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
"""The reshape ops (a new shape over the same contiguous data)."""
SQUEEZES = (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims)
BYTE_VIEWS = (*RESHAPES, aten.view.dtype, aten.alias.default)
"""Views that keep every byte where it is (what sits between a quant's output and a gather, either side)."""
VIEW_OPS = (
    *RESHAPES,
    *SQUEEZES,
    aten.transpose.int,
    aten.permute.default,
    aten.t.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.view.dtype,
    aten.clone.default,
    aten.alias.default,
)
"""Every single-input view (or copy of one) a quant may read a producer's output through; the one list
the others are cut from."""


def fake(node: Any) -> torch.Tensor | None:
    """The FakeTensor recorded on a node (None for non-nodes and nodes without one)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def known_fake(node: Any) -> torch.Tensor:
    """The FakeTensor of a node whose value the caller's guards already read (an AssertionError, never
    None, where the plan went wrong)."""
    val = fake(node)
    assert val is not None, f"{node} has no fake value (a plan reads only nodes that have one)"
    return val


def static_last_dim(node: Any) -> int:
    """The static last size `K` of a node's value, as the guards checked it."""
    k = static_int(known_fake(node).shape[-1])
    assert k is not None, f"{node}: symbolic last dim (the guards admit static K only)"
    return k


def fake_dtype(node: Any) -> torch.dtype | None:
    """The dtype of the node's FakeTensor (None where :func:`fake` is None)."""
    val = fake(node)
    return None if val is None else val.dtype


def is_call(node: Any, *targets: object) -> TypeGuard[fx.Node]:
    """Whether `node` is a node calling one of `targets` (a type guard: the caller may then read its args)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def getitem_users(node: fx.Node) -> dict[int, list[fx.Node]]:
    """`{i: [getitem(node, i), ...]}` for a multi-output node."""
    found: dict[int, list[fx.Node]] = {}
    for user in node.users:
        index = user.args[1] if is_call(user, operator.getitem) and user.args[0] is node else None
        if isinstance(index, int):
            found.setdefault(index, []).append(user)
    return found


def single_getitem(node: fx.Node, index: int) -> fx.Node | None:
    """The getitem(node, index) user (the first of duplicates); None if there is none.

    The pass folds duplicates first (:func:`fold_duplicate_getitems`), so a rewrite sees one.
    """
    users = getitem_users(node).get(index, [])
    return users[0] if users else None


def fold_duplicate_getitems(graph: fx.Graph) -> list[fx.Node]:
    """Point the users of repeated `getitem(node, i)` (left by CSE or freezing) at the first one.

    Returns the duplicates, now without users (erased with the other dead nodes after the pass).
    """
    folded = []
    seen: dict[tuple[fx.Node, Any], fx.Node] = {}
    for node in graph.find_nodes(op="call_function", target=operator.getitem):
        source, index = node.args[0], node.args[1]
        if not isinstance(source, fx.Node) or not isinstance(index, int):
            continue
        first = seen.setdefault((source, index), node)
        if first is not node:
            redirect_uses(node, first)
            folded.append(node)
    return folded


def has_live_users(node: fx.Node) -> bool:
    """Whether anything reads `node`, looking through views and collectives.

    An earlier rewrite may leave a dead chain behind (view -> all-gather -> wait ->
    view, with no reader at the end); it is erased after the pass, and until then it
    must not count as a user.
    """
    work = [node]
    while work:
        for user in work.pop().users:
            if not (user.op == "call_function" and _is_pass_through(user)):
                return True
            work.append(user)
    return False


def _is_pass_through(node: fx.Node) -> bool:
    c10d = torch.ops._c10d_functional
    if node.target is operator.getitem or node.target in BYTE_VIEWS:
        return True
    if node.target in (c10d.all_gather_into_tensor.default, c10d.wait_tensor.default):
        return True
    return node.target is vllm_op("all_gather")


def vllm_op(name: str, namespace: str = "vllm") -> torch._ops.OpOverload | None:
    """`torch.ops.<namespace>.<name>.default` once vLLM registered it; None where vLLM is not loaded.
    (`hasattr` on an op namespace tries to load the op; a missing op is no error.)"""
    ns = getattr(torch.ops, namespace)
    return getattr(ns, name).default if hasattr(ns, name) else None


def static_int(value: Any) -> int | None:
    """`value` as a Python int when it is static (an int, or a SymInt known to be one)."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        return value.node.maybe_as_int()
    return None


def constant_float(value: Any) -> float | None:
    """A Python float/int literal baked into the graph (not a graph input or SymFloat)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def fake_mode_of(*nodes: fx.Node):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([fake(n) for n in nodes if fake(n) is not None])


def call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's insert point with its fake value in meta."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    mode = fake_mode_of(*[a for a in (*args, *kwargs.values()) if isinstance(a, fx.Node)])
    fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
    fake_kwargs = fx.node.map_arg(kwargs, lambda n: n.meta["val"])
    with mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def redirect_uses(old: fx.Node, new: fx.Node, keep=lambda user: False) -> None:
    """Point every user of `old` (but those `keep` selects) at `new`, re-recording the
    users' `eager_input_vals` (see `refresh_eager_input_vals`)."""
    users = [u for u in old.users if not keep(u)]
    old.replace_all_uses_with(new, delete_user_cb=lambda user: not keep(user))
    for user in users:
        refresh_eager_input_vals(user)


def refresh_eager_input_vals(node: fx.Node) -> None:
    """Inductor gives each input of an exact-strides op (every custom op by default) the
    strides recorded in `meta["eager_input_vals"]` at trace time. A rewrite that hands
    such an op new inputs (strided views of a packed buffer) must record them again, or
    Inductor copies each new input back into the old layout: one kernel per input."""
    if "eager_input_vals" not in node.meta:
        return
    node.meta["eager_input_vals"] = fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: a.meta.get("val") if isinstance(a, fx.Node) else None
    )


def getitem(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    out = graph.call_function(operator.getitem, (node, index))
    out.meta["val"] = node.meta["val"][index]
    if node.meta.get("stack_trace"):
        out.meta["stack_trace"] = node.meta["stack_trace"]
    return out


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?:\s*(.+))?')


def last_frame(stack_trace: str | None) -> tuple[str | None, str | None]:
    """`("models.py:204 in forward", "return torch.ops...")` from a node's stack_trace (last frame)."""
    frames = _FRAME.findall(stack_trace or "")
    if not frames:
        return None, None
    path, line, func, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} in {func}", (code.strip() or None)


def source_line(node: fx.Node) -> str | None:
    """`"models.py:204 in forward: return self.norm(x)"`: the last frame of the node's stack trace."""
    where, code = last_frame(node.meta.get("stack_trace"))
    return f"{where}: {code}" if where and code else where


def op_name(node: fx.Node) -> str | None:
    """`ns::op` of a call node (`hop(ns::op)` for a higher-order op); None for getitem and non-calls."""
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name()  # e.g. "mxfuse::mxfp8_quantize"
    if isinstance(target, torch._ops.HigherOrderOperator):
        inner = node.args[0]
        return f"{target.name()}({inner.name() if isinstance(inner, torch._ops.OpOverload) else inner})"
    return getattr(target, "__name__", str(target))


def op_label(node: fx.Node) -> str:
    """A short readable name of what a node calls: `mxfuse.mxfp8_quantize`, `aten.mm`, `getitem of ...`."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if target is operator.getitem:
        return f"getitem of {op_label(node.args[0])}" if isinstance(node.args[0], fx.Node) else "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        inner = node.args[0] if node.args else None
        inner_name = f"{inner.namespace}.{inner._opname}" if isinstance(inner, torch._ops.OpOverload) else inner
        return f"{target.name()}({inner_name})"
    return getattr(target, "__name__", str(target))
