"""Which media URLs a request may carry: vLLM fetches http(s) media itself (and
`file://` under `--allowed-local-media-path`), so a client that names a URL makes the NPU host
fetch it, addresses inside the operator's network included (SSRF). Pure: no I/O.

    data       only inline `data:` URLs (the default; MinerU's client sends nothing else)
    allowlist  `data:` plus URLs whose host, or whose beginning, is on the allowlist
    any        whatever vLLM would accept
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from mineru_gateway.errors import InvalidRequest
from mineru_gateway.request import Request, param_of

MediaUrlPolicy = Literal["data", "allowlist", "any"]


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    mode: MediaUrlPolicy = "data"
    allowed: tuple[str, ...] = ()  # hosts ("docs.example.com") or URL prefixes ("https://x/")

    def allows(self, url: str) -> bool:
        if self.mode == "any" or url.startswith("data:"):
            return True
        if self.mode == "data":
            return False
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        web = parts.scheme in ("http", "https")
        return any(
            url.startswith(entry) if "://" in entry else web and host == entry.lower()
            for entry in self.allowed
        )

    def check(self, request: Request) -> None:
        """Raises InvalidRequest (400) naming the message and part of the first refused URL."""
        if self.mode == "any":
            return
        for media in request.urls:
            url = media.url
            if not self.allows(url):
                where = media.where
                raise InvalidRequest(
                    f"{where}: media URL {url[:80]!r} is not allowed: this gateway accepts "
                    + (
                        "inline data: URLs only (send the image base64-encoded)"
                        if self.mode == "data"
                        else "data: URLs and its allowlist only"
                    ),
                    param=param_of(where),
                )
