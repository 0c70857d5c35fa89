"""CUDA graphs' bookkeeping (ember/runtime/cudagraphs.py) on the CPU, through a fake recorder.

The fake records by running the program and replays by running it again on the recording's
inputs, writing the results into the recorded outputs' memory: what a replay does to memory,
without a GPU. Programs are compiled by the C++ backend and compared with eager PyTorch.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from ember import config
from ember.frontend.backend import _checked_options
from ember.runtime import cudagraph_pool as cg_pool
from ember.runtime import cudagraphs as cg
from tests.helpers import assert_close, ember_compile, repro

CPU = torch.device("cpu")


class FakeGraph:
    def __init__(self, run, outputs, pool):
        self.run, self.outputs, self.pool = run, outputs, pool


class FakeRecorder:
    """A Recorder whose graphs are the program itself, run again on each replay into the recorded
    outputs' memory."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.pools: list[str] = []
        self.recorded: list[FakeGraph] = []
        self.replays = 0
        self.invalidated: dict[int, str] = {}  # StorageImpl pointer -> the message reading it raises
        self.device_seconds: list[float] = []
        self.current_stream = "stream 0"  # what a test switches to call on another stream

    def new_pool(self):
        self.pools.append(f"pool {len(self.pools)}")
        return self.pools[-1]

    def record(self, run, inputs, pool):
        # It runs the program to record it: inputs the program writes are put back as they were,
        # as after a capture, which computes nothing.
        before = [(x, x.clone()) for x in inputs if isinstance(x, torch.Tensor)]
        outputs = run()
        for x, saved in before:
            if not torch.equal(x, saved):
                x.data.copy_(saved)  # through .data: autograd's version of a saved tensor stays as it was
        self.recorded.append(FakeGraph(run, outputs, pool))
        return self.recorded[-1], outputs

    def replay(self, graph):
        self.replays += 1
        for static, new in zip(graph.outputs, graph.run()):
            if isinstance(static, torch.Tensor) and static.data_ptr() != new.data_ptr():
                static.untyped_storage().copy_(new.untyped_storage())  # whole storages: expanded outputs too

    def invalidate(self, storage, message):
        self.invalidated[storage] = message

    def stream(self):
        return self.current_stream

    def time_device(self, run):
        # What the device would spend on a replay: `device_seconds`, taken in turn, else 0.
        return run(), (self.device_seconds.pop(0) if self.device_seconds else 0.0)


@pytest.fixture
def recorder():
    with cg.use_recorder(FakeRecorder()) as r:
        yield r
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()  # PyTorch's step counter, which mark_step_begin moved


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _backward_both(compiled, model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """One training step's gradients, fresh (set to None first), through the compiled model and its eager twin."""
    x = torch.randn(4, 8)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()


def test_modes_turn_cudagraphs_on():
    assert _checked_options("reduce-overhead", None)["cudagraphs"] is True
    assert _checked_options("max-autotune", None)["cudagraphs"] is True
    assert _checked_options("max-autotune-no-cudagraphs", None)["cudagraphs_default"] is False
    assert "cudagraphs" not in _checked_options(None, None)
    assert _checked_options("reduce-overhead", {"cudagraphs": False})["cudagraphs"] is False  # the caller's word wins


def test_inference_replays_copy_only_inputs_that_are_not_static(recorder):
    model = _mlp()
    compiled = ember_compile(model, "cpp", cudagraphs=True)
    line = repro(program="Linear(8,16)-relu-Linear(16,4)", x="f32[2, 8]", calls=4)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 8)
            y = compiled(x)
            assert_close(y, model(x), rtol=1e-5, atol=1e-5, what=f"call {i}", line=line)
            del y  # the next call is a new step anyway (a new torch.compile'd invocation)
    assert len(recorder.recorded) == 1 and recorder.replays == 3, line  # warm-up, record + replay, 2 replays
    rec = cg.pool_for(recorder, CPU).recordings[0]
    params = {p.data_ptr() for p in model.parameters()}
    static = [k for k, a in enumerate(rec.inputs) if isinstance(a, torch.Tensor) and a.data_ptr() in params]
    copied = [k for k, _ in rec.copy_in]
    assert len(static) == 4 and len(copied) == 1 and copied[0] not in static, line
    assert rec.copy_in_bytes == 2 * 8 * 4, line  # x, f32[2, 8]
    said = cg_pool._recorded(rec, 1)
    assert "a replay copies in 1 input (6.4e-05 MB); 0 read through address tables" in said, said
    wide = torch.randn(2, 1).expand(2, 8)  # a broadcast input: one column copied, not eight
    assert cg_pool._copied_bytes(wide, cg_pool._copy_index(wide)) == 2 * 4


