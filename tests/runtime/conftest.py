"""The `recorder` fixture: CUDA graphs compiled in a test record through a fake recorder (cudagraph_fakes.py)."""

from __future__ import annotations

import pytest

from ember.runtime import cudagraphs as cg
from tests.runtime.cudagraph_fakes import FakeRecorder


@pytest.fixture
def recorder():
    with cg.use_recorder(FakeRecorder()) as r:
        yield r
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()  # PyTorch's step counter, which mark_step_begin moved
