"""ember's logging: `EMBER_DEBUG` levels, named artifacts (`EMBER_LOGS=fusion,code`) and warnings.

Levels: 1 prints one summary line per compiled graph; 2 adds the generated source;
3 adds the IR after each pass; 4 adds each kernel's machine code (assembly; PTX and SASS).
Artifacts select one kind of output regardless of level.
Output goes to stderr through the `ember` logger so users can redirect it. Warnings (a graph
run eagerly) name the user's line that led to them, not ember's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable, Iterable

from ember import config

ARTIFACTS = config.LOG_ARTIFACTS
# The debug level at which each artifact turns on without being named in EMBER_LOGS.
_ARTIFACT_LEVEL = {
    "code": 2,
    "graph": 3,
    "fusion": 3,
    "schedule": 3,
    "cache": 3,
    "patterns": 1,
    "cudagraphs": 1,
    "recompiles": 1,
    "asm": 4,
}

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


# Preambles (includes, helper functions: everything a generated module holds before its first
# kernel) already printed in this process, by content hash -> the title they were printed under.
_preambles_shown: dict[str, str] = {}
_preambles_lock = threading.Lock()


def generated_source(title: str, source: str, kernel_sources: Iterable[str]) -> None:
    """The `code` artifact of one generated module: its preamble is printed with the first graph
    that has it, and later graphs refer to it, so EMBER_DEBUG=2 shows each graph's own kernels."""
    if not enabled("code"):
        return
    first = next((s for s in kernel_sources if s and s in source), None)
    cut = source.find(first) if first is not None else 0
    preamble, rest = source[:cut], source[cut:]
    if preamble.strip():
        digest = hashlib.sha256(preamble.encode()).hexdigest()
        with _preambles_lock:
            shown_under = _preambles_shown.get(digest)
            _preambles_shown.setdefault(digest, title)
        if shown_under is not None:
            lines = preamble.strip("\n").count("\n") + 1
            preamble = f"(preamble: the {lines} lines printed above with '{shown_under}', once per process)\n\n"
    artifact("code", title, preamble + rest)


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


@functools.lru_cache(maxsize=1)
def _where_code_lives() -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(PyTorch's and ember's package folders, installed libraries' folders, the standard library's)."""
    import torch

    ember_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep  # ember/, where this module lives
    paths = sysconfig.get_paths()
    installed = tuple({os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib")})
    return (_package_dir(torch), ember_dir), installed, os.path.abspath(paths["stdlib"]) + os.sep


# Code objects Python or PyTorch generate at run time, which no user wrote.
_GENERATED_FILES = ("<frozen ", "<eval_with_key>", "<ember host program>")


def _is_users(filename: str, where: tuple) -> bool:
    torch_and_ember, installed, stdlib = where
    if filename.startswith(_GENERATED_FILES):
        return False
    if filename.startswith("<"):
        return True  # `python -c`, a notebook cell, the interactive prompt
    path = os.path.abspath(filename)
    if path.startswith(torch_and_ember):
        return False
    # site-packages lies inside the standard library's folder: an installed library is the user's.
    return path.startswith(installed) or not path.startswith(stdlib)


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning issued by this function's caller name the innermost
    frame of the user's own code: the first one outside ember, PyTorch and Python's standard
    library (another installed library counts as the user's). 2, the caller's caller, when no
    frame is the user's."""
    where = _where_code_lives()
    frame, level = sys._getframe(2), 2
    while frame is not None:
        if _is_users(frame.f_code.co_filename, where):
            return level
        frame, level = frame.f_back, level + 1
    return 2


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)\n([^\n]*)')


def innermost_frame(stack_trace: str) -> tuple[str, str]:
    """("file:line", the line's code) of the innermost frame of an FX node's `stack_trace`
    (the user's line Dynamo recorded for the op); ("", "") when it names none."""
    frames = _FRAME.findall(stack_trace or "")
    if not frames:
        return "", ""
    torch_dir = _where_code_lives()[0][0]
    # The innermost frame outside PyTorch: the user's call of F.layer_norm, not layer_norm's body.
    path, line, _, code = next((f for f in reversed(frames) if not f[0].startswith(torch_dir)), frames[-1])
    return f"{path}:{line}", code.strip()


def warn(message: str) -> None:
    """`warnings.warn(message)`, attributed to the user's line that led here (user_stacklevel)."""
    warnings.warn(message, stacklevel=user_stacklevel())
