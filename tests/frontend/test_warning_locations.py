"""ember's warnings name the user's line that led to them, never ember's or PyTorch's own files,
and say "an inference graph"."""

from __future__ import annotations

import warnings

import torch

import ember
from tests.helpers import assert_close


def _ember_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if str(w.message).startswith("ember")]


def test_attention_matching_failure_warns_at_the_users_line():
    x = torch.randn(4, 8)
    broken = ember.config.override(strict=False, fault_inject="patterns")  # the matcher raises
    with warnings.catch_warnings(record=True) as caught, broken:
        warnings.simplefilter("always")
        out = torch.compile(lambda t: torch.softmax(t * 2, -1), backend="ember")(x)
    assert_close(out, torch.softmax(x * 2, -1), rtol=1e-5, atol=1e-6, what="output", line="patterns broken")
    (w,) = _ember_warnings(caught)
    assert "attention pattern matching failed" in str(w.message), w.message
    assert w.filename == __file__, f"{w.filename}:{w.lineno}"


def test_aot_cache_load_failure_warns_at_the_users_line(tmp_path):
    def fn(t):
        return torch.sigmoid(t) * 3

    x = torch.randn(8, 8)
    with ember.config.override(cache_dir=str(tmp_path), backend="cpp", strict=True):
        torch.compile(fn, backend="ember")(x)  # stored in AOTAutograd's cache
        torch._dynamo.reset()
        # Another machine's CPU, as a cache folder shared between machines sees: the stored
        # schedule was made for another target, so the load fails.
        with warnings.catch_warnings(record=True) as caught, ember.config.override(fault_inject="cpu_arch=another CPU"):
            warnings.simplefilter("always")
            out = torch.compile(fn, backend="ember")(x)
    assert_close(out, fn(x), rtol=1e-6, atol=1e-6, what="output", line="aot cache load failure")
    (w,) = _ember_warnings(caught)
    assert str(w.message).startswith("ember: an inference graph from AOTAutograd's cache did not load"), w.message
    assert w.filename == __file__, f"{w.filename}:{w.lineno}"
