"""The package's metadata is in pyproject.toml; this file only adds the compiled build.

`MINERU_GATEWAY_COMPILE=1 pip install .` compiles the modules on the request path (`COMPILED`)
to C extensions with mypyc, from the same sources and type annotations mypy --strict checks: 0.70x
the instructions per small request (docs/proxy-costs.md, "The compiled build"). It builds in an
environment that has the dependencies (`--no-build-isolation`): mypyc compiles against their
types. Without the variable the package is pure Python, as editable installs must be: an
extension module beside its source would shadow every edit of it. The gateway image
(deploy/docker/Dockerfile.gateway) is the compiled build; `make compiled` builds one into
build/compiled for the tests and the benchmarks.
"""

from __future__ import annotations

import os

from setuptools import setup

# Modules each request or streamed event runs through, and the pure code they call. Not here:
# api/app.py (FastAPI reads its endpoints' signatures) and the modules that run once or per
# scrape.
COMPILED = [
    "api/accounting.py",
    "api/connection.py",
    "api/limits.py",
    "api/media.py",
    "api/payload.py",
    "api/relay.py",
    "api/requests.py",
    "api/tenants.py",
    "cost.py",
    "errors.py",
    "flow.py",
    "metrics.py",
    "prompts.py",
    "routing.py",
    "workers/dispatcher.py",
    "workers/http1.py",
    "workers/registry.py",
    "workers/upstream.py",
]


def ext_modules() -> list[object]:
    if os.environ.get("MINERU_GATEWAY_COMPILE") != "1":
        return []
    from mypyc.build import mypycify

    return list(mypycify([f"src/mineru_gateway/{path}" for path in COMPILED], opt_level="3"))


def compiled_modules() -> list[str]:
    """The compiled modules' names (tests/conftest.py checks a compiled build imports them so)."""
    return ["mineru_gateway." + path.removesuffix(".py").replace("/", ".") for path in COMPILED]


if __name__ == "__main__":  # as pip's build runs it; the tests import COMPILED
    setup(ext_modules=ext_modules())
