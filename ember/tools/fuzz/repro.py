"""A failing program as a standalone script: plain torch and `backend="ember"`, its own comparison rule."""

from __future__ import annotations

import inspect
from pathlib import Path

from ember.tools.fuzz.checker import GRAD_TOL, Outcome, _tol, compare, cotangents, grads

REPRO = '''"""ember fuzz repro: seed {seed}, program {index} ({status}).

{detail}

Rerun: python {filename}
Regenerate: python -m ember.tools.fuzz --seed {seed} --only {index}
"""

import math

import torch

{compare}

{grads}
{program}
{reference}
{inputs}

GRAD = {grad!r}  # also compare the gradients of the float inputs


def main():
    inputs = make_inputs({device!r})
    if GRAD:
        inputs = [x.requires_grad_(True) if x.is_floating_point() else x for x in inputs]
    ref_inputs = [x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs]
    expected = list(program(*inputs))
    torch.set_default_dtype(torch.float64)  # int / 0.5 is float64 in the reference
    reference = list(reference_program(*ref_inputs))
    torch.set_default_dtype(torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(program, backend="ember", dynamic={dynamic}, options={options!r})
    got = list(compiled(*inputs))
    if GRAD:
        expected = [o.detach() for o in expected] + grads(expected, inputs)
        reference = [o.detach() for o in reference] + grads(reference, ref_inputs)
        got = [o.detach() for o in got] + grads(got, inputs)
    failed = len(got) != len(expected)
    n_out = len(got) - (sum(x.requires_grad for x in inputs) if GRAD else 0)
    for i, (c, e, r) in enumerate(zip(got, expected, reference)):
        problem = compare(c, e, r, {tol!r} if i < n_out else max({tol!r}, {grad_tol!r}))
        failed = failed or problem is not None
        print(f"output {{i}}: {{problem or 'ok'}}")
    print("MISMATCH" if failed else "all outputs match")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
'''


def write_repro(outcome: Outcome, directory: Path, options: dict, device: str = "cpu") -> Path:
    p = outcome.program
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"repro_seed{p.seed}_{p.index}.py"
    text = REPRO.format(
        seed=p.seed,
        index=p.index,
        status=outcome.status,
        detail=outcome.detail.replace('"""', "'''")[:3000],
        filename=path.name,
        program=p.source("program"),
        reference=p.source("reference_program", reference=True),
        inputs=p.inputs_source("make_inputs"),
        dynamic=p.dynamic or None,
        options=options,
        compare=inspect.getsource(compare),
        grads=inspect.getsource(cotangents) + "\n\n" + inspect.getsource(grads),
        grad=p.grad,
        tol=_tol(p.low_precision),
        grad_tol=GRAD_TOL,
        device=device,
    )
    path.write_text(text)
    return path
