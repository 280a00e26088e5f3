"""What the worker image adds to vLLM-Ascend's (mineru-vl-utils, for MinerU's logits processor) fits
that image's vLLM and Python, and reads the `vllm_xargs` MinerU 3's and 4's clients send. Asks
the package index for the wheel pip would install, as the image build does."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mineru_gateway.vllm_contract import IMAGE_VERSION
from tests.deploy.support import ROOT

DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile.worker"
# vLLM-Ascend v0.23.0's image: vLLM 0.23.0 on Python 3.12 (docs/facts/worker-image.md).
IMAGE_PYTHON = "3.12"
# What MinerU's clients put in `vllm_xargs` (mineru_vl_utils/vlm_client/http_client.py of 1.2.1
# and 2.0.7; tests/test_mineru_clients.py watches them being sent).
CLIENT_XARGS = {"no_repeat_ngram_size", "debug"}


def dockerfile_arg(name: str) -> str:
    match = re.search(rf'^ARG {name}="?([^"\n]+)"?$', DOCKERFILE.read_text(), re.M)
    assert match, name
    return match.group(1)


def test_the_image_is_a_final_vllm_ascend_release_of_the_supported_vllm() -> None:
    image = dockerfile_arg("VLLM_ASCEND_IMAGE")
    repository, tag = image.rsplit(":", 1)
    assert repository == "quay.io/ascend/vllm-ascend"
    version = Version(tag.removeprefix("v"))
    assert not version.is_prerelease, "a release candidate"
    assert version >= Version("0.23.0")
    # vLLM-Ascend's final releases carry the vLLM of the same number.
    assert str(version) == IMAGE_VERSION


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mineru-vl-utils wheel the image's pip would take for its Python."""
    into = tmp_path_factory.mktemp("mineru-vl-utils")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"),
            *("--only-binary=:all:", "--no-deps", "--python-version", IMAGE_PYTHON),
            *("--implementation", "cp", "-d", str(into), dockerfile_arg("MINERU_VL_UTILS")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (found,) = into.glob("*.whl")
    return found


def _metadata(wheel: Path) -> tuple[SpecifierSet, SpecifierSet]:
    """Its Requires-Python, and the vLLM versions its `vllm` extra declares."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(name).decode())
    vllm = [
        Requirement(line)
        for line in meta.get_all("Requires-Dist", [])
        if line.startswith("vllm") and 'extra == "vllm"' in line
    ]
    assert len(vllm) == 1, vllm
    return SpecifierSet(meta["Requires-Python"]), vllm[0].specifier


def test_its_mineru_vl_utils_declares_the_images_vllm_and_python(wheel: Path) -> None:
    python, vllm = _metadata(wheel)
    assert IMAGE_PYTHON + ".0" in python
    assert IMAGE_VERSION in vllm, f"{wheel.name} declares vllm{vllm}"


def test_its_logits_processor_reads_what_the_clients_send(wheel: Path) -> None:
    """The keys the processor takes from a request's `extra_args` (vLLM's name for
    `vllm_xargs`): every one MinerU's clients send is read, so neither client's
    `no_repeat_ngram_size` is lost on this image."""
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read("mineru_vl_utils/logits_processor/vllm_v1_no_repeat_ngram.py")
    read: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and any("extra_args" in ast.unparse(a) for a in node.args):
            read |= {a.value for a in node.args if isinstance(a, ast.Constant)}
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and "extra_args" in ast.unparse(node.func.value)
        ):
            read |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    assert read >= CLIENT_XARGS, read
