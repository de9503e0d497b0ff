"""mxfuse: compiler passes that fuse the producer of an MXFP8 activation (an RMSNorm, Gemma or standard; an act·mul;
a gated output) with its quantization.

    torch.compile(model, options={"post_grad_custom_post_pass": mxfuse.post_grad_pass()})

or, in vLLM, `--compilation-config '{"inductor_passes":
{"post_grad_custom_post_pass": "mxfuse.vllm_pass"}}'` (options: env MXFUSE_OPTIONS).

`mxfuse.vllm_pass` exists once vLLM has loaded its pass module (it subclasses vLLM's
InductorPass), so it is not in `__all__`: `from mxfuse import *` works without vLLM.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from mxfuse import ops  # noqa: F401  (registers torch.ops.mxfuse.*)

if TYPE_CHECKING:
    from mxfuse.passes import MxfusePass, PassOptions
    from mxfuse.passes.explain import Explanation

__version__ = "0.1.0"
__all__ = ["MxfusePass", "PassOptions", "explain", "post_grad_pass"]

_VLLM_PASS_MODULE = "vllm.compilation.passes.inductor_pass"


def __getattr__(name: str) -> Any:
    if name in ("MxfusePass", "PassOptions"):
        import mxfuse.passes

        return getattr(mxfuse.passes, name)
    raise AttributeError(f"module 'mxfuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names and the loaded submodules, not the helpers this module imports (`sys`, `Literal`, ...)."""
    submodules = [n for n, v in globals().items() if getattr(v, "__name__", "") == f"{__name__}.{n}"]
    bound = ["vllm_pass"] if "vllm_pass" in globals() else []
    return sorted({*__all__, "__version__", *bound, *submodules})


class _Unset:
    """Marks an option the caller did not pass (the environment or the default decides)."""

    def __repr__(self) -> str:
        return "<from the environment or default>"


_UNSET = _Unset()


def post_grad_pass(
    *,
    fuse_norm_quant: bool | _Unset = _UNSET,
    sp_gather: Literal["auto", "bf16", "mxfp8"] | _Unset = _UNSET,
    sequence_parallel: bool | _Unset = _UNSET,
    dump_dir: str | _Unset | None = _UNSET,
    strict: bool | _Unset = _UNSET,
    fresh: bool | _Unset = _UNSET,
    **misspelled: Any,
) -> MxfusePass:
    """A `CustomGraphPass` for `torch.compile(options={"post_grad_custom_post_pass": ...})`.

    The options are those of :class:`PassOptions`; one not passed comes from the
    environment (`MXFUSE_OPTIONS`, `MXFUSE_DUMP_DIR`, `MXFUSE_STRICT`) else its default,
    by the rule of :meth:`PassOptions.from_env` (the vLLM pass reads them the same way). An
    unknown keyword raises listing the options (and the closest one).
    """
    from mxfuse.passes import MxfusePass, PassOptions

    given = {
        "fuse_norm_quant": fuse_norm_quant,
        "sp_gather": sp_gather,
        "sequence_parallel": sequence_parallel,
        "dump_dir": dump_dir,
        "strict": strict,
        "fresh": fresh,
    }
    return MxfusePass(PassOptions.for_pass(**misspelled, **{k: v for k, v in given.items() if v is not _UNSET}))


def explain(
    module: Callable[..., Any], *example_inputs: Any, options: PassOptions | None = None, dynamic: bool | None = None
) -> Explanation:
    """Compile `module` with the passes, run it once, and return why each producer of an MXFP8 activation (an
    RMSNorm, Gemma or standard; an act·mul; a gate) did or did not fuse. `module`: an `nn.Module` or a function,
    called on `example_inputs`.

    Returns a :class:`mxfuse.passes.explain.Explanation` (its `verdicts`: node, norm kind,
    fused, the reason as a `RefusalCode` and as text, the fix, module path and source line).
    """
    from mxfuse.passes.explain import explain_module

    if not callable(module):
        raise TypeError(
            f"mxfuse.explain(module, *example_inputs): module must be an nn.Module or a function, "
            f"got {type(module).__name__} {module!r:.60}"
        )
    return explain_module(module, *example_inputs, options=options, dynamic=dynamic)


def _bind_vllm_pass() -> None:
    from mxfuse.passes.vllm import vllm_pass as make

    globals()["vllm_pass"] = make()


class _BindVllmPassOnImport(importlib.abc.MetaPathFinder):
    """Binds `mxfuse.vllm_pass` right after vLLM loads its InductorPass module.

    vLLM looks the pass up in `mxfuse.__dict__` (no module `__getattr__`), and the
    pass must subclass vLLM's InductorPass, which `import mxfuse` may not import. One
    shot: it removes itself the first time it sees that module.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _VLLM_PASS_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenBindVllmPass(spec.loader)
        return spec


class _ThenBindVllmPass(importlib.abc.Loader):
    """The loader of vLLM's InductorPass module, binding `mxfuse.vllm_pass` once the module has run;
    everything else (`get_source`, `get_filename`, ...) is the wrapped loader's."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        _bind_vllm_pass()


if _VLLM_PASS_MODULE in sys.modules:
    _bind_vllm_pass()
elif not any(isinstance(f, _BindVllmPassOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _BindVllmPassOnImport())
