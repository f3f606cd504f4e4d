"""The server's log output: a bounded queue in front of stderr, written by one thread.

`logging.StreamHandler` writes on the thread that logs. When stderr is a pipe
whose reader stalls (a stuck log shipper), the write blocks once the pipe's
64 KiB buffer is full, and the event loop and the device thread stop with it:
a `vaed serve` whose stderr nobody read hung after a few hundred calls. Here a record
is formatted on the logging thread and put on a bounded queue without waiting;
one writer thread writes the queue to the file descriptor. When the queue is
full the record is dropped and counted, and the writer reports the count once
it can write again. Nothing but that thread ever waits on the descriptor.

The writer uses os.write on the descriptor, not sys.stderr: a thread blocked
inside a Python file object holds that object's lock, and interpreter
shutdown would then wait for it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# Records held while the descriptor is not writable; past this they are
# dropped. A call logs one line of ~300 bytes, so this is a few thousand
# calls' worth (~1 MB) of log.
QUEUE_RECORDS = 4096

# Seconds `stop` waits for the queue to be written before it gives up on a
# descriptor nobody reads.
STOP_SECONDS = 2.0

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Drops:
    """Records dropped since start, and how many the writer has already reported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self.reported = 0

    def add(self) -> None:
        with self._lock:
            self.total += 1


class QueueLogHandler(logging.Handler):
    """Formats on the calling thread and enqueues without waiting; a full queue drops."""

    def __init__(self, fd: int, capacity: int = QUEUE_RECORDS) -> None:
        super().__init__()
        self.fd = fd
        self.drops = _Drops()
        self._queue: queue.Queue[bytes | None] = queue.Queue(capacity)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="vaed-log-writer", daemon=True)
        self._writer.start()

    @property
    def dropped(self) -> int:
        return self.drops.total

    def emit(self, record: logging.LogRecord) -> None:
        if self._closed:  # no writer any more (a thread logging during interpreter exit)
            self.drops.add()
            return
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
        except Exception:
            self.handleError(record)
            return
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.drops.add()

    def handleError(self, record: logging.LogRecord) -> None:
        # The default prints to sys.stderr, the very stream that may be blocked.
        self.drops.add()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def _write_loop(self) -> None:
        while True:
            line = self._queue.get()
            if line is None:  # close(): everything before it was written
                self._queue.task_done()
                return
            try:
                self._write(line)
                total = self.drops.total
                if total > self.drops.reported:
                    self._write(f"vaed.logs: dropped {total - self.drops.reported} log record(s) while the log "
                                f"stream was not read ({total} since start)\n".encode())
                    self.drops.reported = total
            except OSError:  # the reader went away (EPIPE) or the descriptor closed
                self.drops.add()
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = STOP_SECONDS) -> None:
        """Wait at most `timeout` seconds for what is queued to be written (before os._exit, at exit)."""
        if self._closed:
            return
        with self._queue.all_tasks_done:
            self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

    def close(self, timeout: float = STOP_SECONDS) -> None:
        """Write what is queued, waiting at most `timeout` seconds for the descriptor."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        else:
            self._writer.join(timeout)
        super().close()


class DroppedLogCollector(Collector):
    """`vaed_log_records_dropped_total`: records the handler dropped (read at scrape time)."""

    def __init__(self, handler: QueueLogHandler) -> None:
        self._handler = handler

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "vaed_log_records_dropped", "Log records dropped because the log stream was not being read.",
        )
        family.add_metric([], self._handler.dropped)
        yield family


_installed: QueueLogHandler | None = None


def install(level: str | int, fd: int = 2, fmt: str = FORMAT) -> QueueLogHandler:
    """Route the root logger through a QueueLogHandler on `fd` (stderr), replacing its handlers."""
    global _installed
    handler = QueueLogHandler(fd)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    _installed = handler
    return handler


def installed() -> QueueLogHandler | None:
    """The handler `install` set up in this process, if any (a server embedded in a test has none)."""
    return _installed
