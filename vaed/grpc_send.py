"""A gRPC call's response messages written under --send-timeout.

A client that opens a large Decode and never reads its response stream stops
the server's writes (HTTP/2 flow control), so the session's decode waits on
its --queue-chunks credits and holds its slot while the server idles: until
the connection ages out (--max-connection-age 300 s + its 600 s grace). With
--max-sessions N, N such clients locked everyone else out. Here every write
of a call's answer must complete within `timeout` seconds, else the call is
ended; its front then ends the Call (logged DEADLINE_EXCEEDED, slot freed).

Why the servicer writes with `context.write` rather than yielding: grpc.aio
writes a yielded message itself and asks the handler's generator for the next
only once that write completed, so a stalled write leaves the handler with no
way to notice it, let alone return. A write started here runs as a task the
handler waits on with a timeout, and is never cancelled: cancelling grpc.aio's
wait on a batch still in gRPC core would leave that batch to complete into a
cancelled future, so it is left to finish (or fail when the connection goes)
on its own, and its outcome is read and dropped.

What "taken" means: a write completes once gRPC core has put the message on
the wire, which needs room in the client's HTTP/2 window. The client's gRPC
library fills its receive window ahead of its application (64 KiB without
bandwidth probing; MiBs with it, gRPC's default: 7 messages, 5.25 MiB, in
tests/server/test_send_timeout.py) and makes room only as the application
reads past it. So the clock sees the client's transport, not each read of its
application: one that keeps reading is cut only if reading through that
window takes it longer than the timeout.

How the call ends: gRPC's Python server cannot reset a stream, and a status
sent while a message is stalled queues behind it. `end` starts the status
without waiting for it, so the handler returns (its RPC slot, --max-concurrent-rpcs,
is freed too); the client gets the status after the stalled message if it
reads again, and the stream goes when it cancels or its connection closes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

# Writes and statuses left to finish in gRPC core after their call's handler returned:
# held here so they are not collected while pending, and their outcome is read.
_left: set[asyncio.Future[Any]] = set()


def _leave(pending: asyncio.Future[Any]) -> None:
    _left.add(pending)
    pending.add_done_callback(_forget)


def _forget(done: asyncio.Future[Any]) -> None:
    _left.discard(done)
    if not done.cancelled():
        done.exception()  # ExecuteBatchError once the client left, AbortError from `end`: expected


class SendStalled(Exception):
    """The client took none of its call's answer for `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            f"the client took none of the answer for {seconds:g} s (the server's --send-timeout); "
            "read the response stream while the call runs")
        self.seconds = seconds


class TimedWriter:
    """Writes one call's response messages, each within `timeout` seconds (0 = no limit)."""

    def __init__(self, context: grpc.aio.ServicerContext, timeout: float) -> None:
        self._context = context
        self.timeout = timeout
        self.stalled = False  # a write ran out of time: the call ends DEADLINE_EXCEEDED
        self._headers: asyncio.Future[Any] | None = None

    def send_headers(self, metadata: tuple[tuple[str, str], ...]) -> None:
        """Start sending the call's initial metadata now, while the call reads its first message and
        decodes (the send's await took ~0.1 ms of the event loop on a loaded 2-core machine: awaited
        in line, before the call starts, it would be on the first frame's path). gRPC sends a call's
        initial metadata once, before anything else, so the first write and the status wait for it
        (`headers_sent`). HTTP/2 headers are not flow-controlled: a client that reads nothing
        cannot stall them."""
        self._headers = asyncio.ensure_future(self._context.send_initial_metadata(metadata))

    async def headers_sent(self) -> None:
        """Wait for `send_headers`' send, if one is under way (its failure, the client gone, raises
        here as a write's would)."""
        headers = self._headers
        if headers is None:
            return
        await asyncio.wait((headers,))  # not `await headers`: a cancelled handler would cancel the send in core
        self._headers = None
        headers.result()

    def abandon(self) -> None:
        """The handler returns: a header send still under way finishes on its own (see `_leave`)."""
        headers, self._headers = self._headers, None
        if headers is not None:
            _leave(headers)

    async def write(self, message: Any) -> None:
        """Send `message`; SendStalled when the client took none of it within the timeout."""
        await self.headers_sent()
        if self.timeout <= 0:
            await self._context.write(message)
            return
        sending = asyncio.ensure_future(self._context.write(message))
        try:
            await asyncio.wait((sending,), timeout=self.timeout)
        except BaseException:
            # this call was cancelled meanwhile: the write's outcome is read when it ends, or now
            # if it has (a write that failed as the client cancelled, unread, was logged at ERROR
            # with its traceback as "Task exception was never retrieved")
            _leave(sending)
            raise
        if not sending.done():
            _leave(sending)
            self.stalled = True
            raise SendStalled(self.timeout)
        sending.result()

    async def end(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with `code` without waiting for the status to leave: it queues behind the
        stalled message. Returns once grpc.aio counts the call as ended, so the handler may
        return without grpc.aio sending an OK status of its own."""
        await self.headers_sent()  # done: `end` follows a write that stalled, which waited for them
        ending = asyncio.ensure_future(self._context.abort(code, details))
        _leave(ending)
        while not (self._context.done() or ending.done()):
            await asyncio.sleep(0)  # abort marks the call ended before it waits for its send
