"""Chaos: replicas die, drain or lose their connections mid-call, and the client's resume
(`vaed_client.resume`) still gives the application every frame exactly once, equal to an
undisturbed decode (torch.equal). Real `vaed serve` processes (tiny random model, CPU,
loopback), the real client. Each test prints its recovery times (failure -> first frame after
it, re-decode of the skipped frames included); none is asserted: the machine may be loaded.

Faults are placed by events, never by sleeps: kills happen from inside the client's own frame
handling after a set number of messages (so a kill is always mid-call whatever the machine's
speed), the rolling update pushes the rest of its sessions' latents only once the draining
replica has exited, and the proxy cuts after set byte counts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Iterator

import pytest
import torch

from vaed_client import AsyncVaeClient, VaeClient
from vaed_client import core as client_core
from vaed_client.resume import CallReport, ResumePolicy
from vaed_client.encoding import EncodedAssembly
from vaed_client.video import assemble

from chaos_tools import ChaosProxy, Replica, free_port, random_faults, recovery_split, start_replicas

pytestmark = pytest.mark.slow

Z = 4  # the tiny model's z_dim; 8x8 latents decode to 64x64 frames


def latents(t: int, seed: int = 0, hw: int = 8) -> torch.Tensor:
    return torch.randn(1, Z, t, hw, hw, generator=torch.Generator().manual_seed(seed))


def frames_of(t: int) -> int:
    return 1 + 4 * (t - 1)


def report_line(name: str, report: CallReport, resumed_calls: list[dict[str, str]] = ()) -> None:
    """Print a call's resumes; with the new server's log lines of its resumed calls, each recovery
    split into reconnect and the server's re-decode (they pair up when every resume skipped frames)."""
    recovery = ", ".join(f"{s * 1e3:.0f} ms" for s in report.recovery_seconds) or "-"
    print(f"{name}: resumes={report.resumes} recovery={recovery} reasons={report.reasons}")
    if len(resumed_calls) == len(report.recovery_seconds):
        for seconds, call in zip(report.recovery_seconds, resumed_calls):
            print(f"  recovery {recovery_split(seconds, call)}")


def check_resumed_call(call: dict[str, str], total: int) -> None:
    """The new server's log line of a resumed call: it succeeded, and the frames it skipped and
    the frames it sent make the whole video (it skipped exactly what the client had)."""
    assert call["status"] == "OK"
    assert int(call["skipped_frames"]) > 0 and int(call["skipped_frames"]) + int(call["frames"]) == total


def assert_tiles_once(chunks: list[Any], total: int) -> None:
    """Every frame 0..total-1 exactly once, in order."""
    starts = [c.first_frame for c in chunks]
    assert starts == sorted(starts)
    covered = [f for c in chunks for f in range(c.first_frame, c.end_frame)]
    assert covered == list(range(total)), "frames lost or duplicated"


@pytest.fixture()
def pair() -> Iterator[list[Replica]]:
    replicas = start_replicas((), ())
    yield replicas
    for replica in replicas:
        replica.stop()