def test_training_step_shares_one_pool_and_grads_match_eager(recorder):
    model = _mlp()
    reference = _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = ember_compile(model, "cpp", cudagraphs=True)
    line = repro(program="mlp training step", x="f32[4, 8]", steps=3)
    for step in range(3):
        _backward_both(compiled, model, reference)
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, what=f"step {step} grad {name}", line=line)
    assert len(recorder.recorded) == 2, line  # the forward and the backward, recorded in step 2
    kept = [p.grad for p in model.parameters()]  # a gradient held into the next step is invalidated
    model.zero_grad(set_to_none=True)
    compiled(torch.randn(4, 8)).square().sum().backward()
    assert {recorder.invalidated.get(g.untyped_storage()._cdata) for g in kept} == {cg.GRADIENT_OVERWRITTEN}, line
    assert len(recorder.pools) == 1 and {g.pool for g in recorder.recorded} == {recorder.pools[0]}, line


def test_an_update_reads_the_gradients_a_recorded_backward_handed_out_where_they_are(recorder):
    """A compiled SGD update after a compiled training step, both under CUDA graphs: the gradients
    it reads are the backward recording's outputs, in the pool's memory. The update's recording
    reads them where they are (their addresses in its key), copies none in, and matches eager.
    A call finds the last recording without its key only while the pool is as it was."""
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = ember_compile(model, "cpp", cudagraphs=True)

    def update(params):
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)

    step = ember_compile(update, "cpp", cudagraphs=True)
    line = repro(program="mlp training step, then a compiled SGD update", x="f32[4, 8]", steps=6)
    for i in range(6):
        _backward_both(compiled, model, reference)
        step(list(model.parameters()))
        update(list(reference.parameters()))
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert_close(p, r, rtol=1e-4, atol=1e-5, what=f"step {i} {name}", line=line)
    # Recorded once over copies of the plain backward's gradients, then, once the backward's recording
    # hands them out, again over the pool's memory: the one that replays from there on.
    first, rec = [r for r in cg.pool_for(recorder, CPU).recordings if r.kind == "inference"]
    assert not first.in_pool and rec is cg.pool_for(recorder, CPU).recordings[-1], line
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(rec.in_pool) == 4 and {rec.addresses[k] for k in rec.in_pool} == {
        p.grad.data_ptr() for p in model.parameters()
    }, line
    assert not {k for k, _ in rec.copy_in} & set(rec.in_pool) and grads <= cg.pool_for(recorder, CPU).resident(), line


def test_default_mode_records_inference_and_returns_fresh_outputs(recorder):
    model = _mlp()
    compiled = ember_compile(model, "cpp", cudagraphs_default=True)
    line = repro(program="Linear(8,16)-relu-Linear(16,4)", x="f32[2, 8]", cudagraphs_default=True)
    xs = torch.randn(6, 2, 8)
    with torch.no_grad():
        outs = [compiled(x) for x in xs]  # every output held: fresh tensors, none overwritten
        for i, (x, y) in enumerate(zip(xs, outs)):
            assert_close(y, model(x), rtol=1e-5, atol=1e-5, what=f"held output {i}", line=line)
    assert recorder.replays >= 4 and not recorder.invalidated, line
    assert not cg.pool_for(recorder, CPU).recordings and cg.pool_for(recorder, CPU, with_steps=False).recordings, line


def _sgd_loop(model, steps: int, pattern: str, compiled=None) -> list[float]:
    """A training loop of `steps` SGD steps in one of the ways users write one; the losses it kept."""
    f = compiled or model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        if pattern == "accumulate":  # two micro-batches a step, the gradients summed in .grad
            opt.zero_grad(set_to_none=True)
            for _ in range(2):
                loss = f(torch.randn(4, 8, generator=gen)).square().mean()
                loss.backward()
                losses.append(loss.detach())
        else:
            if pattern == "zero before backward":  # the gradients of the last step held through the forward
                loss = f(torch.randn(4, 8, generator=gen)).square().mean()
                opt.zero_grad(set_to_none=True)
            elif pattern == "zero in place":  # the .grad tensors of the first step kept for good
                opt.zero_grad(set_to_none=False)
                loss = f(torch.randn(4, 8, generator=gen)).square().mean()
            else:  # "set to none", the loop most code writes
                opt.zero_grad(set_to_none=True)
                loss = f(torch.randn(4, 8, generator=gen)).square().mean()
            loss.backward()
            losses.append(loss.detach())  # held, as a loss kept for logging is: it must stay as it was
        opt.step()
    return [float(x) for x in losses]


