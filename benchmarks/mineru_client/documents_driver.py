"""Runs MinerU's own client on several synthetic documents against one server, each document
starting at its own time, and prints when every page and document finished as one JSON document.

Runs inside the client's virtualenv (`client_venv.py`), like `driver.py`. One `MinerUClient` per
document, as a service parsing documents side by side holds one per document when it names
them: with `--ids` each client sends its document's id in a header through
`MinerUClient(..., server_headers={...})` (docs/mineru-client.md). A document is parsed as
mineru-vl-utils' `aio_concurrent_two_step_extract` does it for the http-client backend: every
page's `aio_two_step_extract` at once (a layout request, then one request per block) under the
client's semaphore.

What each page did is read from httpx's log (one line per answered request), attributed to the
page through a context variable its task inherits, never by patching the client: a page's first
answer is its layout, its last ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import sys
import time
from typing import Any

from driver import make_page
from loguru import logger as loguru_logger
from mineru_vl_utils import MinerUClient

current: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "page", default=None
)


class Answers(logging.Handler):
    """When each page's requests were answered (httpx logs every response at INFO)."""

    def __init__(self, t0: float) -> None:
        super().__init__(logging.INFO)
        self.t0 = t0
        self.times: dict[tuple[str, int], list[float]] = {}
        self.statuses: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith("HTTP Request: POST"):
            return
        status = message.rsplit('"', 1)[-1].strip().split(" ")[-1]
        self.statuses[status] = self.statuses.get(status, 0) + 1
        page = current.get()
        if page is not None:
            self.times.setdefault(page, []).append(time.perf_counter() - self.t0)


async def parse_document(
    spec: dict[str, Any], args: argparse.Namespace, t0: float, answers: Answers
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, spec["start_s"] - (time.perf_counter() - t0)))
    name = spec["name"]
    headers = {args.header: name} if args.ids else None
    client = MinerUClient(
        backend="http-client",
        server_url=args.url,
        max_concurrency=args.max_concurrency,
        use_tqdm=False,
        server_headers=headers,
    )
    images = [make_page(index, spec["seed"]) for index in range(spec["pages"])]
    semaphore = asyncio.Semaphore(args.max_concurrency)
    started = time.perf_counter() - t0

    async def page(index: int) -> dict[str, Any]:
        current.set((name, index))
        begun = time.perf_counter() - t0
        try:
            await client.aio_two_step_extract(images[index], semaphore=semaphore)
            ok = True
        except Exception as error:  # what the client raised for this page
            ok = False
            print(f"{name} page {index}: {type(error).__name__}: {error}", file=sys.stderr)
        ended = time.perf_counter() - t0
        seen = answers.times.get((name, index), [])
        return {
            "page": index,
            "ok": ok,
            "start_s": round(begun, 3),
            "layout_s": round(seen[0], 3) if seen else None,
            "end_s": round(ended, 3),
            "requests": len(seen),
        }

    try:
        pages = list(await asyncio.gather(*(page(i) for i in range(spec["pages"]))))
    finally:
        await client.aclose()
    ended = time.perf_counter() - t0
    return {
        "name": name,
        "pages": spec["pages"],
        "start_s": round(started, 3),
        "end_s": round(ended, 3),
        "completion_s": round(ended - started, 3),
        "pages_failed": sum(not p["ok"] for p in pages),
        "page_times": pages,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    loguru_logger.remove()
    loguru_logger.add(sys.stderr, level="ERROR")
    t0 = time.perf_counter()
    answers = Answers(t0)
    log = logging.getLogger("httpx")
    log.setLevel(logging.INFO)
    log.addHandler(answers)
    log.propagate = False
    plan = json.loads(args.plan)
    documents = await asyncio.gather(*(parse_document(s, args, t0, answers) for s in plan))
    return {"ids": args.ids, "statuses": answers.statuses, "documents": list(documents)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--plan", required=True, help='JSON: [{"name","pages","start_s","seed"}]')
    parser.add_argument("--ids", action="store_true", help="send each document's id")
    parser.add_argument("--header", default="X-Document-Id")
    parser.add_argument("--max-concurrency", type=int, default=100)
    args = parser.parse_args(argv)
    json.dump(asyncio.run(main_async(args)), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
