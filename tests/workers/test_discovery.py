"""DNS discovery: names become worker URLs, and lookups that fail change nothing."""

from __future__ import annotations

import pytest

from mineru_gateway.routing import RoundRobin
from mineru_gateway.workers.discovery import DnsDiscovery, DnsTarget
from mineru_gateway.workers.registry import HealthPolicy, WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient


@pytest.mark.parametrize(
    ("url", "target", "address", "worker"),
    [
        ("http://w:30001", DnsTarget("http", "w", 30001), "10.0.0.7", "http://10.0.0.7:30001"),
        ("https://w", DnsTarget("https", "w", 443), "10.0.0.7", "https://10.0.0.7:443"),
        ("http://w", DnsTarget("http", "w", 80), "fd00::7", "http://[fd00::7]:80"),
    ],
)
def test_targets_and_worker_urls(url: str, target: DnsTarget, address: str, worker: str) -> None:
    assert DnsTarget.parse(url) == target
    assert target.url_for(address) == worker


@pytest.mark.parametrize("url", ["ftp://w:1", "http://", "w:30001"])
def test_bad_targets_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        DnsTarget.parse(url)


async def test_a_failed_lookup_keeps_the_workers_it_had() -> None:
    client = UpstreamClient(Timeouts(1, 1, 1))
    await client.start()
    try:
        registry = WorkerRegistry(
            [],
            client,
            RoundRobin(),
            HealthPolicy(interval_s=60, timeout_s=0.5),
        )
        discovery = DnsDiscovery(registry, ["http://localhost:9"], interval_s=60)
        await discovery.refresh()
        found = {worker.url for worker in registry.membership.workers}
        assert "http://127.0.0.1:9" in found
        gone = DnsDiscovery(registry, ["http://no-such-host.invalid:9"], interval_s=60)
        await gone.refresh()
        assert {worker.url for worker in registry.membership.workers} == found
    finally:
        await client.close()
