"""The pure parts of benchmarks/dashboard_snapshot.py; test_prometheus.py renders a real one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from benchmarks.dashboard_snapshot import (
    format_value,
    legend,
    main,
    parse_duration,
    substitute,
    variable_defaults,
)

from mineru_gateway.testing import free_port
from tests.deploy.support import DASHBOARDS

pytestmark = pytest.mark.unit


def test_substitute_replaces_variables_as_grafana_does() -> None:
    expr = 'rate(x{model=~"$model", worker=~"${worker}"}[$__rate_interval]) + $unknown'
    assert substitute(expr, {"model": ".*", "worker": "a"}, "1m") == (
        'rate(x{model=~".*", worker=~"a"}[1m]) + $unknown'
    )


def test_variables_default_to_all() -> None:
    overview = next(path for path in DASHBOARDS if path.stem == "overview")
    assert variable_defaults(json.loads(overview.read_text())) == {"model": ".*"}


@pytest.mark.parametrize(
    ("template", "labels", "expected"),
    [
        ("p99 {{model}}", {"model": "m"}, "p99 m"),
        ("{{ worker }} ({{policy}})", {"worker": "w", "policy": "queue"}, "w (queue)"),
        ("{{endpoint}} {{model}}", {"endpoint": "chat", "model": ""}, "chat"),
        ("__auto", {"__name__": "up", "job": "vllm"}, 'up{job="vllm"}'),
        ("", {}, ""),
    ],
)
def test_legend(template: str, labels: dict[str, str], expected: str) -> None:
    assert legend(template, labels) == expected


@pytest.mark.parametrize(
    ("value", "unit", "expected"),
    [
        (0.0436, "s", "43.6 ms"),
        (7.25, "s", "7.25 s"),
        (0.05, "percentunit", "5%"),
        (23.7, "reqps", "23.7 req/s"),
        (1800, "short", "1.8 k"),
        (64 * 2**30, "bytes", "64 GiB"),
        (0, "bytes", "0 B"),
        (12, "short", "12"),
        (98.2, "watt", "98.2 W"),
        (math.nan, "s", "-"),
    ],
)
def test_format_value(value: float, unit: str, expected: str) -> None:
    assert format_value(value, unit) == expected


def test_parse_duration() -> None:
    assert [parse_duration(text) for text in ("30s", "15m", "1h")] == [30, 900, 3600]
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")


def test_an_unreachable_prometheus_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overview = next(path for path in DASHBOARDS if path.stem == "overview")
    argv = ["--prometheus", f"http://127.0.0.1:{free_port()}", "--dashboard", str(overview)]
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 1
    assert "dashboard_snapshot: http://127.0.0.1:" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
