"""The worker: runs the selected pairs one by one under a per-pair alarm, saving JSON lines after each;
its driver restarts it after a hard crash and marks that pair `crash`."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from ember.tools.opinfo.batch import run_pair
from ember.tools.opinfo.comparison import UNINITIALIZED, oneline
from ember.tools.opinfo.samples import OUTCOMES, Sample, SweepTimeout
from ember.tools.opinfo.selection import DTYPES, dtype_name, op_name, pairs, select_ops


def record(op, dtype, device, samples: list[Sample], seconds: float, note: str = "") -> dict:
    counts = collections.Counter(s.outcome for s in samples)
    return {
        "op": op_name(op),
        "dtype": dtype_name(dtype),
        "device": device,
        "samples": len(samples),
        "counts": {k: counts.get(k, 0) for k in OUTCOMES},
        "random": any(s.random for s in samples) or op.name in UNINITIALIZED,
        "seconds": round(seconds, 2),
        "details": [{"i": s.index, "outcome": s.outcome, "reason": s.reason} for s in samples if s.outcome != "match"],
        "note": note,
        "torch": torch.__version__,  # the table names the version that ran, not the one rendering it
    }


@contextlib.contextmanager
def _alarm(seconds: float | None):
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SweepTimeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sweep_pair(op, dtype, device, *, limit=None, grad_dtypes=(torch.float32,), timeout_s=None) -> dict:
    import torch._dynamo

    start = time.perf_counter()
    holder: list[Sample] = []
    note = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with _alarm(timeout_s):
                run_pair(op, dtype, device, limit=limit, grad_dtypes=grad_dtypes, into=holder)
        except SweepTimeout:
            note = f"timed out after {timeout_s:g} s"
        except Exception as e:  # noqa: BLE001  (sample generation itself failed)
            note = f"no samples: {type(e).__name__}: {oneline(str(e))[:200]}"
            holder = []
        finally:
            torch._dynamo.reset()
    for s in holder:
        if s.outcome is None:
            s.outcome, s.reason = "timeout", note
    return record(op, dtype, device, holder, time.perf_counter() - start, note)


def load_records(path: Path) -> dict[tuple[str, str], dict]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[(r["op"], r["dtype"])] = r
    return out


def save_records(path: Path, records: dict[tuple[str, str], dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for _, r in sorted(records.items())))
    os.replace(tmp, path)


def run_worker(args) -> int:
    """Run the selected pairs in this process, saving after each; `inflight` names the current pair."""
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    grad_dtypes = tuple(DTYPES[d] for d in args.grad_dtypes.split(",") if d)
    jsonl = Path(args.jsonl)
    records = load_records(jsonl)
    done = set(records) if args.resume else set()
    if args.rerun_failed:
        done = {k for k, r in records.items() if not any(r["counts"][o] for o in ("mismatch", "crash", "timeout"))}
    ops = select_ops(args.ops, args.skip_ops, args.inplace)
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        ops = ops[(k - 1) * len(ops) // n : k * len(ops) // n]
    todo = [(op, d) for op, d in pairs(ops, dtypes, args.device)]
    todo = [(op, d) for op, d in todo if (op_name(op), dtype_name(d)) not in done]
    if args.rerun_failed:
        todo = [(op, d) for op, d in todo if (op_name(op), dtype_name(d)) in records]
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    inflight = jsonl.with_suffix(".inflight")
    for n, (op, d) in enumerate(todo):
        inflight.write_text(json.dumps({"op": op_name(op), "dtype": dtype_name(d)}))
        r = sweep_pair(op, d, args.device, limit=args.limit, grad_dtypes=grad_dtypes, timeout_s=args.timeout_s)
        records[(r["op"], r["dtype"])] = r
        save_records(jsonl, records)
        c = r["counts"]
        bad = c["mismatch"] + c["crash"] + c["timeout"]
        print(
            f"[{n + 1}/{len(todo)}] {r['op']} {r['dtype']}: {r['samples']} samples, "
            f"{c['match']} match, {c['fallback']} fallback, {c['skipped']} skipped"
            + (f", {bad} BAD" if bad else "")
            + f" ({r['seconds']:.1f} s)",
            flush=True,
        )
    inflight.unlink(missing_ok=True)
    return 0


def drive(args, argv: list[str]) -> int:
    """Run the worker in a child process; a worker that dies marks its pair `crash` and is restarted."""
    jsonl = Path(args.jsonl)
    inflight = jsonl.with_suffix(".inflight")
    for attempt in range(1000):
        cmd = [sys.executable, "-m", "ember.tools.opinfo", *argv, "--worker"]
        if attempt and "--resume" not in cmd:
            cmd.append("--resume")
        rc = subprocess.call(cmd)
        if rc == 0:
            return 0
        if not inflight.exists():
            return rc
        pair = json.loads(inflight.read_text())
        inflight.unlink()
        records = load_records(jsonl)
        records[(pair["op"], pair["dtype"])] = {
            **pair,
            "device": args.device,
            "samples": 0,
            "counts": {k: (1 if k == "crash" else 0) for k in OUTCOMES},
            "random": False,
            "seconds": 0.0,
            "details": [{"i": -1, "outcome": "crash", "reason": f"worker process died (exit status {rc})"}],
            "note": f"worker process died (exit status {rc})",
        }
        save_records(jsonl, records)
        print(f"worker died on {pair['op']} {pair['dtype']} (exit status {rc}); restarting", flush=True)
    return 1
