"""The portable cache file (runtime/portable.py): exported, then imported into an empty cache by a fresh
process, it leaves nothing to compile and the results are eager's; a damaged, altered or foreign file
is refused with a message saying why, and imports nothing."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ember
from ember.runtime.cache import DiskCache
from ember.runtime.portable import MAGIC, CacheFileError, import_cache, read_cache_file

ROOT = Path(__file__).resolve().parents[2]

# Run in the parent and in a fresh child: a seeded model's training step compiled with the C++ backend.
STEP = """
import json, sys, torch, ember
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
x = torch.randn(5, 8)
if len(sys.argv) > 1:
    ember.load_cache(sys.argv[1])
before = ember.stats.snapshot()
from ember.report import collecting
with collecting() as report, ember.config.override(backend="cpp", strict=True):
    out = torch.compile(model, backend="ember")(x)
    out.sum().backward()
from torch._dynamo.utils import counters
print("RESULT " + json.dumps({
    "out": out.tolist(), "grad": model[0].weight.grad.tolist(), "counted": ember.stats.delta(before),
    "stages": [sorted(g.stage_seconds) for g in report.graphs],
    "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
}))
"""


def _run_step(env: dict, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", STEP, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-2000:]
    return {**json.loads(lines[-1][len("RESULT ") :]), "stderr": proc.stderr}


def _assert_eager(result: dict) -> None:
    model, x = _model_and_input()
    ref = model(x)
    ref.sum().backward()
    torch.testing.assert_close(torch.tensor(result["out"]), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(result["grad"]), model[0].weight.grad, rtol=1e-5, atol=1e-5)


def _env(root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), EMBER_CACHE_DIR=str(root / "ember"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "torch")
    return env


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A cache file of the step's compile, made in this process with empty caches of its own
    (ember's, and torch's, where AOTAutograd keeps ember's graphs)."""
    root = tmp_path_factory.mktemp("exporter")
    # A process that has run Inductor (its code generators registered), as a test before this one may have:
    # ember's keys hold nothing of them, so the fresh process that imports the file finds its entries.
    from torch._inductor.codegen.common import init_backend_registration

    init_backend_registration()
    torch_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "torch")
    torch._dynamo.reset()
    try:
        with ember.config.override(cache_dir=str(root / "ember"), backend="cpp", strict=True):
            before = ember.stats.snapshot()
            model, x = _model_and_input()
            torch.compile(model, backend="ember")(x).sum().backward()
            assert ember.stats.delta(before).get("cpp_builds", 0) >= 2  # forward and backward built
            path = root / "cache.bin"
            summary = ember.save_cache(str(path))
    finally:
        torch._dynamo.reset()
        _restore("TORCHINDUCTOR_CACHE_DIR", torch_dir)
    assert summary.entries >= 4 and path.read_bytes().startswith(MAGIC)
    assert len(read_cache_file(path)[0]["aot_files"]) == 1  # AOTAutograd's entry of the step
    return path


def _restore(var: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


def _model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return model, torch.randn(5, 8)


def test_a_fresh_process_that_imports_the_file_compiles_nothing_and_matches_eager(exported, tmp_path):
    result = _run_step(_env(tmp_path), str(exported))
    assert result["counted"].get("cpp_builds", 0) == 0, result["counted"]
    # AOTAutograd's entries came with the file, vouched for: tracing is skipped too.
    assert result["aot_hits"] == 1 and "did not load" not in result["stderr"], result
    assert result["stages"] and all("cached schedule" in stages for stages in result["stages"]), result["stages"]
    _assert_eager(result)


def _rewritten(data: bytes, edit) -> bytes:
    """The file with its header edited by `edit(header)` and its checksum made right again: a file
    crafted to pass the outer check."""
    body = data[len(MAGIC) + 32 :]
    (size,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + size])
    edit(header)
    head = json.dumps(header).encode()
    body = struct.pack("<Q", len(head)) + head + body[8 + size :]
    return MAGIC + hashlib.sha256(body).digest() + body


