"""The simulator's HTTP face: vLLM's OpenAI server routes on Starlette.

The two completion routes are raw ASGI endpoints: no request model, one `send` per engine step and
request (normally one token event), and a task awaiting `http.disconnect` that aborts the request in
the engine the moment its client goes, waiting or running, streamed or not (as vLLM does).
The control routes are plain Starlette endpoints. `/sim/...` is the simulator's own namespace.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from mineru_gateway import prompts
from mineru_gateway.sim import protocol, workload
from mineru_gateway.sim.config import SimConfig
from mineru_gateway.sim.engine import EngineLoop, RequestState, Scheduler, SimRequest
from mineru_gateway.sim.metrics import build_registry
from mineru_gateway.sim.protocol import ApiError, ParsedRequest, ResponseMeta, StreamEncoder

JSON_TYPE = b"application/json"
SSE_TYPE = b"text/event-stream; charset=utf-8"


class Simulator:
    """One simulated worker: engine, metrics and the state the routes share."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.engine = EngineLoop(self.scheduler, config.time_scale)
        self.admission_rejections: dict[str, int] = {}
        self.registry = build_registry(
            self.scheduler,
            config.model_name,
            config.engine_label,
            config.dialect,
            self.admission_rejections,
        )
        self.created = int(time.time())
        self.fingerprint = f"vllm-{config.vllm_version}-sim"
        self.healthy = True
        self.in_flight = 0
        self.ids_in_flight: set[str] = set()  # refused twice by vLLM 0.11 (vllm_contract.py)
        # Every `vllm_xargs` key requests carried: what a logits processor would be handed.
        self.xargs_seen: set[str] = set()

    def start(self) -> None:
        if not self.engine.running:
            self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def shut_down(self, poll_s: float = 0.05) -> None:
        """What vLLM does on SIGTERM: in-flight requests may finish for `shutdown_timeout`
        seconds (its drain mode), then whatever is left is aborted (with 0, at once: its
        default abort mode). docs/vllm.md."""
        deadline = time.monotonic() + self.config.shutdown_timeout * self.engine.time_scale
        while self.in_flight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(poll_s)
        await self.engine.stop()

    def check_admission(self) -> None:
        """vLLM's queue limits (`--max-num-queued-reqs`, `--max-num-queued-tokens`): raises
        its queue-full 503 past them (vllm/v1/engine/async_llm.py, `check_admission`)."""
        config, scheduler = self.config, self.scheduler
        limit, tokens = config.max_num_queued_reqs, config.max_num_queued_tokens
        if limit is not None and scheduler.unfinished + 1 > limit:
            self._rejected("max_num_queued_reqs")
            raise protocol.queue_full(tokens=False)
        if tokens is not None and scheduler.queued_prompt_tokens >= tokens:
            self._rejected("max_num_queued_tokens")
            raise protocol.queue_full(tokens=True)

    def _rejected(self, reason: str) -> None:
        self.admission_rejections[reason] = self.admission_rejections.get(reason, 0) + 1

    def state(self) -> dict[str, Any]:
        stats = self.scheduler.stats
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.scheduler.kv_usage,
            "arrived": stats.arrived,
            "completed": stats.completed,
            "aborted": stats.aborted,
            "preemptions": stats.preemptions,
            "steps": stats.steps,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "in_flight": self.in_flight,
            "speed": self.scheduler.speed,
            "time_scale": self.engine.time_scale,
            "healthy": self.healthy,
            "vllm_xargs_seen": sorted(self.xargs_seen),
        }


