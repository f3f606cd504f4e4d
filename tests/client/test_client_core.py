"""The shared request/session core through both front-ends: output types
(diffusers' np / pt / pil, exact over RAW, light over RGB8), option checks
that stay local, the input rule, AsyncVaeClient outside a loop, TLS server
name override and keepalive."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from diffusers.video_processor import VideoProcessor

from harness import FakeDecoder, expected_video, fake_raw, latents_np, self_signed_pem, start_fake_server
import vaed_client
from vaed_client import channel as vchannel
from vaed_client import errors
from vaed_client import outputs
from vaed_client.encoding import prepare_video
from vaed_client.video import assemble




def diffusers_postprocess(raw: torch.Tensor, output_type: str) -> Any:
    """What a Wan pipeline returns for decoder output `raw` [B, 3, T, H, W]."""
    return VideoProcessor(vae_scale_factor=8).postprocess_video(raw, output_type=output_type)


def assert_equal_output(got: Any, want: Any, output_type: str) -> None:
    if output_type == "np":
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype == np.float32 and np.array_equal(got, want)
    elif output_type == "pt":
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    else:
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


# -- output types ----------------------------------------------------------------
@pytest.mark.parametrize("output_type", ["np", "pt", "pil"])
@pytest.mark.parametrize("raw_dtype", [None, "bfloat16", "float16"])
def test_pipeline_outputs_equal_diffusers_postprocess(fake: tuple[FakeDecoder, str], output_type: str,
                                                      raw_dtype: str | None) -> None:
    servicer, target = fake
    raw = torch.from_numpy(fake_raw(expected_video(2, 3, 2, 2)))
    if raw_dtype:
        raw = raw.to(getattr(torch, raw_dtype))  # a half-precision server: diffusers' arithmetic runs in that dtype
    want = diffusers_postprocess(raw, output_type)
    with vaed_client.VaeClient(target) as client:
        got = client.decode(latents_np(b=2, t=3, h=2, w=2), output_type=output_type, raw_dtype=raw_dtype)
        assert servicer.call_options[-1].format == vaed_client.wire.pb.RAW  # exact path: RAW on the wire
        assert_equal_output(got, want, output_type)
        # Torch latents give the same (np stays numpy, pil stays PIL).
        assert_equal_output(client.decode(torch.from_numpy(latents_np(b=2, t=3, h=2, w=2)), output_type=output_type,
                                          raw_dtype=raw_dtype), want, output_type)


@pytest.mark.parametrize("output_type", ["np", "pil"])
def test_numpy_path_without_torch_is_exact_for_float32(output_type: str) -> None:
    # Clients without torch postprocess fp32 RAW with numpy: the same two roundings as torch.
    raw = np.random.default_rng(1).uniform(-1, 1, (2, 3, 5, 8, 8)).astype(np.float32)
    raw[0, 0, 0, 0, :4] = [-1.0, 1.0, 0.0, 0.49999997]  # ends of the range and a rounding edge
    assert_equal_output(outputs.from_raw(raw, output_type), diffusers_postprocess(torch.from_numpy(raw), output_type),
                        output_type)


def test_light_option_sends_rgb8(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    video = expected_video(1, 3, 2, 2)
    with vaed_client.VaeClient(target) as client:
        np_out = client.decode(latents_np(t=3, h=2, w=2), output_type="np", format="rgb8")
        assert servicer.call_options[-1].format == vaed_client.wire.pb.RGB8
        assert np_out.dtype == np.float32 and np.array_equal(np_out, video.astype(np.float32) / 255)
        pt_out = client.decode(latents_np(t=3, h=2, w=2), output_type="pt", format="rgb8")
        assert pt_out.shape == (1, 9, 3, 16, 16) and torch.equal(pt_out.permute(0, 1, 3, 4, 2), torch.from_numpy(np_out))
        pil = client.decode(latents_np(t=3, h=2, w=2), output_type="pil", format="rgb8")
        assert len(pil) == 1 and len(pil[0]) == 9 and np.array_equal(np.asarray(pil[0][4]), video[0, 4])


def test_uint8_and_raw_output_types_are_the_wire_formats(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    with vaed_client.VaeClient(target) as client:
        latents = latents_np(t=2, h=2, w=2)
        assert np.array_equal(client.decode(latents, output_type="uint8"), client.decode(latents))
        assert np.array_equal(client.decode(latents, output_type="raw"), client.decode(latents, format="raw"))


def test_stream_and_session_convert_each_chunk(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    latents = latents_np(t=3, h=2, w=2)
    with vaed_client.VaeClient(target) as client:
        whole = client.decode(latents, output_type="np")
        chunks = list(client.stream(latents, output_type="np"))
        assert all(c.frames.dtype == np.float32 and c.format == "np" for c in chunks)
        assert [c.num_frames for c in chunks] == [1, 3, 1, 3, 1] and chunks[-1].end_frame == 9
        assert np.array_equal(np.concatenate([c.frames for c in chunks], axis=1), whole)
        assert np.array_equal(assemble(reversed(chunks)), whole)
        pt_chunks = list(client.stream(latents, output_type="pt"))
        assert torch.equal(assemble(pt_chunks), client.decode(latents, output_type="pt"))
        pil_chunks = list(client.stream(latents, output_type="pil"))
        assert [c.num_frames for c in pil_chunks] == [1, 3, 1, 3, 1]
        pil = assemble(pil_chunks)
        assert_equal_output(pil, client.decode(latents, output_type="pil"), "pil")
        with client.session(output_type="pt") as session:
            session.push(latents[:, :, :1])
            session.push(latents[:, :, 1:])
            pt = session.collect()
        assert torch.equal(pt, diffusers_postprocess(torch.from_numpy(fake_raw(expected_video(1, 3, 2, 2))), "pt"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(output_type="gif"), "output_type"),
        (dict(output_type="uint8", format="raw"), "cannot travel"),
        (dict(output_type="raw", format="rgb8"), "cannot travel"),
        (dict(output_type="uint8", raw_dtype="float16"), "raw_dtype"),
        (dict(request_id="x" * 129), "128"),
        (dict(request_id="x status=OK"), "without spaces"),  # the server's log line separates fields by spaces
        (dict(request_id=5), "request_id must be a str, got int"),  # was a TypeError from len()
    ],
)
def test_bad_options_are_local_errors(fake: tuple[FakeDecoder, str], kwargs: dict[str, Any], message: str) -> None:
    servicer, target = fake
    with vaed_client.VaeClient(target) as client:
        client.model_info()
        calls = servicer.attempts
        for call in (lambda: client.decode(latents_np(), **kwargs), lambda: client.session(**kwargs),
                     lambda: list(client.stream(latents_np(), **kwargs))):
            with pytest.raises(errors.LocalInputError, match=message) as info:
                call()
            assert info.value.code is None and not str(info.value).startswith("INVALID_ARGUMENT")
        assert servicer.attempts == calls  # nothing reached the server


# -- the input rule ------------------------------------------------------------------
def test_float64_and_4d_latents(fake: tuple[FakeDecoder, str]) -> None:
    servicer, target = fake
    latents = np.random.default_rng(0).standard_normal((16, 2, 3, 3))  # float64, no batch axis
    with vaed_client.VaeClient(target) as client:
        video = client.decode(latents)
        sent = servicer.requests[-1].latents
        assert list(sent.shape) == [1, 16, 2, 3, 3] and sent.dtype == vaed_client.wire.pb.FLOAT32
        assert sent.data == latents.astype(np.float32).tobytes()
        assert np.array_equal(video, expected_video(1, 2, 3, 3))
        t = client.decode(torch.from_numpy(latents))  # torch float64 too
        assert isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), video)
        for bad in (np.zeros((16, 2, 3), np.float32), np.zeros((1, 1, 16, 2, 3, 3), np.float32)):
            with pytest.raises(errors.LocalInputError, match=r"\[B, z_dim, T, h, w\] or \[z_dim, T, h, w\]"):
                client.decode(bad)
        with pytest.raises(errors.LocalInputError, match="int64"):
            client.decode(np.zeros((1, 16, 1, 1, 1), np.int64))


def test_big_endian_latents_and_frames_are_their_numbers(fake: tuple[FakeDecoder, str]) -> None:
    """A big-endian array holds the same float32/float64 numbers: accepted as its native twin
    (the dtype check once read '>f4' and refused it), and sent as the same bytes."""
    servicer, target = fake
    latents = np.random.default_rng(1).standard_normal((1, 16, 2, 3, 3)).astype(np.float32)
    with vaed_client.VaeClient(target) as client:
        want = client.decode(latents)
        native = servicer.requests[-1].latents.data
        for swapped in (latents.astype(">f4"), latents.astype(">f8")):
            assert np.array_equal(client.decode(swapped), want)
            assert servicer.requests[-1].latents.data == native
    frames = np.random.default_rng(2).uniform(-1, 1, (1, 3, 5, 8, 8)).astype(np.float32)
    for swapped in (frames.astype(">f4"), frames.astype(">f8")):
        video = prepare_video(swapped)
        assert video.frames.dtype == np.float32 and np.array_equal(video.frames, frames)
    # torch float64 frames are cast as decode's latents are (they were refused by name)
    video = prepare_video(torch.from_numpy(frames).double())
    assert video.frames.dtype == torch.float32 and torch.equal(video.frames, torch.from_numpy(frames))


def test_an_empty_video_is_a_local_error_in_the_callers_shape(fake: tuple[FakeDecoder, str]) -> None:
    """Frames with no batch, height or width are refused before any call, naming the shape the
    caller sent (an empty float32 video was repacked as uint8 [B, T, H, W, 3] and the server named
    that); T = 0 was refused locally already."""
    servicer, target = fake
    with vaed_client.VaeClient(target) as client:
        for shape in ((0, 3, 1, 64, 64), (1, 3, 1, 0, 64), (1, 3, 1, 64, 0), (1, 3, 0, 64, 64)):
            for frames in (torch.zeros(shape), torch.zeros(shape).numpy(), torch.zeros(shape, dtype=torch.bfloat16)):
                with pytest.raises(errors.LocalInputError, match=re.escape(f"frames shape {list(shape)}")):
                    client.encode(frames)
    assert servicer.attempts == 0


def test_tensors_without_dense_data_are_local_errors(fake: tuple[FakeDecoder, str]) -> None:
    """A sparse or meta tensor is refused by name before any call, for decode, stream and encode
    (a sparse one used to fail on the client's own slicing: "Cannot access storage of
    SparseTensorImpl")."""
    servicer, target = fake
    dense = torch.from_numpy(latents_np())
    frames = torch.zeros(1, 3, 5, 4, 4)
    with vaed_client.VaeClient(target) as client:
        client.model_info()
        calls = servicer.attempts
        for make, why in ((lambda t: t.to_sparse(), "sparse_coo tensor cannot travel"),
                          (lambda t: torch.empty_like(t, device="meta"), "a meta tensor has no data")):
            for call in (lambda: client.decode(make(dense)), lambda: list(client.stream(make(dense))),
                         lambda: client.encode(make(frames))):
                with pytest.raises(errors.LocalInputError, match=why):
                    call()
        assert servicer.attempts == calls


def test_latents_travel_in_a_bf16_servers_dtype(fake: tuple[FakeDecoder, str]) -> None:
    """For a server computing in bfloat16, a whole-video call's float32 latents go as bf16 (the
    server's own first step is that cast): every message, the head and the rest, holds torch's
    rounding of the caller's values, from numpy and torch latents, through both clients.
    Other dtypes, float32 servers and pushed session chunks go as given."""
    servicer, target = fake
    servicer.compute_dtype = vaed_client.wire.pb.BFLOAT16
    z = latents_np(t=5, h=2, w=3)
    want = torch.from_numpy(z).to(torch.bfloat16)

    def sent_since(start: int) -> list[Any]:
        return [m.latents for m in servicer.requests[start:]]

    def assert_sent_as_bf16(start: int) -> None:
        sent = sent_since(start)
        assert [int(m.shape[2]) for m in sent] == [2, 3]  # the head, then the rest
        assert all(m.dtype == vaed_client.wire.pb.BFLOAT16 for m in sent)
        got = torch.cat([vaed_client.wire.to_torch(m) for m in sent], dim=2)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))

    async def async_calls() -> None:
        async with vaed_client.AsyncVaeClient(target) as client:
            start = len(servicer.requests)
            assert np.array_equal(await client.decode(z), expected_video(1, 5, 2, 3))
            assert_sent_as_bf16(start)
            start = len(servicer.requests)
            assert len([c async for c in client.stream(torch.from_numpy(z))]) > 0
            assert_sent_as_bf16(start)

    with vaed_client.VaeClient(target) as client:
        for latents in (z, torch.from_numpy(z)):
            start = len(servicer.requests)
            video = client.decode(latents)
            assert np.array_equal(np.asarray(video), expected_video(1, 5, 2, 3))
            assert_sent_as_bf16(start)
            start = len(servicer.requests)
            assert sum(c.num_frames for c in client.stream(latents)) == expected_video(1, 5, 2, 3).shape[1]
            assert_sent_as_bf16(start)
        start = len(servicer.requests)
        client.decode(z.astype(np.float16))
        assert {m.dtype for m in sent_since(start)} == {vaed_client.wire.pb.FLOAT16}
        start = len(servicer.requests)
        with client.session() as session:
            session.push(z)
            session.collect()
        assert {m.dtype for m in sent_since(start)} == {vaed_client.wire.pb.FLOAT32}
    asyncio.run(async_calls())


