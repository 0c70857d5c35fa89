"""`llama_decode`: greedy decoding with HF transformers' static KV cache, the decode step compiled.

A Llama-3.2-1B-shaped `LlamaForCausalLM` built from its config (hidden 2048, 16 layers, 32 heads,
8 KV heads, MLP 8192, vocabulary 128256, tied embeddings, bf16; random weights), `generate` with
`cache_implementation="static"`. Only the decode step (one new token per sequence) runs compiled:
the forward is replaced by one that sends a single-token call to the compiled forward
(`dynamic=False`, so the step's shapes stay static) and the prompt to the eager one.

Per compiler, in its own process (a crash, such as a compiler's segmentation fault, costs that
cell, not the run): time per token = (time of `generate` of N tokens − time of N/4 tokens) / (N − N/4),
the median over rounds (both calls pay the prompt and the CUDA graph recorded for the new KV cache each
`generate` call allocates: the difference is decode steps alone); the GPU's busy time per token likewise from torch.profiler; and the
greedy tokens, compared with eager's (how many of the N match, and where they first differ).

Correctness is judged on logits, not tokens: with random weights the next-token logits are nearly
uniform, so any rounding difference flips a greedy token (every compiler's tokens leave eager's within
a few steps). Each process decodes once more with its history forced to eager's tokens and keeps
every step's logits; the eager process also does it with the model in float64. A compiler passes
where its logits are as close to float64's as the project's rule allows next to eager's
(`measure.tolerance`).

The floor: the bytes a token must read, the weights (the tied embedding once, as the head) and
the KV cache over the mean context length of the new tokens (the timed ones, from N/4 on, read a few
positions more: under 0.1% of the bytes at the GPU scale), over the measured copy bandwidth.

    python -m ember.tools.bench.decode COMPILER SCALE BATCH [LOGITS.pt TOKENS.json]
    (the child; prints one JSON line; with the paths, writes its forced-history logits, reading eager's
    tokens from TOKENS.json unless it is eager)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# (hidden, layers, heads, kv heads, MLP, vocabulary, batch, prompt tokens, new tokens)
_GPU = (2048, 16, 32, 8, 8192, 128256)
_CPU = (256, 2, 8, 2, 512, 4096)
_TINY = (64, 1, 4, 2, 128, 256)
SIZES_B1 = {"gpu": (*_GPU, 1, 16, 64), "cpu": (*_CPU, 1, 8, 8), "tiny": (*_TINY, 1, 4, 4)}
SIZES_B8 = {"gpu": (*_GPU, 8, 16, 64), "cpu": (*_CPU, 2, 8, 8), "tiny": (*_TINY, 2, 4, 4)}


def describe(size: tuple) -> str:
    hidden, layers, heads, kv, mlp, vocab, batch, prompt, new = size
    return f"batch {batch}, {layers}×{hidden}, {heads}/{kv} heads, MLP {mlp}, vocab {vocab}, {prompt}+{new} tokens"


def build_model(size: tuple, device, dtype=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, mlp, vocab, batch, prompt, new = size
    cfg = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=max(2048, prompt + new),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype or torch.bfloat16).eval()
    model.generation_config.disable_compile = True  # transformers' own compile of the forward: not this row's
    ids = torch.randint(3, vocab, (batch, prompt), device=device)
    return model, ids


def floor_bytes(model, size: tuple) -> int:
    """Weights (each parameter once: the tied embedding is read whole by the head) and the KV cache
    over the mean context of the new tokens, bf16."""
    hidden, layers, heads, kv, _, _, batch, prompt, new = size
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    context = prompt + new / 2
    return int(weights + layers * 2 * batch * kv * (hidden // heads) * context * 2)


def _decode_only(model, compiler: str):
    """The model's forward, its single-token calls through `compiler`."""
    import torch

    eager = model.forward
    if compiler == "eager":
        return eager
    name, _, mode = compiler.partition(":")
    if name == "ember":
        from ember.frontend.backend import register

        register()
    compiled = torch.compile(
        eager, backend="ember" if name == "ember" else "inductor", mode=mode or None, dynamic=False
    )

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        return compiled(*args, **kwargs) if ids is not None and ids.shape[-1] == 1 else eager(*args, **kwargs)

    return forward


def child(compiler: str, scale: str, batch: int, logits_path: str = "", tokens_path: str = "") -> dict:
    import torch

    size = (SIZES_B8 if batch > 1 else SIZES_B1)[scale]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, ids = build_model(size, device)
    new = size[-1]
    model.forward = _decode_only(model, compiler)
    kw = {"do_sample": False, "cache_implementation": "static", "pad_token_id": 0}

    def generate(n):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    t0 = time.perf_counter()
    tokens = generate(new)[:, ids.shape[1] :]
    result = {
        "first_call_s": time.perf_counter() - t0,
        "tokens": tokens.tolist(),
        "floor_bytes": floor_bytes(model, size),
    }
    short = _short(new)
    generate(short)
    per_token = []
    for _ in range(3 if scale == "gpu" else 1):
        t = time.perf_counter()
        generate(new)
        long = time.perf_counter() - t
        t = time.perf_counter()
        generate(short)
        per_token.append((long - (time.perf_counter() - t)) / (new - short) * 1000)
    result["ms"] = statistics.median(per_token)
    if device.type == "cuda":
        result["busy_ms"] = (_busy(generate, new) - _busy(generate, short)) / (new - short)
    if logits_path:
        forced = result["tokens"]
        if compiler != "eager":
            with open(tokens_path) as f:
                forced = json.load(f)
        saved = {"logits": forced_logits(model, ids, forced, kw)}
        if compiler == "eager":
            del model
            reference, _ = build_model(size, device, torch.float64)
            saved["reference"] = forced_logits(reference, ids, forced, kw)
        torch.save(saved, logits_path)
    return result


