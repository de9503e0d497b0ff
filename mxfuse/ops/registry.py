"""The `mxfuse::` ops as data: one :class:`OpSpec` per op, registered with torch.library by :func:`register`.

Each op is a `torch.library.custom_op`, so it stays ONE opaque node in the post-grad graph
(passes can match it) and is functional (no mutation, no aliasing). An op is written once,
as an entry of its module's `OPS` tuple; `mxfuse/ops/__init__.py` joins those tuples into
the one table (`mxfuse.ops.OPS`) from which the registration, the exports of `mxfuse.ops`
and the autograd formulas all come. A new op is one entry::

    OPS = (
        OpSpec(
            "silu_mul_mxfp8(Tensor x, bool swizzled=False, SymInt rule=0) -> (Tensor, Tensor)",
            Impls(cpu=_act_mul_quant, fake=_act_mul_quant_fake, cuda=_act_mul_quant_cuda),
            doc="`silu(gate) * up` and its MXFP8 quant in one pass: `(codes, scales)`.",
        ),
    )

and a new module of ops is one more `*module.OPS` in `mxfuse/ops/__init__.py`.

- `schema`: torch's schema language with the op's name first (`mxfuse::` is implied):
  what `torch.ops.mxfuse.<name>.default._schema` prints. Python `int` is `SymInt` there.
- :class:`Impls`: the CPU impl (the reference; it also serves any device without an impl of
  its own), the fake impl (shapes only, for tracing) and the CUDA impl (imports its Triton
  module on the first call, so importing mxfuse needs no GPU). Each is called as
  `impl(op, **arguments)`: the op's name (for the messages of the checks in
  :mod:`mxfuse.ops.inputs`) and every argument of the schema by name, defaults filled in,
  plus the spec's `constants`. One set of impls thus serves a family of ops whose schemas
  differ (a residual or not, an argument one op fixes), and the impls never depend on the
  order of the schema's arguments.
- `constants`: arguments the impls take that the schema does not have (the standard RMSNorm
  is the Gemma norm with `weight_offset=0.0`).
- `doc`: what the op computes and its contract; the registered op's `__doc__`.
- `backward`: an :class:`~mxfuse.ops.autograd.Backward` (a real derivative), or None: inference
  only, a backward raises :class:`~mxfuse.ops.errors.MxfuseInputError` naming the op and the
  fix (:mod:`mxfuse.ops.autograd`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mxfuse.ops import autograd
from mxfuse.ops.autograd import Backward

NAMESPACE = "mxfuse"

Impl = Callable[..., Any]
"""`impl(op: str, **arguments) -> outputs` (a Tensor, or a tuple of them as the schema returns)."""


@dataclass(frozen=True)
class Impls:
    """How a family of ops computes; each impl is called as `impl(op, **arguments)`."""

    cpu: Impl
    """The reference (plain PyTorch); the impl on every device without one of its own."""
    fake: Impl
    """Output shapes and dtypes from fake inputs, after the same checks as the real impls."""
    cuda: Impl | None = None
    """The CUDA impl (Triton kernels, imported on the first call); None: the CPU impl runs there too."""


@dataclass(frozen=True)
class OpSpec:
    """One `mxfuse::` op, written once (see the module docstring)."""

    schema: str
    """`name(arguments) -> returns` in torch's schema language, without the namespace."""
    impls: Impls
    doc: str
    """What the op computes, its contract (bitwise to which composition) and its arguments."""
    backward: Backward | None = None
    """None: inference only (a backward raises, naming the op and the fix)."""
    constants: Mapping[str, object] = field(default_factory=dict)
    """Arguments the impls take that the schema does not have."""

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]

    @property
    def signature(self) -> str:
        """The schema without the name: `(arguments) -> returns`."""
        return self.schema[len(self.name) :]

    @property
    def qualname(self) -> str:
        """`mxfuse::<name>`."""
        return f"{NAMESPACE}::{self.name}"


def register(specs: Iterable[OpSpec]) -> dict[str, torch.library.CustomOpDef]:
    """Register every op of `specs` with torch.library (once per process): `{name: op}`."""
    ops: dict[str, torch.library.CustomOpDef] = {}
    for spec in specs:
        if spec.name in ops:
            raise ValueError(f"{spec.qualname} is in the op table twice")
        ops[spec.name] = _register(spec)
    return ops


def _register(spec: OpSpec) -> torch.library.CustomOpDef:
    arguments = _Arguments(spec)
    cpu = arguments.calling(spec.impls.cpu)
    op = torch.library.custom_op(spec.qualname, cpu, mutates_args=(), schema=spec.signature)
    op.__doc__ = inspect.cleandoc(spec.doc)
    op.register_fake(arguments.calling(spec.impls.fake))
    if spec.impls.cuda is not None:
        op.register_kernel("cuda", arguments.calling(spec.impls.cuda))
    if spec.backward is None:
        op.register_autograd(autograd.inference_only(spec.name))
    else:
        op.register_autograd(arguments.backward(spec.backward), setup_context=arguments.save(spec.backward))
    return op


class _Arguments:
    """Translates between the dispatcher's positional arguments and the impls' named ones."""

    def __init__(self, spec: OpSpec):
        parsed = torch._C.parse_schema(spec.qualname + spec.signature)
        if any(a.kwarg_only for a in parsed.arguments):
            raise ValueError(f"{spec.qualname}: keyword-only arguments are not supported by the op table")
        self.op = spec.name
        self.names = tuple(a.name for a in parsed.arguments)
        defaults = {a.name: a.default_value for a in parsed.arguments if a.has_default_value()}
        clash = set(spec.constants) & set(self.names)
        if clash:
            raise ValueError(f"{spec.qualname}: constants {sorted(clash)} are arguments of the schema")
        self.base = {**spec.constants, **defaults}

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Every argument by name: the dispatcher passes them positionally and leaves out trailing defaults."""
        bound = dict(self.base)
        bound.update(zip(self.names, args))
        bound.update(kwargs)
        return bound

    def calling(self, impl: Impl) -> Callable[..., Any]:
        op = self.op
        try:  # an impl that cannot take the op's arguments fails here, at import, not on its first call
            inspect.signature(impl).bind(op, **{**dict.fromkeys(self.names), **self.base})
        except TypeError as e:
            raise TypeError(f"{NAMESPACE}::{op}: {impl.__qualname__} does not take the op's arguments: {e}") from None

        def call(*args: Any, **kwargs: Any) -> Any:
            return impl(op, **self.bind(args, kwargs))

        return call

    def save(self, backward: Backward) -> Callable[[Any, tuple[Any, ...], Any], None]:
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            backward.save(ctx, output, **self.bind(inputs, {}))

        return setup_context

    def backward(self, backward: Backward) -> Callable[..., tuple[Tensor | None, ...]]:
        names = self.names

        def grads(ctx: Any, *grad_outputs: Tensor | None) -> tuple[Tensor | None, ...]:
            by_name = backward.grads(ctx, *grad_outputs)
            return tuple(by_name.get(name) for name in names)

        return grads
