"""`value`: a frozen dataclass as type checkers see it, a plain slotted one at run time.

For the small records every request builds (its parsed form, cost, admission, accounting record).
A frozen dataclass's `__init__` sets each field through `object.__setattr__`, several times the
cost of a slotted, unfrozen one, and every small request builds several (docs/proxy-costs.md).
Declared through PEP 681's `frozen_default`, assigning a field is still a mypy error (`mypy
--strict` runs in `make test`); equality and hashing are the frozen ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def value(cls: type[T]) -> type[T]:
    return dataclass(slots=True, unsafe_hash=True)(cls)