@pytest.mark.parametrize("pattern", ["set to none", "zero before backward", "zero in place", "accumulate"])
def test_default_mode_records_training_steps_that_train_as_eager(recorder, pattern):
    """In the default mode a training step's forward and backward are recorded too. The loss is a fresh
    copy; the tensors the forward saves for its backward and the backward's gradients are the pool's
    memory, which a replay never writes while one is held: where a gradient is held when a replay
    could write over it, the backward copies its gradients from then on."""
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = ember_compile(model, "cpp", cudagraphs_default=True)
    line = repro(program="mlp, SGD", loop=pattern, steps=8, cudagraphs_default=True)
    losses = _sgd_loop(model, 8, pattern, compiled)
    expected = _sgd_loop(reference, 8, pattern)
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-6), line
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, r, rtol=1e-4, atol=1e-5, what=f"{name} after 8 steps", line=line)
    pool = cg.pool_for(recorder, CPU, with_steps=False)
    assert [r.kind for r in pool.recordings] == ["forward", "backward"] and recorder.replays >= 4, line
    assert not recorder.invalidated and not cg.pool_for(recorder, CPU).recordings, line
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    backward = pool.recordings[1]
    if pattern == "set to none":  # nothing held into the next step: the gradients are the pool's, not copied
        assert grads <= pool.resident() and backward.handed_from == 0, line
    elif pattern == "zero in place":  # .grad tensors of the first step's plain run, added into in place
        assert grads and not grads & pool.resident() and backward.handed_from == 0, line
    else:  # a replay found one held: copies from then on
        assert grads and not grads & pool.resident() and backward.handed_from is None, line
    forward = pool.recordings[0]
    saved = {number for pos, number, _ in forward.handed if pos >= 1}  # outputs past the loss: saved tensors
    assert saved and {number for pos, number, _ in forward.handed if pos == 0}.isdisjoint(saved), line
    assert forward.live, line  # the saved tensors were handed out, not copied


def test_default_mode_records_graphs_loaded_from_aotautograds_cache(recorder, tmp_path):
    from torch._dynamo.utils import counters

    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    line = repro(program="mlp, SGD, compiled twice", cache="AOTAutograd's", cudagraphs_default=True)
    with config.override(cache_dir=str(tmp_path)):
        for compile_number in range(2):
            torch._dynamo.reset()
            hits = counters["aot_autograd"]["autograd_cache_hit"]
            recorded, replays = len(recorder.recorded), recorder.replays
            losses = _sgd_loop(model, 6, "set to none", ember_compile(model, "cpp", cudagraphs_default=True))
            assert losses == pytest.approx(_sgd_loop(reference, 6, "set to none"), rel=1e-4, abs=1e-6), line
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1, line  # the second compile loaded both graphs
    assert len(recorder.recorded) == recorded + 2 and recorder.replays >= replays + 4, line  # and recorded both
    assert [r.kind for r in cg.pool_for(recorder, CPU, with_steps=False).recordings[-2:]] == ["forward", "backward"]


