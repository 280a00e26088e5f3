"""A completions request as the gateway reads it: one typed value, built in one walk. Pure.

`Request(endpoint, payload)` checks a parsed body's shape (a 400 naming the field) and walks its
messages once, keeping what every reader needs: the limits (api/limits.py: counts, images), the
media policy (api/media.py: the URLs a worker would fetch), the prompt estimate (prompts.py:
texts and image URLs) and the cache key (cache/keys.py: the sampling fields and the payload).
None of them walks the body again (docs/proxy-costs.md, "One walk over the messages"). Lenient
where the worker judges: a part that is not an object, or an unknown part, counts as nothing.

`ParsedRequest` is what admission leaves: the body's bytes as they are forwarded, and what
routing, flow control, the cache and accounting read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from mineru_gateway.cost import CostInputs
from mineru_gateway.errors import InvalidRequest
from mineru_gateway.values import value

Endpoint = Literal["chat", "completions"]

# Content part types whose payload vLLM may fetch from a URL (OpenAI's and vLLM's own).
URL_PARTS = ("image_url", "video_url", "audio_url", "input_image")
IMAGE_PARTS = ("image_url", "input_image")
MEDIA_PARTS = (*URL_PARTS, "input_audio")  # what vLLM may fetch, plus inline audio
TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")


@value
class CacheTag:
    """A cacheable request: the digest of what determines its answer within its scope (the
    key it is stored and coalesced under), and whether a stream of it asked for a usage event
    (cache/keys.py)."""

    digest: bytes
    include_usage: bool = False


@value
class MediaPart:
    """A content part that carries media (`MEDIA_PARTS`): where it is, its kind, its payload."""

    message: int
    number: int
    kind: str
    payload: Any  # `{"url": ...}`, a bare URL string, or inline audio

    @property
    def where(self) -> str:
        return part_name(self.message, self.number)


@value
class MediaUrl:
    """A URL a worker would fetch (or a `data:` URL it decodes), and where it is."""

    message: int
    number: int
    kind: str
    url: str

    @property
    def where(self) -> str:
        return f"{part_name(self.message, self.number)}.{self.kind}"


class Request:
    """A request body read once (module docstring): `Request(endpoint, payload)` checks its
    shape, raising InvalidRequest (400, naming the field), and walks its messages. Read-only
    after. One constructor does it all: it runs for every request (docs/proxy-costs.md)."""

    __slots__ = (
        "endpoint",
        "ignore_eos",
        "image_urls",
        "max_tokens",
        "media",
        "message_count",
        "model",
        "part_count",
        "payload",
        "priority",
        "prompt",
        "stream",
        "texts",
        "token_fields",
        "urls",
    )
    texts: Sequence[str]  # from string contents and text parts, in order
    image_urls: Sequence[str]  # image parts without text, for the estimate
    media: Sequence[MediaPart]
    urls: Sequence[MediaUrl]

    def __init__(self, endpoint: Endpoint, payload: dict[str, Any]) -> None:
        self.endpoint: Endpoint = endpoint
        self.payload = payload  # the parsed body: its depth (limits), its key (cache)
        get = payload.get
        self.part_count = 0  # content parts that are objects
        self.image_urls = self.media = self.urls = NOTHING
        if endpoint == "chat":
            self.prompt: Any = None  # a completion's `prompt`
            self._read_messages(get("messages"))
        else:
            self.message_count = 0
            self.texts = NOTHING
            self.prompt = _prompt(get("prompt"))
        model = get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("`model` must be a string", param="model")
        self.model: str | None = model
        stream = get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise InvalidRequest("`stream` must be a boolean", param="stream")
        self.stream = stream is True
        priority = get("priority")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise InvalidRequest(
                "`priority` must be an integer (lower is served first)", param="priority"
            )
        self.priority: int | None = priority  # vLLM's `priority` field: lower first
        self.ignore_eos = get("ignore_eos") is True
        # Each integer max-tokens field as given (a ceiling is checked against each), and the
        # first positive one (what the answer's length is capped at).
        fields: tuple[tuple[str, int], ...] = ()
        max_tokens = None
        for name in TOKEN_FIELDS:
            tokens = get(name)
            if isinstance(tokens, int) and not isinstance(tokens, bool):
                fields += ((name, tokens),)
                if tokens > 0 and max_tokens is None:
                    max_tokens = tokens
        self.token_fields = fields
        self.max_tokens: int | None = max_tokens

    def _read_messages(self, messages: Any) -> None:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("`messages` must be a non-empty array", param="messages")
        self.message_count = len(messages)
        texts: list[str] = []
        self.texts = texts
        parts: Parts | None = None  # made at the first list of parts
        malformed: int | None = None
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                if malformed is None:
                    malformed = index
                continue
            if malformed is None and not isinstance(message.get("role"), str):
                malformed = index
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                if parts is None:
                    parts = Parts(texts)
                parts.read(index, content)
        if malformed is not None:
            raise InvalidRequest(
                f"`messages[{malformed}]` must be an object with a string `role`",
                param=f"messages.{malformed}",
            )
        if parts is not None:
            self.part_count = parts.count
            self.image_urls, self.media, self.urls = parts.images, parts.media, parts.urls


NOTHING: tuple[Any, ...] = ()


class Parts:
    """The messages' content parts as they are read: texts, image URLs for the estimate,
    media and URLs."""

    __slots__ = ("count", "images", "media", "texts", "urls")

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.count = 0
        self.images: list[str] = []
        self.media: list[MediaPart] = []
        self.urls: list[MediaUrl] = []

    def read(self, index: int, content: list[Any]) -> None:
        """One message's content parts."""
        for number, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            self.count += 1
            text = part.get("text")
            if isinstance(text, str):
                self.texts.append(text)
            elif isinstance(url := _url_of(part.get("image_url")), str):
                self.images.append(url)
            kind = part.get("type")
            if not (isinstance(kind, str) and kind in part):
                kind = next((name for name in MEDIA_PARTS if name in part), None)
            if kind in MEDIA_PARTS:
                self.media.append(MediaPart(index, number, kind, part.get(kind)))
            for name in URL_PARTS:
                url = _url_of(part.get(name))
                if url is not None:
                    self.urls.append(MediaUrl(index, number, name, url))


def _prompt(prompt: Any) -> Any:
    if isinstance(prompt, str | list) and prompt:
        return prompt
    raise InvalidRequest("`prompt` must be a non-empty string or array", param="prompt")


def _url_of(item: Any) -> str | None:
    """`{"url": ...}` as OpenAI nests it, or a bare string as some clients send."""
    if isinstance(item, dict):
        item = item.get("url")
    return item if isinstance(item, str) else None


def part_name(message: int, number: int) -> str:
    """How errors name a content part: `messages[1].content[0]`."""
    return f"messages[{message}].content[{number}]"


def param_of(where: str) -> str:
    """`messages[1].content[0]` as an OpenAI error's `param`: `messages.1.content.0`."""
    return where.replace("[", ".").replace("]", "")


@value
class ParsedRequest:
    """An admitted request: its body as forwarded, and what the gateway read from it."""

    endpoint: Endpoint
    body: bytes
    model: str | None
    stream: bool
    cost: CostInputs
    priority: int | None = None  # vLLM's `priority` field: lower first
    cache_tag: CacheTag | None = None  # set when asked for and the request is greedy
