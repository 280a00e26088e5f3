"""`serve --processes N`: N gateway processes on one port, under a parent that keeps them.

One Python process relays on one core. Each child listens on the gateway's port with
SO_REUSEPORT (the kernel spreads new connections over them) and serves the whole gateway app
(siblings.py says how the children share `/metrics` and operators' changes). The parent holds a
bound, non-listening socket on the port (so port 0 picks one port for all), starts the children,
starts again one that dies, and on SIGTERM/SIGINT passes the signal on and waits for every child
to drain (each within the drain deadline), then exits 0.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.process
import os
import signal
import socket
import tempfile
import threading
from pathlib import Path

import structlog

from mineru_gateway.api.app import create_app
from mineru_gateway.api.context import Lifecycle
from mineru_gateway.api.listeners import reuse_port_socket
from mineru_gateway.config import GatewaySettings
from mineru_gateway.entry import server
from mineru_gateway.entry.logs import configure_logging
from mineru_gateway.siblings import Siblings

log = structlog.get_logger("mineru_gateway.processes")

RESTART_DELAY_S = 1.0  # before starting again a child that died: no busy loop on a crash


def run_processes(settings: GatewaySettings) -> int:
    """Runs `settings.processes` gateway processes until SIGTERM/SIGINT; 0 once all stopped."""
    reserved = reuse_port_socket(settings.host, settings.port)  # bound, never listening
    port = reserved.getsockname()[1]
    settings = settings.model_copy(update={"port": port})
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    with tempfile.TemporaryDirectory(prefix="mineru-gateway-") as directory:
        os.chmod(directory, 0o700)
        context = multiprocessing.get_context("spawn")
        places = [
            Siblings(index, settings.processes, Path(directory))
            for index in range(settings.processes)
        ]
        children = [_start(context, settings, place) for place in places]
        log.info("gateway_processes", processes=settings.processes, port=port)
        try:
            while not stopping.wait(0.2):
                for place, child in zip(places, children, strict=True):
                    if child.is_alive():
                        continue
                    log.error("gateway_process_died", process=place.index, exitcode=child.exitcode)
                    if stopping.wait(RESTART_DELAY_S):
                        break
                    children[place.index] = _start(context, settings, place)
        finally:
            for child in children:
                if child.is_alive() and child.pid is not None:
                    os.kill(child.pid, signal.SIGTERM)
            for child in children:
                child.join()
            reserved.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0


def _start(
    context: multiprocessing.context.SpawnContext, settings: GatewaySettings, siblings: Siblings
) -> multiprocessing.process.BaseProcess:
    child = context.Process(
        target=_child, args=(settings, siblings), name=f"gateway-{siblings.index}"
    )
    child.start()
    return child


def _die_with_parent() -> None:
    """SIGTERM to this child when the parent dies, even by SIGKILL (Linux's prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def _child(settings: GatewaySettings, siblings: Siblings) -> None:
    # A terminal's Ctrl-C reaches the parent alone, which passes SIGTERM on: a child that got
    # both would take the second signal as "skip the drain".
    os.setpgrp()
    _die_with_parent()
    configure_logging(settings.log_level, settings.log_format)
    structlog.contextvars.bind_contextvars(process=siblings.index)
    siblings.own_socket.unlink(missing_ok=True)  # left by a predecessor that was killed
    run_gateway(settings, siblings, [reuse_port_socket(settings.host, settings.port)])


def run_gateway(
    settings: GatewaySettings,
    siblings: Siblings | None = None,
    sockets: list[socket.socket] | None = None,
) -> None:
    """One gateway process until SIGTERM/SIGINT, which first stops it admitting requests."""
    lifecycle = Lifecycle()
    server.run(
        create_app(settings, lifecycle, siblings=siblings),
        settings.host,
        settings.port,
        graceful_timeout_s=settings.drain_timeout_s,
        on_signal=lifecycle.start_draining,
        sockets=sockets,
        timeouts=server.edge_timeouts(settings),
    )
