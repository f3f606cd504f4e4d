"""Operations end to end, through a real vaed server and the real client:
metrics scraped during a real decode, bearer-token auth (missing, wrong,
right; health open without a token), and a TLS round trip."""

from __future__ import annotations

import argparse
import urllib.request
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import harness
from harness import write_self_signed
from vaed_client import cli as client_cli
from vaed_client.wire import AUTH_TOKEN_ENV
from vaed.config import ServerConfig
from vaed_client import VaeClient
from vaed_client.errors import InvalidArgumentError, ResourceExhaustedError, UnauthenticatedError, UnavailableError

TOKEN = "e2e-token-5f1c0a7d"
MODEL = "random:wan2.1-tiny"  # z_dim 4, 8x spatial, 4x temporal; float32 on CPU


def make_config(**overrides: object) -> ServerConfig:
    """Tiny CPU server on an ephemeral loopback port, 1 s drain."""
    return ServerConfig(model=MODEL, devices=("cpu",), host="127.0.0.1", port=0, grace=1.0,
                        **overrides)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The server falls back to $VAED_AUTH_TOKEN; keep the caller's env out.
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)


def latents(t: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, 4, t, 5, 7), dtype=np.float32)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body) for s in f.samples
    }


def _health(target: str, **kw: object) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    client_cli.add_health_arguments(parser)
    args = parser.parse_args(["--server", target, "--timeout", "5"])
    for k, v in kw.items():
        setattr(args, k, v)
    serving, text = client_cli.check_health(args)
    return (0 if serving else 1), text


# ------------------------------------------------------------ metrics


@pytest.fixture(scope="module")
def metrics_server() -> Iterator[harness.RunningServer]:
    with harness.serve_in_thread(make_config(metrics_port=0)) as running:
        yield running


def test_metrics_move_during_real_decode(metrics_server: harness.RunningServer) -> None:
    port = metrics_server.server.metrics_port
    assert port
    before = scrape(port)
    ok_key = ("vaed_requests_total", (("code", "OK"), ("method", "Decode")))
    t = 3
    # A whole-video Decode RPC (an independent client's), then a DecodeStream session.
    assert harness.decode_rpc(metrics_server.target, latents(t)) == 1 + 4 * (t - 1)
    with VaeClient(metrics_server.target, timeout=60) as client:

        # Mid-session: one DecodeStream open, first frames received.
        session = client.session()
        session.push(latents(1, seed=1))
        first = next(iter(session))
        assert first.frames.shape[1] == 1
        during = scrape(port)
        assert during[("vaed_active_sessions", (("device", "cpu"),))] == 1
        session.push(latents(1, seed=2))
        session.close()
        rest = list(session)
        assert sum(c.frames.shape[1] for c in rest) == 4
    after = scrape(port)

    assert after[ok_key] - before.get(ok_key, 0) == 1
    ds_key = ("vaed_requests_total", (("code", "OK"), ("method", "DecodeStream")))
    assert after.get(ds_key, 0) - before.get(ds_key, 0) == 1
    frames = after[("vaed_frames_decoded_total", ())] - before[("vaed_frames_decoded_total", ())]
    assert frames == (1 + 4 * (t - 1)) + (1 + 4)
    latent = (after[("vaed_latent_frames_decoded_total", ())]
              - before[("vaed_latent_frames_decoded_total", ())])
    assert latent == t + 2
    # a method the server does not have: UNIMPLEMENTED, counted as `other` (it was not counted)
    with grpc.insecure_channel(metrics_server.target) as channel:
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary("/vaed.v1.VaeDecoder/NoSuchMethod")(b"", timeout=30)
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    other_key = ("vaed_requests_total", (("code", "UNIMPLEMENTED"), ("method", "other")))
    assert scrape(port).get(other_key, 0) - before.get(other_key, 0) == 1
    # a batch counts each of its videos' frames (B = 2 had counted as one video)
    with VaeClient(metrics_server.target, timeout=60) as client:
        client.decode(np.concatenate([latents(2, seed=3), latents(2, seed=4)]))
    batched = scrape(port)
    assert batched[("vaed_frames_decoded_total", ())] - after[("vaed_frames_decoded_total", ())] == 2 * (1 + 4)
    assert batched[("vaed_latent_frames_decoded_total", ())] - after[("vaed_latent_frames_decoded_total", ())] == 2 * 2
    dur = ("vaed_request_duration_seconds_count", (("method", "Decode"),))
    assert after[dur] - before.get(dur, 0) == 1
    ttff = ("vaed_time_to_first_frame_seconds_count", (("method", "Decode"),))
    assert after[ttff] - before.get(ttff, 0) == 1
    assert after[("vaed_active_sessions", (("device", "cpu"),))] == 0
    assert after[("vaed_pending_latent_frames", (("device", "cpu"),))] == 0
    assert ("vaed_gpu_memory_allocated_bytes", (("device", "cpu"),)) in after


