"""Reporting a benchmark run: JSON lines, a table (rich when installed, else plain), markdown (the PNG:
plot.py).

The JSON lines are the record; everything else is derived from them, so runs made in several
calls (e.g. timings in one, compile times in another) merge by re-rendering their files together:
`ember bench --from-jsonl a.jsonl b.jsonl --out DIR`.

Ratios: speed-up = eager ms ÷ compiler ms; "ember ÷ Inductor" = Inductor ms ÷ ember ms, from the
same run (above 1: ember is faster; ember in a mode is compared with Inductor in that mode where
the run has it); % of limit = the floor (the larger of bytes ÷ measured bandwidth and FLOPs ÷
measured matmul rate) ÷ measured time; % GPU busy = the kernels' time per call under
torch.profiler ÷ measured time (GPU only); host µs = the compiled graph's host time per call,
guards excluded (host_cost.py; the host rows only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ember.tools import timing_noise
from ember.tools.bench.compilers import PEERS

TIMED = ("ok", "fell back")


def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def load_jsonl(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


@dataclass
class Run:
    """The records of one or more runs, joined by case."""

    env: list[dict] = field(default_factory=list)
    ceilings: dict | None = None
    cases: dict[str, dict] = field(default_factory=dict)
    compile: dict[str, dict] = field(default_factory=dict)
    dynamic: dict[str, dict] = field(default_factory=dict)  # dynamic-shape rows (dynamic.py): a table of their own

    @classmethod
    def of(cls, records: list[dict]) -> Run:
        run = cls()
        for r in records:
            kind = r.get("type")
            if kind == "run":
                run.env.append(r)
            elif kind == "ceilings" and run.ceilings is None:
                run.ceilings = r
            elif kind == "case" and (r.get("kind") == "dynamic" or r.get("mode") == "dynamic"):
                # (by its mode too: a row skipped or failed before its build says no kind)
                run.dynamic[r["case"]] = r
            elif kind == "case":
                run.cases[r["case"]] = r
            elif kind == "compile" and not (r.get("skipped") and "compilers" in run.compile.get(r["case"], {})):
                run.compile[r["case"]] = r  # a later measurement wins; a later skip does not erase one
        for key, r in run.compile.items():  # compile-only cases still get a row
            run.cases.setdefault(
                key, {"case": key, "workload": r["workload"], "mode": r["mode"], "compilers": {}, "timing": False}
            )
        return run

    @property
    def compilers(self) -> list[str]:
        """The run's compilers, then other frameworks some rows add (a JAX column)."""
        names: list[str] = []
        for env in self.env:
            names += [c for c in env.get("compilers", []) if c not in names]
        for case in [*self.cases.values(), *self.dynamic.values()]:
            names += [c for c in case.get("compilers", {}) if c != "eager" and c not in names]
        return names


def baseline(compiler: str, compilers: list[str]) -> str:
    """The Inductor an ember column is compared with: Inductor in the same mode where the run has it."""
    _, _, mode = compiler.partition(":")
    same = f"inductor:{mode}"
    return same if mode and same in compilers else "inductor"


def busy_fraction(case: dict, compiler: str) -> float | None:
    """The GPU's busy time (its kernels, from torch.profiler) ÷ the step's time."""
    c = case.get("compilers", {}).get(compiler) or {}
    t = ms_of(case, compiler)
    return c["busy_ms"] / t if t and c.get("busy_ms") is not None else None


def ms_of(case: dict, compiler: str) -> float | None:
    c = case.get("compilers", {}).get(compiler)
    return c["ms"] if c and c.get("status") in TIMED and c.get("ms") else None


def speedup(case: dict, compiler: str) -> float | None:
    eager, t = ms_of(case, "eager"), ms_of(case, compiler)
    return eager / t if eager and t else None


def versus(case: dict, compiler: str, baseline: str = "inductor") -> float | None:
    """baseline ms ÷ compiler ms (above 1: `compiler` is faster)."""
    base, t = ms_of(case, baseline), ms_of(case, compiler)
    return base / t if base and t else None


