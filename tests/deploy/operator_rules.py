"""deploy/k8s/monitoring/operator/prometheus-rule.yaml: deploy/prometheus/rules/ as the Prometheus
Operator's PrometheusRule, whose `spec.groups` is exactly a rule file's `groups`. Written from the
rule files, comments included, so that there is one copy to edit; tests/deploy/test_k8s.py fails
while it is out of date. After changing a rule file:

    .venv/bin/python -m tests.deploy.operator_rules
"""

from __future__ import annotations

from pathlib import Path

from tests.deploy.support import ROOT, RULE_FILES

PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "monitoring" / "operator" / "prometheus-rule.yaml"

_HEADER = """\
# The recording rules and alerts of deploy/prometheus/rules/, for the Prometheus Operator.
# GENERATED from those files by `python -m tests.deploy.operator_rules`: edit them, not this.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: mineru-gateway
  labels:
    app.kubernetes.io/part-of: mineru-gateway
spec:
  groups:
"""


def groups_text(path: Path) -> str:
    """The part of a rule file after `groups:`, indented to sit under `spec.groups`."""
    lines = path.read_text().splitlines(keepends=True)
    start = lines.index("groups:\n") + 1
    body = "".join(f"  {line}" if line.strip() else line for line in lines[start:])
    return f"    # {path.relative_to(ROOT)}\n{body.rstrip()}\n"


def render() -> str:
    return _HEADER + "\n".join(groups_text(path) for path in RULE_FILES)


def main() -> None:
    PROMETHEUS_RULE.write_text(render())
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
