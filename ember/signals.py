"""PyTorch's control-flow exceptions: raised through a backend on purpose and acted on by Dynamo.

Dynamo restarts its analysis when AOTAutograd finds that a Python float it traced as an input must
be specialized (TensorifyScalarRestartAnalysis) and for other RestartAnalysis reasons, skips a
frame on SkipFrame, and breaks the graph where a fake tensor cannot know an output
(data-dependent ops). None of these is a failure of ember's: a fallback that caught one would run
the graph eagerly where PyTorch was about to hand ember a graph it can compile. Both of ember's
fail-safe catches (the pipeline's per graph, the torch.compile backend's) let them through.
"""

from __future__ import annotations

import functools


@functools.cache
def dynamo_control_flow() -> tuple[type[BaseException], ...]:
    """The exception types that must pass through ember's fail-safe catches untouched."""
    from torch._dynamo import exc

    kinds = [getattr(exc, name, None) for name in ("RestartAnalysis", "SkipFrame")]
    kinds += list(getattr(exc, "exceptions_allowed_to_be_fallback", ()))
    if not hasattr(exc, "exceptions_allowed_to_be_fallback"):  # torch releases that predate it
        from torch._subclasses import fake_tensor

        names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
        kinds += [getattr(fake_tensor, n, None) for n in names]
    return tuple(k for k in kinds if isinstance(k, type))
