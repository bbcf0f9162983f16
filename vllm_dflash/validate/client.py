"""Every read validate makes from a server: one request, one connection, a total deadline, a size limit.

A socket timeout bounds one read, not a request: a server that trickles a byte a second keeps a `urlopen` alive for
ever. Here a watchdog shuts the connection down when the request's deadline passes, whatever phase it is in
(connect, headers, body), and the body is read in chunks up to a limit. `Session.abort()` does the same at once to
every request of the session in flight: how Ctrl-C stops a prompt run at once instead of after its slowest request.
One connection per request (`Connection: close`): a pooled keep-alive connection that the server has just closed as
idle fails the request before it reaches vLLM, and nothing here retries (a retry could count a request twice).
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

_CHUNK = 1 << 16


class TransportError(Exception):
    """The request got no complete answer: refused, reset, past its deadline, too large, aborted."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes


class TooLarge(TransportError):
    """The answer exceeded the caller's limit (an endless stream is one)."""


def _shut(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv/send on it at once
        except OSError:
            pass


class Session:
    """Requests that can be stopped together: `abort()` ends every one in flight (each raises TransportError in
    its own thread) and refuses new ones. What a prompt run's worker threads share."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[list[socket.socket | None]] = []  # one holder per request: its socket once connected
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()
        with self._lock:
            for holder in self._open:
                _shut(holder[0])

    def request(
        self,
        method: str,
        url: str,
        deadline_s: float,
        limit: int,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """`method url` answered within `deadline_s` seconds in total, its body at most `limit` bytes;
        TransportError otherwise. Any HTTP status is an answer (the caller decides what a 404 means)."""
        if self.aborted.is_set():
            raise TransportError("interrupted")
        parts = urlsplit(url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        end = time.monotonic() + deadline_s
        try:
            conn = cls(parts.hostname or "", parts.port, timeout=deadline_s)
        except (ValueError, http.client.HTTPException) as exc:  # checked URLs never get here
            raise TransportError(f"bad URL: {exc}") from None
        expired = threading.Event()
        # The socket itself, not conn.sock: http.client hands the socket to the response and forgets it (conn.sock
        # is None once the headers of a `Connection: close` answer are read), but the body is still to come.
        holder: list[socket.socket | None] = [None]

        def watchdog() -> None:
            expired.set()
            _shut(holder[0])

        timer = threading.Timer(deadline_s, watchdog)
        timer.daemon = True
        with self._lock:
            self._open.append(holder)
        timer.start()
        try:
            conn.connect()  # a name lookup cannot be interrupted: its time is checked once it is done
            holder[0] = conn.sock
            if expired.is_set() or self.aborted.is_set():
                raise OSError("deadline")
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request(method, path, body=body, headers={"Connection": "close", **(headers or {})})
            resp = conn.getresponse()
            chunks: list[bytes] = []
            size = 0
            while chunk := _read(holder[0], resp, end):
                size += len(chunk)
                if size > limit:
                    raise TooLarge(f"the answer is larger than {_size(limit)}")
                chunks.append(chunk)
            if expired.is_set():
                raise OSError("deadline")
            return Response(int(resp.status), b"".join(chunks))
        except TransportError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self.aborted.is_set():
                raise TransportError("interrupted") from None
            if expired.is_set() or time.monotonic() >= end:
                raise TransportError(f"no complete answer within {deadline_s:g} s") from None
            raise TransportError(str(exc) or type(exc).__name__) from None
        finally:
            timer.cancel()
            with self._lock:
                self._open.remove(holder)
            conn.close()


def _read(sock: socket.socket | None, resp: http.client.HTTPResponse, end: float) -> bytes:
    left = end - time.monotonic()
    if left <= 0:
        raise OSError("deadline")
    if sock is not None:  # each read waits at most what is left of the deadline (the watchdog ends it anyway)
        sock.settimeout(left)
    return resp.read1(_CHUNK)  # what has arrived (read() would wait for all of a large Content-Length)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def request(
    method: str,
    url: str,
    deadline_s: float,
    limit: int,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """One request outside any session (the main thread's health polls and scrapes: Ctrl-C interrupts those
    directly)."""
    return Session().request(method, url, deadline_s, limit, body, headers)
