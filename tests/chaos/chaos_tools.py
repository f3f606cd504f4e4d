"""Tools of the chaos tests: `vaed serve` replicas whose logs are kept, and a loopback TCP proxy
that cuts, stalls and delays connections.

`Replica` runs the command of harness.start_cli_server (tiny random model on the CPU,
127.0.0.1, forked by tests/launcher.py), but returns once the port is bound rather than at
SERVING (a replica may be caught warming up), and reads the log in a thread so it can be
asserted on (a server whose stdout pipe nobody reads drops its lines).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import launcher

START_TIMEOUT = 120.0  # seconds: a loaded 2-core machine starts a replica in ~3-10 s


def free_port() -> int:
    """A port nothing listens on now (for a replica that must be in a client's list before it starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    """One `vaed serve --device cpu --model random:wan2.1-tiny` process on 127.0.0.1."""

    def __init__(self, *extra: str, port: int = 0) -> None:
        argv = ["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                "--model", "random:wan2.1-tiny", *extra]
        self.proc = launcher.ServeProcess(argv, dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self.port = port or None
        self._bound = threading.Event()
        self._serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if match := re.search(r"\(port (\d+),", line):
                self.port = int(match.group(1))
                self._bound.set()
            if "SERVING" in line:
                self._serving.set()
        self._bound.set()
        self._serving.set()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_bound(self) -> "Replica":
        assert self._bound.wait(START_TIMEOUT) and self.proc.poll() is None, self.log()
        return self

    def wait_serving(self) -> "Replica":
        assert self._serving.wait(START_TIMEOUT) and self.proc.poll() is None, self.log()
        return self

    def kill(self) -> None:
        """kill -9: no drain, no goodbye to its connections."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.kill()
        self.proc.wait(30)

    def wait_for_line(self, text: str, timeout: float = 30.0) -> bool:
        """Whether a log line holding `text` shows up within `timeout` s (the server logs a call
        just after its last message, so a client can finish first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False

    def log(self) -> str:
        return "\n".join(self.lines[-40:])

    def resumed_calls(self, request_id: str, timeout: float = 30.0) -> list[dict[str, str]]:
        """The key=value fields of this replica's log lines for call `request_id` that skipped
        frames (resumed calls), once at least one is logged (a call is logged after its last
        message, so the client can finish first)."""
        self.wait_for_line(f"id={request_id} ", timeout)
        lines = [line for line in self.lines if f" id={request_id} " in line and "skipped_frames=" in line]
        return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]


def start_replicas(*extras: tuple[str, ...]) -> list[Replica]:
    """Several replicas started together (their start-ups overlap), once all are SERVING."""
    replicas = [Replica(*extra) for extra in extras]
    try:
        for replica in replicas:
            replica.wait_serving()
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


@dataclass
class Fault:
    """What the proxy does to one connection: after `after_bytes` bytes from the server, `cut`
    (close both sides: a reset the client sees at once) or `stall` (forward nothing more and
    keep both sides open: only the client's keepalive notices). `delay` (seconds) is added
    before every piece forwarded in either direction."""

    kind: str = "pass"  # "pass", "cut" or "stall"
    after_bytes: int = 0
    delay: float = 0.0


@dataclass
class ChaosProxy:
    """A loopback TCP proxy (asyncio, on its own thread) in front of `upstream_port`. Connection
    i gets `faults[i]` (later ones pass with `default_delay`)."""

    upstream_port: int
    faults: list[Fault] = field(default_factory=list)
    default_delay: float = 0.0
    port: int = 0
    connections: int = 0
    events: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        fault = self.faults[index] if index < len(self.faults) else Fault(delay=self.default_delay)
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        self._writers += [client_w, server_w]
        stalled = asyncio.Event()

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, from_server: bool) -> None:
            sent = 0
            try:
                while data := await reader.read(16384):
                    if fault.delay:
                        await asyncio.sleep(fault.delay)
                    if stalled.is_set():
                        await asyncio.Event().wait()  # forever: the connection hangs open
                    if from_server and fault.kind != "pass" and sent + len(data) > fault.after_bytes:
                        data = data[: max(0, fault.after_bytes - sent)]
                        writer.write(data)
                        self.events.append(f"connection {index}: {fault.kind} after {fault.after_bytes} bytes")
                        if fault.kind == "cut":
                            raise ConnectionResetError
                        stalled.set()
                        await asyncio.Event().wait()
                    sent += len(data)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                for w in (client_w, server_w):
                    if not stalled.is_set() or fault.kind != "stall":
                        w.close()

        tasks = [asyncio.ensure_future(pump(client_r, server_w, False)),
                 asyncio.ensure_future(pump(server_r, client_w, True))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for w in (client_w, server_w):
            w.close()

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            for writer in self._writers:
                writer.close()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# Server bytes a connection carries before its first frame message: HTTP/2 settings and a
# ModelInfo reply are a few hundred; a fault earlier than this would hit GetModelInfo, not a decode.
FIRST_CALL_BYTES = 4096


def random_faults(seed: int, kinds: list[str], max_bytes: int, delay: float) -> list[Fault]:
    """One fault per connection and kind, each after a random count of server bytes in
    [FIRST_CALL_BYTES, max_bytes) (inside a decode's reply), every piece delayed by `delay` s."""
    rng = random.Random(seed)
    return [Fault(kind, rng.randrange(FIRST_CALL_BYTES, max_bytes), delay) for kind in kinds]


def recovery_split(recovery_s: float, call: dict[str, str]) -> str:
    """A recovery time in two parts: the server's own time to the resumed call's first frame
    (replay arrival, re-decode of the skipped frames, queueing behind other sessions) and the
    rest (failure detected, backoff, new connection, upload)."""
    server_ms = float(call["first_frame_ms"]) if call["first_frame_ms"] != "-" else float("nan")
    return (f"{recovery_s * 1e3:.0f} ms = ~{recovery_s * 1e3 - server_ms:.0f} ms reconnect + {server_ms:.0f} ms on the "
            f"new server to its first frame ({call['skipped_frames']} frames skipped)")
