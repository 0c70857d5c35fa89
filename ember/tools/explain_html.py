"""`ember explain ... --html FILE`: the explanation as one self-contained page (no network, no library).

Navigable graph -> kernel -> layer: a contents column lists each graph and its kernels; each kernel's
section shows its ops, the source lines they came from (linked to the graph's source table, whose rows
link back to the kernels), its measurement and resources, and one tab per layer (C++ / assembly, or
Triton / TTIR / TTGIR / LLVM IR / PTX / SASS). A roofline plot (inline SVG) puts each measured kernel
against the measured copy bandwidth and matmul rate; each point links to its kernel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import math
from pathlib import Path

from ember.tools.explain import Explanation, short_path

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;display:flex;color:#222}
nav{width:220px;min-width:220px;height:100vh;overflow:auto;position:sticky;top:0;background:#f4f4f6;
padding:8px;box-sizing:border-box;font-size:13px}
nav a{display:block;text-decoration:none;color:#1a4f9c;padding:1px 0}
nav .g{font-weight:600;margin-top:8px}
main{flex:1;padding:12px 20px;min-width:0}
pre{background:#f7f7f7;border:1px solid #ddd;padding:8px;overflow:auto;max-height:480px;font-size:12px}
table{border-collapse:collapse;font-size:13px;margin:6px 0;display:block;overflow-x:auto;max-width:100%}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.kernel{border-top:2px solid #e0e0e0;margin-top:14px;padding-top:4px}
.tabs button{margin:2px;padding:2px 8px;border:1px solid #999;background:#fff;cursor:pointer}
.tabs button.on{background:#1a4f9c;color:#fff}
.layer{display:none}.layer.on{display:block}
.missing{color:#888;font-size:12px}
:target{background:#fff6d6}
"""

_JS = """
function showLayer(k, i) {
  document.querySelectorAll('[data-k="' + k + '"].layer').forEach(function (e) {
    e.classList.toggle('on', e.dataset.i === String(i));
  });
  document.querySelectorAll('[data-k="' + k + '"].tab').forEach(function (e) {
    e.classList.toggle('on', e.dataset.i === String(i));
  });
}
"""


def _e(text) -> str:
    return html.escape(str(text))


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def write_html(e: Explanation, path: str | Path, layers: list[str] | None = None) -> None:
    Path(path).write_text(render_html(e, layers), encoding="utf-8")


def render_html(e: Explanation, only: list[str] | None = None) -> str:
    """The page; `only`: the layers to include (by name, e.g. ["Triton", "PTX", "SASS"]; None: every one)."""
    measured = {(m.graph_index, m.name): m for m in e.measured if m.kind == "kernel"}
    nav = ['<a href="#top">summary</a>', '<a href="#roofline">roofline</a>', '<a href="#breaks">graph breaks</a>']
    body = [f'<h1 id="top">ember explain {_e(e.title)}</h1>', _summary(e)]
    body.append(_roofline_section(e))
    body.append('<h2 id="breaks">Dynamo graph breaks</h2>')
    body.append("<ul>" + "".join(f"<li>{_e(b)}</li>" for b in e.breaks) + "</ul>" if e.breaks else "<p>none</p>")
    for i, code in enumerate(e.dynamo_code):
        body.append(f"<details><summary>Dynamo's FX graph {i}</summary><pre>{_e(code)}</pre></details>")
    if e.recompiles:
        body.append("<h2>recompiles</h2><ul>" + "".join(f"<li>{_e(r)}</li>" for r in e.recompiles) + "</ul>")
    for gi, g in enumerate(e.report.graphs):
        gid = f"g{gi}"
        nav.append(f'<a class="g" href="#{gid}">{_e(g.kind)} graph</a>')
        body.append(f'<h2 id="{gid}">{_e(g.kind)} graph</h2><p>{_e(g.summary())}</p>')
        if g.fallback:
            continue
        body.append(f"<p>target: {_e(g.target)}<br>memory: {_e(g.memory)}</p>")
        body.append(_source_table(g, gi))
        if g.aten_graph:
            body.append(f"<details><summary>ATen graph</summary><pre>{_e(g.aten_graph)}</pre></details>")
        layers = e.layers.get(gi, {})
        for k in g.kernels:
            nav.append(f'<a href="#{_kid(gi, k.name)}">&nbsp;&nbsp;{_e(k.name)}</a>')
            kl = layers.get(k.name)
            if kl is not None and only is not None:
                kl = dataclasses.replace(kl, layers={n: t for n, t in kl.layers.items() if n in only})
            body.append(_kernel_section(g, gi, k, kl, measured.get((gi, k.name)), e))
        if g.externs:
            body.append("<h3>externs (ATen calls)</h3><ul>")
            for x, where in zip(g.externs, g.extern_lines or [""] * len(g.externs)):
                link = f' from <a href="#{_line_id(gid, where)}">{_e(_short(where))}</a>' if where else ""
                body.append(f"<li>{_e(x)}{link}</li>")
            body.append("</ul>")
        if g.fusion:
            body.append("<details><summary>fusion decisions</summary><ul>")
            body += [f"<li>{_e(f)}</li>" for f in g.fusion]
            body.append("</ul></details>")
        body.append(f"<details><summary>host program</summary><pre>{_e(g.host_source)}</pre></details>")
    if e.measured:
        nav.append('<a class="g" href="#measured">measurements</a>')
        body.append(_measured_table(e))
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ember explain</title>"
        f"<style>{_CSS}</style><script>{_JS}</script></head><body>"
        f"<nav>{''.join(nav)}</nav><main>{''.join(body)}</main></body></html>"
    )