@pytest.mark.parametrize(
    ("replay_s", "bandwidth", "kept"),
    [
        (1.0, 100.0, False),  # the device is the slower, the copies (24 bytes at 100 B/s) 24% of the replay
        (1.0, 1e12, True),  # the copies take a negligible share of the replay: kept
        (1e-9, 2.4e9, True),  # copies 10x the replay, but the host program is the slower: kept
    ],
)
def test_default_mode_keeps_a_recording_only_where_it_pays(recorder, replay_s, bandwidth, kept):
    """The first replay of a default-mode recording is timed on the device (the fake recorder says how
    long), its copies reckoned from their bytes at the device's bandwidth, beside the host program's
    time on the call before it. A recording that does not pay is dropped, and that graph runs its host
    program from then on, recording nothing more."""
    pool = cg.Pool(recorder, CPU, with_steps=False)
    fn = cg.Graphed(
        _fresh, "inference", (), (), pool, False, default_mode=True, copy_share=0.05, copy_bandwidth=bandwidth
    )
    recorder.device_seconds = [replay_s]
    line = repro(program="x * 2, f32[3]", replay_s=replay_s, bandwidth=bandwidth)
    outs = [fn([torch.full((3,), float(i))])[0] for i in range(8)]
    assert [o.tolist() for o in outs] == [[2.0 * i] * 3 for i in range(8)], line  # fresh tensors, every one
    assert len(recorder.recorded) == 1, line  # warm-up, timed host program, recorded on the third call
    assert recorder.replays == (6 if kept else 1) and pool.recordings[0].judged, line
    assert pool.recordings[0].released is not kept and fn.host_seconds, line


def test_default_mode_takes_the_target_s_bandwidth_and_share(recorder):
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.frontend.backend import _capture

    x = torch.randn(4, 8)
    gm = make_fx(lambda x: ((x * 2).relu(),))(x)
    with config.override(cudagraphs_default=True):
        static, facts = _capture(gm, [x], "inference")
    assert static == () and facts.copy_share == 0.05 and facts.copy_bandwidth > 0 and facts.kept_outputs == 1


class _Broken(torch.nn.Module):
    """x plus a product of parameters, a graph break, then sines of products with frozen weights: the
    second graph's backward hands out the gradient of y, which the first one's backward returns as x's
    gradient, an output over an input in the pool's memory."""

    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8, 8) / 3) for _ in range(3)])
        self.ms = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8, 8) / 3, requires_grad=False)] * 2)

    def forward(self, x):
        h = self.ws[0] @ self.ws[1] @ self.ws[2]
        y = x + h
        torch._dynamo.graph_break()
        for m in self.ms:
            y = (y @ m).sin()
        return y


def test_gradients_kept_over_steps_stay_as_they_were(recorder):
    """The input gradients of the last steps are kept: one that views memory of another recording must be
    seen held by it, never written over by its next replay."""
    model = _Broken()
    compiled = ember_compile(model, "cpp", cudagraphs_default=True)
    line = repro(program="x + W1 @ W2 @ W3, graph break, sin(y @ M) twice", x="f32[8, 8]", steps=14, kept_from=8)
    kept = []
    for step in range(14):  # the first steps' gradients dropped, so that the graphs record and replay
        x = torch.randn(8, 8, requires_grad=True)
        v = torch.randn(8, 8)
        got = torch.autograd.grad(compiled(x), x, v)[0]
        if step >= 8:
            kept.append((step, got, torch.autograd.grad(model(x), x, v)[0]))
        del got
    assert recorder.replays > 0, line
    for step, got, expected in kept:
        assert_close(got, expected, rtol=1e-4, atol=1e-5, what=f"input gradient of step {step}", line=line)


def test_a_dropped_recording_is_released_once_what_it_handed_out_is_gone(recorder):
    pool = cg.Pool(recorder, CPU, with_steps=False)

    def forward(args):
        (x,) = args
        args.clear()
        saved = x * 3
        return [saved.sum(), saved]  # the loss (copied) and a tensor saved for a backward (handed out)

    fn = cg.Graphed(forward, "forward", (), (), pool, False, default_mode=True, copied_below=1, copy_bandwidth=1.0)
    recorder.device_seconds = [1.0]  # a 1 s replay; its copy (4 bytes at 1 B/s) takes 8 s: dropped
    line = repro(program="x * 3, its sum", rule="dropped recording")
    x = torch.ones(3)
    fn([x]), fn([x])  # warm-up, timed host program
    loss, saved = fn([x])  # recorded, replayed, judged and dropped
    rec = pool.recordings[0]
    assert fn.disabled and rec in pool.dying and not rec.released, line
    assert loss.item() == 9.0 and saved.tolist() == [3.0] * 3, line
    del saved
    pool.release([])  # reaps
    assert rec.released, line


