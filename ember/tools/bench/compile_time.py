"""Compile time as a user meets it: a fresh process, from its start to the first result.

For each case and compiler, two fresh subprocesses run one step and report when its result was
ready: *cold* with empty cache directories for ember (EMBER_CACHE_DIR), Inductor
(TORCHINDUCTOR_CACHE_DIR) and Triton (TRITON_CACHE_DIR), then *warm* with the directories the cold
run filled; with `imported`, a third with empty directories that first imports the file the cold
run exported (ember.save_cache / ember.load_cache; Inductor's mega-cache,
torch.compiler.save_cache_artifacts / load_cache_artifacts), as a new machine of a fleet would. The time is taken from the parent's clock before it starts the process to the child's
clock after the first step synchronized, so Python start-up and imports count. The child also
reports the parts: start-up (interpreter and imports), set-up (building the model and inputs)
and the first step (capture, compile, run), which is what compiling adds over eager, and for
ember the seconds of each pipeline stage over all graphs (`GraphReport.stage_seconds`: backend,
import, cse, pad, split, schedule, cache write, build, host; a cached schedule replaces import
through cache write), and `breakdown`: the first step split into Dynamo, AOTAutograd, the
compiler's stages and the first run (compile_stages.py).

    python -m ember.tools.bench.compile_time WORKLOAD MODE COMPILER SCALE DEVICE [EXPORT_TO [IMPORT_FROM]]   (the child)

Python's bytecode is compiled ahead for every child (`_bytecode_env`), as pip does when it installs a
package: on a machine where Python may not write it (PYTHONDONTWRITEBYTECODE, a read-only
site-packages), each process would compile the source of torch, ember and the rest again, about 7 s of
a 15 s first step on the H100 host, and the modules a compiler imports lazily would charge it to
whichever stage imports them first.

The child alone, under cProfile, shows which functions a compile spends its time in (empty
caches, so the compile is cold):

    EMBER_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
        python -m cProfile -s cumtime -m ember.tools.bench.compile_time resnet50 train ember gpu cuda
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from ember.tools.bench.compilers import compile_fn

_EMBER_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _child(
    workload: str, mode: str, compiler: str, scale: str, device_name: str, export: str = "", imported: str = ""
) -> None:
    """One first step; `export`: a file to export the caches to after it; `imported`: one to import before."""
    t_start = time.time()
    import torch
    from torch._dynamo.utils import compilation_time_metrics

    from ember import stats
    from ember.report import collecting
    from ember.tools.bench.compile_stages import breakdown
    from ember.tools.bench.measure import Step, prepare_inputs, sync
    from ember.tools.bench.workloads import WORKLOADS

    stats.listen_to_triton()
    t_import = time.time()
    if imported:
        _import_cache(compiler, imported)
    t_cache = time.time()
    device = torch.device(device_name)
    w = WORKLOADS[workload]
    torch.manual_seed(0)
    built = w.instance(scale, device, mode)
    inputs = prepare_inputs(built.inputs, mode == "train")
    sync(device)
    t_ready = time.time()
    step = Step(compile_fn(built.fn, compiler), mode == "train", built.autocast, device)
    before = stats.snapshot()
    with collecting() as report:
        step(*inputs)
        sync(device)
    t_first = time.time()
    stages = _stage_seconds(report.graphs)
    metrics = {k: list(v) for k, v in compilation_time_metrics.items()}
    if export:
        _export_cache(compiler, export)
    print(
        "BENCH_RESULT "
        + json.dumps(
            {
                "child_start": t_start,
                "imported": t_import,
                "cache_imported": t_cache,
                "ready": t_ready,
                "first_result": t_first,
                "graphs": len(report.graphs),
                "fallbacks": [g.fallback for g in report.graphs if g.fallback],
                "stages": stages,
                "breakdown": breakdown(t_first - t_ready, metrics, stages, stats.delta(before), compiler),
            }
        ),
        flush=True,
    )


def _export_cache(compiler: str, path: str) -> None:
    """ember: `ember.save_cache`; Inductor: torch's mega-cache (`torch.compiler.save_cache_artifacts`)."""
    if compiler.startswith("ember"):
        import ember

        ember.save_cache(path)
    elif compiler.startswith("inductor"):
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(path, "wb") as f:
                f.write(saved[0])


def _import_cache(compiler: str, path: str) -> None:
    if not os.path.exists(path):
        return
    if compiler.startswith("ember"):
        import ember

        ember.load_cache(path)
    elif compiler.startswith("inductor"):
        import torch

        with open(path, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())


def _stage_seconds(graphs) -> dict[str, float]:
    """Seconds per ember pipeline stage, summed over the graphs (`GraphReport.stage_seconds`)."""
    stages: dict[str, float] = {}
    for g in graphs:
        for name, seconds in g.stage_seconds.items():
            stages[name] = stages.get(name, 0.0) + seconds
    return stages


