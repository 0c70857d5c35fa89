"""`ember opinfo` (or `python -m ember.tools.opinfo`): ember against eager on PyTorch's OpInfo database.

    ember opinfo                  # every op, every dtype, CPU
    ember opinfo --ops add,nn.functional.gelu --dtypes float32,bfloat16
    ember opinfo --resume         # go on where an earlier run stopped
    ember opinfo --rerun-failed   # only (op, dtype) pairs that failed
    ember opinfo --device cuda    # the GPU sweep (Triton)
    ember opinfo --report         # re-render the table from the JSON lines
    ember opinfo --inplace        # the in-place variants (x.add_(y)): result and written input

Results go to results/opinfo/DEVICE.jsonl and DEVICE.md (DEVICE-inplace.* with --inplace) under the current directory, or to `--out DIR`;
the committed tables are refreshed only when asked: `--out docs/opinfo` from the checkout.

Every sample input of `op_db` (torch.testing._internal.common_methods_invocations) runs through
`torch.compile(backend="ember")` in float32, bfloat16, float16, int64 and bool where the op
supports the dtype, forward, and gradients (float32) where the op supports autograd. Each sample
ends as one outcome:

  match      compiled equals eager (the rule below); graphs whose ops all ran as externs count
             here too, since they ran through ember
  fallback   ember declined a graph on purpose and said why (GraphReport.fallback from a
             GraphUnsupported or NotImplementedError), or Dynamo captured no graph at all (the op
             never reached ember)
  skipped    eager itself raises on the sample, or torch.compile does with PyTorch's own `eager`
             backend (Dynamo fails before any backend sees it): not counted in the totals
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

# One module per role: selection.py (which (op, dtype) pairs run), comparison.py (the comparison rule),
# samples.py (a sample, copies of its inputs, its eager and reference results), batch.py (one pair's
# samples compiled as one batch, re-run one by one to attribute), worker.py (the worker process: pairs
# under an alarm, JSON lines, restart after a crash), report.py (the markdown table, merging shards),
# cli.py (the command line).
from ember.tools.opinfo.batch import DELIBERATE, SHORTCUT_PROBES, run_pair
from ember.tools.opinfo.cli import DEFAULT_OUT, main
from ember.tools.opinfo.comparison import UNINITIALIZED, compare
from ember.tools.opinfo.report import merge, render_markdown, totals, write_report
from ember.tools.opinfo.samples import OUTCOMES, Sample, SweepTimeout
from ember.tools.opinfo.selection import DTYPES, dtype_name, op_name, pairs, select_ops
from ember.tools.opinfo.worker import load_records, record, save_records, sweep_pair

__all__ = [
    "DEFAULT_OUT",
    "DELIBERATE",
    "DTYPES",
    "OUTCOMES",
    "SHORTCUT_PROBES",
    "UNINITIALIZED",
    "Sample",
    "SweepTimeout",
    "compare",
    "dtype_name",
    "load_records",
    "main",
    "merge",
    "op_name",
    "pairs",
    "record",
    "render_markdown",
    "run_pair",
    "save_records",
    "select_ops",
    "sweep_pair",
    "totals",
    "write_report",
]
