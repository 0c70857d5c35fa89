"""ember: a compiler backend for PyTorch programs.

    model = torch.compile(model, backend="ember")          # or ember.compile(model)
    report = ember.explain(fn, *args)                        # what ember made of fn

Settings live in `ember.config` (env EMBER_<NAME>, `options={...}`, `config.override`).
Importing ember is cheap: the compiler loads its stages on first compile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember import config, stats
from ember.config import ConfigError

__all__ = ["ConfigError", "compile", "config", "explain", "load_cache", "save_cache", "stats"]
__version__ = "0.1.0"


def compile(
    model: Callable | None = None,
    *,
    mode: str | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    options: dict[str, Any] | None = None,
) -> Callable:
    """`torch.compile(model, backend="ember", ...)`; ember settings go in `options`."""
    import torch

    from ember.frontend.backend import ember_backend

    if options:
        config.validate(dict(options), "ember.compile options")
    config.check_environment()  # a bad EMBER_* variable fails here, not at the first call

    def backend(gm, example_inputs):
        return ember_backend(gm, example_inputs, mode=mode, options=options)

    def wrap(fn):
        return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    return wrap if model is None else wrap(model)


def explain(fn: Callable, *args: Any, **kwargs: Any):
    """Compile and run `fn(*args, **kwargs)` once (and its backward, if it has one); report what ember did."""
    from ember.tools.explain import explain as _explain

    return _explain(fn, *args, **kwargs)


def save_cache(path: str):
    """Write every entry of ember's disk cache (setting `cache_dir`), and AOTAutograd's entries of
    ember's graphs, to one file, for `load_cache` on another machine of the same kind (same GPU,
    torch, Triton and ember). Returns a summary."""
    from ember.frontend.cache_file import save_cache as _save

    return _save(path)


def load_cache(path: str):
    """Check a file `save_cache` wrote and add its entries to ember's disk cache. A damaged file,
    or one made for another GPU, torch, Triton or ember, raises `ember.runtime.portable.CacheFileError`
    (a ValueError) and imports nothing. Import files only from a source you trust: their kernels run."""
    from ember.frontend.cache_file import load_cache as _load

    return _load(path)