def test_a_backward_whose_gradient_is_held_copies_from_then_on_and_is_judged_again(recorder):
    pool = cg.Pool(recorder, CPU, with_steps=False)
    fn = cg.Graphed(_fresh, "backward", (), (), pool, False, default_mode=True, copied_below=0, copy_bandwidth=1.0)
    recorder.device_seconds = [1.0, 1.0]
    line = repro(program="x * 2 as a backward", rule="held gradient")
    x = torch.ones(3)
    fn([x]), fn([x])  # warm-up, timed host program
    grad = fn([x])[0]  # recorded; handed out, nothing to copy: kept
    assert not fn.disabled and pool.recordings[0].handed_from == 0, line
    again = fn([x + 1])[0]  # `grad` is held: its own host program, and copies from then on
    assert grad.tolist() == [2.0] * 3 and again.tolist() == [4.0] * 3, line
    assert pool.recordings[0].handed_from is None and not pool.recordings[0].judged, line
    del grad, again
    last = fn([x + 2])[0]  # replayed and judged again: 12 bytes at 1 B/s against a 1 s replay, dropped
    assert last.tolist() == [6.0] * 3 and fn.disabled, line


@pytest.mark.parametrize("option", ["cudagraphs", "cudagraphs_default"])
def test_two_forwards_before_one_backward_match_eager(recorder, option):
    """The second forward of a step runs while the first one's saved outputs are held: without its graph,
    under reduce-overhead's steps and in the default mode alike."""
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = ember_compile(model, "cpp", **{option: True})
    line = repro(program="(f(a)^2).mean() + |f(b)|.mean(), one backward", a="f32[4, 8]", steps=4, option=option)
    for step in range(4):
        a, b = torch.randn(4, 8), torch.randn(4, 8)
        for m, f in ((model, compiled), (reference, reference)):
            m.zero_grad(set_to_none=True)
            (f(a).square().mean() + f(b).abs().mean()).backward()
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6, what=f"step {step} grad {name}", line=line)
    pool = cg.pool_for(recorder, CPU, with_steps=option == "cudagraphs")
    assert recorder.replays > 0 and pool.recordings[0].kind == "forward", line


class _MatMul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.w  # saves x, an input that is not static, for w's gradient


def test_saved_input_of_two_forwards_in_one_step_match_eager(recorder):
    """A forward's saved input is the recording's copy of it: the second forward of the step must not
    write over the first one's while autograd holds it."""
    model, reference = _MatMul(), _MatMul()
    reference.load_state_dict(model.state_dict())
    compiled = ember_compile(model, "cpp", cudagraphs=True)
    line = repro(program="(a @ w).sum() + (b @ w).sum(), one backward", a="f32[4, 8]", b="f32[4, 8]", steps=4)
    for step in range(4):
        a, b = torch.randn(4, 8), torch.randn(4, 8)
        for m, f in ((model, compiled), (reference, reference)):
            m.zero_grad(set_to_none=True)
            (f(a).sum() + f(b).sum()).backward()  # the outputs are dropped: only autograd keeps a and b
        assert_close(model.w.grad, reference.w.grad, rtol=1e-5, atol=1e-5, what=f"step {step} grad w", line=line)
    assert recorder.replays > 0, line