def _short(new: int) -> int:
    """The shorter generation timed against the long one: both pay the prompt and each call's one-time work
    (a CUDA graph recorded for the KV cache that every `generate` call allocates), which the difference
    leaves out, so that it holds decode steps alone."""
    return max(2, new // 4)


def forced_logits(model, ids, tokens: list, kw: dict):
    """The logits of every step of `generate` with its history forced to `tokens` ([batch][steps]):
    float32 on the CPU, [batch, steps, vocabulary]."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    prompt = ids.shape[1]
    forced = torch.tensor(tokens, device=ids.device)

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            chosen = torch.full_like(scores, float("-inf"))
            chosen[torch.arange(scores.shape[0]), forced[:, input_ids.shape[1] - prompt]] = 0
            return chosen

    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=forced.shape[1],
            min_new_tokens=forced.shape[1],
            logits_processor=LogitsProcessorList([Force()]),
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    return torch.stack(out.logits, 1).float().cpu()


def _busy(generate, n: int) -> float:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(n)
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.device_time for e in prof.events() if e.device_type == cuda) / 1000


def run(case, s, record: dict, ceilings: dict) -> dict:
    """Eager and each compiler in its own process; per-token time, % of the floor, logits against float64's
    (and tokens against eager's)."""
    import torch

    batch = case.workload.sizes[s.scale][6]
    results, logits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tokens_path = os.path.join(tmp, "tokens.json")
        for compiler in ["eager", *s.compilers]:
            s.progress(f"{case.key}: {compiler}")
            logits_path = os.path.join(tmp, f"{len(logits)}.pt")
            paths = [logits_path, tokens_path]
            results[compiler] = _run_child(compiler, s.scale, batch, s.compile_timeout_s, paths)
            if compiler == "eager":
                if "ms" not in results["eager"]:
                    record["error"] = f"eager: {results['eager'].get('note', 'failed')}"
                    return record
                with open(tokens_path, "w") as f:
                    json.dump(results["eager"]["tokens"], f)
            if os.path.exists(logits_path):
                logits[compiler] = torch.load(logits_path)
    eager = results["eager"]
    floor_ms = eager["floor_bytes"] / ceilings["bandwidth_Bps"] * 1000
    record["limit"] = {"bytes": eager["floor_bytes"], "flops": 0, "floor_ms": floor_ms}
    for compiler, r in check_logits(check_tokens(results), logits).items():
        record["compilers"][compiler] = r
    return record


def check_logits(results: dict[str, dict], logits: dict[str, dict]) -> dict[str, dict]:
    """Each compiler's forced-history logits against float64's, under the float64 rule next to eager's:
    this decides the status; the greedy tokens are a note beside it."""
    import torch

    from ember.tools.bench import measure

    if "eager" not in logits:
        return results
    reference = logits["eager"]["reference"]
    eager_err = measure.rel_err(logits["eager"]["logits"], reference)
    tol = measure.tolerance(torch.bfloat16, eager_err)
    for compiler, r in results.items():
        if "ms" not in r:
            continue
        if compiler not in logits:
            r.update(status="error", note="no logits came back from its process")
            continue
        err = measure.rel_err(logits[compiler]["logits"], reference)
        tokens = f"greedy tokens equal to eager's: {r['tokens_matching']}" + (f"; {r['note']}" if "note" in r else "")
        r.update(err=err, tol=tol, status="ok" if err <= tol else "mismatch", note=tokens)
        if err > tol:
            r["note"] = f"logits: max rel err {err:.2e} > tol {tol:.2e}; {tokens}"
    return results


def check_tokens(results: dict[str, dict]) -> dict[str, dict]:
    """Each compiler's greedy tokens against eager's (results["eager"]): how many match and where they
    first differ; the tokens themselves leave the results."""
    eager_tokens = _flat(results["eager"]["tokens"])
    for r in results.values():
        if "ms" in r:
            same = [a == b for a, b in zip(_flat(r["tokens"]), eager_tokens)]
            r["tokens_matching"] = f"{sum(same)}/{len(same)}"
            r["status"] = "ok" if all(same) else "mismatch"
            if not all(same):
                r["note"] = f"greedy tokens differ from eager's from position {same.index(False)}"
                r["err"] = 1.0 - sum(same) / len(same)
    for r in results.values():
        r.pop("tokens", None)
    return results


def _flat(tokens: list) -> list:
    return [t for row in tokens for t in row]


def _run_child(compiler: str, scale: str, batch: int, timeout: float, paths: list[str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "ember.tools.bench.decode", compiler, scale, str(batch), *(paths or [])]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"timed out after {timeout:.0f} s"}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"status": "error", "note": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])), flush=True)
