"""POST /encode through diffusers' own `remote_encode` against in-process servers of the tiny
Wan2.1 and Wan2.2 models (`--encode --http-port`): a PIL image, an image tensor and a video tensor
give the gRPC Encode's bits (the posterior's mode; with vaed's do_scaling=true the normalised
latents) and stock AutoencoderKLWan's; the bad-input matrix answers 400 and the server keeps serving."""

from __future__ import annotations

import io
import json
import re
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.remote_utils import prepare_encode, remote_encode
from PIL import Image

from harness import RunningServer, make_config, serve_in_thread
from vaed.models import build_random_vae
from vaed_client import VaeClient

H, W = 64, 96  # every model's spatial factor divides it (Wan2.1 8x, Wan2.2 16x)


@pytest.fixture(scope="module", params=["wan2.1-tiny", "wan2.2-tiny"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[RunningServer, Any]]:
    config = make_config(f"random:{request.param}", http_port=0, encode=True, max_pixels=H * W * 4)
    with serve_in_thread(config) as running:
        yield running, build_random_vae(request.param).eval().requires_grad_(False)


def endpoint(running: RunningServer) -> str:
    return f"http://127.0.0.1:{running.server.http_port}/encode"


def picture(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (H, W, 3), dtype=np.uint8))


def grpc_encode(running: RunningServer, frames: Any, **kwargs: Any) -> Any:
    with VaeClient(running.target, timeout=120) as client:
        return client.encode(frames, **kwargs)


@torch.no_grad()
def stock_mode(stock: Any, video: torch.Tensor) -> torch.Tensor:
    return stock.encode(video).latent_dist.mode()


