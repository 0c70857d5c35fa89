"""`ember bench`: eager vs Inductor vs ember, against the measured limit.

    ember bench                                          # every workload, this machine's sizes
    ember bench --workloads micro --modes inference
    ember bench --workloads softmax,gpt2_blocks --compile-time none
    ember bench --max-autotune                           # adds Inductor max-autotune (minutes)
    ember bench --from-jsonl a.jsonl b.jsonl --out DIR   # re-render / merge runs
    ember bench --accuracy --no-inductor                 # float64-reference accuracy, not speed
    ember bench --profile --workloads resnet50 --modes train   # top kernels, host and device time per call
    ember bench --workloads dynamic --compile-time none        # one compile called at many sizes (dynamic.py)

Prints the main columns (--wide: all of them) and writes every column to table.md and table.txt,
with results.jsonl and bench.png, in --out (default results/bench-DATE). `python -m
ember.tools.bench` runs the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ember.tools.bench import plot, report
from ember.tools.bench.compilers import PEERS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ember bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workloads",
        default="all",
        help="all (every group but zoo and cpu_models), micro, model, host, optim, flex, dynamic, zoo, cpu_models, "
        "names, or workload/mode for one case (comma-separated)",
    )
    p.add_argument("--modes", default="inference,train", help="inference, train, or both")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument(
        "--scale", default="auto", choices=["auto", "gpu", "cpu", "tiny"], help="auto: gpu on cuda, else cpu"
    )
    p.add_argument(
        "--ember-modes",
        default="default",
        help="torch.compile modes to run ember in (comma-separated); 'freezing' is the default mode with "
        "options={'freezing': True}, beside Inductor's freezing",
    )
    p.add_argument("--peers", default="", help="other runtimes beside the compilers, inference only: onnxruntime")
    p.add_argument("--max-autotune", action="store_true", help="also Inductor with mode=max-autotune (slow)")
    p.add_argument("--no-inductor", action="store_true", help="skip Inductor (its ratio columns then stay empty)")
    p.add_argument(
        "--compile-time",
        default="all",
        help="cases to time compiling in fresh processes: all, none, or names (workload or workload/mode)",
    )
    p.add_argument("--compile-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--compile-imported",
        action="store_true",
        help="compile time: also a fresh process with empty caches that imports the file the cold run exported "
        "(ember.save_cache; Inductor's torch.compiler.save_cache_artifacts)",
    )
    p.add_argument("--no-timing", action="store_true", help="only compile times (e.g. to merge with another run)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new measurement after this many seconds")
    p.add_argument(
        "--rounds", type=int, default=3, help="timing rounds per case, taking turns; each row is the median over them"
    )
    p.add_argument("--cpu-budget-s", type=float, default=1.0, help="CPU: seconds of timed calls per variant")
    p.add_argument("--out", default=None, help="results folder (default results/bench-DATE-TIME)")
    p.add_argument("--from-jsonl", nargs="+", default=None, help="re-render (and merge) these JSON-lines files")
    p.add_argument("--list", action="store_true", help="list the workloads at --device's sizes and exit")
    p.add_argument("--wide", action="store_true", help="print every column (table.md and table.txt always have them)")
    p.add_argument(
        "--accuracy",
        action="store_true",
        help="instead of timing: check each compiler against a float64 reference (PyTorch's dynamo-benchmark rule)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the table: eager and each compiler under torch.profiler, per call: time, host and device "
        "parts, the kernels with the most time, memory at the peak (GPU); profile.md, results.jsonl and "
        "ember's explain/CASE.txt (graphs, measured kernels, host program) in --out",
    )
    p.add_argument("--top", type=int, default=25, help="--profile: kernels listed per compiler")
    from ember.tools.bench import distributed  # its options: --distributed ddp,fsdp2 --nproc N ...

    distributed.add_arguments(p)
    return p


def _device_and_scale(args):
    """The device to run on and the workload sizes for it (--device, --scale; auto: this machine's)."""
    import torch

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    return device, args.scale if args.scale != "auto" else ("gpu" if device.type == "cuda" else "cpu")


def _compilers(args) -> list[str]:
    out = [] if args.no_inductor else ["inductor"]
    if args.max_autotune:
        out.append("inductor:max-autotune")
    modes = [m.strip() for m in args.ember_modes.split(",")]
    # Inductor in each mode ember runs in, so that each ember column has its Inductor beside it.
    if not args.no_inductor:
        out += [f"inductor:{m}" for m in modes if m not in ("", "default") and f"inductor:{m}" not in out]
    out += ["ember" if m in ("", "default") else f"ember:{m}" for m in modes]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}: {', '.join(PEERS)}")
    return out + peers


