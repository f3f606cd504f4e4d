"""Decoded frames through the real wire are bit-identical to diffusers."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from vaed_client import AsyncVaeClient, VaeClient
from harness import diffusers_decode, make_config, rgb8, serve_in_thread

# (B, T, h, w): T=1, 2, 5, B=2, odd h and w. Spatial sizes stay at h*w >= 35:
# below that, aten's CPU conv3d takes another kernel whose 1x1x1
# post_quant_conv results depend on T, so a chunked session could not match
# a one-shot decode bit for bit (measured: 2x3 and 3x5 differ, 5x7 and up match).
SHAPES = [(1, 1, 5, 7), (1, 2, 6, 6), (2, 5, 5, 7)]


@pytest.fixture(scope="module")
def ref21(tiny_server):
    return tiny_server.reference_vae()


@pytest.fixture(scope="module")
def ref22(tiny22_server):
    return tiny22_server.reference_vae()


def latents_for(vae, b, t, h, w, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, vae.config.z_dim, t, h, w, generator=g).to(dtype)


@pytest.mark.parametrize("b,t,h,w", SHAPES)
@pytest.mark.parametrize("raw_latents", [False, True])
@pytest.mark.parametrize("family", ["wan2.1", "wan2.2"])
def test_rgb8_and_raw_bit_identical_to_diffusers(request, family, raw_latents, b, t, h, w):
    server = request.getfixturevalue("tiny_server" if family == "wan2.1" else "tiny22_server")
    ref = request.getfixturevalue("ref21" if family == "wan2.1" else "ref22")
    z = latents_for(ref, b, t, h, w, seed=t * 10 + b)
    expected = diffusers_decode(ref, z, raw_latents=raw_latents)
    with VaeClient(server.target) as client:
        raw = client.decode(z, format="raw", raw_latents=raw_latents)
        frames = client.decode(z, raw_latents=raw_latents)
    assert raw.dtype == expected.dtype and raw.shape == expected.shape
    assert torch.equal(raw, expected)
    assert frames.dtype == torch.uint8
    assert torch.equal(frames, rgb8(expected))


def test_numpy_in_numpy_out(tiny_server, ref21):
    z = latents_for(ref21, 1, 2, 3, 4, seed=7)
    expected = rgb8(diffusers_decode(ref21, z, raw_latents=False)).numpy()
    with VaeClient(tiny_server.target) as client:
        frames = client.decode(z.numpy())
    assert isinstance(frames, np.ndarray)
    assert np.array_equal(frames, expected)


def test_stream_session_with_uneven_chunks_equals_one_shot(tiny_server, ref21):
    z = latents_for(ref21, 2, 5, 5, 7, seed=3)
    with VaeClient(tiny_server.target) as client:
        one_shot = client.decode(z, format="raw")
        for splits in ([1, 3, 1], [2, 2, 1], [1, 1, 1, 1, 1], [5]):
            with client.session(format="raw") as session:
                start = 0
                for n in splits:
                    session.push(z[:, :, start : start + n])
                    start += n
                streamed = session.collect()
            assert torch.equal(streamed, one_shot), splits
    assert torch.equal(one_shot, diffusers_decode(ref21, z, raw_latents=False))


def test_wan22_stream_session_equals_one_shot(tiny22_server):
    ref = tiny22_server.reference_vae()
    z = latents_for(ref, 1, 5, 5, 7, seed=5)
    with VaeClient(tiny22_server.target) as client:
        one_shot = client.decode(z)
        with client.session() as session:
            for a, b in [(0, 1), (1, 4), (4, 5)]:
                session.push(z[:, :, a:b])
            streamed = session.collect()
    assert torch.equal(streamed, one_shot)
    assert torch.equal(one_shot, rgb8(diffusers_decode(ref, z, raw_latents=False)))


def test_bf16_latents_travel_as_bf16(tiny_server, ref21):
    # h*w >= 12: below that, the CPU 1x1x1 post_quant_conv takes another vector path for one
    # frame than for T frames (see vaed.engine); sessions equal one-shot at every size regardless.
    z = latents_for(ref21, 1, 2, 4, 4, seed=11, dtype=torch.bfloat16)
    with VaeClient(tiny_server.target) as client:
        raw = client.decode(z, format="raw", raw_dtype="bfloat16")
    assert raw.dtype == torch.bfloat16
    expected = diffusers_decode(ref21, z, raw_latents=False).to(torch.bfloat16)
    assert torch.equal(raw, expected)


def test_float32_latents_to_a_bf16_server_keep_stocks_bits():
    """A bf16 server: the client sends float32 latents as bf16 (what the server's own cast
    makes of them) and the frames stay stock's (WanPipeline casts its float32 latents to the
    VAE's dtype first), equal to a session whose pushed float32 chunks the server casts."""
    with serve_in_thread(make_config("random:wan2.1-tiny", dtype="bfloat16")) as running:
        ref = running.reference_vae()
        z = latents_for(ref, 1, 5, 5, 7, seed=12)
        with VaeClient(running.target) as client:
            raw = client.decode(z, format="raw")
            frames = client.decode(z)
            with client.session(format="raw") as session:
                session.push(z)
                pushed = session.collect()
    stock = diffusers_decode(ref, z, raw_latents=False)
    assert raw.dtype == torch.bfloat16 and torch.equal(raw, stock)
    assert torch.equal(frames, rgb8(stock))
    assert torch.equal(pushed, raw)


