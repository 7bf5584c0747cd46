"""`k3 serve`: an OpenAI-compatible HTTP server over the async engine (docs/serving.md, "The server").

The app is `k3.server.app.create_app`; it needs the `serve` extra (fastapi, uvicorn, prometheus_client).
This package's top level imports none of them, so `k3 --help` works without the extra."""

from k3.server.limits import ServerLimits

__all__ = ["ServerLimits"]
