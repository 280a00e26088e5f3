"""Workers behind DNS names: a Kubernetes headless Service or a compose service with replicas.

Each name is resolved every `interval_s`; every address it returns becomes a worker URL
(`http://10.0.0.7:30001`), and addresses that disappear are removed from routing (requests already
there finish normally: removal only stops new ones). A failed lookup changes nothing, so a DNS
hiccup never empties the worker set.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from mineru_gateway.periodic import Periodic
from mineru_gateway.workers.registry import WorkerRegistry

log = structlog.get_logger("mineru_gateway.discovery")


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """`http://name:port` whose name may resolve to many addresses."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> DnsTarget:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {url!r}")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, parts.port or default)

    def url_for(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"


async def resolve(target: DnsTarget) -> set[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    return {target.url_for(str(info[4][0])) for info in infos}


class DnsDiscovery:
    """Keeps the registry's workers in step with what the DNS names resolve to."""

    def __init__(
        self, registry: WorkerRegistry, urls: Iterable[str], *, interval_s: float = 5.0
    ) -> None:
        self._registry = registry
        self._targets = [DnsTarget.parse(url) for url in urls]
        self._known: dict[DnsTarget, set[str]] = {target: set() for target in self._targets}
        self._loop = Periodic("dns-discovery", interval_s, self.refresh)

    async def refresh(self) -> None:
        for target in self._targets:
            try:
                found = await resolve(target)
            except OSError as error:
                log.warning("dns_lookup_failed", host=target.host, error=str(error))
                continue
            await self._apply(target, found)

    async def _apply(self, target: DnsTarget, found: set[str]) -> None:
        known = self._known[target]
        for url in sorted(found - known):
            log.info("worker_discovered", worker=url, name=target.host)
            await self._registry.checks.check(self._registry.membership.add(url))
        for url in sorted(known - found):
            self._registry.membership.remove(url)
            log.info("worker_gone", worker=url, name=target.host)
        self._known[target] = found

    async def start(self) -> None:
        await self.refresh()
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
