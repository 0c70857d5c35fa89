"""`ember cache clear` deletes only what is ember's: the entries and key of a cache folder that
ember made (it holds ember's CACHEDIR.TAG), nothing of any other folder."""

from __future__ import annotations

import os

import pytest

from ember.runtime.cache import MARKER, DiskCache
from ember.tools.cli import main as cli

KEY = "ab" * 32


def _tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _clear(root, monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(root))
    code = cli(["cache", "clear"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_clear_removes_ember_s_entries_and_key_and_nothing_else(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    cache = DiskCache(root)
    cache.put("cpp", KEY, {"graph.so": b"x"})
    cache.put("schedule", KEY, {"schedule.pickle": b"y"})
    key = cache.secret("aot-key")
    (root / "torchinductor").mkdir()  # someone else's, inside ember's folder
    (root / "notes.txt").write_text("mine")
    code, out, _ = _clear(root, monkeypatch, capsys)
    assert code == 0 and "aot-key, cpp, schedule" in out, out
    assert _tree(root) == [MARKER, "notes.txt", "torchinductor"]
    assert cache.get("cpp", KEY) is None
    assert cache.secret("aot-key") != key, "the old key survived: AOTAutograd's entries would still load"


@pytest.mark.parametrize("how", ["no_marker", "another_tools_tag", "symlinked_root"])
def test_clear_refuses_a_folder_that_is_not_ember_s(tmp_path, monkeypatch, capsys, how):
    folder = tmp_path / "project"
    folder.mkdir(mode=0o700)
    (folder / "thesis.tex").write_text("years of work")
    (folder / "cpp").mkdir()  # named like an ember folder, but not ember's
    (folder / "cpp" / "main.cpp").write_text("int main() {}")
    root = folder
    if how == "another_tools_tag":
        (folder / MARKER).write_text("Signature: 8a477f597d28d172789f06886806bc55\n# made by another tool\n")
    elif how == "symlinked_root":
        DiskCache(folder / "real").put("cpp", KEY, {"graph.so": b"x"})  # an ember cache, behind a link
        root = tmp_path / "link"
        root.symlink_to(folder / "real")
    before = _tree(folder)
    code, out, err = _clear(root, monkeypatch, capsys)
    assert code == 1 and "nothing was deleted" in err and str(root) in err, (out, err)
    assert _tree(folder) == before, "ember cache clear deleted from a folder that is not ember's"
    assert (folder / "thesis.tex").read_text() == "years of work"


def test_clear_of_a_missing_folder_says_so(tmp_path, monkeypatch, capsys):
    code, out, _ = _clear(tmp_path / "none", monkeypatch, capsys)
    assert code == 0 and "nothing to clear" in out
    assert not (tmp_path / "none").exists()


def test_cache_help_says_what_path_and_clear_do(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["cache", "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "print the folder the disk cache lives in" in text
    assert "delete ember's entries" in text and MARKER in text


def test_path_prints_the_configured_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "somewhere"))
    assert cli(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "somewhere")
    assert not os.path.exists(tmp_path / "somewhere")