def _set_torch(header):
    header["identity"]["torch"] = "1.0.0"


def _move_span(header):
    entry = header["entries"][0]
    name = next(iter(entry["files"]))
    entry["files"][name][0] += 1  # the bytes it names no longer match its checksum


def _entries_not_a_list(header):
    header["entries"] = 7


def _escape_name(header):
    entry = header["entries"][0]
    entry["files"]["../escape"] = entry["files"].pop(next(iter(entry["files"])))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum does not match"),
        (lambda d: b"PK" + d[2:], "not an ember cache file"),
        (lambda d: _rewritten(d, _set_torch), "another setup"),
        (lambda d: _rewritten(d, _move_span), "does not match its checksum"),
        (lambda d: _rewritten(d, _escape_name), "bad file record"),
        (lambda d: _rewritten(d, _entries_not_a_list), "lists no entries"),
    ],
    ids=["flipped-bit", "not-ember", "other-torch", "inner-checksum", "path-in-name", "bad-header"],
)
def test_a_damaged_or_foreign_file_is_refused_and_imports_nothing(exported, tmp_path, damage, message):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(damage(exported.read_bytes()))
    cache = DiskCache(tmp_path / "cache")
    with pytest.raises(CacheFileError, match=message):
        import_cache(bad, cache)
    assert not (tmp_path / "cache").exists()
    # The command line says the same and fails.
    from ember.tools.cli import main

    with ember.config.override(cache_dir=str(tmp_path / "cache")):
        assert main(["cache", "import", str(bad)]) == 1
    assert not (tmp_path / "cache").exists()


def test_an_aotautograd_entry_no_voucher_names_is_not_loaded(exported, tmp_path):
    """A file whose vouchers were taken out (its checksum made right again): its AOTAutograd entry
    is found under the adopted name, but neither signed with this cache's key nor vouched for, so
    ember refuses it before unpickling and compiles the graph anew (from the imported schedule)."""

    def drop_vouchers(header):
        header["entries"] = [e for e in header["entries"] if e["kind"] != "vouch"]

    crafted = tmp_path / "unvouched.bin"
    crafted.write_bytes(_rewritten(exported.read_bytes(), drop_vouchers))
    torch_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "torch")
    torch._dynamo.reset()
    try:
        with ember.config.override(cache_dir=str(tmp_path / "ember"), backend="cpp", strict=True):
            ember.load_cache(str(crafted))
            before = ember.stats.snapshot()
            model, x = _model_and_input()
            with pytest.warns(UserWarning, match="from AOTAutograd's cache did not load.*does not match ember's key"):
                out = torch.compile(model, backend="ember")(x)
            out.sum().backward()
            assert ember.stats.delta(before).get("cpp_builds", 0) == 0  # the imported libraries
    finally:
        torch._dynamo.reset()
        _restore("TORCHINDUCTOR_CACHE_DIR", torch_dir)
    ref_model, ref_x = _model_and_input()
    ref = ref_model(ref_x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[0].weight.grad, ref_model[0].weight.grad, rtol=1e-5, atol=1e-5)


def test_the_command_line_exports_and_imports(exported, tmp_path, capsys):
    from ember.tools.cli import main

    again = tmp_path / "again.bin"
    with ember.config.override(cache_dir=str(exported.parent / "ember")):
        assert main(["cache", "export", str(again)]) == 0
    assert "exported " in capsys.readouterr().out
    _, entries = read_cache_file(again)
    assert sorted((k, key) for k, key, _ in entries) == sorted((k, key) for k, key, _ in read_cache_file(exported)[1])
    with ember.config.override(cache_dir=str(tmp_path / "cache")):
        assert main(["cache", "import", str(again)]) == 0
        assert f"imported {len(entries)} entries" in capsys.readouterr().out
        assert all(DiskCache().get(kind, key) is not None for kind, key, _ in entries)
        assert main(["cache", "import"]) == 2  # no file named
