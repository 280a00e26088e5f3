"""GatewaySettings: the environment as the gateway reads it, lists, worker URLs, refused values."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest

from mineru_gateway.config import (
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_PORT,
    MIB,
    GatewaySettings,
    default_max_queued_bytes,
    memory_limit,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MINERU_GATEWAY_"):
            monkeypatch.delenv(name)


def test_defaults_listen_where_mineru_clients_look() -> None:
    settings = GatewaySettings()
    assert (settings.host, settings.port) == ("127.0.0.1", DEFAULT_PORT) == ("127.0.0.1", 30000)
    assert settings.workers == settings.worker_dns == settings.api_keys == []
    assert settings.routing_policy == "queue"


def test_settings_come_from_prefixed_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINERU_GATEWAY_PORT", "8080")
    monkeypatch.setenv("MINERU_GATEWAY_ROUTING_POLICY", "round_robin")
    monkeypatch.setenv("MINERU_GATEWAY_FIRST_BYTE_TIMEOUT_S", "12.5")
    monkeypatch.setenv("MINERU_GATEWAY_PACE_WEIGHTING", "true")
    monkeypatch.setenv("PORT", "1")  # unprefixed: not ours
    settings = GatewaySettings()
    assert settings.port == 8080
    assert settings.routing_policy == "round_robin"
    assert settings.first_byte_timeout_s == 12.5
    assert settings.pace_weighting is True


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINERU_GATEWAY_PORT", "8080")
    assert GatewaySettings(port=9090).port == 9090


@pytest.mark.parametrize("field", ["workers", "worker_dns"])
def test_worker_lists_are_comma_separated_and_lose_trailing_slashes(
    monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    monkeypatch.setenv(
        f"MINERU_GATEWAY_{field.upper()}", " http://w0:30001/ ,,https://w1:30002//, http://w2 "
    )
    assert getattr(GatewaySettings(), field) == [
        "http://w0:30001",
        "https://w1:30002",
        "http://w2",
    ]


def test_api_keys_are_comma_separated_and_kept_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINERU_GATEWAY_API_KEYS", "k1, k/2/ ,")
    assert GatewaySettings().api_keys == ["k1", "k/2/"]


def test_lists_given_as_lists_are_taken_as_they_are() -> None:
    settings = GatewaySettings(workers=["http://a:1/"], api_keys=["x,y"])
    assert (settings.workers, settings.api_keys) == (["http://a:1"], ["x,y"])


@pytest.mark.parametrize("url", ["w0:30001", "ftp://w0", "127.0.0.1:30001"])
def test_a_worker_url_without_http_scheme_is_refused(url: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="must start with http:// or https://"):
        GatewaySettings(workers=["http://fine:1", url])


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("port", "65536"),
        ("port", "-1"),
        ("port", "eighty"),
        ("routing_policy", "random"),
        ("log_level", "verbose"),
        ("log_format", "xml"),
        ("connect_timeout_s", "0"),
        ("idle_stream_timeout_s", "-5"),
        ("max_body_bytes", "0"),
        ("eject_after", "0"),
        ("max_retries", "-1"),
        ("kv_avoid_above", "1.5"),
        ("waiting_weight", "-0.1"),
    ],
)
def test_invalid_values_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"MINERU_GATEWAY_{name.upper()}", value)
    with pytest.raises(pydantic.ValidationError) as info:
        GatewaySettings()
    assert [error["loc"] for error in info.value.errors()] == [(name,)]


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="extra"):
        GatewaySettings(wrokers=["http://w0:30001"])  # type: ignore[call-arg]


def test_settings_are_frozen() -> None:
    settings = GatewaySettings()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        settings.port = 1  # type: ignore[misc]


def cgroup_files(tmp_path: Path, v2: str | None, v1: str | None) -> tuple[Path, Path]:
    """cgroup v2's memory.max and v1's memory.limit_in_bytes under `tmp_path`, each written
    only when given."""
    files = (tmp_path / "memory.max", tmp_path / "memory" / "memory.limit_in_bytes")
    for path, text in zip(files, (v2, v1), strict=True):
        if text is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return files


@pytest.mark.parametrize(
    ("v2", "v1", "limit"),
    [
        ("2147483648\n", None, 2048 * MIB),  # cgroup v2, a 2 GiB pod limit
        ("max\n", None, None),  # cgroup v2, no limit
        (None, "1073741824\n", 1024 * MIB),  # cgroup v1
        (None, "9223372036854771712\n", 9223372036854771712),  # v1 without a limit
        ("max\n", "1073741824\n", None),  # v2 answers first
        (None, None, None),  # neither: not in a cgroup this can read
        ("", None, None),  # unreadable as a number: no limit known
    ],
)
def test_the_memory_limit_is_read_from_cgroup_v2_then_v1(
    tmp_path: Path, v2: str | None, v1: str | None, limit: int | None
) -> None:
    assert memory_limit(cgroup_files(tmp_path, v2, v1)) == limit


@pytest.mark.parametrize(
    ("limit", "queued"),
    [
        (2048 * MIB, 512 * MIB),  # the gateway pod's limit: a quarter of it
        (64 * 1024 * MIB, DEFAULT_MAX_QUEUED_BYTES),  # a large limit: the default
        (None, DEFAULT_MAX_QUEUED_BYTES),  # no limit: the default
    ],
)
def test_queued_bytes_default_to_a_quarter_of_the_memory_limit(
    tmp_path: Path, limit: int | None, queued: int
) -> None:
    files = cgroup_files(tmp_path, "max" if limit is None else str(limit), None)
    assert default_max_queued_bytes(files) == queued


def test_queued_bytes_come_from_this_containers_limit_unless_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert GatewaySettings().max_queued_bytes == default_max_queued_bytes()
    monkeypatch.setenv("MINERU_GATEWAY_MAX_QUEUED_BYTES", "12345")
    assert GatewaySettings().max_queued_bytes == 12345
    assert GatewaySettings(max_queued_bytes=7).max_queued_bytes == 7
