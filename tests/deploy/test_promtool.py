"""deploy/prometheus/ passes promtool: config, rule syntax, and the alerts' unit tests."""

from __future__ import annotations

import pytest

from tests.deploy.support import (
    PROMETHEUS_YML,
    RULE_FILES,
    RULE_TESTS,
    alert_names,
    promtool,
    recorded_names,
    rules_found,
)


def test_config_is_valid() -> None:
    result = promtool("check", "config", PROMETHEUS_YML)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 2 rule files found" in result.stdout


@pytest.mark.parametrize("rule_file", RULE_FILES, ids=lambda path: path.name)
def test_rules_are_valid(rule_file: object) -> None:
    result = promtool("check", "rules", rule_file)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_is_counted() -> None:
    """The regexes tests use to list rules see what promtool sees."""
    recording, alerts = (rules_found(promtool("check", "rules", f).stdout) for f in RULE_FILES)
    assert recording == len(recorded_names()) == len(set(recorded_names()))
    assert alerts == len(alert_names()) == len(set(alert_names()))


def test_alert_unit_tests_pass() -> None:
    result = promtool("test", "rules", RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    tested = RULE_TESTS.read_text()
    untested = [name for name in alert_names() if f"alertname: {name}\n" not in tested]
    assert untested == []


def test_every_alert_has_severity_summary_and_description() -> None:
    text = RULE_FILES[1].read_text()
    for block in text.split("- alert: ")[1:]:
        name = block.split()[0]
        for needed in ("\n        for: ", "severity: ", "summary: ", "description: "):
            assert needed in block, f"{name} has no {needed.strip()}"
        assert "severity: critical" in block or "severity: warning" in block, name
