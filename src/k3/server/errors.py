"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure the server
answers: a client reading `error.message` learns what was wrong and what to do, whatever went wrong."""

import json
import logging
import math
import re
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("k3.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request the server answers with an error status; `param` names the offending field when there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def overloaded(retry_after_s: float, message: str) -> APIError:
    """429 with Retry-After in whole seconds (HTTP's unit), at least 1."""
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(
        429,
        f"the server is busy: {message}; retry after {seconds} s",
        code="overloaded",
        headers={"Retry-After": str(seconds)},
    )


_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|[\w-]+\[.*\])")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is not valid", None
    first = errors[0]
    # pydantic names the union member it tried (`stop.str`, `prompt.list[int].0`): not part of the field's path
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _UNION_MEMBER.fullmatch(str(x))]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{where}{first.get('msg')}{more}", param


def _count(request: Request, status: int) -> None:
    """k3_requests_rejected_total{status}: every refusal the server answers, validation's included."""
    server = getattr(request.app.state, "server", None)
    if server is not None and status >= 400 and status != 500:  # a 500 is a failure of the server, not a refusal
        server.metrics.rejections.labels(str(status)).inc()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        _count(request, exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        _count(request, 400)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        _count(request, exc.status_code)
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        _count(request, 400)
        return error_response(400, f"the request body is not valid JSON: {exc}")


class Shield:
    """Innermost middleware: an exception no handler answered is logged once, with an id, and answered 500 in
    OpenAI's shape without its text (internals are the log's, not the client's) when the response has not
    begun. It is never re-raised: Starlette's outer error middleware would log it a second time and uvicorn
    would then drop the client's kept-alive connection, failing its next request too. Exceptions that are not
    errors of the route (a client gone, a cancellation) pass through."""

    def __init__(self, app, passthrough: tuple[type[BaseException], ...] = ()):
        self.app, self.passthrough = app, passthrough

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            return await self.app(scope, receive, watched_send)
        except self.passthrough:
            raise
        except Exception:
            ref = secrets.token_hex(4)
            log.exception("k3 server: unexpected error %s on %s %s", ref, scope.get("method"), scope.get("path"))
            if not started:
                message = f"internal server error; the server log has the details under id {ref}"
                await error_response(500, message, code="internal_error")(scope, receive, send)
