"""The Encode RPC through a real server and the real clients (CPU, tiny models): moments
bit-identical to stock AutoencoderKLWan.encode, frames streamed in chunks that split encoder calls
anywhere, uint8 frames as diffusers' VideoProcessor makes them, the image-to-video pattern sent as
one frame plus a count of zeros (bytes measured), the normalised latents, the async client,
RemoteAutoencoderKLWan.encode, ModelInfo, and the bad-input matrix (INVALID_ARGUMENT, the server
keeps serving)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from harness import make_config, serve_in_thread

from vaed.models import build_random_vae
from vaed_client import AsyncVaeClient, RemoteAutoencoderKLWan, VaeClient, wire
from vaed_client._proto import vaed_pb2, vaed_pb2_grpc
from vaed_client.encoding import encode_options, prepare_video, video_chunks
from vaed_client.errors import InvalidArgumentError

ARCHS = ["wan2.1-tiny", "wan2.2-tiny"]


@pytest.fixture(scope="module", params=ARCHS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    config = make_config(f"random:{request.param}", encode=True, max_latent_frames=8, max_pixels=64 * 96, max_batch=2)
    with serve_in_thread(config) as running:
        stock = build_random_vae(request.param).eval().requires_grad_(False)
        yield running, stock


@pytest.fixture()
def stub(served: tuple[Any, Any]) -> Iterator[Any]:
    channel = grpc.insecure_channel(served[0].target)
    yield vaed_pb2_grpc.VaeDecoderStub(channel)
    channel.close()


# 64x96: every latent frame takes the CPU's conv kernel of the whole video in quant_conv (a 2x3
# latent does not: vaed.engine's docstring)
def _video(b: int, t: int, h: int = 64, w: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, 3, t, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def _stock(stock: Any, x: torch.Tensor) -> torch.Tensor:
    return stock.encode(x).latent_dist.parameters


def _chunk(frames: torch.Tensor, options: Any = None) -> Any:
    chunk = vaed_pb2.VideoChunk(frames=wire.to_message(frames))
    if options is not None:
        chunk.options.CopyFrom(options)
    return chunk


def _status(stub: Any, chunks: list[Any]) -> tuple[grpc.StatusCode, str, list[Any]]:
    replies: list[Any] = []
    try:
        for r in stub.Encode(iter(chunks), timeout=60):
            replies.append(r)
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), replies
    return grpc.StatusCode.OK, "", replies


def test_served_encode_bit_identical_to_stock(served: tuple[Any, Any]) -> None:
    running, stock = served
    x = _video(2, 9)
    with VaeClient(running.target) as client:
        moments = client.encode(x)
        latents = client.encode(x, output_type="latents")
    want = _stock(stock, x)
    assert moments.dtype == want.dtype and torch.equal(moments, want)
    z = stock.config.z_dim
    mean = torch.tensor(stock.config.latents_mean).view(1, z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(stock.config.latents_std).view(1, z, 1, 1, 1)
    assert torch.equal(latents, (want[:, :z] - mean) * inv_std)


def test_chunks_that_split_encoder_calls_equal_one_shot(served: tuple[Any, Any], stub: Any) -> None:
    """VideoChunks of 3, 2, 1 and 7 frames (13 in all): latent frames come back as their calls
    fill, each equal to stock's; so does the client's own chunking at a small message cap."""
    running, stock = served
    x = _video(1, 13, seed=4)
    want = _stock(stock, x)
    pieces = [x[:, :, 0:3], x[:, :, 3:5], x[:, :, 5:6], x[:, :, 6:13]]
    code, details, replies = _status(stub, [_chunk(pieces[0], vaed_pb2.EncodeOptions(request_id="chunks"))]
                                     + [_chunk(p) for p in pieces[1:]])
    assert code == grpc.StatusCode.OK, details
    assert [r.latent_frame for r in replies] == [0, 1, 2, 3, 4] and replies[-1].final
    got = torch.cat([wire.to_torch(r.moments) for r in replies[:-1]], 2)
    assert torch.equal(got, want) and all(r.request_id == "chunks" for r in replies)
    video = prepare_video(x)
    chunks = list(video_chunks(video, encode_options(output_type="moments"), cap_bytes=2 * 3 * 64 * 96 * 4))
    assert len(chunks) == 7  # two frames a message
    code, details, replies = _status(stub, chunks)
    assert code == grpc.StatusCode.OK, details
    assert torch.equal(torch.cat([wire.to_torch(r.moments) for r in replies[:-1]], 2), want)


def test_messages_follow_the_encoder_calls() -> None:
    """Frame 0 alone, then one message per 4-frame call, split further only past the byte cap."""
    from vaed_client.encoding import call_slices

    assert call_slices(13, frame_bytes=10, cap_bytes=100) == [(0, 1), (1, 4), (5, 4), (9, 4)]
    assert call_slices(7, frame_bytes=10, cap_bytes=25) == [(0, 1), (1, 2), (3, 2), (5, 2)]
    assert call_slices(2, frame_bytes=10, cap_bytes=100) == [(0, 1), (1, 1)]  # zeros follow as a count
    video = prepare_video(_video(1, 9))
    sizes = [c.frames.shape[2] for c in video_chunks(video, encode_options(output_type="moments"))]
    assert sizes == [1, 4, 4]


def test_the_first_latent_frame_comes_back_before_the_rest_is_sent(served: tuple[Any, Any], stub: Any) -> None:
    """The encode starts on the first message: the request stream sends its second chunk only
    once latent frame 0 (of the first chunk's one frame) is back. A server that waited for the
    whole upload would never answer (the call would hit its timeout)."""
    import threading

    running, stock = served
    x = _video(1, 5, seed=11)
    first_back = threading.Event()

    def requests() -> Iterator[Any]:
        yield _chunk(x[:, :, :1], vaed_pb2.EncodeOptions(request_id="early"))
        assert first_back.wait(60), "latent frame 0 did not come back before the rest of the video was sent"
        yield _chunk(x[:, :, 1:])

    replies = []
    for reply in stub.Encode(requests(), timeout=90):
        replies.append(reply)
        first_back.set()
    assert [r.latent_frame for r in replies] == [0, 1, 2] and replies[-1].final
    assert torch.equal(torch.cat([wire.to_torch(r.moments) for r in replies[:-1]], 2), _stock(stock, x))


def test_uint8_frames_are_diffusers_video_processor_frames(served: tuple[Any, Any]) -> None:
    """uint8 [B, T, H, W, 3] -> the float32 frames VideoProcessor.preprocess_video makes of them."""
    from diffusers.video_processor import VideoProcessor

    running, stock = served
    u8 = np.random.default_rng(3).integers(0, 256, size=(1, 5, 64, 96, 3), dtype=np.uint8)
    processed = VideoProcessor(vae_scale_factor=8).preprocess_video(u8[0][None].astype(np.float32) / 255.0)
    # preprocess_video takes [0, 1] floats for numpy video; its [-1, 1] output is the stock input
    with VaeClient(running.target) as client:
        got = client.encode(u8)
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, _stock(stock, processed).numpy())


def _all_rgb8(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Every uint8 value in wire layout [1, 1, 16, 16, 3] (768 >= 256 values), and the float32
    frames [1, 3, 1, 16, 16] the server makes of them."""
    from vaed.engine_protocol import rgb8_to_video

    u = (torch.arange(16 * 16 * 3) % 256).to(torch.uint8).reshape(1, 1, 16, 16, 3)
    return u, rgb8_to_video(u.permute(0, 4, 1, 2, 3)).to(device)


def test_float_frames_that_are_uint8_frames_travel_as_uint8(served: tuple[Any, Any]) -> None:
    """float32 frames made of uint8 ones (as diffusers' VideoProcessor makes them) go up as those
    uint8 values, 4x fewer bytes: exhaustive over the 256 values (the client's check inverts the
    server's conversion bit for bit), refused for any other float (-0.0 included), and the served
    moments equal stock's encode of the float frames."""
    from diffusers.video_processor import VideoProcessor

    u, floats = _all_rgb8()
    video = prepare_video(floats)
    assert video.frames.dtype == torch.uint8 and torch.equal(video.frames, u) and video.time_dim == 1
    for bad in (0.5 / 255, -0.0):
        other = floats.clone()
        other[0, 0, 0, 0, 0] = bad
        assert prepare_video(other).frames.dtype == torch.float32
    assert prepare_video(floats.to(torch.bfloat16)).frames.dtype == torch.bfloat16  # float32 only
    running, stock = served
    pixels = np.random.default_rng(5).integers(0, 256, size=(5, 64, 96, 3), dtype=np.uint8)
    x = VideoProcessor(vae_scale_factor=8).preprocess_video(pixels[None].astype(np.float32) / 255.0)
    assert x.dtype == torch.float32 and x.shape == (1, 3, 5, 64, 96)
    sent = sum(c.ByteSize() for c in video_chunks(prepare_video(x), encode_options(output_type="moments")))
    assert sent < x.numel() + 1000  # one byte a value
    with VaeClient(running.target) as client:
        assert torch.equal(client.encode(x), _stock(stock, x))
        image = torch.cat([x[:, :, :1], torch.zeros(1, 3, 8, 64, 96)], 2)  # I2V: a uint8 image, then zeros
        assert torch.equal(client.encode(image), _stock(stock, image))


@pytest.mark.cuda
def test_the_uint8_check_on_the_gpu_inverts_the_servers_cpu_conversion() -> None:
    """On a GPU the check's arithmetic runs there: for all 256 values it gives the CPU-made
    server floats' uint8 back, and a large video on the GPU is checked too (no size bound)."""
    u, floats = _all_rgb8("cuda")
    video = prepare_video(floats)
    assert video.frames.dtype == torch.uint8 and torch.equal(video.frames.cpu(), u)
    big = floats.expand(1, 3, 81, 16, 16).repeat(1, 1, 1, 30, 52).contiguous()  # 81 x 480x832, > the CPU bound
    assert prepare_video(big).frames.dtype == torch.uint8


def test_image_to_video_sends_one_frame(served: tuple[Any, Any]) -> None:
    """An image then zero frames: only the image travels (trailing_zero_frames), same moments."""
    running, stock = served
    image = _video(1, 1, seed=9)
    x = torch.cat([image, torch.zeros(1, 3, 8, 64, 96)], 2)
    video = prepare_video(x)
    assert video.zero_frames == 8 and video.frames.shape[2] == 1
    sent = sum(c.ByteSize() for c in video_chunks(video, encode_options(output_type="moments", zero_frames=8)))
    everything = prepare_video(x, send_zeros=True)
    full = sum(c.ByteSize() for c in video_chunks(everything, encode_options(output_type="moments")))
    assert sent < 3 * 64 * 96 * 4 + 200 and full > 9 * 3 * 64 * 96 * 4  # one frame's bytes, not nine
    negative_zero = x.clone()
    negative_zero[0, 1, 8, 0, 0] = -0.0  # bitwise: a -0.0 frame is sent, not replaced by +0.0
    assert prepare_video(negative_zero).zero_frames == 0
    want = _stock(stock, x)
    with VaeClient(running.target) as client:
        assert torch.equal(client.encode(x), want)
        assert torch.equal(client.encode(x, send_zeros=True), want)
        assert torch.equal(client.encode(negative_zero), _stock(stock, negative_zero))


def test_async_client_and_model_info(served: tuple[Any, Any]) -> None:
    running, stock = served
    x = _video(1, 5, seed=5)

    async def go() -> tuple[Any, Any]:
        async with AsyncVaeClient(running.target) as client:
            return await client.encode(x, out_dtype=torch.bfloat16), await client.model_info()

    got, info = asyncio.run(go())
    assert got.dtype == torch.bfloat16 and torch.equal(got, _stock(stock, x).to(torch.bfloat16))
    assert info.encodes and info.encode_precisions == ["lossless"] and info.encode_dtypes == ["float32"]


def test_remote_autoencoder_encode(served: tuple[Any, Any]) -> None:
    """RemoteAutoencoderKLWan.encode: diffusers' AutoencoderKLOutput with a
    DiagonalGaussianDistribution equal to the local VAE's (mode, sample with a generator)."""
    running, stock = served
    x = _video(1, 5, seed=6)
    vae = RemoteAutoencoderKLWan(running.target)
    try:
        out = vae.encode(x)
        (posterior,) = vae.encode(x, return_dict=False)
        # calling the module is stock's forward: encode, then decode the mode or a sample
        round_trip = vae(x).sample
        sampled = vae(x, sample_posterior=True, generator=torch.Generator().manual_seed(2), return_dict=False)[0]
    finally:
        vae.close()
    with torch.no_grad():
        local = stock.encode(x).latent_dist
        want_round_trip = stock(x).sample
        want_sampled = stock(x, sample_posterior=True, generator=torch.Generator().manual_seed(2)).sample
    assert type(out.latent_dist) is type(local)
    assert torch.equal(out.latent_dist.mode(), local.mode()) and torch.equal(posterior.logvar, local.logvar)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(out.latent_dist.sample(g1), local.sample(g2))
    assert round_trip.shape == x.shape and torch.equal(round_trip, want_round_trip)
    assert torch.equal(sampled, want_sampled) and not torch.equal(sampled, round_trip)


def test_a_decode_only_server_refuses_encode(tiny_server: Any) -> None:
    """Refused, and the server keeps serving. grpc.aio's request receiver makes its generator
    when asked for an iterator: a refused Encode that had asked and never read left it to garbage
    collection, which warned "coroutine '_MessageReceiver._async_message_receiver' was never
    awaited" on the server."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with VaeClient(tiny_server.target) as client:
            assert not client.model_info().encodes
            for _ in range(3):
                with pytest.raises(InvalidArgumentError, match="--encode"):
                    client.encode(_video(1, 1))
            assert client.decode(torch.randn(1, 4, 1, 4, 6)).shape[1] == 1  # still serving
        gc.collect()
    unawaited = [str(w.message) for w in seen if "never awaited" in str(w.message)]
    assert unawaited == []


def _options(**kw: Any) -> Any:
    return vaed_pb2.EncodeOptions(**kw)


BAD = {
    "T = 4": ([_video(1, 4)], "1 + 4k"),
    "T = 2 in two chunks": ([_video(1, 1), _video(1, 1)], "1 + 4k"),
    "T = 0": ([_video(1, 0)], "empty"),
    "uint8 T = 0": ([torch.zeros(1, 0, 64, 96, 3, dtype=torch.uint8)], "empty"),
    "4 channels": ([torch.rand(1, 4, 1, 64, 96)], "channels"),
    "uint8 channels": ([torch.zeros(1, 1, 64, 96, 4, dtype=torch.uint8)], "channels"),
    "rank 4": ([torch.rand(3, 1, 64, 96)], "5-D"),
    "H not a multiple": ([_video(1, 1, h=36, w=48)], "multiple"),
    "over max_pixels": ([_video(1, 1, h=96, w=96)], "pixels"),
    "over max_batch": ([_video(3, 1)], "batch"),
    "over max_latent_frames": ([_video(1, 33)], "limit of 29"),
    # judged before the image comes: the zeros alone, named as such (it said "1000000 frames")
    "zeros over the limit": ([_video(1, 1)], "1000000 trailing zero frames (before the call's own frames, on top "
                             "of them) are over the server limit of 29", _options(trailing_zero_frames=10**6)),
    # the limit counts every frame of the call, whatever the chunking, its trailing zeros too
    "over max_latent_frames in chunks": ([_video(1, 1)] + [_video(1, 4, seed=i) for i in range(8)], "limit of 29"),
    "frames and zeros over the limit": ([_video(1, 25)], "limit of 29", _options(trailing_zero_frames=8)),
    "NaN": ([_video(1, 5).index_fill_(2, torch.tensor([3]), float("nan"))], "NaN"),
    "chunk shape changes": ([_video(1, 1), _video(1, 4, w=48)], "share B, H and W"),
    "chunk dtype changes": ([_video(1, 1), _video(1, 4).to(torch.bfloat16)], "dtype"),
    "out_dtype UINT8": ([_video(1, 1)], "out_dtype", _options(out_dtype=vaed_pb2.UINT8)),
    "encode_dtype not offered": ([_video(1, 1)], "encode_dtype", _options(encode_dtype=vaed_pb2.BFLOAT16)),
    "unknown precision": ([_video(1, 1)], "precision", _options(precision=7)),
    "fast not offered": ([_video(1, 1)], "not offered", _options(precision=vaed_pb2.FAST)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_and_server_keeps_serving(served: tuple[Any, Any], stub: Any, case: str) -> None:
    frames, expect, *opts = BAD[case]
    chunks = [_chunk(f, opts[0] if opts and i == 0 else None) for i, f in enumerate(frames)]
    code, details, _ = _status(stub, chunks)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert expect in details
    code, details, replies = _status(stub, [_chunk(_video(1, 1))])
    assert code == grpc.StatusCode.OK and len(replies) == 2


def test_finite_frames_that_overflow_the_encoder_are_invalid_argument_unless_allowed(
        served: tuple[Any, Any], stub: Any) -> None:
    running, stock = served
    frames = _video(1, 5)
    frames[:, :, 1:] = 3e38  # finite (float32's largest is 3.4e38) and far outside [-1, 1]
    want = _stock(stock, frames)
    assert torch.isfinite(want[:, :, 0]).all() and not torch.isfinite(want[:, :, 1]).all()  # stock overflows too
    code, details, replies = _status(stub, [_chunk(frames)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "frames 1-4 encode to NaN or Inf moments" in details and "allow_non_finite" in details
    # the call's first latent frame, finite, came before the status, bit-identical to stock's
    assert [r.latent_frame for r in replies] == [0]
    assert torch.equal(wire.to_torch(replies[0].moments), want[:, :, :1])
    code, details, replies = _status(stub, [_chunk(frames, _options(allow_non_finite=True))])
    assert code == grpc.StatusCode.OK, (code, details)
    moments = torch.cat([wire.to_torch(r.moments) for r in replies if r.HasField("moments")], dim=2)
    # as stock made them, NaN where stock's are NaN
    assert torch.equal(moments.isnan(), want.isnan()) and torch.equal(moments.nan_to_num(), want.nan_to_num())
    assert _status(stub, [_chunk(_video(1, 1))])[0] == grpc.StatusCode.OK


@pytest.mark.parametrize("case", ["byte count", "unknown dtype", "no dtype", "empty call", "options later",
                                  "malformed"])
def test_bad_messages_are_invalid_argument(served: tuple[Any, Any], stub: Any, case: str) -> None:
    good = _chunk(_video(1, 1))
    chunks = {
        "byte count": [vaed_pb2.VideoChunk(frames=vaed_pb2.Tensor(dtype=vaed_pb2.FLOAT32, shape=[1, 3, 1, 64, 96],
                                                                   data=b"\0" * 100))],
        "unknown dtype": [vaed_pb2.VideoChunk(frames=vaed_pb2.Tensor(dtype=9, shape=[1, 3, 1, 64, 96]))],
        "no dtype": [vaed_pb2.VideoChunk(frames=vaed_pb2.Tensor(shape=[1, 3, 1, 64, 96], data=b"\0" * 73728))],
        "empty call": [],
        "options later": [good, _chunk(_video(1, 4), _options(request_id="late"))],
    }.get(case)
    if case == "malformed":
        channel = grpc.insecure_channel(served[0].target)
        call = channel.stream_stream(f"/{wire.SERVICE_NAME}/Encode")
        with pytest.raises(grpc.RpcError) as info:
            list(call(iter([b"\xff\xff\xff"]), timeout=30))
        channel.close()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    else:
        code, details, _ = _status(stub, chunks)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert _status(stub, [good])[0] == grpc.StatusCode.OK


def test_encode_in_float32_beside_a_bfloat16_decode() -> None:
    """--dtype bfloat16 --encode-dtype float32: the encode runs on an fp32 copy made from the
    loaded weights (equal to a stock fp32 encode), a request may ask for the bf16 one (equal to a
    stock bf16 encode), the decode stays bf16, ModelInfo lists both, the default first."""
    config = make_config("random:wan2.1-tiny", dtype="bfloat16", encode=True, encode_dtype="float32")
    x = _video(1, 5, seed=8)
    fp32 = build_random_vae("wan2.1-tiny").eval().requires_grad_(False)
    bf16 = build_random_vae("wan2.1-tiny").to(torch.bfloat16).eval().requires_grad_(False)
    with serve_in_thread(config) as running, VaeClient(running.target) as client:
        info = client.model_info()
        assert info.compute_dtype == "bfloat16" and info.encode_dtypes == ["float32", "bfloat16"]
        got32 = client.encode(x)
        got16 = client.encode(x.to(torch.bfloat16), encode_dtype="bfloat16")
        assert client.decode(torch.randn(1, 4, 1, 8, 12), output_type="raw").dtype == torch.bfloat16
    assert got32.dtype == torch.float32 and torch.equal(got32, _stock(fp32, x))
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, _stock(bf16, x.to(torch.bfloat16)))
    assert not torch.equal(got32.to(torch.bfloat16), got16)  # two encodes, not one cast
