"""The gateway's settings: one frozen model, and the only code that reads the environment.

Every setting can be given as a `MINERU_GATEWAY_<NAME>` environment variable or as the matching
`--<name>` flag of `mineru-gateway serve` (flags win). Lists take comma-separated values.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

RoutingPolicyName = Literal["least_inflight", "round_robin"]
LogFormat = Literal["json", "console"]

DEFAULT_PORT = 30000  # the port MinerU's clients already use (DESIGN.md section 5)
MIB = 1024 * 1024


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class GatewaySettings(BaseSettings):
    """Settings of one gateway process."""

    model_config = SettingsConfigDict(
        env_prefix="MINERU_GATEWAY_", frozen=True, extra="forbid", validate_default=True
    )

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="Port to listen on (0: any).")
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Worker base URLs, comma-separated (e.g. http://127.0.0.1:30001).",
    )
    routing_policy: RoutingPolicyName = Field(
        "least_inflight", description="How a worker is chosen for each request."
    )
    max_body_bytes: int = Field(
        64 * MIB,
        gt=0,
        description="Largest accepted request body; larger ones get 413. Page images travel as "
        "base64 inside the JSON body, so this bounds the image size a client can send.",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Connecting to a worker.")
    first_byte_timeout_s: float = Field(
        600.0,
        gt=0,
        description="From sending a request to a worker until its first response byte. A "
        "non-streaming answer arrives whole, so this bounds queueing plus generation (MinerU's "
        "client itself gives up after 600 s).",
    )
    idle_stream_timeout_s: float = Field(
        120.0, gt=0, description="Longest silence between two chunks of a streamed answer."
    )
    connect_retries: int = Field(
        2,
        ge=0,
        description="Other workers to try when a worker cannot be connected to (nothing was sent, "
        "so retrying is always safe).",
    )
    health_interval_s: float = Field(2.0, gt=0, description="Between two health checks.")
    health_timeout_s: float = Field(2.0, gt=0, description="One health check, /health + models.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: LogFormat = Field("json", description="json lines, or console for people.")

    _split_workers = field_validator("workers", mode="before")(_split_csv)

    @field_validator("workers")
    @classmethod
    def _normalise_urls(cls, urls: list[str]) -> list[str]:
        normalised = []
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https://: {url!r}")
            normalised.append(url.rstrip("/"))
        return normalised
