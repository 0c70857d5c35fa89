"""Where the bench's `attention` row loses 7 µs to Inductor with the same cuDNN kernel (session 12).

The harness times each call between two events after a flush and a sleep (`measure.Timer._gpu_ms`).
Under the profiler both compilers run the same cuDNN kernel for the same time, yet ember's event
interval is ~7 µs longer. This probe repeats the harness's loop under torch.profiler and splits the
interval: from the start event to the first kernel, between the kernels, from the last kernel to the
end event, and lists the CUDA runtime calls each call makes (a synchronizing call or a cudaMalloc
inside the interval would leave the device idle while the host catches up).

    python scripts/gpu_attention_gap_probe.py [--workload attention] [--reps 50]

Writes $OUT/attention_gap.json (or ./gpu_attention_gap_out) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
import torch._dynamo

import ember  # noqa: F401
from ember.tools.bench import compile_time, measure
from ember.tools.bench.workloads import WORKLOADS


def _events_us(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def _split(trace_path: str, reps: int) -> dict:
    with open(trace_path) as f:
        events = _events_us(json.load(f))
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    sleeps = [e for e in gpu if "spin" in e["name"].lower() or "sleep" in e["name"].lower()]
    runtime = sorted(
        (e for e in events if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"), key=lambda e: e["ts"]
    )
    rows = []
    for i, sleep in enumerate(sleeps):
        end_of_sleep = sleep["ts"] + sleep["dur"]
        nxt = sleeps[i + 1]["ts"] if i + 1 < len(sleeps) else float("inf")
        # the flush (a fill kernel) precedes the next sleep: the call's kernels are those between
        # this sleep's end and the next fill
        inside = [
            e
            for e in gpu
            if end_of_sleep <= e["ts"] < nxt and "fill" not in e["name"].lower() and "FillFunctor" not in e["name"]
        ]
        if not inside:
            continue
        first, last = inside[0], inside[-1]
        rows.append(
            {
                "sleep_end_to_first_us": first["ts"] - end_of_sleep,
                "first_to_last_end_us": last["ts"] + last["dur"] - first["ts"],
                "kernels": [(e["name"][:60], round(e["dur"], 2)) for e in inside],
                "gaps_us": [round(b["ts"] - (a["ts"] + a["dur"]), 2) for a, b in itertools.pairwise(inside)],
            }
        )
    calls = {}
    for e in runtime:
        calls[e["name"]] = calls.get(e["name"], 0) + 1
    return {
        "rows": rows[1:],
        "median_sleep_end_to_first_us": statistics.median(r["sleep_end_to_first_us"] for r in rows[1:]),
        "median_first_to_last_end_us": statistics.median(r["first_to_last_end_us"] for r in rows[1:]),
        "runtime_calls_per_rep": {k: v / max(1, len(rows)) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="attention")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "gpu_attention_gap_out")
    os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda")
    w = WORKLOADS[args.workload]
    torch.manual_seed(0)
    built = w.instance("gpu", device, "inference")
    inputs = measure.prepare_inputs(built.inputs, False)
    steps = {
        c: measure.Step(compile_time.compile_fn(built.fn, c), False, built.autocast, device)
        for c in ("ember", "inductor")
    }
    timer = measure.Timer(device)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "workload": args.workload}
    # 1. the harness's number, three alternating rounds
    for name, step in steps.items():
        step(*inputs)
    harness = {n: [] for n in steps}
    for _ in range(3):
        for name, step in steps.items():
            timer.median_ms(lambda s=step: s(*inputs))
            harness[name].append(timer.last)
    result["harness"] = harness
    # 2. the same loop under the profiler
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)
    for name, step in steps.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        pairs = []
        path = os.path.join(out_dir, f"trace_{name}.json")
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(args.reps):
                flush.zero_()
                torch.cuda._sleep(2_000_000)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(*inputs)
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        split = _split(path, args.reps)
        split["event_us_median"] = statistics.median(s.elapsed_time(e) * 1000 for s, e in pairs)
        split["cpu_ops"] = [
            (e.key, e.count // args.reps, round(e.cpu_time_total / args.reps, 1))
            for e in prof.key_averages()
            if e.key.startswith("aten::") or "cudnn" in e.key.lower()
        ][:25]
        split["rows"] = split["rows"][:3]
        result[name] = split
        os.remove(path)
    with open(os.path.join(out_dir, "attention_gap.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name in steps:
        r = result[name]
        print(
            f"{name:9s} harness device ms {[round(p['device_ms'], 4) for p in harness[name]]}  "
            f"events {r['event_us_median']:.1f} µs  sleep→first {r['median_sleep_end_to_first_us']:.1f}  "
            f"first→last {r['median_first_to_last_end_us']:.1f}"
        )
        print("   kernels", r["rows"][0]["kernels"], "gaps", r["rows"][0]["gaps_us"])
        print("   runtime", dict(list(r["runtime_calls_per_rep"].items())[:10]))
        print("   cpu ops", r["cpu_ops"][:12])


if __name__ == "__main__":
    main()
