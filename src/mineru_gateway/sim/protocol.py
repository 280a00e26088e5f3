"""vLLM's OpenAI wire format: request parsing with vLLM's errors, and response bodies and SSE chunks
with the exact keys of a real vLLM 0.32 server (fixtures/vllm/).

Streaming is the hot path: every chunk of a request differs only in its token text, so each chunk
is pre-serialised once per request as a prefix and a suffix around the JSON-encoded text, and a
token event costs one lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from mineru_gateway import prompts
from mineru_gateway.prompts import PromptKind
from mineru_gateway.sim import workload
from mineru_gateway.vllm_contract import QUEUE_FULL_MESSAGES

DONE_EVENT = b"data: [DONE]\n\n"
_SENTINEL = "@@sim-token-text@@"
_SENTINEL_JSON = orjson.dumps(_SENTINEL)


class ApiError(Exception):
    """An error answered in vLLM's shape: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return orjson.dumps({"error": {**error, "code": self.status}})


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def duplicate_request_id(request_id: str) -> ApiError:
    """vLLM 0.11's answer to a request whose id is already in flight
    (vllm/v1/engine/output_processor.py, `add_request`)."""
    return bad_request(f"Request id {request_id} already running.")


def queue_full(tokens: bool) -> ApiError:
    """vLLM's answer past `--max-num-queued-reqs` (or, `tokens`, `--max-num-queued-tokens`):
    vllm/exceptions.py, typed with the status's phrase (vllm_contract.py)."""
    message = QUEUE_FULL_MESSAGES[1 if tokens else 0].decode()
    return ApiError(
        503, f"{message} Please try again later or on a different instance.", "Service Unavailable"
    )


def validation_error(loc: str, kind: str, msg: str, value: object) -> ApiError:
    """FastAPI's request validation error as vLLM words it (fixtures: error_400_validation)."""
    detail = {"type": kind, "loc": loc, "msg": msg, "input": _abridged(value)}
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request", loc)


def _abridged(value: object) -> object:
    text = repr(value)
    return value if len(text) <= 200 else text[:200] + "..."


