"""`value`: frozen to mypy, a plain slotted dataclass at run time, with a frozen one's equality."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

from mineru_gateway.values import value


@value
class Pair:
    left: int
    right: str = "r"


def test_a_value_compares_hashes_and_replaces_as_a_frozen_dataclass_would() -> None:
    pair = Pair(1)
    assert pair == Pair(1, "r") and pair != Pair(2)
    assert len({pair, Pair(1), Pair(2)}) == 2
    assert replace(pair, right="x") == Pair(1, "x")
    assert not hasattr(pair, "__dict__")  # slotted: no per-instance dict


def test_assigning_a_field_of_a_value_is_a_type_error(tmp_path: Path) -> None:
    module = tmp_path / "assign.py"
    module.write_text(
        textwrap.dedent(
            """
            from mineru_gateway.values import value

            @value
            class Pair:
                left: int

            Pair(1).left = 2
            """
        )
    )
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(module)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 1, checked.stdout
    assert "read-only" in checked.stdout
