"""The connection layer in front of the HTTP app: what a client may hold before it has sent a
request, and how many requests are handled at once.

    ConnectionLimits     header timeout, head size and header count, open-socket cap
    guarded_protocol()   uvicorn's httptools protocol with those limits
    RequestLimit         ASGI middleware: at most `max_inflight` requests at once (503 beyond)
    raise_open_files()   RLIMIT_NOFILE soft -> hard, the socket cap that fits under it

Why a subclass and not uvicorn's settings. uvicorn gives `timeout_keep_alive` (idle time
*after* a response), `limit_concurrency` and, for its h11 protocol only,
`h11_max_incomplete_event_size`. None of them covers the hostile cases:
  - nothing times a connection out before its first request line: the keep-alive timer is
    armed only after a response, so a socket that never sends a byte stays open for ever;
  - `limit_concurrency` counts open sockets as well as tasks, so 1,024 idle sockets make
    every new client's request a 503;
  - the httptools protocol (the default, and the fast parser) has no head limit at all, and
    httptools joins a header's pieces with bytes concatenation, so one 100 MiB header costs
    quadratic copying on the event loop (seconds during which nobody is served); h11's size
    limit exists but is answered with a 400, and h11 is the slow pure-Python parser.
So this module keeps httptools and adds, per connection: a head deadline (request line and
headers within `header_timeout_s` of the connection or of the request's first byte: 408 if
part of a head came, a silent close if nothing did); a byte budget for the head, checked
*before* bytes reach the parser (nothing over the limit is ever concatenated) and a header
count, both answered 431 with OpenAI's error shape; after a refusal the rest of what the client
sends is read and dropped for `linger_s` so that it sees the answer rather than a reset. The
request limit moves to an ASGI middleware that counts requests being handled (what a server's
capacity is about), and open sockets get their own cap: when it is reached the connection
idle the longest (no request in progress) is closed to admit the new one, so idle sockets can
never shut a working client out. uvicorn's `limit_concurrency` is left unset.

The subclass overrides uvicorn's protocol callbacks and calls a few of its helpers
(`_unset_keepalive_if_required`, `send_400_response`, the upgrade checks); written against
uvicorn 0.54 and httptools 0.9, and tests/serve/test_http_front.py exercises each override over
a real socket.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import resource
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("specbuild.http")

FD_RESERVE = 128  # descriptors kept for the model files, logs, MPI, the engine's own


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection limits (ServeConfig fills them from the serve flags)."""

    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    max_header_bytes: int = 64 * 1024  # request line + headers, in bytes
    max_headers: int = 128  # header lines per request
    max_connections: int = 8192  # open sockets; beyond, the longest-idle one is closed
    linger_s: float = 2.0  # after a 408/431: read and drop for this long, then close

    def __post_init__(self) -> None:
        checks = [("header_timeout_s", self.header_timeout_s, 0.05, 3600),
                  ("max_header_bytes", self.max_header_bytes, 1024, 1 << 24),
                  ("max_headers", self.max_headers, 8, 1 << 16),
                  ("max_connections", self.max_connections, 16, 1 << 20), ("linger_s", self.linger_s, 0, 60)]
        for name, value, lo, hi in checks:
            if not lo <= value <= hi:
                raise ValueError(f"{name}={value} is out of range [{lo}, {hi}]")


