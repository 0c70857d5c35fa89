"""ember's logging: `EMBER_DEBUG` levels and named artifacts (`EMBER_LOGS=fusion,code`).

Levels: 1 prints one summary line per compiled graph; 2 adds the generated source;
3 adds the IR after each pass. Artifacts select one kind of output regardless of level.
Output goes to stderr through the `ember` logger so users can redirect it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from ember import config

ARTIFACTS = config.LOG_ARTIFACTS
# The debug level at which each artifact turns on without being named in EMBER_LOGS.
_ARTIFACT_LEVEL = {"code": 2, "graph": 3, "fusion": 3, "schedule": 3, "cache": 3, "patterns": 1}

logger = logging.getLogger("ember")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[ember] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _named_artifacts() -> set[str]:
    return {n.strip() for n in config.get("logs").split(",") if n.strip()}  # validated by config


def enabled(artifact: str) -> bool:
    """Whether `artifact` should be printed now."""
    return artifact in _named_artifacts() or config.get("debug") >= _ARTIFACT_LEVEL[artifact]


def summary(message: str) -> None:
    """A one-line per-graph summary (EMBER_DEBUG>=1)."""
    if config.get("debug") >= 1:
        logger.info(message)


def artifact(name: str, title: str, body: str | Callable[[], str]) -> None:
    """Print an artifact if enabled; pass a callable for bodies that cost something to build."""
    if enabled(name):
        logger.info("=== %s: %s ===\n%s", name, title, body() if callable(body) else body)
