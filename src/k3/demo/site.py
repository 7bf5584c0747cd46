"""What the routing demo answers at each path, without a web framework: the page's static files (package data in
k3/demo/static) and the JSON endpoints. The ASGI app and the stdlib server in `server.py` are thin adapters over
`respond`, so both serve the same bytes.

Paths are relative to where the demo is mounted (`/` for `k3 demo routing`, `/demo/routing/` under `k3 serve`);
the page refers to everything relatively, so it works under either.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

from k3.demo.routing import describe_limits, route_query

STATIC = {  # path -> (file in k3/demo/static, content type)
    "/": ("routing.html", "text/html; charset=utf-8"),
    "/routing.js": ("routing.js", "text/javascript; charset=utf-8"),
    "/routing.css": ("routing.css", "text/css; charset=utf-8"),
}
JSON = "application/json"


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes


def json_reply(status: int, value) -> Reply:
    return Reply(status, JSON, json.dumps(value, allow_nan=False).encode())


def static_file(name: str) -> bytes:
    return resources.files("k3.demo").joinpath("static", name).read_bytes()


def respond(path: str, query: Mapping[str, str]) -> Reply:
    """The reply to a GET of `path` (mount-relative) with its query parameters (one value each)."""
    if path in STATIC:
        name, content_type = STATIC[path]
        return Reply(200, content_type, static_file(name))
    if path == "/api/route":
        return json_reply(*route_query(query))
    if path == "/api/limits":
        return json_reply(200, describe_limits())
    known = ", ".join([*STATIC, "/api/route", "/api/limits"])
    return json_reply(404, {"error": {"message": f"no page at {path!r} in the routing demo; it serves {known}"}})
