"""The HTML page of ``grain-core profile``: plotly charts, with plotly.js inlined once.

plotly is optional (``pip install plotly``); only this module imports it. The
page works offline: the one ``<script>`` with plotly.js is in the file. A small script in the
page's head records script errors and, once the page has loaded, shows them at the top of the
page (``#report-status``) and counts the charts that rendered (``data-rendered-charts`` on the
body): a broken report says so instead of showing empty boxes.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grain_core.observe.profile import ProfileData

__all__ = ["render", "require_plotly"]

_CATEGORY_COLOURS = {
    "read": "#4c78a8",
    "transform": "#f58518",
    "batch": "#54a24b",
    "wait": "#bab0ac",
    "transport": "#b279a2",
}

_HEAD_SCRIPT = """
window.grainReportErrors = [];
window.addEventListener("error", (e) => window.grainReportErrors.push(String(e.message)));
const grainConsoleError = console.error;
console.error = function (...args) {
  window.grainReportErrors.push(args.map(String).join(" "));
  grainConsoleError.apply(console, args);
};
window.addEventListener("load", () => {
  const charts = document.querySelectorAll(".js-plotly-plot .main-svg").length > 0
    ? Array.from(document.querySelectorAll(".js-plotly-plot"))
        .filter((plot) => plot.querySelector(".main-svg")).length
    : 0;
  document.body.dataset.renderedCharts = String(charts);
  document.body.dataset.errors = String(window.grainReportErrors.length);
  if (window.grainReportErrors.length) {
    const status = document.getElementById("report-status");
    status.textContent = "This report had errors while rendering: " +
      window.grainReportErrors.join("; ");
    status.hidden = false;
  }
});
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
.verdict { font-size: 1.15em; background: #fff7e0; border-left: 6px solid #f58518;
           padding: 0.8em 1em; }
.figures { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }
.numbers td { padding: 0.2em 1em 0.2em 0; }
#report-status { background: #fdd; padding: 0.5em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


def require_plotly() -> None:
    """Raises ImportError naming the extra to install if plotly is missing."""
    try:
        import plotly  # noqa: F401  # optional dependency, imported to check
    except ImportError as e:
        raise ImportError(
            "The grain-core profile report draws its charts with plotly, which is not "
            "installed: pip install plotly."
        ) from e


def _figure_html(figure: Any, first: bool) -> str:
    figure.update_layout(margin={"l": 10, "r": 10, "t": 50, "b": 10}, height=360)
    html_text: str = figure.to_html(
        full_html=False, include_plotlyjs=first, config={"displaylogo": False}
    )
    return html_text


def _figures(data: ProfileData) -> list[Any]:
    import plotly.graph_objects as go  # optional dependency

    centres, rates = data.throughput()
    throughput = go.Figure(go.Scatter(x=centres, y=rates, mode="lines+markers", name="batches/s"))
    throughput.update_layout(
        title="Throughput over time", xaxis_title="seconds", yaxis_title="batches per second"
    )

    shown = list(data.stages[:15])[::-1]
    labels = [("[worker] " if s.in_workers else "") + _short(s.label) for s in shown]
    stages = go.Figure(
        go.Bar(
            x=[100 * s.share for s in shown],
            y=labels,
            orientation="h",
            marker_color=[_CATEGORY_COLOURS.get(s.category, "#888") for s in shown],
            text=[f"{s.share_text} · {s.category}" for s in shown],
            hovertext=[f"{s.name}<br>{s.self_s:.3f} s in {s.calls} calls" for s in shown],
        )
    )
    stages.update_layout(
        title="Time share per stage (self time)", xaxis_title="% of all stage time"
    )

    names = [p.name for p in data.processes]
    processes = go.Figure(
        [
            go.Bar(
                name="busy",
                x=names,
                y=[100 * p.utilisation for p in data.processes],
                marker_color="#4c78a8",
            ),
            go.Bar(
                name="idle",
                x=names,
                y=[100 * (1 - p.utilisation) for p in data.processes],
                marker_color="#d8d8d8",
            ),
        ]
    )
    processes.update_layout(
        title="Utilisation per process", barmode="stack", yaxis_title="% of the window"
    )

    wait = data.consumer_wait_share
    consumer = go.Figure(
        go.Pie(
            labels=["waiting in next()", "elsewhere (step, own work)"],
            values=[wait, 1 - wait],
            hole=0.5,
            sort=False,
        )
    )
    consumer.update_layout(title="The consumer's time")
    return [throughput, stages, processes, consumer]


def _short(name: str, limit: int = 60) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


def render(data: ProfileData) -> str:
    """The report page of ``data``.

    Raises:
      ImportError: if plotly is missing.
    """
    require_plotly()
    figures = "\n".join(
        f'<div class="figure">{_figure_html(f, first=i == 0)}</div>'
        for i, f in enumerate(_figures(data))
    )
    numbers = [
        ("batches", f"{len(data.batch_end_s)} in {data.window_s:.2f} s"),
        (
            "throughput",
            f"{len(data.batch_end_s) / data.window_s:.1f} batches/s" if data.window_s else "-",
        ),
        ("consumer waiting", f"{data.consumer_wait_share:.0%} of the time in next()"),
        ("processes", f"{len(data.processes)} ({len(data.processes) - 1} workers)"),
    ]
    if data.step_s:
        numbers.append(("simulated step", f"{data.step_s * 1000:.0f} ms per batch"))
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in numbers
    )
    graph = (
        f"<pre>{html.escape(data.graph_text)}</pre>"
        if data.graph_text
        else "<p>This trace has no dataset graph (only traces written by grain-core profile "
        "carry one).</p>"
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>grain_core pipeline profile</title>
<script>{_HEAD_SCRIPT}</script>
<style>{_STYLE}</style>
</head>
<body>
<h1>grain_core pipeline profile</h1>
<p id="report-status" hidden></p>
<h2>Verdict</h2>
<p class="verdict">{html.escape(data.verdict)}</p>
<table class="numbers">{rows}</table>
<div class="figures">
{figures}
</div>
<h2>Dataset graph</h2>
{graph}
<p>How to read this page: docs/debugging.md of grain_core.</p>
</body>
</html>
"""
