"""The mxfuse pass as a vLLM `InductorPass` (imports vLLM: load only when vLLM is loaded).

vLLM resolves `"mxfuse.vllm_pass"` from its compilation config with
`__import__("mxfuse").__dict__["vllm_pass"]`; :mod:`mxfuse` binds that attribute to
:func:`vllm_pass` as soon as vLLM's pass module exists. Options come from the
environment by :meth:`PassOptions.from_env` (the rule `mxfuse.post_grad_pass()` uses),
checked when the pass is built (which is when vLLM's config resolves `"mxfuse.vllm_pass"`:
`__import__("mxfuse")` binds it then, or vLLM's pass module loads after mxfuse), so a bad
`MXFUSE_OPTIONS` fails while vLLM builds its config, naming the variable; then read again at
each call and in `uuid()`, so vLLM's compile cache follows them.
"""

from __future__ import annotations

import uuid

from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass

from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions
from mxfuse.passes.report import PassReport


class MxfuseVllmPass(InductorPass):
    """mxfuse's rewrites, run by vLLM's PostGradPassManager after its own fusions."""

    def __init__(self, options: PassOptions | None = None):
        if options is not None:
            options.check_dump_dir()
        else:
            PassOptions.for_pass()  # the environment checked now, not at the first compile
        self._options = options  # None: from the environment at each use
        self.last_report: PassReport | None = None
        self._nonce = uuid.uuid4().hex

    @property
    def options(self) -> PassOptions:
        return self._options if self._options is not None else PassOptions.from_env()

    def __call__(self, graph: fx.Graph) -> None:
        self.last_report = post_grad.run(graph, self.options)

    def uuid(self) -> str:
        # `fresh` in MXFUSE_OPTIONS: this pass object's own key, so vLLM's cache recompiles
        return post_grad.cache_key(self.options, self._nonce if self.options.fresh else "")

    def __repr__(self) -> str:
        return f"MxfuseVllmPass({self.options})"


def vllm_pass() -> MxfuseVllmPass:
    return MxfuseVllmPass()
