"""A CPU scalar tensor computed inside a device graph reaches a kernel only through one copy to the
device (aten/builder.py: `operand`, `to_device`).

DeBERTa's attention divides its scores by `torch.sqrt(torch.tensor(d) * scale)`, a CPU tensor: the
ATen ops computing it run on the host, and a kernel that read their result where it lies would read
host memory from the GPU (an illegal address on an H100). Device-free: the graph is traced with fake
CUDA tensors and imported, and the imported nodes are inspected."""

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ember.aten.importer import import_graph

CUDA = torch.device("cuda:0")


def _scaled(x):
    scale = torch.sqrt(torch.tensor(x.shape[-1], dtype=torch.float) * 2)
    return x / scale.to(x.dtype), x * scale.to(x.dtype)


def _imported(fn, device=CUDA):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        x = FakeTensor(mode, torch.empty(4, 8, device="meta"), device)
        gm = make_fx(fn)(x)
    return import_graph(gm, device)


def test_a_host_scalar_is_copied_to_the_device_once_before_kernels_read_it():
    graph = _imported(_scaled)
    kernels = [n for n in graph.nodes if n.op not in ("input", "extern")]
    assert kernels, [n.op for n in graph.nodes]
    for node in kernels:
        assert all(v.device == CUDA for v in node.inputs), [(node.op, [str(v.device) for v in node.inputs])]
    copies = [n for n in graph.nodes if n.op == "extern" and n.origin == "to device"]
    assert len(copies) == 1, [n.origin for n in graph.nodes]  # one copy, read by both products
    assert copies[0].inputs[0].device.type == "cpu" and copies[0].outputs[0].device == CUDA


def test_host_results_keep_their_device():
    graph = _imported(_scaled)
    sqrt = next(n for n in graph.nodes if n.op == "extern" and n.origin == "sqrt")
    assert sqrt.outputs[0].device.type == "cpu"


def test_a_cpu_graph_makes_no_copies():
    def f(x):
        return x / torch.sqrt(torch.tensor(x.shape[-1], dtype=torch.float))

    graph = _imported(f, torch.device("cpu"))
    assert not [n for n in graph.nodes if n.op == "extern" and n.origin == "to device"]