class KillAfter:
    """Wraps the client's whole-video assembly: kill -9 the serving replica once `messages`
    frame messages have been placed (the call is then mid-video by construction)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, replicas: dict[str, Replica], report: CallReport,
                 messages: int) -> None:
        self.killed_at: float | None = None
        add = client_core.Assembly.add
        count = [0]

        def counting_add(assembly: Any, reply: Any) -> None:
            add(assembly, reply)
            count[0] += 1
            if count[0] == messages:
                replicas[report.targets[0]].kill()
                self.killed_at = time.monotonic()

        monkeypatch.setattr(client_core.Assembly, "add", counting_add)


def test_kill9_mid_decode_resumes_on_the_other_replica(pair: list[Replica], monkeypatch: pytest.MonkeyPatch) -> None:
    x = latents(12)
    with VaeClient(pair[1].target) as client:
        want = client.decode(x)  # undisturbed
    report = CallReport()
    killer = KillAfter(monkeypatch, {r.target: r for r in pair}, report, messages=8)
    with VaeClient([r.target for r in pair]) as client:
        got = client.decode(x, report=report, request_id="chaos-decode")
    assert killer.killed_at is not None and report.resumes == 1
    assert torch.equal(got, want) and got.shape[1] == frames_of(12)
    survivor = next(r for r in pair if r.target == report.targets[1])
    (call,) = survivor.resumed_calls("chaos-decode")  # it skipped, not resent
    report_line("kill -9 mid-Decode", report, [call])
    check_resumed_call(call, frames_of(12))


def test_kill9_before_the_first_reply_resumes_and_never_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replica is killed right after a decode's DecodeStream opened on it, before frame 0's
    reply, while the client still holds back the rest of the latents: the sync client resumes on
    the other one, three times over. With the channel's retry policy on DecodeStream, grpc left
    2 of 3 such calls with their status set and their read waiting forever (timeout or not)."""
    x = latents(4, seed=3, hw=32)  # 256x256 frames: frame 0 takes the CPU a while, the kill comes first
    opened = VaeClient._open_stream
    for trial in range(3):
        pair = start_replicas((), ())
        try:
            with VaeClient(pair[1].target) as client:
                want = client.decode(x)
            replicas = {r.target: r for r in pair}
            report = CallReport()

            def open_then_kill(client: VaeClient, *args: Any) -> Any:
                gate = opened(client, *args)
                if report.resumes == 0:
                    replicas[client.targets[args[2].target]].kill()
                return gate

            monkeypatch.setattr(VaeClient, "_open_stream", open_then_kill)
            result: dict[str, Any] = {}

            def decode() -> None:
                try:
                    with VaeClient(list(replicas), timeout=120) as client:
                        result["video"] = client.decode(x, report=report)
                except Exception as exc:  # noqa: BLE001  (asserted on below, with the report)
                    result["error"] = exc

            worker = threading.Thread(target=decode, daemon=True)
            worker.start()
            worker.join(150)
            assert not worker.is_alive(), f"trial {trial}: the decode hung; report {report}"
            assert "error" not in result, (trial, result["error"], report)
            assert report.resumes == 1 and torch.equal(result["video"], want), (trial, report)
        finally:
            monkeypatch.undo()
            for replica in pair:
                replica.stop()


