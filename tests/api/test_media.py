"""The media URL policy: no request makes the NPU host fetch what the operator did not allow."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from mineru_gateway.api.media import MediaPolicy
from mineru_gateway.errors import InvalidRequest
from mineru_gateway.request import Request
from tests.conftest import StartGateway
from tests.support.workers import Script

pytestmark = pytest.mark.unit

PNG = "data:image/png;base64,iVBORw0KGgo="
METADATA = "http://169.254.169.254/latest/meta-data/"


def message(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "s"}, {"role": "user", "content": list(parts)}]


def image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("policy", "url", "allowed"),
    [
        (MediaPolicy(), PNG, True),
        (MediaPolicy(), METADATA, False),
        (MediaPolicy(), "file:///etc/passwd", False),
        (MediaPolicy(), "https://example.com/a.png", False),
        (MediaPolicy("allowlist", ("cdn.example.com",)), "https://cdn.example.com/a.png", True),
        (MediaPolicy("allowlist", ("cdn.example.com",)), "https://CDN.example.com/a.png", True),
        (MediaPolicy("allowlist", ("cdn.example.com",)), "file://cdn.example.com/a", False),
        (MediaPolicy("allowlist", ("cdn.example.com",)), "https://cdn.example.com.evil/a", False),
        (MediaPolicy("allowlist", ("https://x.com/pages/",)), "https://x.com/pages/1.png", True),
        (MediaPolicy("allowlist", ("https://x.com/pages/",)), "https://x.com/other.png", False),
        (MediaPolicy("allowlist", ("cdn.example.com",)), PNG, True),
        (MediaPolicy("any"), "file:///etc/passwd", True),
    ],
)
def test_which_urls_a_policy_allows(policy: MediaPolicy, url: str, allowed: bool) -> None:
    assert policy.allows(url) is allowed


@pytest.mark.parametrize(
    ("part", "where"),
    [
        (image(METADATA), "messages[1].content[1].image_url"),
        ({"type": "image_url", "image_url": METADATA}, "messages[1].content[1].image_url"),
        ({"type": "video_url", "video_url": {"url": METADATA}}, "messages[1].content[1].video_url"),
        ({"type": "audio_url", "audio_url": {"url": METADATA}}, "messages[1].content[1].audio_url"),
        ({"type": "input_image", "input_image": METADATA}, "messages[1].content[1].input_image"),
    ],
)
def test_a_refused_part_is_named(part: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        MediaPolicy().check(Request("chat", {"messages": message(image(PNG), part)}))
    assert refused.value.message.startswith(where)
    assert refused.value.param == where.replace("[", ".").replace("]", "")


def test_inline_audio_and_text_parts_pass() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    MediaPolicy().check(
        Request(
            "chat", {"messages": message({"type": "text", "text": METADATA}, audio, image(PNG))}
        )
    )


@pytest.mark.parametrize("url", [METADATA, "file:///etc/passwd"])
def test_the_gateway_refuses_remote_media_before_any_worker_sees_it(
    scripted: tuple[Script, str], start_gateway: StartGateway, url: str
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    body = {"model": "echo-model", "messages": message(image(url))}
    response = httpx.post(gateway + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "messages[1].content[0].image_url" in error["message"]
    assert script.seen == []
    allowed = start_gateway([worker], media_urls="any")
    assert httpx.post(allowed + "/v1/chat/completions", json=body).status_code == 200
