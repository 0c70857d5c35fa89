"""The GPT-2-block training step written in JAX and compiled by XLA, for a column beside ember's.

The same program as `gpt2_step` (workloads.py: `programs.GPT2Stack`): blocks of pre-norm causal
attention (cuDNN's, through `jax.nn.dot_product_attention` on a GPU) and a tanh-GELU MLP, a final
layer norm, bf16 parameters and activations (layer norms computed in fp32, as PyTorch's), and the
step is the forward plus every gradient for a random cotangent (`jax.vjp`), under one `jax.jit`.
It runs in its own process (JAX and PyTorch each reserve GPU memory), timed as the mean of steps
launched back to back after warm-up, then synchronized; where JAX is absent the column says so.
It has its own random weights: the column is timed, not compared with eager's values.

    python -m ember.tools.bench.jax_step B T D HEADS LAYERS   (the child; prints one JSON line)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time


def _layer_norm(x, w, b):
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * w + b).astype(x.dtype)


def _block(p, x, heads: int):
    import jax

    b, t, c = x.shape
    qkv = _layer_norm(x, p["ln1_w"], p["ln1_b"]) @ p["qkv_w"] + p["qkv_b"]
    q, k, v = (z.reshape(b, t, heads, c // heads) for z in (qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :]))
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    x = x + y.reshape(b, t, c) @ p["proj_w"] + p["proj_b"]
    h = _layer_norm(x, p["ln2_w"], p["ln2_b"]) @ p["fc_w"] + p["fc_b"]
    return x + jax.nn.gelu(h, approximate=True) @ p["out_w"] + p["out_b"]


def _params(key, d: int, layers: int):
    import jax
    import jax.numpy as jnp

    def dense(key, n_in, n_out):
        return (jax.random.normal(key, (n_in, n_out), jnp.float32) / n_in**0.5).astype(jnp.bfloat16)

    blocks = []
    for block_key in jax.random.split(key, layers):
        k = jax.random.split(block_key, 4)
        ones, zeros = jnp.ones((d,), jnp.bfloat16), jnp.zeros((d,), jnp.bfloat16)
        blocks.append(
            {
                "ln1_w": ones, "ln1_b": zeros, "ln2_w": ones, "ln2_b": zeros,
                "qkv_w": dense(k[0], d, 3 * d), "qkv_b": jnp.zeros((3 * d,), jnp.bfloat16),
                "proj_w": dense(k[1], d, d), "proj_b": zeros,
                "fc_w": dense(k[2], d, 4 * d), "fc_b": jnp.zeros((4 * d,), jnp.bfloat16),
                "out_w": dense(k[3], 4 * d, d), "out_b": zeros,
            }
        )  # fmt: skip
    return {"blocks": blocks, "lnf_w": jnp.ones((d,), jnp.bfloat16), "lnf_b": jnp.zeros((d,), jnp.bfloat16)}


def child(b: int, t: int, d: int, heads: int, layers: int) -> dict:
    import jax
    import jax.numpy as jnp

    def forward(params, x):
        for p in params["blocks"]:
            x = _block(p, x, heads)
        return _layer_norm(x, params["lnf_w"], params["lnf_b"])

    @jax.jit
    def step(params, x, ct):
        y, vjp = jax.vjp(forward, params, x)
        return y, vjp(ct)

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = _params(keys[0], d, layers)
    x = jax.random.normal(keys[1], (b, t, d), jnp.float32).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[2], (b, t, d), jnp.float32).astype(jnp.bfloat16)
    start = time.perf_counter()
    jax.block_until_ready(step(params, x, ct))
    first = time.perf_counter() - start
    for _ in range(5):
        out = step(params, x, ct)
    jax.block_until_ready(out)
    times = []
    for _ in range(5):
        n = 20
        start = time.perf_counter()
        for _ in range(n):
            out = step(params, x, ct)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / n * 1000)
    times.sort()
    return {
        "ms": times[len(times) // 2],
        "first_call_s": first,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
    }


def others(case, s) -> dict[str, dict]:
    """{"jax": result}: the step in JAX, run in a fresh process; skipped where JAX does not import."""
    if importlib.util.find_spec("jax") is None:
        return {"jax": {"status": "skipped", "note": "jax not importable here"}}
    size = case.workload.sizes[s.scale]
    cmd = [sys.executable, "-m", "ember.tools.bench.jax_step", *map(str, size)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch's process still holds its memory
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=s.compile_timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"jax": {"status": "error", "note": "timed out"}}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"jax": {"status": "error", "note": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}}
    result = json.loads(lines[-1])
    result.update(status="ok", note="JAX/XLA, its own random weights: timed, not compared with eager")
    return {"jax": result}


if __name__ == "__main__":
    print(json.dumps(child(*map(int, sys.argv[1:6]))), flush=True)
