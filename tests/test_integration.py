"""How users turn the pass on: torch.compile options, vLLM's compilation config, the cache key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mxfuse
from mxfuse.testing import assert_bitwise

PACKAGE = Path(mxfuse.__file__).resolve().parent


def python(code: str, env: dict | None = None, path: Path | None = None) -> str:
    """Run `code` in a fresh interpreter; returns its last stdout line."""
    environment = {**os.environ, **(env or {})}
    if path is not None:
        environment["PYTHONPATH"] = str(path)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=path or Path.cwd(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


UUID = "import mxfuse; print(mxfuse.post_grad_pass().uuid())"


def test_uuid_is_deterministic_across_processes():
    assert python(UUID) == python(UUID) == mxfuse.post_grad_pass().uuid()


@pytest.mark.parametrize("changed", ["patterns/producer_quant.py", "passes/post_grad.py", "ops/library.py"])
def test_uuid_changes_when_a_pattern_pass_or_kernel_source_changes(tmp_path, changed):
    copy = tmp_path / "mxfuse"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    same = python(UUID, path=tmp_path)
    with open(copy / changed, "a") as f:
        f.write("\n# a change\n")
    assert python(UUID, path=tmp_path) != same


def test_kernel_sources_are_part_of_the_cache_key():
    from mxfuse.passes import post_grad

    hashed = {p.name for folder in post_grad._SOURCE_DIRS for p in (PACKAGE / folder).rglob("*.py")}
    assert {"library.py", "reference.py", "producer_quant.py", "post_grad.py"} <= hashed
    assert any(name.startswith("triton_") for name in hashed)


def test_torch_compile_options_entry_point_fuses():
    mx = torch.ops.mxfuse

    def fn(x, weight):
        return mx.mxfp8_quantize(mx.gemma_rmsnorm(x, weight, 1e-6))

    torch._dynamo.reset()
    pass_ = mxfuse.post_grad_pass()
    compiled = torch.compile(fn, options={"post_grad_custom_post_pass": pass_})
    x, w = torch.randn(7, 64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert_bitwise(compiled(x, w), fn(x, w))
    assert pass_.last_report.matched_strings() == {"mxfuse:plain->mxfuse_quant:rowmajor": 1}


def test_import_mxfuse_does_not_import_vllm():
    assert python("import sys, mxfuse; print('vllm' in sys.modules)") == "False"


VLLM_RESOLVE = """
    import json, os
    {first}
    from vllm.config import CompilationConfig
    from vllm.compilation.passes.inductor_pass import InductorPass
    config = CompilationConfig(inductor_passes={{"post_grad_custom_post_pass": "mxfuse.vllm_pass"}})
    p = config.inductor_compile_config["post_grad_custom_post_pass"]
    import mxfuse
    print(json.dumps([type(p).__name__, isinstance(p, InductorPass), p is mxfuse.vllm_pass,
                      p.options.sp_gather, p.uuid()]))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("first", ["import mxfuse", "import vllm"], ids=["mxfuse_first", "vllm_first"])
def test_vllm_compilation_config_resolves_to_the_mxfuse_inductor_pass(first):
    pytest.importorskip("vllm")
    name, is_inductor_pass, same_object, mode, uuid = json.loads(python(VLLM_RESOLVE.format(first=first)))
    assert (name, is_inductor_pass, same_object, mode) == ("MxfuseVllmPass", True, True, "auto")
    assert uuid == python(UUID)  # same options, same key


@pytest.mark.vllm
def test_vllm_pass_options_come_from_the_environment():
    pytest.importorskip("vllm")
    env = {"MXFUSE_OPTIONS": json.dumps({"sp_gather": "bf16"})}
    *_, mode, uuid = json.loads(python(VLLM_RESOLVE.format(first="import mxfuse"), env=env))
    assert mode == "bf16" and uuid == python("import mxfuse; print(mxfuse.post_grad_pass(sp_gather='bf16').uuid())")


@pytest.mark.vllm
def test_vllm_pass_runs_as_a_post_grad_pass():
    pytest.importorskip("vllm")
    import vllm.compilation.passes.inductor_pass  # noqa: F401  (binds mxfuse.vllm_pass)

    mx = torch.ops.mxfuse

    def fn(x, residual, weight):
        y, res = mx.gemma_fused_add_rmsnorm(x, residual, weight, 1e-6)
        return (*mx.mxfp8_quantize(y, True), res)

    torch._dynamo.reset()
    vllm_pass = mxfuse.vllm_pass
    compiled = torch.compile(fn, options={"post_grad_custom_post_pass": vllm_pass})
    args = [torch.randn(5, 64, dtype=torch.bfloat16) for _ in range(2)] + [torch.zeros(64, dtype=torch.bfloat16)]
    with torch.no_grad():
        assert_bitwise(compiled(*args), fn(*args))
    assert sum(vllm_pass.last_report.matched.values()) == 1


def test_bad_options_from_the_environment_raise_clearly(monkeypatch):
    from mxfuse.passes.options import PassOptions

    monkeypatch.setenv("MXFUSE_OPTIONS", "{sp_gather: bf16}")
    with pytest.raises(ValueError, match=r"^MXFUSE_OPTIONS=.*: not valid JSON"):
        PassOptions.from_env()
    monkeypatch.setenv("MXFUSE_OPTIONS", '{"sp_gathr": "bf16"}')
    with pytest.raises(TypeError, match="unknown mxfuse option"):
        PassOptions.from_env()


def test_star_import_works_without_vllm():
    assert python("from mxfuse import *; print(sorted(n for n in dir() if not n.startswith('_')))") == str(
        sorted(mxfuse.__all__)
    )


def test_options_are_data_and_the_environment_is_read_by_one_rule(monkeypatch):
    from mxfuse.passes.options import PassOptions

    monkeypatch.setenv("MXFUSE_DUMP_DIR", "/tmp/from_env")
    monkeypatch.setenv("MXFUSE_STRICT", "1")
    monkeypatch.setenv("MXFUSE_OPTIONS", json.dumps({"sp_gather": "bf16"}))
    assert PassOptions() == PassOptions(fuse_norm_quant=True, sp_gather="auto", dump_dir=None, strict=False)
    from_env = PassOptions.from_env()
    assert (from_env.dump_dir, from_env.strict, from_env.sp_gather) == ("/tmp/from_env", True, "bf16")
    # keyword arguments win, and None is a value (turns the environment's dump off)
    assert PassOptions.from_env(dump_dir=None, sp_gather="mxfp8").dump_dir is None
    assert mxfuse.post_grad_pass(dump_dir=None, strict=False).options == PassOptions(sp_gather="bf16")
    monkeypatch.setenv("MXFUSE_OPTIONS", json.dumps({"dump_dir": "/tmp/from_json"}))
    assert PassOptions.from_env().dump_dir == "/tmp/from_json"  # MXFUSE_OPTIONS over MXFUSE_DUMP_DIR
    # the cache key follows the fields that change the graph, not dump_dir or strict
    assert PassOptions(dump_dir="/x", strict=True).cache_key() == PassOptions().cache_key()
    assert PassOptions(sp_gather="bf16").cache_key() != PassOptions().cache_key()
    monkeypatch.setenv("MXFUSE_STRICT", "yes")
    with pytest.raises(ValueError, match="MXFUSE_STRICT"):
        PassOptions.from_env()
