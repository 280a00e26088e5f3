"""The CLI as users run it: real processes, real signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mineru_gateway.entry.cli import build_parser, main, settings_from_args
from mineru_gateway.testing import free_port, free_port_block, wait_http_ok, wait_until
from tests.support.servers import CliProcess


def processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def test_help_documents_every_setting_with_its_environment_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mineru_gateway", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for name in ("WORKERS", "ROUTING_POLICY", "MAX_BODY_BYTES", "FIRST_BYTE_TIMEOUT_S"):
        assert f"MINERU_GATEWAY_{name}" in result.stdout


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINERU_GATEWAY_WORKERS", "http://a:1, http://b:2/")
    monkeypatch.setenv("MINERU_GATEWAY_PORT", "31000")
    args = build_parser().parse_args(["serve", "--port", "32000"])
    settings = settings_from_args(args)
    assert settings.workers == ["http://a:1", "http://b:2"]
    assert settings.port == 32000


def test_invalid_settings_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--workers", "ftp://x", "--port", "1"]) == 2
    assert "worker URL must start with http" in capsys.readouterr().err


def test_up_help_says_what_its_flags_count_and_their_defaults() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mineru_gateway", "up", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = " ".join(result.stdout.split())
    assert "how many workers to start, a count" in text and "(default: 4)" in text
    assert "(default: sim)" in text
    assert "--log-to-terminal, --no-log-to-terminal" in text
    assert "--flow-control, --no-flow-control" in text


@pytest.mark.parametrize(
    ("flags", "value"),
    [
        ([], None),  # unset: the environment's, else the setting's default
        (["--flow-control"], True),
        (["--no-flow-control"], False),
        (["--flow-control=false"], False),  # as Compose and Kubernetes pass a variable
        (["--flow-control", "no"], False),
        (["--flow-control=1"], True),
    ],
)
def test_on_off_settings_are_flag_and_no_flag_and_still_take_a_value(
    flags: list[str], value: bool | None
) -> None:
    assert build_parser().parse_args(["serve", *flags]).flow_control is value


@pytest.mark.parametrize("flags", [["--no-flow-control=true"], ["--flow-control=maybe"]])
def test_on_off_settings_refuse_what_is_not_a_boolean(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])


def test_npu_exporter_names_is_a_switch_too() -> None:
    parse = build_parser().parse_args
    assert parse(["npu-exporter"]).npu_exporter_names is True
    assert parse(["npu-exporter", "--no-npu-exporter-names"]).npu_exporter_names is False
    assert parse(["npu-exporter", "--npu-exporter-names=false"]).npu_exporter_names is False


def test_serve_refuses_to_start_open_on_an_address_others_reach(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in list(os.environ):
        if name.startswith("MINERU_GATEWAY_"):
            monkeypatch.delenv(name)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("mineru-gateway serve: no API keys, and 0.0.0.0 is reachable")
    assert "MINERU_GATEWAY_ALLOW_NO_AUTH=true" in line
    keys = tmp_path / "api-keys"
    keys.write_text("k1\n")
    allowed = [
        ["--host", "127.0.0.1"],  # loopback: this host only
        ["--host", "::1"],
        ["--host", "0.0.0.0", "--allow-no-auth"],
        ["--host", "0.0.0.0", "--api-keys", "k1"],
        ["--host", "0.0.0.0", "--api-key-files", str(keys)],
        ["--host", "0.0.0.0", "--tenants", '{"a": {"keys": ["k2"]}}'],
    ]
    for flags in allowed:
        settings = settings_from_args(build_parser().parse_args(["serve", *flags]))
        assert settings.open_access_refusal() is None, flags
    monkeypatch.setenv("MINERU_GATEWAY_ALLOW_NO_AUTH", "true")
    assert settings_from_args(
        build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    ).allow_no_auth


def test_serve_on_a_taken_port_is_one_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "mineru_gateway", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert result.stderr == (
        f"mineru-gateway serve: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )


def test_sim_serves_and_exits_0_on_sigterm() -> None:
    port = free_port()
    sim = CliProcess.mineru_gateway("sim", "--port", str(port))
    proc = sim.start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_up_serves_through_its_workers_and_stops_them_all_on_ctrl_c(tmp_path: Path) -> None:
    port, base = free_port(), free_port_block(2)  # two workers: base and base + 1
    up = CliProcess.mineru_gateway(
        "up",
        "--workers",
        "2",
        "--port",
        str(port),
        "--worker-base-port",
        str(base),
        "--sim-arg=--time-scale=0.05",
        "--log-format",
        "console",
    )
    proc = up.start(log_path=str(tmp_path / "up.log"))
    gateway = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(gateway + "/ready", 60, proc)  # ready: at least one worker is healthy
        wait_until(
            lambda: (
                [w["state"] for w in httpx.get(gateway + "/v1/workers").json()["workers"]]
                == ["healthy", "healthy"]
            ),
            30,
            "both workers healthy",
        )
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200
        assert len(processes_mentioning(f"--port {base}")) == 1
    finally:
        # Ctrl-C in a terminal signals the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=30)
        up.close_log()
    assert code == 0, (tmp_path / "up.log").read_text()[-2000:]
    assert processes_mentioning(f"--port {base}") == []
    assert processes_mentioning(f"--port {base + 1}") == []
