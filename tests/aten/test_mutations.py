"""Programs that write their inputs: optimizer steps, cache writes, buffers and counters, views and aliases.

Each case runs eagerly and compiled on copies of the same inputs, and compares the results and every
input afterwards (rtol/atol 1e-5, float32). Where ember promises to write a new value straight into its
input (a kernel's store, or a scatter run in place), the report's mutation lines say so.
"""

from __future__ import annotations

import pytest
import torch

from ember.report import collecting
from tests.helpers import ON_DEVICES, assert_close, ember_compile, repro

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _run(fn, make, backend, device):
    torch.manual_seed(0)
    eager_args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in make()]
    args = [t.clone() if isinstance(t, torch.Tensor) else t for t in eager_args]
    torch._dynamo.reset()
    with collecting() as report:
        got = ember_compile(fn, backend)(*args)
    want = fn(*eager_args)
    line = repro(backend=backend, device=device, inputs=[t for t in eager_args if isinstance(t, torch.Tensor)])
    for k, (a, e) in enumerate(zip(args, eager_args)):
        if isinstance(a, torch.Tensor):
            assert_close(a, e, **TOL, what=f"input {k} after the call", line=line)
    if want is not None:
        assert_close(got, want, **TOL, what="result", line=line)
    return report, line


def _mutation_lines(report) -> list[str]:
    return [m for g in report.graphs for m in g.mutations]


# -- writes into a preallocated cache (a static KV cache), buffers, counters ----------------------


def kv_index_copy(cache, pos, k):
    cache.index_copy_(1, pos, k)
    return cache.sum(dim=1)


def kv_index_put(cache, pos, k):
    cache[:, pos] = k


def kv_slice(cache, k):
    cache[:, 2:4] = k * 2


def kv_scatter(cache, idx, src):
    cache.scatter_(1, idx, src)


def index_put_accumulate(x, i, v):
    x.index_put_((i,), v, accumulate=True)


def buffer_add(buf, x):
    buf.add_(x)
    return x * 2


def counter(c, x):
    c.add_(1)
    return x + c


def mutated_twice(x, y):
    x.mul_(2)
    x.add_(y)
    return y.sum()


def returned_input(x, y):
    x.add_(y)
    return x


def row_of_input(x, y):
    x[0].add_(y)


def strided_view_of_input(x):
    x.view(-1)[::2].mul_(3)


# (function, inputs, whether every mutation is written in place)
CASES = {
    "index_copy": (kv_index_copy, lambda: (torch.zeros(2, 8, 4), torch.tensor([3]), torch.randn(2, 1, 4)), True),
    "index_put": (kv_index_put, lambda: (torch.zeros(2, 8, 4), torch.tensor([5]), torch.randn(2, 1, 4)), True),
    "slice_assign": (kv_slice, lambda: (torch.zeros(2, 8, 4), torch.randn(2, 2, 4)), True),
    "scatter": (
        kv_scatter,
        lambda: (torch.zeros(3, 8), torch.tensor([[1, 2], [0, 7], [4, 5]]), torch.randn(3, 2)),
        True,
    ),
    "index_put_acc": (
        index_put_accumulate,
        lambda: (torch.randn(6, 3), torch.tensor([1, 1, 4]), torch.randn(3, 3)),
        True,
    ),
    "buffer_add": (buffer_add, lambda: (torch.randn(4, 5), torch.randn(4, 5)), True),
    "counter": (counter, lambda: (torch.tensor(0), torch.randn(3)), True),
    "mutated_twice": (mutated_twice, lambda: (torch.randn(4, 5), torch.randn(4, 5)), True),
    "returned_input": (returned_input, lambda: (torch.randn(4, 5), torch.randn(4, 5)), False),
    "row_of_input": (row_of_input, lambda: (torch.randn(4, 5), torch.randn(5)), True),
    "strided_view": (strided_view_of_input, lambda: (torch.randn(4, 5),), False),
}


