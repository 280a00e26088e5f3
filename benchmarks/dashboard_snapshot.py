"""Renders a Grafana dashboard from Prometheus data to a PNG, without a Grafana server.

    python benchmarks/dashboard_snapshot.py --prometheus http://127.0.0.1:9090 \
        --dashboard deploy/grafana/dashboards/overview.json --out docs/dashboard-overview.png

Every time series and stat panel of the dashboard is drawn where its `gridPos` puts it (rows become
section titles), from its queries run as range queries over `--range` up to `--end`. Template
variables take their "All" value (`.*`) unless given with `--var name=value`; `$__rate_interval`
becomes `--rate-interval`. Tables and state timelines are drawn as titled placeholders.

The module's functions that read dashboards (`iter_panels`, `panel_queries`, `substitute`) are also
what tests/deploy/ uses to run every dashboard query against a real Prometheus.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ALL_VALUE = ".*"
DEFAULT_RATE_INTERVAL = "1m"
# Grafana's dark theme and its classic palette, so the picture looks like what users will see.
BACKGROUND = "#111217"
PANEL = "#181b1f"
GRID = "#2c3235"
TEXT = "#ccccdc"
MUTED = "#8e8e8e"
PALETTE = (
    "#73bf69",
    "#f2cc0c",
    "#8ab8ff",
    "#ff780a",
    "#f2495c",
    "#5794f2",
    "#b877d9",
    "#705da0",
    "#37872d",
    "#fade2a",
)
THRESHOLD_COLORS = {
    "green": "#73bf69",
    "red": "#f2495c",
    "orange": "#ff9830",
    "yellow": "#fade2a",
    "blue": "#5794f2",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_DURATION_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


# ---------------------------------------------------------------------------------------------
# Reading dashboards


def load_dashboard(path: Path) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels inside collapsed rows after their row."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(panel: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The panel's visible Prometheus targets (those with an `expr`)."""
    return [t for t in panel.get("targets", []) if t.get("expr") and not t.get("hide")]


def variable_defaults(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Each template variable's "All" value (`.*` unless the dashboard says otherwise)."""
    variables = dashboard.get("templating", {}).get("list", [])
    return {v["name"]: v.get("allValue") or ALL_VALUE for v in variables}


def substitute(expr: str, variables: Mapping[str, str], rate_interval: str) -> str:
    """Replaces `$name` and `${name}` as Grafana would; `$__rate_interval` by `rate_interval`.

    Unknown variables are left as they are, so callers can check that none remain.
    """
    values = {**variables, "__rate_interval": rate_interval}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, match.group(0))

    return _VARIABLE.sub(replace, expr)


def legend(template: str, labels: Mapping[str, str]) -> str:
    """A series' name by Grafana's `legendFormat`: `{{label}}` replaced, `__auto` = the labels."""
    if not template or template == "__auto":
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{labels.get('__name__', '')}{{{inner}}}" if inner else labels.get("__name__", "")
    return " ".join(_LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), template).split())


def parse_duration(text: str) -> float:
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"expected a duration like 30s, 15m or 1h, got {text!r}")
    return int(match.group(1)) * _DURATION_SECONDS[match.group(2)]


# ---------------------------------------------------------------------------------------------
# Prometheus's HTTP API


class PrometheusError(RuntimeError):
    """A query Prometheus rejected, or Prometheus not answering."""


