"""The server's one HTTP stack: an aiohttp application served from the running asyncio loop.

Why aiohttp: it parses HTTP/1.1 with a maintained C parser (llhttp), runs in
the loop that already runs grpc.aio, and serves the HTTP front too, so
/metrics and the front are routes of one ``web.Application`` on one
``AppRunner`` -- one stack, one set of limits. No thread is started: an idle
connection costs a socket and a protocol object.

``HttpServer`` owns the runner and its listening sockets; concerns add their
routes to ``HttpServer.app`` before ``start`` (``vaed.metrics`` adds
``GET /metrics``). What the stack bounds, whatever the routes:

* a request head: ``max_line_size`` (request line), ``max_field_size`` (one
  header), ``max_headers``; past them aiohttp answers 400 before any handler
  runs. ``client_max_size`` bounds a body read through ``request.read()``. A body's content
  coding is never decoded (the routes that take bodies refuse one, 415).
* time: a connection must send a complete head within ``head_timeout``
  seconds of opening (and of its last answer, when kept alive), else it is
  closed -- aiohttp's keep-alive timer, armed at connection start since
  aiohttp 3.14 (hence the lower bound), which also covers a slowloris client
  dribbling a head byte by byte.
* a reader that stops reading: an answer whose client takes none of it for
  ``send_timeout`` seconds (the socket's send buffer full, the transport's
  past its high-water mark, so every write of the answer waits) has its
  connection aborted, which ends the handler and with it any call it serves.
  aiohttp's writes wait for the client without a limit, and TCP keeps a
  connection whose peer acknowledges with a zero window open for ever, so
  without it one such client would hold its session slot and its answer's
  memory until the server stops. A slow reader that keeps draining re-arms
  the timer each time the transport resumes, so only a stalled one is cut.
* a client's FIN: the connection closes and its request is cancelled (asyncio's and aiohttp's
  default, kept on purpose). TCP cannot tell a client that left from one that only half-closed
  (``shutdown(SHUT_WR)`` after its request) until the server writes and gets a reset, and a
  whole answer writes nothing until the video is decoded: keeping half-closed connections open
  would decode every departed client's video to the end, holding its session slot. So a client
  that half-closes gets no answer; HTTP/1.1 clients do not half-close.
* shutdown: ``stop`` cuts every request still in flight the way the send
  timeout cuts a stalled reader (its connection aborted, its handler
  cancelled, so the call it serves ends and frees its slot). The caller stops
  the stack once its drain grace is over; aiohttp's own shutdown would wait
  on each such handler for up to twice its shutdown timeout (60 s by
  default), holding the process past any termination budget.
* sockets: at most ``max_connections`` are open; a new one closes the oldest
  connection that has no request in flight (a scraper is done in
  milliseconds, so the oldest idle one is the likeliest junk; refusing new
  connections instead would let idle ones lock scrapes out). When every open
  connection is busy the new one is closed.

Measured on the 2-core CI machine: a subprocess serving /metrics alone, 1000
connections each holding half a request line, then one 1 MiB header line
(``tests/server/test_metrics_http.py`` asserts the thread, eviction, limit
and timeout properties):

============================  ============================  ===========================
                              hand-written asyncio server   aiohttp 3.14 (this module)
============================  ============================  ===========================
threads, idle -> 1000 idle    2 -> 2 (its own loop thread)  1 -> 1 (the caller's loop)
RSS, idle -> 1000 idle        36.5 -> 39.4 MB               48.1 -> 49.3 MB (+11.6 MB
                                                            importing aiohttp)
connections left open         63 of 1000 (cap 64)           63 of 1000 (cap 64)
1 MiB header line             431 in 8 ms                   400 in 18 ms
scrape during and after       200                           200
============================  ============================  ===========================

aiohttp answers an oversized or malformed head with 400 (RFC 9110 allows it;
the hand-written server sent 431 for a large head) and, for a head it could
not parse, with an ``HTTP/1.0`` status line. It also requires ``Host`` on
HTTP/1.1 requests, as the RFC does; Prometheus and every HTTP client send it.

Every error this stack answers is JSON, ``{"error": "..."}`` (``error_body``), as the HTTP front's
own are (diffusers' client reads an error with ``response.json()``): aiohttp's answers too (404,
405 with its ``Allow``, 417 for an unknown ``Expect``, 400 for a malformed head, 500), with their
status and headers. The connection turns them into JSON where aiohttp hands them over
(``_Connection.finish_response`` and ``handle_error``): a middleware would miss a route's
``Expect`` handler, which aiohttp runs before the middlewares.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import socket
import sys
import termios
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import LooseHeaders
from multidict import CIMultiDict


class _NotClientErrors(logging.Filter):
    """Drops aiohttp's record of a malformed request (it logs each at ERROR with a
    traceback: a client sending garbage would fill the log); handler errors stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))


