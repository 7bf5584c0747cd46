"""Serving the routing demo: `routing_app()`, an ASGI app (Starlette) that `k3 serve` mounts at /demo/routing,
and `routing_http_server()`, the same replies from the standard library's http.server, which `k3 demo routing`
falls back to where Starlette or uvicorn is not installed. Both are thin adapters over `site.respond`."""

import logging
import socket
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

from k3.demo.site import Reply, respond

log = logging.getLogger("k3.demo")


def _headers(reply: Reply) -> dict[str, str]:
    # the page and its answers are computed or versioned with k3: no stale copy after an upgrade
    return {"Content-Type": reply.content_type, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def routing_app():
    """The demo as a Starlette app: GET only; the computation runs in a worker thread, off the event loop."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def endpoint(request: Request) -> Response:
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):  # mounted: the path below the mount point
            path = path[len(root) :] or "/"
        reply = await run_in_threadpool(respond, path, dict(request.query_params))
        return Response(reply.body, reply.status, headers=_headers(reply))

    return Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "HEAD"])])


class _Handler(BaseHTTPRequestHandler):
    server_version = "k3-demo"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        reply = respond(url.path, dict(parse_qsl(url.query, keep_blank_values=True)))
        self.send_response(reply.status)
        for name, value in {**_headers(reply), "Content-Length": str(len(reply.body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(reply.body)

    def log_message(self, format: str, *args) -> None:
        log.info("%s " + format, self.address_string(), *args)


def routing_http_server(host: str = "127.0.0.1", port: int = 8001) -> ThreadingHTTPServer:
    """A stdlib server bound to (host, port), not yet serving (call serve_forever; port 0 picks a free one)."""
    return ThreadingHTTPServer((host, port), _Handler)


def serve_routing(host: str, port: int, say: Callable[[str], None] = print) -> None:
    """Serve the demo until interrupted: uvicorn with the ASGI app when both are installed, else http.server.
    The address is bound first, so a port in use is an OSError here rather than a log line from uvicorn."""
    try:
        import uvicorn

        app = routing_app()
    except ImportError:
        with routing_http_server(host, port) as server:
            say(f"routing demo on http://{host}:{server.server_address[1]}/ (stdlib http.server; Ctrl-C stops it)")
            server.serve_forever()
        return
    sock = socket.create_server((host, port))
    say(f"routing demo on http://{host}:{sock.getsockname()[1]}/ (Ctrl-C stops it)")
    with sock:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
