"""The driver: generate programs, check them in batches, count outcomes, write repros; the CLI."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.tools.fuzz.checker import STATS, Outcome, check
from ember.tools.fuzz.generator import generate
from ember.tools.fuzz.repro import write_repro


@dataclass
class Summary:
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[Outcome] = field(default_factory=list)
    fallbacks: list[Outcome] = field(default_factory=list)
    invalid: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def mismatches(self) -> int:
        return self.counts.get("mismatch", 0) + self.counts.get("crash", 0)


def run(
    seed: int,
    count: int,
    start: int = 0,
    batch: int = 8,
    options: dict | None = None,
    repro_dir: str | Path | None = None,
    log=None,
    device: str = "cpu",
) -> Summary:
    """Generate and check programs start..start+count-1 of `seed`."""
    options = {"backend": "cpp", **(options or {})}
    summary = Summary()
    t0 = time.time()
    indices = list(range(start, start + count))
    for b in range(0, len(indices), batch):
        progs = [generate(seed, i) for i in indices[b : b + batch]]
        # Static and dynamic-shape programs compile apart: a program is checked the way it is replayed.
        kinds = sorted({(p.dynamic, p.grad) for p in progs})
        groups = [[p for p in progs if (p.dynamic, p.grad) == kind] for kind in kinds]
        outcomes = [o for g in groups if g for o in check(g, options, device)]
        for o in sorted(outcomes, key=lambda o: o.program.index):
            summary.counts[o.status] = summary.counts.get(o.status, 0) + 1
            if o.status in ("mismatch", "crash"):
                summary.failures.append(o)
            elif o.status == "fallback":
                summary.fallbacks.append(o)
            elif o.status == "invalid":
                summary.invalid.append(o)
            if o.status != "ok":
                where = (
                    write_repro(o, Path(repro_dir), options, device) if repro_dir and o.status != "invalid" else None
                )
                if log:
                    log(
                        f"program {o.program.index}: {o.status}: {o.detail[:400]}"
                        + (f"\n  repro: {where}" if where else "")
                    )
        if log:
            done = min(b + batch, len(indices))
            log(f"[{done}/{len(indices)}] {time.time() - t0:.0f}s {dict(sorted(summary.counts.items()))}")
    summary.seconds = time.time() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ember fuzz",
        description=sys.modules["ember.tools.fuzz"].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--start", type=int, default=0, help="index of the first program")
    p.add_argument("--only", type=int, default=None, help="just program ONLY of the seed")
    p.add_argument("--batch", type=int, default=8, help="programs compiled together (one C++ build per batch)")
    p.add_argument("--backend", default="cpp", choices=["cpp", "triton"])
    p.add_argument("--device", default="cpu", help="where the inputs live: cpu, cuda (use --backend triton)")
    p.add_argument("--repro-dir", default="results/fuzz-repros")
    p.add_argument("--show", action="store_true", help="print the programs instead of running them")
    args = p.parse_args(argv)
    start, count = (args.only, 1) if args.only is not None else (args.start, args.count)
    if args.show:
        for i in range(start, start + count):
            prog = generate(args.seed, i)
            flags = [f for f, on in (("dynamic", prog.dynamic), ("gradients", prog.grad)) if on]
            print(f"# seed {args.seed} program {i}{' (' + ', '.join(flags) + ')' if flags else ''}")
            print(prog.inputs_source() + "\n" + prog.source())
        return 0
    if args.backend == "triton" and args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's CPU interpreter (before triton is imported)
    print(
        f"ember fuzz: seed {args.seed}, programs {start}..{start + count - 1}, backend {args.backend}, "
        f"device {args.device}",
        flush=True,
    )
    s = run(
        args.seed,
        count,
        start,
        args.batch,
        {"backend": args.backend},
        args.repro_dir,
        log=lambda m: print(m, flush=True),
        device=args.device,
    )
    print(
        f"done: {count} programs in {s.seconds:.0f}s: {s.counts.get('ok', 0)} ok, "
        f"{s.counts.get('fallback', 0)} fell back to eager, {s.counts.get('mismatch', 0)} mismatches, "
        f"{s.counts.get('crash', 0)} crashes, {s.counts.get('invalid', 0)} invalid (eager raised)"
    )
    print(f"compiled {STATS['graphs']} graphs: {STATS['kernels']} ember kernels, {STATS['externs']} ATen externs")
    causes: dict[str, list[int]] = {}
    for o in s.fallbacks:
        cause = re.sub(r"\d+", "N", o.detail.splitlines()[0] if o.detail else "")[:160]
        causes.setdefault(cause, []).append(o.program.index)
    for cause, which in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        print(
            f"  fell back {len(which)}x: {cause}  (programs {', '.join(map(str, which[:8]))}{' ...' if len(which) > 8 else ''})"
        )
    for o in s.failures:
        print(f"  FAIL: program {o.program.index} ({o.status}): {o.detail[:300]}")
    return 1 if s.mismatches else 0
