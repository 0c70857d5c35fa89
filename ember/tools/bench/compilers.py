"""The compilers the bench runs, by name.

- "eager";
- "inductor" and "ember", each optionally in a torch.compile mode ("ember:reduce-overhead"); the
  pseudo-mode "freezing" is the default mode with `options={"freezing": True}` (parameters of an
  inference graph as constants; Inductor's and ember's own freezing);
- "onnxruntime", a peer for CPU inference: `torch.onnx.export(dynamo=True)` of the step at its first
  call, then an ONNX Runtime session with torch's thread count (ort_peer.py).
"""

from __future__ import annotations

__all__ = ["PEERS", "compile_fn"]

PEERS = ("onnxruntime",)  # other frameworks' runtimes the bench can run beside the compilers (inference only)


def compile_fn(fn, compiler: str):
    """`compiler` is "eager", "inductor[:MODE]", "ember[:MODE]" or "onnxruntime"."""
    import torch

    name, _, mode = compiler.partition(":")
    if name == "eager":
        return fn
    if name == "onnxruntime":
        from ember.tools.bench.ort_peer import OrtStep

        return OrtStep(fn)
    options = {"freezing": True} if mode == "freezing" else None
    mode = None if mode in ("", "freezing") else mode
    if name == "inductor":
        return torch.compile(fn, mode=mode, options=options)
    if name == "ember":
        from ember.frontend.backend import ember_backend

        return torch.compile(fn, backend=ember_backend, mode=mode, options=options)
    raise ValueError(f"unknown compiler {compiler!r}")
