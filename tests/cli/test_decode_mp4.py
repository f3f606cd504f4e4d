"""`vaed-client decode -o x.mp4` against a real `vaed serve` process: the server encodes the .mp4
by default (`--server-side`), `--client-side` encodes here, both at --crf 18 unless told; where
the server cannot (.mkv, an older server), --server-side is refused with the reason."""

from __future__ import annotations

import io
import pathlib
from collections.abc import Iterator
from typing import Any

import av
import numpy as np
import pytest
import torch
from harness import FakeDecoder, start_cli_server, start_fake_server

from vaed.video import Fmp4Packager, VideoOptions
from vaed_client import VaeClient
from vaed_client.cli import main

Z = 4  # random:wan2.1-tiny


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    proc, target = start_cli_server("--no-warmup")
    try:
        yield target
    finally:
        proc.terminate()
        proc.wait(30)


def _rows(printed: str) -> dict[str, str]:
    """The summary's `key: value` rows."""
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in printed.splitlines())}


def _frames(path: pathlib.Path) -> tuple[np.ndarray, Any]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)]), stream.average_rate


def _packaged(frames: np.ndarray, options: VideoOptions) -> np.ndarray:
    packager = Fmp4Packager(options)
    data = packager.add(frames) + packager.close()
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.fixture(scope="module")
def latents_file(tmp_path_factory: pytest.TempPathFactory, served: str) -> tuple[pathlib.Path, np.ndarray]:
    """Latents on disk, and the RGB8 frames the server decodes them to."""
    path = tmp_path_factory.mktemp("latents") / "lat.npy"
    x = torch.randn(1, Z, 4, 6, 8, generator=torch.Generator().manual_seed(4)).numpy()
    np.save(path, x)
    with VaeClient(served, timeout=120) as client:
        return path, client.decode(x)[0]


def test_server_side_is_the_default_for_one_mp4(served: str, latents_file: Any, tmp_path: pathlib.Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path, rgb8 = latents_file
    out = tmp_path / "v.mp4"
    assert main(["decode", str(path), "--server", served, "-o", str(out), "--quiet"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["encoded"] == "on the server, CRF 18" and rows["video"] == "13 frames, batch 1, 48x64 (H x W)"
    assert "first frame" not in rows and rows["first bytes"].endswith(" ms") and rows["wrote"] == str(out)
    frames, rate = _frames(out)
    assert rate == 16  # the model's (ModelInfo.video_fps)
    assert np.array_equal(frames, _packaged(rgb8, VideoOptions(fps=16, crf=18)))  # the server's encoder at CRF 18
    assert main(["decode", str(path), "--server", served, "-o", str(out), "--quiet", "--force",
                 "--server-side", "--lossless", "--fps", "8"]) == 0
    exact, rate = _frames(out)
    assert rate == 8 and np.array_equal(exact, rgb8)


def test_client_side_encodes_here(served: str, latents_file: Any, tmp_path: pathlib.Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path, rgb8 = latents_file
    out = tmp_path / "v.mp4"
    assert main(["decode", str(path), "--server", served, "-o", str(out), "--quiet", "--client-side",
                 "--lossless"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["encoded"] == "here" and "first frame" in rows
    exact, rate = _frames(out)
    assert rate == 16 and np.array_equal(exact, rgb8)


def test_server_side_is_refused_where_it_cannot_be(served: str, latents_file: Any, tmp_path: pathlib.Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = latents_file
    assert main(["decode", str(path), "--server", served, "-o", str(tmp_path / "v.mkv"), "--server-side"]) == 2
    assert "--server-side: the output is not an .mp4" in capsys.readouterr().err
    assert not (tmp_path / "v.mkv").exists()
    servicer = FakeDecoder()  # a server whose ModelInfo names no video formats (an older vaed)
    server, port = start_fake_server(servicer)
    try:
        np.save(tmp_path / "lat16.npy", np.zeros((1, 16, 2, 2, 2), np.float32))
        assert main(["decode", str(tmp_path / "lat16.npy"), "--server", f"127.0.0.1:{port}",
                     "-o", str(tmp_path / "v.mp4"), "--server-side"]) == 2
        assert "the server offers no MP4 output" in capsys.readouterr().err
        # without the flag the same call encodes here
        assert main(["decode", str(tmp_path / "lat16.npy"), "--server", f"127.0.0.1:{port}",
                     "-o", str(tmp_path / "v.mp4"), "--quiet"]) == 0
        assert _rows(capsys.readouterr().out)["encoded"] == "here"
    finally:
        server.stop(0)
    assert main(["decode", str(path), "--server", served, "-o", str(tmp_path / "w.mp4"), "--crf", "52"]) == 2
    assert "--crf must be in 0..51, got 52" in capsys.readouterr().err
    # --crf where nothing lossy is encoded is refused, as the library and the server refuse it
    # (it was dropped without a word)
    for output, extra, said in (("w.mp4", ["--lossless"], "--lossless is always CRF 0"),
                                ("w.mp4", ["--lossless", "--client-side"], "--lossless is always CRF 0"),
                                ("w.mkv", [], "is written lossless"), ("frames/", [], "is written lossless")):
        argv = ["decode", str(path), "--server", served, "-o", str(tmp_path / output), "--crf", "10", *extra]
        assert main(argv) == 2, argv
        assert said in capsys.readouterr().err
        assert not (tmp_path / output).exists()
