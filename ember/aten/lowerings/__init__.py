"""ATen -> ember IR, one module per op family. Importing this package imports every family, and
each registers its lowerings (registry.py) as it loads; the importer imports it for that.

Ops absent here run as externs. A lowering raises `Unsupported` to decline a particular call (e.g.
a rounding mode ember does not generate); that call then runs as an extern too.
"""

from ember.aten.lowerings import (  # noqa: F401
    cat_pad,
    control_flow,
    convolution,
    elementwise,
    flex,
    gather_scatter,
    movement,
    pooling,
    reductions,
    rng_state,
    size_checks,
)
