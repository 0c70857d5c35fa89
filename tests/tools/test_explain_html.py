"""The `ember explain --html` page of a CPU training step, in a real headless Chromium (Debian's package,
driven over the DevTools protocol): it loads with no console error and no network request, its links go
graph -> kernel -> source line and back, its layer tabs switch, and its roofline plot renders (a
screenshot of the plot holds the roof's and the points' colours). Chromium is a test requirement
(scripts/test.sh installs it): without it this test fails, it does not skip."""

from __future__ import annotations

import io

import pytest
import torch

from ember.tools.browser import Chromium, find_chromium
from ember.tools.explain import explain_all
from ember.tools.explain_html import render_html, write_html


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.ln = torch.nn.LayerNorm(32)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(x))
        return self.ln(h) * 2


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    chromium = find_chromium()
    assert chromium is not None, "Chromium is required for this test: apt-get install chromium (scripts/test.sh does)"
    torch.manual_seed(0)
    e = explain_all(_Block(), (torch.randn(8, 16),), calls=2, small_ceilings=True, title="block.py")
    path = tmp_path_factory.mktemp("html") / "report.html"
    write_html(e, path)
    with Chromium(chromium) as browser:
        browser.open(path)
        yield browser, e


def test_page_loads_without_errors_or_network(page):
    browser, e = page
    assert browser.console_errors() == []
    assert browser.requests() == []
    assert browser.evaluate("document.title") == "ember explain"
    kernels = [k.name for g in e.report.graphs for k in g.kernels]
    assert browser.evaluate("Array.from(document.querySelectorAll('nav a')).map(a => a.textContent.trim())")[3:] == [
        "forward graph",
        *[k for k in kernels if k.startswith("fk")],
        "backward graph",
    ] + [k for k in kernels if k.startswith("bk")] + ["measurements"]


def test_navigation_graph_kernel_line_and_back(page):
    browser, e = page
    fk = next(k for k in e.report.graphs[0].kernels if k.lines)
    browser.evaluate(f"document.querySelector('nav a[href=\"#k-0-{fk.name}\"]').click()")
    assert browser.evaluate("location.hash") == f"#k-0-{fk.name}"
    assert browser.evaluate(f"document.querySelector('#k-0-{fk.name}').matches(':target')")
    # kernel -> its source line's row -> that row's link back to the kernel
    row = browser.evaluate(
        f"(() => {{ const a = document.querySelector('#k-0-{fk.name} p a'); a.click(); return location.hash; }})()"
    )
    assert row.startswith("#g0-line-"), row
    back = browser.evaluate(f"Array.from(document.querySelectorAll('{row} a')).map(a => a.getAttribute('href'))")
    assert f"#k-0-{fk.name}" in back, back
    assert "gelu" in browser.evaluate(f"document.querySelector('{row}').textContent")


def test_layer_tabs_switch(page):
    browser, e = page
    name = e.report.graphs[0].kernels[0].name

    def shown():
        return browser.evaluate(
            f"Array.from(document.querySelectorAll('pre.layer[data-k=\"k-0-{name}\"]'))"
            ".filter(p => p.offsetParent !== null).map(p => p.dataset.layer)"
        )

    assert shown() == ["C++"]
    browser.evaluate(f'document.querySelector(\'button.tab[data-k="k-0-{name}"][data-i="1"]\').click()')
    assert shown() == ["x86 assembly"]
    text = browser.evaluate(f'document.querySelector(\'pre.layer[data-k="k-0-{name}"][data-i="1"]\').textContent')
    assert f"{name}:" in text and "ret" in text
    only = render_html(e, ["x86 assembly"])
    assert 'data-layer="x86 assembly"' in only and 'data-layer="C++"' not in only


def test_roofline_plot_renders(page):
    from PIL import Image

    browser, e = page
    points = browser.evaluate("document.querySelectorAll('#roofline-plot circle.point').length")
    assert points == sum(1 for m in e.measured if m.kind == "kernel" and m.us > 0), e.measured
    browser.evaluate("document.querySelector('#roofline').scrollIntoView()")
    png = browser.screenshot(selector="#roofline-plot")
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size[0] >= 600 and image.size[1] >= 380, image.size
    colors = {c for _, c in image.getcolors(1 << 20)}
    roof = any(r > 150 and g < 90 and b < 80 for r, g, b in colors)
    dots = any(b > 120 and r < 120 for r, g, b in colors) or any(g > 120 and r < 100 and b < 120 for r, g, b in colors)
    assert roof and dots, f"{len(colors)} colours"
    # a point links to its kernel
    browser.evaluate("document.querySelector('#roofline-plot a').dispatchEvent(new MouseEvent('click'))")
    assert browser.evaluate("location.hash").startswith("#k-")
