"""The compiled build's module list (setup.py): `make test-compiled` runs the tests again against
it, and conftest.py refuses a run where the build is not the one imported."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from setup import COMPILED, compiled_modules

from mineru_gateway.api.app import compiled_build
from mineru_gateway.workers import http1

SRC = Path(__file__).resolve().parents[1] / "src" / "mineru_gateway"
EXPECT_COMPILED = os.environ.get("MINERU_GATEWAY_EXPECT_COMPILED") == "1"  # make test-compiled


def test_every_compiled_module_exists_and_imports() -> None:
    assert len(set(COMPILED)) == len(COMPILED)
    for path in COMPILED:
        assert (SRC / path).is_file(), path
    for name in compiled_modules():
        assert importlib.import_module(name).__name__ == name


def test_the_request_paths_modules_are_compiled() -> None:
    names = set(compiled_modules())
    # A request's way through the gateway: server protocol, relay, parsing, admission, routing,
    # the worker's client, accounting.
    for name in ("api.connection", "api.relay", "api.requests", "flow", "routing"):
        assert f"mineru_gateway.{name}" in names
    for name in ("workers.dispatcher", "workers.registry", "workers.http1", "workers.upstream"):
        assert f"mineru_gateway.{name}" in names
    assert "mineru_gateway.api.accounting" in names
    # FastAPI reads its endpoints' signatures.
    assert "mineru_gateway.api.app" not in names


def test_the_gateway_knows_which_build_it_runs() -> None:
    # Logged at start (`gateway_started ... compiled=`): which build an image really runs.
    assert compiled_build() is EXPECT_COMPILED


def test_only_the_compiled_build_cuts_spliced_reads_into_chunks_itself() -> None:
    # tests/workers/test_http1.py's splice tests run against both builds: the pure one tests
    # the parser's way, the compiled one the connection's own cut (workers/http1.py).
    assert http1.CUT_CHUNKS_HERE is EXPECT_COMPILED
