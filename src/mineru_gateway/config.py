"""The gateway's settings: one frozen model, and the only code that reads the environment.

Every setting can be given as a `MINERU_GATEWAY_<NAME>` environment variable or as the matching
`--<name>` flag of `mineru-gateway serve` (flags win). Lists take comma-separated values; tenants
take JSON, or a TOML/JSON file (`tenants_file`), read here too. Key files and the tenants file
are read when settings are built and again whenever they change on disk (reload.py): what they
hold is a `Credentials` snapshot, swapped whole (docs/usage.md, "Reloading keys and tenants").
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from mineru_gateway.routing import RoutingPolicyName

LogFormat = Literal["json", "console"]

DEFAULT_PORT = 30000  # the port MinerU's clients already use (docs/mineru-client.md)
MIB = 1024 * 1024

Platform = Literal["ascend", "cpu"]
ModelSource = Literal["huggingface", "modelscope", "local"]
DEFAULT_WORKER_BASE_PORT = 30001  # the gateway keeps 30000, the port MinerU's clients use
DEFAULT_HCCL_BASE_PORT = 61000
HCCL_PORT_STRIDE = 64
HCCL_MAX_BASE_PORT = 65520  # CANN's documented upper bound for HCCL_IF_BASE_PORT
DEFAULT_MAX_QUEUED_BYTES = 2048 * MIB
# Where the kernel states the container's memory limit: cgroup v2's file, then cgroup v1's (an
# unlimited v1 group reads as a huge number). Without MAX_QUEUED_BYTES the queue may hold a
# quarter of that limit, so that a queue full of page images is answered 429 long before the
# container is killed for its memory (docs/deploy/kubernetes.md, "Memory and the gateway's
# queue").
CGROUP_MEMORY_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)
QUEUED_SHARE_OF_MEMORY_LIMIT = 4  # the queue's bytes: at most a quarter of the memory limit


def memory_limit(files: tuple[Path, ...] = CGROUP_MEMORY_LIMIT_FILES) -> int | None:
    """The container's memory limit in bytes from the first of `files` that exists; None
    when it has none (`max`) or no file says."""
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else None  # `max`: no limit
    return None


def default_max_queued_bytes(files: tuple[Path, ...] = CGROUP_MEMORY_LIMIT_FILES) -> int:
    """MAX_QUEUED_BYTES when it is not set: a quarter of the memory limit, at most
    DEFAULT_MAX_QUEUED_BYTES."""
    limit = memory_limit(files)
    if limit is None:
        return DEFAULT_MAX_QUEUED_BYTES
    return min(DEFAULT_MAX_QUEUED_BYTES, limit // QUEUED_SHARE_OF_MEMORY_LIMIT)


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _json_object(value: Any) -> Any:
    if isinstance(value, str):
        return json.loads(value) if value.strip() else {}
    return value


class TenantConfig(BaseModel):
    """One tenant of the flow control (docs/flow-control.md): its API keys, its share and its
    limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: list[str] = Field(default_factory=list, description="API keys that are this tenant.")
    key_files: list[Path] = Field(
        default_factory=list,
        description="Files holding more of its keys, one per line (Docker/Kubernetes secrets).",
    )
    weight: float = Field(1.0, gt=0, description="Share of the fleet against other tenants.")
    priority: int = Field(0, description="Priority of requests that name none (lower first).")
    min_priority: int | None = Field(
        None,
        description="The most urgent priority its requests may ask for; default: `priority` "
        "(a tenant may mark work as background, not jump ahead of others).",
    )
    max_queued: int | None = Field(None, ge=0, description="Requests it may have queued.")
    max_queued_bytes: int | None = Field(None, ge=0, description="Bytes it may have queued.")
    max_in_flight: int | None = Field(None, ge=1, description="Requests it may have on workers.")

    def all_keys(self) -> list[str]:
        return [*self.keys, *read_key_files(self.key_files)]


def read_key_files(paths: list[Path]) -> list[str]:
    """Keys from files, one per line; blank lines and `#` comments skipped."""
    keys = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                keys.append(line.strip())
    return keys