def _compile_keys(spec: str, cases) -> list[str] | None:
    """The cases to time compiling for, in the order named (so a time budget spends itself on the first).
    A workload that measures itself (a decoding loop, a dynamic-shape sweep) has no step for a fresh
    process to build: its own record holds its first calls' times."""
    if spec == "none":
        return None
    cases = [c for c in cases if c.workload.runner is None]
    if spec == "all":
        return [c.key for c in cases]
    keys: list[str] = []
    for name in (n.strip() for n in spec.split(",")):
        keys += [c.key for c in cases if (c.key == name or c.workload.name == name) and c.key not in keys]
    return keys


def write_outputs(records: list[dict], out: str, wide: bool = False) -> list[str]:
    """table.md, table.txt, bench.png and, after compile times, compile_stages.md (each first step's
    stages) from the records; prints the table (its main columns,
    or every one if `wide`); returns notes."""
    run = report.Run.of(records)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(report.markdown(run))
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(report.plain(run))
    report.print_table(run, wide=wide)
    if any(r.get("type") == "compile" and "compilers" in r for r in records):
        from ember.tools.bench.compile_stages import stage_table

        with open(os.path.join(out, "compile_stages.md"), "w") as f:
            f.write(stage_table(records))
    note = plot.plot(run, os.path.join(out, "bench.png"))
    return [note] if note else []


class _Progress:
    """A rich progress bar on a terminal; otherwise one line per step."""

    def __init__(self, total: int):
        self.total, self.done, self.bar = total, 0, None
        try:
            from rich.console import Console
            from rich.progress import Progress

            if Console().is_terminal:
                self.bar = Progress(transient=True)
                self.task = self.bar.add_task("ember bench", total=total)
        except ImportError:
            pass

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        else:
            print(f"[{self.done}/{self.total}] {text}", flush=True)

    def finished(self, record: dict) -> None:
        if record.get("type") not in ("case", "compile"):
            return
        self.done += 1
        summary = _one_line(record)
        if self.bar is not None:
            self.bar.update(self.task, advance=1)
            self.bar.console.print(summary, highlight=False, markup=False)
        else:
            print(summary, flush=True)


def _one_line(r: dict) -> str:
    if r.get("skipped") or r.get("error"):
        return f"{r['case']}: {r.get('skipped') or 'error: ' + r['error']}"
    if r["type"] == "compile":
        parts = []
        for comp, m in r["compilers"].items():
            cold = m.get("cold", {}).get("seconds")
            warm = (m.get("warm") or {}).get("seconds")
            parts.append(f"{comp} {cold:.1f}s" if cold else f"{comp} err")
            if warm:
                parts[-1] += f"/{warm:.1f}s"
            imported = (m.get("imported") or {}).get("seconds")
            if imported:
                parts[-1] += f"/{imported:.1f}s imported"
        stages = (r["compilers"].get("ember", {}).get("cold") or {}).get("ember_stages_s")
        if stages:
            slowest = sorted(stages.items(), key=lambda kv: -kv[1])[:4]
            parts.append("ember's slowest stages cold: " + ", ".join(f"{n} {s:.1f}s" for n, s in slowest))
        return f"{r['case']} compile (cold/warm, to first result): " + ", ".join(parts)
    cells = []
    for comp, c in r["compilers"].items():
        cells.append(f"{comp} {c['ms']:.3f} ms" if c.get("ms") else f"{comp} {c.get('status')}")
        if "frames" in c:  # a dynamic-shape row: its time is the geometric mean over sizes
            cells[-1] += f" ({c['frames']} frames)"
    return f"{r['case']}: " + ", ".join(cells)


def _accuracy(cases, args, device, scale: str, out: str, argv: list[str]) -> int:
    """--accuracy: every case against a float64 reference; accuracy.md and results.jsonl in `out`."""
    import torch

    from ember.tools.bench import accuracy, harness, measure

    jsonl = os.path.join(out, "results.jsonl")
    open(jsonl, "w").close()
    settings = harness.Settings(device=device, scale=scale, compilers=_compilers(args), timer=measure.Timer(device))
    env = harness.environment(settings)
    report.append_jsonl(jsonl, env)

    def emit(record: dict) -> None:
        report.append_jsonl(jsonl, record)
        print(accuracy.one_line(record), flush=True)

    deadline = time.time() + args.budget_s if args.budget_s else None
    records = accuracy.run(cases, settings.compilers, scale, device, emit, deadline)
    header = (
        f"float64-reference accuracy, {env['date']}, {env['device']}, torch {torch.__version__}, scale {scale}\n\n"
        f"Command: `ember bench {' '.join(argv)}`\n"
    )
    with open(os.path.join(out, "accuracy.md"), "w") as f:
        f.write(accuracy.markdown(records, header))
    bad = [
        f"{r['case']} ({comp})"
        for r in records
        for comp, c in r.get("compilers", {}).items()
        if c.get("status") != "pass"
    ] + [r["case"] for r in records if r.get("error")]
    print(f"results in {out}/ (results.jsonl, accuracy.md)")
    if bad:
        print(f"NOT PASSING: {', '.join(bad)}")
    unchecked = [r["case"] for r in records if r.get("skipped")]
    if unchecked:
        print(f"NOT CHECKED ({len(unchecked)}): {', '.join(unchecked)}")
    return 1 if bad else 0