def _spawn(args: list[str], env: dict, timeout: float) -> dict:
    t0 = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ember.tools.bench.compile_time", *args],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            r = json.loads(line[len("BENCH_RESULT ") :])
            return {
                "seconds": r["first_result"] - t0,
                "startup_s": r["imported"] - t0,
                "cache_import_s": r["cache_imported"] - r["imported"],
                "setup_s": r["ready"] - r["cache_imported"],
                "first_step_s": r["first_result"] - r["ready"],
                "fallbacks": r["fallbacks"],
                "ember_stages_s": r["stages"],
                "breakdown": r["breakdown"],
            }
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)[-300:]}"}


# Packages whose Python source the compilers import, compiled ahead (the workloads' own libraries load at
# start-up and set-up, which the first step does not count).
_PRECOMPILED = ("torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "ember")
_COMPILE_IN_POOL_FROM = 500  # sources without bytecode


def _package_folders() -> list[str]:
    folders = []
    for name in _PRECOMPILED:
        spec = importlib.util.find_spec(name)
        folders += list(spec.submodule_search_locations or []) if spec else []
    return folders


def _bytecode_dir(folder: str, prefix: str | None) -> str:
    """Where Python keeps the bytecode of `folder`'s sources: beside them (`__pycache__`), or under `prefix`
    at the folder's own absolute path (PYTHONPYCACHEPREFIX)."""
    if prefix is None:
        return os.path.join(folder, "__pycache__")
    return os.path.join(prefix, os.path.splitdrive(os.path.abspath(folder))[1].lstrip(os.sep))


def _seed_from_place(folder: str, prefix: str, where: str | None) -> int:
    """Copy the bytecode Python keeps for `folder`'s sources (beside them as pip installs a package, or under
    the user's own prefix `where`) into `prefix`'s tree, where a file of its own is not there yet:
    compileall then finds it current (its header names the source's time and size) and compiles only what
    has none. Returns how many sources have none."""
    missing = 0
    for root, _, files in os.walk(folder):
        kept_dir, target_dir = _bytecode_dir(root, where), _bytecode_dir(root, prefix)
        for f in files:
            if not f.endswith(".py"):
                continue
            cached = os.path.basename(importlib.util.cache_from_source(os.path.join(root, f)))
            kept, target = os.path.join(kept_dir, cached), os.path.join(target_dir, cached)
            if os.path.exists(target):
                continue
            if not os.path.exists(kept):
                missing += 1
                continue
            os.makedirs(target_dir, exist_ok=True)
            try:
                os.link(kept, target)
            except OSError:
                shutil.copyfile(kept, target)
    return missing


def _bytecode_env(env: dict) -> dict:
    """`env` with Python's bytecode kept in a folder of ember's cache (PYTHONPYCACHEPREFIX), which holds
    the bytecode of `_PRECOMPILED` compiled ahead (what the packages keep already copied in first): every
    child, cold or warm, imports compiled modules. compileall runs as a process of its own with the prefix
    in its environment: from Python 3.12 its worker pool starts processes that do not see a prefix set in
    this one, and would write beside the sources."""
    from ember import config

    prefix = os.path.join(config.get("cache_dir"), "bench-pycache")
    env = dict(env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = prefix
    for folder in _package_folders():
        missing = _seed_from_place(folder, prefix, sys.pycache_prefix)
        # A pool of processes where much is left to compile (a package without bytecode kept); else one
        # process, which checks the copied files faster than a pool starts.
        jobs = "0" if missing > _COMPILE_IN_POOL_FROM else "1"
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "-j", jobs, folder], env=env, capture_output=True, check=False
        )
    return env


def _cache_env(base_env: dict, root: str) -> dict:
    env = dict(base_env)
    for var in ("EMBER_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[var] = os.path.join(root, var.lower())
    return env


def measure(
    workload: str,
    mode: str,
    compilers: list[str],
    scale: str,
    device: str,
    timeout: float = 600.0,
    imported: bool = False,
) -> dict[str, dict]:
    """{compiler: {"cold": {...}, "warm": {...}[, "imported": {...}]}} for one case. `imported`: also a
    third fresh process with empty caches that first imports the file the cold run exported
    (ember.save_cache; Inductor's torch.compiler.save_cache_artifacts)."""
    results: dict[str, dict] = {}
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = _EMBER_ROOT + (os.pathsep + base_env["PYTHONPATH"] if base_env.get("PYTHONPATH") else "")
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env = _bytecode_env(base_env)
    for compiler in compilers:
        with tempfile.TemporaryDirectory(prefix="ember-bench-cache-") as root:
            env = _cache_env(base_env, os.path.join(root, "first"))
            args = [workload, mode, compiler, scale, device]
            exported = os.path.join(root, "exported.bin")
            cold = _spawn(args + ([exported] if imported else []), env, timeout)
            results[compiler] = {"cold": cold, "warm": _spawn(args, env, timeout) if "seconds" in cold else cold}
            if imported and "seconds" in cold:
                fresh = _cache_env(base_env, os.path.join(root, "imported"))
                results[compiler]["imported"] = _spawn([*args, "", exported], fresh, timeout)
    return results


if __name__ == "__main__":
    _child(*sys.argv[1:8])
