"""How errors raised in FastAPI's routes become OpenAI-shaped answers (errors.py)."""

from __future__ import annotations

from http import HTTPStatus

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from mineru_gateway.api.control import json_response
from mineru_gateway.api.relay import Send
from mineru_gateway.errors import GatewayError, InvalidRequest

log = structlog.get_logger("mineru_gateway.app")


async def send_error(send: Send, error: GatewayError) -> None:
    """An error answered below FastAPI (before a request reaches it)."""
    headers = [(b"content-type", b"application/json"), *error.headers()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.body_bytes()})


def error_response(error: GatewayError) -> Response:
    headers = {name.decode(): value.decode() for name, value in error.headers()}
    return json_response(error.body(), error.status, headers)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, error: GatewayError) -> Response:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        body = GatewayError(str(error.detail)).body()
        code = HTTPStatus(error.status_code).phrase.lower().replace(" ", "_")
        body["error"].update(type="invalid_request_error", code=code)
        return json_response(body, error.status_code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        return error_response(InvalidRequest(str(first.get("msg", error)), param=param))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        # The top-level handler: the one place a bare Exception is caught.
        log.exception("unhandled_error", path=request.url.path)
        return error_response(GatewayError("internal gateway error"))
