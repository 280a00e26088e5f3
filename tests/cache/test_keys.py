"""What may share an answer and under which key; the stored form; the replayed stream."""

from __future__ import annotations

import orjson
import pytest

from mineru_gateway.api.requests import parse_request
from mineru_gateway.cache.answers import Answer, complete, decode, encode, replay_stream

pytestmark = pytest.mark.unit

PAGE = "data:image/png;base64," + "A" * 40_000  # long enough for payload.py's elision


def chat(**extra: object) -> dict[str, object]:
    content = [{"type": "image_url", "image_url": {"url": PAGE}}, {"type": "text", "text": "L"}]
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "top_p": 0.01,
        "vllm_xargs": {"no_repeat_ngram_size": 100},
        **extra,
    }


def tag_of(payload: dict[str, object]) -> bytes | None:
    tag = parse_request("chat", orjson.dumps(payload), key_scope="").cache_tag
    return None if tag is None else tag.digest


def test_mineru_clients_requests_are_cacheable_and_the_tag_comes_from_the_one_parse() -> None:
    assert tag_of(chat()) is not None
    assert tag_of(chat(temperature=0.7, top_k=1)) is not None
    assert parse_request("chat", orjson.dumps(chat())).cache_tag is None  # not asked for


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0.7},
        {"temperature": None},
        {"n": 2},
        {"logprobs": True},
        {"top_logprobs": 2},
        {"prompt_logprobs": 1},
        {"temperature": False},
    ],
)
def test_sampled_or_multi_choice_or_logprob_requests_are_not_cacheable(
    extra: dict[str, object],
) -> None:
    assert tag_of(chat(**extra)) is None
    assert tag_of({k: v for k, v in chat().items() if k != "temperature"}) is None


def test_delivery_and_scheduling_fields_are_not_in_the_key_every_other_field_is() -> None:
    base = tag_of(chat())
    same = chat(priority=5, user="u", stream=True, stream_options={"include_usage": True})
    assert tag_of(same | {"request_id": "r1"}) == base
    assert tag_of(chat(max_tokens=100)) != base
    assert tag_of(chat(top_p=0.02)) != base
    assert tag_of(chat(model="other")) != base
    assert tag_of(chat(vllm_xargs={"no_repeat_ngram_size": 50})) != base
    other_page = chat()
    other_page["messages"][0]["content"][0]["image_url"]["url"] = PAGE[:-1] + "B"  # type: ignore[index]
    assert tag_of(other_page) != base
    completions = parse_request("completions", orjson.dumps({"prompt": "p", "temperature": 0}))
    assert completions.cache_tag is None
    keyed = parse_request(
        "completions", orjson.dumps({"prompt": "p", "temperature": 0}), key_scope=""
    )
    assert keyed.cache_tag is not None and keyed.cache_tag.digest != base


def key_in(scope: str, payload: dict[str, object]) -> bytes:
    tag = parse_request("chat", orjson.dumps(payload), key_scope=scope).cache_tag
    assert tag is not None
    return tag.digest


def test_tenants_keys_differ_and_name_no_tenant() -> None:
    body = chat()
    a, b, shared = key_in("tenant-a", body), key_in("tenant-b", body), key_in("", body)
    assert len({a, b, shared}) == 3
    assert all(name not in key for key in (a, b, shared) for name in (b"tenant-a", b"tenant-b"))
    assert key_in("tenant-a", body) == a  # the same request, the same key


def answer_body(finish: str = "stop", content: str = "# Title") -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}}
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 7,
            "model": "m",
            "choices": [choice | {"finish_reason": finish}],
            "usage": usage,
        }
    )


def test_only_complete_answers_are_kept() -> None:
    assert complete(Answer(200, "application/json", answer_body()))
    assert not complete(Answer(200, "application/json", answer_body("length")))
    assert not complete(Answer(400, "application/json", answer_body()))
    assert not complete(Answer(200, "application/json", b'{"choices": []}'))
    assert not complete(Answer(200, "application/json", b"not json"))


def test_a_stored_answer_comes_back_and_a_truncated_or_altered_one_is_a_miss() -> None:
    answer = Answer(200, "application/json", answer_body(), worker_s=1.5)
    blob = encode(answer)
    assert decode(blob) == answer
    assert decode(blob[:-1]) is None
    assert decode(blob[:10]) is None
    altered = bytearray(blob)
    altered[-3] ^= 1
    assert decode(bytes(altered)) is None
    assert decode(b"") is None
    assert decode(b"x" * 100) is None


def events(stream: bytes) -> list[bytes]:
    assert stream.endswith(b"\n\n")
    parts = stream[:-2].split(b"\n\n")
    assert all(part.startswith(b"data: ") for part in parts)
    return [part[6:] for part in parts]


def test_a_replayed_stream_is_the_answer_as_vllm_would_stream_it() -> None:
    answer = Answer(200, "application/json", answer_body(content="# Title\n\ntext"))
    data = events(replay_stream("chat", answer, include_usage=True))
    assert data[-1] == b"[DONE]"
    first, usage = orjson.loads(data[0]), orjson.loads(data[1])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["content"] == "# Title\n\ntext"
    assert first["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert len(events(replay_stream("chat", answer, include_usage=False))) == 2
    text = orjson.dumps(
        {"id": "c", "choices": [{"index": 0, "text": "t", "finish_reason": "stop"}]}
    )
    completion = events(replay_stream("completions", Answer(200, "application/json", text), False))
    assert orjson.loads(completion[0])["choices"][0]["text"] == "t"