def _summary(e: Explanation) -> str:
    graphs = e.report.graphs
    kernels = sum(len(g.kernels) for g in graphs)
    text = f"{e.dynamo_graphs} Dynamo graph(s), {len(e.breaks)} graph break(s); {len(graphs)} ember graph(s), "
    text += f"{kernels} kernels."
    if e.ceilings is not None:
        c = e.ceilings
        text += (
            f" Measured ceilings on {c.device}: copy {c.bandwidth / 1e9:.1f} GB/s, {c.dtype} matmul "
            f"{c.matmul / 1e12:.2f} TFLOP/s."
        )
    if e.measured:
        total = sum(m.us for m in e.measured)
        text += f" Measured kernels and ATen calls: {total:.1f} µs per step."
    return f"<p>{_e(text)}</p>"


def _short(where: str) -> str:
    return short_path(where)


def _kid(gi: int, name: str) -> str:
    return f"k-{gi}-{_e(name)}"


def _line_id(gid: str, where: str) -> str:
    return f"{gid}-line-{hashlib.sha1(where.encode()).hexdigest()[:10]}"


def _source_table(g, gi: int) -> str:
    gid = f"g{gi}"
    if not g.source_lines:
        return "<p>(no source lines recorded for this graph)</p>"
    rows = ["<h3>source lines -> ATen ops -> kernels</h3><table><tr><th>line</th><th>code</th><th>ATen ops</th>"]
    rows.append("<th>kernels</th></tr>")
    for where, (code, ops) in g.source_lines.items():
        links = [f'<a href="#{_kid(gi, k.name)}">{_e(k.name)}</a>' for k in g.kernels if where in k.lines]
        links += [f"extern {_e(x)}" for x, w in zip(g.externs, g.extern_lines) if w == where]
        rows.append(
            f'<tr id="{_line_id(gid, where)}"><td>{_e(_short(where))}</td><td><code>{_e(code)}</code></td>'
            f"<td>{_e(', '.join(ops))}</td><td>{' '.join(links) or '-'}</td></tr>"
        )
    return "".join(rows) + "</table>"


