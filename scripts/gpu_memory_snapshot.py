"""On the GPU: what is alive at the peak of one call, ember against eager.

    PYTHONPATH=. python scripts/gpu_memory_snapshot.py --workloads hf_bert [--train] [--out peak.json]

For each workload and runner (eager, ember), one warm call runs under the CUDA caching
allocator's history recorder (`torch.cuda.memory._record_memory_history`). Replaying its
allocations and frees gives the moment of the peak (over what was allocated before the call, as
the bench's peak column) and the blocks alive then, each with the frames that allocated it: for
ember, a line of the generated host program (`<ember host program>`), whose source is saved
beside, so the buffer can be named. Also ember's planned peak and eager's, from the memory plan.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from ember.codegen import host
from ember.frontend.backend import ember_backend
from ember.report import collecting
from ember.tools.bench.workloads import WORKLOADS

_SOURCES: list[str] = []
_INIT = host.HostProgram.__init__


def _recording_init(self, source, namespace):
    _SOURCES.append(source)
    _INIT(self, source, namespace)


host.HostProgram.__init__ = _recording_init


def _call(fn, inputs, autocast, train: bool):
    ctx = torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    if train:
        with ctx:
            out = fn(*inputs)
        out.float().mean().backward()
        return None
    with torch.no_grad(), ctx:
        return fn(*inputs)


def _frames(event) -> list[str]:
    """The interesting frames of an allocation: ember's host program and the model's Python."""
    keep = []
    for f in event.get("frames", []):
        name = f.get("filename", "")
        if "ember host program" in name or ("/torch/" not in name and "site-packages/torch" not in name):
            keep.append(f"{name}:{f.get('line')}:{f.get('name')}")
    return keep[:4]


def _peak(trace: list[dict]) -> dict:
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    blocks = sorted(at_peak, key=lambda e: -e["size"])
    return {
        "peak_mb": peak / 1e6,
        "blocks": [{"mb": round(b["size"] / 1e6, 2), "frames": _frames(b)} for b in blocks[:40]],
        "blocks_alive": len(blocks),
    }


def _measure(fn, inputs, autocast, train: bool) -> dict:
    for _ in range(2):
        _call(fn, inputs, autocast, train)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
    _call(fn, inputs, autocast, train)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return _peak(snapshot["device_traces"][0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="hf_bert")
    p.add_argument("--train", action="store_true")
    p.add_argument("--out", default="memory_snapshot.json")
    args = p.parse_args()
    mode = "train" if args.train else "inference"
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "mode": mode}
    for name in args.workloads.split(","):
        built = WORKLOADS[name].instance("gpu", torch.device("cuda"), mode)
        row = {"eager": _measure(built.fn, built.inputs, built.autocast, args.train)}
        torch._dynamo.reset()
        _SOURCES.clear()
        fn = torch.compile(built.fn, backend=ember_backend)
        with collecting() as report:
            row["ember"] = _measure(fn, built.inputs, built.autocast, args.train)
        row["ember"]["plans"] = [g.memory for g in report.graphs]
        row["ember"]["host_programs"] = list(_SOURCES)
        results[name] = row
        print(name, {k: v["peak_mb"] for k, v in row.items()}, row["ember"]["plans"], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
