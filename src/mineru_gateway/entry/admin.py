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
import json
import os
import sys
import time
from typing import Any

import httpx

DEFAULT_GATEWAY = "http://127.0.0.1:30000"
POLL_S = 0.5


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


def run_admin(args: argparse.Namespace) -> int:
    headers = {"authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    try:
        with httpx.Client(base_url=args.gateway, headers=headers, timeout=30.0) as client:
            return _ACTIONS[args.action](client, args)
    except httpx.HTTPError as error:
        print(f"mineru-gateway workers: no answer from {args.gateway}: {error}", file=sys.stderr)
        return 2


def _list(client: httpx.Client, args: argparse.Namespace) -> int:
    return _show(client.get("/v1/workers"))


def _drain(client: httpx.Client, args: argparse.Namespace) -> int:
    answer = client.post("/v1/workers/drain", json={"url": args.url})
    if answer.status_code != 200 or args.no_wait:
        return _show(answer)
    deadline = time.monotonic() + args.timeout_s
    while (busy := _in_flight(answer.json(), args.url)) > 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)
        answer = client.get("/v1/workers")
    print(json.dumps({"url": args.url, "in_flight": busy, "idle": busy == 0}))
    return 0 if busy == 0 else 1


def _undrain(client: httpx.Client, args: argparse.Namespace) -> int:
    return _show(client.post("/v1/workers/undrain", json={"url": args.url}))


def _restart(client: httpx.Client, args: argparse.Namespace) -> int:
    answer = client.post("/v1/workers/restart", json={"urls": args.urls or None})
    if answer.status_code != 202 or args.no_wait:
        return _show(answer, ok=202)
    deadline = time.monotonic() + args.timeout_s
    while answer.json().get("state") == "running" and time.monotonic() < deadline:
        time.sleep(POLL_S)
        answer = client.get("/v1/workers/restart")
    _show(answer)
    return 0 if answer.json().get("state") == "done" else 1


def _in_flight(described: dict[str, Any], url: str) -> int:
    for worker in described.get("workers", []):
        if worker.get("url") == url:
            return int(worker.get("in_flight", 0))
    return 0


def _show(answer: httpx.Response, ok: int = 200) -> int:
    try:
        print(json.dumps(answer.json(), indent=2))
    except ValueError:
        print(answer.text)
    return 0 if answer.status_code == ok else 1


_ACTIONS = {"list": _list, "drain": _drain, "undrain": _undrain, "restart": _restart}