@pytest.mark.parametrize("backend,device", ON_DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_input_mutation(case, backend, device):
    fn, make, in_place = CASES[case]
    report, line = _run(fn, make, backend, device)
    lines = _mutation_lines(report)
    assert lines, f"no mutated input reported\n{line}"
    if in_place:
        assert all("written in place" in m for m in lines), f"{lines}\n{line}"
    else:  # still correct, through one copy whose reason the report gives
        assert all("copied in at the end (" in m for m in lines), f"{lines}\n{line}"


# -- inputs that share storage ---------------------------------------------------------------------


def write_one_read_other(a, b):
    a.mul_(2)
    return b + 1


def write_view_read_base(base, row):
    row.add_(1)
    return base.sum(dim=0)


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_two_inputs_sharing_storage(backend, device):
    """The same tensor passed twice: the write through one is seen through the other, as in eager."""
    torch.manual_seed(0)
    x, y = torch.randn(3, 4, device=device), None
    y = x.clone()
    got = ember_compile(write_one_read_other, backend)(x, x)
    want = write_one_read_other(y, y)
    line = repro(backend=backend, device=device, x=x)
    assert_close(got, want, **TOL, what="result", line=line)
    assert_close(x, y, **TOL, what="the shared input", line=line)


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_view_and_its_base_as_inputs(backend, device):
    torch.manual_seed(0)
    x = torch.randn(3, 4, device=device)
    y = x.clone()
    got = ember_compile(write_view_read_base, backend)(x, x[1])
    want = write_view_read_base(y, y[1])
    line = repro(backend=backend, device=device, x=x)
    assert_close(got, want, **TOL, what="result", line=line)
    assert_close(x, y, **TOL, what="the base after the view's write", line=line)


# -- optimizer steps ---------------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd_momentum": lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=fe),
    "sgd_nesterov": lambda p, fe: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=fe
    ),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=0.01, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=fe),
    "rmsprop": lambda p, fe: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, foreach=fe),
    "adagrad": lambda p, fe: torch.optim.Adagrad(p, lr=0.1, foreach=fe),
}
SHAPES = [(5, 3), (7,), (2, 3, 4)]


def _params(device):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _check_steps(make_opt, backend, device, steps=3):
    eager_params, params = _params(device), _params(device)
    eager_opt, opt = make_opt(eager_params), make_opt(params)
    step = ember_compile(opt.step, backend)
    with collecting() as report:
        for _ in range(steps):
            eager_opt.step()
            step()
    line = repro(backend=backend, device=device, shapes=SHAPES, steps=steps)
    for k, (p, e) in enumerate(zip(params, eager_params)):
        assert_close(p.detach(), e.detach(), **TOL, what=f"param {k}", line=line)
        for key, value in eager_opt.state[e].items():
            if isinstance(value, torch.Tensor):
                assert_close(opt.state[p][key], value, **TOL, what=f"state {key} of param {k}", line=line)
    return report, line


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_step_cpp(name, foreach):
    """Params and state after 3 steps equal eager's; the step has no ATen calls, and each state tensor
    is written by the kernel computing it."""
    report, line = _check_steps(lambda p: OPTIMIZERS[name](p, foreach), "cpp", "cpu")
    graphs = [g for g in report.graphs if g.mutations]
    assert graphs, f"no graph wrote the optimizer's state\n{line}"
    for g in graphs:
        assert not g.externs, f"{g.externs}\n{line}"
        assert all("written in place by kernel" in m for m in g.mutations), f"{g.mutations}\n{line}"


# Adam's bias correction is a pow: under Triton's interpreter (no libdevice) it renders as ember_pow.
@pytest.mark.parametrize("name", ["rmsprop", "sgd_nesterov", "adam"])
def test_optimizer_step_triton(name):
    report, line = _check_steps(lambda p: OPTIMIZERS[name](p, True), "triton", "cpu", steps=2)
    assert all("written in place" in m for g in report.graphs for m in g.mutations), line


def test_tensor_lr_changes_without_recompiling():
    """lr as a tensor (an LR scheduler writes it): new values are read, the step is not recompiled."""
    eager_params, params = _params("cpu"), _params("cpu")
    eager_opt = torch.optim.Adam(eager_params, lr=torch.tensor(0.01), foreach=False)
    opt = torch.optim.Adam(params, lr=torch.tensor(0.01), foreach=False)
    step = ember_compile(opt.step, "cpp")
    with collecting() as report:
        for lr in (0.01, 0.02, 0.005):
            for o in (opt, eager_opt):
                o.param_groups[0]["lr"].fill_(lr)
            eager_opt.step()
            step()
    line = repro(backend="cpp", shapes=SHAPES, lrs=(0.01, 0.02, 0.005))
    for k, (p, e) in enumerate(zip(params, eager_params)):
        assert_close(p.detach(), e.detach(), **TOL, what=f"param {k}", line=line)
    # The first call initializes the state (its own graph); every later step reuses one compiled graph.
    assert len(report.graphs) <= 2, f"{[g.summary() for g in report.graphs]}\n{line}"


