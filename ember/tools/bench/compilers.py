"""The compilers the bench runs, by name: eager, Inductor and ember, each optionally in a torch.compile mode."""

from __future__ import annotations

__all__ = ["compile_fn"]


def compile_fn(fn, compiler: str):
    """`compiler` is "eager", "inductor", "inductor:MODE", "ember" or "ember:MODE"."""
    import torch

    name, _, mode = compiler.partition(":")
    if name == "eager":
        return fn
    if name == "inductor":
        return torch.compile(fn, mode=mode or None)
    if name == "ember":
        from ember.frontend.backend import ember_backend

        return torch.compile(fn, backend=ember_backend, mode=mode or None)
    raise ValueError(f"unknown compiler {compiler!r}")