class CompletionEndpoint:
    """`POST /v1/chat/completions` (chat=True) or `POST /v1/completions`, as raw ASGI."""

    def __init__(self, sim: Simulator, chat: bool) -> None:
        self.sim = sim
        self.chat = chat
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await _read_body(receive)
        if raw is None:
            return
        self.sim.start()  # no-op under a lifespan; lets servers without one work too
        self.sim.in_flight += 1
        try:
            await self._serve(scope, raw, receive, send)
        finally:
            self.sim.in_flight -= 1

    async def _serve(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        header_id = _header(scope, b"x-request-id")
        try:
            parsed = protocol.parse_request(raw, self.chat, self.sim.config.seed)
            request, meta = self._admit(parsed, header_id)
        except ApiError as error:
            await _send_body(send, error.status, error.body(), _id_headers(header_id))
            return
        headers = _id_headers(header_id)
        sim = self.sim
        sim.xargs_seen |= parsed.xargs_keys
        if sim.config.dialect.refuses_duplicate_id and request.request_id in sim.ids_in_flight:
            refused = protocol.duplicate_request_id(request.request_id)
            if parsed.stream:  # vLLM 0.11 finds it once the stream has begun
                await _stream_error(send, refused, headers)
            else:
                await _send_body(send, refused.status, refused.body(), headers)
            return
        sim.ids_in_flight.add(request.request_id)
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, request))
        try:
            self.sim.engine.submit(request)
            if parsed.stream:
                encoder = StreamEncoder(
                    meta, self.chat, workload.VOCABULARY[parsed.kind], parsed.include_usage
                )
                await _stream(send, request, encoder, headers)
            else:
                await self._answer_whole(send, request, meta, parsed.kind, headers)
        finally:
            watcher.cancel()
            sim.ids_in_flight.discard(request.request_id)
            self.sim.engine.abort(request)  # no-op once finished

    def _admit(
        self, parsed: ParsedRequest, header_id: str | None
    ) -> tuple[SimRequest, ResponseMeta]:
        config = self.sim.config
        if parsed.model is not None and parsed.model != config.model_name:
            raise protocol.model_not_found(parsed.model, config.model_name)
        max_tokens = protocol.check_request(parsed, config.max_model_len)
        self.sim.check_admission()
        answer = _plan_answer(parsed, max_tokens)
        base_id = header_id or parsed.request_id or os.urandom(8).hex()
        request = SimRequest(
            request_id=self.id_prefix + base_id,
            prompt_tokens=parsed.prompt_tokens,
            output_tokens=answer.tokens,
            finish_reason=answer.finish_reason,
            max_tokens=max_tokens,
            priority=parsed.priority,
        )
        meta = ResponseMeta(
            response_id=request.request_id,
            created=int(time.time()),
            model=config.model_name,
            fingerprint=self.sim.fingerprint,
            prompt_tokens=parsed.prompt_tokens,
        )
        return request, meta

    async def _watch(self, receive: Receive, request: SimRequest) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.sim.engine.abort(request)

    async def _answer_whole(
        self,
        send: Send,
        request: SimRequest,
        meta: ResponseMeta,
        kind: prompts.PromptKind,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        while not request.done:
            await request.changed()
        if request.state is RequestState.ABORTED:
            await _send_body(send, 503, _stopped_error().body(), headers)
            return
        text = workload.answer_text(kind, request.generated)
        render = protocol.chat_body if self.chat else protocol.completion_body
        body = render(meta, text, request.finish_reason, request.generated)
        await _send_body(send, 200, body, headers)


async def _stream(
    send: Send, request: SimRequest, encoder: StreamEncoder, headers: list[tuple[bytes, bytes]]
) -> None:
    """Sends each token as its own SSE event, as soon as the engine step that made it ends."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", SSE_TYPE), *headers],
        }
    )
    sent = 0
    while True:
        if request.generated == sent and not request.done:
            await request.changed()
        if request.state is RequestState.ABORTED:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body, sent = _events(request, encoder, sent)
        finished = request.state is RequestState.FINISHED
        await send({"type": "http.response.body", "body": body, "more_body": not finished})
        if finished:
            return


async def _stream_error(send: Send, error: ApiError, headers: list[tuple[bytes, bytes]]) -> None:
    """A stream that fails before its first token, as vLLM writes one: an error event, then
    `[DONE]` (vllm/entrypoints/openai/serving_chat.py of 0.11)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", SSE_TYPE), *headers],
        }
    )
    body = b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _events(request: SimRequest, encoder: StreamEncoder, sent: int) -> tuple[bytes, int]:
    generated = request.generated
    opening = encoder.opening() if sent == 0 else b""
    if request.state is not RequestState.FINISHED:
        return opening + b"".join(encoder.tokens(sent, generated)), generated
    middle = b"".join(encoder.tokens(sent, generated - 1))
    closing = encoder.closing(generated - 1, request.finish_reason, generated)
    return opening + middle + closing, generated


