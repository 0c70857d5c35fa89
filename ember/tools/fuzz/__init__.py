"""`ember fuzz` (or `python -m ember.tools.fuzz`): random programs, each checked against eager PyTorch.

    ember fuzz --seed 0 --count 200        # 200 programs, repros to results/fuzz-repros/
    ember fuzz --seed 0 --only 17 --show   # print program 17 of seed 0

A program is a straight-line function of a few input tensors: chains of pointwise ops (unary,
binary with broadcasting and Python scalars, where, casts), reductions (sum, mean, amax, amin,
var; keepdim or not), views (reshape, permute, transpose, expand, unsqueeze, squeeze, slices
with steps, select), matmuls and concatenations. Shapes are random with size-1, zero-size and
odd dims; inputs may be transposed or strided; dtypes mix float32, bfloat16, float16, int64 and
bool. The generator keeps the program valid by construction: every value carries its shape and
dtype (read off a meta-tensor evaluation of the op it chose), and an op is only picked with
operands it accepts. Program `i` of seed `s` depends on (s, i) alone.

Checking. Each program runs eagerly and compiled with ember (the C++ backend by default). A
*reference* is the same program in float64 (floating inputs upcast, every float dtype in a cast
retargeted to float64), as PyTorch's dynamo benchmarks compare against a float64 run. For each
output:

* dtype and shape must equal eager's;
* integer and bool outputs must equal eager's exactly;
* a float element c (compiled) passes, with e (eager) and r (reference), when its class
  (NaN, +inf, -inf, finite) is eager's or the reference's, and if finite,
      |c - r| <= 2 |e - r| + tol * (|r| + scale)      (or, where r is not finite, |c - e| <= tol * (|e| + scale))
  with scale = max(1, mean |r|) over the output and tol = 1e-4 for float32-only programs (1e-3 for
  gradients, which sum over broadcasts with cancellation: the training tolerance of PyTorch's dynamo
  benchmarks), 2^-6 with float16 anywhere and 2^-5 with bfloat16 anywhere. The reference's class
  is taken after rounding it to the output's dtype (a value past float32's range is inf there). The 2 |e - r| term is eager's own
  error: ember may be more accurate than eager (it keeps bf16 intermediates in float32, and its
  formulas differ: gelu's erf form loses digits in eager's tail that ember keeps), never much less.

A few programs (8%) have rows of 4097 to 33001 elements, past the split-reduction and persistent-
reduction thresholds. sin, cos and exp are kept off values summed from 256 or more terms: their
absolute error (fine relative to the sum) would be as large as the result.

Bool and integer results compare exactly, so the generator keeps ops with a discontinuity away
from values that rounding can move across it: floor/ceil and float->int casts read only values
no float arithmetic made (inputs, views, casts, concatenations); comparisons read no value made
by low-precision arithmetic, and compare computed values with 0 only (layer_norm over two
elements is exactly +-1 in one implementation and 1 - ulp in another).

30% of the programs also check gradients: one backward with fixed pseudo-random cotangents,
and each float input's gradient compared by the same rule.

Several programs are compiled as one function (`--batch`), to pay the C++ compiler once per
batch; a batch with a mismatch, a crash or an eager fallback is re-run program by program so the
culprit is named. A failing program is written as a standalone script (plain torch and
`backend="ember"`) to `--repro-dir`.
"""

# One module per idea: program.py (a program's values and source text), generator.py (random valid
# programs), checker.py (eager and float64 comparison, batches split down to the culprit), repro.py
# (standalone repro scripts), runner.py (the driver and the command line).
from ember.tools.fuzz.checker import GRAD_TOL, STATS, Outcome, check, check_batch, compare, cotangents, grads
from ember.tools.fuzz.generator import Generator, generate
from ember.tools.fuzz.program import Program, Val
from ember.tools.fuzz.repro import write_repro
from ember.tools.fuzz.runner import Summary, main, run

__all__ = [
    "GRAD_TOL",
    "STATS",
    "Generator",
    "Outcome",
    "Program",
    "Summary",
    "Val",
    "check",
    "check_batch",
    "compare",
    "cotangents",
    "generate",
    "grads",
    "main",
    "run",
    "write_repro",
]