def test_a_resumed_sync_session_sends_every_latent_frame_pushed_after_the_resume(pair: list[Replica]) -> None:
    """gRPC reads a resumed session's request stream on its own thread before DecodeStream
    returns. Held there 0.3 s (a loaded machine), the new stream still sends what is pushed
    later: it ended after its replay when it saw the failed attempt's call done, and the session
    came back with 5 of 37 frames and no error."""
    x = latents(10, seed=3)
    with VaeClient(pair[1].target) as client:
        want = client.decode(x)
    replicas = {r.target: r for r in pair}
    killed, reopened = threading.Event(), threading.Event()

    class SlowToReturn:
        def __init__(self, stub: Any) -> None:
            self.stub = stub

        def DecodeStream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802  (the stub's name)
            call = self.stub.DecodeStream(*args, **kwargs)
            if killed.is_set():
                time.sleep(0.3)
                reopened.set()
            return call

        def __getattr__(self, name: str) -> Any:
            return getattr(self.stub, name)

    chunks: list[Any] = []
    with VaeClient(list(replicas)) as client:
        client._stub_objs = [SlowToReturn(stub) for stub in client._stub_objs]
        session = client.session(request_id="chaos-resumed-session")
        reader = threading.Thread(target=lambda: chunks.extend(session), daemon=True)
        reader.start()
        session.push(x[:, :, :2])
        deadline = time.monotonic() + 60
        while not chunks and time.monotonic() < deadline:  # frames of the first attempt came
            time.sleep(0.01)
        replicas[session.report.targets[0]].kill()
        killed.set()
        assert reopened.wait(60)  # the rest is pushed once the resumed attempt's call is open
        for i in range(2, 10):
            session.push(x[:, :, i : i + 1])
        session.close()
        reader.join(120)
    assert not reader.is_alive() and session.report.resumes == 1
    assert_tiles_once(chunks, frames_of(10))
    assert torch.equal(assemble(chunks), want)


def test_kill9_mid_decode_stream_gives_every_frame_once(pair: list[Replica]) -> None:
    x = latents(12, seed=1)
    with VaeClient(pair[1].target) as client:
        want = client.decode(x)
    replicas = {r.target: r for r in pair}
    report = CallReport()
    chunks = []
    with VaeClient([r.target for r in pair]) as client:
        for chunk in client.stream(x, report=report, request_id="chaos-stream"):
            chunks.append(chunk)
            if len(chunks) == 5:
                replicas[report.targets[0]].kill()
    assert report.resumes == 1
    (call,) = replicas[report.targets[1]].resumed_calls("chaos-stream")
    report_line("kill -9 mid-DecodeStream", report, [call])
    check_resumed_call(call, frames_of(12))
    assert_tiles_once(chunks, frames_of(12))
    assert torch.equal(assemble(chunks), want)


def test_kill9_mid_async_decode_and_stream(pair: list[Replica], monkeypatch: pytest.MonkeyPatch) -> None:
    """The asyncio client's decode and stream resume like the sync client's: a decode whose
    replica is killed after 8 frame messages, then (on a fresh replica beside the survivor) a
    stream whose replica is killed after 5 chunks (each on whichever replica it started on:
    the client's first call, its model info, took the first turn of its targets)."""
    x = latents(12, seed=4)
    with VaeClient(pair[1].target) as client:
        want = client.decode(x)
    decode_report, stream_report = CallReport(), CallReport()
    killer = KillAfter(monkeypatch, {r.target: r for r in pair}, decode_report, messages=8)

    async def decode() -> torch.Tensor:
        async with AsyncVaeClient([r.target for r in pair]) as client:
            return await client.decode(x, report=decode_report, request_id="chaos-async-decode")

    got = asyncio.run(decode())
    assert killer.killed_at is not None and decode_report.resumes == 1
    assert torch.equal(got, want)
    survivor = next(r for r in pair if r.target == decode_report.targets[1])
    (call,) = survivor.resumed_calls("chaos-async-decode")
    report_line("kill -9 mid-Decode (asyncio)", decode_report, [call])
    check_resumed_call(call, frames_of(12))
    monkeypatch.undo()

    (fresh,) = start_replicas(())
    try:
        replicas = {fresh.target: fresh, survivor.target: survivor}

        async def stream() -> list[Any]:
            chunks: list[Any] = []
            async with AsyncVaeClient([fresh.target, survivor.target]) as client:
                async for chunk in client.stream(x, report=stream_report, request_id="chaos-async-stream"):
                    chunks.append(chunk)
                    if len(chunks) == 5:
                        replicas[stream_report.targets[0]].kill()
            return chunks

        chunks = asyncio.run(stream())
        assert stream_report.resumes == 1 and set(stream_report.targets) == {fresh.target, survivor.target}
        (call,) = replicas[stream_report.targets[1]].resumed_calls("chaos-async-stream")
        report_line("kill -9 mid-DecodeStream (asyncio)", stream_report, [call])
        check_resumed_call(call, frames_of(12))
        assert_tiles_once(chunks, frames_of(12))
        assert torch.equal(assemble(chunks), want)
    finally:
        fresh.stop()


# -- Encode ---------------------------------------------------------------------------------------

ENCODE_FRAMES = 1 + 4 * 11  # 12 latent frames of 64x96 video


def video(seed: int = 0) -> torch.Tensor:
    return torch.rand(1, 3, ENCODE_FRAMES, 64, 96, generator=torch.Generator().manual_seed(seed)) * 2 - 1


class KillAfterLatents:
    """kill -9 the replica serving an encode once `count` latent frames reached the client's
    assembly (mid-call by construction)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, replicas: dict[str, Replica], report: CallReport,
                 count: int) -> None:
        self.killed = False
        add = EncodedAssembly.add
        seen = [0]

        def counting_add(assembly: Any, reply: Any) -> None:
            add(assembly, reply)
            seen[0] += not reply.final
            if seen[0] == count and not self.killed:
                replicas[report.targets[0]].kill()
                self.killed = True

        monkeypatch.setattr(EncodedAssembly, "add", counting_add)


@pytest.fixture()
def encoding_pair() -> Iterator[list[Replica]]:
    replicas = start_replicas(("--encode",), ("--encode",))
    yield replicas
    for replica in replicas:
        replica.stop()


@pytest.mark.parametrize("front", ["sync", "asyncio"])
@pytest.mark.parametrize("given_id", [True, False], ids=["given-id", "server-made-id"])
def test_kill9_mid_encode_resumes_bit_identical(encoding_pair: list[Replica], monkeypatch: pytest.MonkeyPatch,
                                                front: str, given_id: bool, caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 of the replica after 4 of 12 latent frames: the encode is opened again on the
    other replica, which encodes the whole video again (the causal cache needs every frame); the
    client drops the 4 latent frames it had, and the moments equal an undisturbed encode. A call
    sent without an id resumes under the one the first server gave it, as a decode does."""
    x = video(seed=3)
    with VaeClient(encoding_pair[1].target) as client:
        want = client.encode(x)  # undisturbed
    assert want.shape[2] == 12
    report = CallReport()
    killer = KillAfterLatents(monkeypatch, {r.target: r for r in encoding_pair}, report, count=4)
    targets = [r.target for r in encoding_pair]
    sent_id = f"chaos-encode-{front}" if given_id else None
    caplog.set_level("WARNING", logger="vaed_client.resume")
    if front == "sync":
        with VaeClient(targets) as client:
            got = client.encode(x, report=report, request_id=sent_id)
    else:
        async def encode() -> torch.Tensor:
            async with AsyncVaeClient(targets) as client:
                return await client.encode(x, report=report, request_id=sent_id)

        got = asyncio.run(encode())
    assert killer.killed and report.resumes == 1 and report.targets[0] != report.targets[1]
    assert torch.equal(got, want)
    # the resume's warning names the call's id: the one sent, or the first server's
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "vaed_client.resume"]
    request_id = warning.split(":", 1)[0].removeprefix("request ")
    assert request_id == sent_id if given_id else len(request_id) == 16
    survivor = next(r for r in encoding_pair if r.target == report.targets[1])
    assert survivor.wait_for_line(f"Encode id={request_id} status=OK")
    (line,) = [ln for ln in survivor.lines if f"Encode id={request_id} " in ln]
    assert " groups=12 " in line  # it encoded (and sent) every latent frame; the client dropped 4
    report_line(f"kill -9 mid-Encode ({front})", report)


