"""Runs MinerU's own client (`mineru_vl_utils.MinerUClient`, backend `http-client`) on synthetic
pages against one server and prints what became of every page as one JSON document on stdout.

Runs inside the client's virtualenv (`client_venv.py`), not the gateway's: it imports only
mineru-vl-utils and its dependencies (Pillow for the page images). The client is used exactly as
shipped, with its defaults (3 retries, 0.5 s backoff factor, 100 requests at once); what it does
is observed through the loggers of httpx and httpx-retries, never by patching it.

Modes:
- `pages`: each page is its own `aio_two_step_extract` (layout, then one request per block),
  all pages at once under one shared semaphore of `max_concurrency`, so each page succeeds or
  fails on its own.
- `windows`: what MinerU's document pipeline does (mineru 4.x, `backend/analysis/pdf/window.py`):
  pages in windows of 64, one `aio_batch_two_step_extract` per window, windows one after another,
  one shared semaphore. One failed request fails its whole window (and so the document).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import random
import re
import sys
import time
from collections import Counter
from typing import Any

from loguru import logger as loguru_logger
from mineru_vl_utils import MinerUClient
from PIL import Image, ImageDraw

PAGE_SIZE = (1240, 1754)  # A4 at 150 dpi
current_page: contextvars.ContextVar[int | None] = contextvars.ContextVar("page", default=None)


def make_page(index: int, seed: int) -> Image.Image:
    """A white page with a title bar and lines of grey 'text', different on every page."""
    rng = random.Random(seed * 100_003 + index)
    image = Image.new("RGB", PAGE_SIZE, "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((100, 80, 100 + rng.randint(400, 900), 130), fill=(40, 40, 40))
    draw.text((100, 150), f"page {index}", fill="black")
    y = 220
    while y < PAGE_SIZE[1] - 120:
        if rng.random() < 0.1:
            y += 40  # paragraph break
        width = rng.randint(600, PAGE_SIZE[0] - 200)
        shade = rng.randint(60, 120)
        draw.rectangle((100, y, 100 + width, y + 14), fill=(shade, shade, shade))
        y += 28
    return image


class Observer(logging.Handler):
    """Counts what httpx-retries and httpx log: each retry (with the status that caused it),
    each sleep before a retry, each final response. Attributed to the page being processed
    (a context variable the page's tasks inherit)."""

    RETRY = re.compile(r"response=(?:<Response \[(\d+)[^\]]*\]>|(.+?)) retry=")
    SLEEP = re.compile(r"sleep seconds=([0-9.eE+-]+)")
    FINAL = re.compile(r'HTTP Request: (\w+) \S+ "HTTP/[0-9.]+ (\d+)')

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.retries: Counter[str] = Counter()
        self.final: Counter[str] = Counter()
        self.sleeps: list[float] = []
        self.per_page: dict[int, dict[str, Any]] = {}

    def page(self) -> dict[str, Any] | None:
        index = current_page.get()
        if index is None:
            return None
        return self.per_page.setdefault(index, {"retries": Counter(), "sleep_s": 0.0})

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        page = self.page()
        if "retrying request=" in message:
            match = self.RETRY.search(message)
            why = (match.group(1) or "exception " + match.group(2)[:60]) if match else "?"
            self.retries[why] += 1
            if page is not None:
                page["retries"][why] += 1
        elif (match := self.SLEEP.search(message)) is not None:
            seconds = float(match.group(1))
            self.sleeps.append(seconds)
            if page is not None:
                page["sleep_s"] += seconds
        elif (match := self.FINAL.search(message)) is not None:
            self.final[f"{match.group(1)} {match.group(2)}"] += 1


def install_observer() -> Observer:
    observer = Observer()
    for name, level in (("httpx_retries", logging.DEBUG), ("httpx", logging.INFO)):
        log = logging.getLogger(name)
        log.setLevel(level)
        log.addHandler(observer)
        log.propagate = False
    # MinerU's own warnings (e.g. "No angle found" for every simulated block) would flood stderr.
    loguru_logger.remove()
    loguru_logger.add(sys.stderr, level="ERROR")
    return observer


def describe(error: BaseException) -> dict[str, Any]:
    text = str(error)
    out: dict[str, Any] = {"type": type(error).__name__, "message": text[:300]}
    status = getattr(error, "status_code", None)
    if status is not None:
        out["status"] = status
    return out


def summarise(result: Any) -> dict[str, Any]:
    blocks = list(result)
    return {
        "blocks": len(blocks),
        "types": dict(Counter(block.type for block in blocks)),
        "with_content": sum(1 for block in blocks if block.content),
    }


async def run_pages(
    client: MinerUClient, images: list[Image.Image], semaphore: asyncio.Semaphore, t0: float
) -> list[dict[str, Any]]:
    async def one(index: int, image: Image.Image) -> dict[str, Any]:
        current_page.set(index)
        started = time.perf_counter() - t0
        try:
            result = await client.aio_two_step_extract(image, semaphore=semaphore)
            outcome: dict[str, Any] = {"ok": True, **summarise(result)}
        except Exception as error:  # what the client raised for this page
            outcome = {"ok": False, "error": describe(error)}
        ended = time.perf_counter() - t0
        return {"page": index, **outcome, "start_s": round(started, 3), "end_s": round(ended, 3)}

    return list(await asyncio.gather(*(one(i, image) for i, image in enumerate(images))))


async def run_windows(
    client: MinerUClient,
    images: list[Image.Image],
    semaphore: asyncio.Semaphore,
    t0: float,
    window: int,
) -> list[dict[str, Any]]:
    pages: list[dict[str, Any]] = []
    for start in range(0, len(images), window):
        chunk = images[start : start + window]
        started = time.perf_counter() - t0
        try:
            results = await client.aio_batch_two_step_extract(chunk, semaphore=semaphore)
            outcomes: list[dict[str, Any]] = [{"ok": True, **summarise(r)} for r in results]
        except Exception as error:  # the whole window fails, as in MinerU
            outcomes = [{"ok": False, "error": describe(error)}] * len(chunk)
        ended = time.perf_counter() - t0
        for offset, outcome in enumerate(outcomes):
            pages.append(
                {
                    "page": start + offset,
                    "window": start // window,
                    **outcome,
                    "start_s": round(started, 3),
                    "end_s": round(ended, 3),
                }
            )
    return pages


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    observer = install_observer()
    images = [make_page(i, args.seed) for i in range(args.pages)]
    headers = dict(header.split("=", 1) for header in args.server_header)
    client = MinerUClient(
        backend="http-client",
        server_url=args.url,
        server_headers=headers or None,
        max_concurrency=args.max_concurrency,
        max_retries=args.max_retries,
        use_tqdm=False,
    )
    semaphore = asyncio.Semaphore(args.max_concurrency)
    t0 = time.perf_counter()
    try:
        if args.mode == "pages":
            pages = await run_pages(client, images, semaphore, t0)
        else:
            pages = await run_windows(client, images, semaphore, t0, args.window)
    finally:
        close = getattr(client, "aclose", None)  # 2.x; the 1.2 releases have none
        if close is not None:
            await close()
    wall = time.perf_counter() - t0
    for page in pages:
        seen = observer.per_page.get(page["page"])
        page["retries"] = dict(seen["retries"]) if seen else {}
        page["retry_sleep_s"] = round(seen["sleep_s"], 3) if seen else 0.0
    failed = [p for p in pages if not p["ok"]]
    return {
        "mode": args.mode,
        "model": client.client.model_name,
        "pages_sent": len(pages),
        "pages_completed": len(pages) - len(failed),
        "pages_failed": len(failed),
        "errors": dict(
            Counter(f"{p['error']['type']} {p['error'].get('status', '')}".strip() for p in failed)
        ),
        "wall_s": round(wall, 3),
        "client": {
            "max_concurrency": args.max_concurrency,
            "max_retries": args.max_retries,
            "final_responses": dict(observer.final),
            "retries_by_cause": dict(observer.retries),
            "retry_sleeps": len(observer.sleeps),
            "retry_sleep_s_total": round(sum(observer.sleeps), 3),
            "retry_sleep_s_max": round(max(observer.sleeps), 3) if observer.sleeps else 0.0,
            "retry_sleep_s_values": dict(Counter(round(s, 1) for s in observer.sleeps)),
        },
        "pages": pages,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="server URL, as MinerU's --url")
    parser.add_argument("--pages", type=int, default=20)
    parser.add_argument("--mode", choices=("pages", "windows"), default="pages")
    parser.add_argument("--window", type=int, default=64, help="pages per window (windows mode)")
    parser.add_argument("--max-concurrency", type=int, default=100)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-header",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a header on every request (the client's server_headers, as MinerU 4 sends its key)",
    )
    args = parser.parse_args(argv)
    report = asyncio.run(main_async(args))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