def _kernel_section(g, gi: int, k, kl, m, e: Explanation) -> str:
    gid, kid = f"g{gi}", _kid(gi, k.name)
    parts = [f'<div class="kernel" id="{kid}"><h3>{_e(k.name)} <small>({_e(g.kind)})</small></h3>']
    parts.append(f"<p>over {_e(k.domain)}: {_e(' + '.join(k.ops) or '(copy)')}<br>")
    lines = [f'<a href="#{_line_id(gid, w)}">{_e(_short(w))}</a>' for w in k.lines]
    parts.append(f"from {', '.join(lines) or '(no source line)'}<br>")
    cost = f"cost model: {_fmt(k.bytes and k.bytes / 1e6, '.3f')} MB, {_fmt(k.flops and k.flops / 1e6, '.3f')} MFLOP"
    if k.estimate_us is not None:
        cost += f", estimate {k.estimate_us:.1f} µs ({k.bound})"
    parts.append(_e(cost))
    if m is not None and e.ceilings is not None:
        parts.append(
            f"<br>measured: {m.us:.1f} µs per step ({m.runs:.0f} runs), {_fmt(m.gbps, '.1f')} GB/s, "
            f"{_fmt(m.gflops, '.1f')} GFLOP/s, {_fmt(m.percent_of_roof(e.ceilings), '.1f')}% of the roof"
        )
    if kl is not None and kl.resources:
        parts.append(f"<br>machine code: {_e(kl.describe_resources())}")
    parts.append("</p>")
    if kl is not None:
        parts.append('<div class="tabs">')
        names = list(kl.layers)
        for i, layer in enumerate(names):
            on = " on" if i == 0 else ""
            parts.append(
                f'<button class="tab{on}" data-k="{kid}" data-i="{i}" '
                f"onclick=\"showLayer('{kid}',{i})\">{_e(layer)}</button>"
            )
        parts.append("</div>")
        for i, layer in enumerate(names):
            on = " on" if i == 0 else ""
            parts.append(
                f'<pre class="layer{on}" data-k="{kid}" data-i="{i}" data-layer="{_e(layer)}">'
                f"{_e(kl.layers[layer])}</pre>"
            )
        for layer, why in kl.missing.items():
            parts.append(f'<div class="missing">{_e(layer)}: not available ({_e(why)})</div>')
    return "".join(parts) + "</div>"


def _measured_table(e: Explanation) -> str:
    rows = ['<h2 id="measured">measurements</h2><table><tr><th>name</th><th>graph</th><th>µs/step</th>']
    rows.append("<th>runs</th><th>MB</th><th>MFLOP</th><th>GB/s</th><th>GFLOP/s</th><th>% roof</th><th>ops</th></tr>")
    for m in sorted(e.measured, key=lambda m: -m.us):
        name = f'<a href="#{_kid(m.graph_index, m.name)}">{_e(m.name)}</a>' if m.kind == "kernel" else _e(m.name)
        rows.append(
            f"<tr><td>{name}</td><td>{_e(m.graph)}</td><td class=n>{m.us:.1f}</td><td class=n>{m.runs:.1f}</td>"
            f"<td class=n>{_fmt(m.bytes and m.bytes / 1e6, '.3f')}</td>"
            f"<td class=n>{_fmt(m.flops and m.flops / 1e6, '.3f')}</td><td class=n>{_fmt(m.gbps, '.1f')}</td>"
            f"<td class=n>{_fmt(m.gflops, '.1f')}</td><td class=n>{_fmt(m.percent_of_roof(e.ceilings), '.1f')}</td>"
            f"<td>{_e(' + '.join(m.ops)[:80])}</td></tr>"
        )
    return "".join(rows) + "</table>"


# -- the roofline ----------------------------------------------------------------------------------

W, H, PAD = 640, 400, 56


def _roofline_section(e: Explanation) -> str:
    head = '<h2 id="roofline">roofline</h2>'
    points = [m for m in e.measured if m.us > 0 and m.bytes and m.kind == "kernel"]
    if e.ceilings is None or not points:
        return head + "<p>(not measured: run without --no-measure)</p>"
    return head + roofline_svg(points, e.ceilings)


