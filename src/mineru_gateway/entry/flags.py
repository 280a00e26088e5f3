"""On/off flags, the same in every command: `--flag` / `--no-flag`.

Compose files and Kubernetes manifests pass a variable's value instead (`--flag=${VAR:-true}`),
so `--flag=false` and `--flag false` are accepted too, as true/false, yes/no or 1/0.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")


def parse_boolean(text: str) -> bool:
    """A flag's value as Compose or Kubernetes pass a variable: true/false, yes/no, 1/0."""
    value = text.strip().lower()
    if value not in (*_TRUE, *_FALSE):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in _TRUE


class Switch(argparse.Action):
    """`--name` sets True, `--no-name` False; `--name=VALUE` sets VALUE (see `parse_boolean`)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        default: Any = None,
        help: str | None = None,
        **kwargs: Any,
    ) -> None:
        names = [*option_strings]
        names += [f"--no-{name[2:]}" for name in option_strings if name.startswith("--")]
        super().__init__(names, dest, nargs="?", default=default, help=help, metavar="BOOL")

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        negated = option_string is not None and option_string.startswith("--no-")
        if values is None:
            setattr(namespace, self.dest, not negated)
            return
        if negated:
            raise argparse.ArgumentError(self, f"{option_string} takes no value")
        try:
            setattr(namespace, self.dest, parse_boolean(str(values)))
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentError(self, str(error)) from None


class HelpFormatter(argparse.HelpFormatter):
    """Shows a switch as `--name, --no-name`, not with a value after each."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Switch):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)