def _profile(cases, args, device, scale: str, out: str, argv: list[str]) -> int:
    """--profile: every case's profile record in results.jsonl, profile.md, and ember's explain files."""
    import torch

    from ember.tools.bench import harness, measure, profile

    jsonl = os.path.join(out, "results.jsonl")
    open(jsonl, "w").close()
    settings = harness.Settings(
        device=device,
        scale=scale,
        compilers=_compilers(args),
        timer=measure.Timer(device, cpu_budget_s=args.cpu_budget_s),
        progress=lambda line: print(line, flush=True),
    )
    env = harness.environment(settings)
    report.append_jsonl(jsonl, env)
    records = [env]
    os.makedirs(os.path.join(out, "explain"), exist_ok=True)
    for case in cases:
        record, explain = profile.profile_case(case, settings, top=args.top)
        report.append_jsonl(jsonl, record)
        records.append(record)
        if explain:
            with open(os.path.join(out, "explain", case.key.replace("/", "-") + ".txt"), "w") as f:
                f.write(explain)
    header = (
        f"# Profile, {env['date']}, {env['device']}, torch {torch.__version__}, scale {scale}\n\n"
        f"Command: `ember bench {' '.join(argv)}`"
    )
    with open(os.path.join(out, "profile.md"), "w") as f:
        f.write(profile.markdown(records, header))
    print(f"results in {out}/ (profile.md, results.jsonl, explain/)")
    failed = [r["case"] for r in records[1:] if r.get("error")]
    if failed:
        print(f"NOT PROFILED: {', '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.distributed:
        from ember.tools.bench import distributed

        return distributed.main(sys.argv[1:] if argv is None else argv)
    from ember.tools.bench.workloads import WORKLOADS, select

    if args.list:
        device, scale = _device_and_scale(args)
        print(f"sizes for {device.type} (scale {scale}; --scale picks another)")
        width = max(len(name) for name in WORKLOADS) + 2
        for w in WORKLOADS.values():
            print(f"{w.name:<{width}}{w.group:<7}{w.dtype:<15}{'+'.join(w.modes):<18}{w.describe(w.sizes[scale])}")
        return 0
    out = args.out or os.path.join("results", time.strftime("bench-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    if args.from_jsonl:
        records = report.load_jsonl(args.from_jsonl)
        with open(os.path.join(out, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        for note in write_outputs(records, out, wide=args.wide):
            print(f"note: {note}")
        return 0

    from ember.tools.bench import harness, measure

    device, scale = _device_and_scale(args)
    cases = select(args.workloads, args.modes)
    if args.accuracy:
        return _accuracy(cases, args, device, scale, out, sys.argv[1:] if argv is None else argv)
    if args.profile:
        return _profile(cases, args, device, scale, out, sys.argv[1:] if argv is None else argv)
    jsonl = os.path.join(out, "results.jsonl")
    open(jsonl, "w").close()
    compile_keys = _compile_keys(args.compile_time, cases)
    total = (0 if args.no_timing else len(cases)) + len(compile_keys or ())
    with _Progress(total) as progress:

        def emit(record: dict) -> None:
            report.append_jsonl(jsonl, record)
            progress.finished(record)

        settings = harness.Settings(
            device=device,
            scale=scale,
            compilers=_compilers(args),
            timer=measure.Timer(device, cpu_budget_s=args.cpu_budget_s),
            compile_time=compile_keys,
            compile_timeout_s=args.compile_timeout_s,
            compile_imported=args.compile_imported,
            deadline=time.time() + args.budget_s if args.budget_s else None,
            rounds=max(1, args.rounds),
            emit=emit,
            progress=progress.line,
        )
        records = harness.run(cases, settings, timing=not args.no_timing)
    notes = write_outputs(records, out, wide=args.wide)
    for note in notes:
        print(f"note: {note}")
    print(f"results in {out}/ (results.jsonl, table.md, table.txt{'' if notes else ', bench.png'})")
    bad = [
        r["case"]
        for r in records
        if r.get("type") == "case" and any(c.get("status") == "mismatch" for c in r["compilers"].values())
    ]
    if bad:
        print(f"MISMATCH in: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
