"""CUDA graphs over static inputs that are made anew (ember/runtime/cudagraph_pool.py), on the CPU through
the fake recorder: a static KV cache that each `generate()` call allocates, read and written in place.

A recording whose static input is held by nothing but itself can never replay; it is released, its key
stops counting against `cudagraphs_max_graphs`, and the call with the new tensor records at once.
"""

from __future__ import annotations

import warnings

import torch

from ember import config
from ember.runtime import cudagraphs as cg
from tests.helpers import assert_close, ember_compile, repro
from tests.runtime.cudagraph_fakes import fresh

CPU = torch.device("cpu")


def _decode_step(x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)  # the step's key and value written into the cache, in place
    return torch.softmax(cache @ x.t(), 0).t() @ cache


def test_a_cache_made_anew_per_request_records_once_per_request(recorder):
    compiled = ember_compile(_decode_step, "cpp", cudagraphs=True)
    requests, steps = 12, 10  # more requests than cudagraphs_max_graphs (8)
    line = repro(program="cache.index_copy_(0, pos, x); softmax(cache @ x.T) @ cache", requests=requests, steps=steps)
    replays_before = 0
    with torch.no_grad():
        for request in range(requests):
            cache, reference = torch.zeros(16, 8), torch.zeros(16, 8)
            torch._dynamo.mark_static_address(cache)
            for t in range(steps):
                x, pos = torch.randn(1, 8), torch.tensor([t])
                out = compiled(x, cache, pos)
                assert_close(
                    out, _decode_step(x, reference, pos), rtol=1e-5, atol=1e-6, what=f"{request}.{t}", line=line
                )
                assert_close(cache, reference, rtol=0, atol=0, what=f"cache {request}.{t}", line=line)
                if request:
                    # The last request's recording is released: this request's is the only one holding a cache.
                    live = [r for r in cg.pool_for(recorder, CPU).recordings if not r.released]
                    assert len(live) == 1 and any(a is cache for a in live[0].inputs), f"request {request}: {line}"
                del out
            replays = recorder.replays - replays_before
            replays_before = recorder.replays
            # The first request warms up (a plain call) before it records; later ones record at their first call.
            assert replays == (steps - 1 if request == 0 else steps), f"request {request}: {replays} replays; {line}"
            del cache
    assert len(recorder.recorded) == requests, line


def _graphed(recorder, static=(1,)) -> cg.Graphed:
    return cg.Graphed(lambda a: [a[0] + a[1]], "inference", static, (), cg.Pool(recorder, CPU))


def _requests(fn: cg.Graphed, make, requests: int, calls: int, line: str) -> list[str]:
    """`requests` runs of `calls` calls of `fn([x, static])`, each with `make(i)`'s static tensor (returned with the
    object that holds it, dropped after its run), checked against x + static; the warnings they gave."""
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(requests):
            holder, static = make(i)
            for _ in range(calls):
                assert fn([x, static])[0].tolist() == [1.0 + i] * 2, line
            del holder, static
    return [str(w.message) for w in caught]


def test_short_lived_recordings_are_bounded_then_one_warning(recorder):
    with config.override(cudagraphs_max_graphs=3):
        fn = _graphed(recorder)
    line = repro(program="x + weight", static="weight, made anew every 3 calls", cudagraphs_max_graphs=3)
    weight = lambda i: (None, torch.full((2,), float(i)))
    messages = [m for m in _requests(fn, weight, 8, 3, line) if "fewer than" in m]
    assert len(messages) == 1 and "made anew every few calls" in messages[0], messages
    # Requests 0-2 record; the 4th request's first call releases the third short-lived recording: the bound.
    assert fn.disabled is not None and len(recorder.recorded) == 3, line


def test_a_static_input_still_held_keeps_its_recording(recorder):
    fn = _graphed(recorder)
    x = torch.ones(2)
    kept = [torch.full((2,), float(i)) for i in range(3)]  # the caller holds every one: each may come again
    line = repro(program="x + weight", static="weight, three held tensors in turn")
    for weight in (*kept, *kept, *kept):
        assert fn([x, weight])[0].tolist() == (x + weight).tolist(), line
    assert len(recorder.recorded) == 3 and len(fn.recordings) == 3 and fn.short_lived == 0, line


def test_an_input_that_is_not_static_is_never_what_releases_a_recording(recorder):
    fn = cg.Graphed(fresh, "inference", (), (), cg.Pool(recorder, CPU))
    line = repro(program="x * 2", static="none", calls=6)
    for _ in range(6):
        x = torch.randn(2)  # a new tensor every call: copied in, never the recording's to hold
        assert fn([x])[0].tolist() == (x * 2).tolist(), line
    assert len(recorder.recorded) == 1 and len(fn.recordings) == 1, line


def test_a_static_input_dropped_in_a_reference_cycle_is_released_at_the_bound(recorder):
    class Cache:  # holds itself, as an object graph with a cycle: only the collector frees it
        def __init__(self, request: int):
            self.tensor, self.me = torch.full((2,), float(request)), self

    with config.override(cudagraphs_max_graphs=2):
        fn = _graphed(recorder)
    line = repro(program="x + cache", static="cache in a reference cycle, made anew per request", max_graphs=2)
    caches = lambda i: (cache := Cache(i), cache.tensor)
    messages = _requests(fn, caches, 6, 10, line)
    assert not [m for m in messages if "cudagraphs" in m] and fn.disabled is None, line
    assert len(recorder.recorded) == 6 and len(fn.recordings) <= 2, line


def test_the_default_mode_keeps_the_recording_made_at_once_for_a_new_cache(recorder):
    pool = cg.Pool(recorder, CPU, with_steps=False)
    fn = cg.Graphed(
        lambda a: [a[0] + a[1]], "inference", (1,), (), pool, default_mode=True, copy_share=0.05, copy_bandwidth=1e12
    )
    line = repro(program="x + cache", mode="default (cudagraphs_default)", static="cache, made anew per request")
    _requests(fn, lambda i: (None, torch.full((2,), float(i))), 4, 10, line)
    # Request 0: warm-up, three timed host calls, record; later requests record at their first call, judged against
    # the host time of the released key's calls (a time of 0 would have dropped the recording and the graph's CUDA
    # graphs).
    assert fn.disabled is None and len(recorder.recorded) == 4, (fn.disabled, line)
    assert len(fn.host_seconds) == 1 and all(t > 0 for t in fn.host_seconds.values()), line


def test_a_view_of_the_static_input_still_held_keeps_its_recording(recorder):
    fn = _graphed(recorder)
    x = torch.ones(2)
    line = repro(program="x + cache", static="cache dropped, a view of it kept")
    views = []
    for request in range(3):
        cache = torch.full((4,), float(request))[:2]
        views.append(cache[1:])  # the caller keeps a view: the memory may still be read and passed again
        for _ in range(10):
            assert fn([x, cache])[0].tolist() == [1.0 + request] * 2, line
        del cache
    assert len(fn.recordings) == 3 and fn.short_lived == 0, line