@dataclass(frozen=True)
class Prometheus:
    url: str
    timeout_s: float = 30.0

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query; the result's vector (or a scalar as one unlabelled sample)."""
        params = {"query": expr} | ({} if at is None else {"time": f"{at:.3f}"})
        data = self._call("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        result: list[dict[str, Any]] = self._call("/api/v1/query_range", params)["result"]
        return result

    def get(self, path: str, params: Mapping[str, str | Sequence[str]] | None = None) -> Any:
        """Any other API call, e.g. `/api/v1/rules`; returns `data`."""
        query = urllib.parse.urlencode(params or {}, doseq=True)
        request = urllib.request.Request(f"{self.url.rstrip('/')}{path}?{query}")
        return self._send(request, path)

    def _call(self, path: str, params: Mapping[str, str]) -> Any:
        body = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(f"{self.url.rstrip('/')}{path}", data=body)
        return self._send(request, params.get("query", path))

    def _send(self, request: urllib.request.Request, what: str) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = json.load(response)
        except urllib.error.HTTPError as error:
            payload = _error_payload(error)
        except (urllib.error.URLError, TimeoutError) as error:
            raise PrometheusError(f"{self.url}: {error}") from error
        if payload.get("status") != "success":
            raise PrometheusError(f"{what}: {payload.get('errorType')}: {payload.get('error')}")
        return payload["data"]


def _error_payload(error: urllib.error.HTTPError) -> dict[str, Any]:
    # Prometheus answers a bad query with 400 and its JSON error body.
    try:
        payload: dict[str, Any] = json.load(error)
    except ValueError:
        payload = {"status": "error", "errorType": str(error.code), "error": error.reason}
    return payload


# ---------------------------------------------------------------------------------------------
# Rendering


@dataclass
class Series:
    name: str
    times: list[float]
    values: list[float]


@dataclass
class PanelData:
    panel: dict[str, Any]
    series: list[Series] = field(default_factory=list)


def fetch(
    prometheus: Prometheus,
    dashboard: Mapping[str, Any],
    *,
    start: float,
    end: float,
    step: float,
    variables: Mapping[str, str],
    rate_interval: str,
) -> list[PanelData]:
    """Runs every query of every drawable panel as a range query."""
    panels = []
    for panel in iter_panels(dashboard):
        data = PanelData(panel)
        if panel.get("type") in ("timeseries", "stat"):
            for target in panel_queries(panel):
                expr = substitute(target["expr"], variables, rate_interval)
                for result in prometheus.query_range(expr, start, end, step):
                    times = [float(t) for t, _ in result["values"]]
                    values = [float(v) for _, v in result["values"]]
                    name = legend(target.get("legendFormat", ""), result["metric"])
                    data.series.append(Series(name, times, values))
        panels.append(data)
    return panels


def format_value(value: float, unit: str) -> str:
    """A number in a panel's Grafana unit, short."""
    if math.isnan(value):
        return "-"
    if unit == "s":
        return _format_seconds(value)
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "bytes":
        return _format_scaled(value, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    suffix = {"reqps": " req/s", "watt": " W", "celsius": " °C"}.get(unit, "")
    return _format_scaled(value, 1000, ("", "k", "M", "G")) + suffix


def _format_seconds(value: float) -> str:
    if value == 0:
        return "0 s"
    if abs(value) < 1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.3g} s"


def _format_scaled(value: float, base: float, names: Sequence[str]) -> str:
    index = 0
    while abs(value) >= base and index < len(names) - 1:
        value /= base
        index += 1
    return f"{value:.3g} {names[index]}".rstrip()


@dataclass(frozen=True)
class Box:
    """A rectangle in inches from the figure's top-left corner."""

    x: float
    y: float
    w: float
    h: float

    def inset(self, left: float, top: float, right: float, bottom: float) -> Box:
        return Box(self.x + left, self.y + top, self.w - left - right, self.h - top - bottom)

    def rect(self, width: float, height: float) -> tuple[float, float, float, float]:
        """(left, bottom, width, height) as fractions of a `width` x `height` inch figure."""
        return (self.x / width, 1 - (self.y + self.h) / height, self.w / width, self.h / height)


# Figure geometry, inches: Grafana's 24 columns over WIDTH_IN, a grid row ROW_IN high.
WIDTH_IN = 20.0
ROW_IN = 0.36
MARGIN_IN = 0.15
HEADER_IN = 0.8
GAP_IN = 0.08
LEGEND_ROW_IN = 0.17


def render(
    panels: Sequence[PanelData],
    out: Path,
    title: str,
    subtitle: str,
    time_range: tuple[float, float] | None = None,
) -> None:
    """Draws the panels where their `gridPos` puts them on Grafana's grid; writes a PNG.

    Time series share `time_range` (Unix seconds), as in Grafana, or each fits its data.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = max(p.panel["gridPos"]["y"] + p.panel["gridPos"]["h"] for p in panels)
    height = HEADER_IN + rows * ROW_IN + MARGIN_IN
    figure = plt.figure(figsize=(WIDTH_IN, height), facecolor=BACKGROUND)
    figure.text(MARGIN_IN / WIDTH_IN, 1 - 0.25 / height, title, color=TEXT, fontsize=18, va="top")
    figure.text(
        1 - MARGIN_IN / WIDTH_IN, 1 - 0.32 / height, subtitle, color=MUTED, ha="right", va="top"
    )
    column = (WIDTH_IN - 2 * MARGIN_IN) / 24
    for data in panels:
        pos = data.panel["gridPos"]
        cell = Box(
            MARGIN_IN + pos["x"] * column,
            HEADER_IN + pos["y"] * ROW_IN,
            pos["w"] * column,
            pos["h"] * ROW_IN,
        ).inset(GAP_IN / 2, GAP_IN / 2, GAP_IN / 2, GAP_IN / 2)
        _draw_panel(figure, data, cell, height, time_range)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100, facecolor=BACKGROUND)
    plt.close(figure)


def _draw_panel(
    figure: Any,
    data: PanelData,
    cell: Box,
    height: float,
    time_range: tuple[float, float] | None,
) -> None:
    kind = data.panel.get("type")
    title = data.panel.get("title", "")
    background = figure.add_axes(cell.rect(WIDTH_IN, height))
    background.set_xticks([])
    background.set_yticks([])
    if kind == "row":
        background.set_axis_off()
        background.text(0, 0.5, title, color=TEXT, fontsize=13, weight="bold", va="center")
        return
    background.set_facecolor(PANEL)
    for spine in background.spines.values():
        spine.set_color(GRID)
    background.text(0.1 / cell.w, 1 - 0.08 / cell.h, title, color=TEXT, fontsize=10, va="top")
    if kind == "stat":
        _draw_stat(background, data)
    elif kind == "timeseries":
        _draw_timeseries(figure, data, cell, height, time_range)
    else:
        background.text(0.5, 0.5, f"({kind})", color=MUTED, ha="center", va="center")


def _unit(panel: Mapping[str, Any]) -> str:
    unit: str = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    return unit


def _log_base(panel: Mapping[str, Any]) -> int | None:
    custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
    scale = custom.get("scaleDistribution", {})
    return int(scale.get("log", 10)) if scale.get("type") == "log" else None


def _legend_layout(names: Sequence[str], width_in: float) -> tuple[int, int]:
    """(columns, rows) of a Grafana-like list legend under the plot."""
    if not names:
        return 1, 0
    entry_in = 0.45 + 0.055 * max(len(name) for name in names)
    columns = max(1, min(len(names), int((width_in - 0.2) // entry_in)))
    return columns, math.ceil(len(names) / columns)


def _draw_timeseries(
    figure: Any,
    data: PanelData,
    cell: Box,
    height: float,
    time_range: tuple[float, float] | None,
) -> None:
    from matplotlib.dates import DateFormatter
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    unit = _unit(data.panel)
    names = [_shorten(series.name) for series in data.series]
    columns, legend_rows = _legend_layout(names, cell.w)
    legend_in = legend_rows * LEGEND_ROW_IN
    plot = cell.inset(0.8, 0.38, 0.2, 0.32 + legend_in)
    axes = figure.add_axes(plot.rect(WIDTH_IN, height))
    axes.set_facecolor(PANEL)
    for spine in axes.spines.values():
        spine.set_visible(False)
    axes.tick_params(colors=MUTED, labelsize=8, length=0)
    dashed = _dashed_series(data.panel)
    lines = []
    for index, series in enumerate(data.series):
        times = [_datetime(t) for t in series.times]
        if series.name in dashed:
            style = {"color": THRESHOLD_COLORS["red"], "ls": "--", "lw": 1.2}
        else:
            style = {"color": PALETTE[index % len(PALETTE)], "lw": 1.4}
        lines.extend(axes.plot(times, series.values, **style))
    if not data.series:
        axes.text(0.5, 0.5, "No data", color=MUTED, ha="center", transform=axes.transAxes)
    axes.grid(color=GRID, lw=0.6)
    if time_range is not None:
        axes.set_xlim(_datetime(time_range[0]), _datetime(time_range[1]))
    base = _log_base(data.panel)
    if base is not None:
        axes.set_yscale("log", base=base)
        axes.yaxis.set_minor_formatter(NullFormatter())
    else:
        axes.set_ylim(bottom=0)
        axes.yaxis.set_major_locator(MaxNLocator(4))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_value(value, unit)))
    axes.xaxis.set_major_locator(MaxNLocator(6))
    axes.xaxis.set_major_formatter(DateFormatter("%H:%M:%S"))  # type: ignore[no-untyped-call]
    if lines:
        anchor = cell.inset(0.1, cell.h - legend_in - 0.06, 0.1, 0.06)
        left, bottom, _, top_height = anchor.rect(WIDTH_IN, height)
        figure.legend(
            lines,
            names,
            loc="upper left",
            bbox_to_anchor=(left, bottom + top_height),
            ncol=columns,
            fontsize=7.5,
            frameon=False,
            labelcolor=TEXT,
            handlelength=1.5,
            columnspacing=1.5,
            borderaxespad=0,
            borderpad=0,
        )


def _draw_stat(axes: Any, data: PanelData) -> None:
    unit = _unit(data.panel)
    defaults = data.panel.get("fieldConfig", {}).get("defaults", {})
    if not data.series:
        axes.text(0.5, 0.42, "No data", color=MUTED, ha="center", va="center")
        return
    width = 1.0 / len(data.series)
    for index, series in enumerate(data.series):
        last = next((v for v in reversed(series.values) if not math.isnan(v)), math.nan)
        center = width * (index + 0.5)
        axes.text(
            center,
            0.42,
            format_value(last, unit),
            color=_threshold_color(defaults, last),
            fontsize=22,
            ha="center",
            va="center",
            weight="bold",
        )
        if len(data.series) > 1:
            axes.text(center, 0.1, series.name, color=MUTED, ha="center")


def _threshold_color(defaults: Mapping[str, Any], value: float) -> str:
    color = "blue"
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step.get("value") is None or (not math.isnan(value) and value >= step["value"]):
            color = step["color"]
    return THRESHOLD_COLORS.get(color, color)


def _dashed_series(panel: Mapping[str, Any]) -> set[str]:
    """Series a `byName` override draws dashed (the SLO line of the TTFT panel)."""
    names = set()
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        properties = {p["id"] for p in override.get("properties", [])}
        if override.get("matcher", {}).get("id") == "byName" and "custom.lineStyle" in properties:
            names.add(override["matcher"]["options"])
    return names


def _shorten(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _datetime(timestamp: float) -> Any:
    from datetime import datetime

    return datetime.fromtimestamp(timestamp)


# ---------------------------------------------------------------------------------------------
# Command line


def snapshot(
    prometheus_url: str,
    dashboard_path: Path,
    out: Path,
    *,
    end: float | None = None,
    range_s: float = 900.0,
    step_s: float | None = None,
    variables: Mapping[str, str] | None = None,
    rate_interval: str = DEFAULT_RATE_INTERVAL,
) -> list[PanelData]:
    """Fetches and renders one dashboard; returns what was drawn."""
    dashboard = load_dashboard(dashboard_path)
    end = time.time() if end is None else end
    step = step_s or max(1.0, round(range_s / 240))
    values = variable_defaults(dashboard) | dict(variables or {})
    panels = fetch(
        Prometheus(prometheus_url),
        dashboard,
        start=end - range_s,
        end=end,
        step=step,
        variables=values,
        rate_interval=rate_interval,
    )
    chosen = ", ".join(f"{k}={v}" for k, v in values.items())
    subtitle = f"last {_format_seconds(range_s)}  |  {chosen}  |  {prometheus_url}"
    title = dashboard.get("title", dashboard_path.stem)
    render(panels, out, title, subtitle, time_range=(end - range_s, end))
    return panels


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus URL")
    parser.add_argument("--dashboard", type=Path, required=True, help="Grafana dashboard JSON")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--range", default="15m", help="time range ending at --end (15m)")
    parser.add_argument("--end", type=float, help="Unix time of the range's end (now)")
    parser.add_argument("--step", help="resolution, e.g. 5s (range / 240)")
    parser.add_argument(
        "--var", action="append", default=[], metavar="NAME=VALUE", help="a template variable"
    )
    parser.add_argument(
        "--rate-interval", default=DEFAULT_RATE_INTERVAL, help="$__rate_interval (1m)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    variables = dict(item.split("=", 1) for item in args.var)
    try:
        panels = snapshot(
            args.prometheus,
            args.dashboard,
            args.out,
            end=args.end,
            range_s=parse_duration(args.range),
            step_s=parse_duration(args.step) if args.step else None,
            variables=variables,
            rate_interval=args.rate_interval,
        )
    except (PrometheusError, ValueError) as error:
        print(f"dashboard_snapshot: {error}", file=sys.stderr)
        return 1
    drawn = sum(1 for p in panels if p.series)
    print(f"{args.out}: {drawn} panels with data of {len(panels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
