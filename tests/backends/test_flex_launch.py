"""How flex kernels are launched on a GPU, with stand-ins for Triton's JIT function and compiled
kernel: the direct launch after the first call, fewer pipeline stages where shared memory runs out,
and the smaller tile for a BlockMask that lists few keys a row."""

from __future__ import annotations

import pytest
import torch

from ember.backends.direct_launch import DirectLaunch, launch_fitting
from ember.backends.flex import forward_launch
from ember.codegen.flex_triton import FlexLaunch
from ember.ir.flex import FlexSpec
from ember.target import Target


class _Compiled:
    def __init__(self, log):
        self.log = log
        self.function, self.packed_metadata = "cufunction", "meta"

    def run(self, *args):
        self.log.append(("direct", args))


class _Jit:
    """Triton's JITFunction as DirectLaunch uses it: arg_names, and kernel[grid](...) compiling."""

    def __init__(self, fail_above_stages: int = 99):
        self.arg_names = ["X", "n", "scale", "A", "B"]
        self.log, self.fail_above = [], fail_above_stages

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages, **consts):
            if num_stages > self.fail_above:
                from triton.runtime.errors import OutOfResources

                raise OutOfResources(300000, 232448, "shared memory")
            self.log.append(("jit", grid, args, consts, num_warps, num_stages))
            return _Compiled(self.log)

        return launch


def test_first_call_compiles_then_the_same_specialization_launches_directly(monkeypatch):
    """Through Triton's launcher, where torch's static one cannot take the kernel."""
    import ember.backends.triton as triton_backend
    from ember.backends import static_launch

    monkeypatch.setattr(triton_backend, "current_stream", lambda device: 7)
    monkeypatch.setattr(static_launch, "from_compiled", lambda compiled, device: None)
    jit = _Jit()
    fn = DirectLaunch(jit, False)
    x = torch.zeros(64)
    fn((4, 2), (x,), (10, 0.5), {"A": 1, "B": 2}, 4, 3)
    fn((4, 2), (x,), (10, 0.5), {"A": 1, "B": 2}, 4, 3)
    assert [entry[0] for entry in jit.log] == ["jit", "direct"]
    # The grid in three, the stream, the handles, no hooks, then every parameter in order.
    assert jit.log[1][1] == (4, 2, 1, 7, "cufunction", "meta", None, None, None, x, 10, 0.5, 1, 2)
    # Another size Triton specializes alike (not 1, not a multiple of 16) and another float share it.
    fn((4, 2), (x,), (11, 0.25), {"A": 1, "B": 2}, 4, 3)
    assert jit.log[2][1][10:12] == (11, 0.25)
    # A multiple of 16, a misaligned pointer or other constants compile (and specialize) again.
    fn((4, 2), (x,), (16, 0.5), {"A": 1, "B": 2}, 4, 3)
    fn((4, 2), (x[1:],), (10, 0.5), {"A": 1, "B": 2}, 4, 3)
    fn((4, 2), (x,), (10, 0.5), {"A": 1, "B": 4}, 4, 3)
    assert [entry[0] for entry in jit.log] == ["jit", "direct", "direct", "jit", "jit", "jit"]


def test_a_kernel_whose_shared_memory_does_not_fit_compiles_with_fewer_stages(monkeypatch):
    import ember.backends.triton as triton_backend
    from ember.backends import static_launch

    monkeypatch.setattr(triton_backend, "current_stream", lambda device: 0)
    monkeypatch.setattr(static_launch, "from_compiled", lambda compiled, device: None)
    jit = _Jit(fail_above_stages=1)
    launch = launch_fitting(
        DirectLaunch(jit, False), (1,), (torch.zeros(4),), (1, 1.0), {"A": 1, "B": 2}, FlexLaunch(128, 64, 8, 3)
    )
    assert launch == FlexLaunch(128, 64, 8, 1)
    assert [entry[5] for entry in jit.log] == [1]
    with pytest.raises(Exception, match="shared memory"):
        launch_fitting(
            DirectLaunch(_Jit(fail_above_stages=0), False),
            (1,),
            (torch.zeros(4),),
            (1, 1.0),
            {"A": 1, "B": 2},
            FlexLaunch(128, 64, 8, 3),
        )


