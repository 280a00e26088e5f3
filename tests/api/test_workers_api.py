"""Workers at run time (admin API, DNS discovery) and API keys."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack

import httpx
import pytest

from mineru_gateway.api.app import create_app
from mineru_gateway.api.context import Lifecycle
from mineru_gateway.config import GatewaySettings
from mineru_gateway.entry.cli import main
from tests.conftest import StartGateway, StartSim
from tests.support.servers import serve
from tests.support.workers import Script, scripted_worker

CHAT = "/v1/chat/completions"
BODY = {"model": "echo-model", "messages": [{"role": "user", "content": "hi"}]}
ADMIN = {"authorization": "Bearer admin-key"}


def test_api_keys_guard_v1_but_not_health_or_metrics(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], api_keys="k1,k2")
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"}):
        response = httpx.post(gateway + CHAT, json=BODY, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gateway + "/v1/models").status_code == 401
    assert httpx.get(gateway + "/v1/workers").status_code == 401
    assert script.seen == []
    good = {"authorization": "Bearer k2"}
    assert httpx.post(gateway + CHAT, json=BODY, headers=good).status_code == 200
    assert httpx.get(gateway + "/v1/models", headers=good).status_code == 200
    assert "authorization" not in script.seen[-1]["headers"]  # a gateway key stays here
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx.get(gateway + open_path).status_code == 200


def test_workers_get_their_own_key(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], api_keys="k", worker_api_key="wk")
    httpx.post(gateway + CHAT, json=BODY, headers={"authorization": "Bearer k"})
    assert script.seen[-1]["headers"]["authorization"] == "Bearer wk"


def test_workers_can_be_added_and_removed_at_run_time(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    first = start_sim(model_name="m", time_scale=1.0)
    second = start_sim(model_name="m", time_scale=1.0)
    gateway = start_gateway([first], admin_keys="admin-key")
    added = httpx.post(gateway + "/v1/workers", json={"url": second}, headers=ADMIN)
    assert added.status_code == 201
    states = {w["url"]: w["state"] for w in added.json()["workers"]}
    assert states == {first: "healthy", second: "healthy"}

    # A long stream on `first`, then `first` is removed: the stream still completes.
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    body |= {"max_tokens": 30, "ignore_eos": True}
    with httpx.stream("POST", first + CHAT, json=body) as warm:
        warm.read()  # sanity: the worker answers directly
    httpx.post(gateway + "/v1/workers", json={"url": first}, headers=ADMIN)  # no change
    with httpx.stream("POST", gateway + CHAT, json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)
        for url in (second, first):
            removed = httpx.request(
                "DELETE", gateway + "/v1/workers", json={"url": url}, headers=ADMIN
            )
        assert [w["url"] for w in removed.json()["workers"]] == []
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert httpx.post(gateway + CHAT, json=body | {"stream": False}).status_code == 503


def test_bad_worker_changes_are_400(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _, worker = scripted
    gateway = start_gateway([worker], admin_keys="admin-key")
    for payload in ({"url": "ftp://x"}, {}, {"url": "http://h:1/path"}):
        response = httpx.post(gateway + "/v1/workers", json=payload, headers=ADMIN)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "url"


def test_changing_workers_needs_an_admin_key_distinct_from_client_keys(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    """A client key must not add its own server and receive other tenants' requests."""
    _, worker = scripted
    off = start_gateway([worker], api_keys="client")
    response = httpx.post(
        off + "/v1/workers",
        json={"url": "http://evil:1"},
        headers={"authorization": "Bearer client"},
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "admin_disabled"
    guarded = start_gateway([worker], api_keys="client", admin_keys="admin-key")
    for headers in ({}, {"authorization": "Bearer client"}, {"authorization": "Bearer nope"}):
        for method in ("POST", "DELETE"):
            response = httpx.request(
                method, guarded + "/v1/workers", json={"url": worker}, headers=headers
            )
            assert response.status_code == 403, (method, headers)
            assert response.json()["error"]["type"] == "permission_error"
    listing = httpx.get(guarded + "/v1/workers", headers={"authorization": "Bearer client"})
    assert [w["url"] for w in listing.json()["workers"]] == [worker]  # nothing changed
    assert httpx.post(guarded + "/v1/workers", json={"url": worker}, headers=ADMIN).is_success


def test_admin_keys_must_differ_from_client_keys() -> None:
    with pytest.raises(ValueError, match="admin_keys must differ"):
        GatewaySettings(api_keys="k1,k2", admin_keys="k2")


def test_workers_found_through_dns(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    port = worker.rsplit(":", 1)[1]
    gateway = start_gateway([], worker_dns=f"http://localhost:{port}", dns_interval_s=0.2)
    described = httpx.get(gateway + "/v1/workers").json()["workers"]
    assert f"http://127.0.0.1:{port}" in {w["url"] for w in described if w["state"] == "healthy"}
    assert httpx.post(gateway + CHAT, json=BODY).status_code == 200
    assert len(script.seen) == 1


def test_a_draining_gateway_admits_nothing_new(scripted: tuple[Script, str]) -> None:
    script, worker = scripted
    lifecycle = Lifecycle()
    settings = GatewaySettings(workers=[worker], port=0, log_level="warning")
    with serve(create_app(settings, lifecycle)) as gateway:
        assert httpx.post(gateway + CHAT, json=BODY).status_code == 200
        assert httpx.get(gateway + "/ready").status_code == 200
        lifecycle.start_draining()
        refused = httpx.post(gateway + CHAT, json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(gateway + "/ready").json()["error"]["code"] == "shutting_down"
        assert httpx.get(gateway + "/health").status_code == 200
    assert len(script.seen) == 1


# -- draining, and what only `up` can do -------------------------------------------------------


def sim_successes(worker: str) -> float:
    text = httpx.get(worker + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_a_drained_worker_gets_nothing_new_until_it_is_undrained(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    first, second = start_sim(model_name="m"), start_sim(model_name="m")
    gateway = start_gateway([first, second], admin_keys="admin-key", routing_policy="round_robin")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    drained = httpx.post(gateway + "/v1/workers/drain", json={"url": first}, headers=ADMIN)
    assert drained.status_code == 200
    states = {w["url"]: w["state"] for w in drained.json()["workers"]}
    assert states == {first: "draining", second: "healthy"}
    for _ in range(6):
        assert httpx.post(gateway + CHAT, json=body).status_code == 200
    assert (sim_successes(first), sim_successes(second)) == (0, 6)
    undrained = httpx.post(gateway + "/v1/workers/undrain", json={"url": first}, headers=ADMIN)
    assert {w["state"] for w in undrained.json()["workers"]} == {"healthy"}
    for _ in range(6):
        assert httpx.post(gateway + CHAT, json=body).status_code == 200
    assert sim_successes(first) >= 1


def test_draining_needs_an_admin_key_and_a_known_worker(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _, worker = scripted
    gateway = start_gateway([worker], admin_keys="admin-key")
    refused = httpx.post(gateway + "/v1/workers/drain", json={"url": worker})
    assert refused.status_code == 403
    unknown = httpx.post(gateway + "/v1/workers/drain", json={"url": "http::/x:1"}, headers=ADMIN)
    assert unknown.status_code == 400  # not a URL
    unknown = httpx.post(gateway + "/v1/workers/drain", json={"url": "http://x:1"}, headers=ADMIN)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "unknown_worker"


def test_a_rolling_restart_needs_a_gateway_that_runs_its_workers(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _, worker = scripted
    gateway = start_gateway([worker], admin_keys="admin-key")
    for method in ("POST", "GET"):
        response = httpx.request(method, gateway + "/v1/workers/restart", json={}, headers=ADMIN)
        assert response.status_code == 409
        error = response.json()["error"]
        assert error["code"] == "not_supervised"
        assert "/v1/workers/drain" in error["message"]


def workers_command(*args: str) -> tuple[int, str]:
    """`mineru-gateway workers ...` as an operator runs it: its exit status and its output."""
    done = subprocess.run(
        [sys.executable, "-m", "mineru_gateway", "workers", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout


def test_the_workers_command_drains_lists_and_undrains(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(model_name="m")
    gateway = start_gateway([worker], api_keys="client", admin_keys="admin-key")
    base = ["--gateway", gateway, "--admin-key", "admin-key"]
    status, out = workers_command(*base, "drain", worker)
    assert (status, json.loads(out)) == (0, {"url": worker, "in_flight": 0, "idle": True})
    status, out = workers_command(*base, "list")  # an admin key reads what a client key may
    assert (status, [w["state"] for w in json.loads(out)["workers"]]) == (0, ["draining"])
    status, out = workers_command(*base, "undrain", worker)
    assert (status, json.loads(out)["workers"][0]["state"]) == (0, "healthy")
    status, out = workers_command(*base, "restart")  # `serve` runs no workers
    assert (status, json.loads(out)["error"]["code"]) == (1, "not_supervised")
    assert main(["workers", "--gateway", gateway, "drain", worker]) == 1  # no admin key
    assert main(["workers", "--gateway", "http://127.0.0.1:9", "list"]) == 2  # nobody there


def test_a_model_whose_workers_are_all_ejected_gets_503_and_one_never_served_404(
    scripted: tuple[Script, str], servers: ExitStack, start_gateway: StartGateway
) -> None:
    """The only worker serving a model fails and is ejected while another worker serves
    another model: the model exists, it has no healthy worker now (503 with Retry-After, as
    when no worker at all is healthy). A model no worker was ever seen serving stays 404."""
    script, echo = scripted
    other = servers.enter_context(serve(scripted_worker(Script(model="other-model"))))
    # No probe in the test's time: the worker stays out once ejected.
    gateway = start_gateway([echo, other], eject_after=1, health_interval_s=60)
    script.mode = "status"  # the worker answers 500: one failure ejects it
    assert httpx.post(gateway + CHAT, json=BODY).status_code == 500
    states = {w["url"]: w["state"] for w in httpx.get(gateway + "/v1/workers").json()["workers"]}
    assert states == {echo: "unhealthy", other: "healthy"}

    unavailable = httpx.post(gateway + CHAT, json=BODY)
    assert unavailable.status_code == 503
    error = unavailable.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "no_healthy_worker")
    assert "echo-model" in error["message"]
    assert int(unavailable.headers["retry-after"]) >= 1

    never = httpx.post(gateway + CHAT, json=BODY | {"model": "never-served"})
    assert never.status_code == 404
    assert never.json()["error"]["code"] == "model_not_found"
    assert "retry-after" not in never.headers
