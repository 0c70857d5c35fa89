"""report.collecting: nested collectors (ember.explain around a bench that collects its own reports) each get
every graph compiled while they are open, and leaving the inner one leaves the outer one collecting."""

from __future__ import annotations

from ember.report import GraphReport, collecting, publish


def test_nested_collectors():
    with collecting() as outer:
        with collecting() as inner:
            publish(GraphReport(kind="forward"))
        publish(GraphReport(kind="backward"))
    assert [g.kind for g in outer.graphs] == ["forward", "backward"]
    assert [g.kind for g in inner.graphs] == ["forward"]
