"""The command line: `python -m ember.tools.opinfo` and `ember opinfo`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ember import config
from ember.tools.opinfo.report import merge, write_report
from ember.tools.opinfo.samples import OUTCOMES
from ember.tools.opinfo.selection import DTYPES
from ember.tools.opinfo.worker import drive, run_worker

# Relative, so a sweep writes under the directory it is run from: never into the installed checkout's
# committed tables (docs/opinfo/) unless `--out` names them.
DEFAULT_OUT = Path("results", "opinfo")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ember opinfo",
        description=sys.modules["ember.tools.opinfo"].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x], default=None, help="names or globs")
    p.add_argument("--skip-ops", type=lambda s: [x for x in s.split(",") if x], default=None)
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"from {','.join(DTYPES)}")
    p.add_argument("--grad-dtypes", default="float32", help="dtypes whose gradients are checked too")
    p.add_argument("--shard", default=None, help="K/N: only the K-th of N contiguous slices of the op list")
    p.add_argument("--limit", type=int, default=None, help="at most this many samples per (op, dtype)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (Triton)")
    p.add_argument(
        "--inplace",
        action="store_true",
        help="the ops' in-place variants (add_, index_put_, ...): result and written input against eager's",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="wall-time limit per (op, dtype)")
    p.add_argument("--out", default=None, help="folder for DEVICE.jsonl and DEVICE.md (default: ./results/opinfo)")
    p.add_argument("--resume", action="store_true", help="keep results already in the JSON lines; run the rest")
    p.add_argument("--rerun-failed", action="store_true", help="re-run only pairs with mismatches, crashes or timeouts")
    p.add_argument("--report", action="store_true", help="only re-render the markdown table")
    p.add_argument("--merge", nargs="+", default=None, help="JSON lines of other runs (shards) to merge in first")
    p.add_argument("--command", default=None, help="the command line to print in the table (e.g. of merged shards)")
    p.add_argument("--in-process", action="store_true", help="no worker process (a segfault ends the sweep)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    out = Path(args.out) if args.out else DEFAULT_OUT
    dev = torch.device(args.device).type
    # A CPU sweep under EMBER_BACKEND=triton (Triton's interpreter) keeps its own tables.
    interpreted = dev == "cpu" and config.get("backend") == "triton"
    stem = dev + ("-triton" if interpreted else "") + ("-inplace" if args.inplace else "")
    args.jsonl = str(out / f"{stem}.jsonl")
    md = out / f"{stem}.md"
    if args.merge:
        merge(Path(args.jsonl), [Path(other) for other in args.merge])
    if args.worker or args.in_process:
        rc = run_worker(args)
        if args.worker:
            return rc
    elif not args.report and not args.merge:
        fresh = not (args.resume or args.rerun_failed or args.ops or args.shard)
        if fresh and Path(args.jsonl).exists():
            Path(args.jsonl).unlink()  # a full fresh sweep starts from nothing
        rc = drive(args, [a for a in argv if a != "--worker"])
        if rc:
            return rc
    command = args.command or "python -m ember.tools.opinfo " + " ".join(
        a for a in argv if a not in ("--report", "--in-process")
    )
    what = dev + (" (Triton's interpreter)" if interpreted else "") + (", in-place variants" if args.inplace else "")
    t = write_report(Path(args.jsonl), md, what, command.strip())
    counted = sum(t[k] for k in OUTCOMES if k != "skipped")
    print(
        f"{counted} samples: {t['match']} match, {t['fallback']} fell back, {t['mismatch']} mismatch, "
        f"{t['crash']} crash, {t['timeout']} timeout ({t['skipped']} skipped by eager) -> {md}"
    )
    return 0
