"""Key files and the tenants file, watched: a change on disk takes effect without a restart.

Each gateway process looks at the files every `reload_interval_s` (their stat: inode, mtime and
size of the file each path resolves to; no inotify, which misses a Kubernetes Secret's update:
the kubelet swaps a `..data` symlink to a new directory, so the path resolves to a new inode
while the watched name itself never changes). A change is applied once two looks in a row agree,
so a file caught half-written by an in-place edit is not taken. Then every file is read again
and checked (config.read_credentials); good, the settings' credentials and the tenant directory
are replaced whole; bad, the old ones stay, with a log line and
`mineru_gateway_config_reload_total{result="refused"}`. docs/usage.md, "Reloading keys and
tenants".
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from mineru_gateway.api.tenants import TenantDirectory
from mineru_gateway.config import GatewaySettings
from mineru_gateway.metrics import Counter
from mineru_gateway.periodic import Periodic

log = structlog.get_logger("mineru_gateway.reload")

FileState = tuple[int, int, int] | None  # (inode, mtime in ns, size); None: unreadable
Signature = tuple[tuple[str, FileState], ...]

APPLIED = "applied"
REFUSED = "refused"


def file_state(path: Path) -> FileState:
    try:
        stat = os.stat(path)  # follows symlinks: a swapped `..data` link is a new inode
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


def signature(paths: list[Path]) -> Signature:
    return tuple((str(path), file_state(path)) for path in paths)


class CredentialWatcher:
    """Reloads `settings`' credentials and `tenants` when the files they come from change."""

    def __init__(
        self, settings: GatewaySettings, tenants: TenantDirectory, reloads: Counter
    ) -> None:
        self._settings = settings
        self._tenants = tenants
        self._reloads = reloads
        self._applied = signature(settings.credential_files())  # what the settings hold
        self._seen = self._applied  # at the last look
        self._loop = Periodic("credential-watch", settings.reload_interval_s, self._look)

    @property
    def watching(self) -> bool:
        return bool(self._applied)

    def start(self) -> None:
        if self.watching:
            self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def _look(self) -> None:
        self.check()

    def check(self) -> str | None:
        """One look: APPLIED or REFUSED when a settled change was acted on, else None."""
        now = signature(self._settings.credential_files())
        settled, self._seen = now == self._seen, now
        if not settled or now == self._applied:
            return None
        try:
            self._settings.reload_credentials()
        except (OSError, ValueError) as error:
            # A refused change is not tried again until the files change once more.
            self._applied = now
            self._reloads.inc(REFUSED)
            log.error("config_reload_refused", error=str(error), kept="the previous keys")
            return REFUSED
        self._tenants.refresh()
        # The tenants file may name other key files now: watch what was just read.
        self._applied = self._seen = signature(self._settings.credential_files())
        self._reloads.inc(APPLIED)
        log.info("config_reloaded", tenants=sorted(self._tenants.policies()))
        return APPLIED
