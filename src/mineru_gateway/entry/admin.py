"""`mineru-gateway workers ...`: an operator's client for a running gateway's admin endpoints.

    workers list                     each worker's state, in-flight requests and load
    workers drain URL                no new requests to URL; waits until it is idle (--no-wait)
    workers undrain URL              URL takes requests again
    workers restart [URL ...]        a rolling restart (`up` only): all workers, or these, one at
                                     a time; waits until it has finished (--no-wait)

The admin key comes from --admin-key or MINERU_GATEWAY_ADMIN_KEY (one of the gateway's
ADMIN_KEYS). Exit status: 0 done, 1 the gateway refused or the restart failed, 2 bad usage or
no gateway there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mineru_gateway.workers.http1 import ConnectFailed, Disconnected, Http1Pool, Malformed
from mineru_gateway.workers.upstream import KEEPALIVE_S

DEFAULT_GATEWAY = "http://127.0.0.1:30000"
POLL_S = 0.5
TIMEOUT_S = 30.0  # one call to the gateway, its connection included


def add_admin_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        default=os.environ.get("MINERU_GATEWAY_URL", DEFAULT_GATEWAY),
        help=f"the gateway's base URL [env MINERU_GATEWAY_URL; default {DEFAULT_GATEWAY}]",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("MINERU_GATEWAY_ADMIN_KEY"),
        help="one of the gateway's ADMIN_KEYS [env MINERU_GATEWAY_ADMIN_KEY]",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=3600.0, help="longest wait for a drain or a restart"
    )
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="each worker's state and load")
    for name, text in (("drain", "no new requests to URL"), ("undrain", "URL takes requests")):
        action = actions.add_parser(name, help=text)
        action.add_argument("url")
        if name == "drain":
            action.add_argument("--no-wait", action="store_true", help="do not wait until idle")
    restart = actions.add_parser("restart", help="rolling restart (up only)")
    restart.add_argument("urls", nargs="*", help="workers to restart (default: all)")
    restart.add_argument("--no-wait", action="store_true", help="return once it has started")


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Gateway:
    """A running gateway's admin API, over the gateway's own HTTP/1.1 client (workers/http1.py)."""

    def __init__(self, pool: Http1Pool, base_url: str, headers: dict[str, str]) -> None:
        self._pool = pool
        self._base = base_url.rstrip("/")
        self._headers = headers

    async def get(self, path: str) -> Reply:
        return await self._call("GET", path, b"", self._headers)

    async def post(self, path: str, payload: dict[str, Any]) -> Reply:
        headers = self._headers | {"content-type": "application/json"}
        return await self._call("POST", path, json.dumps(payload).encode(), headers)

    async def _call(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Reply:
        async with asyncio.timeout(TIMEOUT_S):
            answer = await self._pool.request(method, self._base + path, headers, body, TIMEOUT_S)
            try:
                data = answer.whole()
                if data is None:
                    data = await answer.read()
            finally:
                answer.close()
        return Reply(answer.status, data)


def run_admin(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    headers = {"authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    pool = Http1Pool(TIMEOUT_S, KEEPALIVE_S)
    try:
        return await _ACTIONS[args.action](Gateway(pool, args.gateway, headers), args)
    except (ConnectFailed, Disconnected, Malformed, TimeoutError, ValueError) as error:
        why = str(error) or type(error).__name__
        print(f"mineru-gateway workers: no answer from {args.gateway}: {why}", file=sys.stderr)
        return 2
    finally:
        pool.close()


async def _list(gateway: Gateway, args: argparse.Namespace) -> int:
    return _show(await gateway.get("/v1/workers"))


async def _drain(gateway: Gateway, args: argparse.Namespace) -> int:
    answer = await gateway.post("/v1/workers/drain", {"url": args.url})
    if answer.status != 200 or args.no_wait:
        return _show(answer)
    deadline = asyncio.get_running_loop().time() + args.timeout_s
    while (busy := _in_flight(answer.json(), args.url)) > 0 and _before(deadline):
        await asyncio.sleep(POLL_S)
        answer = await gateway.get("/v1/workers")
    print(json.dumps({"url": args.url, "in_flight": busy, "idle": busy == 0}))
    return 0 if busy == 0 else 1


async def _undrain(gateway: Gateway, args: argparse.Namespace) -> int:
    return _show(await gateway.post("/v1/workers/undrain", {"url": args.url}))


async def _restart(gateway: Gateway, args: argparse.Namespace) -> int:
    answer = await gateway.post("/v1/workers/restart", {"urls": args.urls or None})
    if answer.status != 202 or args.no_wait:
        return _show(answer, ok=202)
    deadline = asyncio.get_running_loop().time() + args.timeout_s
    while answer.json().get("state") == "running" and _before(deadline):
        await asyncio.sleep(POLL_S)
        answer = await gateway.get("/v1/workers/restart")
    _show(answer)
    return 0 if answer.json().get("state") == "done" else 1


def _before(deadline: float) -> bool:
    return asyncio.get_running_loop().time() < deadline


def _in_flight(described: dict[str, Any], url: str) -> int:
    for worker in described.get("workers", []):
        if worker.get("url") == url:
            return int(worker.get("in_flight", 0))
    return 0


def _show(answer: Reply, ok: int = 200) -> int:
    try:
        print(json.dumps(answer.json(), indent=2))
    except ValueError:
        print(answer.body.decode(errors="replace"))
    return 0 if answer.status == ok else 1


Action = Callable[[Gateway, argparse.Namespace], Awaitable[int]]
_ACTIONS: dict[str, Action] = {
    "list": _list,
    "drain": _drain,
    "undrain": _undrain,
    "restart": _restart,
}
