"""The Grafana dashboards and provisioning, read as files: structure, datasource, variables, and
that every recording rule they use exists. tests/deploy/test_prometheus.py runs their queries."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from benchmarks.dashboard_snapshot import iter_panels, panel_queries

from tests.deploy.support import DASHBOARDS, GRAFANA_DIR, RULE_FILES, recorded_names

pytestmark = pytest.mark.unit

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
_VARIABLE = re.compile(r"\$\{?(\w+)")
_RECORDED = re.compile(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+")
_LABEL_VALUES = re.compile(r"^label_values\((.+), (\w+)\)$")

dashboard_files = pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.stem)


def load(path: Path) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in iter_panels(dashboard):
        for target in panel_queries(panel):
            yield panel["title"], target["expr"]


def variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = dashboard["templating"]["list"]
    return found


def test_the_five_dashboards() -> None:
    uids = [load(path)["uid"] for path in DASHBOARDS]
    stems = [path.stem for path in DASHBOARDS]
    assert stems == ["gateway-internals", "npu", "overview", "tenants", "workers"]
    assert len(set(uids)) == len(uids)


@dashboard_files
def test_dashboard_model(path: Path) -> None:
    dashboard = load(path)
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["id"] is None  # provisioned dashboards are identified by uid
    assert dashboard["uid"].startswith("mineru-gateway-") and len(dashboard["uid"]) <= 40
    assert dashboard["title"].startswith("MinerU gateway / ")
    assert "mineru-gateway" in dashboard["tags"]
    assert "${DS_" not in path.read_text()  # no import-time datasource inputs


@dashboard_files
def test_panels_have_unique_ids_and_fit_the_grid(path: Path) -> None:
    panels = list(iter_panels(load(path)))
    assert len({panel["id"] for panel in panels}) == len(panels)
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {
            (y, x)
            for y in range(pos["y"], pos["y"] + pos["h"])
            for x in range(pos["x"], pos["x"] + pos["w"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


@dashboard_files
def test_every_panel_queries_the_provisioned_datasource(path: Path) -> None:
    for panel in iter_panels(load(path)):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        targets = panel["targets"]
        assert targets and len(targets) == len(panel_queries(panel)), panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        assert all(t["datasource"] == DATASOURCE for t in targets), panel["title"]
        assert panel.get("description"), f"{panel['title']} has no description"


@dashboard_files
def test_variables_are_label_values_queries(path: Path) -> None:
    dashboard = load(path)
    defined = [variable["name"] for variable in variables(dashboard)]
    assert defined, "every dashboard filters by something"
    for variable in variables(dashboard):
        assert variable["datasource"] == DATASOURCE
        assert _LABEL_VALUES.match(variable["definition"]), variable["definition"]
        assert variable["query"]["query"] == variable["definition"]
        assert variable["includeAll"] and variable["allValue"] == ".*"
    used = {name for _, expr in queries(dashboard) for name in _VARIABLE.findall(expr)}
    assert used <= {*defined, "__rate_interval"}
    assert set(defined) <= used | {
        name for v in variables(dashboard) for name in _VARIABLE.findall(v["definition"])
    }, "a variable filters nothing"


@dashboard_files
def test_recording_rules_used_exist(path: Path) -> None:
    recorded = set(recorded_names())
    for title, expr in queries(load(path)):
        missing = set(_RECORDED.findall(expr)) - recorded
        assert not missing, f"{title}: {missing} not in recording.yml"


def test_every_recording_rule_is_used() -> None:
    """A recorded series nobody reads is evaluation cost for nothing."""
    alerts, recording = (path.read_text() for path in RULE_FILES[::-1])
    readers = "\n".join(
        [
            *(expr for path in DASHBOARDS for _, expr in queries(load(path))),
            alerts,
            re.sub(r"- record: \S+", "", recording),
        ]
    )
    unused = [name for name in recorded_names() if not re.search(_series(name), readers)]
    assert unused == []


def _series(name: str) -> str:
    return re.escape(name) + r"(?![\w:])"


def test_provisioning_points_at_the_dashboards_and_datasource() -> None:
    datasource = (GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text()
    provider = (GRAFANA_DIR / "provisioning" / "dashboards" / "provider.yml").read_text()
    assert f"uid: {DATASOURCE['uid']}\n" in datasource
    assert "type: prometheus\n" in datasource
    assert "path: /var/lib/grafana/dashboards/mineru-gateway\n" in provider
