"""The listening socket the service serves on."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path

import pytest

from monitor.api.server import admin_token_for, bind
from monitor.config import ServiceConfig
from monitor.errors import ConfigError
from tests.support import cli_result


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


def test_a_new_admin_token_file_is_written_owner_only_and_read_back(tmp_path: Path) -> None:
    token_file = tmp_path / "store.db.admin-token"
    config, written = admin_token_for(ServiceConfig(), token_file)
    assert written == token_file and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert admin_token_for(ServiceConfig(), token_file)[0].admin_token == config.admin_token


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_an_admin_token_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    token_file = tmp_path / "store.db.admin-token"
    token_file.write_text("rh_admin_leaked\n")
    token_file.chmod(mode)
    with pytest.raises(ConfigError) as refused:
        admin_token_for(ServiceConfig(), token_file)
    message = str(refused.value)
    assert str(token_file) in message and f"{mode:04o}" in message and "\n" not in message


def test_serve_refuses_a_loose_admin_token_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RUNHEALTH_ADMIN_TOKEN", raising=False)

    def no_socket(host: str, port: int) -> socket.socket:
        raise AssertionError("serve went on to listen")  # instead of serving until killed

    monkeypatch.setattr("monitor.api.server.bind", no_socket)
    token_file = tmp_path / "t.admin-token"
    token_file.write_text("rh_admin_leaked\n")
    token_file.chmod(0o644)
    code, out, err = cli_result(
        capsys, "serve", "--db", str(tmp_path / "s.db"), "--admin-token-file", str(token_file)
    )
    assert code == 2 and out == ""
    assert err.startswith("runhealth: error: refusing the admin token file ") and err.count("\n") == 1, err
    assert not (tmp_path / "s.db").exists()  # refused before the store was opened


def test_an_owner_only_or_tighter_admin_token_file_is_used(tmp_path: Path) -> None:
    token_file = tmp_path / "t.admin-token"
    token_file.write_text("rh_admin_kept\n")
    token_file.chmod(0o400)
    assert admin_token_for(ServiceConfig(), token_file)[0].admin_token == "rh_admin_kept"
