"""The listening socket the service serves on."""

from __future__ import annotations

import asyncio
import socket

from monitor.api.server import bind


def test_connections_on_the_service_socket_send_without_nagle_delays() -> None:
    """asyncio turns Nagle's algorithm off only on sockets whose ``proto`` says TCP; with it on,
    each kept-alive request waited ~40 ms for the client's delayed ACK (a sender posting one
    batch after another fell behind a trainer by seconds)."""
    listening = bind("127.0.0.1", 0)
    port = listening.getsockname()[1]
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted = transport.get_extra_info("socket")
            seen.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=listening)
        async with server:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(accept_one())
    assert seen and seen[0] != 0
