"""`ember opinfo` / `python -m ember.tools.opinfo`: ember against eager on PyTorch's OpInfo database.

    python -m ember.tools.opinfo                                  # every op, every dtype, CPU
    python -m ember.tools.opinfo --ops add,nn.functional.gelu --dtypes float32,bfloat16
    python -m ember.tools.opinfo --resume                         # go on where an earlier run stopped
    python -m ember.tools.opinfo --rerun-failed                   # only (op, dtype) pairs that failed
    python -m ember.tools.opinfo --device cuda                    # the GPU sweep (Triton)
    python -m ember.tools.opinfo --report                         # re-render the table from the JSON lines

Every sample input of `op_db` (torch.testing._internal.common_methods_invocations) runs through
`torch.compile(backend="ember")` in float32, bfloat16, float16, int64 and bool where the op
supports the dtype, forward, and gradients (float32) where the op supports autograd. Each sample
ends as one outcome:

  match      compiled equals eager (the rule below); graphs whose ops all ran as externs count
             here too, since they ran through ember
  fallback   ember declined a graph on purpose and said why (GraphReport.fallback from a
             GraphUnsupported or NotImplementedError), or Dynamo captured no graph at all (the op
             never reached ember)
  skipped    eager itself raises on the sample: not counted in the totals
  mismatch   compiled and eager disagree: a bug
  crash      the compiled call raised, the worker process died, or ember's fail-safe caught an
             error that is not a deliberate decline (ZeroDivisionError, a C++ compile error, ...): a bug
  timeout    the (op, dtype) pair ran past --timeout-s: its unfinished samples

Comparison rule (documented in docs/opinfo/README.md): integers and bools exactly; floats first by
torch.testing.assert_close's default tolerances for the dtype (NaN equal to NaN). A float output
that fails that is compared against a reference run in higher precision (float64 for float32,
float32 for bfloat16/float16, inputs upcast): compiled error <= F x eager error + atol x max(1, |ref|)
with F = 2 (float32) or 3 (low precision), atol = 1e-5 (float32) or the dtype's eps; non-finite
values must sit where eager's or the reference's do. Ops whose eager outputs differ between two
seeds (random ops) and ops returning uninitialized memory are compared by shape and dtype only.

Speed: one Dynamo graph (fullgraph) per (op, dtype) runs all its samples, so one C++ translation
unit is compiled for them; only when that batch fails, falls back or breaks the graph are the
samples re-run one by one to attribute the outcome. The sweep runs in a worker process that is
restarted after a hard crash (a segfault becomes that pair's `crash`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fnmatch
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
}
OUTCOMES = ("match", "fallback", "skipped", "mismatch", "crash", "timeout")
# Worse outcomes win when a sample's forward and backward disagree.
_RANK = {"match": 0, "fallback": 1, "timeout": 2, "mismatch": 3, "crash": 4}
# Reference precision for the second comparison, and the rule's factor and atol.
_REF_DTYPE = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}
_FACTOR = {torch.float32: 2.0, torch.bfloat16: 3.0, torch.float16: 3.0}
_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# Ops whose outputs are uninitialized memory: eager's values mean nothing, compared by shape/dtype.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "opinfo"


class SweepTimeout(BaseException):
    """Raised by the per-pair alarm; a BaseException so that ember's own fail-safe does not catch it."""


@dataclass
class Sample:
    index: int
    case: tuple  # (input, args, kwargs), tensors are the original sample's
    process_grad: Any = None
    eager: Any = None
    eager_grads: list | None = None  # None: no gradient check for this sample
    grad_inputs: list = field(default_factory=list)  # positions (in flattened case) of grad leaves
    random: bool = False
    outcome: str | None = None
    reason: str = ""

    def finish(self, outcome: str, reason: str = "") -> None:
        if self.outcome is None or _RANK.get(outcome, 0) > _RANK.get(self.outcome, 0):
            self.outcome, self.reason = outcome, reason[:400]


