"""`ember explain script.py [--function NAME]`: what ember did with a program, at every layer.

With `--function NAME`, the script's NAME (a function or an nn.Module) is compiled with ember, run once
(forward and backward where anything requires grad) and then timed; its arguments come from the
script's `example_inputs()`, which returns a tuple, or a dict of tuples by function name (none needed
for a function without parameters). Shown: Dynamo's graph breaks with reason and line; each graph's
kernels, externs and fusion decisions; each source line and the ATen ops and kernels it became; each
kernel's code at every layer (C++ and assembly; Triton, TTIR, TTGIR, LLVM IR, PTX and SASS) with its
registers, spills, shared memory and occupancy; each kernel's measured time against the device's
measured ceilings. `--html FILE` writes all of it as one self-contained page.

Without `--function`, the script runs as `__main__` and every graph ember compiles in it is shown
(graph breaks as Dynamo counted them; no timing, since ember does not know the script's step).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import runpy
import sys
from pathlib import Path

import torch

from ember import config
from ember.tools.explain import Explanation, explain_all, short_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ember explain", description=__doc__.split("\n\n")[0])
    p.add_argument("script", help="a Python file")
    p.add_argument("--function", help="the function or nn.Module of the script to compile, run and time")
    p.add_argument("--html", help="write the report as one self-contained HTML page to this file")
    p.add_argument(
        "--html-layers", help="the layers the page holds, comma-separated (e.g. Triton,PTX,SASS; default: all)"
    )
    p.add_argument("--layers", choices=["none", "machine", "all"], default="none", help="print kernel code layers")
    p.add_argument("--no-measure", action="store_true", help="do not time the kernels")
    p.add_argument("--calls", type=int, default=10, help="steps timed (default 10)")
    args = p.parse_args(argv)
    script = Path(args.script)
    if not script.is_file():
        print(f"ember explain: no such file: {script}", file=sys.stderr)
        return 2
    try:
        explanation = explain_script(script, args.function, measure=not args.no_measure, calls=args.calls)
    except ScriptError as e:
        print(f"ember explain: {e}", file=sys.stderr)
        return 2
    print(render_text(explanation, args.layers))
    if args.html:
        from ember.tools.explain_html import write_html

        write_html(explanation, args.html, args.html_layers.split(",") if args.html_layers else None)
        print(f"wrote {args.html}")
    return 0


class ScriptError(ValueError):
    """The script, or the function named, cannot be explained as asked."""


def explain_script(script: Path, function: str | None, measure: bool = True, calls: int = 10) -> Explanation:
    sys.path.insert(0, str(script.resolve().parent))
    try:
        if function is None:
            return _explain_main(script)
        namespace = runpy.run_path(str(script), run_name="__ember_explain__")
        if function not in namespace:
            found = sorted(n for n, v in namespace.items() if callable(v) and not n.startswith("_"))
            raise ScriptError(f"{script} defines no {function!r}; callables there: {', '.join(found[:20])}")
        fn = namespace[function]
        return explain_all(fn, _inputs(namespace, function, fn), measure=measure, calls=calls, title=str(script))
    finally:
        sys.path.remove(str(script.resolve().parent))


def _inputs(namespace: dict, function: str, fn) -> tuple:
    make = namespace.get("example_inputs")
    if make is None:
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        required = [
            p
            for p in inspect.signature(target).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            raise ScriptError(f"{function} takes arguments: define example_inputs() in the script to give them")
        return ()
    inputs = make()
    if isinstance(inputs, dict):
        if function not in inputs:
            raise ScriptError(f"example_inputs() gives inputs for {sorted(inputs)}, not for {function!r}")
        inputs = inputs[function]
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _explain_main(script: Path) -> Explanation:
    """Run the script as __main__ and collect every graph ember compiles (backend="ember" in it)."""
    from torch._dynamo.utils import counters

    from ember.report import collecting

    counters.clear()
    argv = sys.argv
    sys.argv = [str(script)]
    recompiles = _Recompiles()
    logging.getLogger("ember").addHandler(recompiles)
    logs = ",".join(n for n in (config.get("logs"), "recompiles") if n)
    try:
        with collecting() as report, config.override(logs=logs):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
        logging.getLogger("ember").removeHandler(recompiles)
    breaks = [f"{reason} ({n}x)" for reason, n in counters["graph_break"].items()]
    result = Explanation(
        report, breaks=breaks, recompiles=recompiles.found, dynamo_graphs=len(report.graphs), title=str(script)
    )
    for gi, g in enumerate(report.graphs):
        if g.layers is not None:
            result.layers[gi] = g.layers()
    return result


class _Recompiles(logging.Handler):
    """Keeps what `EMBER_LOGS=recompiles` (frontend/recompiles.py) logs: each recompile's reasons."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("=== recompiles: "):
            self.found.append(" ".join(message.removeprefix("=== recompiles: ").replace(" ===", ":", 1).split()))


def render_text(e: Explanation, layers: str = "none") -> str:
    from ember.backends.layers import MACHINE_LAYERS
    from ember.tools.explain_measure import table

    out = [f"Dynamo: {e.dynamo_graphs} graph(s), {len(e.breaks)} graph break(s)"]
    out += [f"  break: {b}" for b in e.breaks]
    out += [f"  {r}" for r in e.recompiles]
    if layers == "all":
        out += [f"--- Dynamo's FX graph {i} ---\n{code}" for i, code in enumerate(e.dynamo_code)]
    for gi, g in enumerate(e.report.graphs):
        out.append(str(g))
        if layers == "all" and g.aten_graph:
            out.append(f"--- {g.kind} ATen graph ---\n{g.aten_graph}")
        if g.source_lines:
            out.append("  source lines -> ATen ops -> kernels:")
            for where, (code, ops) in g.source_lines.items():
                kernels = [k.name for k in g.kernels if where in k.lines]
                kernels += [f"extern {x}" for x, w in zip(g.externs, g.extern_lines) if w == where]
                out.append(f"    {short_path(where)}  {code}")
                out.append(f"        ops {', '.join(ops)} -> {', '.join(kernels) or '(no kernel: views or folded)'}")
        for name, kl in e.layers.get(gi, {}).items():
            missing = f"; missing: {', '.join(kl.missing)}" if kl.missing else ""
            out.append(f"  {name} layers: {', '.join(kl.layers)}; {kl.describe_resources()}{missing}")
            for layer, text in kl.layers.items():
                if layers == "all" or (layers == "machine" and layer in MACHINE_LAYERS):
                    out.append(f"--- {name} {layer} ---\n{text.rstrip()}")
    if e.measured and e.ceilings is not None:
        out.append(table(e.measured, e.ceilings))
    return "\n".join(out)