def test_frames_arrive_before_the_decode_finishes(tiny_server, ref21, monkeypatch):
    """The first chunk reaches the client before the server's last decoder call ends."""
    engine = tiny_server.server.pool.engine
    step_ends: list[float] = []
    original = engine.decode_frame

    def timed_step(*args):
        group = original(*args)
        step_ends.append(time.perf_counter())
        return group

    monkeypatch.setattr(engine, "decode_frame", timed_step)
    z = latents_for(ref21, 1, 12, 8, 8, seed=2)
    arrivals = []
    with VaeClient(tiny_server.target) as client:
        for chunk in client.stream(z):
            arrivals.append((time.perf_counter(), chunk.chunk_index))
    assert len(step_ends) == 12 and [c for _, c in arrivals] == list(range(12))
    assert arrivals[0][0] < step_ends[-1], "first frames only arrived after the whole decode"


def test_eight_concurrent_clients_with_different_shapes(tiny_server, ref21):
    shapes = [(1, 1, 3, 3), (1, 2, 4, 5), (2, 3, 3, 4), (1, 4, 5, 3), (2, 2, 2, 2), (1, 5, 4, 4), (1, 3, 6, 4), (2, 1, 5, 5)]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with VaeClient(tiny_server.target) as client:
                results[i] = client.decode(latents_for(ref21, *shapes[i], seed=100 + i), format="raw")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i, shape in enumerate(shapes):
        expected = diffusers_decode(ref21, latents_for(ref21, *shape, seed=100 + i), raw_latents=False)
        assert torch.equal(results[i], expected), shape
    assert tiny_server.active_sessions == 0


def test_message_over_4_mib_round_trips(tiny_server, ref21):
    # Input 4.2 MiB of float32 latents; each output group of 4 RAW fp32
    # frames at 256x320 is 3.9 MB, 2 of them per message over 4 MiB.
    z = latents_for(ref21, 2, 2, 32, 40, seed=9)
    assert z.numel() * 4 < 4 * 2**20  # the input is small; the output is what is large
    with VaeClient(tiny_server.target) as client:
        raw = client.decode(z, format="raw")
    group_bytes = raw[:, :, 1:].numel() * 4
    assert group_bytes > 4 * 2**20
    assert torch.equal(raw, diffusers_decode(ref21, z, raw_latents=False))


