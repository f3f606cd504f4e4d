"""Idle calls through the real wire: a call that opens and sends nothing, or stops
sending mid-session, ends DEADLINE_EXCEEDED (the message names the flag) and frees
its slot; one the server still owes frames, one held by its full backlog and one
that half-closed are not idle; the sessions gauge counts a call from admission.

Every wait is a bound on a hang (a minute), never a speed threshold: the servers'
timeouts are seconds, and without them an idle call holds its slot until its
connection ages out (300 s + its 600 s grace).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
import torch

from vaed.cli import add_serve_arguments, build_parser, config_from_args
from vaed.config import ServerConfig
from vaed_client import VaeClient, wire
from vaed_client.errors import DeadlineExceededError, ResourceExhaustedError

from harness import make_config, serve_in_thread, start_cli_server

Z = 4  # z_dim of random:wan2.1-tiny
T = 2.0  # both session timeouts of the in-process server, in seconds
WAIT_S = 60.0  # the bound on every wait: a hang, not a slow machine
FIRST_FLAG = "--session-first-message-timeout"
IDLE_FLAG = "--session-idle-timeout"


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout:g} s: {what}"
        time.sleep(0.02)


class _Idle:
    """A call that sends `first` (or nothing) and then nothing until `release`, as a stuck or
    hostile client does."""

    def __init__(self, channel: grpc.Channel, method: str = "DecodeStream", first: Any = None) -> None:
        self._stop = threading.Event()

        def requests() -> Any:
            if first is not None:
                yield first.SerializeToString()
            self._stop.wait(WAIT_S)

        self.call = channel.stream_stream(f"/{wire.SERVICE_NAME}/{method}")(requests(), timeout=2 * WAIT_S)

    def status(self) -> tuple[grpc.StatusCode, str]:
        """The call's status (it must end within WAIT_S)."""
        exc = self.call.exception(timeout=WAIT_S)
        return (grpc.StatusCode.OK, "") if exc is None else (exc.code(), exc.details())

    def release(self) -> None:
        self._stop.set()
        self.call.cancel()


def _sessions_gauge(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^vaed_active_sessions\{[^}]*\} (\S+)$", text, re.MULTILINE))


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as reply:
        return reply.read().decode()


@pytest.fixture(scope="module")
def server():
    config = make_config(max_sessions=2, session_first_message_timeout=T, session_idle_timeout=T)
    with serve_in_thread(config) as running:
        yield running


@pytest.fixture()
def gate(server, monkeypatch):
    """Holds every decode step until `open` is set; `entered` is set once a step waits."""
    engine = server.server.pool.engine
    original = engine.decode_frame
    entered, open_ = threading.Event(), threading.Event()

    def held(*args: Any) -> Any:
        entered.set()
        open_.wait(WAIT_S)
        return original(*args)

    monkeypatch.setattr(engine, "decode_frame", held)
    yield entered, open_
    open_.set()


def _slots_free(server) -> bool:
    return server.server.pool.admitted == 0


# -- idle calls end and free their slots ---------------------------------------------------------

@pytest.mark.parametrize("method", ["DecodeStream", "Decode"])
def test_a_call_that_sends_nothing_ends_deadline_exceeded_and_frees_its_slot(server, method):
    with grpc.insecure_channel(server.target) as channel:
        idle = [_Idle(channel, method) for _ in range(2)]  # every slot
        try:
            for call in idle:
                code, details = call.status()
                assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
                assert FIRST_FLAG in details and f"{T:g} s" in details
        finally:
            for call in idle:
                call.release()
    _wait_for(lambda: _slots_free(server), "the idle calls' slots are free")
    with VaeClient(server.target, timeout=WAIT_S) as client:
        assert client.decode(torch.randn(1, Z, 2, 5, 7)).shape[1] == 5


def test_a_decode_that_never_half_closes_gets_its_frames_then_deadline_exceeded(server):
    request = wire.pb.DecodeRequest(latents=wire.to_message(torch.randn(1, Z, 2, 5, 7)))
    with grpc.insecure_channel(server.target) as channel:
        call = _Idle(channel, "Decode", first=request)
        try:
            replies = []
            with pytest.raises(grpc.RpcError):
                for reply in call.call:
                    replies.append(wire.pb.FrameChunk.FromString(reply))
            code, details = call.status()
        finally:
            call.release()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and FIRST_FLAG in details, (code, details)
    assert sum(r.frames.shape[1] for r in replies if r.HasField("frames")) == 5  # RGB8 [B, T, H, W, 3]
    _wait_for(lambda: _slots_free(server), "the call's slot is free")


def test_a_session_that_stops_sending_ends_deadline_exceeded_after_its_frames(server):
    frames = 0
    with VaeClient(server.target, timeout=WAIT_S) as client:
        session = client.session()
        session.push(torch.randn(1, Z, 2, 5, 7))
        with pytest.raises(DeadlineExceededError) as failure:
            for chunk in session:
                frames += chunk.frames.shape[1]
        session.cancel()
    assert IDLE_FLAG in str(failure.value) and "2 latent frames received" in str(failure.value)
    assert frames == 5  # everything it sent was decoded and delivered first
    _wait_for(lambda: _slots_free(server), "the idle session's slot is free")


@pytest.mark.parametrize("front", ["sync", "asyncio"])
def test_a_session_opened_long_before_its_first_push_starts_its_call_with_it(server, front):
    """A generator opens its session, then takes longer than --session-first-message-timeout (T)
    to make its first latents (its reader already waiting, asyncio): the session's call starts
    with the first push, so it holds no slot meanwhile and its video comes whole. The call had
    started with the session and ended DEADLINE_EXCEEDED before the first push."""
    import asyncio

    from vaed_client import AsyncVaeClient
    from vaed_client.video import assemble

    x = torch.randn(1, Z, 3, 5, 7, generator=torch.Generator().manual_seed(7))
    with VaeClient(server.target, timeout=WAIT_S) as client:
        want = client.decode(x, output_type="pt")
        if front == "sync":
            with client.session(output_type="pt") as session:
                time.sleep(T / 2)
                assert server.server.pool.admitted == 0  # no call, no slot
                time.sleep(2.5 * T)  # past the first-message timeout
                session.push(x[:, :, :1])
                session.push(x[:, :, 1:])
                got = session.collect()
            assert torch.equal(got, want)
            return

    async def late_first_push() -> Any:
        async with AsyncVaeClient(server.target, timeout=WAIT_S) as aclient:
            async with aclient.session(output_type="pt") as session:
                async def read() -> list[Any]:
                    return [chunk async for chunk in session]

                reader = asyncio.ensure_future(read())  # waiting for frames before any push
                await asyncio.sleep(T / 2)
                assert server.server.pool.admitted == 0
                await asyncio.sleep(2.5 * T)
                await session.push(x[:, :, :1])
                await session.push(x[:, :, 1:])
            return await reader

    chunks = asyncio.run(late_first_push())
    assert torch.equal(torch.as_tensor(assemble(chunks)), want)


# -- what is not idle ------------------------------------------------------------------------------

def test_a_session_is_not_idle_while_the_server_decodes_what_it_sent(server, gate):
    """Lockstep: the client waits for a chunk's frames before it sends the next one."""
    entered, open_ = gate
    latents = torch.randn(1, Z, 2, 5, 7)
    with VaeClient(server.target, timeout=WAIT_S) as client:
        with client.session(format="raw", raw_dtype="float32") as session:
            session.push(latents[:, :, :1])
            assert entered.wait(WAIT_S)
            time.sleep(3 * T)  # the decode is held: the server owes the client, the client waits
            open_.set()
            chunks = iter(session)
            first = next(chunks)  # latent frame 0's frames, then the next chunk
            session.push(latents[:, :, 1:])
            session.close()
            frames = [first.frames] + [chunk.frames for chunk in chunks]
        one_shot = client.decode(latents, format="raw", raw_dtype="float32")
    assert torch.equal(torch.cat(frames, 2), one_shot)


def test_a_session_held_by_its_full_backlog_is_not_idle(server, gate):
    """Eight latent frames against a backlog of four: the server stops reading, not the client."""
    entered, open_ = gate
    latents = torch.randn(1, Z, 8, 5, 7)
    with VaeClient(server.target, timeout=WAIT_S) as client:
        with client.session(format="raw", raw_dtype="float32") as session:
            for i in range(8):
                session.push(latents[:, :, i : i + 1])
            assert entered.wait(WAIT_S)
            time.sleep(3 * T)
            open_.set()
            streamed = session.collect()
        assert torch.equal(streamed, client.decode(latents, format="raw", raw_dtype="float32"))


def test_a_half_closed_session_is_not_idle_while_its_frames_decode(server, gate):
    entered, open_ = gate
    latents = torch.randn(1, Z, 3, 5, 7)
    with VaeClient(server.target, timeout=WAIT_S) as client:
        with client.session(format="raw", raw_dtype="float32") as session:
            session.push(latents)
            session.close()
            assert entered.wait(WAIT_S)
            time.sleep(3 * T)
            open_.set()
            streamed = session.collect()
        assert torch.equal(streamed, client.decode(latents, format="raw", raw_dtype="float32"))


# -- the sessions gauge --------------------------------------------------------------------------------

