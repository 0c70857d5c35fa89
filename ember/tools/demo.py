"""ember's demo: compile models on the GPU if there is one (else the CPU), check them against
eager PyTorch, and print compile time, speed-up and the kernels ember made.

    python -m ember.tools.demo [--workloads gpt2_block,softmax] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember.tools.workloads import WORKLOADS


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: str, repeats: int) -> float:
    """Median wall time of fn() in ms, synchronizing around each call."""
    for _ in range(3):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _outputs(x):
    return [t for t in (x if isinstance(x, (tuple, list)) else [x]) if isinstance(t, torch.Tensor)]


def run(names: list[str], dtype: torch.dtype, device: str) -> bool:
    import torch._dynamo

    scale = "gpu" if device == "cuda" else "small"
    repeats = 50 if device == "cuda" else 10
    print(
        f"ember demo on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, {dtype}, torch {torch.__version__}"
    )
    print(
        f"{'workload':<16}{'compile s':>10}{'eager ms':>10}{'ember ms':>10}{'speed-up':>10}{'kernels':>9}{'max err':>10}  ok"
    )
    all_ok = True
    last_report = None
    for name in names:
        torch._dynamo.reset()
        torch.manual_seed(0)
        fn, inputs = WORKLOADS[name].make(scale, dtype, device)
        with torch.no_grad():
            compiled = torch.compile(fn, backend="ember")
            from ember.report import collecting

            with collecting() as report:
                start = time.perf_counter()
                out = compiled(*inputs)
                _sync(device)
                compile_s = time.perf_counter() - start
            ref = fn(*inputs)
            errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(_outputs(out), _outputs(ref))]
            scale_ref = max(b.float().abs().max().item() for b in _outputs(ref))
            tol = (2e-2 if dtype != torch.float32 else 1e-4) * max(1.0, scale_ref)
            ok = all(e <= tol for e in errs) and not any(g.fallback for g in report.graphs)
            all_ok &= ok
            eager_ms = median_ms(lambda f=fn, x=inputs: f(*x), device, repeats)
            ember_ms = median_ms(lambda f=compiled, x=inputs: f(*x), device, repeats)
        kernels = sum(len(g.kernels) for g in report.graphs)
        print(
            f"{name:<16}{compile_s:>10.2f}{eager_ms:>10.3f}{ember_ms:>10.3f}{eager_ms / ember_ms:>9.2f}x"
            f"{kernels:>9}{max(errs):>10.2e}  {'yes' if ok else 'NO'}"
        )
        last_report = report
    if last_report is not None:
        print(f"\nWhat ember made of {names[-1]}:")
        print(last_report)
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="pointwise3,gelu_tanh,softmax,layernorm_gelu,mlp,gpt2_block")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    ok = run(args.workloads.split(","), getattr(torch, args.dtype), args.device)
    print("\nall outputs match eager" if ok else "\nMISMATCH: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
