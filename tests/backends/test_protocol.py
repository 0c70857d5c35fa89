"""Both backends implement the Backend protocol (backends/base.py) and say what they are in one
Target (ember/target.py), which the pipeline reads once and hands to the passes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import ember
from ember import config
from ember.backends.base import Backend
from ember.backends.cpp import CppBackend
from ember.backends.triton import TritonBackend
from ember.pipeline import select_backend
from ember.target import INTERPRETER_SM_COUNT, SplitHeuristics, Target


@pytest.mark.parametrize("name", ["cpp", "triton"])
def test_each_backend_is_a_backend_and_makes_its_target(name):
    with config.override(backend=name):
        backend = select_backend(torch.device("cpu"))
    assert isinstance(backend, Backend), type(backend)
    target = backend.target()
    assert isinstance(target, Target) and target.name == name == backend.name
    assert target is backend.target()  # made once, with the backend
    assert target.bandwidth > 0 and target.flop_rate > 0  # measured and looked up, for reports
    assert backend.full_source == "" and backend.sources == {}


def test_what_each_target_renders():
    cpp, triton = CppBackend().target(), TritonBackend().target()
    assert not cpp.online_softmax and not cpp.column_partials and cpp.row_programs == 0
    assert cpp.heuristics.split == SplitHeuristics()
    assert callable(CppBackend().gemm_chooser)  # float32 products of static sizes: ember's C++ template
    # Triton's interpreter (these tests) schedules as a GPU of INTERPRETER_SM_COUNT SMs would.
    assert triton.online_softmax and triton.interpreted and triton.sm_count == INTERPRETER_SM_COUNT
    assert triton.row_programs == INTERPRETER_SM_COUNT and triton.column_partials
    assert triton.heuristics.split.partials > cpp.heuristics.split.partials
    assert callable(TritonBackend().gemm_chooser)


@pytest.mark.parametrize("programs,expected", [(0, INTERPRETER_SM_COUNT), (7, 7), (-1, 0)])
def test_row_programs_follow_the_setting(programs, expected):
    with config.override(column_partial_programs=programs):
        target = TritonBackend().target()
    assert target.row_programs == expected and target.column_partials == (expected > 0)


def test_triton_without_a_gpu_or_its_interpreter_names_the_way_out(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ember.config.ConfigError, match="backend=triton needs a CUDA GPU") as e:
        TritonBackend(torch.device("cpu"))
    assert "TRITON_INTERPRET=1" in str(e.value) and "backend=cpp" in str(e.value)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return found


def test_the_backends_import_one_way():
    """No module of ember/backends imports one that imports it back (GEMM tuning is a stage the
    Triton backend calls, handing it the loader it needs), and none imports the pipeline."""
    folder = Path(ember.__file__).parent / "backends"
    modules = {f"ember.backends.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {name: {m for m in _imports(p) if m in modules and m != name} for name, p in modules.items()}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, seen | {m})) for m in graph[start])

    circles = sorted(name for name in graph if reaches(name, name, {name}))
    assert not circles, {name: sorted(graph[name]) for name in circles}
    upward = sorted(name for name, p in modules.items() if any(m.startswith("ember.pipeline") for m in _imports(p)))
    assert not upward, upward
