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
from tests.runtime.cudagraph_fakes import FakeRecorder, fresh, mlp

CPU = torch.device("cpu")


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
    model = mlp()
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
    model = mlp()
    reference = mlp()
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
    model, reference = mlp(), mlp()
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


@pytest.mark.parametrize("option", ["cudagraphs", "cudagraphs_default"])
def test_two_forwards_before_one_backward_match_eager(recorder, option):
    """The second forward of a step runs while the first one's saved outputs are held: without its graph,
    under reduce-overhead's steps and in the default mode alike."""
    model, reference = mlp(), mlp()
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


def _graphed(recorder, pool=None, static=(), program=fresh) -> cg.Graphed:
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
    compiled = ember_compile(mlp(), "cpp", cudagraphs=True)
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
        compiled = ember_compile(mlp(), "cpp", cudagraphs=True)
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
        compiled = ember_compile(mlp(), "cpp", cudagraphs=True)  # a failed capture would run without a graph
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