# -- mixed precision and capturable steps ------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw"])
def test_bf16_params_step(name):
    """bf16 params and (torch.optim's) bf16 state: after 3 steps each is no further from a float64 run
    of the same step than eager's is (ember rounds to bf16 once per value, eager once per op)."""
    from tests.helpers import assert_not_worse

    def made(dtype):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
        for p in params:
            p.grad = torch.randn_like(p)
        return params, OPTIMIZERS[name](params, True)

    (eager_params, eager_opt), (params, opt) = made(torch.bfloat16), made(torch.bfloat16)
    ref_params, ref_opt = made(torch.float64)
    for p, e in zip(ref_params, eager_params):  # the same bf16 values, held in float64
        p.data.copy_(e.detach().double())
        p.grad.copy_(e.grad.double())
    step = ember_compile(opt.step, "cpp")
    for _ in range(3):
        eager_opt.step()
        ref_opt.step()
        step()
    line = repro(backend="cpp", optimizer=name, dtype=torch.bfloat16, shapes=SHAPES, steps=3)
    for k, (p, e, r) in enumerate(zip(params, eager_params, ref_params)):
        assert_not_worse(p.detach(), e.detach(), r.detach().float(), what=f"param {k}", line=line)
        for key in ("exp_avg", "exp_avg_sq"):
            ref_state = ref_opt.state[r][key].float()
            assert_not_worse(opt.state[p][key], eager_opt.state[e][key], ref_state, what=f"{key} {k}", line=line)


def test_bf16_params_with_fp32_state():
    """Adam over bf16 params with fp32 moments (which eager's torch.optim refuses: its lerp takes one
    dtype): the moments equal a float32 run's, and each param is that run's new value rounded to bf16."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    ref_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    for p, r in zip(params, ref_params):
        r.grad = p.grad.float()
    opt = torch.optim.Adam(params, lr=0.01, foreach=True)
    ref_opt = torch.optim.Adam(ref_params, lr=0.01, foreach=True)
    for p in params:
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape)}
    step = ember_compile(opt.step, "cpp")
    line = repro(backend="cpp", params=torch.bfloat16, state=torch.float32, shapes=SHAPES, steps=3)
    for _ in range(3):
        step()
        ref_opt.step()
        with torch.no_grad():  # the reference keeps what a bf16 param can hold
            for r in ref_params:
                r.copy_(r.bfloat16().float())
    for k, (p, r) in enumerate(zip(params, ref_params)):
        assert_close(p.detach(), r.detach().bfloat16(), rtol=2**-7, atol=1e-5, what=f"param {k}", line=line)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[p][key], ref_opt.state[r][key], **TOL, what=f"{key} {k}", line=line)


@pytest.mark.parametrize("name,foreach", [("adam", True), ("adamw", False)], ids=["adam-foreach", "adamw-single"])
def test_capturable_step(name, foreach):
    """capturable=True (step counts and bias corrections as tensors, no host sync): eager refuses it on
    CPU tensors, compiled it runs; params and moments after 3 steps equal eager's capturable=False."""
    make = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    eager_params, params = _params("cpu"), _params("cpu")
    eager_opt = make(eager_params, lr=0.01, foreach=foreach)
    opt = make(params, lr=0.01, foreach=foreach, capturable=True)
    step = ember_compile(opt.step, "cpp")
    with collecting() as report:
        for _ in range(3):
            eager_opt.step()
            step()
    line = repro(backend="cpp", optimizer=name, capturable=True, foreach=foreach, shapes=SHAPES, steps=3)
    for k, (p, e) in enumerate(zip(params, eager_params)):
        assert_close(p.detach(), e.detach(), **TOL, what=f"param {k}", line=line)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_close(opt.state[p][key], eager_opt.state[e][key], **TOL, what=f"{key} {k}", line=line)
    assert all("written in place" in m for g in report.graphs for m in g.mutations), line
