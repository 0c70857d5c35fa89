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


_THREADS_CHILD = """
import threading
import time
import torch
from torch._dynamo.backends import registry
from ember.frontend.backend import register

real_register_backend = registry.register_backend

def slow_register_backend(*args, **kwargs):
    time.sleep(0.05)  # a thread switch between a registry lookup and its registration, made certain
    return real_register_backend(*args, **kwargs)

registry.register_backend = slow_register_backend  # torch's lookup_backend calls it by this name too

def compile_at_once(threads, make_backend):
    barrier, errors, outs = threading.Barrier(threads), [], {}
    def work(k):
        barrier.wait()
        try:
            outs[k] = torch.compile(lambda x: x * k + 1, backend=make_backend())(torch.ones(3))
        except Exception as e:
            errors.append(repr(e))
    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert all(torch.equal(outs[k], torch.ones(3) * k + 1) for k in range(threads)), outs

# The first compiles of a process, through pip's entry point where ember is installed.
compile_at_once(6, register)
# Without the entry point: register() itself registers the name, from every thread at once.
registry._COMPILER_FNS.pop("ember", None)
registry._BACKENDS.pop("ember", None)
compile_at_once(6, register)
print("ok")
"""


def test_register_from_many_threads_at_once():
    """Threads that start compiling at the same moment each get the backend: none sees torch's
    registry raise "duplicate name: ember"."""
    r = subprocess.run([sys.executable, "-c", _THREADS_CHILD], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