def test_async_client_decode_stream_and_session(tiny_server, ref21):
    import asyncio

    z = latents_for(ref21, 1, 3, 3, 4, seed=21)
    expected = rgb8(diffusers_decode(ref21, z, raw_latents=False))

    async def main():
        async with AsyncVaeClient(tiny_server.target) as client:
            info = await client.model_info()
            whole = await client.decode(z)
            chunks = [c async for c in client.stream(z)]
            session = client.session()
            for i in range(3):
                await session.push(z[:, :, i : i + 1])
            streamed = await session.collect()
            return info, whole, chunks, streamed

    info, whole, chunks, streamed = asyncio.run(main())
    assert info.z_dim == ref21.config.z_dim
    assert torch.equal(whole, expected) and torch.equal(streamed, expected)
    assert [c.first_frame for c in chunks] == [0, 1, 5]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_closing_the_client_ends_its_open_session_without_resuming(tiny_server, ref21, caplog, asynchronous):
    """Closing a client is the application's own doing: a session still open on it ends with
    ClientClosedError, and is not resumed (grpc's CANCELLED "Channel closed!" was taken for a
    failure of its server: a warning, a resume and its back-off)."""
    import asyncio
    import logging

    from vaed_client.errors import ClientClosedError

    z = latents_for(ref21, 1, 2, 3, 4, seed=22)

    def sync() -> None:
        client = VaeClient(tiny_server.target)
        session = client.session()
        session.push(z[:, :, :1])
        chunks = iter(session)
        assert next(chunks).first_frame == 0
        client.close()
        with pytest.raises(ClientClosedError, match="the client was closed during the call"):
            next(chunks)

    async def main() -> None:
        client = AsyncVaeClient(tiny_server.target)
        session = client.session()
        await session.push(z[:, :, :1])
        chunks = aiter(session)
        assert (await anext(chunks)).first_frame == 0
        await client.close()
        with pytest.raises(ClientClosedError, match="the client was closed during the call"):
            await anext(chunks)

    with caplog.at_level(logging.INFO, logger="vaed_client"):
        asyncio.run(main()) if asynchronous else sync()
    assert "resum" not in caplog.text, caplog.text


def test_a_decode_ends_with_its_last_step_not_a_step_of_its_own(tiny_server, ref21, monkeypatch):
    """A Decode RPC's input (its one message) has ended before its steps run, so the worker
    delivers its end with the last latent frame's group: no step of the session takes no frame
    (such a step waited its turn behind every other session's step, and the call's status with
    it). `VaeClient.decode` sends a DecodeStream, whose input may end after its last step."""
    from harness import decode_rpc

    from vaed import session as session_module

    taken: list[bool] = []
    take_frame = session_module.Session.take_frame

    def recorded(self):
        frame = take_frame(self)
        taken.append(frame is not None)
        return frame

    monkeypatch.setattr(session_module.Session, "take_frame", recorded)
    assert decode_rpc(tiny_server.target, latents_for(ref21, 1, 3, 5, 7, seed=23)) == 9
    assert taken == [True, True, True]


def test_random_wan21_at_a_small_size():
    """The real Wan2.1 architecture (random weights) at 16x24 output pixels."""
    from harness import make_config, serve_in_thread

    with serve_in_thread(make_config("random:wan2.1", warmup=False)) as server:
        ref = server.reference_vae()
        z = latents_for(ref, 1, 2, 2, 3, seed=1)
        with VaeClient(server.target) as client:
            frames = client.decode(z)
            info = client.model_info()
    assert info.z_dim == 16 and info.random_weights and info.scale_factor_spatial == 8
    assert frames.shape == (1, 5, 16, 24, 3)
    assert torch.equal(frames, rgb8(diffusers_decode(ref, z, raw_latents=False)))


def test_empty_session_ends_with_one_final_message(tiny_server):
    import grpc

    from vaed_client._proto import vaed_pb2_grpc

    with grpc.insecure_channel(tiny_server.target) as channel:
        replies = list(vaed_pb2_grpc.VaeDecoderStub(channel).DecodeStream(iter([]), timeout=30))
    assert len(replies) == 1 and replies[0].final and not replies[0].HasField("frames")
    assert tiny_server.active_sessions == 0
