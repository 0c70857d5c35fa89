"""Bad input behaves as in eager: NaN and infinity, empty and 0-d tensors, integer overflow and
division by zero, mixed devices. Each case is a program, its inputs and what eager does; ember
compiles it in strict mode (so a silent fallback would fail the test) unless the case says eager
is the right outcome, and errors must be raised where eager raises them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import repro, tensors

nan, inf = float("nan"), float("inf")


def _special():
    return torch.tensor([[1.0, nan, 3.0], [inf, -inf, 0.0], [-1.0, 2.0, 0.5]])


def _long_rows():
    x = torch.randn(6, 101)
    x[0, 37], x[1, 100], x[2, 0] = nan, nan, nan
    x[3, :] = -inf
    x[4, 50] = inf
    return x


@dataclass(frozen=True)
class Case:
    fn: Callable
    inputs: Callable[[], list]
    raises: str | None = None  # eager raises an error with this text; compiled must raise too
    strict: bool = True  # False: ember may (and should) run it eagerly, with a warning


CASES = {
    # NaN and infinity propagate as in eager, through pointwise ops, max/min and reductions.
    "nan_inf_pointwise": Case(
        lambda x: (torch.exp(x) * 2 - 1, torch.sqrt(x), torch.log(x), torch.tanh(x), torch.sigmoid(x), x / 0.0),
        lambda: [_special()],
    ),
    "nan_inf_max_min_clamp": Case(
        lambda x: (x.amax(1), x.amin(0), torch.maximum(x, x.t()), torch.minimum(x, x * 0), torch.clamp(x, -1, 1)),
        lambda: [_special()],
    ),
    # Rows long enough for vector loops and their tails: a NaN in the body, in the tail, first.
    "nan_in_long_rows": Case(
        lambda x: (x.amax(1), x.amin(1), torch.softmax(x, 1), x.bfloat16().amax(1), x.double().amin(1)),
        lambda: [_long_rows()],
    ),
    "nan_relu": Case(lambda x: torch.relu(x) + 1, lambda: [_special()]),
    "nan_inf_reductions": Case(lambda x: (x.sum(1), x.mean(0), x.var(1), x.sum()), lambda: [_special()]),
    "inf_softmax": Case(lambda x: torch.softmax(x, 1), lambda: [_special()]),
    "nan_compare_where": Case(
        lambda x: (torch.where(x > 0, x, -x), torch.isnan(x), torch.eq(x, x), torch.ne(x, x)), lambda: [_special()]
    ),
    "float_division_by_zero": Case(
        lambda a, b: (a / b, torch.reciprocal(b)), lambda: [torch.tensor([1.0, -1.0, 0.0]), torch.zeros(3)]
    ),
    # Empty tensors: results of the right shape; mean over nothing is NaN; max over nothing raises.
    "empty_pointwise": Case(lambda x: x * 2 + 1, lambda: [torch.randn(0, 5)]),
    "empty_reductions": Case(lambda x: (x.sum(0), x.sum(1), x.mean(1), x.amax(1)), lambda: [torch.randn(0, 5)]),
    "empty_mean_is_nan": Case(lambda x: x.mean(0) + 1, lambda: [torch.randn(0, 5)]),
    "empty_softmax": Case(lambda x: torch.softmax(x, 0), lambda: [torch.randn(0, 5)]),
    "empty_amax_raises": Case(lambda x: x.amax(0), lambda: [torch.randn(0, 5)], raises="zero"),
    # 0-d tensors, alone and broadcast against others.
    "zero_dim": Case(lambda s: (s * 2, s.exp(), s.sum(), s + 1), lambda: [torch.tensor(2.5)]),
    "zero_dim_broadcast": Case(lambda x, s: x * s + s, lambda: [torch.randn(3, 4), torch.tensor(2.5)]),
    # Integer overflow wraps around, as in eager (two's complement).
    "int64_overflow": Case(
        lambda i: (i * 4, i + i, i.sum(), -i, i.abs()),
        lambda: [torch.tensor([2**62, -(2**62), 2**63 - 1, -(2**63)], dtype=torch.int64)],
    ),
    "int32_overflow": Case(
        lambda i: (i * 4, i + i, i.sum()), lambda: [torch.tensor([2**30, -(2**31), 7], dtype=torch.int32)]
    ),
    # Integer division by zero: eager raises on CPU (floor, trunc, remainder); true division gives inf/NaN.
    "int_floor_division_by_zero": Case(
        lambda a, b: a // b + 1, lambda: [torch.tensor([5, -7]), torch.tensor([0, 2])], raises="ZeroDivisionError"
    ),
    "int_remainder_by_zero": Case(
        lambda a, b: a % b, lambda: [torch.tensor([5, -7]), torch.tensor([0, 2])], raises="ZeroDivisionError"
    ),
    "int_trunc_division_by_zero": Case(
        lambda a, b: torch.div(a * 2, b, rounding_mode="trunc"),
        lambda: [torch.tensor([5, -7]), torch.tensor([0, 2])],
        raises="ZeroDivisionError",
    ),
    "int_true_division_by_zero": Case(
        lambda a, b: a / b, lambda: [torch.tensor([5, -7, 0, 3]), torch.tensor([0, 0, 0, 2])]
    ),
    # Mixed devices and 0-d operands: a 0-d CPU tensor of another dtype takes part like a scalar.
    "cpu_tensor_and_0d_tensor": Case(
        lambda x, s: (x + s, x * s.double(), x.int() + s), lambda: [torch.randn(3, 4), torch.tensor(2.5)]
    ),
    "float32_times_0d_float64": Case(
        lambda x, s: x * s, lambda: [torch.randn(3, 4), torch.tensor(2.5, dtype=torch.float64)]
    ),
    "int_times_0d_float": Case(lambda x, s: x * s, lambda: [torch.arange(6).reshape(2, 3), torch.tensor(0.5)]),
    # Layouts other than dense row-major: a stride-0 broadcast, slices with steps, a transpose,
    # channels-last images, and offsets into a storage.
    "expanded_input": Case(
        lambda x, y: (x * y, (x + 1).sum(0), x.amax(1)), lambda: [torch.randn(1, 37).expand(19, 37), torch.randn(19, 1)]
    ),
    "strided_inputs": Case(
        lambda a, b: (a * 2 + b, (a - b).sum(1), torch.softmax(b, 1)),
        lambda: [torch.randn(40, 66)[::2, 1::3], torch.randn(22, 20).t()],
    ),
    "channels_last_input": Case(
        lambda x: (x.relu() * 3, x.mean((2, 3)), torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (5,))),
        lambda: [torch.randn(2, 5, 7, 9).to(memory_format=torch.channels_last)],
    ),
    "storage_offset_input": Case(lambda x: (x.exp(), x.sum()), lambda: [torch.randn(1000)[3:]]),
    "meta_tensors_run_eagerly": Case(lambda x: x * 2 + 1, lambda: [torch.randn(3, 4, device="meta")], strict=False),
    "cpu_and_meta_tensor_raise": Case(
        lambda x, m: x + m, lambda: [torch.randn(3, 4), torch.randn(3, 4, device="meta")], raises="meta"
    ),
}


def _same(got: torch.Tensor, want: torch.Tensor, what: str, line: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device, (
        f"{what}: {got.dtype}{list(got.shape)} on {got.device} != eager's {want.dtype}{list(want.shape)} on "
        f"{want.device}\n{line}"
    )
    if want.device.type == "meta":
        return
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{what}: {m}\n{line}")


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_matches_eager(name):
    case = CASES[name]
    inputs = case.inputs()
    line = repro(case=name, inputs=[x for x in inputs if isinstance(x, torch.Tensor)])
    compiled = torch.compile(case.fn, backend="ember", options={"backend": "cpp", "strict": case.strict})
    if case.raises:
        with pytest.raises(Exception, match=case.raises):
            case.fn(*inputs)
        with pytest.raises(Exception) as info:
            compiled(*inputs)
        assert case.raises.lower() in str(info.value).lower(), f"compiled raised {info.value!r}\n{line}"
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager's own (e.g. var with one degree of freedom)
        expected = tensors(case.fn(*inputs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tensors(compiled(*inputs))
    assert len(got) == len(expected), line
    for k, (g, e) in enumerate(zip(got, expected)):
        _same(g, e, f"output {k}", line)
    if not case.strict:
        msgs = [str(w.message) for w in caught if str(w.message).startswith("ember")]
        assert len(msgs) == 1, f"expected one ember warning for running eagerly: {msgs}\n{line}"


def test_past_int32_elements():
    """More than 2**31 elements, through a stride-0 input that keeps memory small: 64-bit index math
    and an exact integer sum. The expected values are known (eager takes ~25 s on this input)."""
    n = 2**31 + 10
    x = torch.tensor([3], dtype=torch.int32).expand(n)
    compiled = torch.compile(lambda x: (x.sum(), x.amin(), (x * 2).amax()), backend="ember", options={"strict": True})
    total, low, high = compiled(x)
    assert total.dtype == torch.int64 and int(total) == 3 * n, repro(n=n, total=int(total))
    assert int(low) == 3 and int(high) == 6, repro(n=n, low=int(low), high=int(high))


# -- settings --------------------------------------------------------------------------------


def _garbage(setting) -> str | None:
    """A value the setting must reject, or None if every string is a valid value (paths, names)."""
    if setting.type is bool:
        return "maybe"
    if setting.type is int:
        return "twelve"
    if setting.choices is not None:
        return "no-such-choice"
    if setting.check is not None:
        return "no-such-value!"
    return None


def _checked_settings() -> list[str]:
    from ember import config

    return [name for name, s in config.SETTINGS.items() if _garbage(s) is not None]


@pytest.mark.parametrize("name", _checked_settings())
def test_every_checked_setting_rejects_a_bad_environment_value(monkeypatch, name):
    """EMBER_<NAME>=garbage is a ConfigError naming the variable and the value, before any compile."""
    from ember import ConfigError, config

    setting = config.SETTINGS[name]
    value = _garbage(setting)
    monkeypatch.setenv(setting.env_var, value)
    with pytest.raises(ConfigError) as info:
        config.get(name)
    assert setting.env_var in str(info.value) and value in str(info.value), str(info.value)
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: x + 1, backend="ember")(torch.randn(3))
    chain, e = [], info.value
    while e is not None and e not in chain:
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    assert any(isinstance(c, ConfigError) for c in chain), f"compiling raised {info.value!r}, not a ConfigError"
