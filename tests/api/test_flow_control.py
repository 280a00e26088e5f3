"""Flow control end to end: a real gateway on uvicorn over real workers (scripted or simulated).

Scripted workers in `hang` mode hold their requests until the client leaves, so what the gateway
queues and refuses is exact; simulated workers finish requests, so order can be observed.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import pytest

from mineru_gateway.testing import free_port
from tests.conftest import StartGateway, StartSim
from tests.support.servers import CliProcess, wait_until
from tests.support.workers import Script

CHAT = "/v1/chat/completions"
# batch_limit 1 and the minimum headroom of 2: three requests fit on a worker. Tests that count
# on it turn the reserve off (`batch_reserve` 0): with it, a lone tenant leaves the headroom free.
HOLD = 3


def chat(**extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, **extra}


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


def queue_depths(gateway: str) -> dict[str, float]:
    """Queued requests per tenant, as the gateway's /metrics says."""
    text = httpx.get(gateway + "/metrics").text
    depths: dict[str, float] = {}
    for labels, value in re.findall(r"^mineru_gateway_queue_requests\{(.*)\} (\S+)$", text, re.M):
        tenant = re.search(r'tenant="([^"]*)"', labels)
        assert tenant is not None
        depths[tenant.group(1)] = depths.get(tenant.group(1), 0.0) + float(value)
    return depths


def queued(gateway: str, tenant: str | None = None) -> float:
    depths = queue_depths(gateway)
    return sum(depths.values()) if tenant is None else depths.get(tenant, 0.0)


async def wait_for(condition: object, limit_s: float = 10.0) -> None:
    """Polls `condition` (blocking HTTP calls) in a thread until it is true."""
    await asyncio.to_thread(wait_until, condition, limit_s, "condition")


async def test_past_a_tenants_queue_limit_it_gets_429_with_retry_after(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    script.mode = "hang"
    gateway = start_gateway(
        [worker],
        batch_limit=1,
        batch_reserve=0,
        api_keys="ka,kb",
        tenant_max_queued=2,
        max_queue_wait_s=60,
    )
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        held = [
            asyncio.create_task(client.post(CHAT, json=chat(), headers=key("ka")))
            for _ in range(HOLD + 2)
        ]
        await wait_for(lambda: (len(script.seen) == HOLD and queued(gateway) == 2) or None)
        refused = await client.post(CHAT, json=chat(), headers=key("ka"))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "tenant_queue_full")
        # The other key is a tenant of its own: its queue is empty, so it may wait.
        other = asyncio.create_task(client.post(CHAT, json=chat(), headers=key("kb")))
        await wait_for(lambda: queued(gateway) == 3 or None)
        assert len(queue_depths(gateway)) == 2  # two tenants, one per key
        assert not other.done()
        for task in [*held, other]:
            task.cancel()
        await asyncio.gather(*held, other, return_exceptions=True)
    await wait_for(lambda: queued(gateway) == 0 or None)
    # Every request that reached the worker was cancelled there (a freed slot may go to a
    # queued request whose client is leaving too: it is cancelled upstream as well).
    await wait_for(lambda: script.cancelled == len(script.seen) or None)


async def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    script.mode = "hang"
    gateway = start_gateway([worker], batch_limit=1, batch_reserve=0)
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        # The held requests reach the worker first: requests sent together reach the gateway in
        # any order, and the one cancelled below must be the one waiting in its queue.
        tasks = [asyncio.create_task(client.post(CHAT, json=chat())) for _ in range(HOLD)]
        await wait_for(lambda: len(script.seen) == HOLD or None)
        tasks.append(asyncio.create_task(client.post(CHAT, json=chat())))
        await wait_for(lambda: queued(gateway) == 1 or None)
        tasks[-1].cancel()
        await wait_for(lambda: queued(gateway) == 0 or None, limit_s=2)
        assert len(script.seen) == HOLD
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    text = (await asyncio.to_thread(httpx.get, gateway + "/metrics")).text
    never_sent = re.search(
        r'^mineru_gateway_requests_total\{[^}]*outcome="client_disconnected"[^}]*worker=""\} 1\.0$',
        text,
        re.M,
    )
    assert never_sent, "the request that left the queue is counted, with no worker"