def test_calls_count_in_the_sessions_gauge_from_admission():
    """No timeouts (0): idle calls hold their slots, and the gauge shows them all along."""
    config = make_config(max_sessions=3, session_first_message_timeout=0, session_idle_timeout=0, metrics_port=0)
    with serve_in_thread(config) as running:
        pool = running.server.pool
        with grpc.insecure_channel(running.target) as channel:
            idle = [_Idle(channel) for _ in range(3)]
            try:
                _wait_for(lambda: pool.admitted == 3, "three calls admitted")
                assert [load.active_sessions for load in pool.device_loads()] == [3]
                assert _sessions_gauge(_scrape(running.server.metrics_port)) == 3
                with VaeClient(running.target, timeout=WAIT_S) as client:
                    with pytest.raises(ResourceExhaustedError):
                        client.decode(torch.randn(1, Z, 1, 5, 7))
                time.sleep(3 * T)  # 0 = no limit: still held
                assert pool.admitted == 3 and not any(call.call.done() for call in idle)
            finally:
                for call in idle:
                    call.release()
        _wait_for(lambda: pool.admitted == 0, "cancelled calls free their slots")
        assert _sessions_gauge(_scrape(running.server.metrics_port)) == 0


# -- flags ----------------------------------------------------------------------------------------------

def test_the_timeout_flags_reach_the_config():
    args = build_parser("serve").parse_args(
        ["serve", "--device", "cpu", f"{FIRST_FLAG}=2.5", f"{IDLE_FLAG}=0"])
    config = config_from_args(args)
    assert (config.session_first_message_timeout, config.session_idle_timeout) == (2.5, 0.0)
    defaults = config_from_args(build_parser("serve").parse_args(["serve", "--device", "cpu"]))
    assert (defaults.session_first_message_timeout, defaults.session_idle_timeout) == (
        ServerConfig.session_first_message_timeout, ServerConfig.session_idle_timeout)
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser("serve").parse_args(["serve", f"{IDLE_FLAG}={bad}"])


def _readme_flag_rows() -> list[tuple[list[str], str]]:
    """(flags, default cell) per row of the README's `vaed serve` flag table."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme.split("## `vaed serve` flags", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]  # no cell holds a "|"
            rows.append((re.findall(r"`(--[a-z0-9-]+)", cells[0]), cells[1]))
    return rows


def _readme_defaults() -> dict[str, str]:
    """flag -> its README default: a row of N flags with N comma-separated defaults pairs them
    ("`--host`, `--port` | `0.0.0.0`, `50051`"); otherwise every flag of the row gets the cell."""
    out: dict[str, str] = {}
    for flags, cell in _readme_flag_rows():
        parts = [p.strip() for p in cell.split(", ")]
        for i, flag in enumerate(flags):
            out[flag] = parts[i] if len(flags) > 1 and len(parts) == len(flags) else cell
    return out


def test_the_readme_flag_table_matches_vaed_serve_help():
    """Every `vaed serve` flag has a row in the README's table and every row a flag, and each
    row's default is the one --help shows (the config's): a concrete default is written as that
    value, a flag without one (None) in words, a switch (--no-warmup, --encode, --disable-op) with none."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    actions = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    actions.pop("--help")
    in_table = _readme_defaults()
    assert set(actions) == set(in_table), (
        f"only in --help: {sorted(set(actions) - set(in_table))}; only in README: {sorted(set(in_table) - set(actions))}"
    )
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    for flag, action in actions.items():
        readme = in_table[flag]
        if action.dest in fields:  # --gpu/--device set `devices` and have no config default
            assert action.default == fields[action.dest].default or action.default == [], flag
        switch = isinstance(action, (argparse._StoreFalseAction, argparse._StoreTrueAction, argparse._AppendAction))
        if switch:
            assert readme == "", f"{flag} is a switch; the README gives it a default {readme!r}"
        elif action.default is None:
            # said in words ("off", "2 x sessions + 8"), never as a value the flag does not default to
            assert readme and not re.fullmatch(r"`?[\d.]+`?", readme), f"{flag}: README default {readme!r}"
        else:
            value = readme.split(" (")[0].strip("`")
            if isinstance(action.default, (int, float)):
                assert float(value) == action.default, f"{flag}: README says {readme!r}, --help {action.default!r}"
            else:
                assert value == str(action.default), f"{flag}: README says {readme!r}, --help {action.default!r}"
    assert float(in_table[FIRST_FLAG]) == ServerConfig.session_first_message_timeout
    assert float(in_table[IDLE_FLAG]) == ServerConfig.session_idle_timeout