def versus_by_round(case: dict, compiler: str, baseline: str = "inductor") -> list[float]:
    """baseline ÷ compiler in each timing round (the rounds take turns, so each pair ran close
    in time); empty where the case was timed in one round."""
    comps = case.get("compilers", {})
    if ms_of(case, baseline) is None or ms_of(case, compiler) is None:
        return []
    base, t = comps[baseline].get("ms_rounds", []), comps[compiler].get("ms_rounds", [])
    return [b / x for b, x in zip(base, t)] if len(base) == len(t) else []


def _range(vs: list[float]) -> str:
    return f"{min(vs):.2f}–{max(vs):.2f}" if vs else "-"


def fraction_of_limit(case: dict, compiler: str) -> float | None:
    floor, t = (case.get("limit") or {}).get("floor_ms"), ms_of(case, compiler)
    return floor / t if floor and t else None


def label(compiler: str) -> str:
    name, _, mode = compiler.partition(":")
    pretty = {"inductor": "Inductor", "ember": "ember", "eager": "eager", "onnxruntime": "ONNX Runtime"}.get(name, name)
    return f"{pretty} {mode}" if mode else pretty


def _cell_ms(case: dict, compiler: str) -> str:
    c = case.get("compilers", {}).get(compiler)
    if c is None:
        return "-"
    status = c.get("status")
    # On a GPU the time is the larger of the device's and the host's; "(host)" marks the host's.
    host = " (host)" if c.get("host_ms", 0) > c.get("device_ms", math.inf) else ""
    if status == "ok":
        return f"{c['ms']:.3f}{host}"
    if status == "fell back":
        return f"{c['ms']:.3f}{host} (fell back)"
    if status == "mismatch":
        return f"MISMATCH ({c.get('err', math.nan):.1e})"
    if status == "skipped":
        return "skipped"
    return f"error: {c.get('note', '?').split(':')[0]}"


def _x(v: float | None, digits: int = 2) -> str:
    return f"{v:.{digits}f}×" if v is not None else "-"


