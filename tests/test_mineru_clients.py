"""MinerU 3's and MinerU 4's own clients (mineru-vl-utils 1.2.1 and 2.0.7, each in a virtualenv of
its own: `make mineru-clients`) parse pages through the gateway, two steps each (layout, then
one request per block), on simulated workers, each sending its key the way its MinerU does."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from benchmarks.mineru_client import client_venv

from tests.conftest import StartGateway, StartSim
from tests.deploy.test_worker_image import CLIENT_XARGS

DRIVER = Path(__file__).resolve().parents[1] / "benchmarks" / "mineru_client" / "driver.py"
KEY = "sk-mineru-client-test"
PAGES = 3


def client_python(version: str) -> Path:
    """The client's virtualenv, made by `make mineru-clients` (which `make test` runs first)."""
    venv = client_venv.venv_for(version)
    python = venv / "bin" / "python"
    if not (venv / client_venv.MARKER).exists() or not python.exists():
        raise RuntimeError(
            f"mineru-vl-utils {version} is not installed in {venv}: run `make mineru-clients`, "
            "or run the tests with `make test`"
        )
    return python


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mineru", "version"), sorted(client_venv.CLIENTS.items()))
def test_each_minerus_client_parses_pages_through_the_gateway(
    mineru: str, version: str, start_sim: StartSim, start_gateway: StartGateway
) -> None:
    python = client_python(version)
    worker = start_sim(time_scale=0.02)
    gateway = start_gateway([worker], api_keys=[KEY])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINERU_")}
    argv = [str(python), str(DRIVER), "--url", gateway, "--pages", str(PAGES)]
    argv += ["--max-concurrency", "16"]
    if mineru == "MinerU 3":  # `mineru -b vlm-http-client -u URL`: the key from the environment
        env["MINERU_VL_API_KEY"] = KEY
    else:  # MinerU 4: model.vlm.api_key, sent as the client's server_headers
        argv += ["--server-header", f"Authorization=Bearer {KEY}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["pages_completed"] == PAGES, report["errors"]
    assert all(page["blocks"] > 0 for page in report["pages"])
    state = httpx.get(worker + "/sim/state").json()
    # Two steps a page: its layout request, then one per block it found.
    blocks = sum(page["blocks"] for page in report["pages"])
    assert state["completed"] >= PAGES + 1
    assert state["arrived"] <= PAGES + blocks
    # What each client hands vLLM's logits processor is what the worker image's reads.
    assert set(state["vllm_xargs_seen"]) <= CLIENT_XARGS
    assert "no_repeat_ngram_size" in state["vllm_xargs_seen"]


def test_both_minerus_clients_are_named() -> None:
    assert client_venv.CLIENTS == {"MinerU 3": "1.2.1", "MinerU 4": "2.0.7"}
