"""JSON schemas for the Prometheus Operator resources in deploy/k8s/monitoring/operator/, and
for the Gateway API HTTPRoute of deploy/k8s/examples/httproute.yaml.

kubernetes-validate knows Kubernetes' own kinds only. These are the parts of the operator's CRDs
(monitoring.coreos.com/v1 PodMonitor and PrometheusRule, as in prometheus-operator's
example/prometheus-operator-crd/) that the manifests use, written out by hand, strict: a field
that is not listed, a misspelt one included, fails, as do wrong types and unknown relabel
actions. Fields the manifests do not use are left out on purpose.
"""

from __future__ import annotations

from typing import Any

_STRINGS = {"type": "array", "items": {"type": "string"}}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
# The CRDs' Duration pattern: 30s, 1m30s, 5m, 0.
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_ACTIONS = ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep"]
_ACTIONS += ["lowercase", "uppercase", "keepequal", "dropequal"]

_RELABELING = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {"enum": _ACTIONS + [action.capitalize() for action in _ACTIONS]},
        "modulus": {"type": "integer"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "sourceLabels": _STRINGS,
        "targetLabel": {"type": "string"},
    },
}

_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS},
}

_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": _LABELS},
    "required": ["matchLabels"],
}

_POD_METRICS_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "relabelings": {"type": "array", "items": _RELABELING},
        "metricRelabelings": {"type": "array", "items": _RELABELING},
    },
}


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A monitoring.coreos.com/v1 object of `kind` whose spec is `spec`."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": {"type": "object", "additionalProperties": False, **spec},
        },
    }


POD_MONITOR = _resource(
    "PodMonitor",
    {
        "required": ["selector", "podMetricsEndpoints"],
        "properties": {
            "jobLabel": {"type": "string"},
            "selector": _SELECTOR,
            "namespaceSelector": {
                "type": "object",
                "properties": {"any": {"type": "boolean"}, "matchNames": _STRINGS},
            },
            "podMetricsEndpoints": {
                "type": "array",
                "minItems": 1,
                "items": _POD_METRICS_ENDPOINT,
            },
        },
    },
)

_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "properties": {
        "record": {"type": "string"},
        "alert": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": _DURATION,
        "labels": _LABELS,
        "annotations": _LABELS,
    },
}

_RULE_GROUP = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "rules"],
    "properties": {
        "name": {"type": "string"},
        "interval": _DURATION,
        "rules": {"type": "array", "items": _RULE},
    },
}

PROMETHEUS_RULE = _resource(
    "PrometheusRule",
    {"properties": {"groups": {"type": "array", "minItems": 1, "items": _RULE_GROUP}}},
)

SCHEMAS = {"PodMonitor": POD_MONITOR, "PrometheusRule": PROMETHEUS_RULE}

# Gateway API's HTTPRoute (gateway.networking.k8s.io/v1, standard channel, `timeouts` since 1.2):
# the fields the example uses, from the CRD's schema, strict in the same way.
_GATEWAY_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_PARENT_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "namespace": {"type": "string"},
        "name": {"type": "string"},
        "sectionName": {"type": "string"},
        "port": {"type": "integer"},
    },
}
_PATH_MATCH = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
        "value": {"type": "string", "maxLength": 1024},
    },
}
_BACKEND_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "weight": {"type": "integer", "minimum": 0},
    },
}
_HTTP_ROUTE_RULE = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matches": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"path": _PATH_MATCH},
            },
        },
        "backendRefs": {"type": "array", "items": _BACKEND_REF},
        "timeouts": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"request": _GATEWAY_DURATION, "backendRequest": _GATEWAY_DURATION},
        },
    },
}
HTTP_ROUTE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "items": _PARENT_REF},
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {"type": "array", "maxItems": 16, "items": _HTTP_ROUTE_RULE},
            },
        },
    },
}
