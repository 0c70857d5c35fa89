"""ember under torch.distributed, on the CPU with gloo and two processes, against eager PyTorch.

One spawn of two ranks runs every case (process start and gloo set-up cost more than the cases):
five training steps under DDP (Dynamo's `optimize_ddp` splits the graph at bucket boundaries),
under FSDP2 with each block compiled and with the whole model compiled, each beside eager under the
same wrapper; and a graph holding functional collectives (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor and their waits). Every ember compile is strict, so a fallback to eager would
fail the case; each rank's losses, gradients and reports come back to the test through a file.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ember.tools.bench.dist_workloads import TinyNet as Net  # the distributed bench's CPU workload

WORLD = 2
STEPS = 5
DIM = 256  # Net's width: two blocks of 2 x 256 x 512 weights, past DDP's 1 MB bucket, so optimize_ddp splits the graph
# float32 against eager: the compiled kernels reorder sums (layer norm, GEMM epilogues) a little.
RTOL, ATOL = 1e-4, 1e-5


def _ember(module):
    return torch.compile(module, backend="ember", options={"strict": True})


def _train(model: nn.Module, run, rank: int) -> dict:
    """Five SGD steps on rank-specific data: each step's loss and every parameter's full gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for i in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        x, y = torch.randn(4, 8, DIM, generator=gen), torch.randn(4, 8, 8, generator=gen)
        loss = nn.functional.mse_loss(run(x), y)
        loss.backward()
        losses.append(loss.detach().clone())
        # FSDP2's gradients are sharded DTensors: compare the whole gradient.
        grads.append([_full(p.grad) for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()


def _wrapped(base: nn.Module, wrapper: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(base)
    if wrapper == "ddp":
        return DistributedDataParallel(model, bucket_cap_mb=1)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _compiled(model: nn.Module, how: str):
    if how == "blocks":  # regional compilation: each block compiled, FSDP2's hooks run around it
        for block in model.module.blocks if hasattr(model, "module") else model.blocks:
            block.compile(backend="ember", options={"strict": True})
        return model
    return _ember(model)


def _training_case(rank: int, wrapper: str, how: str) -> dict:
    from ember.report import collecting

    torch.manual_seed(0)
    base = Net()
    model = _wrapped(base, wrapper)
    eager = _train(model, model, rank)
    torch._dynamo.reset()
    with collecting() as report:
        model = _wrapped(base, wrapper)
        ember = _train(model, _compiled(model, how), rank)
    kinds = [g.kind for g in report.graphs]
    fallbacks = [g.fallback for g in report.graphs if g.fallback]
    return {"eager": eager, "ember": ember, "kinds": kinds, "fallbacks": fallbacks}


def collectives_program(x, w, group):
    """Compute on each side of three functional collectives, each awaited where its result is read."""
    import torch.distributed._functional_collectives as fc

    reduced = fc.all_reduce(x @ w, "sum", group)
    h = torch.relu(x * 2) @ w
    gathered = fc.all_gather_tensor(h, 0, group)
    scattered = fc.reduce_scatter_tensor(torch.sin(h), "sum", 0, group)
    return reduced + 1, gathered * 2, scattered.cos()


def _collectives_case(rank: int) -> dict:
    from ember.report import collecting

    torch.manual_seed(rank)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    group = dist.group.WORLD
    eager = collectives_program(x, w, group)
    torch._dynamo.reset()
    with collecting() as report:
        compiled = torch.compile(collectives_program, backend="ember", options={"strict": True})
        ember = compiled(x, w, group)
    return {
        "eager": [t.clone() for t in eager],
        "ember": [t.clone() for t in ember],
        "fallbacks": [g.fallback for g in report.graphs if g.fallback],
        "reports": [str(g) for g in report.graphs],
    }


CASES = {
    "ddp": lambda rank: _training_case(rank, "ddp", "whole"),
    "fsdp2_blocks": lambda rank: _training_case(rank, "fsdp2", "blocks"),
    "fsdp2_whole": lambda rank: _training_case(rank, "fsdp2", "whole"),
    "collectives": _collectives_case,
}


def _worker(rank: int, port: int, out_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # fc.all_gather_tensor's deprecation notice
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    results = {}
    try:
        for name, case in CASES.items():
            try:
                results[name] = case(rank)
            except Exception:  # noqa: BLE001  (one case's failure is that case's result; the others still run)
                results[name] = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _result(ranks, name: str, rank: int) -> dict:
    result = ranks[rank][name]
    assert "error" not in result, f"{name} on rank {rank} raised:\n{result['error']}"
    assert not result["fallbacks"], f"{name} on rank {rank} fell back: {result['fallbacks']}"
    return result


@pytest.mark.parametrize("name", ["ddp", "fsdp2_blocks", "fsdp2_whole"])
@pytest.mark.parametrize("rank", range(WORLD))
def test_training_matches_eager(ranks, name, rank):
    result = _result(ranks, name, rank)
    eager, ember = result["eager"], result["ember"]
    assert "backward" in result["kinds"], f"{name}: no backward graph compiled: {result['kinds']}"
    for step in range(STEPS):
        line = f"repro: pytest tests/e2e/test_distributed.py  # {name} rank {rank} step {step}"
        torch.testing.assert_close(ember["losses"][step], eager["losses"][step], rtol=RTOL, atol=ATOL, msg=line)
        for k, (g, ref) in enumerate(zip(ember["grads"][step], eager["grads"][step])):
            torch.testing.assert_close(
                g, ref, rtol=RTOL, atol=ATOL, msg=lambda m, k=k, line=line: f"grad {k}: {m}\n{line}"
            )


def test_ddp_graph_split_at_buckets(ranks):
    """optimize_ddp splits the model at its bucket boundaries: several forward graphs, each compiled."""
    kinds = _result(ranks, "ddp", 0)["kinds"]
    assert kinds.count("forward") >= 2, f"one forward graph: the DDP split did not happen: {kinds}"


@pytest.mark.parametrize("rank", range(WORLD))
def test_functional_collectives_compile_and_match(ranks, rank):
    result = _result(ranks, "collectives", rank)
    for k, (got, ref) in enumerate(zip(result["ember"], result["eager"])):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"output {k}: {m}")
    text = "\n".join(result["reports"])
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        # ember.explain's line for each: where it starts, where it is waited on, what runs between.
        assert f"collective {op} " in text and "waited at step" in text, f"{op}: no collective line:\n{text}"
