"""The settings registry: bad names and values are clear errors (ember.ConfigError) that list
what is valid, wherever they come from (torch.compile options, ember.compile, config.override,
EMBER_* environment variables); good ones take effect, in the documented order of priority."""

from __future__ import annotations

import pytest
import torch

import ember
from ember import ConfigError, config
from tests.helpers import assert_close, reports


def _f(x):
    return x * 2 + 1


def _config_error(e: BaseException) -> ConfigError | None:
    """The ConfigError itself, or the one Dynamo wrapped in BackendCompilerFailed."""
    seen = []
    while e is not None and e not in seen:
        if isinstance(e, ConfigError):
            return e
        seen.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None


def _compile_error(run) -> ConfigError:
    with pytest.raises(Exception) as info:
        run()
    err = _config_error(info.value)
    assert err is not None, f"expected an ember.ConfigError, got {type(info.value).__name__}: {info.value}"
    return err


VALID_NAMES = sorted(config.SETTINGS)


# -- unknown names -------------------------------------------------------------------------


def test_unknown_option_in_torch_compile():
    err = _compile_error(lambda: torch.compile(_f, backend="ember", options={"nope": 1})(torch.randn(4)))
    assert "nope" in str(err)
    assert all(name in str(err) for name in VALID_NAMES), str(err)


def test_unknown_option_in_ember_compile_fails_at_once():
    with pytest.raises(ConfigError, match="nope") as info:
        ember.compile(_f, options={"nope": 1})
    assert all(name in str(info.value) for name in VALID_NAMES), str(info.value)


def test_unknown_name_in_override():
    with pytest.raises(ConfigError, match="nope") as info, config.override(nope=1):
        pass
    assert all(name in str(info.value) for name in VALID_NAMES), str(info.value)


def test_unknown_name_in_get():
    with pytest.raises(ConfigError, match="valid settings"):
        config.get("nope")


def test_unknown_environment_variable(monkeypatch):
    monkeypatch.setenv("EMBER_NOPE", "1")
    err = _compile_error(lambda: torch.compile(_f, backend="ember")(torch.randn(4)))
    assert "EMBER_NOPE" in str(err)
    assert all(s.env_var in str(err) for s in config.SETTINGS.values()), str(err)


def test_misspelled_option_gets_a_suggestion():
    err = _compile_error(lambda: torch.compile(_f, backend="ember", options={"stirct": True})(torch.randn(4)))
    assert "torch.compile options: unknown ember setting 'stirct'; did you mean 'strict'?" in str(err), str(err)


def test_misspelled_environment_variable_gets_a_suggestion(monkeypatch):
    monkeypatch.setenv("EMBER_DEBG", "1")
    err = _compile_error(lambda: torch.compile(_f, backend="ember")(torch.randn(4)))
    assert "unknown environment variable EMBER_DEBG; did you mean 'EMBER_DEBUG'?" in str(err), str(err)


def test_bad_environment_fails_at_ember_compile(monkeypatch):
    monkeypatch.setenv("EMBER_STRICT", "maybe")
    with pytest.raises(ConfigError, match="EMBER_STRICT"):
        ember.compile(_f)


def test_ember_config_flags_unknown_and_invalid_environment_variables(monkeypatch, capsys):
    from ember.tools.cli import main

    monkeypatch.setenv("EMBER_CACHEDIR", "/tmp/x")
    monkeypatch.setenv("EMBER_DEBUG", "loud")
    main(["config"])
    out = capsys.readouterr().out
    assert "warning: unknown environment variable EMBER_CACHEDIR; did you mean 'EMBER_CACHE_DIR'?" in out, out
    assert "warning: environment variable EMBER_DEBUG: debug='loud' is not a valid int" in out, out