@pytest.mark.parametrize("method", ["Decode", "DecodeStream"])
def test_metrics_count_errors(metrics_server: harness.RunningServer, method: str) -> None:
    """A refused call is counted under its own method: an independent client's Decode RPC, and
    the client's decode() (a DecodeStream)."""
    port = metrics_server.server.metrics_port
    assert port
    key = ("vaed_requests_total", (("code", "INVALID_ARGUMENT"), ("method", method)))
    before = scrape(port).get(key, 0)
    bad = np.zeros((1, 3, 1, 5, 7), dtype=np.float32)  # z_dim 3, model has 4
    if method == "Decode":
        with pytest.raises(grpc.RpcError) as rpc_info:
            harness.decode_rpc(metrics_server.target, bad)
        assert rpc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "z_dim" in rpc_info.value.details()
    else:
        with VaeClient(metrics_server.target, timeout=30) as client:
            with pytest.raises(InvalidArgumentError) as info:
                client.decode(bad)
        assert "INVALID_ARGUMENT" in str(info.value) and "z_dim" in str(info.value)
    assert scrape(port)[key] - before == 1


# ------------------------------------------------------------ auth


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.RunningServer]:
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")  # trailing newline as `echo` writes it
    cfg = make_config(auth_token_file=str(token_file))
    with harness.serve_in_thread(cfg) as running:
        yield running


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
def test_auth_rejects(auth_server: harness.RunningServer, token: str | None) -> None:
    with VaeClient(auth_server.target, timeout=30, token=token) as client:
        with pytest.raises(UnauthenticatedError):
            client.model_info()
        with pytest.raises(UnauthenticatedError):
            client.decode(latents(1))
        with pytest.raises(UnauthenticatedError):
            list(client.stream(latents(1)))


def test_auth_rejects_session(auth_server: harness.RunningServer) -> None:
    with VaeClient(auth_server.target, timeout=30, token="wrong-token") as client:
        with pytest.raises(UnauthenticatedError):
            client.session()  # a session learns the served model first, as decode() does


def test_auth_accepts_right_token(auth_server: harness.RunningServer) -> None:
    with VaeClient(auth_server.target, timeout=60, token=TOKEN) as client:
        assert client.model_info().z_dim == 4
        video = client.decode(latents(2))
        assert video.shape[1] == 5
        session = client.session()
        session.push(latents(1))
        session.push(latents(1, seed=3))
        assert session.collect().shape[1] == 5


def test_health_open_without_token(auth_server: harness.RunningServer) -> None:
    assert _health(auth_server.target) == (0, "SERVING")
    assert _health(auth_server.target, service="vaed.v1.VaeDecoder") == (0, "SERVING")


# ------------------------------------------------------------ TLS


def test_tls_round_trip(tmp_path: Path) -> None:
    cert, key = write_self_signed(tmp_path, host="localhost")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    cfg = make_config(tls_cert=str(cert), tls_key=str(key),
                               auth_token_file=str(token_file))
    with harness.serve_in_thread(cfg) as running:
        target = f"localhost:{running.server.port}"
        with VaeClient(target, timeout=60, tls=str(cert), token=TOKEN) as client:
            assert client.model_info().z_dim == 4
            assert client.decode(latents(2)).shape[1] == 5
        with VaeClient(target, timeout=30, tls=str(cert)) as client:
            with pytest.raises(UnauthenticatedError):
                client.model_info()
        # A plaintext client gets nothing from the TLS port.
        with VaeClient(target, timeout=5, token=TOKEN) as client:
            with pytest.raises(UnavailableError) as info:
                client.model_info()
            assert "UNAVAILABLE" in str(info.value)
        assert _health(target, tls=True, ca_cert=str(cert)) == (0, "SERVING")


