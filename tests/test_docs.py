"""The documents say what the code does: generated references are current, and every make target,
`mineru-gateway` flag and relative link they name exists."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
)
SUBCOMMANDS = ("serve", "sim", "up", "worker", "workers", "npu-exporter", "compose")

FENCED = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?:^|[\s;&|(])make ([a-z][\w-]*)")
COMMAND = re.compile(
    r"(?:mineru-gateway|python -m mineru_gateway) (" + "|".join(SUBCOMMANDS) + r")\b"
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# Development history has no place in a product's documents (it is in git).
HISTORY = re.compile(
    r"\bthis round\b|\blast round\b|\bthis session\b|\bprevious session\b|\bat commit\b"
    r"|\bissue \d+\b",
    re.I,
)


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_of(text: str) -> list[str]:
    """Command-like text: each line of fenced blocks (continuations joined), each inline span."""
    blocks = [block.replace("\\\n", " ") for block in FENCED.findall(text)]
    lines = [line for block in blocks for line in block.splitlines()]
    return lines + INLINE.findall(FENCED.sub("", text))


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_documents_are_found() -> None:
    assert ROOT / "README.md" in DOCUMENTS
    assert ROOT / "docs" / "reference" / "configuration.md" in DOCUMENTS
    assert all(path.is_file() for path in DOCUMENTS)


def test_generated_references_are_current() -> None:
    generator = _load_generator()
    stale = [
        _relative(path)
        for path, text in generator.outputs().items()
        if not path.is_file() or path.read_text() != text
    ]
    assert not stale, f"{stale} differ from the code: run `python scripts/gen_reference.py`"


def test_the_configuration_reference_names_every_setting() -> None:
    from mineru_gateway.config import GatewaySettings

    text = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    missing = [
        n for n in GatewaySettings.model_fields if f"MINERU_GATEWAY_{n.upper()}`" not in text
    ]
    assert not missing


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", text, re.M))


def test_make_targets_named_in_documents_exist() -> None:
    targets = makefile_targets()
    assert {"run", "test", "install"} <= targets
    named = {
        (_relative(path), target)
        for path in DOCUMENTS
        for code in code_of(path.read_text())
        for target in MAKE.findall(code)
    }
    assert ("README.md", "run") in named
    unknown = sorted(pair for pair in named if pair[1] not in targets)
    assert not unknown, f"make targets named in documents but not in the Makefile: {unknown}"


@functools.cache
def help_text(*command: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "mineru_gateway", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return run.stdout


def flags_of(command: str) -> tuple[str, list[str], list[str]]:
    """(subcommand, the words after it, the flags given to the gateway's own command)."""
    match = COMMAND.search(command)
    assert match is not None
    words = command[match.end() :].split()
    flags = []
    for word in words:
        if word == "--" or word in ("|", "||", "&&", ";", "#"):
            break  # what follows `--` goes to vLLM; the rest is another command
        if word.startswith("--") and "[" not in word:
            flags.append(re.sub(r"[^\w-]+$", "", word.split("=", 1)[0]))
    return match.group(1), words, flags


def known_flags(subcommand: str, words: list[str]) -> str:
    text = help_text(subcommand)
    actions = [word for word in words if word in ("list", "drain", "undrain", "restart")]
    if subcommand == "workers" and actions:
        text += help_text(subcommand, actions[0])
    return text


def test_flags_named_in_documents_exist() -> None:
    checked, unknown = 0, []
    for path in DOCUMENTS:
        for code in code_of(path.read_text()):
            for line in code.splitlines():
                if COMMAND.search(line) is None:
                    continue
                subcommand, words, flags = flags_of(line)
                text = known_flags(subcommand, words)
                for flag in flags:
                    checked += 1
                    if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                        unknown.append(f"{_relative(path)}: mineru-gateway {subcommand} {flag}")
    assert checked > 10, "no flags found: is the pattern still right?"
    assert not unknown, "flags not in the subcommand's --help:\n" + "\n".join(unknown)


def test_the_flag_check_catches_an_unknown_flag() -> None:
    subcommand, words, flags = flags_of("mineru-gateway serve --workers http://w:1 --no-such-flag")
    assert flags == ["--workers", "--no-such-flag"]
    assert "--no-such-flag" not in known_flags(subcommand, words)
    assert flags_of("mineru-gateway worker --device 0 -- --max-num-seqs 8")[2] == ["--device"]


@pytest.mark.parametrize("path", DOCUMENTS, ids=_relative)
def test_relative_links_point_to_files(path: Path) -> None:
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{_relative(path)} links to missing files: {broken}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=_relative)
def test_documents_describe_the_product_not_its_history(path: Path) -> None:
    found = [m.group(0) for m in HISTORY.finditer(path.read_text())]
    assert not found, f"{_relative(path)}: {found}"


def test_the_readme_starts_with_what_a_user_does_first() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, "the README is a front page: details belong in docs/"
    first = "\n".join(lines[:100])
    steps = ("make run", "docker compose up", "dashboard", "kubectl apply -k deploy/k8s/ ")
    for step in steps:
        assert step in first, f"{step!r} is not within the README's first 100 lines"


def test_weights_are_fetched_with_commands_that_exist_today() -> None:
    """huggingface_hub 1.0 has `hf download`, not `huggingface-cli`."""
    stale = [_relative(path) for path in DOCUMENTS if "huggingface-cli" in path.read_text()]
    assert not stale, stale


