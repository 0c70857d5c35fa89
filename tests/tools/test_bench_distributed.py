"""`ember bench --distributed` in this process, as one rank of a world of one (gloo): the tiny workload under
FSDP2, eager and ember, as the one-GPU run does it; its table, raw records and timeline PNG. (Its blocks are
tests/e2e/test_distributed.py's: compiled there first, they come from the session's cache here.)"""

from __future__ import annotations

import argparse
import json
import socket

import pytest
import torch
import torch.distributed as dist

from ember.tools.bench import distributed
from ember.tools.bench.dist_workloads import WORKLOADS


@pytest.fixture
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_step_checked_timed_and_profiled(world_of_one, tmp_path):
    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    args = parser.parse_args(["--distributed", "fsdp2", "--dist-compilers", "ember", "--dist-steps", "2"])
    args.dist_warmup = 1
    workload = WORKLOADS["tiny"]
    alone = dist.new_group([0])  # each rank's group of itself: the weak-scaling baseline, timed in turns
    record = distributed.run_wrapper(workload, "fsdp2", ["ember"], args, torch.device("cpu"), alone)
    ember = record["compilers"]["ember"]
    assert ember["scaling"]["from"] == 1 and ember["scaling"]["baseline_ms"] > 0, ember
    assert ember["scaling"]["baseline_ms"] == ember["alone_ms"] and "alone_error" not in ember, ember
    assert ember["status"] == "pass", ember
    assert ember["accuracy"]["tensors"] == 1 + len(list(workload.build().parameters()))
    assert ember["graphs"] >= 2 and not ember["fallbacks"], ember  # forwards and backwards, compiled
    assert ember["ms"] > 0 and ember["overlap"]["comm_ms"] >= 0
    env = distributed.environment(workload, torch.device("cpu"), args)
    distributed._write(env, [record], str(tmp_path), ["--distributed", "fsdp2"])
    table = (tmp_path / "distributed.md").read_text()
    assert "| fsdp2 | ember |" in table and "pass (15 tensors)" in table, table
    assert json.loads((tmp_path / "distributed.json").read_text())["records"][0]["wrapper"] == "fsdp2"
    assert (tmp_path / "timeline-fsdp2.png").exists() or "matplotlib is not installed" in table
    # Against itself as a baseline run: 100% scaling from one process.
    distributed._write(env, [record], str(tmp_path / "again"), [], baseline=str(tmp_path / "distributed.json"))
    table = (tmp_path / "again" / "distributed.md").read_text()
    assert "scaling from 1 |" in table and table.count(" 100% |") == 2, table


def test_unknown_wrapper_is_refused():
    with pytest.raises(SystemExit, match="unknown wrapper"):
        distributed.main(["--distributed", "ddp,zero3"])
