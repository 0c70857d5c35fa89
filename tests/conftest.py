"""Test-session setup shared by every ember test.

* Triton runs through its CPU interpreter: TRITON_INTERPRET must be set before triton is
  imported anywhere, so it is set here, at conftest import time.
* ember's disk cache, and Inductor's (where AOTAutograd's cache keeps ember's graphs), live in a
  temporary directory for the whole session, never in ~/.cache or /tmp/torchinductor_* (tests
  that need a fresh cache override `cache_dir` themselves).
* Every test starts from a fresh Dynamo state and the same random seed.
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
_SESSION_CACHE = tempfile.mkdtemp(prefix="ember-test-cache-")
os.environ["EMBER_CACHE_DIR"] = _SESSION_CACHE
# AOTAutograd's cache (which keeps ember's graphs: frontend/aot_cache.py) and Inductor's, per session.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_SESSION_CACHE, "torchinductor")

import pytest
import torch
import torch._dynamo


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def session_cache_dir() -> str:
    return _SESSION_CACHE