class _AddW(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return x + self.w


def test_backward_returning_its_incoming_gradient_is_handed_out(recorder):
    """x's gradient is the backward's incoming one, the recording's copy of it: handed out like a pool
    output, so a later step invalidates it rather than overwriting it silently."""
    model, reference = _AddW(), _AddW()
    reference.load_state_dict(model.state_dict())
    compiled = ember_compile(model, "cpp", cudagraphs=True)
    line = repro(program="grad(x + w, x, v)", x="f32[4, 8]", v="f32[4, 8] (step)", steps=4)
    kept = []
    for step in range(4):
        x = torch.randn(4, 8, requires_grad=True)
        v = torch.full((4, 8), float(step + 1))
        (g,) = torch.autograd.grad(compiled(x), x, v)
        (expected,) = torch.autograd.grad(reference(x), x, v)
        assert_close(g, expected, rtol=0, atol=0, what=f"step {step} grad x", line=line)
        kept.append(g)
    assert recorder.replays > 0, line
    recorded = [g for g in kept[:-1] if recorder.invalidated.get(g.untyped_storage()._cdata)]
    assert recorded and {recorder.invalidated[g.untyped_storage()._cdata] for g in recorded} == {
        cg.GRADIENT_OVERWRITTEN
    }, line


def test_default_mode_copies_an_expanded_output(recorder):
    def f(x, w):
        h = torch.relu(x @ w).softmax(-1) @ w
        return h.sum(0, keepdim=True).expand(4, 8)  # stride 0 in dim 0

    compiled = ember_compile(f, "cpp", cudagraphs_default=True, aot_cache=False)
    w = torch.randn(8, 8)
    line = repro(program="(relu(x @ w).softmax(-1) @ w).sum(0, keepdim=True).expand(4, 8)", x="f32[4, 8]")
    with torch.no_grad():
        outs = [(compiled(x, w), x) for x in torch.randn(4, 4, 8)]
        for i, (y, x) in enumerate(outs):  # every output held: fresh tensors, none overwritten
            assert_close(y, f(x, w), rtol=1e-5, atol=1e-5, what=f"held output {i}", line=line)
            assert y.stride() == (0, 1), line
    assert recorder.replays >= 2, line


def test_mutated_inputs_are_captured(recorder):
    class Decay(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("state", torch.zeros(4, 8))

        def forward(self, x, extra):
            self.state.mul_(0.5).add_(x)  # a buffer: static, written in place by the graph
            extra.add_(1.0)  # an argument: copied in, and back after the replay
            return self.state.sum(-1) + extra.sum()

    model, reference = Decay(), Decay()
    compiled = ember_compile(model, "cpp", cudagraphs=True)
    extra, extra_ref = torch.zeros(3), torch.zeros(3)
    line = repro(program="state = 0.5 * state + x; extra += 1", x="f32[4, 8]", extra="f32[3]", calls=4)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 8)
            out = compiled(x, extra)
            assert_close(out, reference(x, extra_ref), rtol=1e-5, atol=1e-5, what=f"call {i}", line=line)
            assert_close(model.state, reference.state, rtol=1e-5, atol=1e-5, what=f"state {i}", line=line)
            assert_close(extra, extra_ref, rtol=0, atol=0, what=f"extra {i}", line=line)
    rec = cg.pool_for(recorder, CPU).recordings[0]
    assert rec.copy_out and all(k in dict(rec.copy_in) for k in rec.copy_out), line
    assert any(a is model.state or getattr(a, "data_ptr", lambda: 0)() == model.state.data_ptr() for a in rec.inputs)


def _fresh(args: list) -> list:
    """A program with one input and a fresh output, as a host program is called."""
    (x,) = args
    args.clear()
    return [x * 2]


def _graphed(recorder, pool=None, static=(), program=_fresh) -> cg.Graphed:
    return cg.Graphed(program, "inference", static, (), pool or cg.Pool(recorder, CPU))


def test_held_output_runs_without_the_graph_until_a_new_step(recorder):
    fn = _graphed(recorder)
    x = torch.ones(3)
    fn([x])  # warm-up
    held = fn([x])[0]  # recorded and replayed
    held_storage = held.untyped_storage()._cdata
    again = fn([x + 1])[0]  # same step, `held` still held: a replay would write over it
    line = repro(program="x * 2", rule="held output")
    assert recorder.replays == 1 and held.tolist() == [2.0] * 3 and again.tolist() == [4.0] * 3, line
    torch.compiler.cudagraph_mark_step_begin()
    new = fn([x + 2])[0]  # a new step: the held output is invalidated, then overwritten
    assert recorder.replays == 2 and new.tolist() == [6.0] * 3, line
    assert held_storage in recorder.invalidated, line
    del new
    fn([x])  # same step, nothing held: replays
    assert recorder.replays == 3, line


def test_a_long_loop_keeps_only_the_outputs_still_alive(recorder):
    """Each replay notes the storages it hands out (the recording's memory outlives any still alive):
    outputs dropped step after step are forgotten, not kept one entry per replay."""
    fn = _graphed(recorder)
    x = torch.ones(3)
    kept = []
    for step in range(1000):
        torch.compiler.cudagraph_mark_step_begin()
        out = fn([x])[0]
        if step in (300, 600, 900):
            kept.append(out)  # a few held on: each stays noted while alive
    rec = fn.recordings[next(iter(fn.recordings))]
    line = repro(program="x * 2", rule="1000 steps, 3 outputs held")
    assert recorder.replays == 999 and out.tolist() == [2.0] * 3, line
    alive = [ref for ref in rec.given if not ref.expired()]
    assert len(alive) == len(kept) + 1 and len(rec.given) < 200, (len(rec.given), line)


def test_a_dropped_graph_releases_its_recording_once_its_outputs_are_gone(recorder):
    pool = cg.Pool(recorder, CPU)
    fn, other = _graphed(recorder, pool), _graphed(recorder, pool, program=lambda a: [a.pop() + 1])
    x = torch.ones(3)
    fn([x])
    held = fn([x])[0]  # recorded; its output is still held
    other([x])
    other([x])
    rec = pool.recordings[0]
    line = repro(program="x * 2, dropped while its output is held", rule="release")
    del fn
    gc.collect()
    assert not rec.released and held.tolist() == [2.0] * 3, line  # the caller still reads its memory
    del held
    torch.compiler.cudagraph_mark_step_begin()
    other([x])  # the pool's next call frees it
    assert rec.released and rec.graph is None and not rec.outputs, line
    assert not pool.recordings[1].released and other([x])[0].tolist() == [2.0] * 3, line


def test_dynamo_reset_releases_a_compiled_models_recordings(recorder):
    compiled = ember_compile(_mlp(), "cpp", cudagraphs=True)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(2, 8))
    rec = cg.pool_for(recorder, CPU).recordings[0]
    del compiled
    torch._dynamo.reset()
    gc.collect()
    assert rec.released and rec.graph is None, repro(program="mlp", rule="released after torch._dynamo.reset()")


