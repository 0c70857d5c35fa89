"""backend="ember" resolves without pip's entry point (a checkout on PYTHONPATH, as on the GPU machine)."""

import subprocess
import sys

_CHILD = """
import torch
from torch._dynamo.backends import registry
registry.list_backends(exclude_tags=())       # load entry points first, then forget ember's
registry._COMPILER_FNS.pop("ember", None)
registry._BACKENDS.pop("ember", None)     # as if pip had never installed the entry point
try:
    torch.compile(lambda x: x + 1, backend="ember")(torch.ones(2))
    raise SystemExit("the name resolved without registration: the test proves nothing")
except Exception as e:
    assert "Invalid backend" in str(e), e
from ember.frontend.backend import register
assert register() == "ember" and register() == "ember"  # idempotent
torch._dynamo.reset()
y = torch.compile(lambda x: x.sin() + 1, backend="ember")(torch.ones(3))
assert torch.allclose(y, torch.ones(3).sin() + 1)
print("ok")
"""


def test_register_makes_the_name_resolve():
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
