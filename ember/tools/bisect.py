"""`ember bisect`: find the op whose compilation makes a program's result differ from eager.

    ember bisect repro.py                       # repro.py defines program(...) and make_inputs()
    ember bisect model.py --fn f --inputs make_inputs --rtol 1e-4 --atol 1e-5 --out bisect-out/
    python -m ember.tools.bisect ...            # the same

How. The `bisect_ops` setting makes the importer lower only the first N ATen ops of each graph
and run every later op as an ATen extern, i.e. eagerly. N = 0 is all-eager (through ember's host
program); N = all is the full compile. The first N at which the result mismatches is found by
binary search (each try recompiles: the setting enters the cache key); the N-th lowered op is the
culprit. The search runs twice: with fusion on and with fusion off (`fuse=False`, one kernel per
realized value). A mismatch that disappears without fusion is a fusion bug (the culprit is the op
whose fusion breaks it); one that stays is an op bug (its lowering or rendering).

The culprit's graph is cut down to the culprit and what it depends on, and written with the
graph's real inputs as a standalone script (plain torch: the ATen ops called directly, compiled
with `backend="ember"`); if the cut-down graph does not reproduce the mismatch, the whole graph
is written instead.
"""

from __future__ import annotations

import argparse
import contextlib
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from ember import config


@dataclass
class Trial:
    """One compile-and-compare at a given bisect_ops (None: no limit)."""

    limit: int | None
    fuse: bool
    bad: bool
    detail: str
    graphs: list[tuple[str, torch.fx.GraphModule, list]] = field(default_factory=list)  # (kind, gm, real inputs)


@dataclass
class BisectResult:
    culprit: str | None  # "aten.mul.Tensor (node mul_3 in inference graph 0)"
    op: str | None  # the ATen op's name: "mul"
    limit: int | None  # the smallest N that mismatches
    kind: str  # "op" | "fusion" | "no mismatch" | "eager graph"
    detail: str
    repro: Path | None = None
    trials: list[Trial] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"ember bisect: {self.kind}"]
        if self.culprit:
            lines.append(f"  culprit: {self.culprit} (mismatch from bisect_ops={self.limit})")
        lines.append(f"  {self.detail}")
        if self.repro:
            lines.append(f"  repro: python {self.repro}")
        lines.append(f"  {len(self.trials)} compiles")
        return "\n".join(lines)


def _outputs(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _outputs(y)]
    return []


def _mismatch(got, want, rtol: float | None, atol: float | None) -> str | None:
    got, want = _outputs(got), _outputs(want)
    if len(got) != len(want):
        return f"{len(got)} outputs, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            return f"output {i}: {' '.join(str(e).split())[:300]}"
    return None


@contextlib.contextmanager
def _recording(graphs: list) -> Iterator[None]:
    """Record each ATen graph ember compiles, with the real inputs of its first call."""
    from ember import pipeline

    original = pipeline.compile_graph

    def record(gm, example_inputs, kind, **kwargs):
        entry = [kind, gm, None]
        graphs.append(entry)  # before compiling: a graph whose compile raises is recorded too
        compiled = original(gm, example_inputs, kind, **kwargs)

        def call(args):
            if entry[2] is None:
                entry[2] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return compiled(args)

        call._boxed_call = True
        return call

    pipeline.compile_graph = record
    try:
        yield
    finally:
        pipeline.compile_graph = original


def _clone(inputs):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]


