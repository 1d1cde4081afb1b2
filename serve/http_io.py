"""What stands between a connection and a route: the server's operating options, API-key auth, reading a JSON
body (media type, size, time limit, a client that leaves mid-body), and what unauthenticated callers may see.

Auth is SGLang's `--api-key`: every route but /health needs `Authorization: Bearer <key>`. Callers without a
valid key (every caller, when the server has no key) see server info with absolute paths cut to their last
component and without the distributed coordinator's address.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from serve import protocol
from serve.protocol import APIError

log = logging.getLogger("serve.server")

OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers probe it)
PRIVATE_KEYS = ("dist_init_addr",)  # server-info fields only authenticated callers see
SECRET_KEYS = ("api_key",)  # never shown


@dataclass(frozen=True)
class ServeOptions:
    """How the HTTP server runs (launch flags of the same names).

    api_key: Bearer key for every route but /health (None: no auth). random_seed: source of per-request seeds
    for requests without one (None: random per start). max_queued_requests: waiting requests beyond which a new
    one gets 503 (None: unbounded). request_timeout_s: a request's limit from arrival (None: none).
    body_timeout_s: how long a request body may take to arrive (408 after)."""

    api_key: str | None = None
    random_seed: int | None = None
    max_queued_requests: int | None = None
    request_timeout_s: float | None = None
    body_timeout_s: float = 30.0

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"--body-timeout must be > 0 seconds, got {self.body_timeout_s}")
        if self.random_seed is not None and not 0 <= self.random_seed < protocol.MAX_SEED:
            raise ValueError(f"--random-seed must be in [0, 2**64), got {self.random_seed}")


class ApiKeyMiddleware:
    """ASGI middleware: 401 without `Authorization: Bearer <api_key>` (except OPEN_PATHS); marks the request
    authenticated in its scope state either way it passes."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
        ok = self.api_key is not None and hmac.compare_digest(auth, b"Bearer " + self.api_key.encode())
        scope.setdefault("state", {})["authenticated"] = ok
        if self.api_key is None or ok or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        e = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                     type="authentication_error", code="invalid_api_key")
        body = json.dumps(e.body()).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def authenticated(request: Request) -> bool:
    return bool(request.scope.get("state", {}).get("authenticated"))


def public_view(info: dict, authenticated: bool) -> dict:
    """Server info as this caller may see it (see the module docstring)."""
    out = {}
    for k, v in info.items():
        if k in SECRET_KEYS or (k in PRIVATE_KEYS and not authenticated):
            continue
        if isinstance(v, str) and os.path.isabs(v) and not authenticated:
            v = os.path.basename(os.path.normpath(v))
        out[k] = v
    return out


async def read_json_body(request: Request, timeout_s: float) -> dict:
    """The request's JSON object: 415 unless the Content-Type is application/json, 413 past the size limit,
    408 when it takes longer than `timeout_s` to arrive, 400 for anything protocol.parse_body refuses."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got '{media or '(none)'}'",
                       param="content-type", code="unsupported_media_type")
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > protocol.MAX_BODY_BYTES:
        raise APIError(413, f"request body is {n} bytes; the limit is {protocol.MAX_BODY_BYTES}",
                       code="body_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > protocol.MAX_BODY_BYTES:
                    raise APIError(413, f"request body exceeds the limit of {protocol.MAX_BODY_BYTES} bytes",
                                   code="body_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)",
                       code="body_timeout") from None
    except ClientDisconnect:
        log.warning("%s %s: the client disconnected while sending its body (%d bytes came)", request.method,
                    request.url.path, size)
        raise APIError(400, "client disconnected", code="client_disconnected") from None
    return protocol.parse_body(b"".join(chunks))
