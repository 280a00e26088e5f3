"""Every error the gateway reports, and how each becomes an OpenAI-style body and status.

    GatewayError                      500  internal_error / internal_error
    ├── InvalidRequest                400  invalid_request_error / invalid_request, or a
    │                                      limit's code (json_too_deep, too_many_images,
    │                                      image_too_large, ...: api/limits.py)
    ├── AuthenticationFailed          401  authentication_error / invalid_api_key
    ├── PermissionDenied              403  permission_error / admin_key_required, admin_disabled
    ├── ModelNotFound                 404  invalid_request_error / model_not_found
    ├── UnknownWorker                 404  invalid_request_error / unknown_worker
    ├── UnknownPath                   404  invalid_request_error / not_found
    ├── Conflict                      409  invalid_request_error / conflict, or why
    │                                      (restart_in_progress, not_supervised, ...)
    ├── RequestTimeout                408  invalid_request_error / request_timeout (a head or
    │                                      body that stopped coming: api/connection.py)
    ├── RequestTooLarge               413  invalid_request_error / request_too_large
    ├── HeadersTooLarge               431  invalid_request_error /
    │                                      request_header_fields_too_large
    ├── Overloaded                    429  rate_limit_error / <why>: flow control shed it
    │                                      (queue_full, tenant_queue_full, queue_timeout, ...)
    └── UpstreamError                 502  upstream_error / upstream_error (a worker failed us)
        ├── UpstreamConnectError      502  upstream_error / upstream_connect_error
        │   │                              (nothing was sent: retry safe)
        │   └── UpstreamConnectTimeout    502  upstream_error / upstream_connect_timeout
        ├── UpstreamBadStatus         502  upstream_error / bad_upstream_status (a status no
        │                                  client may be given: 101, or outside 200-599)
        ├── UpstreamTimeout           504  upstream_error / upstream_timeout
        └── NoHealthyWorker           503  service_unavailable / no_healthy_worker
            ├── ShuttingDown          503  service_unavailable / shutting_down (draining)
            └── WorkersBusy           503  service_unavailable / workers_busy (every worker's
                                           own queue is full, without flow control's queue)

Each row reads status, `type` / `code`: `type` is the broad class a client can switch on (OpenAI's
SDKs map the status to an exception), `code` the specific reason. Bodies follow OpenAI:
`{"error": {"message", "type", "param", "code"}}`. Errors that tell the client when to come back
(429, 503) carry `Retry-After`, which MinerU's client honours (docs/mineru-client.md). Worker
answers that carry their own status (a vLLM 400, say) are not GatewayErrors: they are relayed as
they came.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import orjson


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self._code = code  # a more specific code than the class's (`too_many_images`, ...)

    @property
    def reason(self) -> str:
        """The error's code, as the body, outcome labels and logs name it."""
        return self._code or self.code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.reason,
            }
        }

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers: `Retry-After` (whole seconds, at least 1) when known."""
        if self.retry_after_s is None:
            return []
        return [(b"retry-after", str(max(1, math.ceil(self.retry_after_s))).encode())]


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    """An admin act (adding or removing workers) without an admin key, or with admin acts off."""

    status = 403
    type = "permission_error"
    code = "admin_key_required"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class UnknownWorker(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_worker"


class UnknownPath(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Conflict(GatewayError):
    """An admin act that cannot happen now (a rolling restart already running, say)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RequestTimeout(GatewayError):
    """A client that stopped sending its request part way (docs/http-edge.md)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"


class Overloaded(GatewayError):
    """Shed by flow control: a queue is full, or the request waited too long in it."""

    status = 429
    type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, why: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s, code=why)
        self.why = why


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


class NoHealthyWorker(UpstreamError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_worker"


class ShuttingDown(NoHealthyWorker):
    code = "shutting_down"


class WorkersBusy(NoHealthyWorker):
    """Every worker that serves the model refused the request because its own queue is full,
    and flow control is off, so there is no gateway queue to wait in."""

    code = "workers_busy"


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection within `connect_timeout_s`: nothing was sent either, but unlike a refused
    connection it may be a live worker whose host is overloaded, so it does not eject at once."""

    code = "upstream_connect_timeout"


class UpstreamStatusError(UpstreamError):
    """A worker answered a read of its own (health, models, load) with a status other than 200:
    it is up and speaking HTTP, unlike a connection error or a timeout."""

    code = "upstream_status"


class UpstreamBadStatus(UpstreamError):
    """A worker's answer with a status that is no answer to relay: a switch of protocols (101)
    or one outside 200-599. Not passed back as it came, unlike a worker's 4xx or 5xx."""

    code = "bad_upstream_status"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