def test_setting_error_at_first_call_is_one_clear_line():
    """Dynamo wraps a backend's exceptions in BackendCompilerFailed, under a screenful of its own
    frames; ember's setting errors come out as ember.ConfigError, their message the first line."""
    import traceback

    with pytest.raises(ConfigError) as info:
        torch.compile(_f, backend="ember", options={"debg": 1})(torch.randn(4))
    err = info.value
    assert not isinstance(err, torch._dynamo.exc.BackendCompilerFailed)
    assert str(err).startswith("torch.compile options: unknown ember setting 'debg'; did you mean 'debug'?"), err
    frames = traceback.extract_tb(err.__traceback__)
    # This test's call, Dynamo's re-raise, ember's raise: no frame of Dynamo's tracing in between.
    assert len(frames) <= 3, traceback.format_tb(err.__traceback__)


# -- bad values ----------------------------------------------------------------------------

BAD_VALUES = [
    # (name, value, text the error must contain)
    ("debug", "x", "0 quiet"),  # not an int: the help text lists the levels
    ("debug", 9, "0 quiet"),  # out of range
    ("backend", "cuda-magic", "['auto', 'triton', 'cpp']"),
    ("strict", "maybe", "strict"),
    ("persistent_reduction_max", 0, "persistent_reduction_max"),
    ("compile_threads", "many", "compile_threads"),
]


