"""What a web page must not make a browser do to a local `brisk serve`: the checks every request passes first.

A page the user opens can send "simple" cross-origin requests (a POST with `Content-Type: text/plain`) to
http://127.0.0.1:8000 without a CORS preflight, and, by DNS rebinding (its own name re-pointed at 127.0.0.1),
read the answers as if same-origin. Three checks close that, as llama.cpp's and Ollama's servers do:

  * Host: on a server bound to a loopback address, the `Host` header must be a loopback name or address
    (localhost, 127.0.0.1, [::1]), the bound address, or one of --allowed-hosts: a rebound name is refused (403).
    Bound to another address (0.0.0.0: reachable by the network anyway) any Host is accepted unless
    --allowed-hosts lists some.
  * Origin: a request carrying an `Origin` other than the server's own (scheme://Host) is refused (403) unless
    --allowed-origins lists it (CORS is answered for those). Clients that are not browsers send no Origin.
  * Content-Type: a POST body is read only as `application/json` (parameters such as charset allowed); anything
    else is a 415. A browser cannot send that type cross-origin without a preflight, which the Origin check refuses.

The checks are one pure ASGI middleware (RequestGuard), shared by the server and the data-parallel router.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

JSON_MEDIA_TYPE = "application/json"
_BODY_METHODS = {"POST", "PUT", "PATCH"}
_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_loopback(name: str) -> bool:
    """localhost (and *.localhost, which browsers resolve to loopback themselves) or a loopback address."""
    name = name.lower().rstrip(".").strip("[]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header (or bound address) -> (lowercase name without brackets, port or None): "[::1]:8000" ->
    ("::1", 8000), "Example.com" -> ("example.com", None)."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") > 1:  # a bare IPv6 address (a bound host, never a Host header)
        name, port = value, ""
    else:
        name, _, port = value.partition(":")
    return name.rstrip("."), int(port) if port.isdigit() else None


def normalize_origin(origin: str) -> str:
    """An --allowed-origins entry as browsers write Origin (lowercase, no trailing slash); ValueError if it is not
    '*', 'null' or scheme://host[:port]."""
    origin = origin.strip().rstrip("/").lower()
    if origin in ("*", "null"):
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ValueError(f"--allowed-origins: {origin!r} is not an origin; write it as a browser sends it, "
                         "scheme://host[:port] (http://localhost:3000), or '*' for any")
    return origin


def split_list(value: str | None) -> list[str]:
    """A comma-separated option value -> its non-empty items."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@dataclass
class AccessPolicy:
    """Which Host and Origin headers a server answers (see the module docstring)."""

    bind_host: str = "127.0.0.1"  # the address the server listens on
    allowed_origins: list[str] = field(default_factory=list)  # besides its own origin; "*" = any
    allowed_hosts: list[str] = field(default_factory=list)  # besides loopback and the bound address; "*" = any

    def __post_init__(self) -> None:
        self.allowed_origins = [normalize_origin(o) for o in self.allowed_origins]
        self.allowed_hosts = ["*" if h.strip() == "*" else split_host(h)[0] for h in self.allowed_hosts]
        self.bound_name = split_host(self.bind_host)[0]
        self.check_hosts = "*" not in self.allowed_hosts and (is_loopback(self.bound_name) or bool(self.allowed_hosts))

    def host_allowed(self, host: str) -> bool:
        if not self.check_hosts or not host:  # no Host header: HTTP/1.0, not a browser
            return True
        name = split_host(host)[0]
        return is_loopback(name) or name == self.bound_name or name in self.allowed_hosts

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or not host:
            return False
        try:
            origin_port = parts.port or _DEFAULT_PORTS[parts.scheme]
        except ValueError:  # a port that is not a number
            return False
        name, port = split_host(host)
        return (parts.hostname, origin_port) == (name.strip("[]"), port or _DEFAULT_PORTS[parts.scheme])

    def refusal(self, method: str, headers: dict[str, str]) -> tuple[int, str, str, str] | None:
        """(status, message, error type, code) for a request that must not be answered; None if it may."""
        host = headers.get("host", "")
        if not self.host_allowed(host):
            listed = f", {', '.join(self.allowed_hosts)}" if self.allowed_hosts else ""
            return (403, f"the Host header {host!r} does not name this server (bound to {self.bind_host}, it answers "
                         f"to localhost, 127.0.0.1, [::1]{listed}); a web page may be trying to reach it through its "
                         f"own domain (DNS rebinding). To serve under that name, start brisk serve with "
                         f"--allowed-hosts {split_host(host)[0]}", "permission_error", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            return (403, f"requests from the web origin {origin!r} are refused: a page on another origin may not use "
                         f"this server. To let that site call it from the browser, start brisk serve with "
                         f"--allowed-origins {origin}", "permission_error", "origin_not_allowed")
        if method in _BODY_METHODS:
            content_type = headers.get("content-type")
            media_type = (content_type or "").split(";", 1)[0].strip().lower()
            if media_type != JSON_MEDIA_TYPE:
                got = f"got {content_type!r}" if content_type is not None else "none was sent"
                return (415, f"the request body must be JSON sent as 'Content-Type: application/json' ({got})",
                        "invalid_request_error", "unsupported_media_type")
        return None


class RequestGuard:
    """Pure ASGI middleware answering AccessPolicy's refusals with an OpenAI error object (BaseHTTPMiddleware would
    wrap `receive` and break the disconnect watcher)."""

    def __init__(self, app: Any, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for key, value in scope.get("headers", []):
            headers.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        refused = self.policy.refusal(scope.get("method", "GET"), headers)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message, err_type, code = refused
        body = json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