def _us(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "-"


def _pct(v: float | None) -> str:
    return f"{100 * v:.0f}%" if v is not None else "-"


def _compile_cell(run: Run, key: str, compiler: str) -> str:
    rec = run.compile.get(key)
    if rec is None:
        return "-"
    if rec.get("skipped"):
        return "n/m"
    c = rec.get("compilers", {}).get(compiler)
    if not c:
        return "-"

    def one(m):
        return f"{m['seconds']:.1f}" if m and "seconds" in m else "err"

    cell = one(c.get("cold")) + (f" / {one(c.get('warm'))}" if "warm" in c else "")
    return cell + (f" / {one(c.get('imported'))}" if "imported" in c else "")


def table_rows(run: Run) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, notes): one row per case; notes hold skips, fallbacks, mismatches, errors."""
    compilers = run.compilers
    embers = [c for c in compilers if c.startswith("ember")]
    header = ["workload", "mode", "shape", "dtype", "eager ms"] + [f"{label(c)} ms" for c in compilers]
    header += [f"{label(c)} speed-up" for c in compilers]
    if "inductor" in compilers:
        header += [f"{label(c)} ÷ {label(baseline(c, compilers))}" for c in embers]
        header += [f"{label(c)} ÷ {label(baseline(c, compilers))}, rounds min–max" for c in embers]
    peers = [p for p in compilers if p in PEERS]
    header += [f"{label(c)} ÷ {label(p)}" for p in peers for c in embers]
    header += ["limit ms"] + [f"% limit {label(c)}" for c in ["eager", *compilers]]
    header += [f"% GPU busy {label(c)}" for c in ["eager", *compilers]]
    host_rows = any("graph_host_us" in c for case in run.cases.values() for c in case.get("compilers", {}).values())
    if host_rows:
        header += [f"host µs {label(c)}" for c in ["eager", *compilers]]
    header += [f"peak MB {label(c)}" for c in ["eager", *compilers]]
    header += [f"compile s {label(c)} cold / warm (/ imported)" for c in compilers]
    header += ["ember kernels / externs"]
    rows, notes = [], []
    for key, case in run.cases.items():
        row = [case["workload"], case["mode"], case.get("shape", ""), case.get("dtype", "")]
        if case.get("skipped") or case.get("error"):
            why = case.get("skipped") or f"error: {case['error']}"
            notes.append(f"{key}: {why}")
            rows.append(row + [("skipped" if case.get("skipped") else "error")] + ["-"] * (len(header) - 5))
            continue
        timed = case.get("timing", True)
        row.append(_cell_ms(case, "eager") if timed else "n/m")
        row += [_cell_ms(case, c) if timed else "n/m" for c in compilers]
        row += [_x(speedup(case, c)) for c in compilers]
        if "inductor" in compilers:
            row += [_x(versus(case, c, baseline(c, compilers))) for c in embers]
            row += [_range(versus_by_round(case, c, baseline(c, compilers))) for c in embers]
        row += [_x(versus(case, c, p)) for p in peers for c in embers]
        limit = case.get("limit") or {}
        floor = limit.get("floor_ms")
        bound = ""
        if limit and run.ceilings:
            t_bytes = limit["bytes"] / run.ceilings["bandwidth_Bps"] * 1000
            # Merged runs measured slightly different ceilings: a row without FLOPs is bound by memory,
            # and a 1% margin keeps the label from following another run's bandwidth.
            memory_bound = not limit.get("flops") or (floor is not None and floor <= t_bytes * 1.01)
            bound = " (mem)" if memory_bound else " (FLOP)"
        row.append(f"{floor:.3f}{bound}" if floor else "-")
        row += [_pct(fraction_of_limit(case, c)) for c in ["eager", *compilers]]
        row += [_pct(busy_fraction(case, c)) for c in ["eager", *compilers]]
        if host_rows:
            row += [_us(case.get("compilers", {}).get(c, {}).get("graph_host_us")) for c in ["eager", *compilers]]
        for c in ["eager", *compilers]:
            peak = case.get("compilers", {}).get(c, {}).get("peak_mb")
            row.append("-" if peak is None else f"{peak:.0f}" if peak >= 10 else f"{peak:.2f}")
        row += [_compile_cell(run, key, c) for c in compilers]
        kernels = []
        for c in embers:
            e = case.get("compilers", {}).get(c, {})
            if "kernels" in e:
                kernels.append(f"{e['kernels']} / {e['externs']}" + (" (fell back)" if e.get("fallbacks") else ""))
        row.append("; ".join(kernels) or "-")
        rows.append(row)
        for c in compilers:
            e = case.get("compilers", {}).get(c, {})
            for fb in e.get("fallbacks", []):
                notes.append(f"{key}: {label(c)} ran a graph eagerly: {fb[:200]}")
            if e.get("status") in ("mismatch", "error", "skipped") or e.get("note") and e.get("status") == "ok":
                notes.append(f"{key}: {label(c)} {e['status']}: {e.get('note', '')[:300]}")
            if e.get("tokens_matching"):
                notes.append(f"{key}: {label(c)} greedy tokens equal to eager's: {e['tokens_matching']}")
        crec = run.compile.get(key, {})
        if crec.get("skipped"):
            notes.append(f"{key}: compile time {crec['skipped']}")
        for c, m in crec.get("compilers", {}).items():
            for kind, r in m.items():
                if r and "error" in r:
                    notes.append(f"{key}: {label(c)} {kind} compile: {r['error'][:200]}")
    return header, rows, notes + timing_notes(run)


def timing_notes(run: Run) -> list[str]:
    """Warnings that the times are not to be trusted: a busy machine when the run began, rounds that disagree."""
    notes = []
    for env in run.env:
        load = env.get("load_average")
        busy = timing_noise.load_warning(load[0] if load else None, env.get("cpus") or 1)
        if busy:
            notes.append(f"when the run of {env.get('date', '?')} on {env['device']} began, {busy}")
    for key, case in [*run.cases.items(), *run.dynamic.items()]:
        for c, e in case.get("compilers", {}).items():
            uneven = timing_noise.spread_warning(f"{key}: {label(c)}", e.get("ms_rounds") or [])
            if uneven:
                notes.append(uneven)
    return notes


DYNAMIC_TITLE = (
    "Dynamic shapes: each compiled once with dynamic=None, then called at every size in turn; "
    "ms: the geometric mean over sizes"
)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def sizes_ms(case: dict, compiler: str) -> list[float] | None:
    """A dynamic-shape row's steady-state ms at each size for `compiler` (None: not timed at every size)."""
    c = case.get("compilers", {}).get(compiler)
    if not c or c.get("status") not in TIMED:
        return None
    ms = [p.get("ms") for p in c.get("sizes", [])]
    return ms if ms and all(ms) else None


