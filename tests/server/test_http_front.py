"""The HTTP front through diffusers' own client: `remote_decode` (pt, pt + partial_postprocess,
pil with a VideoProcessor, mp4) against in-process servers of the tiny Wan2.1 and Wan2.2 models,
compared with the gRPC path (`VaeClient`) and diffusers' local decode; the bad-input, auth and
admission matrices; fMP4 bytes that reach the client while the call still decodes."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import math
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import av
import numpy as np
import pytest
import requests
import torch
from diffusers.utils.remote_utils import prepare_decode, remote_decode
from diffusers.video_processor import VideoProcessor
from PIL import Image

from harness import RunningServer, diffusers_decode, engine_calling_at, make_config, serve_in_thread, start_cli_server
from vaed.errors import CapacityExhausted
from vaed.http import front as http_front
from vaed.video import Fmp4Packager, VideoOptions
from vaed_client import VaeClient

TOKEN = "s3cret-token"
BODY_TIMEOUT_S = 3.0  # the bad-input server's --session-first-message-timeout
Z = {"random:wan2.1-tiny": 4, "random:wan2.2-tiny": 6}


def url(running: RunningServer, path: str = "/") -> str:
    return f"http://127.0.0.1:{running.server.http_port}{path}"


def latents(model: str, t: int = 3, h: int = 4, w: int = 6, seed: int = 0, b: int = 1) -> torch.Tensor:
    return torch.randn(b, Z[model], t, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["random:wan2.1-tiny", "random:wan2.2-tiny"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with serve_in_thread(make_config(request.param, http_port=0)) as running:
        yield running


def grpc_decode(running: RunningServer, x: torch.Tensor, **kwargs: Any) -> Any:
    with VaeClient(running.target, timeout=120) as client:
        return client.decode(x, **kwargs)


def frames_of_mp4(data: bytes) -> tuple[np.ndarray, Any]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, stream.average_rate


def package(frames: np.ndarray, options: VideoOptions) -> bytes:
    packager = Fmp4Packager(options)
    return packager.add(frames) + packager.close()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


# -- diffusers' remote_decode against the server ------------------------------------------------


@pytest.mark.parametrize("do_scaling", [True, False])
def test_pt_is_bit_identical_to_the_grpc_raw_path(server: RunningServer, do_scaling: bool) -> None:
    """do_scaling=True (remote_decode's default): the server applies WanPipeline's decode step,
    as gRPC's default does; do_scaling=False: the tensor is vae.decode's input (raw_latents)."""
    x = latents(server.config.model, seed=1)
    remote = remote_decode(endpoint=url(server), tensor=x, output_type="pt", return_type="pt", do_scaling=do_scaling)
    local = grpc_decode(server, x, output_type="raw", raw_latents=not do_scaling)
    assert remote.dtype == torch.float32 and remote.shape == local.shape
    assert torch.equal(remote, torch.as_tensor(local))
    # and what diffusers' own decode gives (the pipeline's decode step when do_scaling)
    assert torch.equal(remote, diffusers_decode(server.reference_vae(), x, raw_latents=not do_scaling))


def test_pt_takes_a_batch(server: RunningServer) -> None:
    x = latents(server.config.model, t=2, b=2, seed=2)
    remote = remote_decode(endpoint=url(server), tensor=x, output_type="pt", return_type="pt")
    assert torch.equal(remote, torch.as_tensor(grpc_decode(server, x, output_type="raw")))


def test_partial_postprocess_answers_the_rgb8_frames_as_pil_images(server: RunningServer) -> None:
    x = latents(server.config.model, seed=3)
    frames = remote_decode(endpoint=url(server), tensor=x, output_type="pt", partial_postprocess=True, return_type="pt")
    rgb8 = torch.as_tensor(grpc_decode(server, x))  # [1, T, H, W, 3] uint8
    assert frames.dtype == torch.uint8 and torch.equal(frames, rgb8[0])
    images = remote_decode(endpoint=url(server), tensor=x, output_type="pt", partial_postprocess=True)
    assert len(images) == rgb8.shape[1]
    assert all(np.array_equal(np.asarray(image), rgb8[0, i].numpy()) for i, image in enumerate(images))


def test_pil_with_a_video_processor_gives_the_local_pipelines_frames(server: RunningServer) -> None:
    """output_type pil with a processor, and pt with a processor (the client post-processes the
    raw output): both equal what WanPipeline's output_type="pil" gives for the same latents."""
    x = latents(server.config.model, seed=4)
    processor = VideoProcessor()
    local = processor.postprocess_video(diffusers_decode(server.reference_vae(), x, raw_latents=False), output_type="pil")[0]
    for output_type in ("pil", "pt"):
        remote = remote_decode(endpoint=url(server), tensor=x, output_type=output_type, processor=processor)
        assert len(remote) == len(local)
        for got, want in zip(remote, local, strict=True):
            assert got.size == want.size and np.array_equal(np.asarray(got), np.asarray(want)), output_type


def test_pil_without_a_processor_answers_one_frame_as_an_image(server: RunningServer) -> None:
    x = latents(server.config.model, t=1, seed=5)
    rgb8 = torch.as_tensor(grpc_decode(server, x))[0, 0].numpy()
    png = remote_decode(endpoint=url(server), tensor=x, output_type="pil", image_format="png")
    assert png.format == "png" and np.array_equal(np.asarray(png), rgb8)
    jpg = remote_decode(endpoint=url(server), tensor=x, output_type="pil")
    assert jpg.format == "jpeg" and jpg.size == png.size
    with pytest.raises(RuntimeError, match="pass processor=VideoProcessor"):
        remote_decode(endpoint=url(server), tensor=latents(server.config.model, t=2), output_type="pil")
    # a hand-written client's Accept: media types are case-insensitive, and it may list several
    sent = prepare_decode(x, output_type="pil", image_format="png")
    for accept in ("Image/PNG", "text/html, image/png;q=0.9"):
        answer = requests.post(url(server), params=sent["params"], data=sent["data"],
                               headers={**sent["headers"], "Accept": accept}, timeout=60)
        assert answer.status_code == 200 and answer.headers["Content-Type"] == "image/png", (accept, answer.headers)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(answer.content))), rgb8)


