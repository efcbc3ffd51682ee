"""A minimal HTTP/1.1 client over one kept-alive socket: just what the sender needs.

The sender's CPU is the trainer's CPU, and ``http.client`` costs about 350 us of it per request
on the reference CPU (request building with header validation, a buffered reader per response,
headers parsed by the ``email`` package); a request here costs about 100 us, mostly the send
and receive system calls. Requests are written in one ``sendall``; responses are read with
``Content-Length``, chunked transfer coding, or up to the connection's close, as RFC 9112
allows. Failures raise what ``http.client`` would: ``OSError`` for the network (a timeout
included), ``http.client.HTTPException`` for a malformed answer, and ``RemoteDisconnected`` for
a connection the server closed before answering (a kept-alive one it closed while idle).
"""

from __future__ import annotations

import http.client
import socket
import ssl

READ_CHUNK = 64 * 1024
MAX_HEAD = 64 * 1024  # status line and headers; anything longer is not the service


class Response:
    """A parsed status and head; the body is read by ``HttpConnection``."""

    __slots__ = ("chunked", "close", "length", "retry_after", "status")

    def __init__(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise http.client.BadStatusLine(lines[0].decode(errors="replace"))
        self.status = int(parts[1])
        self.length: int | None = None
        self.chunked = False
        self.close = parts[0] == b"HTTP/1.0"
        self.retry_after: str | None = None  # a 429's or 503's word on when to ask again
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = value.endswith(b"chunked")
            elif name == b"connection":
                self.close = value == b"close"
            elif name == b"retry-after":
                self.retry_after = value.decode("latin-1")


class HttpConnection:
    """One connection to ``host:port``; not thread-safe (each sender connection has one user)."""

    def __init__(self, host: str, port: int | None, *, https: bool, timeout_s: float) -> None:
        self._host = host
        self._port = port or (443 if https else 80)
        self._https = https
        self._timeout_s = timeout_s
        default_port = self._port == (443 if https else 80)
        self._host_header = host if default_port else f"{host}:{self._port}"
        self._socket: socket.socket | None = None
        self._buffer = b""
        self.retry_after: str | None = None
        """The ``Retry-After`` of the last answer read here (None: it had none)."""

    @property
    def is_open(self) -> bool:
        return self._socket is not None

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """Send one request and read its whole answer: (status, body)."""
        sock = self._socket or self._connect()
        lines = [f"{method} {path} HTTP/1.1", f"host: {self._host_header}"]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        if body is not None:
            lines.append(f"content-length: {len(body)}")
        sock.sendall("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (body or b""))
        response = self._read_head()
        while 100 <= response.status < 200:  # interim answers (100 Continue): the real one follows
            response = self._read_head()
        content = b"" if method == "HEAD" or response.status in (204, 304) else self._read_body(response)
        self.retry_after = response.retry_after
        if response.close:
            self.close()
        return response.status, content

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self._buffer = b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one write per request
        if self._https:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
        self._socket, self._buffer = sock, b""
        return sock

    def _receive(self) -> bytes:
        assert self._socket is not None
        data = self._socket.recv(READ_CHUNK)
        self._buffer += data
        return data

    def _read_head(self) -> Response:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD:
                raise http.client.LineTooLong("response head")
            if not self._receive():
                if self._buffer:
                    raise http.client.IncompleteRead(self._buffer)
                raise http.client.RemoteDisconnected("Remote end closed connection without response")
        head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
        return Response(head)

    def _read_body(self, response: Response) -> bytes:
        if response.chunked:
            return self._read_chunks()
        if response.length is None:  # delimited by the close
            while self._receive():
                pass
            response.close = True
            return self._take(len(self._buffer))
        return self._read_exactly(response.length)

    def _read_exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            if not self._receive():
                raise http.client.IncompleteRead(self._buffer, size - len(self._buffer))
        return self._take(size)

    def _read_line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD:
                raise http.client.LineTooLong("chunk size")
            if not self._receive():
                raise http.client.IncompleteRead(self._buffer)
        line = self._take(end)
        self._take(2)
        return line

    def _read_chunks(self) -> bytes:
        parts = []
        while True:
            size_text = self._read_line().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise http.client.IncompleteRead(size_text) from None
            if size == 0:
                break
            parts.append(self._read_exactly(size))
            self._read_exactly(2)  # the chunk's CRLF
        while self._read_line():  # trailer fields, up to the empty line
            pass
        return b"".join(parts)

    def _take(self, size: int) -> bytes:
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken
