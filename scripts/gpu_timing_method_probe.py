"""On the GPU: does the harness's timing of a micro workload include host latency?

The harness times a call with `triton.testing.do_bench`: before each call it zeroes a 256 MB
buffer (to flush L2), records a start event, calls, records an end event. The GPU is busy with
the flush for ~0.09 ms while the host prepares the call; if the host takes longer than that to
launch the call's first kernel, the GPU waits and the wait is timed. This times each compiler's
call three ways:

- `do_bench`: as the harness (256 MB flush, median);
- `big_flush`: the same with a 2 GB flush (~0.7 ms of GPU work: hides any host latency);
- `back_to_back`: CUDA events around 50 calls in a row (no flush; the host runs ahead);
- `timer`: the harness's `measure.Timer` (device time with the host hidden, and host time per
  call launched back to back; the larger reported).

If `do_bench` is above `big_flush` for a compiler, the harness measured its host latency too.

    PYTHONPATH=. python scripts/gpu_timing_method_probe.py --workloads softmax,attention --out t.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch._dynamo
import triton.testing

from ember.frontend.backend import register
from ember.tools.bench.measure import Timer
from ember.tools.bench.workloads import WORKLOADS


def flushed_median_ms(fn, flush_bytes: int, reps: int = 100) -> float:
    cache = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        cache.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def back_to_back_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="softmax,attention,linear_bias_gelu,layernorm_residual")
    ap.add_argument("--out", default="timing_method.json")
    args = ap.parse_args()
    register()
    rows = []
    dev = torch.device("cuda")
    timer = Timer(dev)
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        built = w.build(w.sizes["gpu"], dev)
        for compiler in ("eager", "inductor", "ember"):
            torch._dynamo.reset()
            fn = built.fn if compiler == "eager" else torch.compile(built.fn, backend=compiler)

            def call(fn=fn, inputs=built.inputs):
                with torch.no_grad():
                    return fn(*inputs)

            row = {
                "workload": name,
                "compiler": compiler,
                "do_bench": triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"),
                "big_flush": flushed_median_ms(call, 2 << 30),
                "back_to_back": back_to_back_ms(call),
                "timer": timer.median_ms(call),
                "timer_parts": dict(timer.last),
            }
            rows.append(row)
            print(
                f"{name:20} {compiler:9} do_bench {row['do_bench']:.4f}  big_flush {row['big_flush']:.4f}  "
                f"back_to_back {row['back_to_back']:.4f}  Timer {row['timer']:.4f} ms {row['timer_parts']}",
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
