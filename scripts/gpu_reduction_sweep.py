"""On the GPU: time ember's persistent-reduction kernels under several launch configs.

    python scripts/gpu_reduction_sweep.py [--out DIR]

For the row-wise micro workloads (layernorm_residual, rmsnorm, softmax, cross_entropy) it
patches `launch_config` for persistent reductions to each (rows per program, warps) pair,
compiles with ember in a fresh cache, checks the result against eager and times it with
triton.testing.do_bench; prints achieved bandwidth as a fraction of the measured copy
bandwidth, so the size heuristic in ember/codegen/triton.py can be chosen from data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--workloads", default="layernorm_residual,rmsnorm,softmax,cross_entropy")
    args = parser.parse_args()
    os.environ["EMBER_CACHE_DIR"] = tempfile.mkdtemp()
    os.environ["EMBER_STRICT"] = "1"
    import triton.testing

    import ember.codegen.triton as tcg
    from ember.frontend.backend import ember_backend
    from ember.schedule.cost import target_for
    from ember.tools.bench.workloads import WORKLOADS

    device = torch.device("cuda")
    bw = target_for(device).bandwidth
    original = tcg.launch_config
    variants = [None, (1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16), (1, 32)]
    rows = []
    for w in [WORKLOADS[name] for name in args.workloads.split(",")]:
        built = w.build(w.sizes["gpu"], device)
        with torch.no_grad():
            want = built.fn(*built.inputs)
        moved = sum(x.nbytes for x in built.inputs if isinstance(x, torch.Tensor))
        moved += sum(t.nbytes for t in (want if isinstance(want, tuple) else (want,)))
        for variant in variants:

            def patched(kernel, variant=variant):
                cfg = original(kernel)
                if variant is None or not cfg.persistent:
                    return cfg
                xblock, warps = variant
                return tcg.LaunchConfig(xblock, cfg.rblock, warps, True)

            tcg.launch_config = patched
            torch._dynamo.reset()
            try:
                fn = torch.compile(built.fn, backend=ember_backend)
                with torch.no_grad():
                    got = fn(*built.inputs)
                    ok = all(
                        torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
                        for a, b in zip(
                            got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)
                        )
                    )
                    ms = triton.testing.do_bench(lambda: fn(*built.inputs), warmup=50, rep=300)
                row = {
                    "workload": w.name,
                    "variant": variant or "default",
                    "ms": ms,
                    "ok": ok,
                    "bw_fraction": moved / (ms / 1e3) / bw,
                }
            except Exception as e:  # a config Triton cannot compile: record it, go on
                row = {"workload": w.name, "variant": variant or "default", "error": f"{type(e).__name__}: {e}"[:200]}
            finally:
                tcg.launch_config = original
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "reduction_sweep.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