# -- copying inputs and comparing outputs ------------------------------------------------------


def _copy_tensor(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh leaf with x's values and, unless the dtype changes, x's exact layout (strides, offset)."""
    if dtype is not None and dtype != x.dtype:
        y = x.detach().to(dtype)
    elif x.layout != torch.strided or x.numel() == 0:
        y = x.detach().clone()
    else:
        storage = x.untyped_storage().nbytes() // x.element_size()
        flat = torch.empty(storage, dtype=x.dtype, device=x.device)
        flat.copy_(x.detach().as_strided((storage,), (1,), 0))
        y = flat.as_strided(x.shape, x.stride(), x.storage_offset())
    return y.detach().requires_grad_(x.requires_grad and (y.dtype.is_floating_point or y.dtype.is_complex))


def _copy_case(case, upcast_from: torch.dtype | None = None, upcast_to: torch.dtype | None = None):
    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        return _copy_tensor(x, upcast_to if upcast_from is not None and x.dtype == upcast_from else None)

    return pytree.tree_map(one, case)


def _leaves(out) -> list:
    return pytree.tree_leaves(out)


def _grad_leaves(case) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(case) if isinstance(x, torch.Tensor) and x.requires_grad]


def _cotangents(outs: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    cots = []
    for o in outs:
        c = torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype=o.dtype, device=o.device)
        cots.append(c)
    return cots


def _diff_outputs(out) -> list[torch.Tensor]:
    return [o for o in _leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point]


def compare(actual, expected, ref_fn=None, dtype: torch.dtype | None = None, what: str = "output") -> str | None:
    """None if `actual` matches `expected` (trees of tensors and scalars), else why not.

    ref_fn() lazily gives the same tree computed in higher precision, for the second rule.
    """
    a_leaves, e_leaves = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return f"{what}: {len(a_leaves)} values, eager {len(e_leaves)}"
    ref_leaves = None
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        name = f"{what}[{k}]" if len(a_leaves) > 1 else what
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"{name}: {type(a).__name__}, eager a tensor"
            if a.shape != e.shape:
                return f"{name}: shape {tuple(a.shape)}, eager {tuple(e.shape)}"
            if a.dtype != e.dtype:
                return f"{name}: dtype {a.dtype}, eager {e.dtype}"
            if a.device != e.device:
                return f"{name}: device {a.device}, eager {e.device}"
            try:
                torch.testing.assert_close(a, e, equal_nan=True, check_stride=False)
                continue
            except AssertionError as err:
                first = str(err).strip()
            if not e.dtype.is_floating_point or ref_fn is None:
                return f"{name}: {_oneline(first)}"
            if ref_leaves is None:
                try:
                    ref_leaves = pytree.tree_leaves(ref_fn())
                except Exception as ex:  # noqa: BLE001  (the op rejects the upcast inputs)
                    return f"{name}: {_oneline(first)} (no reference: {type(ex).__name__})"
            r = ref_leaves[k] if k < len(ref_leaves) else None
            why = _against_reference(a, e, r, e.dtype)
            if why is not None:
                return f"{name}: {why}; first check: {_oneline(first)}"
        elif isinstance(e, float) and isinstance(a, float):
            if not (a == e or (math.isnan(a) and math.isnan(e)) or math.isclose(a, e, rel_tol=1.3e-6, abs_tol=1e-5)):
                return f"{name}: {a!r}, eager {e!r}"
        elif a != e and not (isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor)):
            return f"{name}: {a!r}, eager {e!r}"
    return None


def _against_reference(a: torch.Tensor, e: torch.Tensor, r, dtype: torch.dtype) -> str | None:
    if not isinstance(r, torch.Tensor) or r.shape != a.shape or dtype not in _FACTOR:
        return "no reference to compare with"
    a64, e64, r64 = (t.detach().to("cpu", torch.float64) for t in (a, e, r))
    a_bad, e_bad, r_bad = ~torch.isfinite(a64), ~torch.isfinite(e64), ~torch.isfinite(r64)

    def same_nonfinite(x, y):
        return (torch.isnan(x) & torch.isnan(y)) | (torch.isinf(x) & (x == y))

    bad = a_bad & ~(same_nonfinite(a64, e64) | same_nonfinite(a64, r64))
    if bad.any():
        return f"{int(bad.sum())} non-finite values where eager and the reference have none"
    # Where the reference is not finite but compiled and eager agree, nothing more to compare.
    finite = ~a_bad & ~e_bad & ~r_bad
    if not finite.any():
        return None
    c_err = (a64 - r64)[finite].abs().max().item()
    e_err = (e64 - r64)[finite].abs().max().item()
    scale = max(1.0, r64[finite].abs().max().item())
    bound = _FACTOR[dtype] * e_err + _ATOL[dtype] * scale
    if c_err <= bound:
        return None
    return f"error vs {r.dtype} reference {c_err:.3g} > {_FACTOR[dtype]:g} x eager's {e_err:.3g} + {_ATOL[dtype] * scale:.3g}"


def _oneline(s: str) -> str:
    return " ".join(s.split())[:300]


def _structure(out) -> list:
    return [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in _leaves(out)]


# -- running one (op, dtype) -----------------------------------------------------------------------


def _call(op, case):
    inp, args, kwargs = case
    return op(inp, *args, **kwargs)


def _eager(op, s: Sample, want_grad: bool, seed: int) -> None:
    """Eager result (and gradients), and whether the op is random (another seed, another result)."""
    case = _copy_case(s.case)
    torch.manual_seed(seed)
    out = _call(op, case)
    if s.process_grad is not None and want_grad:
        out_g = s.process_grad(out)
    else:
        out_g = out
    s.eager = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
    if want_grad:
        outs, leaves = _diff_outputs(out_g), _grad_leaves(case)
        if outs and leaves:
            try:
                grads = torch.autograd.grad(outs, leaves, _cotangents(outs, seed), allow_unused=True)
                s.eager_grads = [g.detach() if g is not None else None for g in grads]
            except Exception:  # noqa: BLE001
                s.eager_grads = None  # eager cannot differentiate this sample: forward only
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        again = _call(op, _copy_case(s.case))
    if compare(again, s.eager) is not None:
        s.random = True


def _reference(op, s: Sample, dtype: torch.dtype, grads: bool, seed: int):
    """Outputs (or gradients) of the sample in higher precision."""
    ref_dtype = _REF_DTYPE[dtype]
    case = _copy_case(s.case, upcast_from=dtype, upcast_to=ref_dtype)
    torch.manual_seed(seed)
    out = _call(op, case)
    if not grads:
        return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
    out_g = s.process_grad(out) if s.process_grad is not None else out
    outs, leaves = _diff_outputs(out_g), _grad_leaves(case)
    cots = [c.to(o.dtype) for c, o in zip(_cotangents([o.to(dtype) for o in outs], seed), outs)]
    return list(torch.autograd.grad(outs, leaves, cots, allow_unused=True))


class _Runner:
    """Compiles a function that runs some samples, and checks them."""

    def __init__(self, op, dtype: torch.dtype, device: str, seed: int):
        self.op, self.dtype, self.device, self.seed = op, dtype, device, seed

    def run(self, samples: list[Sample], fullgraph: bool) -> tuple[list, list, Any]:
        """Compiled outputs and gradients of each sample, and the collected ember reports."""
        import torch._dynamo

        from ember.report import collecting

        op = self.op
        cases = [_copy_case(s.case) for s in samples]

        def run_samples():
            return [op(c[0], *c[1], **c[2]) for c in cases]

        torch._dynamo.reset()
        compiled = torch.compile(run_samples, backend="ember", dynamic=False, fullgraph=fullgraph)
        with collecting() as report:
            torch.manual_seed(self.seed)
            outs = compiled()
            grads: list = [None] * len(samples)
            all_outs, all_cots, all_leaves, spans = [], [], [], []
            for k, (s, out, case) in enumerate(zip(samples, outs, cases)):
                if s.eager_grads is None:
                    continue
                out_g = s.process_grad(out) if s.process_grad is not None else out
                d_outs, leaves = _diff_outputs(out_g), _grad_leaves(case)
                spans.append((k, len(all_leaves), len(leaves)))
                all_outs += d_outs
                all_cots += _cotangents(d_outs, self.seed)
                all_leaves += leaves
            if all_outs and all_leaves:
                flat = torch.autograd.grad(all_outs, all_leaves, all_cots, allow_unused=True)
                for k, start, n in spans:
                    grads[k] = list(flat[start : start + n])
        outs = [pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, o) for o in outs]
        return outs, grads, report

    def check(self, s: Sample, out, grads) -> str | None:
        if s.random or self.op.name in UNINITIALIZED:
            if _structure(out) != _structure(s.eager):
                return f"output structure {_structure(out)}, eager {_structure(s.eager)}"
            return None
        ref_fn = (lambda: _reference(self.op, s, self.dtype, False, self.seed)) if self.dtype in _REF_DTYPE else None
        why = compare(out, s.eager, ref_fn, self.dtype)
        if why is not None or s.eager_grads is None:
            return why
        if grads is None:
            return "no gradients from the compiled call"
        gref = (lambda: _reference(self.op, s, self.dtype, True, self.seed)) if self.dtype in _REF_DTYPE else None
        e_grads = [torch.zeros(0) if g is None else g for g in s.eager_grads]
        a_grads = [torch.zeros(0) if g is None else g.detach() for g in grads]
        return compare(a_grads, e_grads, gref, self.dtype, what="grad")


# Samples run alone before a batch that reached ember with no graph settles the rest as `fallback`.
SHORTCUT_PROBES = 8


def _no_graph_shortcut(runner: _Runner, todo: list[Sample]) -> list[Sample]:
    """After a failed fullgraph batch: if Dynamo hands ember no graph at all for the batch (data-dependent
    ops such as unique or nonzero break the graph), every sample that matches is `fallback` at once,
    instead of tracing each alone. Returns the samples left to run one by one.

    A graph break inside the batch can make Dynamo run the whole batch eagerly while samples alone
    still compile (boolean-mask `__getitem__` among plain indexing), so a few samples are first run
    alone: if one reaches ember, every sample is run alone."""
    try:
        outs, grads, report = runner.run(todo, fullgraph=False)
    except SweepTimeout:
        raise
    except Exception:  # noqa: BLE001  (the one-by-one runs record the error)
        return todo
    if report.graphs or _some_alone_reach_ember(runner, todo[:SHORTCUT_PROBES]):
        return todo
    rest = []
    for s, out, g in zip(todo, outs, grads):
        if runner.check(s, out, g) is None:
            s.finish("fallback", "Dynamo: no graph reached ember")
        else:
            rest.append(s)
    return rest


def _some_alone_reach_ember(runner: _Runner, samples: list[Sample]) -> bool:
    for s in samples:
        try:
            _, _, report = runner.run([s], fullgraph=False)
        except SweepTimeout:
            raise
        except Exception:  # noqa: BLE001  (an error alone: the one-by-one runs record it)
            return True
        if report.graphs:
            return True
    return False


def _fallbacks(report) -> list[str]:
    return [f"{g.kind}: {g.fallback}" for g in report.graphs if g.fallback]


# Exceptions by which ember declines a graph on purpose; any other exception that its fail-safe
# caught (ZeroDivisionError, KeyError, a compiler error on generated code, ...) is a bug: `crash`.
DELIBERATE = ("GraphUnsupported", "NotImplementedError")


def _deliberate(fallback: str) -> bool:
    return fallback.split(": ", 2)[1] in DELIBERATE if fallback.count(": ") >= 2 else False


def run_pair(
    op, dtype: torch.dtype, device: str, *, limit: int | None, grad_dtypes, seed: int = 0, into: list | None = None
) -> list[Sample]:
    """Every sample of one op in one dtype, each with its outcome.

    The samples are also appended to `into` as soon as they exist, so that a caller whose alarm
    interrupts the run (SweepTimeout) still has them.
    """
    want_grad = op.supports_autograd and dtype in grad_dtypes
    torch.manual_seed(seed)
    raw = list(op.sample_inputs(device, dtype, requires_grad=want_grad))
    if limit is not None:
        raw = raw[:limit]
    samples = [Sample(i, (r.input, tuple(r.args), dict(r.kwargs)), r.output_process_fn_grad) for i, r in enumerate(raw)]
    if into is not None:
        into.extend(samples)
    todo = []
    for s in samples:
        try:
            _eager(op, s, want_grad, seed)
            todo.append(s)
        except SweepTimeout:
            raise
        except Exception as e:  # noqa: BLE001  (eager raises: the sample is not counted)
            s.outcome, s.reason = "skipped", f"eager raises {type(e).__name__}: {_oneline(str(e))[:200]}"
    runner = _Runner(op, dtype, device, seed)
    one_by_one = todo
    if len(todo) > 1:
        one_by_one = []
        try:
            outs, grads, report = runner.run(todo, fullgraph=True)
            batch_ok = report.graphs and not _fallbacks(report)
        except SweepTimeout:
            raise
        except Exception:  # noqa: BLE001  (re-run one by one, which records the error)
            batch_ok = False
        if batch_ok:
            for s, out, g in zip(todo, outs, grads):
                why = runner.check(s, out, g)
                if why is None:
                    s.finish("match")
                else:
                    one_by_one.append(s)  # re-run alone to confirm and attribute
        else:
            one_by_one = _no_graph_shortcut(runner, todo)
    for s in one_by_one:
        s.outcome = None
        try:
            outs, grads, report = runner.run([s], fullgraph=False)
        except SweepTimeout:
            raise
        except Exception as e:  # noqa: BLE001  (recorded as the outcome)
            s.finish("crash", f"{type(e).__name__}: {_oneline(str(e))}")
            continue
        why = runner.check(s, outs[0], grads[0])
        fallbacks = _fallbacks(report)
        errors = [f for f in fallbacks if not _deliberate(f)]
        if why is not None:
            extra = f" (graphs ran eagerly: {fallbacks[0]})" if fallbacks else ""
            s.finish("mismatch", why + extra)
        elif errors:
            s.finish("crash", f"ember error, caught by its fail-safe: {errors[0]}")
        elif fallbacks:
            s.finish("fallback", fallbacks[0])
        elif not report.graphs:
            s.finish("fallback", "Dynamo: no graph reached ember")
        else:
            s.finish("match")
    return samples


# -- the sweep ----------------------------------------------------------------------------------


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def select_ops(patterns: list[str] | None, skip: list[str] | None = None) -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    def hit(op, pats):
        names = (op_name(op), op.name)
        return any(fnmatch.fnmatchcase(n, p) for p in pats for n in names)

    ops = [op for op in op_db if not patterns or hit(op, patterns)]
    return [op for op in ops if not skip or not hit(op, skip)]


def pairs(ops, dtypes: list[torch.dtype], device: str) -> list[tuple[Any, torch.dtype]]:
    out = []
    for op in ops:
        supported = op.supported_dtypes(device)
        out += [(op, d) for d in dtypes if d in supported]
    return out


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def record(op, dtype, device, samples: list[Sample], seconds: float, note: str = "") -> dict:
    counts = collections.Counter(s.outcome for s in samples)
    return {
        "op": op_name(op),
        "dtype": _dtype_name(dtype),
        "device": device,
        "samples": len(samples),
        "counts": {k: counts.get(k, 0) for k in OUTCOMES},
        "random": any(s.random for s in samples) or op.name in UNINITIALIZED,
        "seconds": round(seconds, 2),
        "details": [{"i": s.index, "outcome": s.outcome, "reason": s.reason} for s in samples if s.outcome != "match"],
        "note": note,
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
            note = f"no samples: {type(e).__name__}: {_oneline(str(e))[:200]}"
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


def _worker(args) -> int:
    """Run the selected pairs in this process, saving after each; `inflight` names the current pair."""
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    grad_dtypes = tuple(DTYPES[d] for d in args.grad_dtypes.split(",") if d)
    jsonl = Path(args.jsonl)
    records = load_records(jsonl)
    done = set(records) if args.resume else set()
    if args.rerun_failed:
        done = {k for k, r in records.items() if not any(r["counts"][o] for o in ("mismatch", "crash", "timeout"))}
    ops = select_ops(args.ops, args.skip_ops)
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        ops = ops[(k - 1) * len(ops) // n : k * len(ops) // n]
    todo = [(op, d) for op, d in pairs(ops, dtypes, args.device)]
    todo = [(op, d) for op, d in todo if (op_name(op), _dtype_name(d)) not in done]
    if args.rerun_failed:
        todo = [(op, d) for op, d in todo if (op_name(op), _dtype_name(d)) in records]
    inflight = jsonl.with_suffix(".inflight")
    for n, (op, d) in enumerate(todo):
        inflight.write_text(json.dumps({"op": op_name(op), "dtype": _dtype_name(d)}))
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


def _drive(args, argv: list[str]) -> int:
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


# -- the table ------------------------------------------------------------------------------------


def totals(records) -> collections.Counter:
    t: collections.Counter = collections.Counter()
    for r in records:
        t.update(r["counts"])
    return t


def render_markdown(records: list[dict], device: str, command: str) -> str:
    t = totals(records)
    counted = sum(t[k] for k in OUTCOMES if k != "skipped")
    good = t["match"] + t["fallback"]
    pct = 100.0 * good / counted if counted else 0.0
    ops = sorted({r["op"] for r in records})
    lines = [
        f"# OpInfo sweep: ember vs eager on {device}",
        "",
        "Generated by `ember opinfo` (ember/tools/opinfo.py); do not edit by hand. Rules: README.md beside this file.",
        "",
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; {len(ops)} ops, {len(records)} (op, dtype) pairs.",
        "",
        "| samples counted | match | fell back cleanly | mismatch | crash | timeout | match or fell back | skipped by eager |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        (
            f"| {counted} | {t['match']} | {t['fallback']} | {t['mismatch']} | {t['crash']} | {t['timeout']} "
            f"| {pct:.2f}% | {t['skipped']} |"
        ),
        "",
        "## By dtype",
        "",
        "| dtype | pairs | match | fell back | mismatch | crash | timeout | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in DTYPES:
        rs = [r for r in records if r["dtype"] == d]
        if rs:
            c = totals(rs)
            lines.append(
                f"| {d} | {len(rs)} | {c['match']} | {c['fallback']} | {c['mismatch']} | {c['crash']} "
                f"| {c['timeout']} | {c['skipped']} |"
            )
    reasons: collections.Counter = collections.Counter()
    for r in records:
        for d in r["details"]:
            if d["outcome"] == "fallback":
                reasons[_reason_key(d["reason"])] += 1
    lines += ["", "## Why ember fell back", "", "| samples | reason |", "|---:|---|"]
    lines += [f"| {n} | {_md(k)} |" for k, n in reasons.most_common(40)]
    bad = [(r, d) for r in records for d in r["details"] if d["outcome"] in ("mismatch", "crash", "timeout")]
    lines += ["", "## Mismatches, crashes and timeouts", ""]
    if not bad:
        lines.append("None.")
    else:
        lines += ["| op | dtype | sample | outcome | reason |", "|---|---|---:|---|---|"]
        lines += [
            f"| {r['op']} | {r['dtype']} | {d['i']} | {d['outcome']} | {_md(d['reason'][:200])} |" for r, d in bad
        ]
    random_ops = sorted({r["op"] for r in records if r.get("random")})
    lines += [
        "",
        "## Compared by shape and dtype only",
        "",
        "Outputs that differ between two eager runs with different seeds (random ops) or are uninitialized memory:",
        "",
        ", ".join(f"`{o}`" for o in random_ops) or "none",
        "",
        "## Per op",
        "",
        "Counts per dtype as match/fell back/skipped, and `!N` for N mismatches, crashes or timeouts.",
        "",
        "| op | " + " | ".join(DTYPES) + " |",
        "|---|" + "---|" * len(DTYPES),
    ]
    by_op: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for r in records:
        by_op[r["op"]][r["dtype"]] = r
    for o in ops:
        cells = []
        for d in DTYPES:
            r = by_op[o].get(d)
            if r is None:
                cells.append("")
                continue
            c = r["counts"]
            cell = f"{c['match']}/{c['fallback']}/{c['skipped']}"
            nbad = c["mismatch"] + c["crash"] + c["timeout"]
            if nbad:
                cell += f" **!{nbad}**"
            if r.get("note") and not r["samples"]:
                cell = "no samples"
            cells.append(cell)
        lines.append(f"| `{o}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _reason_key(reason: str) -> str:
    """Group fallback reasons: drop the graph kind and anything after the first colon-separated detail."""
    reason = reason.split(": ", 1)[1] if reason.startswith(("forward: ", "backward: ", "inference: ")) else reason
    return reason[:120]


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def write_report(jsonl: Path, md: Path, device: str, command: str) -> collections.Counter:
    records = list(load_records(jsonl).values())
    md.write_text(render_markdown(records, device, command))
    return totals(records)


# -- command line ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ember opinfo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x], default=None, help="names or globs")
    p.add_argument("--skip-ops", type=lambda s: [x for x in s.split(",") if x], default=None)
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"from {','.join(DTYPES)}")
    p.add_argument("--grad-dtypes", default="float32", help="dtypes whose gradients are checked too")
    p.add_argument("--shard", default=None, help="K/N: only the K-th of N contiguous slices of the op list")
    p.add_argument("--limit", type=int, default=None, help="at most this many samples per (op, dtype)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (Triton)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="wall-time limit per (op, dtype)")
    p.add_argument("--out", default=None, help="folder for DEVICE.jsonl and DEVICE.md (default docs/opinfo)")
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
    args.jsonl = str(out / f"{dev}.jsonl")
    md = out / f"{dev}.md"
    if args.merge:
        records = load_records(Path(args.jsonl))
        for other in args.merge:
            records.update(load_records(Path(other)))
        save_records(Path(args.jsonl), records)
    if args.worker or args.in_process:
        rc = _worker(args)
        if args.worker:
            return rc
    elif not args.report and not args.merge:
        fresh = not (args.resume or args.rerun_failed or args.ops or args.shard)
        if fresh and Path(args.jsonl).exists():
            Path(args.jsonl).unlink()  # a full fresh sweep starts from nothing
        rc = _drive(args, [a for a in argv if a != "--worker"])
        if rc:
            return rc
    command = args.command or "python -m ember.tools.opinfo " + " ".join(
        a for a in argv if a not in ("--report", "--in-process")
    )
    t = write_report(Path(args.jsonl), md, dev, command.strip())
    counted = sum(t[k] for k in OUTCOMES if k != "skipped")
    print(
        f"{counted} samples: {t['match']} match, {t['fallback']} fell back, {t['mismatch']} mismatch, "
        f"{t['crash']} crash, {t['timeout']} timeout ({t['skipped']} skipped by eager) -> {md}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