class TorchLikePools(FakeRecorder):
    """A FakeRecorder that keeps torch's rule for graph memory pools: a pool whose graphs are all gone
    stays while any block of it is allocated, and a capture into it then fails torch's assert."""

    def __init__(self):
        super().__init__()
        self.graphs: dict[str, list[weakref.ref]] = {}
        self.blocks: dict[str, list[weakref.ref]] = {}

    def record(self, run, inputs, pool):
        graphs = self.graphs.setdefault(pool, [])
        kept = [b for b in self.blocks.get(pool, []) if b() is not None]
        if graphs and all(g() is None for g in graphs) and kept:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        graph, outputs = super().record(run, inputs, pool)
        self.recorded.pop()  # the recorder holds no graph: ember's recording does
        graphs.append(weakref.ref(graph))
        self.blocks.setdefault(pool, []).extend(weakref.ref(o) for o in outputs if isinstance(o, torch.Tensor))
        return graph, outputs


def test_a_capture_after_every_graph_was_released_takes_a_new_pool():
    """A block of a pool held past its graphs (as an address table held by its launch once was) made
    the next capture into that pool fail: once every recording of the pool is released, the next one
    takes a new pool."""
    with cg.use_recorder(TorchLikePools()) as recorder:
        compiled = ember_compile(_mlp(), "cpp", cudagraphs=True)
        with torch.no_grad():
            for _ in range(3):
                compiled(torch.randn(2, 8))
        pool = cg.pool_for(recorder, CPU)
        held = pool.recordings[0].outputs[0]  # a block of the first pool, alive past its graph
        first = pool.handle
        del compiled
        torch._dynamo.reset()
        gc.collect()
        assert pool.recordings[0].released
        compiled = ember_compile(_mlp(), "cpp", cudagraphs=True)  # a failed capture would run without a graph
        x = torch.randn(2, 8)
        with torch.no_grad():
            outs = [compiled(x).clone() for _ in range(3)]
        line = repro(program="mlp", rule="a new pool once every graph of the old one is released")
        assert pool.handle != first and len(recorder.graphs[pool.handle]) == 1 and held.numel(), line
        assert torch.equal(outs[2], outs[0]), line
        assert [r.released for r in pool.recordings] == [False] and pool.recordings[0].index == 0, line
    torch._dynamo.reset()


def test_a_capture_beside_a_live_recording_shares_its_pool(recorder):
    """The forward and backward of a step, and any graph recorded while another lives, share one pool."""
    pool = cg.Pool(recorder, CPU)
    first, second = _graphed(recorder, pool), _graphed(recorder, pool, program=lambda a: [a.pop() + 1])
    x = torch.ones(2)
    for fn in (first, first, second, second):  # warm-up and record each
        fn([x])
    line = repro(program="two graphs of one pool", rule="no new pool while a recording lives")
    assert len(recorder.recorded) == 2 and recorder.recorded[0].pool == recorder.recorded[1].pool, line
    assert len(recorder.pools) == 1, line