# -- asyncio -----------------------------------------------------------------------
def test_async_client_built_outside_a_loop(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    client = vaed_client.AsyncVaeClient(target)  # no running loop here

    async def use() -> Any:
        return await client.decode(latents_np(t=2, h=2, w=2))

    assert np.array_equal(asyncio.run(use()), expected_video(1, 2, 2, 2))
    with pytest.raises(RuntimeError, match="one AsyncVaeClient per event loop"):
        asyncio.run(use())  # the channel belongs to the first loop

    shared = vaed_client.AsyncVaeClient(target)

    async def use_and_close() -> Any:
        async with shared:
            return await shared.model_info()

    assert asyncio.run(use_and_close()).z_dim == 16
    assert asyncio.run(use_and_close()).z_dim == 16  # closed clients start over in the next loop


def test_async_output_types(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    want = diffusers_postprocess(torch.from_numpy(fake_raw(expected_video(1, 3, 2, 2))), "np")

    async def main() -> None:
        async with vaed_client.AsyncVaeClient(target) as client:
            assert_equal_output(await client.decode(latents_np(t=3, h=2, w=2), output_type="np"), want, "np")
            chunks = [c async for c in client.stream(latents_np(t=3, h=2, w=2), output_type="np")]
            assert np.array_equal(np.concatenate([c.frames for c in chunks], axis=1), want)
            with pytest.raises(errors.LocalInputError):
                await client.decode(latents_np(), output_type="gif")

    asyncio.run(main())


# -- channel ----------------------------------------------------------------------
def test_keepalive_options() -> None:
    opts = dict(vchannel.channel_options())
    assert opts["grpc.keepalive_time_ms"] == 60_000 and opts["grpc.keepalive_timeout_ms"] == 20_000
    assert opts["grpc.keepalive_permit_without_calls"] == 0 and opts["grpc.http2.max_pings_without_data"] == 0
    assert "grpc.ssl_target_name_override" not in opts
    assert dict(vchannel.channel_options(tls_server_name="a.b"))["grpc.ssl_target_name_override"] == "a.b"
    # gRPC core's own ping-ack deadline follows the keepalive timeout, also an overridden one
    assert opts["grpc.http2.ping_timeout_ms"] == 20_000
    fast = dict(vchannel.channel_options([("grpc.keepalive_timeout_ms", 1000)]))
    assert fast["grpc.http2.ping_timeout_ms"] == 1000
    assert dict(vchannel.channel_options([("grpc.http2.ping_timeout_ms", 7)]))["grpc.http2.ping_timeout_ms"] == 7


def test_tls_server_name_override() -> None:
    cert, key = self_signed_pem("vaed.test")  # valid for vaed.test and 127.0.0.1, not for "localhost"
    servicer = FakeDecoder()
    server, port = start_fake_server(servicer, grpc.ssl_server_credentials([(key, cert)]))
    try:
        with vaed_client.VaeClient(f"localhost:{port}", tls=cert, timeout=5) as client:
            with pytest.raises(errors.UnavailableError):
                client.model_info()  # name mismatch
        with vaed_client.VaeClient(f"localhost:{port}", tls=cert, tls_server_name="vaed.test", timeout=5) as client:
            assert client.model_info().model == "fake"

        async def aio() -> str:
            async with vaed_client.AsyncVaeClient(f"localhost:{port}", tls=cert, tls_server_name="vaed.test") as c:
                return (await c.model_info()).model

        assert asyncio.run(aio()) == "fake"
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="TLS"):
        vaed_client.VaeClient("localhost:1", tls_server_name="vaed.test")
    with pytest.raises(ValueError, match="TLS"):
        vaed_client.AsyncVaeClient("localhost:1", tls_server_name="vaed.test")


def test_read_token(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t").write_text(" tok\n")
    assert vchannel.read_token(str(tmp_path / "t"), "VAED_AUTH_TOKEN") == "tok"
    monkeypatch.setenv("VAED_AUTH_TOKEN", " env ")
    assert vchannel.read_token(None, "VAED_AUTH_TOKEN") == "env"
    monkeypatch.setenv("VAED_AUTH_TOKEN", " ")
    with pytest.raises(ValueError, match="set but empty"):
        vchannel.read_token(None, "VAED_AUTH_TOKEN")
    (tmp_path / "e").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        vchannel.read_token(str(tmp_path / "e"))
    monkeypatch.delenv("VAED_AUTH_TOKEN")
    assert vchannel.read_token(None, "VAED_AUTH_TOKEN") is None


# -- the drop-in VAE without diffusers ---------------------------------------------
def test_remote_vae_works_without_diffusers(fake: tuple[FakeDecoder, str]) -> None:
    import subprocess
    import sys

    _, target = fake
    code = (
        "import sys; sys.modules['diffusers'] = None\n"  # `import diffusers` fails
        "import torch, vaed_client\n"
        f"vae = vaed_client.RemoteAutoencoderKLWan({target!r})\n"
        "assert vae.config.z_dim == 16 and vae.config['scale_factor_spatial'] == 8 and vae.dtype == torch.float32\n"
        "out = vae.decode(torch.zeros(1, 16, 2, 2, 2))\n"
        "assert tuple(out.sample.shape) == (1, 3, 5, 16, 16) and out[0] is out.sample\n"
        "assert vae.decode(torch.zeros(1, 16, 1, 2, 2), return_dict=False)[0].shape[2] == 1\n"
        "print(type(vae.config).__name__, type(out).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["_AttrDict", "_DecoderOutput"]


# -- closed clients ----------------------------------------------------------------
def test_a_closed_client_raises_vaeds_error_not_grpcs(fake: tuple[FakeDecoder, str]) -> None:
    """The README's snippets once used `vae` after its `with` block: grpc then said only
    "Cannot invoke RPC on closed channel!"."""
    servicer, target = fake
    with vaed_client.VaeClient(target) as vae:
        vae.decode(latents_np(t=1))
        assert not vae.closed
    assert vae.closed
    calls = servicer.attempts
    for call in (vae.model_info, lambda: vae.decode(latents_np()), lambda: list(vae.stream(latents_np())),
                 vae.session):
        with pytest.raises(errors.ClientClosedError, match=r"is closed: its `with` block ended") as info:
            call()
        assert isinstance(info.value, errors.VaedError) and info.value.code is None
        assert target in str(info.value) and "Cannot invoke RPC" not in str(info.value)
    assert servicer.attempts == calls


def test_a_closed_async_client_raises_in_its_loop_and_starts_over_in_a_new_one(fake: tuple[FakeDecoder, str]) -> None:
    _, target = fake
    vae = vaed_client.AsyncVaeClient(target)

    async def after_the_block() -> None:
        async with vae:
            await vae.model_info()
        assert vae.closed
        for call in (vae.model_info, lambda: vae.decode(latents_np())):
            with pytest.raises(errors.ClientClosedError, match=r"`async with` block ended"):
                await call()
        with pytest.raises(errors.ClientClosedError):
            [c async for c in vae.stream(latents_np())]
        with pytest.raises(errors.ClientClosedError):
            async with vae.session() as session:
                await session.push(latents_np())

    asyncio.run(after_the_block())

    async def in_a_new_loop() -> int:  # one asyncio.run per job, one client: a fresh channel each time
        assert not vae.closed
        async with vae:
            return (await vae.model_info()).z_dim

    assert asyncio.run(in_a_new_loop()) == 16

    never_opened = vaed_client.AsyncVaeClient(target)

    async def close_first() -> None:
        await never_opened.close()
        with pytest.raises(errors.ClientClosedError):
            await never_opened.model_info()

    asyncio.run(close_first())


# -- extras: a clear error before the call -------------------------------------------
def test_pt_without_torch_and_pil_without_pillow_are_clear_local_errors(fake: tuple[FakeDecoder, str]) -> None:
    import subprocess
    import sys

    _, target = fake
    code = (
        "import sys; sys.modules[sys.argv[1]] = None\n"
        "import numpy as np, vaed_client\n"
        "with vaed_client.VaeClient(sys.argv[2]) as vae:\n"
        "    try:\n"
        "        vae.decode(np.zeros((1, 16, 1, 1, 1), np.float32), output_type=sys.argv[3])\n"
        "    except vaed_client.LocalInputError as e:\n"
        "        print(type(e).__name__, e)\n"
        "    print(vae.decode(np.zeros((1, 16, 1, 1, 1), np.float32), output_type='np').shape)\n"
    )
    for blocked, output_type, extra in (("torch", "pt", "vaed-client[torch]"), ("PIL", "pil", "vaed-client[video]")):
        out = subprocess.run([sys.executable, "-c", code, blocked, target, output_type],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        first, second = out.stdout.splitlines()
        assert first.startswith("LocalInputError") and extra in first and "ModuleNotFoundError" not in out.stdout
        assert second == "(1, 1, 8, 8, 3)"  # the client stays usable; np needs neither
