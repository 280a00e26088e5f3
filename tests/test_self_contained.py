"""The repository stands alone: no file reads or cites anything outside it.

A user's clone has only what git tracks. Fixtures live in tests/fixtures/ and design facts in docs/;
nothing may point at a sibling folder of the checkout or at a design file kept elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match its own patterns.
_SIBLING = "shared"
_DESIGN_FILE = "DESIGN" + ".md"
FORBIDDEN = re.compile(
    "|".join(re.escape(text) for text in ("../" + _SIBLING, _SIBLING + "/fixtures", _DESIGN_FILE))
)
# Path building that climbs out of the checkout: `parents[N]` and the quoted sibling folder name.
SIBLING_NAME = re.compile("[\"']" + _SIBLING + "[\"']")
PARENTS = re.compile(r"\bparents?\b")

DOCS_CITATION = re.compile(r"docs/[a-z0-9_-]+\.md")
BINARY_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".ico", ".pdf", ".gz", ".zip"})


def _git_files(*args: str) -> list[str]:
    listing = subprocess.run(
        ["git", "ls-files", "-z", *args], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [name for name in listing.decode().split("\0") if name]


def repository_paths() -> list[Path]:
    """Tracked files and untracked ones that are not ignored: what a commit would hold."""
    names = set(_git_files()) | set(_git_files("--others", "--exclude-standard"))
    return sorted(ROOT / name for name in names)


def text_of(path: Path) -> str | None:
    """A file's text; a symbolic link's target; None for binaries and files deleted since."""
    if path.is_symlink():
        return os.readlink(path)
    if not path.is_file() or path.suffix.lower() in BINARY_SUFFIXES:
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_references(text: str) -> list[tuple[int, str]]:
    """(line number, line) for each line that reads or cites something outside the repository."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        builds_path = SIBLING_NAME.search(line) and PARENTS.search(line)
        if FORBIDDEN.search(line) or builds_path:
            found.append((number, line.strip()))
    return found


def test_the_patterns_catch_what_they_should() -> None:
    sibling, design = "../" + _SIBLING, _DESIGN_FILE
    caught = [
        f"FIXTURES = Path(__file__).parents[2] / '{_SIBLING}' / 'fixtures'",
        f"see {sibling}/fixtures/vllm/metrics.txt",
        f"recordings in {_SIBLING}/fixtures/npu-smi/",
        f"(see {design} section 7)",
    ]
    passed = [
        "on two shared cores the workers do not run at the same speed",
        "FIXTURES = Path(__file__).resolve().parent / 'fixtures'",
        "(docs/running-locally.md)",
    ]
    assert [bool(outside_references(line)) for line in caught] == [True] * len(caught)
    assert [bool(outside_references(line)) for line in passed] == [False] * len(passed)


def test_nothing_refers_outside_the_repository() -> None:
    paths = repository_paths()
    assert Path(__file__).resolve() in paths
    offences = [
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in paths
        if (text := text_of(path)) is not None
        for number, line in outside_references(text)
    ]
    assert not offences, "files refer to things outside the repository:\n" + "\n".join(offences)


def test_every_document_cited_in_src_exists() -> None:
    src = ROOT / "src"
    cited = {
        citation
        for path in repository_paths()
        if path.is_relative_to(src) and (text := text_of(path)) is not None
        for citation in DOCS_CITATION.findall(text)
    }
    assert cited, "src/ cites no docs/*.md at all: is the pattern still right?"
    missing = sorted(name for name in cited if not (ROOT / name).is_file())
    assert not missing, f"src/ cites documents that do not exist: {missing}"
