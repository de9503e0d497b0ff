"""mxfuse: compiler passes that fuse Gemma RMSNorm with MXFP8 quantization.

    torch.compile(model, options={"post_grad_custom_post_pass": mxfuse.post_grad_pass()})

or, in vLLM, `--compilation-config '{"inductor_passes":
{"post_grad_custom_post_pass": "mxfuse.vllm_pass"}}'` (options: env MXFUSE_OPTIONS).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import mxfuse.ops  # noqa: F401  (registers torch.ops.mxfuse.*)
from mxfuse.passes import MxfusePass, PassOptions

__version__ = "0.1.0"
__all__ = ["MxfusePass", "PassOptions", "post_grad_pass", "vllm_pass"]

_VLLM_PASS_MODULE = "vllm.compilation.passes.inductor_pass"


def post_grad_pass(**options) -> MxfusePass:
    """A `CustomGraphPass` for `torch.compile(options={"post_grad_custom_post_pass": ...})`.

    Options: fuse_norm_quant=True, sp_gather="auto" | "bf16" | "mxfp8", dump_dir=None.
    """
    return MxfusePass(PassOptions.from_kwargs(**options))


def _bind_vllm_pass():
    from mxfuse.passes.vllm import vllm_pass as make

    globals()["vllm_pass"] = make()


class _BindVllmPassOnImport(importlib.abc.MetaPathFinder):
    """Binds `mxfuse.vllm_pass` right after vLLM loads its InductorPass module.

    vLLM looks the pass up in `mxfuse.__dict__` (no module `__getattr__`), and the
    pass must subclass vLLM's InductorPass, which `import mxfuse` may not import. One
    shot: it removes itself the first time it sees that module.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != _VLLM_PASS_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_bind(module):
                exec_module(module)
                _bind_vllm_pass()

            spec.loader.exec_module = exec_then_bind
        return spec


if _VLLM_PASS_MODULE in sys.modules:
    _bind_vllm_pass()
elif not any(isinstance(f, _BindVllmPassOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _BindVllmPassOnImport())