def model_not_found(requested: str, served: str) -> ApiError:
    message = f"The model `{requested}` does not exist. Valid aliases: {served}."
    return ApiError(404, message, "NotFoundError", "model")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the simulator needs from a completion request; the rest is accepted and ignored."""

    chat: bool
    model: str | None
    prompt_tokens: int
    kind: PromptKind
    seed: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int
    n: int
    request_id: str | None
    forced_output_tokens: int | None
    xargs_keys: frozenset[str] = frozenset()  # what `vllm_xargs` carried: logits processors' input


def parse_request(raw: bytes, chat: bool, seed: int) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise validation_error("body.0", "json_invalid", "JSON decode error", {}) from None
    if not isinstance(body, dict):
        raise validation_error("body", "model_attributes_type", "Input should be an object", body)
    if chat:
        tokens, parts, texts = _chat_prompt(_field(body, "messages", list, required=True))
    else:
        tokens, parts, texts = _completion_prompt(body.get("prompt"))
    return ParsedRequest(
        chat=chat,
        model=_field(body, "model", str),
        prompt_tokens=max(1, tokens),
        kind=prompts.prompt_kind("\n".join(texts)),
        seed=workload.content_seed(parts, seed),
        max_tokens=_max_tokens(body, chat),
        min_tokens=_int_field(body, "min_tokens", 0),
        ignore_eos=_field(body, "ignore_eos", bool) or False,
        stream=_field(body, "stream", bool) or False,
        include_usage=_include_usage(body),
        priority=_int_field(body, "priority", 0),
        n=_int_field(body, "n", 1),
        request_id=_field(body, "request_id", str),
        forced_output_tokens=_forced_output_tokens(body),
        xargs_keys=frozenset(_field(body, "vllm_xargs", dict) or ()),
    )


_TYPE_ERRORS: dict[type, tuple[str, str]] = {
    list: ("list_type", "Input should be a valid list"),
    dict: ("dict_type", "Input should be a valid dictionary"),
    str: ("string_type", "Input should be a valid string"),
    bool: ("bool_type", "Input should be a valid boolean"),
    int: ("int_type", "Input should be a valid integer"),
}


def _field(
    body: dict[str, Any], name: str, kind: type, required: bool = False, loc: str = "body"
) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise validation_error(f"{loc}.{name}", "missing", "Field required", body)
        return None
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        error_type, message = _TYPE_ERRORS[kind]
        raise validation_error(f"{loc}.{name}", error_type, message, value)
    return value


def _int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = _field(body, name, int)
    return default if value is None else int(value)


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    # OpenAI's newer name wins in vLLM's chat endpoint.
    newer = _field(body, "max_completion_tokens", int) if chat else None
    value = newer if newer is not None else _field(body, "max_tokens", int)
    return None if value is None else int(value)


def _include_usage(body: dict[str, Any]) -> bool:
    options = _field(body, "stream_options", dict)
    if options is None:
        return False
    if not body.get("stream"):
        message = "Value error, Stream options can only be defined when `stream=True`."
        raise validation_error("body", "value_error", message, body)
    return bool(_field(options, "include_usage", bool, loc="body.stream_options"))


def _forced_output_tokens(body: dict[str, Any]) -> int | None:
    """`vllm_xargs: {"sim_output_tokens": N}`: the answer has N tokens (capped by max_tokens).

    A simulator-only extension that tests and benchmarks use for exact lengths ending in `stop`;
    vLLM hands `vllm_xargs` to logits processors, which ignore keys they do not know.
    """
    xargs = _field(body, "vllm_xargs", dict)
    if xargs is None:
        return None
    value = _field(xargs, "sim_output_tokens", int, loc="body.vllm_xargs")
    return None if value is None else max(1, int(value))


def _chat_prompt(messages: list[Any]) -> tuple[int, list[str], list[str]]:
    """Prompt tokens, content to seed from, and the texts (to recognise MinerU's prompts)."""
    tokens = prompts.chat_overhead_tokens(len(messages))
    parts: list[str] = []
    texts: list[str] = []
    for index, message in enumerate(messages):
        loc = f"body.messages.{index}"
        if not isinstance(message, dict):
            raise validation_error(loc, "dict_type", "Input should be a valid dictionary", message)
        role = _field(message, "role", str, required=True, loc=loc)
        parts.append(role)
        tokens += _content_tokens(message.get("content"), loc, parts, texts)
    return tokens, parts, texts


def _content_tokens(content: object, loc: str, parts: list[str], texts: list[str]) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        parts.append(content)
        texts.append(content)
        return prompts.text_tokens(content)
    if not isinstance(content, list):
        raise validation_error(
            f"{loc}.content", "list_type", "Input should be a valid list", content
        )
    return sum(
        _part_tokens(part, f"{loc}.content.{i}", parts, texts) for i, part in enumerate(content)
    )


def _part_tokens(part: object, loc: str, parts: list[str], texts: list[str]) -> int:
    if not isinstance(part, dict):
        raise validation_error(loc, "dict_type", "Input should be a valid dictionary", part)
    kind = part.get("type")
    if kind == "text":
        text = _field(part, "text", str, required=True, loc=loc)
        parts.append(text)
        texts.append(text)
        return prompts.text_tokens(text)
    if kind == "image_url":
        url = _image_url(part, loc)
        parts.append(url)
        return prompts.image_tokens(url)
    return 0  # audio, video, files: not part of MinerU's traffic


def _image_url(part: dict[str, Any], loc: str) -> str:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        message = "Input should be a valid string"
        raise validation_error(f"{loc}.image_url.url", "string_type", message, url)
    return url


def _completion_prompt(prompt: object) -> tuple[int, list[str], list[str]]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompts.text_tokens(prompt), [prompt], [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt), [repr(prompt)], []
    if prompt is None:
        raise validation_error("body.prompt", "missing", "Field required", None)
    raise bad_request(
        "the simulator serves one prompt (a string or token ids) per request", "prompt"
    )


def check_request(request: ParsedRequest, max_model_len: int) -> int:
    """vLLM's checks on lengths and sampling parameters; returns the effective max_tokens.
    A non-zero `priority` passes under every scheduling policy: V1's `fcfs` ignores it, whatever
    the field's description says (docs/vllm.md, "Priorities")."""
    max_tokens = request.max_tokens
    if max_tokens is not None and max_tokens > max_model_len:
        raise bad_request(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            "max_tokens",
        )
    _check_prompt_fits(request.prompt_tokens, max_tokens, max_model_len)
    effective = max_tokens if max_tokens is not None else max_model_len - request.prompt_tokens
    _check_sampling(request, effective)
    return effective


def _check_prompt_fits(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    if prompt_tokens >= max_model_len:
        raise bad_request(
            f"The decoder prompt (length {prompt_tokens}) is longer than the maximum model length "
            f"of {max_model_len}. Make sure that `max_model_len` is no smaller than the number of "
            "text tokens plus multimodal tokens.",
            "prompt",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max_tokens} output tokens and your prompt contains {prompt_tokens} input "
            f"tokens, for a total of {prompt_tokens + max_tokens} tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens. "
            f"(parameter=max_tokens, value={max_tokens})",
            "max_tokens",
        )


def _check_sampling(request: ParsedRequest, max_tokens: int) -> None:
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if request.min_tokens < 0:
        raise bad_request(
            f"min_tokens must be greater than or equal to 0, got {request.min_tokens}."
        )
    if request.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {request.min_tokens}."
        )
    if request.n != 1:
        raise bad_request(f"The simulator answers n=1 only, got n={request.n}.", "n")


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every chunk and body of one response repeats."""

    response_id: str
    created: int
    model: str
    fingerprint: str
    prompt_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": total,
        "completion_tokens": completion_tokens,
    }


def chat_body(meta: ResponseMeta, text: str, finish_reason: str, completion_tokens: int) -> bytes:
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": None}
    message |= {"audio": None, "function_call": None, "reasoning": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    choice |= {"stop_reason": None, "token_ids": None, "routed_experts": None}
    return orjson.dumps(
        {
            **_head(meta, "chat.completion"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": meta.fingerprint,
            "usage": _full_usage(meta.prompt_tokens, completion_tokens),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


def completion_body(
    meta: ResponseMeta, text: str, finish_reason: str, completion_tokens: int
) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    choice |= {"stop_reason": None, "token_ids": None, "prompt_logprobs": None}
    choice |= {"prompt_token_ids": None, "routed_experts": None}
    return orjson.dumps(
        {
            **_head(meta, "text_completion"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": meta.fingerprint,
            "usage": _full_usage(meta.prompt_tokens, completion_tokens),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


def _head(meta: ResponseMeta, kind: str) -> dict[str, Any]:
    return {"id": meta.response_id, "object": kind, "created": meta.created, "model": meta.model}


def _full_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    details = {"prompt_tokens_details": None, "completion_tokens_details": None}
    return usage(prompt_tokens, completion_tokens) | details


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class StreamEncoder:
    """The SSE events of one streamed response, token text cycling through `vocabulary`."""

    def __init__(
        self, meta: ResponseMeta, chat: bool, vocabulary: Sequence[str], include_usage: bool
    ) -> None:
        self.meta = meta
        self.chat = chat
        self.include_usage = include_usage
        self._vocabulary = vocabulary
        self._object = "chat.completion.chunk" if chat else "text_completion"
        prefix, suffix = self._split(self._token_chunk(_SENTINEL, None))
        self._events = [prefix + orjson.dumps(text) + suffix for text in vocabulary]

    def opening(self) -> bytes:
        """Sent with the first token: the chat role chunk (completions have none)."""
        if not self.chat:
            return b""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        payload = {**_head(self.meta, self._object), "choices": [choice]}
        return _event(payload | {"prompt_token_ids": None, "prompt_text": None})

    def tokens(self, start: int, end: int) -> Iterable[bytes]:
        """Events of tokens `start` to `end - 1`, none of them the last."""
        events, size = self._events, len(self._events)
        return (events[index % size] for index in range(start, end))

    def closing(self, last_index: int, finish_reason: str, completion_tokens: int) -> bytes:
        """The last token's chunk with its finish reason, the usage chunk if asked, `[DONE]`."""
        text = self._vocabulary[last_index % len(self._vocabulary)]
        last = self._token_chunk(text, finish_reason)
        if not self.include_usage:
            return _event(last | {"system_fingerprint": self.meta.fingerprint}) + DONE_EVENT
        usage_chunk = {
            **_head(self.meta, self._object),
            "choices": [],
            "usage": usage(self.meta.prompt_tokens, completion_tokens),
            "system_fingerprint": self.meta.fingerprint,
        }
        return _event(last) + _event(usage_chunk) + DONE_EVENT

    def _token_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice |= {"delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = None
        else:
            choice |= {"text": text, "logprobs": None, "finish_reason": finish_reason}
            choice |= {"stop_reason": None, "prompt_token_ids": None}
        choice["token_ids"] = None
        return {**_head(self.meta, self._object), "choices": [choice]}

    @staticmethod
    def _split(chunk: dict[str, Any]) -> tuple[bytes, bytes]:
        # The text comes after the id and model, so the last occurrence is the placeholder.
        prefix, _, suffix = _event(chunk).rpartition(_SENTINEL_JSON)
        return prefix, suffix
