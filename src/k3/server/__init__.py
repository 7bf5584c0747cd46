"""`k3 serve`: an OpenAI-compatible HTTP server over the async engine (docs/serving.md, "The server")."""

from k3.server.app import create_app
from k3.server.guard import ServerState
from k3.server.limits import ServerLimits

__all__ = ["ServerLimits", "ServerState", "create_app"]
