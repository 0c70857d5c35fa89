"""`EMBER_LOGS=recompiles` (frontend/recompiles.py): a recompile logs Dynamo's reason (the guard that
failed) and what ember reused; a first compile, or the artifact off, logs nothing."""

from __future__ import annotations

import io
import logging

import pytest
import torch

import ember


@pytest.fixture
def ember_log():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("ember")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _f(x):
    return torch.relu(x) * 3 + 1


def _calls(sizes, **options):
    compiled = torch.compile(_f, backend="ember", dynamic=False)
    with ember.config.override(backend="cpp", strict=True, **options):
        for n in sizes:
            x = torch.randn(n, 5)
            torch.testing.assert_close(compiled(x), _f(x))


def test_a_recompile_logs_dynamos_reason_and_what_ember_reused(ember_log):
    _calls([4, 6, 4], logs="recompiles")
    text = ember_log.getvalue()
    # One recompile, the second shape's: the first compile has nothing to explain, the third call reuses.
    assert text.count("=== recompiles: recompile [") == 1 and "recompile [0/1]" in text, text
    assert "Dynamo: " in text and "size mismatch at index 0. expected 4, actual 6" in text, text
    assert "ember: inference: scheduled anew, 1 kernels; kernels: " in text, text


def test_quiet_unless_asked(ember_log):
    _calls([4, 6])  # the same libraries (the disk cache's): only the logging differs
    assert ember_log.getvalue() == ""