def versus_by_size(case: dict, compiler: str, baseline: str = "inductor") -> list[float]:
    """baseline ms ÷ compiler ms at each size of a dynamic-shape row; empty unless both ran every size."""
    base, t = sizes_ms(case, baseline), sizes_ms(case, compiler)
    return [b / x for b, x in zip(base, t)] if base and t and len(base) == len(t) else []


def _frames_cell(c: dict | None) -> str:
    if not c or "frames" not in c:
        return "-"
    breaks = c.get("graph_breaks")
    return f"{c['frames']}" + (f" ({breaks} breaks)" if breaks else "")


def _float64_cell(c: dict | None) -> str:
    if not c or not c.get("sizes"):
        return "-" if not c or c.get("status") != "error" else "error"
    passed = sum(p["float64"] == "pass" for p in c["sizes"])
    cell = f"{passed}/{len(c['sizes'])}"  # sizes passing
    if c.get("status") == "error":
        return cell + " then error"
    return cell if passed == len(c["sizes"]) else cell + " FAIL"


def dynamic_rows(run: Run) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, notes) of the dynamic-shape rows (dynamic.py): per compiler the frames compiled
    over every size, the compile time (the sum of each size's first call), the steady-state geometric
    mean over sizes and the sizes passing the float64 rule; ember ÷ Inductor, the geometric mean over
    sizes of Inductor ms ÷ ember ms, and its range over the sizes."""
    compilers = [c for c in run.compilers if c not in PEERS]
    embers = [c for c in compilers if c.startswith("ember")]
    header = ["workload", "shape", "dtype"] + [f"{label(c)} frames" for c in compilers]
    header += [f"{label(c)} compile s" for c in compilers]
    header += [f"{label(c)} ms" for c in ["eager", *compilers]]
    if "inductor" in compilers:
        header += [f"{label(c)} ÷ {label(baseline(c, compilers))}" for c in embers]
        header += [f"{label(c)} ÷ {label(baseline(c, compilers))}, sizes min–max" for c in embers]
    header += [f"{label(c)} float64" for c in compilers]
    rows, notes = [], []
    for key, case in run.dynamic.items():
        row = [case["workload"], case.get("shape", ""), case.get("dtype", "")]
        if case.get("skipped") or case.get("error"):
            why = case.get("skipped") or f"error: {case['error']}"
            notes.append(f"{key}: {why}")
            rows.append(row + ["skipped" if case.get("skipped") else "error"] + ["-"] * (len(header) - 4))
            continue
        comps = case.get("compilers", {})
        row += [_frames_cell(comps.get(c)) for c in compilers]
        row += [f"{comps[c]['compile_s']:.1f}" if "compile_s" in comps.get(c, {}) else "-" for c in compilers]
        row += [_cell_ms(case, c) for c in ["eager", *compilers]]
        if "inductor" in compilers:
            row += [_x(versus(case, c, baseline(c, compilers))) for c in embers]
            row += [_range(versus_by_size(case, c, baseline(c, compilers))) for c in embers]
        row += [_float64_cell(comps.get(c)) for c in compilers]
        rows.append(row)
        for c in compilers:
            e = comps.get(c, {})
            for fb in e.get("fallbacks", []):
                notes.append(f"{key}: {label(c)} ran a graph eagerly: {fb[:200]}")
            if e.get("status") in ("mismatch", "error", "skipped") or e.get("note") and e.get("status") == "ok":
                notes.append(f"{key}: {label(c)} {e['status']}: {e.get('note', '')[:300]}")
            if e.get("frames", 0) > 2:
                reasons = "; ".join(e.get("recompile_reasons", [])[:3])
                notes.append(f"{key}: {label(c)} compiled {e['frames']} frames; Dynamo's reasons: {reasons}")
            if e.get("recompiled_while_timing"):
                notes.append(f"{key}: {label(c)} compiled {e['recompiled_while_timing']} more graphs while timed")
    return header, rows, notes


def dynamic_main_columns(run: Run, header: list[str]) -> list[int]:
    """The dynamic-shape table's columns a terminal shows unless asked for all: the frames and the
    geometric-mean time of each compiler, and ember's ratio to Inductor and float64 result."""
    compilers = [c for c in run.compilers if c not in PEERS]
    embers = [c for c in compilers if c.startswith("ember")]
    keep = {"workload"} | {f"{label(c)} frames" for c in compilers}
    keep |= {f"{label(c)} ms" for c in ["eager", *compilers]}
    keep |= {f"{label(e)} ÷ {label(baseline(e, compilers))}" for e in embers}
    keep |= {f"{label(e)} float64" for e in embers}
    return [i for i, name in enumerate(header) if name in keep]


def dynamic_summary(run: Run) -> list[str]:
    """Per dynamic-shape row and ember column: ember ÷ Inductor as the geometric mean over sizes, its
    range, and each one's frames."""
    lines = []
    for case in run.dynamic.values():
        for c in [c for c in run.compilers if c.startswith("ember")]:
            base = baseline(c, run.compilers)
            by_size = versus_by_size(case, c, base)
            if not by_size:
                continue
            comps = case["compilers"]
            lines.append(
                f"{label(c)} ÷ {label(base)}, {case['workload']} over {len(by_size)} sizes: geometric mean "
                f"{_geomean(by_size):.2f}× ({_range(by_size)}); frames {comps[c].get('frames')} vs "
                f"{comps[base].get('frames')}"
            )
    return lines


def main_columns(run: Run, header: list[str]) -> list[int]:
    """The columns a terminal shows unless asked for all (`ember bench --wide`): each compiler's time
    and ember's speed-up, its ratio to Inductor and its share of the limit, which fit 80 columns.
    Shapes, peaks, round ranges, compile times and kernel counts are in table.md and table.txt."""
    embers = [c for c in run.compilers if c.startswith("ember")]
    keep = {"workload", "mode", "eager ms"} | {f"{label(c)} ms" for c in run.compilers}
    keep |= {f"{label(e)} speed-up" for e in embers} | {f"% limit {label(e)}" for e in embers}
    keep |= {f"{label(e)} ÷ {label(baseline(e, run.compilers))}" for e in embers}
    return [i for i, name in enumerate(header) if name in keep]


def _columns(header: list[str], rows: list[list[str]], keep: list[int]) -> tuple[list[str], list[list[str]]]:
    """The kept columns; the mode "inference" shortened to "infer", so the longest workload fits too."""
    mode = header.index("mode") if "mode" in header else -1
    rows = [[("infer" if i == mode and cell == "inference" else cell) for i, cell in enumerate(row)] for row in rows]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


def _two_lines(header: str) -> str:
    """A long column name broken at its middle space, so that the name is no wider than the numbers."""
    if len(header) <= 9 or " " not in header:
        return header
    spaces = [i for i, ch in enumerate(header) if ch == " "]
    cut = min(spaces, key=lambda i: abs(i - len(header) / 2))
    return header[:cut] + "\n" + header[cut + 1 :]


def describe_env(run: Run) -> list[str]:
    lines = []
    for env in run.env:
        lines.append(
            f"{env['device']} ({env['cpus']} CPUs), torch {env['torch']}, triton {env['triton']}, "
            f"Python {env['python']}, scale {env['scale']}, {env['date']}"
        )
    c = run.ceilings
    if c:
        rates = ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in c["flops"].items())
        lines.append(f"measured ceilings: copy {c['bandwidth_Bps'] / 1e9:.1f} GB/s (read + write); matmul {rates}")
    return lines


