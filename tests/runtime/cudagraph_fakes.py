"""A fake CUDA graph recorder and small programs, for the CPU tests of CUDA graphs' bookkeeping
(tests/runtime/test_cudagraphs*.py; the `recorder` fixture is in conftest.py).

The fake records by running the program and replays by running it again on the recording's
inputs, writing the results into the recorded outputs' memory: what a replay does to memory,
without a GPU.
"""

from __future__ import annotations

import torch


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
        # What the host would spend on a host program's call and on a replay (the pool's bookkeeping, the copies
        # issued and a graph's launch), or a list of such times taken in turn (then the last one again): a
        # host-bound graph by default, whose recordings pay.
        self.host_seconds = {"host program": 1e-3, "replay": 1e-5}
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

    def time_host(self, run, what):
        seconds = self.host_seconds[what]
        if isinstance(seconds, list):
            seconds = seconds.pop(0) if len(seconds) > 1 else seconds[0]
        return run(), seconds


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def fresh(args: list) -> list:
    """A program with one input and a fresh output, as a host program is called."""
    (x,) = args
    args.clear()
    return [x * 2]
