"""ember's demo: compile models on the GPU if there is one (else the CPU), check them against
eager PyTorch, and print compile time, speed-up and the kernels ember made.

    ember demo [--workloads gpt2_block,softmax] [--dtype bfloat16] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ember.tools.timing_noise import Spread, load_average, load_warning, spread_warning, usable_cpus
from ember.tools.workloads import WORKLOADS

ROUNDS = 5  # timing rounds per workload; eager and ember take turns in each
ROUND_MS = 40.0  # each function's share of one round: enough back-to-back calls that one call's jitter averages out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _calls_per_round(fn: Callable[[], object], device: str, clock: Callable[[], float]) -> int:
    start = clock()
    fn()
    _sync(device)
    single_ms = (clock() - start) * 1000
    return max(1, min(10_000, math.ceil(ROUND_MS / max(single_ms, 1e-3))))


def time_in_rounds(
    fns: dict[str, Callable[[], object]],
    device: str,
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Milliseconds per call of each function, one number per round.

    The functions take turns within a round and the order rotates from round to round, so a change
    in the machine's speed (another process, clocks) falls on all of them alike instead of on
    whichever ran last. A round times enough back-to-back calls to fill ROUND_MS, then synchronizes.
    """
    for fn in fns.values():  # the first calls allocate, load kernels and fill caches
        for _ in range(3):
            fn()
    _sync(device)
    calls = {name: _calls_per_round(fn, device, clock) for name, fn in fns.items()}
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = clock()
            for _ in range(calls[name]):
                fns[name]()
            _sync(device)
            times[name].append((clock() - start) * 1000 / calls[name])
    return times


@dataclass(frozen=True)
class Timing:
    """One workload's rounds: eager's and ember's ms per call, the speed-up of each round, and warnings."""

    eager: Spread
    ember: Spread
    speedup: Spread
    warnings: tuple[str, ...]

    @classmethod
    def of(cls, name: str, eager_ms: list[float], ember_ms: list[float]) -> Timing:
        warnings = (spread_warning(f"{name}, eager", eager_ms), spread_warning(f"{name}, ember", ember_ms))
        return cls(
            eager=Spread.of(eager_ms),
            ember=Spread.of(ember_ms),
            speedup=Spread.of([e / c for e, c in zip(eager_ms, ember_ms)]),
            warnings=tuple(w for w in warnings if w),
        )


HEADER = (
    f"{'workload':<15}{'compile s':>10}{'eager ms':>9}{'ember ms':>9}{'speed-up':>9}{'range':>11}{'kernels':>8}   ok"
)


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def format_row(name: str, compile_s: float, timing: Timing, kernels: int, ok: bool) -> str:
    """One table line (under 80 columns): median times and speed-up over the rounds, the speed-up's range."""
    s = timing.speedup
    return (
        f"{name:<15}{compile_s:>10.2f}{timing.eager.median:>9.3g}{timing.ember.median:>9.3g}{s.median:>8.2f}x"
        f" {f'{_ratio(s.low)}-{_ratio(s.high)}x':>10}{kernels:>8}  {'yes' if ok else ' NO'}"
    )


def _outputs(x):
    return [t for t in (x if isinstance(x, (tuple, list)) else [x]) if isinstance(t, torch.Tensor)]


def run(names: list[str], dtype: torch.dtype, device: str) -> bool:
    import torch._dynamo

    # The CPU sizes make each timed call take a millisecond or more: at a tenth of that, call
    # overhead and the clock's jitter decide the speed-up.
    scale = "gpu" if device == "cuda" else "cpu"
    print(
        f"ember demo on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, {dtype}, torch {torch.__version__}"
    )
    busy = load_warning(load_average(), usable_cpus())
    if busy:
        print(f"warning: {busy}")
    print(
        f"times: ms per call, the median of {ROUNDS} rounds in which eager and ember take turns;\n"
        "range: the speed-up's min-max over the rounds; ok: matches eager, no graph run eagerly\n"
    )
    print(HEADER)
    all_ok = True
    last_report = None
    warnings: list[str] = []
    problems: list[str] = []
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
            fell_back = [g.fallback for g in report.graphs if g.fallback]
            ok = all(e <= tol for e in errs) and not fell_back
            all_ok &= ok
            if not ok:
                problems.append(
                    f"{name}: max abs error {max(errs):.1e} (tolerance {tol:.1e})"
                    + (f"; ran a graph eagerly: {fell_back[0]}" if fell_back else "")
                )
            del out, ref
            times = time_in_rounds(
                {"eager": lambda f=fn, x=inputs: f(*x), "ember": lambda f=compiled, x=inputs: f(*x)}, device
            )
        timing = Timing.of(name, times["eager"], times["ember"])
        warnings += timing.warnings
        kernels = sum(len(g.kernels) for g in report.graphs)
        print(format_row(name, compile_s, timing, kernels, ok), flush=True)
        last_report = report
    for p in problems:
        print(f"NOT OK: {p}")
    for w in warnings:
        print(f"warning: {w}")
    if warnings or busy:
        print("(the speed-ups above come from a busy or uneven machine: rerun when it is quiet)")
    if last_report is not None:
        print(f"\nWhat ember made of {names[-1]}:")
        print(last_report)
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ember demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="(default: %(default)s)")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: %(default)s, this machine's)",
    )
    args = parser.parse_args(argv)
    ok = run(args.workloads.split(","), getattr(torch, args.dtype), args.device)
    print("\nall outputs match eager" if ok else "\nMISMATCH: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