def summary(run: Run, worst: int = 3) -> list[str]:
    """Per ember column and mode (inference, train): the geometric mean of ember ÷ Inductor over the rows
    timed in both, and the `worst` rows. Empty where the run has no Inductor or fewer than two such rows."""
    lines = []
    for c in [c for c in run.compilers if c.startswith("ember")]:
        base = baseline(c, run.compilers)
        for mode in ("inference", "train"):
            got = [(versus(case, c, base), case["workload"]) for case in run.cases.values() if case.get("mode") == mode]
            got = sorted((v, name) for v, name in got if v)
            if len(got) < 2:
                continue
            mean = math.exp(sum(math.log(v) for v, _ in got) / len(got))
            low = ", ".join(f"{name} {v:.2f}×" for v, name in got[:worst])
            lines.append(
                f"{label(c)} ÷ {label(base)}, {mode}: geometric mean {mean:.2f}× over {len(got)} rows; lowest: {low}"
            )
    return lines + dynamic_summary(run)


def _tables(run: Run, wide: bool = True) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
    """(title, header, rows, notes) of each table the run has: the main one (unless the run has only
    dynamic-shape rows), then the dynamic-shape one; `wide` False keeps their main columns."""
    tables = []
    if run.cases or not run.dynamic:
        header, rows, notes = table_rows(run)
        if not wide:
            header, rows = _columns(header, rows, main_columns(run, header))
        tables.append(("", header, rows, notes))
    if run.dynamic:
        header, rows, notes = dynamic_rows(run)
        if not wide:
            header, rows = _columns(header, rows, dynamic_main_columns(run, header))
        tables.append((DYNAMIC_TITLE, header, rows, notes))
    return tables


