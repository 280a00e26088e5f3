"""Every error the gateway reports, and how each becomes an OpenAI-style body and status.

    GatewayError                      500 internal_error
    ├── InvalidRequest                400 invalid_request_error   (bad JSON, bad shape)
    ├── AuthenticationFailed          401 authentication_error
    ├── ModelNotFound                 404 model_not_found
    ├── RequestTooLarge               413 request_too_large
    └── UpstreamError                 502 upstream_error          (a worker failed us)
        ├── NoHealthyWorker           503 no_healthy_worker
        ├── ShuttingDown              503 shutting_down           (draining before exit)
        ├── UpstreamConnectError      502 upstream_connect_error   (nothing was sent: retry safe)
        └── UpstreamTimeout           504 upstream_timeout

Bodies follow OpenAI: `{"error": {"message", "type", "param", "code"}}`. Worker answers that carry
their own status (a vLLM 400, say) are not GatewayErrors: they are relayed as they came.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


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


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
