"""The connection layer under the app: a deadline for each request's headers, and a way for the app to close
the connection it is answering.

uvicorn parses a request's headers before the app is called and sets no deadline on them: a client sending
one byte a second (slowloris) holds a connection, and a slot of --max-connections, for as long as it likes.
`timed_protocol` wraps uvicorn's HTTP protocol class: each connection must deliver a whole request head within
header_timeout_s of opening, and of its previous response completing (the next request on a kept-alive
connection), or it is closed. A request whose head has arrived is the app's: its body and response have the
app's own timeouts (k3.server.guard).

`close(client)` closes the connection of an ASGI scope's `client` address. The app uses it when a client
stopped reading a response: the connection is closed at once, so uvicorn sees a disconnect rather than an app
that returned without finishing its response.
"""

import asyncio
import logging

log = logging.getLogger("k3.server")

# client (host, port) -> its open protocol instance; one entry per connection of any server in this process
_OPEN: dict[tuple, asyncio.Protocol] = {}


def close(client: tuple | list | None) -> bool:
    """Close the connection whose peer is `client` (an ASGI scope's "client"); False if none is known."""
    protocol = _OPEN.get(tuple(client)) if client else None
    if protocol is None:
        return False
    protocol.transport.close()
    return True


def timed_protocol(base: type, header_timeout_s: float) -> type:
    """A subclass of uvicorn's HTTP protocol class `base` (h11 or httptools: both keep the current request
    cycle as `self.cycle` and call `on_response_complete`) with a deadline on every request head."""

    class TimedProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_deadline = None
            if self.client:
                _OPEN[tuple(self.client)] = self
            self._arm()

        def _arm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            self._head_deadline = self.loop.call_later(header_timeout_s, self._head_overdue)

        def _head_overdue(self) -> None:
            self._head_deadline = None
            cycle = getattr(self, "cycle", None)
            waiting_for_head = cycle is None or cycle.response_complete
            if waiting_for_head and not self.transport.is_closing():
                log.info("k3 server: closed %s: no request head within %.0f s", self.client, header_timeout_s)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this kept-alive connection gets its own deadline

        def connection_lost(self, exc) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            if self.client and _OPEN.get(tuple(self.client)) is self:
                del _OPEN[tuple(self.client)]
            super().connection_lost(exc)

    TimedProtocol.__name__ = TimedProtocol.__qualname__ = f"Timed{base.__name__}"
    return TimedProtocol