def test_the_readme_shows_minerus_4_and_3_ways_in() -> None:
    text = (ROOT / "README.md").read_text()
    for way in ("MINERU_MODEL_VLM_SERVER_URL", "mineru parse", "mineru-api --vlm-server-url"):
        assert way in text, way
    assert "-b vlm-http-client -u" in text  # MinerU 3


# ---------------------------------------------------------------------------------------------
# Commands as an operator pastes them: on a Compose host nothing of this project is installed,
# and once keys are set every /v1/ endpoint wants one.

HEADING = re.compile(r"^#{1,6} ")
FENCE = re.compile(r"^\s*```")
COMPOSE = re.compile(r"docker[ -]compose(?![\w.])")  # not docker-compose.yml
IN_A_CONTAINER = re.compile(
    r"docker[ -]compose (?:exec|run)\b|\bdocker run\b|\bkubectl\b.*\bexec\b"
)
RUNS_THE_GATEWAY = re.compile(
    r"(?:^|[;&|(]|\$\()\s*(?:[\w./~-]*/)?mineru-gateway (?:" + "|".join(SUBCOMMANDS) + r")\b"
)
CURL_URL = re.compile(r"\bcurl\b.*?(https?://([^/\s:'\"]+)[^\s'\"]*)")
OPEN_PATHS = ("/health", "/ready", "/metrics")
SENDS_A_KEY = re.compile(r"authorization: bearer \S+", re.I)
LOCAL_KEYLESS = re.compile(r"make run|mineru-gateway up\b")


def sections(text: str) -> list[tuple[str, str, list[str]]]:
    """(heading, the section's whole text, its fenced code lines with continuations joined)."""
    found: list[tuple[str, list[str], list[str]]] = [("", [], [])]
    fenced: list[str] | None = None
    for line in text.splitlines():
        if FENCE.match(line):
            if fenced is None:
                fenced = []
            else:
                joined = "\n".join(fenced).replace("\\\n", " ")
                found[-1][2].extend(joined.splitlines())
                fenced = None
        elif fenced is not None:
            fenced.append(line)
        elif HEADING.match(line):
            found.append((line, [], []))
        found[-1][1].append(line)
    return [(heading, "\n".join(lines), code) for heading, lines, code in found]


def gateway_commands_on_the_compose_host(text: str) -> list[str]:
    """Code lines of sections about Compose that run `mineru-gateway` outside a container."""
    return [
        line
        for _, section, code in sections(text)
        if COMPOSE.search(section)
        for line in code
        if RUNS_THE_GATEWAY.search(line) and not IN_A_CONTAINER.search(line)
    ]


def keyless_curls(text: str) -> list[str]:
    """Code lines that curl a key-guarded path without a key, but for a keyless local run's."""
    found = []
    for _, section, code in sections(text):
        for line in code:
            match = CURL_URL.search(line)
            if match is None or SENDS_A_KEY.search(line):
                continue
            url, host = match.groups()
            path = "/" + url.split("/", 3)[3] if url.count("/") >= 3 else "/"
            if not path.startswith("/v1/") or path.startswith(OPEN_PATHS):
                continue
            if host in ("127.0.0.1", "localhost") and LOCAL_KEYLESS.search(section):
                continue  # `make run`, `up`: no keys, on the loopback only
            found.append(line.strip())
    return found


@pytest.mark.parametrize("path", DOCUMENTS, ids=_relative)
def test_no_document_runs_the_gateway_on_the_compose_host(path: Path) -> None:
    found = gateway_commands_on_the_compose_host(path.read_text())
    assert not found, f"{_relative(path)}: use `docker compose exec|run ... gateway`: {found}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=_relative)
def test_every_curl_to_a_guarded_endpoint_sends_a_key(path: Path) -> None:
    found = keyless_curls(path.read_text())
    assert not found, f"{_relative(path)}: curl without `Authorization: Bearer`: {found}"


def test_the_operator_command_checks_can_fail() -> None:
    compose = (
        "## Compose\n\nWith docker compose:\n\n```sh\n"
        "mineru-gateway compose --npus 0-3\n"
        ".venv/bin/mineru-gateway workers list\n"
        "docker compose exec gateway mineru-gateway workers list\n"
        "docker compose run --rm --no-deps gateway \\\n  mineru-gateway compose --dir /repo\n"
        "# mineru-gateway compose, in a comment line of a block\n"
        "```\n\n## Elsewhere\n\n```sh\nmineru-gateway serve --workers http://w:1\n```\n"
    )
    assert gateway_commands_on_the_compose_host(compose) == [
        "mineru-gateway compose --npus 0-3",
        ".venv/bin/mineru-gateway workers list",
    ]
    curls = (
        "## Deployed\n\n```sh\ncurl -s http://HOST:30000/v1/workers\n"
        'curl -s -H "Authorization: Bearer $KEY" http://HOST:30000/v1/models\n'
        "curl -s http://127.0.0.1:30000/ready\ncurl -s http://127.0.0.1:30000/v1/models\n```\n"
        "\n## Local\n\n`make run`, then:\n\n```sh\ncurl -s http://127.0.0.1:30000/v1/models\n```\n"
    )
    assert keyless_curls(curls) == [
        "curl -s http://HOST:30000/v1/workers",
        "curl -s http://127.0.0.1:30000/v1/models",
    ]