# The connections' logger: aiohttp's protocol reports errors here.
_protocol_log = logging.getLogger(f"{__name__}.protocol")
_protocol_log.addFilter(_NotClientErrors())
log = logging.getLogger(__name__)

# The longest text of an error this stack turns into JSON (its own messages are under 300).
MAX_ERROR_CHARS = 512
# Seconds ``stop`` waits for the handlers it cut to finish their cleanup (log line, session slot);
# a cancelled handler ends within milliseconds, so this bounds only a bug.
CUT_WAIT_S = 5.0
# aiohttp's wait, in ``cleanup``, for a connection's handler (then again after cancelling it): every
# request was cut before, so this bounds only a request that began since (aiohttp's default: 60 s).
SHUTDOWN_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class HttpLimits:
    """What one client can make the HTTP stack hold."""

    # Seconds a connection gets to send a request head (from opening, or from
    # its last answer); Prometheus sends its head at once.
    head_timeout: float = 5.0
    # Open connections; each holds a file descriptor the gRPC port also needs.
    max_connections: int = 64
    # A scrape's head is ~200 bytes; aiohttp's defaults (8190 per line) are
    # kept, with fewer headers than its 128, so a head is at most ~33 lines.
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 32
    # Keep a connection open after its answer (HTTP/1.1's default). Off: every
    # answer carries "Connection: close", so a connection lives one request and
    # at most head_timeout + the answer (a scrape every 15-30 s gains nothing
    # from a connection that the head timeout closes between scrapes anyway).
    keep_alive: bool = False
    # Bytes of a request body a handler may read (GET /metrics reads none).
    client_max_size: int = 64 * 1024
    # Seconds an answer may wait for its client to read on (see the module
    # docstring); 0 = no limit.
    send_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.head_timeout <= 0:
            raise ValueError(f"HTTP head timeout must be > 0, got {self.head_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"HTTP max connections must be >= 1, got {self.max_connections}")
        if self.send_timeout < 0:
            raise ValueError(f"HTTP send timeout must be >= 0, got {self.send_timeout}")


class HttpServer:
    """One aiohttp app, its runner and its listening sockets, in the running loop.

    Add routes to ``app`` before ``start``; ``start`` and ``stop`` are
    coroutines of the loop that serves (the server's own).
    """

    def __init__(self, limits: HttpLimits | None = None, name: str = "HTTP") -> None:
        self.limits = limits or HttpLimits()
        self.name = name  # in error messages: "metrics host must be ..."
        # Connections with a request in flight, and the task that runs its handler (`stop` waits on it).
        self._busy: dict[web.RequestHandler, asyncio.Task[Any]] = {}
        self.app = web.Application(client_max_size=self.limits.client_max_size, middlewares=[self._track_busy])
        if not self.limits.keep_alive:
            self.app.on_response_prepare.append(_close_after_answer)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening sockets (empty before ``start``)."""
        return tuple(self._listener.sockets) if self._listener is not None else ()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host`` (an IPv4 or IPv6 address, brackets allowed) and ``port``
        (0 = ephemeral); returns the bound port. Raises OSError when the address cannot
        be bound, ValueError when it is empty, RuntimeError when already started."""
        if self._runner is not None:
            raise RuntimeError(f"{self.name} HTTP server already running")
        address = host.strip("[]")
        if not address:
            # asyncio would bind every interface, each on its own ephemeral port.
            raise ValueError(f"{self.name} host must be an address such as 0.0.0.0, :: or 127.0.0.1")
        # handler_cancellation: a handler whose client disconnected is cancelled (aiohttp's default
        # since 3.7 lets it run on), so a decode over HTTP whose client left frees its session
        # slot at once instead of decoding for nobody.
        runner = web.AppRunner(self.app, handle_signals=False, access_log=None, handler_cancellation=True,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            # aiohttp's Server is a protocol factory for create_server (its documented
            # low-level use); this one builds its RequestHandler subclass, which reports
            # each new connection for the cap.
            self._listener = await asyncio.get_running_loop().create_server(
                self._connection_factory(runner), address, port
            )
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        return int(self._listener.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Close the sockets and every connection, cutting the requests still in flight (see the
        module docstring); safe when never started."""
        listener, self._listener = self._listener, None
        runner, self._runner = self._runner, None
        if listener is not None:
            listener.close()
        await self._cut_in_flight()
        if runner is not None:
            await runner.cleanup()  # closes open connections, runs the app's cleanup hooks
        if listener is not None:
            await listener.wait_closed()

    async def _cut_in_flight(self) -> None:
        """Abort every connection with a request in flight and wait for their handlers to end."""
        cut = [task for connection, task in list(self._busy.items())
               if isinstance(connection, _Connection) and connection.cut()]
        if not cut:
            return
        log.warning("%s: %d request(s) still in flight at shutdown; their connections are closed", self.name, len(cut))
        await asyncio.wait(cut, timeout=CUT_WAIT_S)

    def _connection_factory(self, runner: web.AppRunner) -> Callable[[], web.RequestHandler]:
        server = runner.server
        assert server is not None  # set by runner.setup()
        limits = self.limits
        loop = asyncio.get_running_loop()

        def made(new: web.RequestHandler) -> None:
            self._enforce_cap(server, new)

        def connection() -> web.RequestHandler:
            return _Connection(
                server, made, limits.send_timeout, loop=loop, access_log=None, logger=_protocol_log,
                keepalive_timeout=limits.head_timeout, max_line_size=limits.max_line_size,
                max_field_size=limits.max_field_size, max_headers=limits.max_headers,
                # a body in a content coding is not inflated as it arrives: the routes refuse one
                # from its head (415), and a broken gzip body a client sends on regardless made
                # aiohttp's decoder log an ERROR traceback per request
                auto_decompress=False,
            )

        return connection

    def _enforce_cap(self, server: web.Server, new: web.RequestHandler) -> None:
        """``new`` opened: past the cap, close the oldest idle connection (or ``new``)."""
        # Open ones in arrival order; a closed one stays listed until its task ends.
        others = [h for h in server.connections if h is not new and h.transport is not None]
        if len(others) < self.limits.max_connections:
            return
        idle = next((h for h in others if h not in self._busy), None)
        (idle or new).force_close()

    @web.middleware
    async def _track_busy(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        protocol = request.protocol
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs each request in a task of its own
        self._busy[protocol] = task
        try:
            return await handler(request)
        finally:
            self._busy.pop(protocol, None)


def error_body(message: str) -> bytes:
    """An error answer's body, the one shape of every error on this stack."""
    return json.dumps({"error": message}).encode()


def json_error(status: int, message: str, headers: LooseHeaders | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(message), content_type="application/json", headers=headers)


def _as_json(plain: web.Response) -> web.Response:
    """aiohttp's text/plain error as JSON: its status, its text (at most MAX_ERROR_CHARS: a head
    aiohttp could not parse is quoted in it, and a body sent without its Content-Length was
    parsed as the next head, so 7 KB of a client's body came back), its other headers (Allow on
    a 405)."""
    headers = CIMultiDict(plain.headers)
    for name in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH):
        headers.popall(name, None)
    text = plain.text or plain.reason
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + f"... ({len(text) - MAX_ERROR_CHARS} more characters)"
    answer = json_error(plain.status, text, headers)
    if plain.keep_alive is False:
        answer.force_close()
    return answer


def send_timed_out(request: web.BaseRequest) -> bool:
    """Whether `request`'s connection was aborted by the send timeout: a call it served ended
    DEADLINE_EXCEEDED (its client's time ran out), not CANCELLED (its client left)."""
    return isinstance(request.protocol, _Connection) and request.protocol.send_timed_out


async def _close_after_answer(request: web.Request, response: web.StreamResponse) -> None:
    # Called after aiohttp computed the headers: say it, and make aiohttp close.
    response.headers[hdrs.CONNECTION] = "close"
    response.force_close()


def _socket_send_queue(transport: asyncio.BaseTransport) -> int:
    """Bytes in the transport socket's send queue (Linux TIOCOUTQ); 0 where it cannot be asked."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int.from_bytes(queued, sys.byteorder, signed=True)


class _Connection(web.RequestHandler):
    """aiohttp's connection protocol, telling the server when it opens (for the cap) and
    aborting it when its client reads nothing of an answer for ``send_timeout`` seconds."""

    __slots__ = ("_on_made", "_send_timeout", "_stalled", "_buffered", "send_timed_out")

    def __init__(
        self, manager: web.Server, on_made: Callable[[web.RequestHandler], None], send_timeout: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._on_made = on_made
        self._send_timeout = send_timeout
        self._stalled: asyncio.TimerHandle | None = None
        self._buffered = 0  # bytes the transport held when the stall timer was armed
        self.send_timed_out = False  # aborted for a reader that read nothing (see `send_timed_out`)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._on_made(self)

    # The transport calls these as its send buffer passes its high- and low-water marks.
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timeout > 0:
            self._arm()

    def _arm(self) -> None:
        self._buffered = self._buffered_bytes()
        self._stalled = self._loop.call_later(self._send_timeout, self._check_stalled)

    def _buffered_bytes(self) -> int:
        """The answer's bytes not yet taken by the client: the transport's buffer, and the socket's
        send queue (sent but unacknowledged, or unsent). The kernel wakes the transport only once a
        third or so of a send buffer of MBs is free, which a slow reader takes many seconds to
        free, so the transport's buffer alone stood still while its client read."""
        transport = self.transport
        if not isinstance(transport, asyncio.WriteTransport):
            return 0
        return transport.get_write_buffer_size() + _socket_send_queue(transport)

    def resume_writing(self) -> None:
        self._disarm()
        super().resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _disarm(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None,
    ) -> tuple[web.StreamResponse, bool]:
        # every answer goes through here: aiohttp's HTTP errors (the router's 404 / 405, an Expect
        # handler's 417, a handler's raised HTTPException) are text/plain until here
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            resp = _as_json(resp)
        return await super().finish_response(request, resp, start_time)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's own answer to a head it could not take (400) or a handler's crash (500),
        logged as aiohttp logs it, in JSON."""
        plain = super().handle_error(request, status, exc, message)
        assert isinstance(plain, web.Response)  # aiohttp's: a text answer, closing the connection
        return _as_json(plain)

    def cut(self) -> bool:
        """Abort the connection: aiohttp cancels its handler (`handler_cancellation`), which ends
        the call it serves. The one way the stack ends a request early; False when already closed."""
        if self.transport is None:
            return False
        self.transport.abort()
        return True

    def _check_stalled(self) -> None:
        """`send_timeout` after the send buffer filled: a client that took some of it meanwhile (its
        buffer shrank) is a slow reader, given another `send_timeout`; one that took nothing is cut.
        The buffer stays over its high-water mark for a slow reader too (aiohttp resumes writing
        only below the low one): at 100 and 200 KB/s a 7 MB answer was cut after 4 MB."""
        self._stalled = None
        if self.transport is None:
            return
        if self._buffered_bytes() < self._buffered:
            self._arm()
            return
        self.send_timed_out = True
        _protocol_log.warning("HTTP client read nothing of its answer for %g s; connection aborted",
                              self._send_timeout)
        self.cut()
