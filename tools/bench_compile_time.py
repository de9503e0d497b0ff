"""What the mxfuse pass costs at compile time, by layer count of the reference model (CPU).

Columns, per layer count L of `Model(ModelConfig.tiny(n_layers=L))` (`mxfuse/models.py`):

- nodes: the traced graph (make_fx with Inductor's decompositions under fake tensors: the
  graph a post-grad pass sees);
- pass ms: `post_grad.run` alone on a fresh copy of that graph, min of `--repeat`;
  `sp pass ms`: the same on the tensor-parallel form (`TPModel`, 2 ranks of a fake process
  group) with `sequence_parallel=True`;
- update ms: Inductor's `FakeTensorUpdater.incremental_update()` (what Inductor runs after
  the custom post-grad pass) on that graph without / with the pass, min of `--repeat`;
- compile s: the whole first compile of the model (`torch.compile`, Dynamo reset and the FX
  graph cache off, first call on 16 tokens) without / with the pass, min of `--compile-repeat`.

The machine this runs on may be shared: every time is a minimum over repeats, and the
ratios are what to read. `--quick`: layers 1, 2, 4, 8 and fewer repeats.

    PYTHONPATH=. python3 tools/bench_compile_time.py [--quick] [--layers 1,2,4] [--no-compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._C._distributed_c10d as c10d_cpp
from torch import fx
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_utils import FakeTensorUpdater
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from mxfuse.models import Model, ModelConfig, compile_model, example_inputs
from mxfuse.models_tp import TPModel
from mxfuse.passes import post_grad
from mxfuse.passes.options import PassOptions

GROUP = "bench_compile_time"
WORLD = 2
TOKENS = 16
LAYERS = (1, 2, 4, 8, 16, 32, 64, 128)


def trace(model: torch.nn.Module) -> tuple[fx.GraphModule, FakeTensorMode]:
    """The model's post-grad-like ATen graph, weights as inputs, and its fake mode."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(state)

    def fn(ids, *weights):
        return torch.func.functional_call(model, dict(zip(names, weights)), (ids,))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t, static_shapes=True) for t in (example_inputs(model.config, TOKENS), *state.values())]
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="real")(*fakes), mode


def fresh(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def time_pass(gm: fx.GraphModule, options: PassOptions, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        copy = fresh(gm)
        start = time.perf_counter()
        report = post_grad.run(copy.graph, options)
        best = min(best, time.perf_counter() - start)
        assert report.failed is None and report.applied, report
    return best * 1e3


def time_update(gm: fx.GraphModule, mode: FakeTensorMode, with_pass: bool, repeat: int) -> tuple[float, int]:
    """Min ms of the incremental update after (or without) the pass, and the nodes it re-propagated."""
    best, updated = float("inf"), 0
    for _ in range(repeat):
        copy = fresh(gm)
        with V.set_fake_mode(mode):
            updater = FakeTensorUpdater(copy)
            if with_pass:
                post_grad.run(copy.graph, PassOptions(strict=True))
            start = time.perf_counter()
            updated = updater.incremental_update()
            best = min(best, time.perf_counter() - start)
    return best * 1e3, updated


def time_compile(layers: int, with_pass: bool, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch._dynamo.reset()
        model = Model(ModelConfig.tiny(n_layers=layers))
        compiled = compile_model(model, {"strict": True} if with_pass else None)
        ids = example_inputs(model.config, TOKENS)
        start = time.perf_counter()
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False):
            compiled(ids)
        best = min(best, time.perf_counter() - start)
    return best


def _fake_group():
    pg = c10d_cpp.ProcessGroup(c10d_cpp.FakeStore(), 0, WORLD)
    backend = c10d_cpp.FakeProcessGroup._create_internal(0, WORLD)
    pg._register_backend(torch.device("cpu"), c10d_cpp.ProcessGroup.BackendType.CUSTOM, backend)
    c10d_cpp._register_process_group(GROUP, pg)


def tp_model(layers: int) -> TPModel:
    c10d = torch.ops._c10d_functional
    config = ModelConfig.tiny(n_layers=layers, n_kv_heads=4)
    return TPModel(config, 0, WORLD, lambda x: c10d.wait_tensor(c10d.all_reduce(x, "sum", GROUP)), lm_head=False)


def row(layers: int, args) -> dict:
    gm, mode = trace(Model(ModelConfig.tiny(n_layers=layers)))
    result = {"layers": layers, "nodes": len(gm.graph.nodes)}
    result["pass_ms"] = time_pass(gm, PassOptions(strict=True), args.repeat)
    tp_gm, _ = trace(tp_model(layers))
    result["sp_nodes"] = len(tp_gm.graph.nodes)
    result["sp_pass_ms"] = time_pass(tp_gm, PassOptions(strict=True, sequence_parallel=True), args.repeat)
    result["update_ms"], result["updated"] = time_update(gm, mode, False, args.repeat)
    result["update_pass_ms"], result["updated_pass"] = time_update(gm, mode, True, args.repeat)
    if args.compile and layers <= args.max_compile_layers:
        result["compile_s"] = time_compile(layers, False, args.compile_repeat)
        result["compile_pass_s"] = time_compile(layers, True, args.compile_repeat)
    return result


def table(rows: list[dict]) -> str:
    head = (
        "| layers | nodes | pass ms | us/node | sp nodes | sp pass ms | update ms (nodes) | "
        "update ms with pass (nodes) | compile s | compile s with pass | compile +% |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        compile_cells = ["-", "-", "-"]
        if "compile_s" in r:
            extra = 100 * (r["compile_pass_s"] / r["compile_s"] - 1)
            compile_cells = [f"{r['compile_s']:.1f}", f"{r['compile_pass_s']:.1f}", f"{extra:+.1f}"]
        lines.append(
            f"| {r['layers']} | {r['nodes']} | {r['pass_ms']:.1f} | {1e3 * r['pass_ms'] / r['nodes']:.0f} | "
            f"{r['sp_nodes']} | {r['sp_pass_ms']:.1f} | {r['update_ms']:.1f} ({r['updated']}) | "
            f"{r['update_pass_ms']:.1f} ({r['updated_pass']}) | " + " | ".join(compile_cells) + " |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="layers 1, 2, 4, 8; fewer repeats")
    parser.add_argument("--layers", help="comma-separated layer counts (default 1 to 128)")
    parser.add_argument("--repeat", type=int, default=5, help="repeats of the pass and the update (min)")
    parser.add_argument("--compile-repeat", type=int, default=1, help="repeats of each whole compile (min)")
    parser.add_argument("--max-compile-layers", type=int, default=128, help="compile whole only up to this")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the whole compiles")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()
    layers = [int(n) for n in args.layers.split(",")] if args.layers else list(LAYERS)
    if args.quick:
        layers, args.repeat = [n for n in layers if n <= 8], min(args.repeat, 3)
    _fake_group()
    torch.manual_seed(0)
    rows = []
    for n in layers:
        rows.append(row(n, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(
        f"\nCPU, {torch.get_num_threads()} threads; times are minima of {args.repeat} (pass, update) and "
        f"{args.compile_repeat} (compile) runs.\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
