"""The server's listening socket (:func:`tartlet.server.app.listen_socket`):
the connections it accepts have Nagle's algorithm off (``TCP_NODELAY``), so
a reply written in two pieces (HTTP headers then body, a launch reply then
the instance's ``exit`` event, one streamed chunk after another) is not
held back until the client's delayed ACK (~40 ms on Linux)."""

from __future__ import annotations

import asyncio
import socket

from tartlet.server.app import listen_socket


def test_accepted_connections_have_nagle_off():
    async def main() -> tuple[int, int]:
        sock = listen_socket("127.0.0.1", 0)
        got: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()

        async def handle(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            s = w.get_extra_info("socket")
            got.set_result((s.proto, s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
            w.close()

        srv = await asyncio.start_server(handle, sock=sock)  # as uvicorn serves it: loop.create_server(sock=...)
        async with srv:
            _, w = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(got, 10)
            finally:
                w.close()

    proto, nodelay = asyncio.run(main())
    assert proto == socket.IPPROTO_TCP
    assert nodelay != 0