def raise_open_files(want: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards its hard limit (enough for `want` sockets
    plus FD_RESERVE); returns how many sockets fit under the limit then in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want + FD_RESERVE if hard == resource.RLIM_INFINITY else min(hard, want + FD_RESERVE)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    except (ValueError, OSError) as e:  # not permitted here: keep what there is
        log.warning("could not raise the open-file limit: %s", e)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = want if soft == resource.RLIM_INFINITY else max(16, soft - FD_RESERVE)
    return min(want, room)


def error_body(status: int, message: str, code: str) -> bytes:
    """An HTTP/1.1 answer with OpenAI's error object that closes the connection."""
    data = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    phrase = {408: "Request Timeout", 431: "Request Header Fields Too Large"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            "connection: close\r\n\r\n").encode() + data


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head over a limit."""


class ConnectionBook:
    """The open connections in idle order: those with no request in progress, oldest first."""

    def __init__(self) -> None:
        self.idle: collections.OrderedDict[int, GuardedProtocol] = collections.OrderedDict()
        self.evicted = 0

    def set_idle(self, conn: "GuardedProtocol", idle: bool) -> None:
        if idle:
            self.idle[id(conn)] = conn
            self.idle.move_to_end(id(conn))
        else:
            self.idle.pop(id(conn), None)

    def make_room(self, newcomer: "GuardedProtocol", open_count: int, cap: int) -> bool:
        """Close idle connections (oldest first, never the newcomer) until `open_count` fits
        the cap; False when none can go (every other connection has a request in progress)."""
        while open_count > cap:
            victim = next((c for k, c in self.idle.items() if c is not newcomer), None)
            if victim is None:
                return False
            self.idle.pop(id(victim))
            victim.transport.close()
            self.evicted += 1
            open_count -= 1
        return True


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the limits of `ConnectionLimits` (module doc).
    `guarded_protocol()` makes the subclass that carries one server's limits and book."""

    limits = ConnectionLimits()
    book = ConnectionBook()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_open = True  # bytes now arriving belong to a request head
        self.head_bytes = 0
        self.header_count = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False  # a 408/431 went out: what comes is dropped until the close

    # ---- connection lifecycle ----------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.book.set_idle(self, True)
        self.arm_head_timer()
        if not self.book.make_room(self, len(self.connections), self.limits.max_connections):
            log.warning("%d connections open, all with requests in progress: refusing a new one",
                        len(self.connections))
            transport.close()

    def connection_lost(self, exc) -> None:
        self.book.set_idle(self, False)
        self.cancel_head_timer()
        super().connection_lost(exc)

    def arm_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self.head_timed_out)

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or not self.head_open:
            return
        if self.head_bytes:
            self.refuse(408, f"the request line and headers did not arrive within {self.limits.header_timeout_s:g}s "
                             f"({self.head_bytes} bytes came)", "header_timeout")
        else:  # nothing was asked: nothing to answer
            self.transport.close()

    # ---- bytes in ----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.refused or self.parser is None:
            return
        self._unset_keepalive_if_required()
        if self.head_open:
            room = self.limits.max_header_bytes - self.head_bytes
            if len(data) > room:  # feed what fits; the head must end inside it
                first, data = data[:room], data[room:]
                self.head_bytes += len(first)
                self.feed(first)
                if self.head_open and not self.refused:
                    self.refuse(431, f"the request line and headers are over {self.limits.max_header_bytes} bytes, "
                                     "the limit", "header_too_large")
                if self.refused or not data:
                    return
            else:
                self.head_bytes += len(data)
        self.feed(data)

    def feed(self, data: bytes) -> None:
        """The parser over `data`, with uvicorn's answers to its errors (httptools_impl
        data_received) and ours to a refused head."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _HeadRefused):
                self.refuse(431, str(e.__context__), "too_many_headers")
            else:
                raise
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    # ---- parser callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.header_count = 0
        self.arm_head_timer()  # a keep-alive connection's next request: its head is timed too

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        if self.header_count > self.limits.max_headers:
            raise _HeadRefused(f"the request has over {self.limits.max_headers} header lines, the limit")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.head_open = False
        self.cancel_head_timer()
        self.book.set_idle(self, False)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.head_open, self.head_bytes = True, 0  # what follows is the next request's head

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.book.set_idle(self, True)

    # ---- refusing ----------------------------------------------------------------------
    def refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` and close: write the answer, shut our side, drop what the client
        still sends for `linger_s` (so that it reads the answer instead of a reset)."""
        if self.refused:
            return
        self.refused = True
        self.cancel_head_timer()
        self.book.set_idle(self, False)
        log.info("%s: %s", status, message)
        self.transport.write(error_body(status, message, code))
        try:
            self.transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self.transport.close()
            return
        self.flow.resume_reading()
        self.loop.call_later(self.limits.linger_s, self.transport.close)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A GuardedProtocol subclass with these limits and a connection book of its own (one per
    server: two servers in one process never evict each other's connections)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits, "book": ConnectionBook()})


class RequestLimit:
    """ASGI middleware: at most `max_inflight` HTTP requests handled at once; beyond, 503 with
    Retry-After (a request counts from its headers until its response ends, streams included).
    `/health` and `/metrics` are not counted and never refused."""

    EXEMPT = ("/health", "/metrics")

    def __init__(self, app, max_inflight: int, retry_after_s: int = 1) -> None:
        self.app, self.max_inflight, self.retry_after_s = app, max_inflight, retry_after_s
        self.inflight = 0

    def __getattr__(self, name: str):  # .openapi(), .routes ... of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            return await self.app(scope, receive, send)
        if self.inflight >= self.max_inflight:
            data = json.dumps({"error": {"message": f"{self.inflight} requests are in progress, the limit "
                                                    f"(--max-inflight) is {self.max_inflight}; retry later",
                                         "type": "server_error", "param": None, "code": "too_many_requests"}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                    (b"retry-after", str(self.retry_after_s).encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
