"""The Redis tier's side of RESP: small commands packed by hand, and replies read straight off the socket, a
block's bytes into the buffer that is waiting for them.

redis-py (with hiredis or without) builds every bulk reply as a bytes object, and the tier then copied it into
a host slot: two copies of every block read. Here a value of the size a block has goes header first into a
small buffer and payload straight into the slot (one kernel copy, no Python object); anything else (nil, an
error, a value of another size) is read whole, as redis-py would, and judged by the caller.
"""

from __future__ import annotations

import socket
from typing import Any

from redis.exceptions import AskError, ClusterDownError, MovedError, ResponseError, TryAgainError

_LINE_READ = 4096  # a reply's first line is short: read little past it, so a block's bytes mostly land in place
# A cluster's error replies that say where to go, as redis-py's parser raises them (its message without the code)
_REDIRECTS = {"MOVED": MovedError, "ASK": AskError, "TRYAGAIN": TryAgainError, "CLUSTERDOWN": ClusterDownError}


def bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def command(*args: bytes) -> bytes:
    """One command in RESP, for small arguments."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args)


def responses(conn: Any, n: int) -> list[Any]:
    """`n` replies parsed by redis-py; an error reply comes back as a ResponseError in its place."""
    replies: list[Any] = []
    for _ in range(n):
        try:
            replies.append(conn.read_response())
        except ResponseError as e:  # the reply was read whole: the connection is still in step
            replies.append(e)
    return replies


def error_reply(message: str) -> ResponseError:
    """An error reply as redis-py would raise it: a cluster's redirect (MOVED, ASK, ...) as its own class."""
    code, _, rest = message.partition(" ")
    kind = _REDIRECTS.get(code)
    return kind(rest) if kind is not None else ResponseError(message)


class Replies:
    """RESP2 replies on one connected socket, read in order; only the kinds the tier's reads get back."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()  # read past the last reply's end: the next reply's first bytes

    def bulk_into(self, header: memoryview, payload: memoryview) -> bytes | bool | ResponseError | None:
        """One bulk-string reply: True when its value was exactly `header` + `payload` bytes long and now fills
        them; else the value itself (bytes), None for nil, the error for an error reply."""
        line = self._line()
        if line[:1] == b"-":
            return error_reply(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            return None  # nothing a GET returns
        length = int(line[1:])
        if length < 0:
            return None
        if length != len(header) + len(payload):
            value = bytearray(length + 2)
            self._exact(memoryview(value))
            return bytes(value[:length])
        self._exact(header)
        self._exact(payload)
        if self._line():  # the value's CRLF (read with the next reply's first line)
            raise ConnectionError("redis reply out of step: no CRLF after a value")
        return True

    def skip(self) -> None:
        """One integer, status or error reply (the TOUCH script's), read and dropped."""
        line = self._line()
        if line[:1] == b"$" and int(line[1:]) >= 0:
            self._exact(memoryview(bytearray(int(line[1:]) + 2)))

    def _line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def _exact(self, into: memoryview) -> None:
        taken = min(len(self.pending), len(into))
        if taken:
            with memoryview(self.pending) as pending:
                into[:taken] = pending[:taken]
            del self.pending[:taken]
        while taken < len(into):
            n = self.sock.recv_into(into[taken:])
            if n == 0:
                raise ConnectionError("redis closed the connection mid-reply")
            taken += n

    def _fill(self) -> None:
        chunk = self.sock.recv(_LINE_READ)
        if not chunk:
            raise ConnectionError("redis closed the connection mid-reply")
        self.pending += chunk
