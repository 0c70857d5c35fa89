"""C++ builds on a precompiled header of the prelude's standard headers (backends/cpp_headers.py):
the same libraries, used only once ready and only where they apply, never stale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import ember
from ember.backends import cpp_headers
from ember.backends.cpp import PRELUDE_INCLUDES, toolchain_identity

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="needs g++")  # the C++ backend's own requirement


@pytest.fixture(autouse=True)
def _fresh_headers(monkeypatch):
    """Each test starts with no header made or started in this process (header builds that earlier tests
    started have ended, so none writes into this test's tables)."""
    cpp_headers.wait()
    monkeypatch.setattr(cpp_headers, "_ready", {})
    monkeypatch.setattr(cpp_headers, "_started", set())
    monkeypatch.setattr(cpp_headers, "_threads", [])


def _logging_compiler(tmp_path: Path, fail_headers: bool = False) -> tuple[Path, Path]:
    log = tmp_path / "cxx.log"
    wrapper = tmp_path / "logging-g++"
    refuse = 'case "$*" in *c++-header*) exit 1;; esac\n' if fail_headers else ""
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n{refuse}exec "{GXX}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def _library_builds(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if "-shared" in line.split()]


def _compile(fn, x, **settings):
    torch._dynamo.reset()
    with ember.config.override(strict=True, backend="cpp", **settings):
        out = torch.compile(fn, backend="ember")(x)
    torch.testing.assert_close(out, fn(x))


def _first(x):
    return torch.softmax(x * 3, -1) - 1


def _second(x):
    return torch.tanh(x).sum(0) * x.exp().amax(0)


def _disassembly(cache: Path) -> str:
    (library,) = cache.glob("cpp/*/*/graph.so")
    cmd = ["objdump", "-d", "--no-show-raw-insn", str(library)]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return text.split("Disassembly of section", 1)[1]  # past the file name


def test_a_build_after_the_header_is_ready_takes_it_and_makes_the_same_library(tmp_path):
    cxx, log = _logging_compiler(tmp_path)
    x = torch.randn(16, 40)
    _compile(_first, x, cxx=str(cxx), cache_dir=str(tmp_path / "a"))  # starts the header's build
    cpp_headers.wait()
    assert list((tmp_path / "a" / "pch").glob("*/*/header.gch")), "the header was not kept in the disk cache"
    _compile(_second, x, cxx=str(cxx), cache_dir=str(tmp_path / "b"))
    first, second = _library_builds(log)
    assert "-include" not in first  # the first build did not wait for the header
    assert "-include" in second and "-Winvalid-pch" in second
    header = Path(second[second.index("-include") + 1])
    assert header.read_text() == PRELUDE_INCLUDES and Path(str(header) + ".gch").exists()

    _compile(_second, x, cxx=str(cxx), cache_dir=str(tmp_path / "c"), cpp_precompiled_header=False)
    assert "-include" not in _library_builds(log)[-1]
    if shutil.which("objdump"):
        assert _disassembly(tmp_path / "b") == _disassembly(tmp_path / "c")


def test_a_stale_header_is_built_anew_once_and_found_by_the_next_process(tmp_path, monkeypatch):
    cxx, log = _logging_compiler(tmp_path)
    settings = {"cxx": str(cxx), "cache_dir": str(tmp_path / "cache")}
    _compile(_first, torch.randn(8, 8), **settings)
    cpp_headers.wait()
    (key,) = [k for k in cpp_headers._ready if k[0] == str(cxx)]  # (cxx, flags, includes, arch)
    lookup = (str(cxx), list(key[1]), key[2], key[3], toolchain_identity(str(cxx)))
    (entry,) = (tmp_path / "cache" / "pch").glob("*/*")
    stamps = json.loads((entry / "headers.json").read_text())
    # A header file updated since the entry was made: its size, as the process sees it now, differs.
    first = next(iter(stamps))
    real_now, real_stamps = cpp_headers._now, cpp_headers._stamps

    def updated(values: list, paths) -> list:
        return [[v[0] + 1, v[1]] if p == first and v else v for p, v in zip(paths, values)]

    monkeypatch.setattr(cpp_headers, "_now", lambda s: updated(real_now(s), list(s)))
    monkeypatch.setattr(cpp_headers, "_stamps", lambda ps: dict(zip(ps, updated(list(real_stamps(ps).values()), ps))))
    header_builds = [sum("c++-header" in line for line in log.read_text().splitlines())]
    for _ in range(2):  # two processes' lookups
        with ember.config.override(**settings):
            header = cpp_headers._load_or_build(*lookup)
        header_builds.append(sum("c++-header" in line for line in log.read_text().splitlines()))
        assert header is not None and Path(f"{header}.gch").exists()
    assert header_builds == [1, 2, 2]  # stale: built anew once; the next lookup found that one
    assert len(list((tmp_path / "cache" / "pch").glob("*/*"))) == 2


def test_a_header_gone_or_failing_is_dropped_and_the_build_succeeds(tmp_path):
    cxx, log = _logging_compiler(tmp_path)
    x = torch.randn(16, 40)
    settings = {"cxx": str(cxx), "cache": False}
    _compile(_first, x, **settings)
    cpp_headers.wait()
    ((key, header),) = [(k, h) for k, h in cpp_headers._ready.items() if k[0] == str(cxx)]
    # Its private copy removed (a cleaner of the temporary folder): not used, read again.
    shutil.rmtree(header.parent)
    _compile(_second, x, **settings)
    assert "-include" not in _library_builds(log)[-1]
    cpp_headers.wait()
    header = cpp_headers._ready[key]
    # A damaged copy (cut short: g++ fails; other damage: g++ warns under -Winvalid-pch and parses the
    # headers): the build succeeds (built again without it where g++ failed), and it is not used again.
    gch = Path(f"{header}.gch")
    gch.write_bytes(gch.read_bytes()[:4096])
    builds = len(_library_builds(log))
    _compile(lambda t: torch.cos(t) * 5, x, **settings)
    assert "-include" in _library_builds(log)[builds]
    assert key not in cpp_headers._ready and key in cpp_headers._started
    _compile(lambda t: torch.sin(t) * 7, x, **settings)
    assert "-include" not in _library_builds(log)[-1]


def test_a_header_that_cannot_be_built_leaves_builds_parsing_the_headers(tmp_path):
    cxx, log = _logging_compiler(tmp_path, fail_headers=True)
    x = torch.randn(16, 40)
    _compile(_first, x, cxx=str(cxx), cache_dir=str(tmp_path / "cache"))
    cpp_headers.wait()
    _compile(_second, x, cxx=str(cxx), cache_dir=str(tmp_path / "cache"))
    assert any("c++-header" in line for line in log.read_text().splitlines())  # it was tried
    assert all("-include" not in words for words in _library_builds(log))
    assert not (tmp_path / "cache" / "pch").exists()


def test_the_header_applies_only_to_gcc_sources_that_begin_with_its_includes():
    source = PRELUDE_INCLUDES + "\nint f() { return 1; }\n"
    args = ("g++", ["-O3"], PRELUDE_INCLUDES)
    assert cpp_headers.flags_for(*args, source, "cpu", "g++ 12", gcc=False) == []
    assert cpp_headers.flags_for(*args, "#include <vector>\n" + source, "cpu", "g++ 12", gcc=True) == []
    with ember.config.override(cpp_precompiled_header=False):
        assert cpp_headers.flags_for(*args, source, "cpu", "g++ 12", gcc=True) == []
    assert not cpp_headers._started  # none of these started a build


def test_a_stored_header_is_stale_once_a_header_file_it_read_changes(tmp_path):
    read = tmp_path / "cmath"
    read.write_text("// a header\n")
    stamps = cpp_headers._stamps([str(read)])
    assert cpp_headers._unchanged(stamps)
    read.write_text("// a header, updated\n")
    assert not cpp_headers._unchanged(stamps)
    os.remove(read)
    assert not cpp_headers._unchanged(stamps)
    assert not cpp_headers._unchanged({})


def test_the_prelude_begins_with_its_standard_headers():
    assert PRELUDE_INCLUDES.startswith("#include <algorithm>\n#include <cmath>\n")
    assert cpp_headers.include_block("\n#include <a>\n#include <b>\nint x;\n#include <c>\n") == (
        "#include <a>\n#include <b>\n"
    )