def markdown(run: Run) -> str:
    out = [f"- {line}" for line in describe_env(run)] + [f"- {line}" for line in summary(run)]
    for title, header, rows, notes in _tables(run):
        out += ["", title, ""] if title else [""]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        out += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
        if notes:
            out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def plain(run: Run, wide: bool = True) -> str:
    """The tables as text: every column (table.txt), or the main ones (a terminal without rich)."""
    lines = describe_env(run) + summary(run)
    for title, header, rows, notes in _tables(run, wide):
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        lines += ["", title] if title else [""]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
        if notes:
            lines += ["", "notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines) + "\n"


def print_table(run: Run, console=None, wide: bool = False) -> None:
    """A rich table when rich is installed, else the plain one: the main columns, sized to the
    terminal; `wide`: every column, at 200 characters or more."""
    try:
        from rich import box
        from rich.table import Table
    except ImportError:
        print(plain(run, wide=wide))
        print("(install rich for a formatted table)")
        return
    if console is None:
        from rich.console import Console

        console = Console(width=max(200, Console().width)) if wide else Console()
    every_note = []
    tables = _tables(run, wide)
    for k, (title, header, rows, notes) in enumerate(tables):
        caption = describe_env(run) if k == len(tables) - 1 else []  # under the last table
        if caption and not wide:
            caption.append("shapes, peak memory, compile times, kernels: table.md / table.txt, or --wide")
        # Columns one space apart (SIMPLE_HEAD's separators are spaces): the main ones fit 80 characters.
        table = Table(
            title=f"ember bench: {title}" if title else "ember bench",
            caption="\n".join(caption) or None,
            box=box.SIMPLE_HEAD,
            padding=(0, 0),
        )
        for h in header:
            table.add_column(h if wide else _two_lines(h), overflow="fold")
        for row in rows:
            style = "red" if any("MISMATCH" in c or c.startswith("error") or "FAIL" in c for c in row) else None
            table.add_row(*row, style=style)
        console.print(table)
        every_note += notes
    for line in summary(run):
        console.print(line, highlight=False)
    for n in every_note:
        console.print(f"[yellow]note[/yellow] {n}", markup=True, highlight=False)
