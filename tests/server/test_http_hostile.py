"""Hostile HTTP clients against a real `vaed serve --http-port` subprocess, its RSS read from
/proc: a flood of large bodies over the admission limit, clients that claim large bodies and send
nothing, and readers that stop reading. Memory stays within what the limits allow, refused
requests are refused from their head, a stalled answer stalls only its own session and ends by
--http-send-timeout, and another client decodes meanwhile.

Sizes: bodies claim CLAIM_MIB = 64 MiB (latents [1, 4, 256, 128, 128] float32, under the server's
256 MiB message limit, and a request its head checks pass: 1024x1024 frames, 256 latent frames, RGB8
frames streamed); FLOOD = 8 clients push them over --max-sessions 2, 512 MiB in all. The
bound, BODY_GROWTH_BOUND = 48 MiB, is under one claimed body, so reading one flood body, or
allocating the two admitted claims' buffers before their bytes come, fails it.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from subprocess import Popen

import pytest
import requests
import torch
from diffusers.utils.remote_utils import prepare_decode, remote_decode
from harness import PeakRss, start_serve
from prometheus_client.parser import text_string_to_metric_families

MIB = 1 << 20
CLAIM_SHAPE = (1, 4, 256, 128, 128)
CLAIM_BYTES = 4 * 4 * 256 * 128 * 128  # 64 MiB of float32
# streamed RGB8 frames: raw pt's whole answer (12.8 GB) would be refused from the head, over its 4 GiB bound
CLAIM_QUERY = "output_type=pt&partial_postprocess=true&do_scaling=true"
FLOOD = 8
MAX_SESSIONS = 2
BODY_GROWTH_BOUND = 48 * MIB
SEND_TIMEOUT_S = 3.0


@dataclass
class Served:
    proc: Popen[str]
    port: int  # the HTTP front and /metrics share it
    lines: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = requests.get(f"{self.endpoint}metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def sessions(self) -> float:
        return sum(v for (name, _), v in self.metrics().items() if name == "vaed_active_sessions")

    def requests_with(self, code: str) -> float:
        return self.metrics().get(("vaed_requests_total", (("code", code), ("method", "Decode"))), 0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(*extra: str, environ: dict[str, str] | None = None) -> Iterator[Served]:
    """`vaed serve` with the HTTP front and /metrics on one port and --max-sessions 2; its output
    is drained in a thread (a full pipe would block the server's logging). With `environ`, a
    fresh interpreter with those variables added (glibc reads its tunables when it starts)."""
    port = _free_port()
    proc, _, _ = start_serve("--http-port", str(port), "--metrics-port", str(port),
                             "--max-sessions", str(MAX_SESSIONS), *extra,
                             fresh_interpreter=environ is not None, environ=environ)
    served = Served(proc, port)

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            served.lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    try:
        yield served
    finally:
        proc.kill()
        proc.wait(30)


def _wait(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    done = threading.Event()
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met")
        done.wait(0.05)


def _head(shape: tuple[int, ...], length: int, query: str = "output_type=pt&do_scaling=true") -> bytes:
    dims = "&".join(f"shape={d}" for d in shape)
    return (f"POST /?{dims}&dtype=float32&{query} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _answer_status(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data and (chunk := s.recv(4096)):
        data += chunk
    return int(data.split(b" ", 2)[1])


# -- a body flood over the admission limit ---------------------------------------------------


def _flood_one(port: int, slowly: bool) -> tuple[int, int]:
    """One client pushing a 64 MiB body after its head, at full speed or 64 KiB per 50 ms, until
    its answer comes: (status, body bytes it had sent by then)."""
    piece = bytes(64 * 1024 if slowly else MIB)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(_head(CLAIM_SHAPE, CLAIM_BYTES, CLAIM_QUERY))
        sent = 0
        while sent < CLAIM_BYTES and not select.select([s], [], [], 0.05 if slowly else 0)[0]:
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        return _answer_status(s), sent


@pytest.mark.parametrize("slowly", [False, True], ids=["at-once", "slowly"])
def test_a_body_flood_over_the_admission_limit_is_refused_unread_and_memory_stays_flat(slowly: bool) -> None:
    """Two clients claim 64 MiB bodies and send nothing: they hold both session slots, and their
    buffers cost only what arrived (nothing). Eight more push 64 MiB bodies: each is refused
    (429) from its head, before its body was all sent, and none of the 512 MiB is kept. Then a
    holder leaves and another client's decode is answered."""
    with serve("--session-first-message-timeout", "120") as served:
        x = torch.randn(1, 4, 3, 4, 6)
        remote_decode(endpoint=served.endpoint, tensor=x, output_type="pt", return_type="pt")  # first use
        holders: list[socket.socket] = []
        try:
            with PeakRss(served.proc.pid) as rss:
                for _ in range(MAX_SESSIONS):
                    holders.append(socket.create_connection(("127.0.0.1", served.port), timeout=60))
                    holders[-1].sendall(_head(CLAIM_SHAPE, CLAIM_BYTES, CLAIM_QUERY))
                _wait(lambda: served.sessions() == MAX_SESSIONS)
                with ThreadPoolExecutor(FLOOD) as pool:
                    results = list(pool.map(lambda _: _flood_one(served.port, slowly), range(FLOOD)))
                assert requests.get(f"{served.endpoint}health", timeout=10).status_code == 200
            assert [status for status, _ in results] == [429] * FLOOD
            assert all(sent < CLAIM_BYTES for _, sent in results), results
            growth = rss.peak - rss.start
            print(f"\nflood ({'slowly' if slowly else 'at once'}): {sum(s for _, s in results) / MIB:.0f} MiB pushed "
                  f"by {FLOOD} refused clients, 2 x 64 MiB claimed by the admitted ones; "
                  f"RSS {rss.start / MIB:.0f} -> peak {rss.peak / MIB:.0f} MiB (+{growth / MIB:.1f})")
            assert growth < BODY_GROWTH_BOUND, f"RSS grew by {growth / MIB:.0f} MiB"
            holders.pop().close()  # its call ends (the body never came) and frees its slot
            _wait(lambda: served.sessions() == MAX_SESSIONS - 1)
            out = remote_decode(endpoint=served.endpoint, tensor=x, output_type="pt", return_type="pt")
            assert out.shape == (1, 3, 9, 32, 48)
        finally:
            for holder in holders:
                holder.close()


# -- a reader that stops reading ------------------------------------------------------------

# 1533 frames of 256 x 256: 288 MiB of RGB8, and about 6 s of decode per latent frame on a loaded
# 2-core machine, so a call that is not held back would outlast the test
SLOW_T, SLOW_H, SLOW_W = 384, 32, 32
SLOW_FRAMES = 1 + 4 * (SLOW_T - 1)
# A call's RSS peak is its live memory only where freed memory goes back to the kernel. `vaed serve`
# keeps it instead (`vaed_client.heap.keep_freed_memory`: blocks under 32 MiB from the heap, up to
# 64 MiB of free heap kept per malloc arena, for its frame messages' copies), so after a call some
# of the decoder's working memory stays resident in one arena or another: the stalled call's peak
# over a reading call's ranged -90..+169 MiB on the loaded 2-core machine (the bound below failed at
# +169). A malloc tunable in the environment makes the server leave glibc to it: with its mmap
# threshold at 128 KiB every large block is mmapped and unmapped when freed, and that difference
# was +6.5..+7.8 MiB in the same runs (the body, the other client's small call). What the server
# holds for a reader that stops reading is the same either way.
STEADY_RSS = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


@pytest.mark.parametrize("route", ["pt-partial", "mp4-stream"])
def test_a_reader_that_stops_reading_stalls_only_its_session_until_the_send_timeout(route: str) -> None:
    """A client reads its answer's head, then nothing (a 4 KiB receive buffer). The server's
    writes wait for it, so its decode stops after the credit window's groups (its log line counts
    the frames decoded) and the server's memory stays flat; another client decodes meanwhile;
    after --http-send-timeout of nothing read, the connection is closed and the call ends
    DEADLINE_EXCEEDED, freeing its slot."""
    x = torch.randn(1, 4, SLOW_T, SLOW_H, SLOW_W, generator=torch.Generator().manual_seed(0))

    def request(latents: torch.Tensor) -> tuple[bytes, dict[str, str]]:
        if route == "pt-partial":  # RGB8 frames, streamed
            sent = prepare_decode(latents, output_type="pt", partial_postprocess=True)
            return sent["data"], sent["params"]
        sent = prepare_decode(latents, output_type="mp4")  # lossless fMP4 of noise: about the RGB8 size
        return sent["data"], {**sent["params"], "stream": "true", "lossless": "true"}

    body, params = request(x)
    path = requests.Request("POST", "http://x/", params=params).prepare().path_url
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    answer_bytes = SLOW_FRAMES * SLOW_H * 8 * SLOW_W * 8 * 3
    with serve("--http-send-timeout", str(SEND_TIMEOUT_S), environ=STEADY_RSS) as served:
        # The same route and frame size read by a client that reads, as many latent frames as the
        # stalled call gets to decode: its peak is the decoder's and the encoder's working memory
        # (~220 MiB at 256 x 256 on the CPU, freed after each call), what the slow reader's is
        # compared with.
        with PeakRss(served.proc.pid) as reading:
            warm_body, warm_params = request(x[:, :, :6])
            assert requests.post(served.endpoint, data=warm_body, params=warm_params, timeout=200).status_code == 200
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            with PeakRss(served.proc.pid) as rss:
                slow.connect(("127.0.0.1", served.port))
                slow.sendall(head + body)
                assert slow.recv(12) == b"HTTP/1.1 200"  # the answer began; now nothing more is read
                small = torch.randn(1, 4, 2, 4, 6)
                out = remote_decode(endpoint=served.endpoint, tensor=small, output_type="pt", return_type="pt")
                assert out.shape == (1, 3, 5, 32, 48)
                _wait(lambda: served.requests_with("DEADLINE_EXCEEDED") == 1)
                _wait(lambda: served.sessions() == 0)
        finally:
            slow.close()
        growth = rss.peak - reading.peak
        _wait(lambda: any("status=DEADLINE_EXCEEDED" in line for line in served.lines), timeout=30)
        (line,) = [line for line in served.lines if "status=DEADLINE_EXCEEDED" in line]
        frames = int(re.search(r" frames=(\d+)", line).group(1))  # type: ignore[union-attr]
        print(f"\nslow reader ({route}): {frames} of {SLOW_FRAMES} frames decoded before the send timeout; "
              f"RSS peak {rss.peak / MIB:.0f} MiB, {growth / MIB:+.1f} over a reading client's call "
              f"({reading.peak / MIB:.0f} MiB); the whole answer is {answer_bytes / MIB:.0f} MiB")
        assert frames < SLOW_FRAMES // 2, line  # held back by the unread answer, not decoded to the end
        # an eighth of the answer: over four times the measured +7.8 MiB, and far under the answer
        assert growth < answer_bytes // 8, f"the slow reader's call peaked {growth / MIB:.0f} MiB higher"
        assert requests.get(f"{served.endpoint}health", timeout=10).status_code == 200


def test_a_slow_reader_that_keeps_reading_gets_its_whole_answer() -> None:
    """A client that reads a 7 MB whole answer (raw pt frames) at most 32 KiB every 0.1 s takes
    over 20 s, far past --http-send-timeout (3 s): it keeps taking its answer, so it is not cut.
    The timer checked only that the send buffer fell under its low-water mark, which a whole
    answer's buffer does only near its end: such readers were cut after 3-4 MB."""
    shape = (1, 4, 3, 32, 32)  # 9 frames of 256 x 256 x 3 float32: 7 077 888 bytes
    body = torch.randn(shape, generator=torch.Generator().manual_seed(5)).numpy().tobytes()
    head = (f"POST /decode?{'&'.join(f'shape={d}' for d in shape)}&dtype=float32&output_type=pt HTTP/1.1\r\n"
            f"Host: x\r\nX-Request-Id: slow-but-reading\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with serve("--http-send-timeout", str(SEND_TIMEOUT_S)) as served:
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            client.settimeout(60)
            client.connect(("127.0.0.1", served.port))
            client.sendall(head + body)
            received = bytearray()
            while b"\r\n\r\n" not in received:
                received += client.recv(4096)
            answer_head, _, received = bytes(received).partition(b"\r\n\r\n")
            assert answer_head.startswith(b"HTTP/1.1 200"), answer_head
            length = int(re.search(rb"(?i)content-length: (\d+)", answer_head).group(1))  # type: ignore[union-attr]
            assert length == 9 * 256 * 256 * 3 * 4
            received = bytearray(received)
            while len(received) < length:
                piece = client.recv(32768)
                assert piece, f"cut after {len(received)} of {length} bytes: {served.lines[-3:]}"
                received += piece
                time.sleep(0.1)
        _wait(lambda: any("slow-but-reading" in line and "status=OK" in line for line in served.lines), timeout=60)
        assert not any("connection aborted" in line for line in served.lines)
