"""MinerU's own client (`mineru-vl-utils`) in a virtualenv of its own, created on first use.

Its base install is what its `http-client` backend needs and nothing heavy: httpx, httpx-retries,
aiofiles, pillow, pydantic, loguru, tqdm. torch, transformers and vLLM are only in its extras
(`[transformers]`, `[vllm]`, ...), which are not installed. After installing, this checks that no
torch, vllm or transformers came along and stops with an error if one did.

    python -m benchmarks.mineru_client.client_venv        # create or reuse, print its python
    python -m benchmarks.mineru_client.client_venv --version 1.2.1   # MinerU 3's client

MinerU 4 (4.0.x) requires mineru-vl-utils>=2.0.5,<3; MinerU 3 used the 1.2.x releases
(docs/mineru-client.md). `CLIENTS` names the release of each that the tests run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

VERSION = "2.0.7"
PACKAGE = f"mineru-vl-utils=={VERSION}"
CLIENTS = {"MinerU 3": "1.2.1", "MinerU 4": VERSION}
PYTHON = os.environ.get("PYTHON", "python3.11")
CACHE = Path(os.environ.get("MINERU_CACHE", Path.home() / ".cache" / "mineru-gateway"))
DEFAULT_VENV = Path(os.environ.get("MINERU_VL_UTILS_VENV", CACHE / f"mineru-vl-utils-{VERSION}"))
HEAVY = ("torch", "vllm", "transformers", "nvidia-cudnn-cu12", "triton")
MARKER = ".installed"


def venv_for(version: str) -> Path:
    """Where the client of `version` is installed by default."""
    return DEFAULT_VENV if version == VERSION else CACHE / f"mineru-vl-utils-{version}"


def ensure(venv: Path = DEFAULT_VENV, quiet: bool = True, version: str = VERSION) -> Path:
    """The venv's python, with `mineru-vl-utils==version` installed (created if missing)."""
    package = f"mineru-vl-utils=={version}"
    python = venv / "bin" / "python"
    if (venv / MARKER).exists() and python.exists():
        return python
    if not python.exists():
        subprocess.run([PYTHON, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", *(["--quiet"] if quiet else [])]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", package], check=True)
    installed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.lower()
    names = {line.split("==")[0] for line in installed.splitlines()}
    heavy = sorted(name for name in HEAVY if name in names)
    if heavy:
        raise SystemExit(f"{venv}: {package} pulled in {', '.join(heavy)}; stopping")
    (venv / MARKER).write_text(installed)
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=VERSION, help="mineru-vl-utils release")
    parser.add_argument("--venv", type=Path, help="default: one per release in the cache")
    args = parser.parse_args(argv)
    print(ensure(args.venv or venv_for(args.version), quiet=False, version=args.version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