async def test_one_tenants_flood_does_not_hold_up_another(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(max_num_seqs=4, time_scale=0.05)
    gateway = start_gateway([worker], api_keys="flood,small", batch_limit=4)
    finished: list[str] = []

    async def send(client: httpx.AsyncClient, who: str) -> None:
        response = await client.post(CHAT, json=chat(ignore_eos=True), headers=key(who))
        assert response.status_code == 200, response.text
        finished.append(who)

    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        flood = [asyncio.create_task(send(client, "flood")) for _ in range(60)]
        await wait_for(lambda: queued(gateway) > 30 or None)
        await send(client, "small")
        pending = sum(not task.done() for task in flood)
        await asyncio.gather(*flood)
    assert pending >= 30, f"the small tenant waited behind {60 - pending} of the flood's requests"
    assert finished.index("small") < 30


async def test_a_lower_priority_value_is_served_first(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(max_num_seqs=1, time_scale=0.5)  # ~0.15 s a request, one at a time
    gateway = start_gateway([worker], batch_limit=1)
    order: list[int] = []

    async def send(client: httpx.AsyncClient, priority: int) -> None:
        body = chat(ignore_eos=True, priority=priority)
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        order.append(priority)

    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        background = [asyncio.create_task(send(client, 10)) for _ in range(12)]
        await wait_for(lambda: queued(gateway) >= 6 or None)
        urgent = asyncio.create_task(send(client, 0))
        await asyncio.gather(*background, urgent)
    assert order.index(0) <= HOLD + 1  # behind what was already on the worker, no more


def test_with_no_healthy_worker_the_answer_is_503_with_retry_after(
    start_gateway: StartGateway,
) -> None:
    gateway = start_gateway([f"http://127.0.0.1:{free_port()}"])
    response = httpx.post(gateway + CHAT, json=chat())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_worker"
    assert int(response.headers["retry-after"]) >= 1


@pytest.mark.parametrize("stream", [False, True])
async def test_on_sigterm_queued_requests_get_503_before_the_drain_deadline(
    scripted: tuple[Script, str], stream: bool
) -> None:
    script, worker = scripted
    script.mode = "hang"
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    proc = CliProcess.mineru_gateway(
        "serve",
        "--port",
        str(port),
        "--workers",
        worker,
        "--batch-limit",
        "1",
        "--batch-reserve",
        "0",
        "--drain-timeout-s",
        "3",
        "--log-level",
        "warning",
    )
    proc.start()
    try:
        await wait_for(lambda: _ready(gateway), limit_s=20)
        async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
            tasks = [
                asyncio.create_task(client.post(CHAT, json=chat(stream=stream)))
                for _ in range(HOLD + 2)
            ]
            await wait_for(lambda: queued(gateway) == 2 or None)
            signalled = time.monotonic()
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks, return_exceptions=True)
        answered = [r for r in results if isinstance(r, httpx.Response) and r.status_code == 503]
        # the 2 queued ones before the deadline; the HOLD on the worker when uvicorn cuts them
        assert len(answered) == HOLD + 2, results
        assert all(r.json()["error"]["code"] == "shutting_down" for r in answered)
        assert time.monotonic() - signalled < 10
        assert proc.proc.wait(timeout=15) == 0
    finally:
        proc.stop()


def _ready(gateway: str) -> bool | None:
    try:
        return httpx.get(gateway + "/ready").status_code == 200 or None
    except httpx.TransportError:
        return None


async def test_a_document_sent_behind_another_of_the_same_key_goes_first(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(max_num_seqs=1, time_scale=0.5)  # ~0.15 s a request, one at a time
    gateway = start_gateway([worker], batch_limit=1, document_header="X-Doc")
    order: list[str] = []

    async def send(client: httpx.AsyncClient, document: str) -> None:
        body = chat(ignore_eos=True)
        response = await client.post(CHAT, json=body, headers={"x-doc": document})
        assert response.status_code == 200, response.text
        order.append(document)

    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        big = [asyncio.create_task(send(client, "big")) for _ in range(12)]
        await wait_for(lambda: queued(gateway) >= 6 or None)
        small = [asyncio.create_task(send(client, "small")) for _ in range(2)]
        await asyncio.gather(*big, *small)
    # Behind what was already on the worker, no more: the small document had no service yet
    # (and, below its share, it may take the room the worker keeps in reserve).
    assert order.index("small") <= HOLD + 1 and order[: HOLD + 3].count("small") == 2


async def test_documents_show_as_flows_per_tenant_never_as_labels(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    script.mode = "hang"
    gateway = start_gateway([worker], batch_limit=1, batch_reserve=0, max_queue_wait_s=60)
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        held = [asyncio.create_task(client.post(CHAT, json=chat())) for _ in range(HOLD)]
        await wait_for(lambda: len(script.seen) == HOLD or None)
        documents = ["report-2026.pdf", "report-2026.pdf", "invoice-17.pdf"]
        waiting = [
            asyncio.create_task(client.post(CHAT, json=chat(), headers={"X-Document-Id": d}))
            for d in documents
        ]
        await wait_for(lambda: queued(gateway) == 3 or None)
        text = (await asyncio.to_thread(httpx.get, gateway + "/metrics")).text
        # Two documents queued plus the requests without one on the worker.
        assert 'mineru_gateway_tenant_flows{tenant="default"} 3.0' in text
        assert 'mineru_gateway_queue_task_requests{task="other"} 3.0' in text
        assert "report-2026" not in text and "invoice-17" not in text
        too_long = await client.post(CHAT, json=chat(), headers={"X-Document-Id": "x" * 257})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["type"] == "invalid_request_error"
        for task in [*held, *waiting]:
            task.cancel()
        await asyncio.gather(*held, *waiting, return_exceptions=True)
    await wait_for(lambda: queued(gateway) == 0 or None)
