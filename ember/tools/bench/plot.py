"""The bench's PNG (`bench.png` beside its tables): speed-up bars, %-of-limit bars and a roofline,
derived from a run's records as the tables are (report.py)."""

from __future__ import annotations

import math

from ember.tools.bench.report import Run, describe_env, fraction_of_limit, label, ms_of, speedup, versus


def plot(run: Run, path: str) -> str | None:
    """Write a PNG with speed-up bars, %-of-limit bars and a roofline; returns a note if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    compilers = run.compilers
    cases = [c for c in run.cases.values() if not c.get("skipped") and not c.get("error") and c.get("compilers")]
    if not cases:
        return "no timed cases of fixed shape: no PNG" if run.dynamic else "no timed cases: no PNG"
    names = [f"{c['workload']}\n{c['mode']}" for c in cases]
    colors = {"eager": "#999999", "inductor": "#4c72b0"}
    palette = ["#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for i, c in enumerate(x for x in compilers if x not in colors):
        colors[c] = palette[i % len(palette)]
    fig, axes = plt.subplots(3, 1, figsize=(max(10, 0.9 * len(cases) + 3), 15))
    width = 0.8 / max(1, len(compilers))
    xs = range(len(cases))

    ax = axes[0]
    for j, comp in enumerate(compilers):
        vals = [speedup(c, comp) or math.nan for c in cases]
        bars = ax.bar([x + j * width for x in xs], vals, width, label=label(comp), color=colors[comp])
        for bar, case in zip(bars, cases):
            st = case["compilers"].get(comp, {}).get("status", "-")
            text = {"fell back": "fell\nback", "mismatch": "MIS-\nMATCH", "error": "error"}.get(st)
            if comp.startswith("ember") and "inductor" in compilers and versus(case, comp):
                text = f"{versus(case, comp):.2f}" + ("\nfell back" if st == "fell back" else "")
            if text:
                y = bar.get_height() if math.isfinite(bar.get_height()) else 1.0  # untimed: at the eager line
                ax.text(
                    bar.get_x() + bar.get_width() / 2, y, text, ha="center", va="bottom", fontsize=7, color=colors[comp]
                )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speed-up over eager (×, log scale)")
    ax.set_title("Speed-up over eager; number above ember's bar: ember ÷ Inductor speed (same run)")
    ax.set_xticks([x + width * (len(compilers) - 1) / 2 for x in xs], names, fontsize=7)
    ax.legend(fontsize=8)

    ax = axes[1]
    every = ["eager", *compilers]
    w2 = 0.8 / len(every)
    for j, comp in enumerate(every):
        vals = [100 * (fraction_of_limit(c, comp) or 0.0) for c in cases]
        ax.bar([x + j * w2 for x in xs], vals, w2, label=label(comp), color=colors[comp])
    ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("% of the limit")
    ax.set_title("Achieved fraction of the limit (max of byte floor and FLOP floor, measured ceilings)")
    ax.set_xticks([x + w2 * (len(every) - 1) / 2 for x in xs], names, fontsize=7)
    ax.legend(fontsize=8)

    ax = axes[2]
    _roofline(ax, run, cases, every, colors)
    fig.suptitle("ember bench: " + (describe_env(run)[0] if run.env else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def _roofline(ax, run: Run, cases: list[dict], compilers: list[str], colors: dict) -> None:
    c = run.ceilings
    points = [case for case in cases if (case.get("limit") or {}).get("flops")]
    if not c or not points:
        ax.text(0.5, 0.5, "no workload with counted FLOPs", ha="center", transform=ax.transAxes)
        return
    bw = c["bandwidth_Bps"]
    intensities = [case["limit"]["flops"] / case["limit"]["bytes"] for case in points]
    lo, hi = min(intensities) / 4, max(intensities) * 4
    xs = [lo * (hi / lo) ** (k / 100) for k in range(101)]
    for dtype, peak in c["flops"].items():
        ax.plot(xs, [min(bw * x, peak) for x in xs], linestyle="--", linewidth=1, label=f"roof ({dtype} matmul)")
    markers = "osD^v<>"
    for j, comp in enumerate(compilers):
        px, py = [], []
        for case, inten in zip(points, intensities):
            t = ms_of(case, comp)
            if t:
                px.append(inten)
                py.append(case["limit"]["flops"] / (t / 1000))
        ax.scatter(px, py, marker=markers[j % len(markers)], color=colors[comp], label=label(comp), zorder=3)
    for case, inten in zip(points, intensities):
        top = min(bw * inten, max(c["flops"].values()))
        ax.annotate(f"{case['workload']}/{case['mode'][:5]}", (inten, top), fontsize=6, rotation=30)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (counted FLOPs ÷ minimum bytes)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title("Roofline: workloads with matmul/conv/attention FLOPs (measured bandwidth and matmul ceilings)")
    ax.legend(fontsize=7)