def test_kill9_while_the_replacement_warms_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving replica dies mid-session while the only other one is still starting (first
    not listening, then UNAVAILABLE while it warms up): the asyncio session keeps resuming with
    backoff until the replacement serves, then finishes bit-identical."""
    (serving,) = start_replicas(())
    replacement: Replica | None = None
    port = free_port()
    x = latents(10, seed=2)
    try:
        with VaeClient(serving.target) as client:
            want = client.decode(x)
        policy = ResumePolicy(max_resumes=60, max_backoff=1.0)  # ~60 s of patience for a loaded machine

        async def run() -> tuple[list[Any], CallReport]:
            nonlocal replacement
            chunks: list[Any] = []
            async with AsyncVaeClient([serving.target, f"127.0.0.1:{port}"], resume=policy) as client:
                session = client.session(request_id="chaos-warmup")
                async with session:
                    await session.push(x[:, :, :4])
                    async for chunk in session:
                        chunks.append(chunk)
                        if chunk.end_frame >= 5:
                            break
                    # Warming up: 256x256 and 320x320 in the warm-up shapes take seconds on the CPU;
                    # the port is bound before the warm-up starts, so it answers UNAVAILABLE meanwhile.
                    replacement = Replica("--warmup-shapes", "256x256,320x320", port=port)
                    await asyncio.to_thread(replacement.wait_bound)
                    serving.kill()
                    await session.push(x[:, :, 4:])
                chunks += [chunk async for chunk in session]  # the rest, after the half-close
                return chunks, session.report

        chunks, report = asyncio.run(run())
        assert replacement is not None
        (call,) = replacement.resumed_calls("chaos-warmup")
        report_line("kill -9 while the replacement warms up", report)
        print(f"  the last recovery {recovery_split(report.recovery_seconds[-1], call)}")
        check_resumed_call(call, frames_of(10))
        assert report.resumes >= 1 and report.targets[-1] == f"127.0.0.1:{port}"
        assert_tiles_once(chunks, frames_of(10))
        assert torch.equal(assemble(chunks), want)
    finally:
        serving.stop()
        if replacement is not None:
            replacement.stop()


def test_sigterm_of_one_of_two_replicas_while_8_sessions_stream() -> None:
    """A rolling update: one replica drains (SIGTERM, --grace 1) while 8 sessions stream. Each
    session pushes half its latents and has frames back; then SIGTERM; each pushes one more chunk
    (the draining replica still serves its admitted sessions); the rest are pushed only once every
    session of the draining replica was cut (at the end of the grace, by construction: none of
    them half-closed) and resumed on the other replica, replaying its latents."""
    draining, staying = start_replicas(("--grace", "1"), ())
    t = 12
    xs = [latents(t, seed=10 + i) for i in range(8)]
    try:
        with VaeClient(staying.target) as client:
            wants = [client.decode(x) for x in xs]

        sessions: list[Any] = []

        async def one(client: AsyncVaeClient, x: torch.Tensor, first: asyncio.Event,
                      terminated: asyncio.Event, drained: asyncio.Event) -> tuple[list[Any], CallReport]:
            session = client.session(request_id=f"rolling-{len(sessions)}")
            sessions.append(session)
            chunks: list[Any] = []

            async def read() -> None:
                async for chunk in session:
                    chunks.append(chunk)
                    first.set()

            async with session:
                reader = asyncio.ensure_future(read())
                for i in range(t // 2):
                    await session.push(x[:, :, i : i + 1])
                await first.wait()
                await terminated.wait()
                await session.push(x[:, :, t // 2 : t // 2 + 1])  # during the drain
                await drained.wait()
                for i in range(t // 2 + 1, t):
                    await session.push(x[:, :, i : i + 1])
            await reader
            return chunks, session.report

        async def run() -> tuple[list[tuple[list[Any], CallReport]], float]:
            async with AsyncVaeClient([draining.target, staying.target]) as client:
                firsts = [asyncio.Event() for _ in xs]
                terminated, drained = asyncio.Event(), asyncio.Event()
                tasks = [asyncio.ensure_future(one(client, x, f, terminated, drained)) for x, f in zip(xs, firsts)]
                for f in firsts:
                    await f.wait()
                draining.terminate()
                sent_at = time.monotonic()
                terminated.set()
                cut = [s for s in sessions if s.report.targets[0] == draining.target]
                deadline = time.monotonic() + 120
                while not all(s.report.resumes for s in cut):  # a condition, polled: resumes have no event
                    assert time.monotonic() < deadline, "the draining replica's sessions did not resume"
                    await asyncio.sleep(0.02)
                drain_s = time.monotonic() - sent_at
                drained.set()
                results = await asyncio.gather(*tasks)
                code = await asyncio.to_thread(draining.proc.wait, 120)
                assert code == 0, draining.log()  # it drained and exited cleanly
                return results, drain_s

        started = time.monotonic()
        results, drain_s = asyncio.run(run())
        print(f"8 sessions across a rolling update in {time.monotonic() - started:.1f} s "
              f"(SIGTERM to the last of its sessions resumed elsewhere: {drain_s:.1f} s)")
        for i, ((chunks, report), want) in enumerate(zip(results, wants)):
            resumed = staying.resumed_calls(f"rolling-{i}") if report.resumes else []
            report_line(f"session {i} ({report.targets[0]})", report, resumed)
            assert_tiles_once(chunks, frames_of(t))
            assert torch.equal(assemble(chunks), want)
            for call in resumed:
                check_resumed_call(call, frames_of(t))
        on_draining = [r for _, r in results if r.targets[0] == draining.target]
        on_staying = [r for _, r in results if r.targets[0] == staying.target]
        assert len(on_draining) == len(on_staying) == 4  # the client starts calls round-robin
        assert all(r.resumes >= 1 and r.targets[-1] == staying.target for r in on_draining)
        assert all(r.resumes == 0 for r in on_staying)
        assert any("draining" in line for line in draining.lines), draining.log()
    finally:
        draining.stop()
        staying.stop()


def test_proxy_cuts_stalls_and_delays_connections() -> None:
    """One replica behind a proxy that cuts two connections and stalls one at random points
    inside the reply, and delays every piece: a decode and a session through it (one target, so
    every resume goes back through the proxy on a new connection; the stall is found by the
    client's keepalive, here 0.5 s + 1 s)."""
    (replica,) = start_replicas(("--min-ping-interval", "0.1"))
    # 4x4 latents (32x32 frames): every resume re-decodes what it skips, a quarter of the work
    # of 8x8 on the CPU; the reply (138 KB) still holds every fault's byte count.
    x = latents(12, seed=3, hw=4)
    reply_bytes = frames_of(12) * 32 * 32 * 3
    proxy = ChaosProxy(replica.port, random_faults(7, ["cut", "stall", "cut"], reply_bytes, delay=0.002),
                       default_delay=0.002)
    keepalive = [("grpc.keepalive_time_ms", 500), ("grpc.keepalive_timeout_ms", 1000)]
    try:
        with VaeClient(replica.target) as client:
            want = client.decode(x)
        with VaeClient(proxy.target, options=keepalive, resume=ResumePolicy(max_resumes=8)) as client:
            decode_report = CallReport()
            got = client.decode(x, report=decode_report, request_id="proxy-decode")
            with client.session(request_id="proxy-session") as session:
                for i in range(0, 12, 3):
                    session.push(x[:, :, i : i + 3])
                streamed = session.collect()
            session_report = session.report
        print("proxy:", proxy.events)
        report_line("proxy decode", decode_report, replica.resumed_calls("proxy-decode", timeout=5))
        report_line("proxy session", session_report, replica.resumed_calls("proxy-session", timeout=5))
        assert torch.equal(got, want) and torch.equal(streamed, want)
        # Each fault that fired (the first two always do: at least a reply's bytes follow them)
        # cost exactly one resume.
        assert len(proxy.events) >= 2
        assert decode_report.resumes + session_report.resumes == len(proxy.events)
    finally:
        proxy.close()
        replica.stop()
