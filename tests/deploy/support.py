"""Paths and small helpers shared by the deploy/ tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
PROMETHEUS_YML = PROMETHEUS_DIR / "prometheus.yml"
RULE_FILES = (PROMETHEUS_DIR / "rules" / "recording.yml", PROMETHEUS_DIR / "rules" / "alerts.yml")
RULE_TESTS = PROMETHEUS_DIR / "tests" / "alerts_test.yml"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))

_RECORD = re.compile(r"^\s*- record: (\S+)$", re.M)
_ALERT = re.compile(r"^\s*- alert: (\S+)$", re.M)
_RULES_FOUND = re.compile(r"SUCCESS: (\d+) rules found")


def tool(name: str) -> str:
    """The path of a Prometheus binary; fails (never skips) when it is missing."""
    path = shutil.which(name) or shutil.which(name, path="/usr/bin")
    assert path, f"{name} is not installed: run `make system-deps` (Debian package prometheus)"
    return path


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def recorded_names() -> list[str]:
    return _RECORD.findall(RULE_FILES[0].read_text())


def alert_names() -> list[str]:
    return _ALERT.findall(RULE_FILES[1].read_text())


def rules_found(output: str) -> int:
    """The rule count `promtool check rules FILE` reports for one file."""
    counts = [int(count) for count in _RULES_FOUND.findall(output)]
    assert len(counts) == 1, output
    return counts[0]