def _plan_answer(parsed: ParsedRequest, max_tokens: int) -> workload.Answer:
    if parsed.forced_output_tokens is not None:
        drawn = parsed.forced_output_tokens
    else:
        drawn = workload.draw_length(parsed.kind, parsed.seed)
    return workload.plan_answer(drawn, max_tokens, parsed.min_tokens, parsed.ignore_eos)


def _stopped_error() -> ApiError:
    return ApiError(
        503, "The simulated engine stopped before the request finished.", "EngineDeadError"
    )


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client left first."""
    chunks: list[bytes] = []
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _id_headers(request_id: str | None) -> list[tuple[bytes, bytes]]:
    return [] if request_id is None else [(b"x-request-id", request_id.encode("latin-1"))]


async def _send_body(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    start_headers = [
        (b"content-type", JSON_TYPE),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _control_routes(sim: Simulator) -> list[Route]:
    config = sim.config

    async def health(_: Request) -> Response:
        return Response(status_code=200 if sim.healthy else 503)

    async def models(_: Request) -> Response:
        return _json(_models_payload(config, sim.created))

    async def version(_: Request) -> Response:
        return _json({"version": config.vllm_version})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(sim.registry), media_type=CONTENT_TYPE_LATEST)

    async def filtered_metrics(request: Request) -> Response:
        # vLLM serves `/metrics` through prometheus-fastapi-instrumentator, which ignores
        # `name[]`, and `/metrics/` through prometheus_client's ASGI app, which applies it
        # (docs/vllm.md); with several API servers, its multiprocess registry knows no names.
        names = request.query_params.getlist("name[]")
        if not names:
            return await metrics(request)
        if config.api_server_count > 1:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        text = generate_latest(sim.registry.restricted_registry(names))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def load(_: Request) -> Response:
        return _json({"server_load": sim.in_flight})

    async def state(_: Request) -> Response:
        return _json(sim.state())

    async def control(request: Request) -> Response:
        try:
            _apply_control(sim, orjson.loads(await request.body()))
        except (orjson.JSONDecodeError, ValueError, TypeError) as error:
            return _json({"error": str(error)}, status=400)
        return _json(sim.state())

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/version", version),
        Route("/metrics", metrics),
        Route("/metrics/", filtered_metrics),
        Route("/sim/state", state),
        Route("/sim/control", control, methods=["POST"]),
    ]
    if config.enable_server_load_tracking:
        routes.append(Route("/load", load))
    return routes


def _apply_control(sim: Simulator, payload: object) -> None:
    """`{"speed": 0.5, "healthy": false}`: degrade or fail a running simulator."""
    if not isinstance(payload, dict):
        raise ValueError("expected a JSON object")
    speed = payload.get("speed")
    if speed is not None:
        if not isinstance(speed, int | float) or isinstance(speed, bool) or speed <= 0:
            raise ValueError("speed must be a positive number")
        sim.scheduler.speed = float(speed)
    healthy = payload.get("healthy")
    if healthy is not None:
        if not isinstance(healthy, bool):
            raise ValueError("healthy must be a boolean")
        sim.healthy = healthy


def _models_payload(config: SimConfig, created: int) -> dict[str, Any]:
    permission = {
        "id": "modelperm-" + os.urandom(8).hex(),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    model = {
        "id": config.model_name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": config.model_name,
        "parent": None,
        "max_model_len": config.max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [model]}


def create_sim_app(config: SimConfig) -> Starlette:
    """A simulated vLLM worker; its engine runs between the app's lifespan startup and shutdown."""
    sim = Simulator(config)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        sim.start()
        try:
            yield
        finally:
            await sim.stop()

    routes = [
        Route("/v1/chat/completions", CompletionEndpoint(sim, chat=True), methods=["POST"]),
        Route("/v1/completions", CompletionEndpoint(sim, chat=False), methods=["POST"]),
        *_control_routes(sim),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.sim = sim
    return app
