"""OpenTelemetry traces of the gateway's requests, opt-in (`tracing`; docs/tracing.md).

The relay checks `ENABLED`, a module attribute, and nothing else while tracing is off: the SDK is
imported only by `setup.start_tracing`, so a gateway without tracing does no SDK work per
request. A client's `traceparent` and `tracestate` reach the workers either way (api/relay.py).
"""

from __future__ import annotations

ENABLED = False  # set by setup.start_tracing, cleared by setup.stop_tracing