def test_a_disabled_graph_releases_its_recordings(recorder):
    with config.override(cudagraphs_max_graphs=1):
        fn = _graphed(recorder)
    fn([torch.ones(2)])
    fn([torch.ones(2)])  # recorded
    rec = fn.pool.recordings[0]
    with pytest.warns(UserWarning, match="cudagraphs_max_graphs"):
        fn([torch.ones(3)])  # a second shape past the bound: no more CUDA graphs
    assert rec.released, repro(rule="disabled graph released")


def test_output_of_a_later_recording_blocks_an_earlier_one(recorder):
    pool = cg.Pool(recorder, CPU)
    first, second = _graphed(recorder, pool), _graphed(recorder, pool, program=lambda a: [a.pop() + 1])
    x = torch.ones(2)
    for fn in (first, first, second, second):  # warm-up and record each: `first` records before `second`
        fn([x])
    torch.compiler.cudagraph_mark_step_begin()
    kept = second([x])[0]  # held: it may lie in memory `first`'s replay writes
    replays = recorder.replays
    assert first([x])[0].tolist() == [2.0, 2.0] and recorder.replays == replays, repro(rule="later recording held")
    assert kept.tolist() == [2.0, 2.0]


def test_rerecording_is_bounded_then_one_warning(recorder):
    line = repro(program="x * 2", cudagraphs_max_graphs=2, shapes="1..5")
    with config.override(cudagraphs_max_graphs=2):
        fn = _graphed(recorder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 6):
            for _ in range(2):
                assert fn([torch.full((n,), float(n))])[0].tolist() == [2.0 * n] * n, line
    messages = [str(w.message) for w in caught if "cudagraphs_max_graphs" in str(w.message)]
    assert len(messages) == 1 and len(recorder.recorded) == 2, line
    assert "input 0's shape" in messages[0], messages
    assert fn.report is None or "off" in fn.report.cudagraphs


def test_the_bound_names_a_static_input_whose_address_moves(recorder):
    with config.override(cudagraphs_max_graphs=2):
        fn = _graphed(recorder, static=(1,), program=lambda a: [a[0] + a[1]])
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replaced = [torch.ones(2) for _ in range(3)]  # all alive: three addresses
        for weight in replaced:  # a "parameter" replaced by a new tensor every call
            assert fn([x, weight])[0].tolist() == [2.0, 2.0]
    messages = [str(w.message) for w in caught if "cudagraphs_max_graphs" in str(w.message)]
    assert len(messages) == 1 and "static input 1's address" in messages[0], messages


def test_dynamic_shapes_record_one_graph_per_shape(recorder):
    def f(x):
        return torch.softmax(x * 2, -1) + x.shape[0]

    compiled = ember_compile(f, "cpp", dynamic=True, cudagraphs=True)
    line = repro(program="softmax(x * 2, -1) + x.shape[0]", x="f32[n, 8]", n="3 3 3 5 5 5 3", dynamic=True)
    for n in (3, 3, 3, 5, 5, 5, 3):
        x = torch.randn(n, 8)
        assert_close(compiled(x), f(x), rtol=1e-5, atol=1e-6, what=f"n={n}", line=line)
    assert len(cg.pool_for(recorder, CPU).recordings) == 2 and recorder.replays == 5, line


def test_a_failed_capture_runs_without_graphs_and_warns_once():
    class Failing(FakeRecorder):
        def record(self, run, inputs, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    fn = _graphed(None, cg.Pool(Failing(), CPU))
    line = repro(program="x * 2", recorder="capture raises")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            assert fn([torch.ones(2)])[0].tolist() == [2.0, 2.0], line
    assert len([w for w in caught if "its capture failed: RuntimeError" in str(w.message)]) == 1, line
    assert fn.disabled is not None, line


def test_static_input_at_a_new_address_records_again(recorder):
    pool = cg.Pool(recorder, CPU)
    fn = _graphed(recorder, pool, static=(0,))
    a, b = torch.ones(2), torch.ones(2) * 3
    line = repro(program="x * 2", static="x", addresses="a a b b a")
    for x in (a, a, b, b, a):
        assert fn([x])[0].tolist() == (x * 2).tolist(), line
    assert len(recorder.recorded) == 2 and recorder.replays == 3, line
    assert [r.inputs[0] is x for r, x in zip(pool.recordings, (a, b))] == [True, True] and not any(
        r.copy_in for r in pool.recordings
    ), line