# -- a real `vaed serve` --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sixteen_idle_streams_hold_every_slot_until_the_timeout_then_a_new_client_decodes():
    """16 DecodeStream calls that open and send nothing take all 16 slots and the gauge
    reads 16; after the first-message timeout (4 s here) each ends DEADLINE_EXCEEDED
    naming the flag, and a new client is admitted and decodes. Without the timeout one
    such call held its slot 334.7 s with the default flags (until its connection aged
    out) while the gauge read 0; now 10.1 s (30.8 s for a session idle after a chunk)."""
    metrics_port = _free_port()
    proc, target = start_cli_server(
        "--max-sessions", "16", f"{FIRST_FLAG}=4", f"{IDLE_FLAG}=4", "--metrics-port", str(metrics_port))
    channel = grpc.insecure_channel(target)
    idle: list[_Idle] = []
    try:
        idle = [_Idle(channel) for _ in range(16)]
        _wait_for(lambda: _sessions_gauge(_scrape(metrics_port)) == 16, "the gauge reads 16 idle sessions")
        with VaeClient(target, timeout=WAIT_S) as client:
            with pytest.raises(ResourceExhaustedError):
                client.decode(torch.randn(1, Z, 1, 5, 7))
        for call in idle:
            code, details = call.status()
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and FIRST_FLAG in details, (code, details)
        with VaeClient(target, timeout=WAIT_S) as client:
            assert client.decode(torch.randn(1, Z, 2, 5, 7)).shape[1] == 5
        _wait_for(lambda: _sessions_gauge(_scrape(metrics_port)) == 0, "the gauge is back to 0")
    finally:
        for call in idle:
            call.release()
        channel.close()
        proc.kill()
        proc.wait(30)


# -- a client's stream that it never reads ---------------------------------------------------------

def test_a_stream_closed_or_dropped_before_its_first_next_frees_its_slot():
    """`stream()` opens its call before the first next(): closing the iterator, or dropping it,
    cancels that call at once. The server's own limits are far beyond the wait bound here, so
    only the client's cancel frees the one slot in time."""
    far = 10 * WAIT_S
    config = make_config(max_sessions=1, session_first_message_timeout=far, session_idle_timeout=far,
                         send_timeout=far)
    latents = torch.randn(1, Z, 4, 5, 7)
    with serve_in_thread(config) as running, VaeClient(running.target, timeout=far) as client:
        want = client.decode(latents, format="raw", raw_dtype="float32")
        for how in ("close", "drop"):
            chunks = client.stream(latents)
            _wait_for(lambda: running.server.pool.admitted == 1, f"the stream to {how} is admitted")
            if how == "close":
                chunks.close()
            del chunks
            _wait_for(lambda: _slots_free(running), f"the slot of the stream to {how} is free")
        assert torch.equal(client.decode(latents, format="raw", raw_dtype="float32"), want)


def test_a_break_out_of_a_streams_with_block_cancels_its_decode(caplog: pytest.LogCaptureFixture):
    """A `break` tells an iterator nothing, so a stream still referenced after one decoded on to
    the end for nobody; leaving its `with` block closes it: the call, held on the server at
    latent frame 1 until then, ends CANCELLED and frees its slot."""
    from harness import engine_calling_at

    caplog.set_level("INFO", logger="vaed")
    config = make_config(max_sessions=1, warmup=False)  # the warm-up's frame 1 would wait too
    release = threading.Event()
    build = engine_calling_at(config, 1, lambda: release.wait(WAIT_S))
    with serve_in_thread(config, build_engine=build) as running, VaeClient(running.target, timeout=WAIT_S) as client:
        try:
            with client.stream(torch.randn(1, Z, 6, 5, 7), request_id="break-in-with") as chunks:
                for _ in chunks:
                    break
            _wait_for(lambda: _slots_free(running), "the slot of the stream left by a break")
        finally:
            release.set()
        _wait_for(lambda: "id=break-in-with status=" in caplog.text, "the call's log line")
    assert "id=break-in-with status=CANCELLED" in caplog.text, caplog.text


def test_an_encode_that_stops_sending_is_told_so_in_its_own_words():
    """The idle limit holds Encode sessions too; its message names Encode and the video frames
    it sent (it read "no DecodeStream message" and counted encoder calls as latent frames)."""
    config = make_config(encode=True, session_first_message_timeout=T, session_idle_timeout=T)
    frames = torch.zeros(1, 3, 5, 16, 16)  # frame 0, then one encoder call of 4: two results
    first = wire.pb.VideoChunk(frames=wire.to_message(frames))
    with serve_in_thread(config) as running, grpc.insecure_channel(running.target) as channel:
        call = _Idle(channel, "Encode", first=first)
        try:
            replies = list(_replies_until_status(call))
            code, details = call.status()
        finally:
            call.release()
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
        assert "no Encode message arrived" in details and "5 video frames received" in details, details
        assert IDLE_FLAG in details and len(replies) == 2
        _wait_for(lambda: _slots_free(running), "the idle encode's slot is free")


def _replies_until_status(idle: _Idle) -> Any:
    try:
        yield from idle.call
    except grpc.RpcError:
        return