def _run(fn: Callable, inputs: list) -> list[torch.Tensor]:
    """fn's outputs and, if an input requires grad, the gradients of every such input (one backward
    with fixed pseudo-random cotangents), so a backward graph is checked too."""
    inputs = _clone(inputs)
    outs = _outputs(fn(*inputs))
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    diff = [o for o in outs if o.requires_grad]
    if not leaves or not diff:
        return [o.detach() for o in outs]
    gen = torch.Generator().manual_seed(0)
    cots = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in diff]
    grads = torch.autograd.grad(diff, leaves, cots, allow_unused=True)
    return [o.detach() for o in outs] + [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def trial(fn: Callable, inputs: list, limit: int | None, fuse: bool, options: dict, rtol, atol, dynamic=None) -> Trial:
    expected = _run(fn, inputs)
    graphs: list = []
    torch._dynamo.reset()
    settings = {**options, "fuse": fuse, "bisect_ops": -1 if limit is None else limit, "strict": True}
    try:
        # AOTAutograd's cache would serve a graph without compiling it, and so without recording it.
        with config.override(**{**settings, "aot_cache": False}), _recording(graphs):
            got = _run(torch.compile(fn, backend="ember", dynamic=dynamic), inputs)
        detail = _mismatch(got, expected, rtol, atol)
    except Exception as e:  # noqa: BLE001 - a crash at this limit counts as a failure
        message = " ".join(str(e).replace("Set TORCHDYNAMO_VERBOSE=1", "\n").split("\n")[0:3]).split()
        detail = f"raised {type(e).__name__}: {' '.join(message)[:300]}\n{traceback.format_exc()[-1500:]}"
    return Trial(limit, fuse, detail is not None, detail or "matches eager", [tuple(g) for g in graphs])


def _search(fn, inputs, fuse: bool, options: dict, rtol, atol, trials: list, dynamic=None) -> int | None:
    """The smallest bisect_ops at which the result mismatches, or None if even the full compile matches."""
    full = trial(fn, inputs, None, fuse, options, rtol, atol, dynamic)
    trials.append(full)
    if not full.bad:
        return None
    zero = trial(fn, inputs, 0, fuse, options, rtol, atol, dynamic)
    trials.append(zero)
    if zero.bad:
        return 0
    # Upper bound: the most ops any graph lowers in the full compile.
    hi = max((_count_lowered(gm, fuse, options) for _, gm, _ in full.graphs), default=0)
    lo = 0  # lo is good, hi is bad
    while hi - lo > 1:
        mid = (lo + hi) // 2
        t = trial(fn, inputs, mid, fuse, options, rtol, atol, dynamic)
        trials.append(t)
        lo, hi = (lo, mid) if t.bad else (mid, hi)
    return hi


def _importer(gm, limit: int | None, options: dict):
    from ember.aten.importer import Importer
    from ember.pipeline import graph_device

    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    with config.override(**{**options, "bisect_ops": -1 if limit is None else limit}):
        imp = Importer(gm, graph_device(gm, placeholders))
        imp.run()
    return imp


def _count_lowered(gm, fuse: bool, options: dict) -> int:
    return len(_importer(gm, None, options).lowered)


def _culprit_nodes(
    t: Trial, limit: int, options: dict
) -> list[tuple[int, str, torch.fx.GraphModule, list, torch.fx.Node]]:
    found = []
    for k, (kind, gm, real) in enumerate(t.graphs):
        lowered = _importer(gm, limit, options).lowered
        if len(lowered) >= limit >= 1:
            found.append((k, kind, gm, real, lowered[limit - 1]))
    return found


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def _subgraph(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[int]]:
    """The culprit and its ancestors as a graph returning the culprit; and which inputs it keeps."""
    keep: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        stack.extend(n.all_input_nodes)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    kept_inputs = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in gm.graph.nodes:
        if n in keep:
            env[n] = g.node_copy(n, lambda a: env[a])
            if n.op == "placeholder":
                kept_inputs.append(placeholders.index(n))
    out = env[node]
    g.output((out,))
    return torch.fx.GraphModule(gm, g), kept_inputs


REPRO = '''"""ember bisect repro: {summary}

The ATen graph below is the culprit op and everything it depends on (or the whole graph),
called with the graph's real inputs ({inputs_file}).
Rerun: python {script}
"""

import os

import torch

{code}

def main():
    here = os.path.dirname(os.path.abspath(__file__))
    inputs = torch.load(os.path.join(here, "{inputs_file}"))
    expected = forward(*inputs)
    torch._dynamo.reset()
    got = torch.compile(forward, backend="ember", dynamic={dynamic!r}, options={options!r})(*inputs)
    bad = False
    for i, (g, e) in enumerate(zip(got, expected)):
        try:
            torch.testing.assert_close(g, e, rtol={rtol!r}, atol={atol!r}, equal_nan=True)
            print(f"output {{i}}: ok")
        except AssertionError as err:
            bad = True
            print(f"output {{i}}: MISMATCH {{err}}")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
'''


def _graph_code(gm: torch.fx.GraphModule) -> str:
    """gm's Python code as a plain function `forward(...)` of ATen ops."""
    code = gm.code.replace("def forward(self, ", "def forward(").replace("def forward(self)", "def forward()")
    lines = [ln for ln in code.splitlines() if ln.strip()]
    header = ["from torch import device  # noqa: F401", "inf, nan = float('inf'), float('nan')", ""]
    return "\n".join(header + lines) + "\n"


def write_repro(gm, inputs: list, out: Path, summary: str, options: dict, rtol, atol, dynamic=None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    inputs_file = "repro_inputs.pt"
    torch.save(inputs, out / inputs_file)
    script = out / "repro.py"
    script.write_text(
        REPRO.format(
            summary=summary,
            inputs_file=inputs_file,
            script=script,
            code=_graph_code(gm),
            # strict: a compile that fails is reported, not run eagerly
            options={**{k: v for k, v in options.items() if k != "bisect_ops"}, "strict": True},
            rtol=rtol,
            atol=atol,
            dynamic=dynamic,
        )
    )
    return script


def _reproduces(gm, inputs, options: dict, rtol, atol, dynamic=None) -> bool:
    fn = _exec_forward(gm)
    return trial(fn, inputs, None, options.get("fuse", True), options, rtol, atol, dynamic).bad


def _exec_forward(gm) -> Callable:
    ns: dict[str, Any] = {"torch": torch}
    exec(compile(_graph_code(gm), "<ember-bisect>", "exec"), ns)  # noqa: S102 - torch.fx's own code
    return ns["forward"]


def bisect(
    fn: Callable,
    inputs: list,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    options: dict | None = None,
    out: str | Path | None = None,
    log: Callable[[str], None] = lambda s: None,
    dynamic: bool | None = None,
) -> BisectResult:
    """Find the op whose lowering (or fusion) makes `fn(*inputs)` differ from eager; write a repro to `out`.

    If an input requires grad, the gradients are compared too and backward graphs are bisected."""
    options = dict(options or {})
    options.setdefault("backend", "cpp")
    trials: list[Trial] = []
    limit = _search(fn, inputs, True, options, rtol, atol, trials, dynamic)
    if limit is None:
        return BisectResult(None, None, None, "no mismatch", "the full compile matches eager", trials=trials)
    log(f"with fusion: first mismatch at bisect_ops={limit}")
    unfused = trial(fn, inputs, None, False, options, rtol, atol, dynamic)
    trials.append(unfused)
    kind = "op" if unfused.bad else "fusion"
    fuse = kind == "fusion"
    if kind == "op":
        # Without fusion each op is its own kernel: the search there names the op itself.
        limit = _search(fn, inputs, False, options, rtol, atol, trials, dynamic)
        log(f"without fusion: first mismatch at bisect_ops={limit}")
    if limit == 0:
        detail = trials[-1].detail
        detail = f"mismatch with no op lowered: the ATen graph itself (decompositions) differs from eager: {detail}"
        return BisectResult(None, None, 0, "eager graph", detail, trials=trials)
    last_bad = next(t for t in reversed(trials) if t.bad and t.fuse == fuse and t.graphs)
    found = _culprit_nodes(last_bad, limit, options)
    if not found:
        return BisectResult(None, None, limit, kind, f"no graph lowers {limit} ops: {last_bad.detail}", trials=trials)
    k, gkind, gm, real, node = found[0]
    if real is None:  # the graph's compile raised at this limit: take its inputs from a trial that ran it
        real = next((t.graphs[k][2] for t in trials if len(t.graphs) > k and t.graphs[k][2] is not None), None)
    others = [f"{_op_name(n)} ({n.name}, {kd} graph {i})" for i, kd, _, _, n in found[1:]]
    culprit = f"{node.target} (node {node.name} in {gkind} graph {k})"
    detail = ("a fusion bug: the result matches with fuse=False. " if kind == "fusion" else "an op bug: ") + (
        last_bad.detail.splitlines()[0]
    )
    if others:
        detail += f"; other graphs' op at that position: {', '.join(others)}"
    result = BisectResult(culprit, _op_name(node), limit, kind, detail, trials=trials)
    if out is not None and real is not None:
        settings = {**options, "fuse": fuse}
        sub, kept = _subgraph(gm, node)
        sub_inputs = [real[i] for i in kept]
        if _reproduces(sub, sub_inputs, settings, rtol, atol, dynamic):
            result.repro = write_repro(sub, sub_inputs, Path(out), culprit, settings, rtol, atol, dynamic)
        else:
            log("the cut-down graph does not reproduce it; writing the whole graph")
            result.repro = write_repro(gm, list(real), Path(out), culprit, settings, rtol, atol, dynamic)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ember bisect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("script", help="a Python file defining the function and a function returning its inputs")
    p.add_argument("--fn", default="program", help="the function to check (default: program, as in fuzz repros)")
    p.add_argument("--inputs", default="make_inputs", help="a function returning the list of inputs")
    p.add_argument("--rtol", type=float, default=None, help="torch.testing.assert_close's rtol (default: by dtype)")
    p.add_argument("--atol", type=float, default=None)
    p.add_argument("--backend", default="cpp", choices=["cpp", "triton"])
    p.add_argument("--out", default="results/bisect", help="where the repro is written")
    p.add_argument("--grad", action="store_true", help="float inputs require grad: check gradients too")
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (symbolic sizes)")
    args = p.parse_args(argv)
    if (args.rtol is None) != (args.atol is None):
        p.error("give both --rtol and --atol, or neither")
    ns = runpy.run_path(args.script, run_name="ember_bisect_target")
    fn, inputs = ns[args.fn], list(ns[args.inputs]())
    if args.grad:
        inputs = [
            x.requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs
        ]
    result = bisect(
        fn,
        inputs,
        rtol=args.rtol,
        atol=args.atol,
        options={"backend": args.backend},
        out=args.out,
        log=print,
        dynamic=True if args.dynamic else None,
    )
    print(result)
    return 0 if result.kind == "no mismatch" else 1


if __name__ == "__main__":
    sys.exit(main())
