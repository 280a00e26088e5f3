"""The package's imports: no circle between modules, and at most two that run up a floor.

The floors are docs/architecture.md's ("Floors"): the core, the services over it, the API over
those, and the programs on top. Every import counts, those only for type checkers and those
inside functions too: a circle through any of them is a module that cannot be read, or changed,
without the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mineru_gateway"
MAX_UPWARD = 2

# The first part of a module's name under the package, to its floor (docs/architecture.md).
FLOORS = {
    # 0, the core: pure policy, the request and the values everything passes around
    "": 0,
    "routing": 0,
    "flow": 0,
    "cost": 0,
    "prompts": 0,
    "request": 0,
    "images": 0,
    "values": 0,
    "errors": 0,
    "config": 0,
    "vllm_contract": 0,
    # 1, the services: workers, cache, fleet state, telemetry, metrics
    "workers": 1,
    "cache": 1,
    "fleet": 1,
    "telemetry": 1,
    "tracing": 1,
    "metrics": 1,
    "redis_link": 1,
    "periodic": 1,
    "reload": 1,
    # 2, the API: the relay, the server protocol, the control routes
    "api": 2,
    # 3, the programs: the command line, the simulator, the test helpers
    "entry": 3,
    "sim": 3,
    "testing": 3,
    "__main__": 3,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports, wherever in it the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base).strip(".")
            else:
                module = node.module or ""
            # `from package import module` imports the module; other names, the package's.
            targets = [
                f"{module}.{alias.name}"
                if inner_name(f"{module}.{alias.name}") in known
                else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            inner = inner_name(target)
            if inner is not None and inner in known and inner != name:
                found.add(inner)
    return found


def inner_name(module: str) -> str | None:
    """`mineru_gateway.api.relay` as `api.relay`; None for another package's module."""
    if module == "mineru_gateway" or module.startswith("mineru_gateway."):
        return module.removeprefix("mineru_gateway").lstrip(".")
    return None


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def floor(name: str) -> int:
    return FLOORS[name.partition(".")[0]]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_floor() -> None:
    unplaced = {name for name in modules() if name.partition(".")[0] not in FLOORS}
    assert unplaced == set(), "place them in FLOORS and docs/architecture.md"


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def test_at_most_two_imports_run_up_a_floor() -> None:
    edges = graph()
    upward = sorted(
        f"{name} -> {other}"
        for name, targets in edges.items()
        for other in targets
        if floor(other) > floor(name)
    )
    assert len(upward) <= MAX_UPWARD, upward


def test_a_circle_and_an_upward_import_are_seen() -> None:
    """The checks themselves: a made-up graph with a circle through three modules."""
    edges = {"api.a": {"cache.b"}, "cache.b": {"api.c"}, "api.c": {"api.a"}, "flow": set()}
    assert circles(edges) == [["api.a", "api.c", "cache.b"]]
    assert floor("cache.b") < floor("api.c")