@pytest.mark.parametrize("name,value,hint", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_bad_value_in_override(name, value, hint):
    with pytest.raises(ConfigError) as info, config.override(**{name: value}):
        pass
    assert name in str(info.value) and hint in str(info.value), str(info.value)


@pytest.mark.parametrize("name,value,hint", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_bad_value_in_torch_compile_options(name, value, hint):
    err = _compile_error(lambda: torch.compile(_f, backend="ember", options={name: value})(torch.randn(4)))
    assert name in str(err) and hint in str(err), str(err)


@pytest.mark.parametrize("name,value,hint", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_bad_value_in_ember_compile_options(name, value, hint):
    with pytest.raises(ConfigError) as info:
        ember.compile(_f, options={name: value})
    assert name in str(info.value) and hint in str(info.value), str(info.value)


@pytest.mark.parametrize("name,value,hint", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_bad_environment_value(monkeypatch, name, value, hint):
    var = f"EMBER_{name.upper()}"
    monkeypatch.setenv(var, str(value))
    with pytest.raises(ConfigError) as info:
        config.get(name)
    assert var in str(info.value) and hint in str(info.value), str(info.value)
    # Compiling reports it too, before doing any work (and even with strict off).
    err = _compile_error(lambda: torch.compile(_f, backend="ember")(torch.randn(4)))
    assert var in str(err) and hint in str(err), str(err)


def test_bad_logs_artifact_in_environment_is_an_error(monkeypatch):
    """EMBER_LOGS=bogus is a settings error, not an ember failure to fall back from."""
    monkeypatch.setenv("EMBER_LOGS", "bogus")
    err = _compile_error(lambda: torch.compile(_f, backend="ember", options={"strict": False})(torch.randn(4)))
    assert "bogus" in str(err) and "graph, fusion, schedule, code, cache" in str(err), str(err)


def test_bad_logs_artifact_in_options_is_an_error():
    err = _compile_error(
        lambda: torch.compile(_f, backend="ember", options={"logs": "code,bogus", "strict": False})(torch.randn(4))
    )
    assert "bogus" in str(err) and "graph, fusion, schedule, code, cache" in str(err), str(err)


def test_unknown_mode():
    err = _compile_error(lambda: ember.compile(_f, mode="warp-speed")(torch.randn(4)))
    assert "warp-speed" in str(err) and "max-autotune" in str(err), str(err)


# -- good values ---------------------------------------------------------------------------


def test_override_nests_and_restores():
    base = config.get("debug")
    with config.override(debug=1):
        assert config.get("debug") == 1
        with config.override(debug=2, strict=True):
            assert config.get("debug") == 2 and config.get("strict") is True
        assert config.get("debug") == 1
    assert config.get("debug") == base


def test_override_restores_after_an_exception():
    base = config.get("fuse")
    with pytest.raises(RuntimeError), config.override(fuse=not base):
        raise RuntimeError("boom")
    assert config.get("fuse") == base


def test_priority_default_environment_override(monkeypatch):
    monkeypatch.delenv("EMBER_DEBUG", raising=False)
    assert config.get("debug") == config.SETTINGS["debug"].default
    monkeypatch.setenv("EMBER_DEBUG", "1")
    assert config.get("debug") == 1
    with config.override(debug=3):
        assert config.get("debug") == 3
    assert config.get("debug") == 1


@pytest.mark.parametrize(
    "raw,value",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("", False),
    ],
)
def test_bool_environment_values(monkeypatch, raw, value):
    monkeypatch.setenv("EMBER_STRICT", raw)
    assert config.get("strict") is value


def test_values_are_converted():
    with config.override(debug="2", strict="yes", persistent_reduction_max="64"):
        assert config.get("debug") == 2
        assert config.get("strict") is True
        assert config.get("persistent_reduction_max") == 64


def test_every_setting_is_documented():
    table = config.describe()
    for s in config.SETTINGS.values():
        assert s.help, s.name
        assert s.env_var == f"EMBER_{s.name.upper()}"
        assert s.env_var in table


def test_codegen_key_has_codegen_settings_only():
    key = config.codegen_key()
    assert {"backend", "cxx", "fuse", "persistent_reduction_max"} <= set(key)
    assert not {"strict", "debug", "logs", "cache_dir"} & set(key)
    with config.override(fuse=False):
        assert config.codegen_key() != key


def test_snapshot_lists_every_setting():
    assert set(config.snapshot()) == set(config.SETTINGS)


def test_options_select_the_backend_for_forward_and_backward():
    """options={...} given to torch.compile apply to the lazily compiled backward graph too."""
    x = torch.randn(4, 8, requires_grad=True)
    compiled = torch.compile(
        lambda t: torch.tanh(t) * 3, backend="ember", options={"backend": "triton", "strict": True}
    )
    with reports() as report:
        y = compiled(x)
        (g,) = torch.autograd.grad(y.sum(), [x])
    x2 = x.detach().requires_grad_(True)
    (ge,) = torch.autograd.grad((torch.tanh(x2) * 3).sum(), [x2])
    assert_close(g, ge, rtol=1e-5, atol=1e-6, what="grad", line="repro: tanh(x)*3 with options backend=triton")
    assert sorted((g.kind, g.backend) for g in report.graphs) == [("backward", "triton"), ("forward", "triton")]


def test_ember_compile_is_torch_compile_with_options():
    x = torch.randn(4, 8)
    with reports() as report:
        out = ember.compile(_f, options={"backend": "cpp", "strict": True})(x)
    assert_close(out, _f(x), rtol=1e-6, atol=1e-6, what="ember.compile", line="repro: ember.compile(x*2+1)")
    assert [g.backend for g in report.graphs] == ["cpp"]


def test_fuse_off_gives_one_kernel_per_realized_value():
    def fn(x):
        return torch.softmax(x, -1)

    x = torch.randn(4, 32)
    with reports() as fused:
        torch.compile(fn, backend="ember", options={"backend": "cpp", "strict": True})(x)
    torch._dynamo.reset()
    with reports() as unfused:
        out = torch.compile(fn, backend="ember", options={"backend": "cpp", "strict": True, "fuse": False})(x)
    assert_close(out, fn(x), rtol=1e-5, atol=1e-6, what="unfused softmax", line="repro: softmax fuse=False")
    assert len(fused.kernels) == 1
    assert len(unfused.kernels) > 1, str(unfused)


def test_changed_lists_the_settings_not_at_their_defaults(monkeypatch):
    monkeypatch.setenv("EMBER_FLEX_ATOMIC_DQ", "0")
    with config.override(strict=True):
        changed = config.changed()
    assert changed["flex_atomic_dq"] is False and changed["strict"] is True
    assert "cache" not in changed and "sdpa_causal_flex" not in changed
