"""`ember bench --distributed graph`: collectives inside a compiled graph, ember's own scheduling of them measured.

DDP's and FSDP2's collectives run in their hooks, outside the graphs ember compiles; this case puts one in the
graph. The program all-reduces a large tensor through a functional collective and waits on it at once (as Dynamo
traces `wait_tensor(all_reduce(x))`), then computes matrix products that do not need it. In graph order nothing
overlaps; ember under `overlap_collectives` moves the wait past the products. Rows: eager, Inductor, ember in graph
order (`overlap_collectives=False`) and ember as it runs by default, each checked against eager and a float64
run under the float64 rule, timed, and profiled for the communication hidden under compute (overlap.py), in the
same record shape as distributed.run_wrapper's.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from ember.tools.bench import float64_rule, overlap

PRODUCTS = 8


def _program(group: str):
    def program(x, w, big):
        c = torch.ops._c10d_functional
        reduced = c.wait_tensor(c.all_reduce(big * 2, "sum", group))
        h = x
        for _ in range(PRODUCTS):
            h = torch.tanh(h @ w)
        return reduced + 1, h

    return program


def _variants(program, compilers: list[str]) -> dict:
    out = {"eager": lambda: program}
    if "inductor" in compilers:
        out["inductor"] = lambda: torch.compile(program, backend="inductor")
    if "ember" in compilers:
        options = {"overlap_collectives": False}
        out["ember, graph order"] = lambda: torch.compile(program, backend="ember", options=options)
        out["ember"] = lambda: torch.compile(program, backend="ember", options={"overlap_collectives": True})
    return out


def sizes(device: torch.device) -> tuple[int, int]:
    """(n, m): n x n products, an all_reduce of m float32s. GPU: 4096^2 products (~1 ms each), 256 MB."""
    return (4096, 64 << 20) if device.type == "cuda" else (512, 8 << 20)


def run_graph(compilers: list[str], args, device: torch.device) -> dict:

    n, m = sizes(device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(n, n, generator=gen).to(device)
    w = (torch.randn(n, n, generator=gen) / n**0.5).to(device)
    big = torch.randn(m, generator=gen).to(device)
    program = _program(dist.group.WORLD.group_name)
    reference = program(x.double(), w.double(), big.double())
    eager = program(x, w, big)
    record: dict = {"wrapper": "graph", "compilers": {}, "lanes": {}}
    for name, make in _variants(program, compilers).items():
        torch._dynamo.reset()
        entry: dict = {}
        try:
            fn = make()
            overlap.sync(device)
            start = time.perf_counter()
            out = fn(x, w, big)
            overlap.sync(device)
            entry["first_step_s"] = time.perf_counter() - start
            checks = [
                float64_rule.check_tensor(f"output {k}", o, e, r, 1e-4)
                for k, (o, e, r) in enumerate(zip(out, eager, reference))
            ]
            failed = [f"{c.name} ({c.how})" for c in checks if not c.passed]
            entry["accuracy"] = {"status": "mismatch" if failed else "pass", "tensors": len(checks), "failed": failed}
            times = []
            for k in range(args.dist_warmup + args.dist_steps):
                dist.barrier()
                overlap.sync(device)
                start = time.perf_counter()
                fn(x, w, big)
                overlap.sync(device)
                if k >= args.dist_warmup:
                    times.append((time.perf_counter() - start) * 1000)
            entry["ms_rank0"] = statistics.median(times)
            entry["ms"] = overlap.slowest_rank(entry["ms_rank0"])
            record["lanes"][name], _ = overlap.profile_call(functools.partial(fn, x, w, big), device, dist.barrier)
            entry["overlap"] = overlap.summary(record["lanes"][name])
            entry["status"] = entry["accuracy"]["status"]
        except Exception as e:  # noqa: BLE001  (one variant's failure is its row; the others still run)
            entry["status"] = "error"
            entry["error"] = f"{type(e).__name__}: {e}"[:400]
        record["compilers"][name] = entry
    return record
