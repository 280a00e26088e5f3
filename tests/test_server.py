"""The gateway's uvicorn server (entry/server.py), in a process of its own: what its startup
leaves for the garbage collector."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio, gc
from mineru_gateway.entry.server import make_server

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

async def main():
    server = make_server(app, "127.0.0.1", 0, "warning")
    before = gc.get_freeze_count()
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(before, gc.get_freeze_count() > before, flush=True)
    server.should_exit = True
    await serving

asyncio.run(main())
"""


def test_once_listening_what_startup_made_is_frozen_out_of_the_collectors_way() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True"]