def read_tenants_file(path: Path) -> dict[str, TenantConfig]:
    """`[tenants.NAME]` tables of a TOML file, or a JSON object `{"NAME": {...}}`."""
    text = path.read_text()
    raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text).get("tenants", {})
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: tenants must be a table/object of tenant names")
    return {name: TenantConfig.model_validate(table) for name, table in raw.items()}


@dataclass(frozen=True, slots=True)
class Credentials:
    """What the key files and the tenants file said at one reading: replaced whole on reload,
    so a reader sees one reading or the next, never a mix."""

    tenant_configs: dict[str, TenantConfig]
    tenant_keys: dict[str, tuple[str, ...]]
    client_keys: tuple[str, ...]
    admin_keys: tuple[str, ...]


def read_credentials(settings: GatewaySettings) -> Credentials:
    """Reads every key file and the tenants file; raises ValueError or OSError on a bad one."""
    from_file = read_tenants_file(settings.tenants_file) if settings.tenants_file else {}
    configs = from_file | dict(settings.tenants)
    tenant_keys = {name: tuple(config.all_keys()) for name, config in configs.items()}
    client_keys = (*settings.api_keys, *read_key_files(settings.api_key_files))
    admin_keys = (*settings.admin_keys, *read_key_files(settings.admin_key_files))
    if set(client_keys).union(*tenant_keys.values()) & set(admin_keys):
        raise ValueError("admin_keys must differ from every client key (api_keys, tenants)")
    return Credentials(configs, tenant_keys, client_keys, admin_keys)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to, others may reach it
        return False


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
    worker_dns: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Worker URLs whose host name is resolved every dns_interval_s; each address "
        "becomes a worker (a Kubernetes headless Service, say: http://mineru-worker:30001).",
    )
    dns_interval_s: float = Field(5.0, gt=0, description="Between two lookups of worker_dns.")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="When set, /v1/* requires `Authorization: Bearer <one of these>` (MinerU's "
        "client sends $MINERU_VL_API_KEY). Health, readiness and metrics stay open.",
    )
    allow_no_auth: bool = Field(
        False,
        description="Serve /v1/* without API keys on an address other than loopback (a trusted "
        "network only). Without keys and without this, the gateway refuses to start there.",
    )
    worker_api_key: str | None = Field(
        None,
        description="Bearer key for the workers (vLLM --api-key); by default the client's "
        "Authorization header is passed through when no api_keys are set.",
    )
    routing_policy: RoutingPolicyName = Field(
        "queue",
        description="How a worker is chosen: queue (least estimated load from the gateway's own "
        "requests and the workers' reported queues), p2c (the better of two random workers by "
        "the same score), least_inflight, round_robin.",
    )
    load_interval_s: float = Field(
        0.2, gt=0, description="Between two reads of each worker's /metrics (its vLLM queue)."
    )
    stale_after_s: float = Field(
        1.0,
        gt=0,
        description="Worker queue figures older than this are ignored for routing (at least two "
        "read periods, when the GET budget stretches them).",
    )
    max_worker_gets_per_s: float = Field(
        5.6,
        gt=0,
        description="GETs per second each worker answers from the whole gateway deployment: "
        "/health, /v1/models every 30 s, and /metrics reads with what is left, so "
        "load_interval_s is stretched to fit. One process of each replica reads and probes for "
        "all; with fleet_state on, the replicas it counts share the budget, else each replica "
        "takes all of it. The default is what one replica needs to read a small fleet every "
        "load_interval_s (0.2 s) and probe it every health_interval_s (2 s); with many "
        "workers max_fleet_gets_per_s bounds each worker's share far below it "
        "(docs/operate/fleet-scale.md).",
    )
    max_fleet_gets_per_s: float = Field(
        200.0,
        gt=0,
        description="GETs per second this gateway sends to all its workers together, half for "
        "probes and half for load reads: with many workers each is read and probed less often, "
        "so the gateway's idle CPU stays bounded (docs/operate/fleet-scale.md).",
    )
    routing_sample: int = Field(
        8,
        ge=2,
        description="Workers with room a routing decision draws at random and the policy "
        "chooses among (power of d choices); a fleet no larger is looked at whole.",
    )
    per_worker_metrics: bool | None = Field(
        None,
        description="Label the request, latency, token and routing series of /metrics by worker "
        "too. Unset: while the gateway has at most 64 workers. Off: one series for all workers "
        '(worker=""), and per worker only health, in-flight, queue and ejections, so /metrics '
        "stays small with many workers (docs/operate/fleet-scale.md).",
    )
    kv_avoid_above: float = Field(
        0.95, gt=0, le=1, description="Workers whose KV cache is fuller are avoided when possible."
    )
    pace_weighting: bool = Field(
        False,
        description="Scale each worker's load by its reported inter-token latency against its "
        "peers'. Off by default: latency grows with load, so it counts load twice and lags; "
        "own in-flight counts already give a slower NPU less (README, Routing evidence).",
    )
    waiting_weight: float = Field(
        1.0,
        ge=0,
        description="Routing cost of each request a worker reports waiting, in running-batch "
        "slots, on top of the slot it will hold (vLLM's own DP balancer uses 4*waiting+running).",
    )
    prefill_weight: float = Field(
        0.001,
        ge=0,
        description="Routing cost of a prompt token until the answer's first byte, in "
        "running-batch slots (a 1036x1036 page is ~1.4).",
    )
    decode_weight: float = Field(
        0.0, ge=0, description="Routing cost of an expected answer token, in batch slots."
    )
    default_decode_tokens: float = Field(
        256, gt=0, description="Expected answer length before one is learnt for a request class."
    )
    max_body_bytes: int = Field(
        64 * MIB,
        gt=0,
        description="Largest accepted request body; larger ones get 413. Page images travel as "
        "base64 inside the JSON body, so this bounds the image size a client can send.",
    )
    max_header_bytes: int = Field(
        32 * 1024, gt=0, description="Largest total size of a request's headers; past it 431."
    )
    max_headers: int = Field(100, gt=0, description="Most headers a request may carry; 431.")
    max_json_depth: int = Field(64, gt=0, description="Deepest nesting of a request body; 400.")
    max_messages: int = Field(1024, gt=0, description="Most messages in a chat request; 400.")
    max_content_parts: int = Field(
        1024, gt=0, description="Most content parts in all of a chat request's messages; 400."
    )
    max_images: int = Field(
        32, gt=0, description="Most images (and other media) in one request; 400."
    )
    max_image_pixels: int = Field(
        89_478_485,
        gt=0,
        description="Most pixels of one image, read from its header, not decoded (PIL's own "
        "decompression-bomb threshold); 400.",
    )
    max_image_side: int = Field(32768, gt=0, description="Longest side of one image; 400.")
    max_image_aspect: float = Field(
        200.0,
        gt=1,
        description="Longest ratio of an image's sides (Qwen2-VL's processor refuses past "
        "200); 400.",
    )
    max_tokens_limit: int | None = Field(
        None,
        gt=0,
        description="Optional ceiling on a request's max_tokens / max_completion_tokens; 400.",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve /metrics on this port only (not on the client port), so tenants "
        "cannot read it; unset: /metrics on the client port.",
    )
    metrics_host: str | None = Field(
        None, description="Where the metrics listener binds; unset: the gateway's host."
    )
    head_timeout_s: float = Field(
        10.0,
        gt=0,
        description="From a request head's first byte to its end; a client slower than that "
        "gets 408 and is disconnected (nginx's client_header_timeout).",
    )
    body_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest silence within a request body the gateway waits for; past it 408 "
        "and the request is dropped (nginx's client_body_timeout).",
    )
    keep_alive_timeout_s: float = Field(
        30.0,
        gt=5,
        description="An idle client connection is closed after this long. Above 5 s: MinerU's "
        "client drops idle connections after 5 s itself, and must be the one to do it, or it "
        "may send a request on a connection the gateway is closing.",
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
    max_retries: int = Field(
        2,
        ge=0,
        description="Other workers to try when a worker cannot be reached or drops a request "
        "before any byte of its answer reached the client.",
    )
    eject_after: int = Field(
        3,
        ge=1,
        description="Consecutive failures (5xx, dropped connections) that take a worker out of "
        "routing until its next good health check; a refused connection ejects at once.",
    )
    busy_hold_s: float = Field(
        1.0,
        gt=0,
        description="A worker that refuses a request because its own vLLM queue is full "
        "(--max-num-queued-reqs or --max-num-queued-tokens: a 503) takes no requests for this "
        "long; the request goes to another worker or waits in the gateway's queue, and the "
        "worker is never ejected for it.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM/SIGINT: new requests get 503 and /ready turns 503 at once; "
        "requests in flight get this long to finish before they are cut.",
    )
    health_interval_s: float = Field(2.0, gt=0, description="Between two health checks.")
    health_timeout_s: float = Field(2.0, gt=0, description="One health check, /health + models.")
    slow_probes_to_eject: int = Field(
        3,
        ge=1,
        description="Health checks in a row that time out before a worker is taken out of "
        "routing (a worker busy with a full batch answers /health late); a refused connection "
        "or an error answer takes it out at once.",
    )
    media_urls: Literal["data", "allowlist", "any"] = Field(
        "data",
        description="Media URLs requests may carry (vLLM fetches them itself): data (inline "
        "data: URLs only), allowlist (plus media_allowlist), any.",
    )
    media_allowlist: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts (docs.example.com) or URL prefixes (https://cdn.example.com/pages/) "
        "media URLs may name when media_urls is allowlist.",
    )
    api_key_files: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Files holding more API keys, one per line (Docker/Kubernetes secrets).",
    )
    admin_key_files: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="Files holding more admin keys, one per line."
    )
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Keys for what changes the gateway (POST/DELETE /v1/workers); distinct "
        "from api_keys. Without them those endpoints are off (403).",
    )
    flow_control: bool = Field(
        True,
        description="Hold requests in the gateway's own fair queue until a worker has room "
        "(backpressure, fair sharing between API keys, priorities); off: forward at once.",
    )
    tenants: Annotated[dict[str, TenantConfig], NoDecode] = Field(
        default_factory=dict,
        description='Named tenants as JSON: {"batch": {"keys": ["k1"], "weight": 1, '
        '"priority": 0, "max_queued": 2000, "max_in_flight": 200}}. Without them every '
        "API key is its own tenant with equal weight; without API keys there is one tenant.",
    )
    tenants_file: Path | None = Field(
        None,
        description="A TOML ([tenants.NAME] tables) or JSON file of tenants; `tenants` entries "
        "of the same name win. Their keys are accepted API keys too.",
    )
    tenant_max_queued: int | None = Field(
        None, ge=0, description="Queued requests a tenant without its own limit may have."
    )
    tenant_max_queued_bytes: int | None = Field(
        None, ge=0, description="Queued bytes a tenant without its own limit may have."
    )
    tenant_max_in_flight: int | None = Field(
        None, ge=1, description="Requests on workers a tenant without its own limit may have."
    )
    max_queued: int = Field(
        4096,
        ge=0,
        description="Requests the gateway queues in all; past it the newest request of the "
        "tenant holding most of the queue gets 429. A request back when its 429's Retry-After "
        "said counts as arriving when it first came, and may wait past this, up to twice it "
        "(docs/flow-control.md).",
    )
    max_queued_bytes: int = Field(
        DEFAULT_MAX_QUEUED_BYTES,
        ge=0,
        description="Request bytes the gateway queues in all (page images). Unset: a quarter "
        "of the container's cgroup memory limit, at most this default "
        "(docs/deploy/kubernetes.md).",
    )
    max_queue_wait_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait in the gateway's queue before 429 (MinerU's client gives up "
        "after 600 s and sends again).",
    )
    batch_limit: int | None = Field(
        None,
        ge=1,
        description="Each worker's running batch (vLLM --max-num-seqs); learnt from the workers' "
        "metrics when unset (256, vLLM's default, until then).",
    )
    batch_headroom: float = Field(
        0.0,
        ge=0,
        description="Requests allowed to wait on a worker beyond its batch, as a share of it, on "
        "top of batch_headroom_min. What waits there is served first-come by the worker, ahead "
        "of other tenants, and beyond a few requests it buys no throughput (docs/flow-control.md).",
    )
    batch_headroom_min: int = Field(
        2,
        ge=0,
        description="The least headroom, in requests, whatever the batch size: a freed slot is "
        "refilled from the worker's own queue while the gateway's next request is on its way.",
    )
    batch_reserve: int = Field(
        2,
        ge=0,
        description="Of each worker's batch plus headroom, the last requests' room is kept for "
        "tenants (and, inside a tenant, documents) below their share: their next request starts "
        "at the worker's next step however full another keeps the batches "
        '(docs/flow-control.md, "Interactive work under floods").',
    )
    pass_priority: bool = Field(
        False,
        description="Forward each request's effective priority to the workers (start them with "
        "vLLM's --scheduling-policy priority; its default fcfs ignores the field). Off: the "
        "gateway orders by priority itself and removes a non-zero one, so that a client's own "
        "priority never reorders a worker's queue past the gateway's fair share.",
    )
    priority_header: str = Field(
        "x-priority", description="Header a client may set its priority in (lower first)."
    )
    document_header: str = Field(
        "x-document-id",
        description="Header naming the document a request belongs to: inside a tenant, "
        "documents share its turns, the least served first (docs/flow-control.md).",
    )
    max_flows_per_tenant: int = Field(
        64,
        ge=1,
        description="Documents a tenant's queue tells apart; past it, a new document's "
        "requests join the tenant's requests without a document id (never refused).",
    )
    order_steps: bool = Field(
        True,
        description="Inside a document, MinerU's block requests go ahead of its new layout "
        "requests: pages started finish before new ones start.",
    )
    coalesce: bool = Field(
        True,
        description="Identical greedy requests in flight share one generation: one worker "
        "request, every client the whole answer (non-streamed requests; docs/cache.md).",
    )
    cache: str = Field(
        "off",
        description="Answers of greedy requests kept for the next identical request: off, "
        "memory (this process, an LRU bounded by cache_max_bytes) or redis://HOST:PORT/DB "
        "(shared by every process and replica). docs/cache.md.",
    )
    cache_ttl_s: float = Field(86400.0, gt=0, description="How long a cached answer is kept.")
    cache_max_bytes: int = Field(
        512 * MIB, gt=0, description="Bytes of answers the memory cache holds in all."
    )
    cache_tenant_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of cache_max_bytes one tenant's answers may hold in the memory "
        "cache; past it the tenant's own oldest answers go (docs/cache.md).",
    )
    cache_max_entry_bytes: int = Field(
        1 * MIB, gt=0, description="Largest answer the cache keeps (larger ones are not kept)."
    )
    cache_scope: Literal["tenant", "shared"] = Field(
        "tenant",
        description="tenant: a tenant's cached and coalesced answers serve only that tenant; "
        "shared: identical requests of any tenants share them.",
    )
    cache_redis_timeout_s: float = Field(
        0.05,
        gt=0,
        description="Longest wait for Redis per read or write; past it the read is a miss.",
    )
    fleet_state: str = Field(
        "off",
        description="Where tenants' in-flight limits are counted: off (each replica alone) or "
        "redis://HOST:PORT/DB, shared by every replica; not the cache's Redis by "
        "default (docs/operate/fleet-state.md).",
    )
    fleet_state_timeout_s: float = Field(
        0.05,
        gt=0,
        description="Longest wait for Redis per admission; past it the replica counts alone "
        "until Redis answers again.",
    )
    fleet_state_lease_s: float = Field(
        30.0,
        gt=0,
        description="A slot's lease in Redis, renewed while its request lasts: a crashed "
        "replica's slots free after it.",
    )
    fleet_state_poll_s: float = Field(
        0.05,
        gt=0,
        description="How often requests waiting for a tenant's slot (at its fleet-wide limit) "
        "ask Redis again.",
    )
    fleet_state_share_s: float = Field(
        0.25,
        gt=0,
        description="How often each replica shares its tenants' queued and in-flight counts "
        "through Redis and reads the other replicas': their queue limits may be passed by what "
        "other replicas queued within it.",
    )
    npu_smi: str = Field(
        "auto",
        description="NPU telemetry in /metrics: auto (npu-smi where installed, none without "
        "it), off, or npu-smi's path.",
    )
    npu_exporter_names: bool = Field(
        True,
        description="Also export the NPU readings under Ascend npu-exporter's names "
        "(npu_chip_info_*); false where Ascend's exporter runs too, or each chip counts twice.",
    )
    npu_smi_interval_s: float = Field(5.0, gt=0, description="Between two npu-smi readings.")
    npu_devices: str = Field(
        "",
        description="Which worker uses which NPU, for the NPU metrics: 0=http://w0:30001,1=...",
    )
    tracing: bool = Field(
        False,
        description="Send OpenTelemetry spans of every request (OTLP, configured by the "
        "standard OTEL_* variables: OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER, ...). "
        "OTEL_EXPORTER_OTLP_ENDPOINT alone does not turn it on. Off or on, a client's "
        "traceparent reaches the workers (docs/tracing.md).",
    )
    reload_interval_s: float = Field(
        2.0,
        gt=0,
        le=5,
        description="Between two looks at api_key_files, admin_key_files, tenants_file and the "
        "tenants' key files: a change seen by two looks in a row takes effect, without a "
        "restart (docs/usage.md).",
    )
    usage_prometheus_url: str | None = Field(
        None,
        description="The Prometheus that scrapes the gateway (http://prometheus:9090): with it, "
        "GET /v1/usage?start=&end= answers for a time range (docs/usage.md).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: LogFormat = Field("json", description="json lines, or console for people.")

    _split_lists = field_validator(
        "workers",
        "worker_dns",
        "api_keys",
        "media_allowlist",
        "admin_keys",
        "api_key_files",
        "admin_key_files",
        mode="before",
    )(_split_csv)
    _tenants_json = field_validator("tenants", mode="before")(_json_object)
    _credentials: Credentials = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _queued_bytes_within_memory(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("max_queued_bytes") is not None:
            return data
        return {**data, "max_queued_bytes": default_max_queued_bytes()}

    def model_post_init(self, context: Any) -> None:
        self._credentials = read_credentials(self)

    def reload_credentials(self) -> Credentials:
        """Reads the key files and the tenants file again and, when they are good, makes them
        the settings' from now on (one assignment: readers see the old or the new, whole).
        Raises ValueError or OSError, keeping the old, when they are not."""
        credentials = read_credentials(self)
        self._credentials = credentials
        return credentials

    def credential_files(self) -> list[Path]:
        """The files `reload_credentials` reads: key files, the tenants file and the key files
        its tenants name."""
        files = [*self.api_key_files, *self.admin_key_files]
        if self.tenants_file is not None:
            files.append(self.tenants_file)
        for config in self._credentials.tenant_configs.values():
            files.extend(config.key_files)
        return files

    @property
    def credentials(self) -> Credentials:
        """The key files' and tenants file's current reading."""
        return self._credentials

    def open_access_refusal(self) -> str | None:
        """Why the gateway must not start: no client key at all on an address others reach,
        without `allow_no_auth`; None when it may."""
        credentials = self._credentials
        keyed = credentials.client_keys or any(credentials.tenant_keys.values())
        if keyed or self.allow_no_auth or _is_loopback(self.host):
            return None
        return (
            f"no API keys, and {self.host} is reachable from other hosts: set "
            "MINERU_GATEWAY_API_KEYS (or API_KEY_FILES, or tenants' keys), or "
            "MINERU_GATEWAY_ALLOW_NO_AUTH=true on a trusted network"
        )

    @property
    def tenant_keys(self) -> dict[str, tuple[str, ...]]:
        """Each named tenant's keys, its `keys` and the contents of its `key_files`."""
        return dict(self._credentials.tenant_keys)

    @property
    def client_keys(self) -> tuple[str, ...]:
        """`api_keys` and the keys in `api_key_files` (tenants' own keys not included)."""
        return self._credentials.client_keys

    @property
    def all_admin_keys(self) -> tuple[str, ...]:
        return self._credentials.admin_keys

    @property
    def tenant_configs(self) -> dict[str, TenantConfig]:
        """Tenants from `tenants_file` and `tenants`, by name."""
        return dict(self._credentials.tenant_configs)

    @field_validator("cache")
    @classmethod
    def _cache_store(cls, store: str) -> str:
        if store in ("off", "memory") or store.startswith(("redis://", "rediss://", "unix://")):
            return store
        raise ValueError(f"cache must be off, memory or a redis:// URL, not {store!r}")

    @field_validator("fleet_state")
    @classmethod
    def _fleet_state(cls, where: str) -> str:
        if where == "off" or where.startswith(("redis://", "rediss://", "unix://")):
            return where
        raise ValueError(f"fleet_state must be off or a redis:// URL, not {where!r}")

    @field_validator("workers", "worker_dns")
    @classmethod
    def _normalise_urls(cls, urls: list[str]) -> list[str]:
        normalised = []
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https://: {url!r}")
            normalised.append(url.rstrip("/"))
        return normalised


class LauncherSettings(BaseSettings):
    """Worker settings that may come from `MINERU_GATEWAY_<NAME>` variables; flags win.

    The gateway's own settings live in `config.GatewaySettings`; these only shape workers.
    """

    model_config = SettingsConfigDict(
        env_prefix="MINERU_GATEWAY_", frozen=True, extra="ignore", populate_by_name=True
    )

    model: str | None = Field(None, description="Model directory or hub id vLLM serves.")
    model_source: ModelSource | None = Field(
        None,
        # MinerU's own variable is read too, as MinerU reads it.
        validation_alias=AliasChoices("MINERU_GATEWAY_MODEL_SOURCE", "MINERU_MODEL_SOURCE"),
        description="Where the weights come from: local (the model is a directory, which must "
        "hold config.json; no network), huggingface (a hub id, downloaded) or modelscope (a "
        "ModelScope id; also MINERU_MODEL_SOURCE, as MinerU reads it). Default: local for a "
        "path, huggingface for an id.",
    )
    served_model_name: str | None = Field(
        None, description="Name in /v1/models (default: the model directory's name)."
    )
    vllm_python: str = Field(
        sys.executable,
        description="Python interpreter with vLLM(-Ascend) installed (its own virtualenv here, "
        "the image's python3 in the worker image).",
    )
    platform: Platform = Field("ascend", description="ascend (NPUs) or cpu (vLLM's CPU build).")
    worker_host: str = Field("127.0.0.1", description="Address each worker listens on.")
    worker_base_port: int = Field(
        DEFAULT_WORKER_BASE_PORT, ge=1, le=65535, description="Worker N listens on base + N."
    )
    hccl_base_port: int = Field(
        DEFAULT_HCCL_BASE_PORT,
        ge=1024,
        le=HCCL_MAX_BASE_PORT,
        description=f"Worker N gets HCCL_IF_BASE_PORT = base + {HCCL_PORT_STRIDE} * N.",
    )
    mineru_logits_processor: bool | None = Field(
        None, description="Add MinerU's logits processor (default: when the model is MinerU)."
    )

    @field_validator("model_source", mode="before")
    @classmethod
    def _unset_when_empty(cls, value: Any) -> Any:
        return None if value == "" else value  # `${MINERU_MODEL_SOURCE:-}` in a compose file

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LauncherSettings:
        given = {
            name: value
            for name in cls.model_fields
            if (value := getattr(args, name, None)) is not None
        }
        return cls(**given)