def test_mp4_decodes_back_to_the_frames(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    """H.264 at the default CRF within the codec's loss; the lossless choice exactly; the frame
    rate is the model's (16 Wan2.1, 24 Wan2.2)."""
    x = latents(server.config.model, t=5, h=8, w=8, seed=6)
    rgb8 = torch.as_tensor(grpc_decode(server, x))[0].numpy()
    mp4 = remote_decode(endpoint=url(server), tensor=x, output_type="mp4", return_type="mp4")
    frames, rate = frames_of_mp4(mp4)
    assert frames.shape == rgb8.shape
    assert rate == (24 if "2.2" in server.config.model else 16)
    quality = psnr(frames, rgb8)
    with capsys.disabled():
        print(f"\n{server.config.model} {list(x.shape)}: mp4 {len(mp4)} bytes vs RGB8 {rgb8.nbytes}, PSNR {quality:.2f} dB")
    # Random weights decode to noise, the hardest content for H.264 (and 4:2:0 halves its colour
    # detail), so the loss is large; the frames must be what vaed.video makes of the same frames.
    assert quality > 12
    assert np.array_equal(frames, frames_of_mp4(package(rgb8, VideoOptions(fps=int(rate))))[0])
    sent = prepare_decode(x, output_type="mp4")
    lossless = requests.post(url(server), data=sent["data"], headers=sent["headers"],
                             params={**sent["params"], "lossless": "true", "fps": "8"}, timeout=120)
    assert lossless.status_code == 200 and lossless.headers["Content-Type"] == "video/mp4"
    exact, rate = frames_of_mp4(lossless.content)
    assert rate == 8 and np.array_equal(exact, rgb8)


# -- bad input: 4xx with a JSON error, and the server goes on serving ----------------------------


def _post(running: RunningServer, params: dict[str, Any], data: Any, **headers: str) -> requests.Response:
    return requests.post(url(running, "/decode"), params=params, data=data, headers=headers, timeout=60)


def raw_request(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send a request head (and `body`); read the answer's head and its Content-Length bytes:
    (status, JSON body). Not to the server's close: a refused request's unread body makes
    aiohttp linger up to 10 s before closing (so its answer is not lost to a TCP reset)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data and (chunk := s.recv(65536)):
            data += chunk
        answer_head, _, rest = data.partition(b"\r\n\r\n")
        lengths = [int(line.split(b":", 1)[1]) for line in answer_head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")]
        want = lengths[0] if lengths else None
        while (want is None or len(rest) < want) and (chunk := s.recv(65536)):
            rest += chunk
    status = int(answer_head.split(b" ", 2)[1])
    return status, json.loads(rest or b"null")


def _assert_json_error(response: requests.Response, status: int, pattern: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and re.search(pattern, body["error"]), body
    assert "Traceback" not in response.text


@pytest.fixture(scope="module")
def tiny_http() -> Iterator[RunningServer]:
    config = make_config("random:wan2.1-tiny", http_port=0, max_message_bytes=1 << 20,
                         session_first_message_timeout=BODY_TIMEOUT_S)
    with serve_in_thread(config) as running:
        yield running


def test_a_request_refused_from_its_head_is_logged_as_a_failed_call_is(
        tiny_http: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    """Requests refused from their head (a query or byte count the body cannot meet, a body too
    big) were counted but never logged, where the same refusal over gRPC logs the call's line:
    each now logs its method, X-Request-Id, status, HTTP status and error; an id the server does
    not take is logged as "-", not as its text."""
    caplog.set_level(logging.INFO, logger="vaed")
    sent = prepare_decode(latents("random:wan2.1-tiny"), output_type="pt")
    params, body = sent["params"], sent["data"]
    cases = [
        ("head-unknown", {**params, "colour": "red"}, body, 400, "unknown query parameter 'colour'"),
        ("head-bytes", params, body[:-4], 400, "the body is"),
    ]
    for request_id, case_params, data, status, error in cases:
        answer = _post(tiny_http, case_params, data, **{"X-Request-Id": request_id})
        assert answer.status_code == status, answer.text
        line = re.search(rf"Decode id={request_id} status=INVALID_ARGUMENT refused from its head "
                         rf"\(HTTP {status}\) error=(.*)", caplog.text)
        assert line is not None and error in json.loads(line.group(1)), caplog.text
    status, _ = raw_request(tiny_http.server.http_port, "POST /decode?shape=1&dtype=float32 HTTP/1.1\r\nHost: x\r\n"
                            f"X-Request-Id: head-too-big\r\nContent-Length: {2 << 20}\r\n")
    assert status == 413 and "Decode id=head-too-big status=INVALID_ARGUMENT refused from its head (HTTP 413)" in caplog.text
    answer = _post(tiny_http, {**params, "colour": "red"}, body, **{"X-Request-Id": "bad id with spaces"})
    assert answer.status_code == 400 and "bad id with spaces" not in caplog.text
    assert "Decode id=- status=INVALID_ARGUMENT refused from its head (HTTP 400)" in caplog.text


def test_the_bad_input_matrix(tiny_http: RunningServer) -> None:
    good = latents("random:wan2.1-tiny")
    sent = prepare_decode(good, output_type="pt")
    params, body = sent["params"], sent["data"]
    nan = good.clone()
    nan[0, 1, 2, 0, 0] = float("nan")
    cases: list[tuple[dict[str, Any], Any, int, str]] = [
        (params, body[:-4], 400, r"the body is \d+ bytes, and latents of shape \[1, 4, 3, 4, 6\] in float32 are 1152"),
        (params, body + b"1234", 400, "are 1152"),
        ({**params, "dtype": "float64"}, body, 400, "dtype 'float64' is not a latent dtype"),
        ({**params, "dtype": "uint8"}, body, 400, "dtype 'uint8' is not a latent dtype"),
        ({k: v for k, v in params.items() if k != "dtype"}, body, 400, "dtype is required"),
        ({**params, "shape": [4, 3, 4, 6]}, body, 400, "shape must be 5 positive sizes"),
        ({**params, "shape": [1, 4, 3, 4, "x"]}, body, 400, "shape must be integers"),
        # int() would take these as 6: sizes are ASCII digits only
        ({**params, "shape": [1, 4, 3, 4, "\u0666"]}, body, 400, "shape must be integers"),
        ({**params, "shape": [1, 4, 3, 4, "0_6"]}, body, 400, "shape must be integers"),
        ({**params, "shape": [1, 4, 3, 4, " 6"]}, body, 400, "shape must be integers"),
        ({**params, "height": "\u0663\u0662", "width": 48}, body, 400, "height must be an integer"),
        ({k: v for k, v in params.items() if k != "shape"}, body, 400, "shape is required"),
        ({**params, "output_type": "gif"}, body, 400, "output_type 'gif' is not served"),
        ({**params, "partial_postprocess": "maybe"}, body, 400, "partial_postprocess must be true or false"),
        ({**params, "scaling_factor": 0.3611}, body, 400, "scaling_factor is not used by Wan"),
        ({**params, "shift_factor": 0.1159}, body, 400, "shift_factor is not used by Wan"),
        ({**params, "height": 33, "width": 48}, body, 400, "not the decoded size 32x48"),
        ({**params, "output_type": "mp4", "crf": 99}, body, 400, "crf must be in 0..51"),
        ({**params, "output_type": "mp4", "lossless": "true", "crf": 10}, body, 400,
         "lossless=true is always CRF 0"),
        ({**params, "stream": "true"}, body, 400, "stream=true is served for output_type mp4 only"),
        ({**params, "shape": [1, 5, 3, 4, 6], "dtype": "float16"}, body[:720], 400, "z_dim|channels|5"),
        (params, prepare_decode(nan, output_type="pt")["data"], 400, "NaN or Inf"),
        ({**params, "shape": [2, 4, 3, 4, 6], "output_type": "mp4"}, body + body, 400, "send batch 1"),
        ({**params, "precision": "fast"}, body, 400, "precision fast is not offered"),
    ]
    for case_params, data, status, pattern in cases:
        _assert_json_error(_post(tiny_http, case_params, data), status, pattern)
    # oversized: refused from the head, before a byte of the body is read
    before = tiny_http.server.front.bodies_read
    status, error = raw_request(tiny_http.server.http_port,
                                f"POST /decode?shape=1&dtype=float32 HTTP/1.1\r\nHost: x\r\nContent-Length: {2 << 20}\r\n")
    assert status == 413 and "at most 1048576 bytes (its message limit)" in error["error"]
    # the way out keeps the video whole: parts decoded apart are not the video's (the VAE is causal)
    assert "send it as bfloat16 or float16 latents, or decode it with gRPC's DecodeStream" in error["error"]
    assert "in parts" not in error["error"]
    # admitted, then the body does not come: 504 once --session-first-message-timeout ran out
    status, error = raw_request(tiny_http.server.http_port,
                                _head((1, 4, 3, 4, 6), 1152).replace("do_scaling=true", "do_scaling=false"))
    assert status == 504 and "--session-first-message-timeout" in error["error"], error
    assert tiny_http.server.front.bodies_read == before + 1
    before += 1
    # no Content-Length: a chunked body
    _assert_json_error(_post(tiny_http, params, iter([body])), 411, "Content-Length is required")
    assert tiny_http.server.front.bodies_read == before
    # still serving, and a good call is answered
    good_answer = remote_decode(endpoint=url(tiny_http), tensor=good, output_type="pt", return_type="pt")
    assert good_answer.shape == (1, 3, 9, 32, 48)
    assert requests.get(url(tiny_http, "/health"), timeout=10).status_code == 200


def test_a_whole_pt_answer_over_its_bound_is_413_before_the_body_is_read(
        tiny_http: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw pt is assembled whole before it is sent, so its size (not the body's) is bounded, from
    the head: 1 MiB of float32 latents [1, 4, 1024, 8, 8] decode to 4093 frames of 64x64, a
    201 MB answer on this CPU server, refused under a 100 MiB bound without reading the body."""
    monkeypatch.setattr(http_front, "MAX_WHOLE_ANSWER_BYTES", 100 << 20)
    before = tiny_http.server.front.bodies_read
    shape = (1, 4, 1024, 8, 8)
    status, error = raw_request(tiny_http.server.http_port, _head(shape, 4 * 1024 * 64 * 4).replace(
        "do_scaling=true", "do_scaling=false"))
    answer = 3 * 4093 * 64 * 64 * 4
    assert status == 413 and f"the answer would be {answer} bytes" in error["error"], error
    assert f"holds at most {100 << 20} bytes" in error["error"] and "ask partial_postprocess=true" in error["error"]
    # a batch: the streamed answers take one video a call, so that is what the answer says
    status, error = raw_request(tiny_http.server.http_port, _head((2, 4, 512, 8, 8), 4 * 2 * 512 * 64 * 4).replace(
        "do_scaling=true", "do_scaling=false"))
    assert status == 413 and "decode one video per call" in error["error"], error
    assert "ask partial_postprocess" not in error["error"]
    assert tiny_http.server.front.bodies_read == before
    small = latents("random:wan2.1-tiny", t=3, h=4, w=6)
    assert remote_decode(endpoint=url(tiny_http), tensor=small, output_type="pt", return_type="pt").shape == (
        1, 3, 9, 32, 48)  # under the bound: answered


def test_an_unknown_or_repeated_parameter_is_refused_and_diffusers_are_taken(tiny_http: RunningServer) -> None:
    """A misspelt parameter (do_scalling=true) would decode raw latents in wrong colours if ignored, and
    of two values of one either could be meant: both are 400 naming it, before the body is read; what
    diffusers' remote_decode sends, all of it, is taken."""
    x = latents("random:wan2.1-tiny")
    sent = prepare_decode(x, output_type="pt")
    front = tiny_http.server.front
    before = front.bodies_read
    answer = _post(tiny_http, {**sent["params"], "do_scalling": "true"}, sent["data"])
    _assert_json_error(answer, 400, r"unknown query parameter 'do_scalling'; this route takes .*\bdo_scaling\b")
    assert "allow_non_finite" in answer.json()["error"]  # the list of what is taken
    repeated = requests.post(url(tiny_http, "/decode") + "?output_type=mp4", params=sent["params"], data=sent["data"],
                             timeout=60)  # output_type given twice: pt and mp4
    _assert_json_error(repeated, 400, "query parameter 'output_type' is given 2 times; give it once")
    assert front.bodies_read == before
    # every parameter prepare_decode sends: image_format, output_type, partial_postprocess, shape, dtype,
    # do_scaling, height and width
    frames = remote_decode(endpoint=url(tiny_http), tensor=x, output_type="pt", partial_postprocess=True,
                           return_type="pt", image_format="png", height=32, width=48)
    assert frames.shape == (9, 32, 48, 3)


def test_fps_0_is_refused_as_any_fps_out_of_range(tiny_http: RunningServer) -> None:
    """An absent fps is the model's; fps=0 is refused as fps=-1 is, not taken for the default."""
    sent = prepare_decode(latents("random:wan2.1-tiny", t=2), output_type="mp4")
    for fps in ("0", "-1"):
        answer = _post(tiny_http, {**sent["params"], "fps": fps}, sent["data"])
        _assert_json_error(answer, 400, f"fps must be in 1..240, got {fps}")
    assert _post(tiny_http, sent["params"], sent["data"]).status_code == 200


def test_a_jpeg_over_jpegs_side_is_refused_from_the_head(tiny_http: RunningServer) -> None:
    """JPEG takes at most 65500 px a side: latents [1, 4, 1, 1, 8200] decode to 8x65600, refused with
    400 before the body is read (not a 500 once PIL fails to write it); PNG takes that size."""
    x = latents("random:wan2.1-tiny", t=1, h=1, w=8200)
    front = tiny_http.server.front
    before = front.bodies_read
    with pytest.raises(RuntimeError, match="decode to an image of 8x65600 px, and a JPEG image is at most 65500 px"):
        remote_decode(endpoint=url(tiny_http), tensor=x, output_type="pil", image_format="jpg")
    assert front.bodies_read == before
    png = remote_decode(endpoint=url(tiny_http), tensor=x, output_type="pil", image_format="png")
    assert png.size == (65600, 8)


@pytest.mark.parametrize("answer", ["pt-partial", "pil-processor", "mp4-stream"])
def test_nan_in_a_later_latent_frame_is_a_400_before_a_streamed_answer_begins(
        tiny_http: RunningServer, answer: str) -> None:
    """A streamed answer's status goes out with its first frames, and the core checks each latent
    frame as it decodes it: the front checks them all before, so NaN in latent frame 3 is a 400 with
    the core's message (diffusers raises it as RuntimeError), not a body cut short. allow_non_finite
    decodes them, as gRPC's option does."""
    x = latents("random:wan2.1-tiny", t=4, h=8, w=8, seed=11)
    x[:, :, 3] = float("nan")
    message = "latent frame 3 holds NaN or Inf values"
    if answer == "pt-partial":
        with pytest.raises(RuntimeError, match=message):
            remote_decode(endpoint=url(tiny_http), tensor=x, output_type="pt", partial_postprocess=True,
                          return_type="pt")
        sent = prepare_decode(x, output_type="pt", partial_postprocess=True)
    elif answer == "pil-processor":
        with pytest.raises(RuntimeError, match=message):
            remote_decode(endpoint=url(tiny_http), tensor=x, output_type="pil", processor=VideoProcessor())
        sent = prepare_decode(x, output_type="pil", processor=VideoProcessor())
    else:
        sent = prepare_decode(x, output_type="mp4")
        sent["params"]["stream"] = "true"
        _assert_json_error(_post(tiny_http, sent["params"], sent["data"]), 400, message)
    allowed = requests.post(url(tiny_http), data=sent["data"], headers=sent["headers"],
                            params={**sent["params"], "allow_non_finite": "true"}, timeout=60)
    assert allowed.status_code == 200, allowed.text
    assert len(allowed.content) == int(allowed.headers.get("Content-Length", len(allowed.content))) > 0


def test_a_whole_mp4_over_the_answer_bound_is_413_and_stream_is_not_bound(
        tiny_http: RunningServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A whole mp4 is held before it is sent, to raw pt's bound (MAX_WHOLE_ANSWER_BYTES, 1000 bytes
    here): past it, 413 telling the client to stream, and the call is logged as the refusal it is
    (not as one its client cancelled); stream=true holds no answer and is served."""
    monkeypatch.setattr(http_front, "MAX_WHOLE_ANSWER_BYTES", 1000)
    sent = prepare_decode(latents("random:wan2.1-tiny", t=3, h=8, w=8, seed=12), output_type="mp4")
    with caplog.at_level(logging.INFO, logger="vaed.service"):
        _assert_json_error(_post(tiny_http, sent["params"], sent["data"], **{"X-Request-Id": "mp4-past-bound"}),
                           413, "the MP4 passed 1000 bytes.*holds at most 1000 bytes.*ask stream=true")
    assert re.search(r"Decode id=mp4-past-bound status=INVALID_ARGUMENT ", caplog.text), caplog.text
    streamed = _post(tiny_http, {**sent["params"], "stream": "true"}, sent["data"])
    assert streamed.status_code == 200 and len(streamed.content) > 1000
    assert requests.get(url(tiny_http, "/health"), timeout=10).status_code == 200


def test_a_streamed_mp4_over_http_1_0_runs_to_the_close(tiny_http: RunningServer) -> None:
    """HTTP/1.0 has no chunked transfer (nginx's proxy_http_version defaults to it): stream=true
    answers it with the same bytes as HTTP/1.1's chunks, the body ending at the server's close
    (it was a 500 from aiohttp's refusal to chunk, after the call had started)."""
    sent = prepare_decode(latents("random:wan2.1-tiny", t=3, h=8, w=8, seed=13), output_type="mp4")
    params = {**sent["params"], "stream": "true"}
    want = _post(tiny_http, params, sent["data"])
    assert want.status_code == 200 and want.headers.get("Transfer-Encoding") == "chunked"
    query = urllib.parse.urlencode(params, doseq=True)
    body = bytes(sent["data"])
    head = f"POST /decode?{query} HTTP/1.0\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", tiny_http.server.http_port), timeout=60) as s:
        s.sendall(head.encode() + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    answer_head, _, content = answer.partition(b"\r\n\r\n")
    lines = answer_head.decode().split("\r\n")
    assert lines[0].startswith("HTTP/1.0 200"), answer_head
    assert not any(line.lower().startswith(("transfer-encoding", "content-length")) for line in lines), lines
    assert content == want.content


def test_every_error_is_json_with_its_status_and_headers(tiny_http: RunningServer) -> None:
    """aiohttp's own answers (404, 405 with Allow, 417 for an unknown Expect, 400 for a head it cannot
    parse) are JSON as the front's are, so remote_decode raises them as RuntimeError."""
    port = tiny_http.server.http_port
    missing = requests.get(url(tiny_http, "/nothing-here"), timeout=10)
    _assert_json_error(missing, 404, "Not Found")
    wrong_method = requests.get(url(tiny_http, "/decode"), timeout=10)
    _assert_json_error(wrong_method, 405, "Method Not Allowed")
    assert wrong_method.headers["Allow"] == "POST"
    status, error = raw_request(port, _head((1, 4, 3, 4, 6), 1152, "Expect: something-else"))
    assert status == 417 and error == {"error": "unknown Expect: something-else"}
    status, error = raw_request(port, "GARBAGE\r\n")
    assert status == 400 and set(error) == {"error"} and error["error"], error
    with pytest.raises(RuntimeError, match="Not Found"):
        remote_decode(endpoint=url(tiny_http, "/nothing-here"), tensor=latents("random:wan2.1-tiny"), output_type="pt",
                      return_type="pt")


def test_the_request_id_comes_back_on_every_answer(tiny_http: RunningServer) -> None:
    """X-Request-Id is echoed on success, on a refusal from the head, on the core's own failure (NaN
    latents), and on a streamed answer; an id the server refuses is not echoed."""
    x = latents("random:wan2.1-tiny")
    sent = prepare_decode(x, output_type="pt")
    nan = x.clone()
    nan[0, 0, 1] = float("nan")
    rid = {"X-Request-Id": "trace-42"}
    ok = _post(tiny_http, sent["params"], sent["data"], **rid)
    head_refused = _post(tiny_http, {**sent["params"], "dtype": "float64"}, sent["data"], **rid)
    core_refused = _post(tiny_http, sent["params"], prepare_decode(nan, output_type="pt")["data"], **rid)
    streamed = _post(tiny_http, {**sent["params"], "partial_postprocess": "true"}, sent["data"], **rid)
    _assert_json_error(head_refused, 400, "dtype 'float64' is not a latent dtype")
    _assert_json_error(core_refused, 400, "NaN or Inf")
    for answer in (ok, head_refused, core_refused, streamed):
        assert answer.headers.get("X-Request-Id") == "trace-42", (answer.status_code, answer.headers)
    bad = _post(tiny_http, sent["params"], sent["data"], **{"X-Request-Id": "x" * 200})
    _assert_json_error(bad, 400, "request_id must be at most 128 printable ASCII characters")
    assert "X-Request-Id" not in bad.headers
    # aiohttp's own answers too: a wrong path, a wrong method, an unknown Expect; and /health
    for answer in (requests.get(url(tiny_http, "/nothing-here"), headers=rid, timeout=10),
                   requests.get(url(tiny_http, "/decode"), headers=rid, timeout=10),
                   requests.get(url(tiny_http, "/health"), headers=rid, timeout=10)):
        assert answer.headers.get("X-Request-Id") == "trace-42", (answer.status_code, answer.headers)
    with socket.create_connection(("127.0.0.1", tiny_http.server.http_port), timeout=30) as s:
        s.sendall((_head((1, 4, 3, 4, 6), 1152, "Expect: something-else", "X-Request-Id: trace-42") + "\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head and (chunk := s.recv(65536)):
            head += chunk
    assert head.startswith(b"HTTP/1.1 417") and b"\r\nX-Request-Id: trace-42\r\n" in head, head


# -- auth and admission: refused before the body is read ----------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    config = make_config("random:wan2.1-tiny", http_port=0, auth_token_file=str(token_file), max_sessions=1,
                         session_first_message_timeout=30.0)
    with serve_in_thread(config) as running:
        yield running


def _head(shape: tuple[int, ...], length: int, *headers: str, query: str = "output_type=pt&do_scaling=true") -> str:
    dims = "&".join(f"shape={d}" for d in shape)
    return "".join(f"{line}\r\n" for line in (
        f"POST /?{dims}&dtype=float32&{query} HTTP/1.1", "Host: x", f"Content-Length: {length}", *headers))


def test_no_or_a_wrong_token_is_401_before_the_body_is_read(guarded: RunningServer) -> None:
    x = latents("random:wan2.1-tiny")
    front = guarded.server.front
    before = front.bodies_read
    port = guarded.server.http_port
    for headers, pattern in [((), "missing credentials"), (("Authorization: Bearer wrong",), "invalid bearer token"),
                             (("Authorization: Basic " + TOKEN,), "malformed Authorization header")]:
        # headers only: the body never comes, and the answer does not wait for it
        status, error = raw_request(port, _head(tuple(x.shape), x.numel() * 4, *headers))
        assert status == 401 and re.search(pattern, error["error"]), error
        # Expect: 100-continue: the refusal is the first answer (no 100 Continue before it)
        status, error = raw_request(port, _head(tuple(x.shape), x.numel() * 4, *headers, "Expect: 100-continue"))
        assert status == 401 and re.search(pattern, error["error"]), error
    assert front.bodies_read == before
    with pytest.raises(RuntimeError, match="missing credentials"):
        remote_decode(endpoint=url(guarded), tensor=x, output_type="pt", return_type="pt")  # diffusers sends no token
    assert front.bodies_read == before
    sent = prepare_decode(x, output_type="pt")
    ok = requests.post(url(guarded), data=sent["data"], params=sent["params"],
                       headers={**sent["headers"], "Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert ok.status_code == 200 and json.loads(ok.headers["shape"]) == [1, 3, 9, 32, 48]
    assert front.bodies_read == before + 1
    # an admitted client that waits for 100 Continue gets it, sends its body, gets its answer
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((_head(tuple(x.shape), x.numel() * 4, f"Authorization: Bearer {TOKEN}",
                         "Expect: 100-continue") + "\r\n").encode())
        assert s.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(sent["data"])
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(ok.content)
    assert requests.get(url(guarded, "/health"), timeout=10).status_code == 200  # health needs no token


def test_a_full_server_answers_429_and_a_draining_one_503_before_the_body_is_read(guarded: RunningServer) -> None:
    """max_sessions=1: a request whose body has not come yet holds the one slot; the next is
    refused from its head; draining refuses too, and /health says so."""
    x = latents("random:wan2.1-tiny")
    front = guarded.server.front
    port = guarded.server.http_port
    auth = f"Authorization: Bearer {TOKEN}"
    with _holding_the_slot(guarded, x, auth) as bodies_read:
        status, error = raw_request(port, _head(tuple(x.shape), x.numel() * 4, auth, "Expect: 100-continue"))
        assert status == 429 and "sessions are in use" in error["error"], error  # no 100 Continue first
        assert front.bodies_read == bodies_read  # the refused request's body was never read
    guarded.server.lifecycle.draining = True
    try:
        status, error = raw_request(port, _head(tuple(x.shape), x.numel() * 4, auth))
        assert status == 503 and "draining" in error["error"]
        health = requests.get(url(guarded, "/health"), timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "NOT_SERVING"
    finally:
        guarded.server.lifecycle.draining = False
    assert requests.get(url(guarded, "/health"), timeout=10).status_code == 200


def test_calls_refused_before_their_body_is_parsed_log_the_headers_request_id(
        tiny_http: RunningServer, guarded: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    """The log line names a call by its X-Request-Id (as gRPC's names its first message's) also
    when the call ends before its body is parsed: non-finite latents, a body that never comes,
    no free slot (each had been logged `id=-`, so an operator could not find the client's call)."""
    x = latents("random:wan2.1-tiny")
    nan = x.clone()
    nan[0, 0, 0, 0, 0] = float("nan")
    sent = prepare_decode(nan, output_type="pt")
    with caplog.at_level(logging.INFO, logger="vaed.service"):
        answer = requests.post(url(tiny_http, "/decode"), params=sent["params"], data=sent["data"],
                               headers={**sent["headers"], "X-Request-Id": "nan-body-1"}, timeout=60)
        assert answer.status_code == 400 and answer.headers["X-Request-Id"] == "nan-body-1"
        status, _ = raw_request(tiny_http.server.http_port, _head(tuple(x.shape), x.numel() * 4,
                                                                  "X-Request-Id: slow-body-1"))
        assert status == 504
        auth = f"Authorization: Bearer {TOKEN}"
        with _holding_the_slot(guarded, x, auth):
            status, _ = raw_request(guarded.server.http_port,
                                    _head(tuple(x.shape), x.numel() * 4, auth, "X-Request-Id: second"))
            assert status == 429
    for line in ("Decode id=nan-body-1 status=INVALID_ARGUMENT ", "Decode id=slow-body-1 status=DEADLINE_EXCEEDED ",
                 "Decode id=second status=RESOURCE_EXHAUSTED "):
        assert line in caplog.text, caplog.text


def test_what_the_query_says_is_refused_before_admission_and_the_body(guarded: RunningServer) -> None:
    """Every check the query can answer (the model's z_dim, --max-batch, --max-pixels,
    --max-latent-frames, height/width, the precisions offered, the request id) runs from the head:
    with the one session slot held, each such request gets its 400 as its first answer (no
    100 Continue, no 429), and no body is read."""
    x = latents("random:wan2.1-tiny")
    front = guarded.server.front
    port = guarded.server.http_port
    auth = f"Authorization: Bearer {TOKEN}"
    cases: list[tuple[tuple[int, ...], str, tuple[str, ...], str]] = [
        ((1, 5, 3, 4, 6), "", (), "latents have z_dim 5 but the served model has z_dim 4"),
        ((9, 4, 1, 4, 6), "", (), "batch 9 is over the server limit of 8"),
        ((1, 4, 1, 200, 200), "", (), r"1600x1600 \(2560000 pixels\) is over the server limit of 1638400 pixels"),
        ((1, 4, 1025, 1, 1), "", (), "1025 latent frames in this call are over the server limit of 1024"),
        ((1, 4, 3, 4, 6), "&height=33&width=48", (), "not the decoded size 32x48"),
        ((1, 4, 3, 4, 6), "&precision=fast", (), "precision fast is not offered"),
        ((1, 4, 3, 4, 6), "", ("X-Request-Id: " + "r" * 200,), "request_id must be at most 128"),
        # two ids: the log and the caller could name the call by different ones
        ((1, 4, 3, 4, 6), "", ("X-Request-Id: a", "X-Request-Id: b"), "X-Request-Id came 2 times; send it once"),
    ]
    with _holding_the_slot(guarded, x, auth) as bodies_read:
        for shape, extra, headers, pattern in cases:
            head = _head(shape, 4 * math.prod(shape), auth, "Expect: 100-continue", *headers,
                         query="output_type=pt&do_scaling=true" + extra)
            status, error = raw_request(port, head)
            assert status == 400 and re.search(pattern, error["error"]), (shape, extra, status, error)
        assert front.bodies_read == bodies_read  # the holder's only


@contextlib.contextmanager
def _holding_the_slot(guarded: RunningServer, x: torch.Tensor, auth: str) -> Iterator[int]:
    """A decode admitted to the guarded server's one session slot and waiting for its body; yields
    the bodies the front has read by then (its own included). On leaving, its body goes out and
    its answer must be a 200."""
    front = guarded.server.front
    holder = socket.create_connection(("127.0.0.1", guarded.server.http_port), timeout=30)
    try:
        before = front.bodies_read
        holder.sendall((_head(tuple(x.shape), x.numel() * 4, auth) + "\r\n").encode())
        _wait(lambda: guarded.server.pool.admitted == 1 and front.bodies_read == before + 1)
        yield before + 1
        holder.sendall(prepare_decode(x, output_type="pt")["data"])
        answer = b""
        while chunk := holder.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        holder.close()


def _wait(condition: Any, timeout: float = 30.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        done.wait(0.02)
    raise AssertionError("condition not met")


# -- streaming: fMP4 bytes reach the client while the call still decodes ---------------------------


def test_stream_sends_fragments_before_the_call_ends() -> None:
    """The server's decode of latent frame 2 is held until the client has read the init
    segment and frame 0's fragment: those bytes can only have come before the call ended.
    The concatenated stream is one valid MP4 with every frame."""
    config = make_config("random:wan2.1-tiny", http_port=0, warmup=False)
    release = threading.Event()

    def held_at_frame_2() -> None:
        assert release.wait(60), "the client never read the first fragments"

    build = engine_calling_at(config, 2, held_at_frame_2)

    x = latents("random:wan2.1-tiny", t=4, h=8, w=8, seed=7)
    sent = prepare_decode(x, output_type="mp4")
    with serve_in_thread(config, build_engine=build) as running:
        with requests.post(url(running), data=sent["data"], headers=sent["headers"],
                           params={**sent["params"], "stream": "true"}, stream=True, timeout=60) as response:
            assert response.status_code == 200 and response.headers["Transfer-Encoding"] == "chunked"
            early = b""
            chunks = response.iter_content(chunk_size=None)
            while b"moof" not in early or b"mdat" not in early:
                early += next(chunks)
            assert not release.is_set()  # latent frame 2 cannot have finished: the call is not over
            release.set()
            data = early + b"".join(chunks)
        frames, _ = frames_of_mp4(data)
        rgb8 = torch.as_tensor(grpc_decode(running, x))[0].numpy()
    assert data.startswith(early) and len(early) < len(data)
    assert np.array_equal(frames, frames_of_mp4(package(rgb8, VideoOptions(fps=16)))[0])


@pytest.mark.parametrize("output_type, partial", [("pt", True), ("pil", False)])
def test_frames_answers_stream_each_group_before_the_call_ends(output_type: str, partial: bool) -> None:
    """pt + partial_postprocess and pil + a processor: the decode of latent frame 2 is held until
    the client has read the headers (shape known from the latents) and frame 0's bytes; the
    whole body, under its Content-Length, is what remote_decode gets from a server that is not held."""
    config = make_config("random:wan2.1-tiny", http_port=0, warmup=False)
    release = threading.Event()

    def held_at_frame_2() -> None:
        assert release.wait(60), "the client never read the first frames"

    build = engine_calling_at(config, 2, held_at_frame_2)

    x = latents("random:wan2.1-tiny", t=4, h=8, w=8, seed=9)
    processor = None if partial else VideoProcessor()
    sent = prepare_decode(x, output_type=output_type, partial_postprocess=partial, processor=processor)
    with serve_in_thread(config, build_engine=build) as running:
        with requests.post(url(running), data=sent["data"], headers=sent["headers"], params=sent["params"],
                           stream=True, timeout=60) as response:
            assert response.status_code == 200, response.text
            shape = json.loads(response.headers["shape"])
            frame_bytes = 64 * 64 * 3 * (1 if partial else 4)
            assert shape == ([13, 64, 64, 3] if partial else [13, 3, 64, 64])
            assert int(response.headers["Content-Length"]) == 13 * frame_bytes
            # not chunk_size=None: on a body of known length urllib3 then reads to its end
            chunks = response.iter_content(chunk_size=frame_bytes)
            early = b""
            while len(early) < frame_bytes:
                early += next(chunks)
            assert not release.is_set()  # latent frame 2 cannot have finished: the call is not over
            release.set()
            data = early + b"".join(chunks)
        # what the gRPC path gives for the same latents, post-processed by diffusers' own processor
        expected = (torch.as_tensor(grpc_decode(running, x))[0] if partial else
                    VideoProcessor().postprocess_video(torch.as_tensor(grpc_decode(running, x, output_type="raw")),
                                                       output_type="pt")[0])
    streamed = torch.frombuffer(bytearray(data), dtype=torch.uint8 if partial else torch.float32).reshape(shape)
    assert torch.equal(streamed, expected)


END_HELD_S = 3.0  # how long the test's server holds a call's end for a client that closes early


def test_a_streamed_answer_ends_after_its_call_so_a_client_that_closes_at_once_is_not_cancelled(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A client of a Content-Length answer may close as soon as it has every byte. The server
    holds each call's end (the worker's last step of it) until the client has closed, or for
    END_HELD_S: the answer's last bytes must not reach the client before then, and the call
    is logged OK with the bytes gRPC gives. (The last piece used to go out before the end, and
    the client's close then cancelled a delivered answer.)"""
    from vaed import session as session_module

    client_done = threading.Event()
    done_while_held: list[bool] = []
    finish = session_module.Session.finish

    def held_finish(self: Any) -> None:
        done_while_held.append(client_done.wait(END_HELD_S))
        finish(self)

    monkeypatch.setattr(session_module.Session, "finish", held_finish)
    config = make_config("random:wan2.1-tiny", http_port=0, warmup=False)
    x = latents("random:wan2.1-tiny", t=3, h=8, w=8, seed=11)
    sent = prepare_decode(x, output_type="pt", partial_postprocess=True)
    with serve_in_thread(config) as running, caplog.at_level(logging.INFO, logger="vaed.service"):
        with requests.post(url(running), data=sent["data"], params=sent["params"],
                           headers={"X-Request-Id": "closes-at-once"}, stream=True, timeout=60) as response:
            assert response.status_code == 200, response.text
            length = int(response.headers["Content-Length"])
            data = response.raw.read(length)  # every byte, then the connection closes
        client_done.set()
        _wait(lambda: "id=closes-at-once status=" in caplog.text)
        expected = torch.as_tensor(grpc_decode(running, x))[0]
    assert done_while_held == [False, True]  # this call's end, then the gRPC call's (client_done set)
    assert re.search(r"Decode id=closes-at-once status=OK ", caplog.text), caplog.text
    assert len(data) == length and torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(
        expected.shape), expected)


def test_a_failure_after_the_first_frames_cuts_the_streamed_body_short(caplog: pytest.LogCaptureFixture) -> None:
    """A streamed answer's status went out with its first bytes: a failure at latent frame 2 (after
    the client read frame 0) ends the body before its Content-Length, so the client's read fails
    instead of taking a short answer as whole; the server goes on serving."""
    config = make_config("random:wan2.1-tiny", http_port=0, warmup=False)
    read_first = threading.Event()

    def fails_at_frame_2() -> None:
        assert read_first.wait(60), "the client never read frame 0"
        raise CapacityExhausted("injected: no memory for latent frame 2")

    build = engine_calling_at(config, 2, fails_at_frame_2)

    x = latents("random:wan2.1-tiny", t=4, h=8, w=8, seed=10)
    sent = prepare_decode(x, output_type="pt", partial_postprocess=True)
    frame_bytes = 64 * 64 * 3
    with serve_in_thread(config, build_engine=build) as running:
        with requests.post(url(running), data=sent["data"], headers=sent["headers"], params=sent["params"],
                           stream=True, timeout=60) as response:
            assert response.status_code == 200 and int(response.headers["Content-Length"]) == 13 * frame_bytes
            chunks = response.iter_content(chunk_size=frame_bytes)
            assert len(next(chunks)) == frame_bytes
            read_first.set()
            with pytest.raises(requests.exceptions.ChunkedEncodingError, match="IncompleteRead"):
                for _ in chunks:
                    pass
        assert "HTTP answer cut after its status was sent: injected: no memory" in caplog.text
        assert requests.get(url(running, "/health"), timeout=10).status_code == 200


@pytest.mark.cuda
@pytest.mark.parametrize("h, w", [(60, 104), (90, 160)])  # 480x832 and 720x1280
def test_pt_answers_from_a_gpu_server(h: int, w: int) -> None:
    """On CUDA a group's frames are in pinned host memory, reused once its credit returns: the
    streamed RGB8 frames (copied per piece) and the whole raw pt (assembled in pageable memory)
    equal gRPC's frames of the same latents, 21 latent frames (81 frames)."""
    config = make_config("random:wan2.1", device="cuda:0", warmup=False, http_port=0)
    x = torch.randn(1, 16, 21, h, w, generator=torch.Generator().manual_seed(2))
    with serve_in_thread(config) as running:
        frames = remote_decode(endpoint=url(running), tensor=x, output_type="pt", partial_postprocess=True,
                               return_type="pt")
        assert torch.equal(frames, torch.as_tensor(grpc_decode(running, x))[0])
        del frames
        raw = remote_decode(endpoint=url(running), tensor=x, output_type="pt", return_type="pt")
        assert raw.shape == (1, 3, 81, 8 * h, 8 * w)
        assert torch.equal(raw, torch.as_tensor(grpc_decode(running, x, output_type="raw")))


# -- where the front listens ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_same_port_as_metrics_shares_its_listener() -> None:
    """--http-port = --metrics-port: one listener answers /metrics, /health and the protocol;
    HTTP decodes are counted as Decode calls."""
    port = _free_port()
    with serve_in_thread(make_config("random:wan2.1-tiny", http_port=port, metrics_port=port)) as running:
        assert running.server.front_http is running.server.http and running.server.http_port == port
        x = latents("random:wan2.1-tiny")
        remote_decode(endpoint=url(running), tensor=x, output_type="pt", return_type="pt")
        requests.post(url(running), params={"dtype": "float32"}, data=b"", timeout=10)  # 400: no shape
        scrape = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'vaed_requests_total{code="OK",method="Decode"} 1.0' in scrape
        assert 'vaed_requests_total{code="INVALID_ARGUMENT",method="Decode"} 1.0' in scrape
        assert requests.get(url(running, "/health"), timeout=10).status_code == 200


def test_vaed_serve_http_port_serves_remote_decode_mp4() -> None:
    """The flag end to end: a `vaed serve` subprocess with --http-port (its own listener beside
    --metrics-port) answers remote_decode's mp4 and /health."""
    http_port, metrics_port = _free_port(), _free_port()
    proc, _ = start_cli_server("--http-port", str(http_port), "--metrics-port", str(metrics_port))
    try:
        endpoint = f"http://127.0.0.1:{http_port}/"
        assert requests.get(endpoint + "health", timeout=10).json() == {"status": "SERVING"}
        mp4 = remote_decode(endpoint=endpoint, tensor=latents("random:wan2.1-tiny", t=2), output_type="mp4",
                            return_type="mp4")
        frames, rate = frames_of_mp4(mp4)
        assert frames.shape == (5, 32, 48, 3) and rate == 16
        assert requests.get(f"http://127.0.0.1:{metrics_port}/health", timeout=10).status_code == 404
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_client_that_leaves_frees_its_session_before_the_decode_would_end() -> None:
    """The server's decode is held at latent frame 1; the client sends its whole body and closes
    the connection; the call is cancelled and its slot freed while the decode is still held."""
    config = make_config("random:wan2.1-tiny", http_port=0, warmup=False)
    release = threading.Event()
    reached = threading.Event()

    def held_at_frame_1() -> None:
        reached.set()
        release.wait(60)

    build = engine_calling_at(config, 1, held_at_frame_1)

    x = latents("random:wan2.1-tiny", t=3, seed=8)
    with serve_in_thread(config, build_engine=build) as running:
        port = running.server.http_port
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            client.sendall((_head(tuple(x.shape), x.numel() * 4) + "\r\n").encode()
                           + prepare_decode(x, output_type="pt")["data"])
            assert reached.wait(60)
            assert running.server.pool.admitted == 1
        finally:
            client.close()
        try:
            _wait(lambda: running.server.pool.admitted == 0)
            assert not release.is_set()  # freed while latent frame 1 was still held
        finally:
            release.set()
        assert requests.get(url(running, "/health"), timeout=10).status_code == 200


def test_a_compressed_body_is_415_before_it_is_read(tiny_http: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    """Bodies are read into a buffer of exactly Content-Length bytes: one in a content coding, valid
    gzip or not (a broken one was a 500 from aiohttp's decoder, and its traceback logged), is
    refused from the head, on the decode route and the .pt converter, with nothing logged at
    ERROR, and the server serves on."""
    x = latents("random:wan2.1-tiny")
    sent = prepare_decode(x, output_type="pt")
    front = tiny_http.server.front
    before = front.bodies_read
    for coding, body in (("gzip", gzip.compress(sent["data"])), ("gzip", b"A" * 64), ("deflate", b"A" * 64),
                         ("br", b"A" * 64)):
        answer = _post(tiny_http, sent["params"], body, **{"Content-Encoding": coding})
        _assert_json_error(answer, 415, f"Content-Encoding '{coding}' is not supported")
        converted = requests.post(url(tiny_http, "/v1/convert/pt"), data=body,
                                  headers={"Content-Encoding": coding}, timeout=30)
        _assert_json_error(converted, 415, f"Content-Encoding '{coding}' is not supported")
    assert front.bodies_read == before
    assert _post(tiny_http, sent["params"], sent["data"], **{"Content-Encoding": "identity"}).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