def test_reflection_needs_token(auth_server: harness.RunningServer) -> None:
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def list_services(metadata: tuple[tuple[str, str], ...] | None) -> list[str]:
        with grpc.insecure_channel(auth_server.target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(stub.ServerReflectionInfo(iter([req]), metadata=metadata, timeout=10))
            return [s.name for s in reply.list_services_response.service]

    with pytest.raises(grpc.RpcError) as info:
        list_services(None)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "vaed.v1.VaeDecoder" in list_services((("authorization", f"Bearer {TOKEN}"),))


def test_log_line_splits_the_first_frame(caplog: pytest.LogCaptureFixture) -> None:
    """Each call's log line gives first_frame_ms and its two known parts: the wait until the device
    starts latent frame 0, and that step (decode + copy to host); they add up to no more than it.
    The step's launch time (until its host copy was enqueued) is part of the step."""
    import logging
    import re

    caplog.set_level(logging.INFO, logger="vaed.service")
    with harness.serve_in_thread(make_config()) as running, VaeClient(running.target) as client:
        list(client.stream(latents(3)))
        assert harness.decode_rpc(running.target, latents(2)) == 5
    lines = [r.getMessage() for r in caplog.records if "status=OK" in r.getMessage() and "Decode" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("DecodeStream") and lines[1].startswith("Decode ")
    for line in lines:
        found = dict(re.findall(r"(first_frame_ms|first_wait_ms|first_step_ms|first_launch_ms)=([\d.]+)", line))
        assert set(found) == {"first_frame_ms", "first_wait_ms", "first_step_ms", "first_launch_ms"}, line
        wait, step, launch, first = (
            float(found[k]) for k in ("first_wait_ms", "first_step_ms", "first_launch_ms", "first_frame_ms"))
        assert wait >= 0 and step > 0 and wait + step <= first + 0.1  # rounding of the printed values
        assert 0 < launch <= step + 0.1  # the launches are part of the step
        assert "first_gpu_ms=- " in line  # the GPU's own clock: CUDA only


def test_only_frame_zero_records_a_timing_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """first_gpu_ms needs frame 0's step timed on the GPU clock; no other step pays for an event."""
    from vaed.worker import DeviceWorker

    timed: list[int] = []
    real = DeviceWorker._timing_event

    def recording(self: DeviceWorker) -> object:
        timed.append(1)
        return real(self)

    monkeypatch.setattr(DeviceWorker, "_timing_event", recording)
    with harness.serve_in_thread(make_config()) as running, VaeClient(running.target) as client:
        timed.clear()  # the server's own warm-up
        list(client.stream(latents(4)))
        client.decode(latents(3))
    assert len(timed) == 2  # one per call


def test_frame_one_waits_until_frame_zero_is_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker steps a session's latent frame 1 only after frame 0 went to the event loop:
    frame 1's kernel launches would hold the GIL while frame 0 is on its way out."""
    import threading
    import time

    from vaed.session import FrameChannel

    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    real_put = FrameChannel.put_group

    def slow_first_put(self: FrameChannel, group: object) -> None:
        if group.chunk_index == 0:  # type: ignore[attr-defined]
            time.sleep(0.3)  # a slow hand-off: without the hold, frame 1 decodes meanwhile
        with lock:
            events.append(("handed over", group.chunk_index))  # type: ignore[attr-defined]
        real_put(self, group)  # type: ignore[arg-type]

    monkeypatch.setattr(FrameChannel, "put_group", slow_first_put)
    with harness.serve_in_thread(make_config()) as running, VaeClient(running.target) as client:
        engine = running.server.pool.engine
        real_decode = engine.decode_frame

        def recording_decode(state: object, frame: object, output: object) -> object:
            with lock:
                events.append(("decode", state.next_latent_frame))  # type: ignore[attr-defined]
            return real_decode(state, frame, output)

        monkeypatch.setattr(engine, "decode_frame", recording_decode)
        client.decode(latents(3))
    assert events.index(("handed over", 0)) < events.index(("decode", 1)), events


def test_a_call_refused_before_its_input_is_counted_but_not_timed() -> None:
    """Sessions full: the refusal answers at once, before the call reads its input. It is counted
    in vaed_requests_total as before, and kept out of the duration histogram, as the RPC cap's and
    the token's refusals are (instant answers dragged the latency quantiles toward zero)."""
    import threading

    config = make_config(metrics_port=0, max_sessions=1, warmup=False)
    reached, release = threading.Event(), threading.Event()

    def held() -> None:
        reached.set()
        release.wait(120)

    with harness.serve_in_thread(config, build_engine=harness.engine_calling_at(config, 1, held)) as running:
        port = running.server.metrics_port
        assert port
        outcome: list[Any] = []
        holder = threading.Thread(target=lambda: outcome.append(harness.decode_rpc(running.target, latents(3))))
        holder.start()
        try:
            assert reached.wait(60)
            with VaeClient(running.target, resume=False, timeout=60) as client:
                for _ in range(3):
                    with pytest.raises(ResourceExhaustedError):
                        client.decode(latents(2))
            refused = scrape(port)
        finally:
            release.set()
            holder.join(60)
        after = scrape(port)
    assert outcome == [1 + 4 * 2]
    assert refused[("vaed_requests_total", (("code", "RESOURCE_EXHAUSTED"), ("method", "DecodeStream")))] == 3
    assert refused.get(("vaed_request_duration_seconds_count", (("method", "DecodeStream"),)), 0) == 0
    assert after[("vaed_request_duration_seconds_count", (("method", "Decode"),))] == 1  # the held call, timed