def test_a_pil_image_is_the_grpc_encodes_mode(served: tuple[RunningServer, Any]) -> None:
    """remote_encode(endpoint, image=PIL): sent as PNG, answered [1, z, h, w] (remote_encode's
    rank for an image), equal to the gRPC encode of its uint8 pixels and to stock's encode of
    diffusers' own preprocessing of the image."""
    running, stock = served
    image = picture()
    got = remote_encode(endpoint=endpoint(running), image=image)
    z, s = stock.config.z_dim, 2 ** len(stock.temperal_downsample) * (stock.config.patch_size or 1)
    assert got.shape == (1, z, H // s, W // s) and got.dtype == torch.float32
    moments = grpc_encode(running, torch.from_numpy(np.asarray(image).copy())[None, None])  # uint8 [1, 1, H, W, 3]
    assert torch.equal(got, moments[:, :z, 0])
    pixels = VaeImageProcessor().preprocess(image)  # [1, 3, H, W] in [-1, 1], as a pipeline makes it
    assert torch.equal(got, stock_mode(stock, pixels[:, :, None])[:, :, 0])


def test_tensors_image_and_video(served: tuple[RunningServer, Any]) -> None:
    """A float image tensor [B, 3, H, W] and a video [B, 3, T, H, W] (T = 1 + 4k) in [-1, 1]."""
    running, stock = served
    z = stock.config.z_dim
    g = torch.Generator().manual_seed(1)
    image = torch.rand(2, 3, H, W, generator=g) * 2 - 1
    got = remote_encode(endpoint=endpoint(running), image=image)
    assert torch.equal(got, grpc_encode(running, image[:, :, None])[:, :z, 0])
    video = torch.rand(1, 3, 5, H, W, generator=g) * 2 - 1
    got = remote_encode(endpoint=endpoint(running), image=video)
    assert got.shape[2] == 2 and torch.equal(got, grpc_encode(running, video)[:, :z])
    assert torch.equal(got, stock_mode(stock, video))


def test_do_scaling_gives_the_normalised_latents(served: tuple[RunningServer, Any]) -> None:
    """vaed's do_scaling=true: (mode - latents_mean) / latents_std, the gRPC encode's latents."""
    running, stock = served
    video = torch.rand(1, 3, 5, H, W, generator=torch.Generator().manual_seed(2)) * 2 - 1
    sent = prepare_encode(image=video)
    answer = requests.post(endpoint(running), data=sent["data"], params={**sent["params"], "do_scaling": "true"},
                           timeout=120)
    assert answer.status_code == 200, answer.text
    got = torch.frombuffer(bytearray(answer.content), dtype=torch.float32).reshape(json.loads(answer.headers["shape"]))
    want = grpc_encode(running, video, output_type="latents")
    assert torch.equal(got, want)
    z = stock.config.z_dim
    mean = torch.tensor(stock.config.latents_mean).view(1, z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(stock.config.latents_std).view(1, z, 1, 1, 1)
    assert torch.equal(got, (stock_mode(stock, video) - mean) * inv_std)


def _error(answer: requests.Response, status: int, pattern: str) -> None:
    assert answer.status_code == status, (pattern, answer.headers)
    body = answer.json()
    assert set(body) == {"error"} and re.search(pattern, body["error"]), body


def _malformed_images() -> list[bytes]:
    """Image files broken in ways PIL's plugins report by other exceptions than OSError."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(out, "PNG")
    png = out.getvalue()
    broken_chunk = bytearray(png)
    broken_chunk[36] = 0x10  # the IDAT chunk's length: SyntaxError "broken PNG file"
    short_header = png[:8] + b"\0\0\0\x05IHDR\0\0\0\x40\0" + b"\0" * 4  # a 5-byte IHDR: ValueError
    bad_maxval = b"P6\n16 16\nJ55\n" + bytes(16 * 16 * 3)  # ValueError from int()
    return [bytes(broken_chunk), short_header, bad_maxval]


def test_the_bad_input_matrix(served: tuple[RunningServer, Any]) -> None:
    running, _ = served
    url = endpoint(running)
    good = torch.rand(1, 3, H, W) * 2 - 1
    sent = prepare_encode(image=good)
    params, body = sent["params"], sent["data"]
    nan = good.clone()
    nan[0, 1, 3, 4] = float("nan")
    cases: list[tuple[dict[str, Any], bytes, str]] = [
        ({**params, "scaling_factor": 0.3611}, body, "scaling_factor is not used by Wan"),
        ({**params, "shift_factor": 0.1159}, body, "shift_factor is not used by Wan"),
        (params, body[:-4], r"frames of shape \[1, 3, 64, 96\] in float32 are 73728"),
        ({**params, "dtype": "float64"}, body, "dtype 'float64' is not a frame dtype"),
        ({"shape": params["shape"]}, body, "dtype is required"),
        ({"dtype": "float32"}, body, "dtype without shape"),
        ({**params, "shape": [3, H, W]}, body, "4 or 5 positive sizes"),
        ({**params, "shape": [1, 3, 2, H // 2, W]}, body, "1 \\+ 4k"),
        ({**params, "shape": [1, 4, H, W * 3 // 4]}, body, "channels"),
        ({**params, "shape": [1, 3, H, W // 2], "dtype": "float64"}, body, "float64"),
        ({**params, "shape": [1, 3, 128, 256]}, b"\0" * (128 * 256 * 12), "over the server limit of 24576 pixels"),
        ({**params, "shape": [1, 3, 12, 12]}, body[: 12 * 12 * 12], "not a multiple"),
        (params, prepare_encode(image=nan)["data"], "NaN or Inf"),
        ({}, b"not an image at all", "not an image file"),
        ({**params, "do_scaling": "maybe"}, body, "do_scaling must be true or false"),
        ({**params, "precision": "fast"}, body, "precision"),
    ]
    for case_params, data, pattern in cases:
        _error(requests.post(url, params=case_params, data=data, timeout=60), 400, pattern)
    for malformed in _malformed_images():
        _error(requests.post(url, data=malformed, timeout=60), 400, "not an image file this server reads")
    big = Image.new("RGB", (W * 4, H * 2))  # 8x the pixels of H x W: over max_pixels from its header
    big_png = prepare_encode(image=big)["data"]
    _error(requests.post(url, data=big_png, timeout=60), 400, "over the server limit of 24576 pixels")
    assert remote_encode(endpoint=url, image=good).shape[0] == 1  # still serving


def test_what_the_query_says_is_refused_before_the_body_is_read(served: tuple[RunningServer, Any]) -> None:
    """The core's checks of an Encode's first message (the request id, the precision, the frames
    against the model and the limits) and the encoder's frame count, run from the query: refused
    with 400 before the body is read. An image's shape is named as it was sent ([B, H, W, 3] uint8),
    not as the 5-D video the server makes of it."""
    running, _ = served
    url = endpoint(running)
    front = running.server.front
    assert front is not None
    good = torch.rand(1, 3, H, W) * 2 - 1
    sent = prepare_encode(image=good)
    params, body = sent["params"], sent["data"]
    cases: list[tuple[dict[str, Any], bytes, dict[str, str], str]] = [
        ({**params, "precision": "fast"}, body, {}, "precision fast is not offered for Encode"),
        ({**params, "shape": [1, 3, 32, 48], "dtype": "uint8"}, b"\0" * (3 * 32 * 48), {},
         r"frames have 48 channels; send RGB, .*; got \[1, 3, 32, 48\]$"),
        ({**params, "shape": [1, 3, 128, 256]}, b"\0" * (128 * 256 * 12), {}, "over the server limit of 24576 pixels"),
        ({**params, "shape": [1, 3, 12, 12]}, body[: 12 * 12 * 12], {}, "not a multiple"),
        ({**params, "shape": [1, 3, 2, H // 2, W]}, body, {}, "1 \\+ 4k"),
        ({**params, "shape": [9, 3, H // 4, W // 2]}, b"\0" * (9 * 3 * H * W // 2), {},
         "batch 9 is over the server limit of 8"),
        (params, body, {"X-Request-Id": "\u00e9t\u00e9"}, "request_id must be at most 128 printable ASCII"),
        ({**params, "do_scalling": "true"}, body, {}, r"unknown query parameter 'do_scalling'; .*\bdo_scaling\b"),
        ({**params, "dtype": ["float32", "float32"]}, body, {}, "query parameter 'dtype' is given 2 times"),
    ]
    before = front.bodies_read
    for case_params, data, headers, pattern in cases:
        answer = requests.post(url, params=case_params, data=data, headers=headers, timeout=60)
        _error(answer, 400, pattern)
        assert "[1, 1, 3, 32, 48]" not in answer.json()["error"]
    assert front.bodies_read == before


def test_a_body_over_the_message_limit_gets_a_way_out_that_keeps_the_video_whole(
        served: tuple[RunningServer, Any]) -> None:
    """413 from the head, before the body: its advice was to encode the video in parts, which
    gives other latents (the encoder is causal); it now names a narrower dtype or gRPC's Encode."""
    import http.client

    running, _ = served
    port = running.server.http_port
    assert port is not None
    length = running.server.config.max_message_bytes + 1
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.putrequest("POST", f"/encode?shape=1&shape=3&shape=81&shape={H}&shape={W}&dtype=float32")
        connection.putheader("Content-Length", str(length))
        connection.endheaders()
        answer = connection.getresponse()
        error = json.loads(answer.read())["error"]
    finally:
        connection.close()
    assert answer.status == 413 and f"the body is {length} bytes" in error, error
    assert "send it as uint8 frames (a quarter of float32's bytes) or bfloat16, or encode it with gRPC's Encode" in error
    assert "in parts" not in error


def _png_head(width: int, height: int) -> bytes:
    """A PNG file of width x height RGB that stops before its pixels: the size is all its header says."""
    def chunk(kind: bytes, data: bytes = b"") -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT") + chunk(b"IEND"))


def test_an_image_file_refused_says_why_without_the_servers_internals(served: tuple[RunningServer, Any]) -> None:
    """A 15000x15000 PNG, which PIL refuses to open (over its decompression-bomb bound), is too large
    against the server's limit; a body that is no image says so without the repr of a buffer."""
    running, _ = served
    url = endpoint(running)
    huge = requests.post(url, data=_png_head(15000, 15000), timeout=60)
    _error(huge, 400, "the image is too large: over 178956970 pixels, and this server takes at most 24576 pixels")
    garbage = requests.post(url, data=b"not an image at all", timeout=60)
    _error(garbage, 400, r"^the body is not an image file this server reads \(PNG, JPEG, ...\)$")


def test_allow_non_finite_encodes_nan_frames_as_they_are(served: tuple[RunningServer, Any]) -> None:
    """allow_non_finite=true, as gRPC's option: NaN frames are encoded, their moments sent as they are."""
    running, _ = served
    frames = torch.rand(1, 3, H, W) * 2 - 1
    frames[0, 1, 3, 4] = float("nan")
    sent = prepare_encode(image=frames)
    _error(requests.post(endpoint(running), params=sent["params"], data=sent["data"], timeout=60), 400, "NaN or Inf")
    answer = requests.post(endpoint(running), params={**sent["params"], "allow_non_finite": "true"}, data=sent["data"],
                           timeout=120)
    assert answer.status_code == 200, answer.text
    got = torch.frombuffer(bytearray(answer.content), dtype=torch.float32).reshape(json.loads(answer.headers["shape"]))
    assert got.isnan().any()


def test_a_decode_only_server_says_it_does_not_encode() -> None:
    config = make_config("random:wan2.1-tiny", http_port=0)
    with serve_in_thread(config) as running:
        sent = prepare_encode(image=torch.zeros(1, 3, H, W))
        answer = requests.post(endpoint(running), params=sent["params"], data=sent["data"], timeout=60)
        _error(answer, 400, "--encode")
