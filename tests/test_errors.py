"""The error tree drawn in errors.py's docstring: each error's status, OpenAI body and headers."""

from __future__ import annotations

import orjson
import pytest

from mineru_gateway import errors
from mineru_gateway.errors import (
    AuthenticationFailed,
    Conflict,
    GatewayError,
    HeadersTooLarge,
    InvalidRequest,
    ModelNotFound,
    NoHealthyWorker,
    Overloaded,
    PermissionDenied,
    RequestTimeout,
    RequestTooLarge,
    ShuttingDown,
    UnknownPath,
    UnknownWorker,
    UpstreamBadStatus,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    WorkersBusy,
)

pytestmark = pytest.mark.unit

# error class, its parent, status, `type`, `code`: the docstring's table.
TREE = [
    (GatewayError, Exception, 500, "internal_error", "internal_error"),
    (InvalidRequest, GatewayError, 400, "invalid_request_error", "invalid_request"),
    (AuthenticationFailed, GatewayError, 401, "authentication_error", "invalid_api_key"),
    (ModelNotFound, GatewayError, 404, "invalid_request_error", "model_not_found"),
    (PermissionDenied, GatewayError, 403, "permission_error", "admin_key_required"),
    (UnknownWorker, GatewayError, 404, "invalid_request_error", "unknown_worker"),
    (UnknownPath, GatewayError, 404, "invalid_request_error", "not_found"),
    (Conflict, GatewayError, 409, "invalid_request_error", "conflict"),
    (RequestTimeout, GatewayError, 408, "invalid_request_error", "request_timeout"),
    (RequestTooLarge, GatewayError, 413, "invalid_request_error", "request_too_large"),
    (
        HeadersTooLarge,
        GatewayError,
        431,
        "invalid_request_error",
        "request_header_fields_too_large",
    ),
    (UpstreamError, GatewayError, 502, "upstream_error", "upstream_error"),
    (UpstreamConnectError, UpstreamError, 502, "upstream_error", "upstream_connect_error"),
    (
        UpstreamConnectTimeout,
        UpstreamConnectError,
        502,
        "upstream_error",
        "upstream_connect_timeout",
    ),
    (UpstreamStatusError, UpstreamError, 502, "upstream_error", "upstream_status"),
    (UpstreamBadStatus, UpstreamError, 502, "upstream_error", "bad_upstream_status"),
    (UpstreamTimeout, UpstreamError, 504, "upstream_error", "upstream_timeout"),
    (NoHealthyWorker, UpstreamError, 503, "service_unavailable", "no_healthy_worker"),
    (ShuttingDown, NoHealthyWorker, 503, "service_unavailable", "shutting_down"),
    (WorkersBusy, NoHealthyWorker, 503, "service_unavailable", "workers_busy"),
]


@pytest.mark.parametrize(
    ("error_class", "parent", "status", "type_", "code"),
    TREE,
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_each_error_has_its_status_and_openai_body(
    error_class: type[GatewayError], parent: type[Exception], status: int, type_: str, code: str
) -> None:
    assert error_class.__bases__ == (parent,)
    error = error_class("it went wrong", param="messages")
    assert error.status == status
    assert error.reason == code
    expected = {"message": "it went wrong", "type": type_, "param": "messages", "code": code}
    assert error.body() == {"error": expected}
    assert orjson.loads(error.body_bytes()) == error.body()
    assert str(error) == "it went wrong"


def test_the_table_covers_every_error_in_the_module() -> None:
    defined = {
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, GatewayError)
    }
    assert defined == {Overloaded, *(row[0] for row in TREE)}


def test_an_error_may_carry_a_more_specific_code() -> None:
    error = InvalidRequest("too many", code="too_many_images")
    assert error.reason == error.body()["error"]["code"] == "too_many_images"
    assert error.status == 400


@pytest.mark.parametrize(
    ("code", "expected"), [(None, "admin_key_required"), ("admin_disabled",) * 2]
)
def test_permission_denied_is_a_403_whose_code_says_why(code: str | None, expected: str) -> None:
    error = PermissionDenied("no", code=code)
    assert (error.status, error.type, error.reason) == (403, "permission_error", expected)
    assert error.body()["error"]["code"] == expected


def test_an_error_without_a_param_says_null() -> None:
    assert UpstreamTimeout("slow").body()["error"]["param"] is None


@pytest.mark.parametrize("why", ["queue_full", "tenant_queue_full", "queue_timeout"])
def test_overloaded_is_a_429_whose_code_says_why(why: str) -> None:
    error = Overloaded("the queue is full", why=why, retry_after_s=2.0)
    assert (error.status, error.type, error.why, error.reason) == (
        429,
        "rate_limit_error",
        why,
        why,
    )
    assert error.body()["error"] == {
        "message": "the queue is full",
        "type": "rate_limit_error",
        "param": None,
        "code": why,
    }
    assert error.headers() == [(b"retry-after", b"2")]


@pytest.mark.parametrize(
    ("retry_after_s", "header"),
    [(0.0, b"1"), (0.2, b"1"), (1.0, b"1"), (1.01, b"2"), (29.5, b"30")],
)
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(
    retry_after_s: float, header: bytes
) -> None:
    error = NoHealthyWorker("none healthy", retry_after_s=retry_after_s)
    assert error.headers() == [(b"retry-after", header)]


def test_errors_that_do_not_know_when_to_come_back_send_no_retry_after() -> None:
    assert [cls("x").headers() for cls, *_ in TREE] == [[] for _ in TREE]