def test_torch_static_launcher_gets_addresses_and_the_scalars_triton_kept(monkeypatch):
    """Through torch's static launcher: pointers as addresses, the integer Triton made a constant
    (equal to 1) left out, the constants left out, the scratch pointers as None."""
    import ember.backends.triton as triton_backend
    from ember.backends import static_launch

    calls = []
    # Parameters X, n, scale, A, B: n specialized away (a constexpr), A and B the kernel's constants.
    fake = static_launch.StaticLaunch(
        launch=lambda *args: calls.append(args),
        function=99,
        num_warps=4,
        shared=1024,
        params=("O", None, "f", None, None),
        scratch=1,
        record={},
    )
    monkeypatch.setattr(triton_backend, "current_stream", lambda device: 5)
    monkeypatch.setattr(static_launch, "from_compiled", lambda compiled, device: fake)
    jit = _Jit()
    fn = DirectLaunch(jit, False)
    x = torch.zeros(64)
    fn((3,), (x,), (1, 0.5), {"A": 1, "B": 2}, 4, 3)
    fn((3,), (x,), (1, 0.5), {"A": 1, "B": 2}, 4, 3)
    assert [entry[0] for entry in jit.log] == ["jit"]
    assert calls == [(99, 3, 1, 1, 4, 1024, "OfO", (x.data_ptr(), 0.5, None), 5)]


def test_a_binary_no_launcher_can_load_keeps_launching_through_triton(monkeypatch):
    from ember.backends import static_launch

    def refuse(compiled, device):
        raise RuntimeError("CUDA driver refused the module")

    monkeypatch.setattr(static_launch, "from_compiled", refuse)
    jit = _Jit()
    fn = DirectLaunch(jit, False)
    for _ in range(2):
        fn((1,), (torch.zeros(4),), (3, 0.5), {"A": 1, "B": 2}, 4, 3)
    assert [entry[0] for entry in jit.log] == ["jit", "jit"]


def test_repeated_arguments_skip_specializing(monkeypatch):
    """A step's calls repeat their sizes and strides: after the first, the launcher is found by the
    arguments' values without specializing each integer again; new values specialize once."""
    import ember.backends.triton as triton_backend
    from ember.backends import direct_launch, static_launch

    monkeypatch.setattr(triton_backend, "current_stream", lambda device: 0)
    monkeypatch.setattr(static_launch, "from_compiled", lambda compiled, device: None)
    specialized = []
    real = direct_launch._specialized
    monkeypatch.setattr(direct_launch, "_specialized", lambda x: specialized.append(x) or real(x))
    jit = _Jit()
    fn = DirectLaunch(jit, False)
    x = torch.zeros(64)
    for _ in range(3):
        fn((1,), (x,), (10, 0.5), {"A": 1, "B": 2}, 4, 3)
    assert len(specialized) == 4  # the compiling call and the first direct one, two scalars each
    fn((1,), (x,), (11, 0.5), {"A": 1, "B": 2}, 4, 3)
    assert len(specialized) == 6
    assert [entry[0] for entry in jit.log] == ["jit", "direct", "direct", "direct"]


def test_a_bound_launch_repeats_with_addresses_alone(monkeypatch):
    """A BoundLaunch (a flex kernel's call plan) compiles on its first call, then launches its kept
    launcher with the tensors' addresses, without specializing its scalars again; a pointer of another
    alignment takes the compiling path once more, and settles its own launcher."""
    import ember.backends.triton as triton_backend
    from ember.backends import direct_launch, static_launch
    from ember.backends.direct_launch import BoundLaunch

    monkeypatch.setattr(triton_backend, "current_stream", lambda device: 3)
    monkeypatch.setattr(static_launch, "from_compiled", lambda compiled, device: None)
    specialized = []
    real = direct_launch._specialized
    monkeypatch.setattr(direct_launch, "_specialized", lambda x: specialized.append(x) or real(x))
    jit = _Jit(fail_above_stages=2)
    bound = BoundLaunch(DirectLaunch(jit, False), (2, 4), (10, 0.5), {"A": 1, "B": 2}, FlexLaunch(64, 64, 4, 3))
    x, y = torch.zeros(64), torch.ones(64)
    bound((x,))
    assert bound.launch == FlexLaunch(64, 64, 4, 2)  # one stage fewer, kept for the next calls
    calls = len(specialized)
    bound((y,))
    bound((x,))
    assert len(specialized) == calls
    assert [entry[0] for entry in jit.log] == ["jit", "direct", "direct"]
    assert jit.log[1][1] == (2, 4, 1, 3, "cufunction", "meta", None, None, None, y, 10, 0.5, 1, 2)
    bound((x[1:],))  # misaligned: Triton specializes it apart
    bound((x[1:],))
    assert [entry[0] for entry in jit.log][3:] == ["jit", "direct"]
    assert [entry[5] for entry in jit.log if entry[0] == "jit"] == [2, 2]


