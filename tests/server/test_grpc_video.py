"""Server-side MP4 over gRPC (DecodeOptions.format MP4 / MP4_LOSSLESS, FrameChunk.video) through
the real client against in-process servers of the tiny Wan2.1 and Wan2.2 models: the file decodes
back (PyAV) to the RGB8 frames within the codec's loss, the lossless choice exactly; the bytes
reach the client while the call still decodes (ordered by a held server-side decode, not by
time: frame 0's fragment leaves before latent frame 1 decodes); bad options are INVALID_ARGUMENT and the server keeps serving; a failed server's MP4 call
starts over on the next one, whole; gRPC and HTTP give the same bytes (one implementation)."""

from __future__ import annotations

import asyncio
import io
import math
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import av
import grpc
import numpy as np
import pytest
import torch
from harness import RunningServer, engine_calling_at, make_config, serve_in_thread

from vaed.errors import NotReady
from vaed.session import HostGroup, Session
from vaed.video import Fmp4Packager, VideoOptions
from vaed_client import AsyncVaeClient, CallReport, VaeClient, wire
from vaed_client.errors import LocalInputError, VaedError
from vaed_client.mp4 import Mp4Output

pb = wire.pb
Z = {"random:wan2.1-tiny": 4, "random:wan2.2-tiny": 6}
FPS = {"random:wan2.1-tiny": 16, "random:wan2.2-tiny": 24}


def latents(model: str, t: int = 3, h: int = 4, w: int = 6, seed: int = 0, b: int = 1) -> torch.Tensor:
    return torch.randn(b, Z[model], t, h, w, generator=torch.Generator().manual_seed(seed))


def frames_of_mp4(data: bytes) -> tuple[np.ndarray, Any]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, stream.average_rate


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def package(frames: np.ndarray, options: VideoOptions) -> bytes:
    packager = Fmp4Packager(options)
    return packager.add(frames) + packager.close()


@pytest.fixture(scope="module", params=sorted(Z))
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with serve_in_thread(make_config(request.param)) as running:
        yield running


def test_model_info_offers_video_at_the_models_rate(server: RunningServer) -> None:
    with VaeClient(server.target, timeout=60) as client:
        info = client.model_info()
    assert info.video_formats == ["mp4", "mp4_lossless"]
    assert info.video_fps == FPS[server.config.model]


