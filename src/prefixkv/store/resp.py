"""``Resp``: one connection to a Redis server, speaking RESP2 over a socket, that reads a
value straight into the caller's buffers (no bytes object per value, no copy past the
socket's) and bounds every call by one deadline.

It is every call of ``RedisStore`` (reads, writes, existence checks): commands are sent
pipelined, replies are parsed from a 64 KiB buffer, and a bulk reply as large as a KV
block is received into its destination views directly. Every receive waits at most until
the call's deadline, so a server that trickles its answer fails the call at the deadline,
not a timeout per read later. A connection that failed mid-reply is closed (its stream
position is lost).
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Sequence
from typing import cast

from .protocol import ReadOutcome

Address = tuple[str, ...] | tuple[str, str, int]
"""``("unix", path)`` or ``("tcp", host, port)``."""
_CHUNK = 1 << 16  # the read buffer; larger payload reads go straight into their views


class RespError(Exception):
    """An error reply of the server (for one command: WRONGTYPE, MOVED, OOM...)."""


Buffer = bytes | bytearray | memoryview
Packed = bytes | tuple[Buffer, ...]
"""A packed command: bytes, or a tuple of buffers that are its bytes in order."""


def pack(*args: bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def pack_set(key: bytes, value: Buffer, ex: bytes) -> tuple[Buffer, ...]:
    """``SET key value EX ex`` packed as three buffers, the value itself the middle one
    (not copied)."""
    n = value.nbytes if type(value) is memoryview else len(value)
    return (b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, n), value,
            b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ex), ex))


class Resp:
    """A connection to ``address``: ``("unix", path)`` or ``("tcp", host, port)``;
    ``tls``: an ``ssl.SSLContext`` (rediss://); ``username``/``password``: AUTH; ``db``:
    SELECT. Opened on ``open``; raises OSError (TimeoutError past a deadline),
    ConnectionError when the server closes, RespError when AUTH or SELECT is refused."""

    def __init__(self, address: Address, *, tls: ssl.SSLContext | None = None,
                 username: str | None = None, password: str | None = None, db: int = 0) -> None:
        self.address, self.tls = address, tls
        self.username, self.password, self.db = username, password, db
        self.sock: socket.socket | None = None
        self._buf = bytearray(_CHUNK)
        self._view = memoryview(self._buf)
        self._r = self._w = 0

    def open(self, deadline: float) -> None:
        """Connect (and authenticate, select the db) before ``deadline``."""
        left = _left(deadline)
        if self.address[0] == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(left)
            try:
                sock.connect(self.address[1])
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.address[1], int(self.address[2])), timeout=left)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.address[1])
        self.sock, self._r, self._w = sock, 0, 0
        setup = []
        if self.password is not None:
            auth = [self.password.encode()] if self.username is None else [self.username.encode(),
                                                                          self.password.encode()]
            setup.append(pack(b"AUTH", *auth))
        if self.db:
            setup.append(pack(b"SELECT", str(self.db).encode()))
        if setup:
            self.send(b"".join(setup), deadline)
            for _ in setup:
                answer = self.reply(deadline)
                if isinstance(answer, RespError):
                    self.close()
                    raise answer

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def idle_ok(self) -> bool:
        """Whether this idle connection can take a command: open, nothing left unread,
        and nothing to read (a server never speaks unasked: readable means it closed or
        reset the connection). No round trip."""
        sock = self.sock
        if sock is None or self._r != self._w:
            return False
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def send(self, data: bytes | Sequence[Packed], deadline: float) -> None:
        """Send ``data`` before ``deadline``: packed commands, or a list of them, each
        bytes or a tuple of buffers (``pack_set``: a large value goes out from its own
        buffer, not copied; the small parts between large ones go out joined)."""
        if type(data) is bytes:
            self._send(data, deadline)
            return
        small: list[Buffer] = []
        size = 0
        for command in cast("Sequence[Packed]", data):
            parts = command if isinstance(command, tuple) else (command,)
            for buf in parts:
                n = buf.nbytes if type(buf) is memoryview else len(buf)
                if n >= _CHUNK:
                    if small:
                        self._send(b"".join(small), deadline)
                        small, size = [], 0
                    self._send(buf, deadline)
                    continue
                small.append(buf)
                size += n
                if size >= _CHUNK:
                    self._send(b"".join(small), deadline)
                    small, size = [], 0
        if small:
            self._send(b"".join(small), deadline)

    def _send(self, data: Buffer, deadline: float) -> None:
        sock = self.sock
        assert sock is not None, "send on a closed connection"
        view, sent = memoryview(data).cast("B"), 0
        while sent < len(view):
            sock.settimeout(_left(deadline))
            sent += sock.send(view[sent:])

    def reply(self, deadline: float) -> object:
        """The next reply: bytes (simple or bulk string), int, None (nil), a list, or a
        RespError (returned, not raised: it answers one command)."""
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n)
            self._into(memoryview(out), deadline)
            self._skip(2, deadline)
            return bytes(out)
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply(deadline) for _ in range(n)]
        raise ConnectionError(f"not a RESP reply: {line[:40]!r}")

    def bulk_into(self, views: Sequence[memoryview], total: int, deadline: float) -> ReadOutcome:
        """The next reply, a bulk string of exactly ``total`` bytes, received into
        ``views`` in order: True; None for nil; the length of a bulk string of another
        length (skipped, nothing written); a RespError for an error reply."""
        line = self._line(deadline)
        kind = line[:1]
        if kind == b"-":
            return RespError(line[1:].decode(errors="replace"))
        if kind != b"$":
            self._skip_reply(line, deadline)
            return RespError(f"a {kind!r} reply where a value was expected")
        n = int(line[1:])
        if n < 0:
            return None
        if n != total:
            self._skip(n + 2, deadline)
            return n
        for v in views:
            self._into(v, deadline)
        self._skip(2, deadline)
        return True

    # ---- the buffer --------------------------------------------------------------------

    def _fill(self, deadline: float) -> None:
        """Receive more into the buffer (compacting it first when its end is reached)."""
        if self._r == self._w:
            self._r = self._w = 0
        elif self._w == len(self._buf):
            n = self._w - self._r
            self._buf[:n] = self._buf[self._r:self._w]
            self._r, self._w = 0, n
        sock = self.sock
        assert sock is not None, "read on a closed connection"
        sock.settimeout(_left(deadline))
        got = sock.recv_into(self._view[self._w:])
        if not got:
            raise ConnectionError("the server closed the connection")
        self._w += got

    def _line(self, deadline: float) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._r, self._w)
            if i >= 0:
                line = bytes(self._view[self._r:i])
                self._r = i + 2
                return line
            if self._w - self._r >= len(self._buf) - 2:
                raise ConnectionError("a reply line longer than the read buffer")
            self._fill(deadline)

    def _into(self, view: memoryview, deadline: float) -> None:
        """Fill ``view`` from the stream: what the buffer holds, then straight from the
        socket for large remainders."""
        n = min(len(view), self._w - self._r)
        view[:n] = self._view[self._r:self._r + n]
        self._r += n
        sock = self.sock
        while n < len(view):
            if len(view) - n >= _CHUNK // 2:
                assert sock is not None, "read on a closed connection"
                sock.settimeout(_left(deadline))
                got = sock.recv_into(view[n:])
                if not got:
                    raise ConnectionError("the server closed the connection")
                n += got
            else:
                self._fill(deadline)
                k = min(len(view) - n, self._w - self._r)
                view[n:n + k] = self._view[self._r:self._r + k]
                self._r += k
                n += k

    def _skip(self, n: int, deadline: float) -> None:
        while n:
            if self._r == self._w:
                self._fill(deadline)
            k = min(n, self._w - self._r)
            self._r += k
            n -= k

    def _skip_reply(self, line: bytes, deadline: float) -> None:
        """Consume the rest of a reply whose first line was ``line``."""
        kind = line[:1]
        if kind == b"$" and int(line[1:]) >= 0:
            self._skip(int(line[1:]) + 2, deadline)
        elif kind == b"*":
            for _ in range(max(int(line[1:]), 0)):
                self._skip_reply(self._line(deadline), deadline)


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError when it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the store did not answer before the deadline")
    return left