def _spec(dtype: torch.dtype, head_dim: int) -> FlexSpec:
    return FlexSpec(dtype, torch.float32, head_dim, head_dim, head_dim**-0.5, None, None, (), 128, 128, True)


class _Mask:
    """A mask program as the launch choice sees it: one that gathers nothing per query or key."""

    def gathers(self, dims) -> bool:
        return False


def test_tiles_by_head_size_precision_and_mask():
    """Half-precision heads up to 64 take the small tile, or with a mask_mod the masked one at its own
    pipelining depth; the backward takes the masked tile for a mask_mod up to head size 128, else its
    tiles by head size; float32 its own, forward and backward."""
    from dataclasses import replace

    from ember.backends.flex import backward_launches

    gpu = Target("triton")
    h = gpu.heuristics.flex

    def launch(tile, stages):
        return FlexLaunch(tile.xblock, tile.rblock, tile.warps, stages)

    cases = {
        # (dtype, head size, mask_mod): (forward, dq, dk/dv)
        (torch.bfloat16, 64, False): (launch(h.small, h.stages), *[launch(h.backward_small, h.stages)] * 2),
        (torch.float16, 32, True): (
            launch(h.masked, h.masked_stages),
            *[launch(h.backward_masked, h.masked_stages)] * 2,
        ),
        (torch.bfloat16, 128, False): (
            launch(h.medium, h.stages),
            launch(h.backward_dq, h.stages),
            launch(h.backward_dkdv, h.stages),
        ),
        (torch.bfloat16, 128, True): (launch(h.medium, h.stages), *[launch(h.backward_masked, h.masked_stages)] * 2),
        (torch.bfloat16, 256, True): (launch(h.large, h.stages), *[launch(h.backward_other, h.stages)] * 2),
        (torch.float32, 64, True): (launch(h.float32, h.stages), *[launch(h.backward_float32, h.stages)] * 2),
    }
    for (dtype, head_dim, masked), launches in cases.items():
        spec = replace(_spec(dtype, head_dim), mask=_Mask() if masked else None)
        assert (forward_launch(spec, gpu), *backward_launches(spec, gpu)) == launches, (dtype, head_dim, masked)


def test_a_new_call_plan_starts_from_the_stages_an_earlier_one_settled(monkeypatch):
    """A flex kernel's plans are per operand layout (a new sequence length makes one); where shared memory
    ran out at the Target's stages, the stages the first plan settled on are the next plan's start, so it
    does not compile, fail and compile again."""
    import ember.backends.triton as triton_backend
    from ember.backends import static_launch
    from ember.backends.flex import FlexKernel

    monkeypatch.setattr(triton_backend, "current_stream", lambda device: 0)
    monkeypatch.setattr(static_launch, "from_compiled", lambda compiled, device: None)
    from ember.backends import direct_launch

    retried = []
    monkeypatch.setattr(direct_launch.log, "summary", lambda message: retried.append(int(message.split()[-2]) + 1))
    jit = _Jit(fail_above_stages=1)
    kernel = FlexKernel.__new__(FlexKernel)
    kernel.spec, kernel.results, kernel.cpp, kernel.plans = _spec(torch.bfloat16, 64), 3, False, {}
    kernel.launch, kernel.fn = FlexLaunch(64, 64, 4, 3), DirectLaunch(jit, False)
    for length in (256, 384, 384):
        q, k, v = (torch.zeros(1, 2, length, 64, dtype=torch.bfloat16) for _ in range(3))
        blocks = (length + 127) // 128
        counts, indices = (
            torch.ones(1, 1, blocks, dtype=torch.int32),
            torch.zeros(1, 1, blocks, blocks, dtype=torch.int32),
        )
        kernel(q, k, v, counts, indices, counts, indices)
    assert [entry[0] for entry in jit.log] == ["jit", "direct", "direct"], jit.log  # both lengths one binary
    assert retried == [3, 2], retried  # shared memory ran out at 3 and 2 stages on the first plan only
    assert kernel.launch.stages == 1
