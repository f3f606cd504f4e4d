"""vaed.yuv: RGB8 -> yuv420p planes, against a naive per-pixel reference, PyAV's own conversion
and (CUDA) the same function on the CPU."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch

from vaed.video import Fmp4Packager, VideoError, VideoOptions
from vaed.yuv import rgb8_to_yuv420p


def naive_yuv420p(image: np.ndarray) -> np.ndarray:
    """One RGB8 frame [H, W, 3] -> [3H/2, W], pixel by pixel and block by block in Python ints:
    BT.601 limited range in 8-bit coefficients, chroma from each 2x2 block's mean (the sum over
    4 * 256, rounded)."""
    h, w, _ = image.shape
    px = image.astype(int)
    y = np.empty((h, w), np.uint8)
    u = np.empty((h // 2, w // 2), np.uint8)
    v = np.empty((h // 2, w // 2), np.uint8)
    for i in range(h):
        for j in range(w):
            r, g, b = px[i, j]
            y[i, j] = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    for i in range(h // 2):
        for j in range(w // 2):
            r, g, b = px[2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(4, 3).sum(axis=0)
            u[i, j] = ((-38 * r - 74 * g + 112 * b + 512) >> 10) + 128
            v[i, j] = ((112 * r - 94 * g - 18 * b + 512) >> 10) + 128
    return np.concatenate([y.ravel(), u.ravel(), v.ravel()]).reshape(h * 3 // 2, w)


def _frames(*lead: int, h: int = 6, w: int = 10, seed: int = 0) -> torch.Tensor:
    frames = torch.randint(0, 256, (*lead, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    frames.view(-1, h, w, 3)[0, :2, :2] = torch.tensor([[0, 0, 0], [255, 255, 255]], dtype=torch.uint8)  # extremes
    return frames


@pytest.mark.parametrize("lead", [(), (3,), (1, 2)])
def test_the_planes_equal_the_naive_conversion(lead: tuple[int, ...]) -> None:
    frames = _frames(*lead)
    planes = rgb8_to_yuv420p(frames)
    assert planes.dtype == torch.uint8 and planes.shape == (*lead, 9, 10)
    flat_in, flat_out = frames.reshape(-1, 6, 10, 3).numpy(), planes.reshape(-1, 9, 10).numpy()
    for image, got in zip(flat_in, flat_out):
        assert np.array_equal(got, naive_yuv420p(image))


def test_the_planes_lie_as_pyav_reads_them() -> None:
    """On a smooth image (no chroma detail for the two downsamplings to differ on) PyAV's own
    rgb24 -> yuv420p gives the same planes within one level: the same coefficients, range and
    plane order; and PyAV takes the array as a yuv420p frame of the image's size."""
    y, x = np.mgrid[0:48, 0:64]
    image = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    ours = rgb8_to_yuv420p(torch.from_numpy(image)).numpy()
    theirs = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p").to_ndarray()
    assert ours.shape == theirs.shape == (72, 64)
    assert int(np.abs(ours.astype(int) - theirs.astype(int)).max()) <= 1
    frame = av.VideoFrame.from_ndarray(ours, format="yuv420p")
    assert (frame.height, frame.width) == (48, 64)


@pytest.mark.parametrize("frames", [
    torch.zeros(2, 5, 8, 3, dtype=torch.uint8), torch.zeros(2, 6, 7, 3, dtype=torch.uint8),
    torch.zeros(2, 6, 8, 4, dtype=torch.uint8), torch.zeros(2, 6, 8, 3, dtype=torch.int16),
])
def test_odd_sides_and_other_frames_are_refused(frames: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="even H and W"):
        rgb8_to_yuv420p(frames)


def test_a_packager_given_planes_writes_the_file_of_the_rgb_frames() -> None:
    """What a server hands the packager (planes made on its device) gives the bytes of the RGB8
    frames packaged here; lossless video takes RGB only, and planes are checked."""
    video = _frames(5, h=16, w=24, seed=3).numpy()
    from_rgb = Fmp4Packager(VideoOptions())
    from_planes = Fmp4Packager(VideoOptions())
    planes = rgb8_to_yuv420p(torch.from_numpy(video)).numpy()
    a = from_rgb.add(video[:1]) + from_rgb.add(video[1:]) + from_rgb.close()
    b = from_planes.add(planes[:1], yuv420p=True) + from_planes.add(planes[1:], yuv420p=True) + from_planes.close()
    assert a == b and a[4:8] == b"ftyp"
    with av.open(io.BytesIO(b)) as container:
        assert [(f.height, f.width) for f in container.decode(video=0)] == [(16, 24)] * 5
    with pytest.raises(VideoError, match="lossless video is encoded from RGB"):
        Fmp4Packager(VideoOptions(lossless=True)).add(planes, yuv420p=True)
    with pytest.raises(VideoError, match=r"yuv420p frames \[t, 3H/2, W\]"):
        Fmp4Packager(VideoOptions()).add(video, yuv420p=True)


@pytest.mark.cuda
def test_the_gpu_makes_the_cpus_planes() -> None:
    frames = _frames(4, h=720, w=1280, seed=5)
    assert torch.equal(rgb8_to_yuv420p(frames.cuda()).cpu(), rgb8_to_yuv420p(frames))