def test_mp4_decodes_back_to_the_frames(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    """H.264 at the default CRF within the codec's loss, at the model's frame rate; the same
    frames vaed.video makes of the RGB8 frames; the lossless choice exactly the RGB8 frames."""
    model = server.config.model
    x = latents(model, t=5, h=8, w=8, seed=6)
    with VaeClient(server.target, timeout=120) as client:
        rgb8 = client.decode(x)[0].numpy()
        mp4 = client.decode(x, output_type="mp4")
        lossless = client.decode(x, output_type="mp4", lossless=True, fps=8)
        small = client.decode(x, output_type="mp4", crf=40, preset="ultrafast")
    assert isinstance(mp4, bytes) and mp4[4:8] == b"ftyp"
    frames, rate = frames_of_mp4(mp4)
    assert frames.shape == rgb8.shape and rate == FPS[model]
    quality = psnr(frames, rgb8)
    with capsys.disabled():
        print(f"\ngRPC {model} {list(x.shape)}: mp4 {len(mp4)} bytes (crf 40: {len(small)}) vs RGB8 "
              f"{rgb8.nbytes}, PSNR {quality:.2f} dB; lossless {len(lossless)} bytes")
    # Random weights decode to noise, H.264's hardest content (and 4:2:0 halves its colour): the
    # loss is large, so the frames must also be what vaed.video makes of the same RGB8 frames.
    assert quality > 12
    assert np.array_equal(frames, frames_of_mp4(package(rgb8, VideoOptions(fps=int(rate))))[0])
    assert mp4 == package(rgb8, VideoOptions(fps=int(rate)))  # the server's yuv420p planes are vaed.yuv's
    assert len(small) < len(mp4)  # crf and preset reached the encoder
    exact, rate = frames_of_mp4(lossless)
    assert rate == 8 and np.array_equal(exact, rgb8)


def test_the_session_hands_h264_its_yuv420p_planes(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A served H.264 call's groups reach the packager as yuv420p planes [t, 3H/2, W] made before
    the host copy (on a GPU server: on the GPU); a lossless call's as RGB8 [t, H, W, 3]."""
    seen: list[tuple[bool, tuple[int, ...]]] = []
    add = Fmp4Packager.add

    def spy(self: Fmp4Packager, frames: np.ndarray, *, yuv420p: bool = False) -> bytes:
        seen.append((yuv420p, frames.shape))
        return add(self, frames, yuv420p=yuv420p)

    monkeypatch.setattr(Fmp4Packager, "add", spy)
    x = latents(server.config.model, t=2, h=8, w=8, seed=2)
    with VaeClient(server.target, timeout=120) as client:
        size = client.decode(x)[0].shape[1:3]
        client.decode(x, output_type="mp4")
        h264, seen[:] = list(seen), []
        client.decode(x, output_type="mp4", lossless=True)
    h, w = size
    assert h264 == [(True, (1, h * 3 // 2, w)), (True, (4, h * 3 // 2, w))]
    assert seen == [(False, (1, h, w, 3)), (False, (4, h, w, 3))]


def test_mp4_path_is_written_as_it_arrives_and_async_gives_the_same(server: RunningServer,
                                                                    tmp_path: pathlib.Path) -> None:
    x = latents(server.config.model, t=3, seed=2)
    path = tmp_path / "v.mp4"
    with VaeClient(server.target, timeout=120) as client:
        want = client.decode(x, output_type="mp4", lossless=True)
        assert client.decode(x, output_type="mp4", lossless=True, mp4_path=path) == path
    assert np.array_equal(frames_of_mp4(path.read_bytes())[0], frames_of_mp4(want)[0])

    async def run() -> bytes:
        async with AsyncVaeClient(server.target, timeout=120) as client:
            return await client.decode(x, output_type="mp4", lossless=True)

    assert np.array_equal(frames_of_mp4(asyncio.run(run()))[0], frames_of_mp4(want)[0])


def test_fragments_arrive_before_the_call_ends() -> None:
    """The server's decode of latent frame 1 is held until the client has read the init segment
    and frame 0's fragment: the first group's bytes leave with the first group, before the
    second one exists (no waiting for the next packet, as FFmpeg's muxer would). The replies'
    bytes are one valid MP4 of every frame."""
    config = make_config("random:wan2.1-tiny", warmup=False)
    release = threading.Event()

    def held_at_frame_1() -> None:
        assert release.wait(60), "the client never read the first fragment"

    build = engine_calling_at(config, 1, held_at_frame_1)

    x = latents("random:wan2.1-tiny", t=4, h=8, w=8, seed=7)
    request = pb.DecodeRequest(latents=wire.to_message(x), options=pb.DecodeOptions(format=pb.MP4_LOSSLESS))
    with serve_in_thread(config, build_engine=build) as running:
        with grpc.insecure_channel(running.target) as channel:
            replies = iter(wire.pb_grpc.VaeDecoderStub(channel).Decode(request, timeout=120))
            first = next(replies)
            assert not first.final and not first.HasField("frames") and first.chunk_index == 0
            early = first.video
            assert early[4:8] == b"ftyp" and b"moov" in early and b"moof" in early
            early_frames = frames_of_mp4(early)[0]  # decodable while latent frame 1 is held
            assert not release.is_set()
            release.set()
            rest = list(replies)
        with VaeClient(running.target, timeout=120) as client:
            rgb8 = client.decode(x)[0].numpy()
    assert np.array_equal(early_frames, rgb8[:1])  # frame 0, exactly (lossless)
    assert rest[-1].final and rest[-1].first_frame == rgb8.shape[0] and not rest[-1].video
    assert all(r.video for r in rest[:-1])  # every message before the final one carries bytes (none empty)
    data = early + b"".join(r.video for r in rest)
    assert np.array_equal(frames_of_mp4(data)[0], rgb8)


def test_the_encoder_opens_after_frame_0_launched_while_it_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call core opens the encoder from the latents' header once frame 0's kernels are
    launched, not beside them and not at frame 0's arrival: no open has started when the engine
    returns frame 0's group (inside the step), and frame 0's delivery is held until the encoder
    is open (an event, never a time), which a call that opened it at its first frame would
    never release. The file is the frames vaed.video makes of the RGB8 frames."""
    config = make_config("random:wan2.1-tiny", warmup=False)
    entered, opened = threading.Event(), threading.Event()
    sizes: list[tuple[int, int]] = []
    open_before_launch: list[bool] = []
    held_until_open: list[bool] = []
    real_open, real_deliver = Fmp4Packager.open, Session.deliver_group

    def recorded_open(self: Fmp4Packager, height: int, width: int) -> None:
        entered.set()
        real_open(self, height, width)
        sizes.append((height, width))
        opened.set()

    def delivered_once_open(self: Session, group: HostGroup) -> None:
        if group.first_frame == 0 and self.output.yuv420p:  # the mp4 call's frame 0
            held_until_open.append(opened.wait(60))
        real_deliver(self, group)

    monkeypatch.setattr(Fmp4Packager, "open", recorded_open)
    monkeypatch.setattr(Session, "deliver_group", delivered_once_open)
    x = latents("random:wan2.1-tiny", t=3, h=8, w=6, seed=3)
    build = engine_calling_at(config, 0, lambda: open_before_launch.append(entered.is_set()))
    with serve_in_thread(config, build_engine=build) as running:
        with VaeClient(running.target, timeout=120) as client:
            mp4 = client.decode(x, output_type="mp4")
            rgb8 = client.decode(x)[0].numpy()
    assert open_before_launch[0] is False  # the mp4 call's frame 0 (the RGB8 call opens nothing)
    assert held_until_open == [True], "the encoder was not opened before frame 0 reached it"
    assert sizes[0] == (64, 48)  # latents 8 x 6 at the tiny model's 8x
    assert np.array_equal(frames_of_mp4(mp4)[0], frames_of_mp4(package(rgb8, VideoOptions(fps=16)))[0])


@pytest.mark.parametrize("options, b, message", [
    (dict(format=pb.MP4, crf=52), 1, "crf must be in 0..51, got 52"),
    (dict(format=pb.MP4, fps=241), 1, "fps must be in 1..240, got 241"),
    (dict(format=pb.MP4, preset="warp"), 1, "preset must be one of ultrafast"),
    (dict(format=pb.MP4_LOSSLESS, crf=18), 1, "MP4_LOSSLESS is always CRF 0"),
    (dict(format=pb.RGB8, fps=16), 1, "fps: options of the MP4 and MP4_LOSSLESS formats, not of RGB8"),
    (dict(format=pb.RAW, crf=0, preset="fast"), 1, "crf, preset: options of the MP4"),
    (dict(format=pb.MP4), 2, "MP4 output holds one video: send batch 1, got 2"),
    (dict(format=pb.MP4, skip_frames=1), 1, "skip_frames (1) does not apply to MP4 output"),
    (dict(format=7), 1, "unknown output format 7; use RGB8, RAW, MP4 or MP4_LOSSLESS"),
    # raw_dtype on any other format was dropped without a word
    (dict(raw_dtype=pb.FLOAT16), 1, "raw_dtype is an option of the RAW format, not of RGB8 (the default)"),
    (dict(format=pb.MP4, raw_dtype=pb.FLOAT16), 1, "raw_dtype is an option of the RAW format, not of MP4"),
])
def test_bad_video_options_are_invalid_argument(server: RunningServer, options: dict[str, Any], b: int,
                                                message: str) -> None:
    """Through the raw stub (the client checks these itself first): each is INVALID_ARGUMENT with
    its reason, on Decode and DecodeStream, and the server keeps serving."""
    x = latents(server.config.model, t=2, b=b)
    with grpc.insecure_channel(server.target) as channel:
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        for call in (lambda o: stub.Decode(pb.DecodeRequest(latents=wire.to_message(x), options=o), timeout=60),
                     lambda o: stub.DecodeStream(iter([pb.LatentChunk(latents=wire.to_message(x), options=o)]),
                                                 timeout=60)):
            with pytest.raises(grpc.RpcError) as caught:
                list(call(pb.DecodeOptions(**options)))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in caught.value.details()
    with VaeClient(server.target, timeout=60) as client:
        assert frames_of_mp4(client.decode(latents(server.config.model, t=2), output_type="mp4"))[0].shape[0] == 5


def test_frames_past_h264s_side_limit_are_invalid_argument_before_the_decode(server: RunningServer) -> None:
    """x264 takes at most 16384 pixels a side: latents that decode wider are refused from their
    header (the encoder's own failure was an INTERNAL after the decode began), on Decode and
    DecodeStream, both MP4 formats; the server keeps serving."""
    scale = 16 if server.config.model.endswith("wan2.2-tiny") else 8
    w = 16384 // scale + 2  # 16400 or 16416 pixels wide, one row of latents: within max_pixels
    x = latents(server.config.model, t=1, h=1, w=w)
    with grpc.insecure_channel(server.target) as channel:
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        for format in (pb.MP4, pb.MP4_LOSSLESS):
            options = pb.DecodeOptions(format=format)
            for call in (lambda: stub.Decode(pb.DecodeRequest(latents=wire.to_message(x), options=options),
                                             timeout=60),
                         lambda: stub.DecodeStream(iter([pb.LatentChunk(latents=wire.to_message(x),
                                                                        options=options)]), timeout=60)):
                with pytest.raises(grpc.RpcError) as caught:
                    list(call())
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
                assert (f"H.264 video is at most 16384 pixels a side, and these latents decode to {scale}x{w * scale}"
                        in caught.value.details())
    with VaeClient(server.target, timeout=60) as client:
        assert client.decode(x).shape == (1, 1, scale, w * scale, 3)  # RGB8 frames of that size are fine
        assert frames_of_mp4(client.decode(latents(server.config.model, t=2), output_type="mp4"))[0].shape[0] == 5


@pytest.mark.parametrize("shape", [[], [4], [1, 4]])
def test_latents_of_another_rank_are_invalid_argument_with_video_output_too(server: RunningServer,
                                                                             shape: list[int]) -> None:
    """The video checks read the batch only of 5-D latents: a tensor of another rank gets the
    latents' own INVALID_ARGUMENT, not an internal error, on Decode and DecodeStream."""
    tensor = pb.Tensor(dtype=pb.FLOAT32, shape=shape, data=bytes(4 * math.prod(shape)))
    with grpc.insecure_channel(server.target) as channel:
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        for format in (pb.MP4, pb.MP4_LOSSLESS):
            options = pb.DecodeOptions(format=format)
            for call in (lambda: stub.Decode(pb.DecodeRequest(latents=tensor, options=options), timeout=60),
                         lambda: stub.DecodeStream(iter([pb.LatentChunk(latents=tensor, options=options)]),
                                                   timeout=60)):
                with pytest.raises(grpc.RpcError) as caught:
                    list(call())
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
                assert f"latents must be 5-D [B, z_dim, T, h, w]; got shape {shape}" in caught.value.details()


def test_the_client_checks_video_options_before_the_call() -> None:
    """LocalInputError before a byte is sent (the target does not even exist)."""
    x = latents("random:wan2.1-tiny")
    with VaeClient("127.0.0.1:1", timeout=5) as client:
        for kwargs, message in [
            (dict(output_type="mp4", crf=60), "crf must be in 0..51"),
            (dict(output_type="mp4", lossless=True, crf=10), "lossless=True is always CRF 0"),
            (dict(output_type="mp4", preset="warp"), "preset must be one of"),
            (dict(output_type="mp4", fps=0), "fps must be in 1..240"),
            # a fraction or a bool is refused, not truncated (23.976 made a 23 fps video)
            (dict(output_type="mp4", fps=23.976), "fps must be a whole number, got 23.976"),
            (dict(output_type="mp4", fps=True), "fps must be a whole number, got True"),
            (dict(output_type="mp4", crf=18.5), "crf must be a whole number, got 18.5"),
            (dict(output_type="mp4", format="raw"), "format and raw_dtype are options of frame output"),
            (dict(output_type="uint8", fps=16), "fps: options of output_type='mp4', not of 'uint8'"),
            (dict(mp4_path="x.mp4"), "mp4_path is for output_type='mp4'"),
            (dict(output_type="mp4", mp4_path="."), "is a directory"),  # was an IsADirectoryError mid-call
        ]:
            with pytest.raises(LocalInputError, match=message):
                client.decode(x, **kwargs)


def _fails_at_frame_2(config: Any, got_bytes: threading.Event) -> Any:
    """An engine factory whose decode fails UNAVAILABLE (as a device failure does) at latent
    frame 2, once the client has received bytes of the call."""
    def fails_at_frame_2() -> None:
        assert got_bytes.wait(60), "the client never received the call's first bytes"
        raise NotReady("device cpu failed; retry on another device or replica")

    build = engine_calling_at(config, 2, fails_at_frame_2)

    return build


@pytest.fixture()
def got_bytes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once the client's Mp4Output has taken bytes (a spy: the real `add` runs)."""
    event = threading.Event()
    add = Mp4Output.add

    def spied_add(self: Mp4Output, reply: Any) -> None:
        add(self, reply)
        if self.bytes:
            event.set()

    monkeypatch.setattr(Mp4Output, "add", spied_add)
    return event


def test_a_failed_servers_mp4_call_starts_over_whole_on_the_next(tmp_path: pathlib.Path,
                                                                 got_bytes: threading.Event) -> None:
    """Replica A fails at latent frame 2, after the client wrote A's first bytes to the file: the
    call resumes on B from the start, the file is emptied first, and it ends as B's whole video
    (one init segment, every frame)."""
    model = "random:wan2.1-tiny"
    config = make_config(model, warmup=False)
    x = latents(model, t=4, h=8, w=8, seed=3)
    path = tmp_path / "v.mp4"
    with serve_in_thread(config, build_engine=_fails_at_frame_2(config, got_bytes)) as a, \
            serve_in_thread(make_config(model)) as b:
        with VaeClient(b.target, timeout=120) as client:
            rgb8 = client.decode(x)[0].numpy()
        report = CallReport()
        with VaeClient([a.target, b.target], timeout=120) as client:
            assert client.decode(x, output_type="mp4", lossless=True, mp4_path=path, report=report) == path
    assert got_bytes.is_set() and report.resumes == 1 and report.targets == [a.target, b.target]
    assert report.reasons[0].startswith("UNAVAILABLE: device cpu failed")
    data = path.read_bytes()
    assert data.count(b"ftyp") == 1 and np.array_equal(frames_of_mp4(data)[0], rgb8)


def test_a_failed_mp4_call_leaves_no_file(tmp_path: pathlib.Path, got_bytes: threading.Event) -> None:
    """One target and nothing delivered: the failure is the call's (as for frames), and the file
    the client had begun is removed: a file at mp4_path is always a whole video."""
    model = "random:wan2.1-tiny"
    config = make_config(model, warmup=False)
    path = tmp_path / "v.mp4"
    with serve_in_thread(config, build_engine=_fails_at_frame_2(config, got_bytes)) as a:
        with VaeClient(a.target, timeout=120) as client, pytest.raises(VaedError, match="device cpu failed"):
            client.decode(latents(model, t=4, h=8, w=8), output_type="mp4", mp4_path=path)
    assert got_bytes.is_set() and not path.exists()


def test_the_encoders_of_failed_mp4_calls_are_freed_at_the_calls_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls that fail after their first fragments (latent frame 2) leave no open encoder: each
    call's packager is closed and lets its container go at the call's end (x264's threads and
    buffers had lived on until a cyclic garbage collection: 4 threads a call on 2 cores)."""
    packagers: list[Fmp4Packager] = []
    init = Fmp4Packager.__init__

    def recorded(self: Fmp4Packager, options: VideoOptions) -> None:
        init(self, options)
        packagers.append(self)

    def fail() -> None:
        raise NotReady("device cpu failed; retry on another device or replica")

    monkeypatch.setattr(Fmp4Packager, "__init__", recorded)
    model = "random:wan2.1-tiny"
    config = make_config(model, warmup=False)
    with serve_in_thread(config, build_engine=engine_calling_at(config, 2, fail)) as running, \
            VaeClient(running.target, timeout=120, resume=False) as client:
        for lossless in (False, True, False):
            with pytest.raises(VaedError, match="device cpu failed"):
                client.decode(latents(model, t=4, h=16, w=16), output_type="mp4", lossless=lossless)
        assert len(packagers) == 3 and all(p.frames_in > 0 for p in packagers)  # the encoders ran
        for _ in range(6000):  # a bound on a hang: the call's end runs just after its status leaves
            if all(p.closed and p._container is None for p in packagers):
                break
            threading.Event().wait(0.01)
    assert [(p.closed, p._container) for p in packagers] == [(True, None)] * 3


def test_grpc_and_http_mp4_are_one_implementation() -> None:
    """The same latents give the same MP4 bytes through gRPC (format MP4) and the HTTP front
    (`remote_decode(output_type="mp4")`): both are the call core's packaging, same options."""
    from diffusers.utils.remote_utils import remote_decode

    model = "random:wan2.2-tiny"
    x = latents(model, t=3, h=4, w=6, seed=5)
    with serve_in_thread(make_config(model, http_port=0)) as running:
        with VaeClient(running.target, timeout=120) as client:
            grpc_mp4 = client.decode(x, output_type="mp4")
        http_mp4 = remote_decode(endpoint=f"http://127.0.0.1:{running.server.http_port}/", tensor=x,
                                 output_type="mp4", return_type="mp4")
    assert grpc_mp4 == http_mp4 and frames_of_mp4(grpc_mp4)[1] == 24


@pytest.mark.cuda
@pytest.mark.parametrize("h, w", [(60, 104), (90, 160)])  # 480x832 and 720x1280
def test_mp4_from_a_gpu_server(h: int, w: int, capsys: pytest.CaptureFixture[str]) -> None:
    """On CUDA a group's frames are in pinned host memory when the packager reads them: the
    lossless MP4 is exactly the RGB8 frames, and the lossy one within the codec's loss, byte for
    byte the file of the RGB8 frames converted on the CPU (the GPU's yuv420p planes are the same)."""
    config = make_config("random:wan2.1", device="cuda:0", warmup=False)
    x = torch.randn(1, 16, 5, h, w, generator=torch.Generator().manual_seed(1))
    with serve_in_thread(config) as running, VaeClient(running.target, timeout=600) as client:
        rgb8 = client.decode(x)[0].numpy()
        exact = client.decode(x, output_type="mp4", lossless=True)
        mp4 = client.decode(x, output_type="mp4")
    assert np.array_equal(frames_of_mp4(exact)[0], rgb8)
    frames, rate = frames_of_mp4(mp4)
    quality = psnr(frames, rgb8)
    with capsys.disabled():
        print(f"\nGPU {list(x.shape)}: mp4 {len(mp4)} bytes vs RGB8 {rgb8.nbytes} (1/{rgb8.nbytes / len(mp4):.0f}), "
              f"PSNR {quality:.2f} dB; lossless {len(exact)} bytes")
    assert rate == 16 and frames.shape == rgb8.shape and quality > 12
    assert mp4 == package(rgb8, VideoOptions(fps=16))
