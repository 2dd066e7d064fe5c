"""The WebSocket protocol class the server gives uvicorn: uvicorn's own
(websockets, sans-I/O), with a clean close of connections whose client
sent a message over the size limit.

uvicorn answers a frame (or a message of several frames) larger than
``ws_max_size`` (``[limits] max_message_bytes``) with a close frame, code
1009, and closes the socket at once. The client is usually still sending
the rest of its message, so the socket is closed with unread data, the
kernel resets the connection, and the client often never reads the close
frame: it sees an abnormal closure (1006) instead. Here the server sends the
close frame, shuts its side down (TCP FIN: the client reads the close frame
and the end of the stream) and reads and discards what the client still
sends, until the client closes or :data:`DRAIN_S` passed.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Longest a connection that failed is drained before it is closed, seconds.
DRAIN_S = 10.0


def protocol_class() -> Any:
    """The ``ws`` protocol class for ``uvicorn.Config`` (``"auto"``: uvicorn's
    choice, when its websockets sans-I/O protocol is not available)."""
    try:
        from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    except ImportError:  # pragma: no cover - an uvicorn without it
        return "auto"

    class DrainingWebSocketProtocol(WebSocketsSansIOProtocol):
        """uvicorn's protocol; after a parse failure (a message too big, a
        protocol error) the close frame reaches the client (see the module)."""

        _draining = False

        def data_received(self, data: bytes) -> None:
            if self._draining:
                return  # the rest of a refused message: discarded
            super().data_received(data)

        def handle_parser_exception(self) -> None:
            conn = self.conn
            assert conn.close_sent is not None
            self.queue.put_nowait({"type": "websocket.disconnect", "code": conn.close_sent.code, "reason": conn.close_sent.reason})
            self.transport.write(b"".join(conn.data_to_send()))
            self.close_sent = True
            self._draining = True
            if self.read_paused:
                self.read_paused = False
                self.transport.resume_reading()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            loop: asyncio.AbstractEventLoop = self.loop
            if self.close_timer is not None:
                self.close_timer.cancel()
            # a pending close timer also keeps uvicorn from closing the socket when the app returns
            self.close_timer = loop.call_later(DRAIN_S, self.transport.close)

    return DrainingWebSocketProtocol
