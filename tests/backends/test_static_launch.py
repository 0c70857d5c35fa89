"""The static-launcher path of the Triton backend, without a GPU: which arguments reach the binary.

Triton compiles constexprs (block sizes, ints specialized to 1) into the binary; the launcher must
be given exactly the others, pointers as addresses, plus a null per scratch argument the binary
declares. A fake `torch._C._StaticCudaLauncher` records what ember loads; the launch line is run
against a fake launch to see the arguments it passes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch

from ember import config
from ember.backends import static_launch


class FakeLauncher:
    loaded: ClassVar[list] = []

    @staticmethod
    def _load_kernel(path, name, shared, device):
        FakeLauncher.loaded.append((Path(path).read_bytes(), name, shared, device))
        return (1234, 32, 0)  # torch 2.11's shape: (function, registers, spills)

    @staticmethod
    def _launch_kernel(*args):
        raise AssertionError("the test calls the line's launch itself")


def fake_compiled(signature: dict, **metadata):
    md = SimpleNamespace(name="k", shared=0, num_warps=4, num_ctas=1, **metadata)
    return SimpleNamespace(metadata=md, src=SimpleNamespace(signature=signature), asm={"cubin": b"\x7fELF fake"})


def test_constexprs_dropped_pointers_as_addresses_scratch_null(monkeypatch, tmp_path):
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", FakeLauncher, raising=False)
    with config.override(cache_dir=str(tmp_path)):
        sig = {"in_ptr0": "*bf16", "out_ptr0": "*fp32", "ks0": "i32", "one": "constexpr", "XBLOCK": "constexpr"}
        static = static_launch.from_compiled(fake_compiled(sig, global_scratch_size=0, profile_scratch_size=0), 0)
    assert static is not None and static.function == 1234
    assert FakeLauncher.loaded[-1] == (b"\x7fELF fake", "k", 0, 0)  # the cubin went through a file
    line = static.line(3, ["a0", "buf1", "s0", "1", "1024"])
    seen = []
    namespace = {
        "_static_launch": lambda *a: seen.append(a),
        "a0": torch.ones(2),
        "buf1": torch.ones(2),
        "s0": 7,
        "stream": 99,
    }
    exec(line, namespace)  # noqa: S102 - the generated statement, as the host program runs it
    function, gx, gy, gz, warps, shared, codes, args, stream = seen[0]
    assert (function, gx, gy, gz, warps, shared, stream) == (1234, 3, 1, 1, 4, 0, 99)
    assert codes == "OOiOO"  # two pointers, one i32, then the two scratch pointers
    assert args == (namespace["a0"].data_ptr(), namespace["buf1"].data_ptr(), 7, None, None)


def test_what_it_cannot_launch_goes_to_tritons_launcher(monkeypatch, tmp_path):
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", FakeLauncher, raising=False)
    sig = {"p": "*fp32", "n": "i32"}
    with config.override(cache_dir=str(tmp_path)):
        assert static_launch.from_compiled(fake_compiled(sig, global_scratch_size=64), 0) is None
        assert static_launch.from_compiled(fake_compiled({"d": "nvTmaDesc"}), 0) is None
        two_ctas = fake_compiled(sig)
        two_ctas.metadata.num_ctas = 2
        assert static_launch.from_compiled(two_ctas, 0) is None
        assert static_launch.from_compiled(fake_compiled(sig), 0) is not None
    monkeypatch.delattr(torch._C, "_StaticCudaLauncher")
    assert static_launch.from_compiled(fake_compiled(sig), 0) is None  # a torch without it


def test_a_launch_record_loads_the_same_binary_without_triton(monkeypatch, tmp_path):
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", FakeLauncher, raising=False)
    sig = {"in_ptr0": "*fp32", "ks0": "i32", "XBLOCK": "constexpr"}
    jobs = [("k", ["torch.float32", 4096], {"XBLOCK": 1024}, 4, True)]
    with config.override(cache_dir=str(tmp_path)):
        first = static_launch.from_compiled(fake_compiled(sig), 0)
        records = static_launch.LaunchRecords("module-key", jobs, ("cuda", 90, 32))
        assert records.load() == {}
        records.save({"k": first.record})
        ((name, record),) = records.load().items()  # a warm start: JSON from ember's cache
        again = static_launch.from_record(record, 0)
        assert again is not None and name == "k"
        assert (again.params, again.scratch, again.num_warps, again.shared) == (first.params, 0, 4, 0)
        assert FakeLauncher.loaded[-1] == FakeLauncher.loaded[-2] == (b"\x7fELF fake", "k", 0, 0)
        # Another specialization (an int no longer divisible by 16) is another key: no records.
        other = [("k", ["torch.float32", 4095], {"XBLOCK": 1024}, 4, True)]
        assert static_launch.LaunchRecords("module-key", other, ("cuda", 90, 32)).load() == {}
        # A record whose cubin is gone from the cache loads nothing (the kernel is compiled again).
        assert static_launch.from_record({**record, "cubin": "0" * 64}, 0) is None
