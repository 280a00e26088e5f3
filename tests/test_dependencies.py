"""Every library the package imports is one it declares (pyproject.toml's dependencies), directly
or through a declared one: the test suite's environment has the dev extras too, so a missing
runtime dependency would pass every other test and fail on a user's `pip install`."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imported_top_level() -> set[str]:
    names = set()
    for path in (ROOT / "src" / "mineru_gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"mineru_gateway", "__future__"}


def test_every_imported_library_is_a_declared_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(requirement) for requirement in project["dependencies"]}
    reachable = set(declared)
    for name in declared:  # what the declared ones bring (starlette with fastapi)
        reachable.update(_name(r) for r in metadata.requires(name) or () if "extra ==" not in r)
    distributions = metadata.packages_distributions()
    imported = _imported_top_level()
    assert "httptools" in imported and "fastapi" in imported  # the walk sees the imports
    missing = {
        module: distributions.get(module)
        for module in imported
        if not {_name(d) for d in distributions.get(module, [])} & reachable
    }
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_gateway_speaks_http_with_its_own_client_and_server_only() -> None:
    """Every HTTP the gateway speaks at run time (clients, workers, the metrics port, the admin
    command, Prometheus, the supervisor's probes) goes through its own HTTP/1.1 client and
    server protocol (workers/http1.py, api/connection.py): no second client or server library
    is imported, and none is a runtime dependency."""
    others = {"aiohttp", "httpx", "uvicorn", "requests", "urllib3", "h11"}
    assert not _imported_top_level() & others
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not {_name(requirement) for requirement in project["dependencies"]} & others