def roofline_svg(points: list, c) -> str:
    """Log-log: FLOPs per byte against achieved GFLOP/s; the roof is min(bandwidth x intensity, matmul)."""
    ridge = c.matmul / c.bandwidth
    xs = [max(m.flops or 0, 1) / m.bytes for m in points]
    x_lo = 10 ** math.floor(math.log10(min(xs + [ridge]) / 2))
    x_hi = 10 ** math.ceil(math.log10(max(xs + [ridge]) * 4))
    ys = [max(m.flops or 0, 1) / (m.us * 1e-6) / 1e9 for m in points]
    y_hi = 10 ** math.ceil(math.log10(c.matmul / 1e9 * 2))
    y_lo = 10 ** math.floor(math.log10(max(min(ys + [x_lo * c.bandwidth / 1e9]), 1e-6)))

    def px(x):
        return PAD + (math.log10(x) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo)) * (W - 2 * PAD)

    def py(y):
        y = max(y, y_lo)
        return H - PAD - (math.log10(y) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo)) * (H - 2 * PAD)

    parts = [f'<svg id="roofline-plot" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img">']
    parts.append(f'<rect x="0" y="0" width="{W}" height="{H}" fill="#fff"/>')
    parts.append(f'<rect x="{PAD}" y="{PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" fill="none" stroke="#999"/>')
    for decade in range(round(math.log10(x_lo)), round(math.log10(x_hi)) + 1):
        x = px(10**decade)
        parts.append(f'<line x1="{x:.1f}" y1="{H - PAD}" x2="{x:.1f}" y2="{H - PAD + 4}" stroke="#666"/>')
        parts.append(f'<text x="{x:.1f}" y="{H - PAD + 16}" font-size="10" text-anchor="middle">1e{decade}</text>')
    for decade in range(round(math.log10(y_lo)), round(math.log10(y_hi)) + 1):
        y = py(10**decade)
        parts.append(f'<line x1="{PAD - 4}" y1="{y:.1f}" x2="{PAD}" y2="{y:.1f}" stroke="#666"/>')
        parts.append(f'<text x="{PAD - 6}" y="{y + 3:.1f}" font-size="10" text-anchor="end">1e{decade}</text>')
    parts.append(
        f'<text x="{W / 2}" y="{H - 12}" font-size="12" text-anchor="middle">FLOPs per byte (cost model)</text>'
    )
    parts.append(
        f'<text x="14" y="{H / 2}" font-size="12" text-anchor="middle" transform="rotate(-90 14 {H / 2})">'
        "achieved GFLOP/s</text>"
    )
    # The roof: the copy bandwidth's slope up to the ridge, then the matmul rate.
    roof = [(x_lo, x_lo * c.bandwidth / 1e9), (ridge, c.matmul / 1e9), (x_hi, c.matmul / 1e9)]
    path = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(roof))
    parts.append(f'<path d="{path}" fill="none" stroke="#c0392b" stroke-width="2"/>')
    parts.append(
        f'<text x="{px(ridge) + 6:.1f}" y="{py(c.matmul / 1e9) - 6:.1f}" font-size="11" fill="#c0392b">'
        f"{c.dtype} matmul {c.matmul / 1e12:.2f} TFLOP/s; copy {c.bandwidth / 1e9:.0f} GB/s</text>"
    )
    for m, x, y in zip(points, xs, ys):
        color = {"forward": "#1a4f9c", "backward": "#27ae60"}.get(m.graph, "#8e44ad")
        parts.append(
            f'<a href="#{_kid(m.graph_index, m.name)}"><circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="5" '
            f'fill="{color}" fill-opacity="0.75"><title>{_e(m.name)} ({_e(m.graph)}): {m.us:.1f} µs, '
            f"{_fmt(m.percent_of_roof(c), '.1f')}% of the roof</title></circle></a>"
        )
    parts.append("</svg>")
    legend = "<p><small>blue: forward kernels; green: backward; purple: inference. Click a point for its kernel."
    legend += (
        " FLOPs per byte is the cost model's; the roof is the measured copy bandwidth and matmul rate.</small></p>"
    )
    return "".join(parts) + legend
