"""Imports run one way, down the pipeline: frontend -> pipeline -> aten -> ir, and pipeline ->
schedule -> codegen -> backends -> runtime. Read from every import statement of ember's sources,
those inside functions included: no lower layer imports the entry floor or the pipeline, the
pipeline imports nothing of the entry floor, and the lowerings never import the importer that
drives them (they write through the builder and the registry)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ember

ROOT = Path(ember.__file__).parent
LOWER_LAYERS = ("aten", "ir", "schedule", "codegen", "backends", "runtime")
# What the import floor may use: itself, the IR, and the leaves anyone may import.
ATEN_MAY_IMPORT = ("ember.aten", "ember.ir", "ember.config", "ember.log", "ember.target")


def _imports(path: Path) -> list[str]:
    """The ember modules a source file imports (`from ember import x` as `ember.x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{a.name}" for a in node.names] if node.module == "ember" else [node.module]
    return [name for name in found if name == "ember" or name.startswith("ember.")]


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_lower_layers_import_neither_the_entry_floor_nor_the_pipeline(layer):
    upward = [
        f"{p.relative_to(ROOT.parent)} imports {name}"
        for p in _sources(layer)
        for name in _imports(p)
        if _under(name, "ember.frontend", "ember.pipeline", "ember.tools")
    ]
    assert not upward, "\n".join(upward)


def test_pipeline_imports_nothing_of_the_entry_floor():
    upward = [name for name in _imports(ROOT / "pipeline.py") if _under(name, "ember.frontend", "ember.tools")]
    assert not upward, upward


def test_import_floor_stands_on_the_ir_alone_and_lowerings_never_import_their_driver():
    wrong = []
    for p in _sources("aten"):
        for name in _imports(p):
            if not _under(name, *ATEN_MAY_IMPORT):
                wrong.append(f"{p.relative_to(ROOT.parent)} imports {name}")
            elif p.name != "importer.py" and _under(name, "ember.aten.importer"):
                wrong.append(f"{p.relative_to(ROOT.parent)} imports its driver {name}")
    assert not wrong, "\n".join(wrong)
