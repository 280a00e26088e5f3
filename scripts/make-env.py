#!/usr/bin/env python3
"""Writes .env for docker-compose.yml from .env.example, with secrets generated here: a client
API key (API_KEYS), an admin key (ADMIN_KEYS) and Grafana's admin password, so a new box is not
open to whoever reaches its port. Prints the client key, for MinerU's MINERU_VL_API_KEY.

    scripts/make-env.py            writes ./.env (refuses to replace one: --force)
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

GENERATED = {
    "API_KEYS": lambda: "sk-mineru-" + secrets.token_urlsafe(24),
    "ADMIN_KEYS": lambda: "sk-mineru-admin-" + secrets.token_urlsafe(24),
    "GRAFANA_ADMIN_PASSWORD": lambda: secrets.token_urlsafe(18),
}


def render(example: str, values: dict[str, str]) -> str:
    """`example` with each `NAME=` line of `values` set to its value."""
    for name, value in values.items():
        example, count = re.subn(rf"^{name}=.*$", f"{name}={value}", example, flags=re.M)
        if count != 1:
            raise SystemExit(f"make-env: .env.example has {count} lines {name}=, expected 1")
    return example


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("."), help="the checkout (default: .)")
    parser.add_argument("--force", action="store_true", help="replace an existing .env")
    args = parser.parse_args(argv)
    target = args.dir / ".env"
    if target.exists() and not args.force:
        print(f"make-env: {target} exists; --force replaces it", file=sys.stderr)
        return 1
    values = {name: make() for name, make in GENERATED.items()}
    text = render((args.dir / ".env.example").read_text(), values)
    descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # secrets
    os.fchmod(descriptor, 0o600)  # a replaced .env too
    with os.fdopen(descriptor, "w") as env_file:
        env_file.write(text)
    print(f"wrote {target} (mode 600): client API key {values['API_KEYS']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
