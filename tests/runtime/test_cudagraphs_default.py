"""CUDA graphs in the default mode (setting cudagraphs_default) on the CPU, through a fake recorder
(cudagraph_fakes.py): copies of what the caller keeps, tensors handed out and never written while
held, training loops written four ways, recordings kept only where they pay, and graphs loaded from
AOTAutograd's cache. Programs are compiled by the C++ backend and compared with eager PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from ember import config
from ember.runtime import cudagraphs as cg
from tests.helpers import assert_close, ember_compile, repro
from tests.runtime.cudagraph_fakes import fresh, mlp

CPU = torch.device("cpu")


def test_default_mode_records_inference_and_returns_fresh_outputs(recorder):
    model = mlp()
    compiled = ember_compile(model, "cpp", cudagraphs_default=True)
    line = repro(program="Linear(8,16)-relu-Linear(16,4)", x="f32[2, 8]", cudagraphs_default=True)
    xs = torch.randn(8, 2, 8)
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
    model, reference = mlp(), mlp()
    reference.load_state_dict(model.state_dict())
    compiled = ember_compile(model, "cpp", cudagraphs_default=True)
    line = repro(program="mlp, SGD", loop=pattern, steps=14, cudagraphs_default=True)
    losses = _sgd_loop(model, 14, pattern, compiled)
    expected = _sgd_loop(reference, 14, pattern)
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-6), line
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, r, rtol=1e-4, atol=1e-5, what=f"{name} after 14 steps", line=line)
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

    model, reference = mlp(), mlp()
    reference.load_state_dict(model.state_dict())
    line = repro(program="mlp, SGD, compiled twice", cache="AOTAutograd's", cudagraphs_default=True)
    with config.override(cache_dir=str(tmp_path)):
        for compile_number in range(2):
            torch._dynamo.reset()
            hits = counters["aot_autograd"]["autograd_cache_hit"]
            recorded, replays = len(recorder.recorded), recorder.replays
            losses = _sgd_loop(model, 14, "set to none", ember_compile(model, "cpp", cudagraphs_default=True))
            assert losses == pytest.approx(_sgd_loop(reference, 14, "set to none"), rel=1e-4, abs=1e-6), line
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1, line  # the second compile loaded both graphs
    assert len(recorder.recorded) == recorded + 2 and recorder.replays >= replays + 4, line  # and recorded both
    assert [r.kind for r in cg.pool_for(recorder, CPU, with_steps=False).recordings[-2:]] == ["forward", "backward"]


@pytest.mark.parametrize(
    ("replay_s", "bandwidth", "replay_host_s", "kept"),
    [
        (1.0, 100.0, 1e-5, False),  # the device is the slower, the copies (x in, 2x out: 48 bytes at 100 B/s) 48%
        (1.0, 1e12, 1e-5, True),  # the copies take a negligible share of the replay: kept
        (1e-9, 2.4e9, 1e-5, True),  # copies 10x the replay, but the host program is the slower: kept
        (1.0, 1e12, 2e-3, True),  # GPU-bound, copies negligible: kept, whatever the replay's time on the host
        (1e-9, 2.4e9, 2e-3, False),  # the host the slower, but slower still with the replay: saves nothing
    ],
)
def test_default_mode_keeps_a_recording_only_where_it_pays(recorder, replay_s, bandwidth, replay_host_s, kept):
    """A default-mode key's host program is timed over three calls after its warm-up (the host's time 1 ms
    a call here), then recorded; the recording's first replay is timed on the device (the fake recorder says
    how long), its copies reckoned from their bytes at the device's bandwidth, and its next two replays on
    the host. A recording that does not pay is dropped, and that graph runs its host program from then on,
    recording nothing more."""
    pool = cg.Pool(recorder, CPU, with_steps=False)
    fn = cg.Graphed(
        fresh, "inference", (), (), pool, False, default_mode=True, copy_share=0.05, copy_bandwidth=bandwidth
    )
    recorder.device_seconds = [replay_s]
    recorder.host_seconds["replay"] = replay_host_s
    line = repro(program="x * 2, f32[3]", replay_s=replay_s, bandwidth=bandwidth, replay_host_s=replay_host_s)
    outs = [fn([torch.full((3,), float(i))])[0] for i in range(10)]
    assert [o.tolist() for o in outs] == [[2.0 * i] * 3 for i in range(10)], line  # fresh tensors, every one
    assert len(recorder.recorded) == 1, line  # warm-up, three timed host programs, recorded on the fifth call
    assert recorder.replays == (6 if kept else 3) and pool.recordings[0].judged, line
    assert pool.recordings[0].released is not kept and fn.host_timed == {next(iter(fn.seen)): 3}, line


@pytest.mark.parametrize(
    ("host_program", "replay", "kept"),
    [
        ([4e-4, 2e-3, 2e-3], [5e-4, 5e-4], False),  # the least host program time (the first) is below the replay's
        ([5e-4, 5e-4, 5e-4], [3e-4, 1e-3], True),  # the least replay time (the first) is below the host program's
    ],
)
def test_default_mode_judges_from_the_least_of_the_timed_calls(recorder, host_program, replay, kept):
    pool = cg.Pool(recorder, CPU, with_steps=False)
    fn = cg.Graphed(fresh, "inference", (), (), pool, False, default_mode=True, copy_share=0.05, copy_bandwidth=1e9)
    recorder.device_seconds = [1e-9]  # host-bound, the copies (48 ns) over 5% of the replay: the host times decide
    recorder.host_seconds = {"host program": list(host_program), "replay": list(replay)}
    line = repro(program="x * 2, f32[3]", host_program=host_program, replay=replay)
    for i in range(8):
        fn([torch.full((3,), float(i))])
    rec = pool.recordings[0]
    assert rec.judged and rec.released is not kept and (fn.disabled is None) is kept, line
    assert rec.host_seconds == min(host_program) and rec.replay_host_seconds == min(replay), line


def test_a_training_step_s_graphs_settle_within_the_settling_calls(recorder):
    """The forward's warm-up and timed calls, then, from the call that records it, the backward's: both are judged
    at step SETTLING_CALLS (`ember bench` and `ember profile` warm up that long), not before."""
    from ember.runtime.cudagraph_judge import SETTLING_CALLS

    model = mlp()
    compiled = ember_compile(model, "cpp", cudagraphs_default=True)
    pool = cg.pool_for(recorder, CPU, with_steps=False)
    judged = {}
    for step in range(1, SETTLING_CALLS + 3):
        compiled(torch.randn(4, 8)).square().mean().backward()
        model.zero_grad(set_to_none=True)
        for rec in pool.recordings:
            judged.setdefault(rec.kind, step if rec.judged else None)
            if judged[rec.kind] is None and rec.judged:
                judged[rec.kind] = step
    assert judged == {"forward": 7, "backward": SETTLING_CALLS}, (judged, repro(program="mlp, SGD"))


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
    for _ in range(4):  # warm-up, timed host programs
        fn([x])
    for _ in range(2):  # recorded and replayed (timed on the device), replayed (timed on the host)
        fn([x])
    loss, saved = fn([x])  # replayed, judged and dropped
    rec = pool.recordings[0]
    assert fn.disabled and rec in pool.dying and not rec.released, line
    assert loss.item() == 9.0 and saved.tolist() == [3.0] * 3, line
    del saved
    pool.release([])  # reaps
    assert rec.released, line


def test_a_backward_whose_gradient_is_held_copies_from_then_on_and_is_judged_again(recorder):
    pool = cg.Pool(recorder, CPU, with_steps=False)
    fn = cg.Graphed(
        fresh, "backward", (), (), pool, False, default_mode=True, copied_below=0, copy_share=0.05, copy_bandwidth=480.0
    )
    recorder.device_seconds = [1.0, 1.0]
    line = repro(program="x * 2 as a backward", rule="held gradient")
    x = torch.ones(3)
    for _ in range(6):  # warm-up, timed host programs, recorded, replayed (timed on the device and the host)
        fn([x])
    grad = fn([x])[0]  # handed out: only x copied in (12 bytes read and written at 480 B/s, 5%): kept
    assert not fn.disabled and pool.recordings[0].handed_from == 0, line
    again = fn([x + 1])[0]  # `grad` is held: its own host program, and copies from then on
    assert grad.tolist() == [2.0] * 3 and again.tolist() == [4.0] * 3, line
    assert pool.recordings[0].handed_from is None and not pool.recordings[0].judged, line
    del grad, again
    for _ in range(2):  # replayed, timed again on the device, then the host
        fn([x + 2])
    last = fn([x + 2])[0]  # judged again: x in and the gradient out, 10% of the replay: dropped
    assert last.tolist() == [6.0] * 3 and fn.disabled, line


def test_default_mode_copies_an_expanded_output(recorder):
    def f(x, w):
        h = torch.relu(x @ w).softmax(-1) @ w
        return h.sum(0, keepdim=True).expand(4, 8)  # stride 0 in dim 0

    compiled = ember_compile(f, "cpp", cudagraphs_default=True, aot_cache=False)
    w = torch.randn(8, 8)
    line = repro(program="(relu(x @ w).softmax(-1) @ w).sum(0, keepdim=True).expand(4, 8)", x="f32[4, 8]")
    with torch.no_grad():
        outs = [(compiled(x, w), x) for x in torch.randn(7, 4, 8)]
        for i, (y, x) in enumerate(outs):  # every output held: fresh tensors, none overwritten
            assert_close(y, f(x, w), rtol=1e-5, atol=1e-5, what=f"held output {i}", line=line)
            assert y.stride() == (0, 1), line
    assert recorder.replays >= 2, line


@pytest.mark.parametrize("addresses", ["fresh each call", "two in turn"])
def test_a_backward_whose_saved_tensors_move_records_two_address_sets_at_most(recorder, addresses):
    """A backward's saved tensors stay put where its forward was recorded, but a forward that runs its
    host program saves fresh ones. Where the allocator hands two sets of memory back in turn, both are
    recorded and replayed; where each call finds them at a new address, the backward runs its host
    program from the third on, rather than recording at every step up to cudagraphs_max_graphs."""
    pool = cg.Pool(recorder, CPU, with_steps=False)
    fn = cg.Graphed(fresh, "backward", (0,), (), pool, False, default_mode=True, copied_below=0, copy_bandwidth=1e12)
    line = repro(program="x * 2 as a backward, x saved by an unrecorded forward", addresses=addresses)
    two = [torch.zeros(3), torch.zeros(3)]
    kept = []  # "fresh each call": every saved tensor held, so that each lies at a new address
    for i in range(16):
        saved = two[i % 2] if addresses == "two in turn" else torch.zeros(3)
        saved.fill_(float(i))
        kept.append(saved)
        (out,) = fn([saved])
        assert out.tolist() == [2.0 * i] * 3, (i, line)
    if addresses == "two in turn":
        assert fn.disabled is None and len(recorder.recorded) == 2 and recorder.replays >= 6, line
    else:
        assert fn.disabled is not None and "new address" in fn.disabled and not recorder.recorded, line
