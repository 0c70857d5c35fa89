"""One workload instance, as the harness runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Built:
    """fn(*inputs) computes the workload; autocast names a dtype to autocast to.

    A workload that changes its own state (an optimizer step) gives `reset`, which puts the state
    back as it was built, run before each call whose result is checked, and `reference`, its
    result computed in float64 from that state. `bytes`: the bytes the step must move at least,
    where the inputs and outputs do not say (an optimizer reads and writes parameters, gradients
    and states it holds itself)."""

    fn: Callable
    inputs: tuple
    autocast: torch.dtype | None = None
    reset: Callable[[], None] | None = None
    reference: Callable[[], list] | None = None
    bytes: int | None = None
