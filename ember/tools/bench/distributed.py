"""`ember bench --distributed`: training steps under DDP or FSDP2 on N processes, eager vs Inductor vs ember.

    ember bench --distributed ddp,fsdp2 --nproc 2 --dist-workload tiny          # CPU, gloo
    ember bench --distributed ddp,fsdp2 --nproc 1 --dist-workload gpt2 --out DIR  # one GPU, NCCL
    torchrun --nproc-per-node 2 -m ember.tools.bench.distributed --distributed ddp,fsdp2 --dist-workload gpt2

Without torchrun's variables in the environment, the command launches itself under torchrun
(`python -m torch.distributed.run --standalone --nproc-per-node N`); each rank runs on its own GPU
with NCCL, or on the CPU with gloo. Per wrapper (DDP: the whole model compiled, Dynamo's
optimize_ddp splitting it at bucket boundaries; FSDP2: `fully_shard` per block and on the root,
each block compiled, or with --fsdp-compile whole the whole model) and per compiler:

- correctness: the first step's loss and every parameter's full gradient against eager's and a
  float64 reference (the same wrapper in float64, no autocast), under the float64 rule of
  accuracy.py; on the same ranks, each rank checking its own;
- step time: the median of --steps timed steps after --warmup (forward, loss, backward, AdamW),
  the slowest rank's;
- scaling efficiency, on more than one process: each rank also trains the same model wrapped over
  a process group of itself alone (N independent one-GPU jobs at once, same per-rank batch), its
  steps taking turns with the N-process ones; efficiency is its step time over the N-process one.
  Host-bound steps vary by a quarter from one process to the next, so a baseline from another run
  (--dist-baseline) measures the processes as much as the scaling. Every timed step starts at a
  barrier;
- overlap: one step under torch.profiler: how much of the communication ran under compute
  (overlap.py), and a PNG of that step per wrapper (timeline-WRAPPER.png) where matplotlib is.

Rank 0 writes distributed.json (every record) and distributed.md (the table) in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from ember.tools.bench import float64_rule, overlap
from ember.tools.bench.dist_graph import run_graph
from ember.tools.bench.dist_workloads import WORKLOADS, DistWorkload

COMPILERS = ("eager", "inductor", "ember")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--distributed",
        default=None,
        help="what to run (comma-separated): ddp, fsdp2 (training steps under each), graph (a functional all_reduce "
        "inside a compiled graph, with compute that does not need it: ember's own scheduling, dist_graph.py)",
    )
    p.add_argument("--nproc", type=int, default=None, help="processes (default: the GPUs, or 2 on the CPU)")
    p.add_argument("--dist-workload", default=None, help=f"{', '.join(WORKLOADS)} (default: gpt2 on GPUs, else tiny)")
    p.add_argument("--dist-compilers", default=",".join(COMPILERS[1:]), help="beside eager: inductor, ember")
    p.add_argument(
        "--dist-baseline",
        default=None,
        help="distributed.json of a run on fewer processes, same per-rank batch: adds each row's scaling efficiency",
    )
    p.add_argument("--fsdp-compile", default="blocks", choices=["blocks", "whole"], help="FSDP2: what is compiled")
    p.add_argument("--dist-steps", type=int, default=10, help="timed steps")
    p.add_argument("--dist-warmup", type=int, default=3, help="steps before timing (the first compiles)")
    p.add_argument("--dist-dtype", default="auto", choices=["auto", "f32", "bf16"], help="auto: bf16 autocast on GPUs")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ember bench --distributed", description=__doc__)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--out", default=None, help="results folder (default results/dist-DATE-TIME)")
    add_arguments(p)
    return p


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this module under torchrun on --nproc processes, then print rank 0's table."""
    cuda = _device_kind(args) == "cuda"
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 2)
    out = args.out or os.path.join("results", time.strftime("dist-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    rest = _without(argv, "--out", "--nproc")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "ember.tools.bench.distributed", *rest, f"--out={out}"]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)  # ember from a checkout too
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd, env=env, check=False).returncode
    table = os.path.join(out, "distributed.md")
    if os.path.exists(table):
        with open(table) as f:
            print(f.read())
    print(f"results in {out}/ (distributed.json, distributed.md, timeline-*.png)")
    return rc


def _without(argv: list[str], *options: str) -> list[str]:
    """argv less these options and their values (the launcher passes its own --out; torchrun would take
    --nproc for its --nproc-per-node)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(f"{o}=") for o in options):
            out.append(a)
    return out


def _device_kind(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def _wrap(model: torch.nn.Module, workload: DistWorkload, wrapper: str, device: torch.device, group=None):
    """The model under DDP or FSDP2, over `group` (None: every process)."""
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, process_group=group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = None if group is None else DeviceMesh.from_group(group, device.type)
    for block in workload.blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _compile(model: torch.nn.Module, workload: DistWorkload, compiler: str, wrapper: str, how: str):
    """The callable a step runs: the wrapped model, compiled as the wrapper wants."""
    if compiler == "eager":
        return model
    backend = "ember" if compiler == "ember" else "inductor"
    if wrapper == "fsdp2" and how == "blocks":
        for block in workload.blocks(model):
            block.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


class _Trainer:
    """One wrapped, compiled model and its optimizer, stepping over a workload's batches."""

    def __init__(self, base, workload, wrapper, compiler, args, device, dtype, autocast, group=None):
        model = copy.deepcopy(base).to(device=device, dtype=dtype)
        self.model = _wrap(model, workload, wrapper, device, group)
        self.run = _compile(self.model, workload, compiler, wrapper, args.fsdp_compile)
        self.workload, self.device, self.autocast = workload, device, autocast
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)

    def forward_backward(self, step: int) -> torch.Tensor:
        rank = dist.get_rank()
        x, y = self.workload.batch(step, rank, self.device)
        if x.is_floating_point():
            x, y = x.to(next(self.model.parameters()).dtype), y.to(next(self.model.parameters()).dtype)
        ctx = torch.autocast(self.device.type, torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            loss = self.workload.loss(self.run(x), y)
        loss.backward()
        return loss.detach()

    def step(self, step: int) -> None:
        self.forward_backward(step)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def gradients(self) -> list[torch.Tensor]:
        """Every parameter's whole gradient (FSDP2's are sharded DTensors: gathered)."""
        out = []
        for p in self.model.parameters():
            grad = torch.zeros_like(p) if p.grad is None else p.grad  # a parameter the loss does not reach
            out.append((grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone())
        return out


def _timed_steps(trainers: list[_Trainer], first: int, count: int, device: torch.device) -> list[list[float]]:
    """Milliseconds of `count` steps of each trainer, taking turns step by step, so a drift of the
    host or the device over the run falls on every trainer alike. Every step starts at a barrier:
    a rank that finished the step before sooner would otherwise wait for the others inside this one
    (at its first collective), and that wait would count as this step's time."""
    times: list[list[float]] = [[] for _ in trainers]
    for k in range(count):
        for trainer, out in zip(trainers, times):
            dist.barrier()
            overlap.sync(device)
            start = time.perf_counter()
            trainer.step(first + k)
            overlap.sync(device)
            out.append((time.perf_counter() - start) * 1000)
    return times


def _checks(name_grads, compiled, eager, ref, tol) -> dict:
    """The float64 rule over the loss and every gradient: how many pass, the first failures."""
    checks = [float64_rule.check_tensor(n, c, e, r, tol) for n, c, e, r in zip(name_grads, compiled, eager, ref)]
    failed = [c for c in checks if not c.passed]
    return {
        "status": "pass" if not failed else "mismatch",
        "tensors": len(checks),
        "failed": [f"{c.name} ({c.how}: rmse {c.compiled_rmse:.3g} vs bound {c.bound:.3g})" for c in failed[:5]],
    }


def _time_with_alone_baseline(trainer: _Trainer, make_alone, entry: dict, args, device) -> list[float]:
    """The N-process trainer's step times, in turns with the same model trained on each rank alone
    (`make_alone()`, wrapped over the rank's process group of itself): the baseline of weak scaling,
    into `entry["alone_ms"]` (the slowest rank's median). Where the lone copy cannot be built or
    stepped (an FSDP2 model that fits only sharded, say), the N-process steps are timed without it
    and `entry["alone_error"]` says why."""
    alone = None
    try:
        alone = make_alone()
        for k in range(args.dist_warmup):
            alone.step(1 + k)
        ok = True
    except Exception as e:  # noqa: BLE001  (the scaling figure is lost, not the row)
        entry["alone_error"] = f"{type(e).__name__}: {e}"[:300]
        ok = False
    if not overlap.across_ranks(float(ok), dist.ReduceOp.MIN):  # every rank takes the same branch
        alone = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        (times,) = _timed_steps([trainer], 1 + args.dist_warmup, args.dist_steps, device)
        return times
    times, alone_times = _timed_steps([trainer, alone], 1 + args.dist_warmup, args.dist_steps, device)
    entry["alone_ms"] = overlap.slowest_rank(statistics.median(alone_times))
    return times


def run_wrapper(workload: DistWorkload, wrapper: str, compilers: list[str], args, device, alone_group=None) -> dict:
    """One wrapper: every compiler's first step checked, its steps timed, one step profiled; with
    `alone_group` (each rank's process group of itself), its scaling from one process too."""
    from ember.report import collecting

    autocast = args.dist_dtype == "bf16" or (args.dist_dtype == "auto" and device.type == "cuda")
    torch.manual_seed(0)
    base = workload.build()
    names = ["loss"] + [n for n, _ in base.named_parameters()]
    ref_trainer = _Trainer(base, workload, wrapper, "eager", args, device, torch.float64, False)
    reference = [ref_trainer.forward_backward(0)] + ref_trainer.gradients()
    del ref_trainer
    tol = 1e-2 if autocast else 1e-3
    record: dict = {"wrapper": wrapper, "compilers": {}}
    lanes: dict = {}
    eager_values = None
    for compiler in ["eager", *compilers]:
        torch._dynamo.reset()
        entry: dict = {}
        try:
            trainer = _Trainer(base, workload, wrapper, compiler, args, device, torch.float32, autocast)
            start = time.perf_counter()
            with collecting() as report:
                values = [trainer.forward_backward(0)] + trainer.gradients()
                trainer.opt.zero_grad(set_to_none=True)
            entry["first_step_s"] = time.perf_counter() - start
            if compiler == "ember":
                entry["graphs"] = len(report.graphs)
                entry["fallbacks"] = [g.fallback for g in report.graphs if g.fallback]
                entry["collectives"] = [c for g in report.graphs for c in g.collectives]
            if compiler == "eager":
                eager_values = values
            entry["accuracy"] = _checks(names, [v.float() for v in values], eager_values, reference, tol)
            del values
            for k in range(args.dist_warmup):
                trainer.step(1 + k)
            if alone_group is None:
                (times,) = _timed_steps([trainer], 1 + args.dist_warmup, args.dist_steps, device)
            else:
                make_alone = functools.partial(
                    _Trainer, base, workload, wrapper, compiler, args, device, torch.float32, autocast, alone_group
                )
                times = _time_with_alone_baseline(trainer, make_alone, entry, args, device)
            entry["ms"] = overlap.slowest_rank(statistics.median(times))
            if "alone_ms" in entry:
                entry["scaling"] = {
                    "from": 1,
                    "baseline_ms": entry["alone_ms"],
                    "efficiency": entry["alone_ms"] / entry["ms"],
                }
            entry["ms_rank0"] = statistics.median(times)
            entry["ms_range_rank0"] = [min(times), max(times)]
            lanes[compiler], entry["kernels"] = overlap.profile_call(
                functools.partial(trainer.step, 1 + args.dist_warmup + args.dist_steps), device, dist.barrier
            )
            entry["overlap"] = overlap.summary(lanes[compiler])
            entry["status"] = entry["accuracy"]["status"]
        except Exception as e:  # noqa: BLE001  (one compiler's failure is its row; the others still run)
            entry["status"] = "error"
            entry["error"] = f"{type(e).__name__}: {e}"[:400]
        finally:
            trainer = None  # freed before the next compiler's model is built
        record["compilers"][compiler] = entry
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record["lanes"] = lanes
    return record


def environment(workload: DistWorkload, device: torch.device, args) -> dict:
    return {
        "type": "env",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "torch": torch.__version__,
        "workload": f"{workload.name}: {workload.describe}",
        "fsdp_compile": args.fsdp_compile,
        "steps": args.dist_steps,
        "warmup": args.dist_warmup,
        "autocast_bf16": args.dist_dtype == "bf16" or (args.dist_dtype == "auto" and device.type == "cuda"),
    }


def markdown(env: dict, records: list[dict], command: str) -> str:
    lines = [
        f"# Distributed training steps: {env['workload']}",
        "",
        (
            f"{env['date']}, {env['world_size']} x {env['device']} ({env['backend']}), torch {env['torch']}, "
            f"bf16 autocast {'on' if env['autocast_bf16'] else 'off'}, FSDP2 compiles {env['fsdp_compile']}; "
            f"median of {env['steps']} steps after {env['warmup']}, the slowest rank's."
        ),
        "",
        f"Command: `{command}`",
        "",
    ]
    scaled = {c["scaling"]["from"] for r in records for c in r["compilers"].values() if c.get("scaling")}
    extra = "".join(f" scaling from {n} |" for n in sorted(scaled))
    lines += [
        "| wrapper | compiler | step ms | vs eager | vs Inductor | first step s | float64 rule | comm ms "
        "| hidden under compute | exposed comm ms |" + extra,
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|" + "---:|" * len(scaled),
    ]
    for r in records:
        eager = r["compilers"].get("eager", {}).get("ms")
        inductor = r["compilers"].get("inductor", {}).get("ms")
        for comp, c in r["compilers"].items():
            if c.get("status") == "error":
                lines.append(f"| {r['wrapper']} | {comp} | error: {c['error'][:120]} | | | | | | | |")
                continue
            ov = c.get("overlap", {})
            acc = c.get("accuracy", {})
            verdict = f"{acc.get('status')} ({acc.get('tensors')} tensors)"
            if c.get("fallbacks"):
                verdict += f"; {len(c['fallbacks'])} graphs ran eagerly"
            hidden = ov.get("hidden")
            lines.append(
                f"| {r['wrapper']} | {comp} | {c['ms']:.2f} | {_ratio(eager, c['ms'])} | {_ratio(inductor, c['ms'])} "
                f"| {c['first_step_s']:.1f} | {verdict} | {ov.get('comm_ms', 0):.2f} "
                f"| {'n/a' if hidden is None else f'{hidden:.0%}'} | {ov.get('exposed_comm_ms', 0):.2f} |"
                + (f" {c['scaling']['efficiency']:.0%} |" if c.get("scaling") else " |" * len(scaled))
            )
    lines += ["", "vs eager / vs Inductor: their step time over this row's (above 1: this row is faster)."]
    if scaled:
        lines.append(
            "Scaling from N: the same wrapper and compiler's step time on N processes (same per-rank batch) over "
            "this row's; 100% is perfect weak scaling."
        )
    failed = [
        f"{r['wrapper']}/{c}: {v['accuracy']['failed']}"
        for r in records
        for c, v in r["compilers"].items()
        if v.get("accuracy", {}).get("failed")
    ]
    if failed:
        lines += ["", "Tensors outside the float64 rule:", *[f"- {f}" for f in failed]]
    return "\n".join(lines) + "\n"


def _ratio(base: float | None, ms: float) -> str:
    return f"{base / ms:.2f}x" if base and ms else ""


def worker(args: argparse.Namespace, argv: list[str]) -> int:
    cuda = _device_kind(args) == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    # torch.compile finds "ember" by name through the installed package's entry point; a checkout run
    # from its folder (PYTHONPATH) has none, so the worker registers the name itself.
    from ember.frontend.backend import register

    register()
    try:
        workload = WORKLOADS[args.dist_workload or ("gpt2" if cuda else "tiny")]
        compilers = [c.strip() for c in args.dist_compilers.split(",") if c.strip()]
        alone_group = None
        if dist.get_world_size() > 1 and not args.dist_baseline:
            alone_group, _ = dist.new_subgroups(group_size=1)
        env = environment(workload, device, args)
        records = [
            run_graph(compilers, args, device)
            if w.strip() == "graph"
            else run_wrapper(workload, w.strip(), compilers, args, device, alone_group)
            for w in args.distributed.split(",")
        ]
        if dist.get_rank() == 0:
            _write(env, records, args.out or ".", argv, args.dist_baseline)
    finally:
        dist.destroy_process_group()
    bad = [c for r in records for c in r["compilers"].values() if c.get("status") != "pass"]
    return 1 if bad else 0


def add_scaling(records: list[dict], baseline_path: str) -> None:
    """Each entry's scaling efficiency against the same wrapper and compiler in a run on fewer processes."""
    with open(baseline_path) as f:
        base = json.load(f)
    procs = base["env"]["world_size"]
    times = {(r["wrapper"], comp): c.get("ms") for r in base["records"] for comp, c in r["compilers"].items()}
    for r in records:
        for comp, c in r["compilers"].items():
            before = times.get((r["wrapper"], comp))
            if before and c.get("ms"):
                c["scaling"] = {"from": procs, "baseline_ms": before, "efficiency": before / c["ms"]}


def _write(env: dict, records: list[dict], out: str, argv: list[str], baseline: str | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    if baseline:
        add_scaling(records, baseline)
    command = "ember bench " + " ".join([*_without(argv, "--out"), f"--nproc {env['world_size']}"])
    notes = []
    for r in records:
        title = f"{env['workload']}, {r['wrapper']}, rank 0 of {env['world_size']} x {env['device']}"
        note = overlap.timeline_png(r["lanes"], os.path.join(out, f"timeline-{r['wrapper']}.png"), title)
        if note:
            notes.append(note)
    with open(os.path.join(out, "distributed.json"), "w") as f:
        json.dump({"env": env, "records": [{k: v for k, v in r.items() if k != "lanes"} for r in records]}, f, indent=1)
    with open(os.path.join(out, "distributed.md"), "w") as f:
        f.write(markdown(env, records, command) + "".join(f"\nNote: {n}\n" for n in dict.fromkeys(notes)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, _ = _parser().parse_known_args(argv)  # `ember bench`'s other options do not apply
    if not args.distributed:
        args.distributed = "ddp,fsdp2"
    missing = [w for w in args.distributed.split(",") if w.strip() not in ("ddp", "fsdp2", "graph")]
    if missing:
        raise SystemExit(f"--distributed: unknown wrapper(s) {missing}: ddp, fsdp2, graph")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(args, argv)
    return launch(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
