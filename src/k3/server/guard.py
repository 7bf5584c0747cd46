"""What every request passes before an endpoint sees it, as ASGI middleware: the API key (compared in
constant time), the body-size limit (413 before any parsing; a body without Content-Length is counted as
it arrives) and, once shutdown has begun, 503 for new work."""

import hmac
from dataclasses import dataclass

from k3.server.errors import error_response

PROTECTED_PREFIX = "/v1/"  # /health and /metrics stay open, for load balancers and scrapers


@dataclass
class ServerState:
    draining: bool = False  # set on SIGTERM: running requests finish, new ones are refused


class Guard:
    def __init__(self, app, max_body_bytes: int, api_key: str | None, state: ServerState):
        self.app, self.max_body_bytes, self.state = app, max_body_bytes, state
        self.api_key = api_key.encode() if api_key else None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest on equal-typed bytes: the time taken does not depend on where a wrong key differs
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        protected = scope["path"].startswith(PROTECTED_PREFIX)
        if protected and self.api_key is not None and not self._authorized(headers):
            response = error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            return await response(scope, receive, send)
        if protected and self.state.draining:
            response = error_response(503, "the server is shutting down and takes no new requests",
                                      code="shutting_down")  # fmt: skip
            return await response(scope, receive, send)
        too_large = error_response(413, f"the request body exceeds {self.max_body_bytes:,} bytes (--max-body-bytes)",
                                   code="request_too_large")  # fmt: skip
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await too_large(scope, receive, send)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        # read the whole body first (it is small by the limit), then hand it to the app in one message
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, which streaming responses listen for

        return await self.app(scope, replay, send)
