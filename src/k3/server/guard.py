"""What every request passes before an endpoint sees it, as ASGI middleware: the API key (compared in
constant time), the body (at most max_body_bytes, 413 before any parsing, counted as it arrives when there is
no Content-Length; whole within body_timeout_s, else 408; for /v1, JSON without NaN or Infinity nested at most
max_json_depth deep, else 400), once shutdown has begun 503 for new work, and a deadline on every write of
the response (a client that stopped reading is disconnected and its requests aborted). It also counts the
/v1 requests in flight, which is what a draining server waits for."""

import asyncio
import functools
import hmac
import json
import logging
from dataclasses import dataclass

from k3.server import connections
from k3.server.errors import error_response
from k3.server.limits import ServerLimits

log = logging.getLogger("k3.server")
PROTECTED_PREFIX = "/v1/"  # /health and /metrics stay open, for load balancers and scrapers


@dataclass
class ServerState:
    draining: bool = False  # set on SIGTERM: running requests finish, new ones are refused
    in_flight: int = 0  # /v1 requests whose response has not been sent in full


class ClientGone(Exception):
    """A response write waited longer than write_timeout_s on the client: the connection is closed."""


class _Constant:
    """Where Python's json met NaN, Infinity or -Infinity: found afterwards, to name the field."""

    def __init__(self, name: str):
        self.name = name


def json_problem(body: bytes, max_depth: int) -> tuple[str, str | None] | None:
    """(why, the field's dotted path or None) when a request body is not JSON this server takes, None when it
    is: NaN/Infinity anywhere (Python's json accepts them; no other JSON parser does), or nesting deeper than
    max_depth. Walked without recursion, so no depth the parser accepts can exhaust the stack here."""
    try:
        value = json.loads(body, parse_constant=_Constant)
    except RecursionError:
        return f"the request body nests deeper than {max_depth} levels", None
    except ValueError as e:  # also bad UTF-8 and malformed JSON
        return f"the request body is not valid JSON: {e}", None
    stack = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, _Constant):
            where = ".".join(map(str, path)) or None
            return (
                f"{where or 'the body'}: {item.name} is not a number JSON allows (NaN and infinities are refused)",
                where,
            )
        if len(path) > max_depth:
            return f"{path[0]}: nests deeper than {max_depth} levels (a request's JSON may nest {max_depth})", str(
                path[0]
            )
        if isinstance(item, dict):
            stack.extend((child, (*path, key)) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, (*path, i)) for i, child in enumerate(item))
    return None


class Guard:
    def __init__(self, app, limits: ServerLimits, api_key: str | None, state: ServerState, metrics=None):
        self.app, self.limits, self.state, self.metrics = app, limits, state, metrics
        self.api_key = api_key.encode() if api_key else None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest on equal-typed bytes: the time taken does not depend on where a wrong key differs
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _refuse(self, scope, receive, send, status: int, message: str, code: str, headers=None, param=None):
        if self.metrics is not None:
            self.metrics.rejections.labels(str(status)).inc()
        await error_response(status, message, param, code, headers)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        self.state.in_flight += 1
        try:
            return await self._protected(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    async def _protected(self, scope, receive, send):
        headers = dict(scope.get("headers") or ())
        refuse = functools.partial(self._refuse, scope, receive, send)
        if self.api_key is not None and not self._authorized(headers):
            message = "missing or wrong API key: send the header 'Authorization: Bearer KEY'"
            return await refuse(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if self.state.draining:
            return await refuse(503, "the server is shutting down and takes no new requests", "shutting_down")
        limit = self.limits.max_body_bytes
        too_large = f"the request body exceeds {limit:,} bytes (--max-body-bytes)"
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await refuse(413, too_large, "request_too_large")
        body = b""
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            body = await self._read_body(receive)
            if body is None:
                return None  # the client went away while sending
            if body == 413:
                return await refuse(413, too_large, "request_too_large", {"Connection": "close"})
            if body == 408:
                late = f"the request body did not arrive within {self.limits.body_timeout_s:g} s (--body-timeout)"
                return await refuse(408, late, "request_timeout", {"Connection": "close"})
            problem = json_problem(body, self.limits.max_json_depth) if body.strip() else None
            if problem is not None:
                return await refuse(400, problem[0], "invalid_value", param=problem[1])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, which streaming responses listen for

        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.limits.write_timeout_s)
            except TimeoutError:
                raise ClientGone(f"a write waited {self.limits.write_timeout_s:g} s on the client") from None

        try:
            return await self.app(scope, replay, timed_send)
        except ClientGone as e:
            log.info("k3 server: %s %s: %s; disconnected it", scope["method"], scope["path"], e)
            connections.close(scope.get("client"))
            await asyncio.sleep(0)  # let the transport report the close before uvicorn looks at this response
            return None

    async def _read_body(self, receive) -> bytes | int | None:
        """The whole body (it is small by the limit), 413 past max_body_bytes, 408 past body_timeout_s, None
        if the client disconnected."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return 408
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                return 413
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
