"""ONNX Runtime as a peer of the compilers on the CPU: the step exported with `torch.onnx.export
(dynamo=True)` at its first call, then run by an `InferenceSession` with all of ONNX Runtime's
graph optimizations and torch's thread count, so both sides use the same cores.

Inference only, on CPU tensors of NumPy's dtypes. Inputs and outputs cross as NumPy arrays that share
the tensors' memory (no copies). ONNX Runtime's threads spin between its calls as it does by default,
which on a machine of few cores can take time from the next program timed. Where the export or the session fails, the first call raises and the bench's row says
why (`harness.run_compiler`)."""

from __future__ import annotations

import io

import torch
from torch import nn


class _AsModule(nn.Module):
    """The exporter takes modules: a plain function of the inputs, as one."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class OrtStep:
    """fn(*inputs) through ONNX Runtime; exported and loaded at the first call, for those input shapes."""

    def __init__(self, fn):
        self.fn = fn
        self.session = None

    def _load(self, inputs) -> None:
        import onnxruntime as ort

        module = self.fn if isinstance(self.fn, nn.Module) else _AsModule(self.fn)
        program = torch.onnx.export(module, tuple(inputs), dynamo=True, verbose=False)
        buffer = io.BytesIO()
        program.save(buffer)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(buffer.getvalue(), opts, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *inputs):
        if not all(isinstance(x, torch.Tensor) for x in inputs):
            raise NotImplementedError("the ONNX Runtime peer takes tensor inputs only")
        if any(x.requires_grad for x in inputs):
            raise NotImplementedError("ONNX Runtime runs inference only")
        if any(x.device.type != "cpu" or x.dtype == torch.bfloat16 for x in inputs):
            raise NotImplementedError("the ONNX Runtime peer takes CPU tensors NumPy can hold (no bfloat16)")
        if self.session is None:
            self._load(inputs)
            if len(self.names) != len(inputs):  # the export dropped an input the program does not read
                raise NotImplementedError(f"the exported program takes {len(self.names)} of {len(inputs)} inputs")
        feeds = {n: x.detach().numpy() for n, x in zip(self.names, inputs)}
        outs = [torch.from_numpy(o) for o in self.session.run(None, feeds)]
        return outs[0] if len(outs) == 1 else tuple(outs)
