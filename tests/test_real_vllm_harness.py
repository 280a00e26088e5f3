"""The real-vLLM harness itself (mineru_gateway.testing): start the CPU build on the tiny model,
talk to it, stop it cleanly; and the same harness against a stand-in for vLLM's python.

One server start (about 20-30 s here); without `make vllm` the test fails with instructions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mineru_gateway.testing import (
    MODEL_ENV,
    PYTHON_ENV,
    omp_bind_env,
    start_vllm_server,
    vllm_paths_from_env,
    vllm_python_from_env,
)

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello, world!"}]


def sse_data(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.vllm
def test_real_vllm_serves_chat_and_stops_cleanly(tmp_path: Path) -> None:
    python, model_dir = vllm_paths_from_env()
    server = start_vllm_server(python, model_dir, log_path=str(tmp_path / "vllm.log"))
    try:
        server.wait_ready(timeout=150)
        assert server.url.startswith("http://127.0.0.1:")
        assert len(server.pids()) >= 3  # API server, engine core, worker (+ resource tracker)

        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            models = client.get("/v1/models")
            assert models.status_code == 200
            assert [m["id"] for m in models.json()["data"]] == ["tiny"]

            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
            started = time.monotonic()
            response = client.post(CHAT, json=body)
            elapsed = time.monotonic() - started
            assert response.status_code == 200, response.text
            completion = response.json()
            assert completion["object"] == "chat.completion"
            assert completion["model"] == "tiny"
            [choice] = completion["choices"]
            assert choice["index"] == 0
            assert choice["message"]["role"] == "assistant"
            assert isinstance(choice["message"]["content"], str)
            assert choice["finish_reason"] in ("length", "stop")
            usage = completion["usage"]
            assert 1 <= usage["completion_tokens"] <= 8
            assert usage["prompt_tokens"] > 0
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert elapsed < 10.0

            stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", CHAT, json=stream_body) as stream:
                assert stream.status_code == 200
                assert stream.headers["content-type"].startswith("text/event-stream")
                data = sse_data(stream)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(item) for item in data[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        *token_chunks, usage_chunk = chunks
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"] == {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
        }
        assert token_chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in token_chunks)
        assert streamed == choice["message"]["content"]  # temperature 0: the same tokens
    finally:
        code = server.stop()

    assert code is not None
    assert server.pids() == [], "vLLM left processes behind (engine core or worker)"


def test_missing_vllm_fails_with_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    monkeypatch.setenv(MODEL_ENV, "/nonexistent/tiny-qwen2")
    with pytest.raises(RuntimeError, match="make vllm") as info:
        vllm_paths_from_env()
    assert PYTHON_ENV in str(info.value)
    assert "/nonexistent/tiny-qwen2" in str(info.value)


def test_the_vllm_python_alone_needs_no_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # The routing benchmark brings its own (small) model: only the python is required.
    monkeypatch.delenv(MODEL_ENV, raising=False)
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    assert vllm_python_from_env() == sys.executable
    monkeypatch.setenv(PYTHON_ENV, "/nonexistent/python")
    with pytest.raises(RuntimeError, match="/nonexistent/python is not an executable"):
        vllm_python_from_env()


def test_omp_bind_env_gives_servers_disjoint_cores() -> None:
    binds = [omp_bind_env(i, 2)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)]
    cores = [set(bind.split(",")) for bind in binds]
    assert all(cores)
    if len(os.sched_getaffinity(0)) >= 2:
        assert not cores[0] & cores[1]


@pytest.mark.vllm
def test_the_model_builder_makes_a_small_model_and_leaves_the_tiny_one_as_it_was(
    tmp_path: Path,
) -> None:
    python, tiny_dir = vllm_paths_from_env()
    script = Path(__file__).parents[1] / "scripts" / "build_tiny_model.py"
    small = tmp_path / "small"
    built = subprocess.run(
        [python, str(script), "--size", "small", "--out", str(small)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    config = json.loads((small / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (8, 512)
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU's head_dim
    # The tiny model's parameters did not move: `make vllm` keeps reusing the cached build.
    again = subprocess.run(
        [python, str(script), "--out", tiny_dir], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr
    assert "reusing" in again.stdout


# -- the harness against a stand-in for vLLM's python -----------------------------------------

STAND_IN = """#!{python}
# Stands in for vLLM's python: a child in the same process group (as vLLM starts its engine core),
# then a simulated worker on the port and under the name it was given ($SERVE_AS overrides it).
import os, subprocess, sys
args = sys.argv[1:]
port = args[args.index("--port") + 1]
name = os.environ.get("SERVE_AS") or args[args.index("--served-model-name") + 1]
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
os.execv(sys.executable, [sys.executable, "-m", "mineru_gateway", "sim", "--port", port,
         "--model-name", name, "--log-level", "warning"])
"""


def stand_in(tmp_path: Path, body: str = STAND_IN) -> str:
    path = tmp_path / "vllm-python"
    path.write_text(body.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_the_harness_waits_for_the_served_name_and_stops_the_whole_group(tmp_path: Path) -> None:
    server = start_vllm_server(stand_in(tmp_path), str(tmp_path), log_path=str(tmp_path / "log"))
    try:
        assert server.wait_ready(timeout=30) is server
        assert server.ready_after is not None and server.ready_after > 0
        assert len(server.pids()) == 2  # the server and its child
        models = httpx.get(server.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
    finally:
        code = server.stop(timeout=10)
    assert code == 0
    assert server.pids() == []


def test_the_harness_reports_a_server_that_serves_another_name(tmp_path: Path) -> None:
    server = start_vllm_server(stand_in(tmp_path), str(tmp_path), env={"SERVE_AS": "other"})
    try:
        with pytest.raises(TimeoutError, match=r"not ready after 5 s \(last: \"/v1/models 200"):
            server.wait_ready(timeout=5)
    finally:
        server.stop(timeout=10)


def test_the_harness_fails_at_once_with_the_log_of_a_server_that_exits(tmp_path: Path) -> None:
    exits = "#!{python}\nprint('no such model')\nraise SystemExit(3)\n"
    server = start_vllm_server(stand_in(tmp_path, exits), str(tmp_path))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="vLLM exited with 3 before it was ready") as info:
        server.wait_ready(timeout=30)
    assert time.monotonic() - started < 10
    assert "no such model" in str(info.value)
    assert server.stop() == 3
