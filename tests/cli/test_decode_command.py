"""`vaed decode` / `vaed info` (the client package's `vaed_client.cli`, re-exported
by `vaed_client.cli`): latents readers, mp4/mkv/PNG writers, and the
commands end to end against the fake server and against the real in-process
server."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any, Iterator

import av
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from harness import FakeDecoder, expected_video, fake_video, start_fake_server
from vaed_client import cli as dc
from vaed_client import export


# -- readers -----------------------------------------------------------------
def test_read_pt_tensor_and_dict(tmp_path: pathlib.Path) -> None:
    latents = torch.randn(1, 16, 3, 4, 5).to(torch.bfloat16)
    torch.save(latents, tmp_path / "a.pt")
    torch.save({"latents": latents, "prompt_embeds": torch.zeros(2)}, tmp_path / "b.pt")
    for name in ("a.pt", "b.pt"):
        got = dc.load_latents(tmp_path / name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, latents)  # bf16 kept


def test_read_safetensors(tmp_path: pathlib.Path) -> None:
    latents = torch.randn(2, 16, 1, 4, 4)
    save_file({"latents": latents, "other": torch.zeros(3)}, str(tmp_path / "a.safetensors"))
    save_file({"x": latents}, str(tmp_path / "b.safetensors"))
    assert torch.equal(dc.load_latents(tmp_path / "a.safetensors"), latents)
    assert torch.equal(dc.load_latents(tmp_path / "b.safetensors"), latents)
    save_file({"x": latents, "y": latents.clone()}, str(tmp_path / "c.safetensors"))
    with pytest.raises(dc.CommandError, match="'latents'"):
        dc.load_latents(tmp_path / "c.safetensors")


def test_read_npy_rank4_and_float64(tmp_path: pathlib.Path) -> None:
    latents = np.random.default_rng(0).standard_normal((16, 2, 3, 3))  # float64, no batch
    np.save(tmp_path / "a.npy", latents)
    got = dc.load_latents(tmp_path / "a.npy")
    assert got.shape == (1, 16, 2, 3, 3) and got.dtype == np.float32
    assert np.array_equal(got[0], latents.astype(np.float32))


def test_read_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(dc.CommandError, match="no such file"):
        dc.load_latents(tmp_path / "missing.pt")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(dc.CommandError, match="unknown latents format"):
        dc.load_latents(tmp_path / "a.txt")
    np.save(tmp_path / "flat.npy", np.zeros((4, 4), np.float32))
    with pytest.raises(dc.CommandError, match=r"\[B, z_dim, T, h, w\]"):
        dc.load_latents(tmp_path / "flat.npy")
    (tmp_path / "bad.pt").write_bytes(b"not a pickle")
    with pytest.raises(dc.CommandError, match="cannot read latents"):
        dc.load_latents(tmp_path / "bad.pt")


# -- writers -----------------------------------------------------------------
def _mp4_frames(path: pathlib.Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_mp4_writer_in_and_out_of_order(tmp_path: pathlib.Path) -> None:
    video = fake_video(1, 9, 64, 96)
    writer = export.make_writer(tmp_path / "v.mp4", fps=16)
    for first, end in [(0, 1), (5, 9), (1, 5)]:  # a late chunk waits for its predecessor
        writer.write(first, video[:, first:end])
    assert writer.close() == [tmp_path / "v.mp4"]
    frames = _mp4_frames(tmp_path / "v.mp4")
    assert len(frames) == 9 and frames[0].shape == (64, 96, 3)


def test_mp4_writer_batch_and_odd_size(tmp_path: pathlib.Path) -> None:
    video = fake_video(2, 5, 33, 47)
    writer = export.make_writer(tmp_path / "v.mp4", fps=8)
    writer.write(0, video)
    paths = writer.close()
    assert paths == [tmp_path / "v_b0.mp4", tmp_path / "v_b1.mp4"]
    for path in paths:
        frames = _mp4_frames(path)
        assert len(frames) == 5 and frames[0].shape == (32, 46, 3)  # cropped to even for yuv420p


def test_png_writer(tmp_path: pathlib.Path) -> None:
    video = fake_video(2, 5, 16, 24)
    writer = export.make_writer(tmp_path / "frames", fps=16)
    writer.write(1, video[:, 1:])
    writer.write(0, video[:, :1])
    dirs = writer.close()
    assert dirs == [tmp_path / "frames_b0", tmp_path / "frames_b1"]
    for b, folder in enumerate(dirs):
        files = sorted(folder.glob("*.png"))
        assert [f.name for f in files] == [f"frame_{i:05d}.png" for i in range(5)]
        assert np.array_equal(np.asarray(Image.open(files[3])), video[b, 3])  # lossless


# -- commands ----------------------------------------------------------------
@pytest.fixture()
def fake_target() -> Iterator[tuple[FakeDecoder, str]]:
    servicer = FakeDecoder()
    server, port = start_fake_server(servicer)
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _parse(add: Any, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_decode_command_mp4_and_png(
    fake_target: tuple[FakeDecoder, str], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, target = fake_target
    np.save(tmp_path / "lat.npy", np.zeros((1, 16, 3, 4, 6), np.float32))
    (tmp_path / "token").write_text("tok\n")
    args = _parse(dc.add_decode_arguments, [str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / "v.mp4"),
                                     "--quiet", "--token-file", str(tmp_path / "token"), "--raw-latents"])
    assert dc.run_decode(args) == 0
    assert len(_mp4_frames(tmp_path / "v.mp4")) == 9
    out = capsys.readouterr().out
    for key in ("video:", "first frame:", "total:", "received:", "wrote:"):
        assert key in out
    assert "9 frames, batch 1, 32x48 (H x W)" in out  # frames, batch, H x W: each named
    assert servicer.metadata[-1]["authorization"] == "Bearer tok"
    # the stream's first message (the first two latent frames) carries the options, the rest none
    first, rest = servicer.requests[-2:]
    assert first.options.raw_latents and list(first.latents.shape)[2] == 2 and not rest.HasField("options")

    args = _parse(dc.add_decode_arguments, [str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / "png")])
    assert dc.run_decode(args) == 0
    files = sorted((tmp_path / "png").glob("*.png"))
    assert len(files) == 9
    want = expected_video(1, 3, 4, 6)
    assert np.array_equal(np.asarray(Image.open(files[-1])), want[0, -1])


def test_decode_command_errors(
    fake_target: tuple[FakeDecoder, str], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, target = fake_target
    np.save(tmp_path / "lat.npy", np.zeros((1, 16, 2, 2, 2), np.float32))
    out = str(tmp_path / "v.mp4")
    # Missing file: exit 2, one line, no traceback.
    assert dc.run_decode(_parse(dc.add_decode_arguments, [str(tmp_path / "none.npy"), "--server", target, "-o", out])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err and "Traceback" not in err
    # Nobody listening: UNAVAILABLE after the retries.
    args = _parse(dc.add_decode_arguments, [str(tmp_path / "lat.npy"), "--server", "127.0.0.1:1", "-o", out, "--timeout", "5"])
    assert dc.run_decode(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("vaed decode: error: 127.0.0.1:1: UNAVAILABLE") and err.count("\n") == 1
    # Unreadable token file: a usage error.
    args = _parse(dc.add_decode_arguments, [str(tmp_path / "lat.npy"), "--server", target, "-o", out,
                                     "--token-file", str(tmp_path / "missing-token")])
    assert dc.run_decode(args) == 2
    assert "cannot read auth token file" in capsys.readouterr().err


def test_info_command(fake_target: tuple[FakeDecoder, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, target = fake_target
    assert dc.run_info(_parse(dc.add_info_arguments, ["--server", target])) == 0
    lines = capsys.readouterr().out.splitlines()
    values = dict(line.split(":", 1) for line in lines)
    assert values["server"].strip() == target and values["z_dim"].strip() == "16"
    assert values["compute_dtype"].strip() == "float32"
    assert len({len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}) == 1  # one value column
    assert dc.run_info(_parse(dc.add_info_arguments, ["--server", "127.0.0.1:1", "--timeout", "3"])) == 1


def test_decode_command_against_real_server(tiny_server: Any, tmp_path: pathlib.Path) -> None:
    """`vaed decode` to PNGs equals the client's own decode of the same latents."""
    from vaed_client import VaeClient

    z_dim = tiny_server.vae.config.z_dim
    latents = torch.randn(1, z_dim, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    torch.save({"latents": latents}, tmp_path / "lat.pt")
    args = _parse(dc.add_decode_arguments, [str(tmp_path / "lat.pt"), "--server", tiny_server.target,
                                     "-o", str(tmp_path / "png"), "--quiet"])
    assert dc.run_decode(args) == 0
    with VaeClient(tiny_server.target) as client:
        video = client.decode(latents).numpy()
    files = sorted((tmp_path / "png").glob("*.png"))
    assert len(files) == video.shape[1] == 9
    for i, f in enumerate(files):
        assert np.array_equal(np.asarray(Image.open(f)), video[0, i])


@pytest.mark.parametrize("name, flags", [("v.mkv", []), ("v.mp4", ["--client-side"]), ("png", [])])
def test_a_decode_that_fails_midway_leaves_no_part_of_a_video(
    tiny_server: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], name: str, flags: list[str]
) -> None:
    """The server refuses latent frame 25 (NaN) after the frames of 0-24 were written here (97
    frames: x264 holds back its lookahead's 40 at most, so the .mp4 has packets too): exit 1, and
    nothing of that video is left (a part of a video looks like a whole one), so the same
    command with good latents then runs without --force."""
    z_dim = tiny_server.vae.config.z_dim
    latents = torch.randn(1, z_dim, 30, 4, 6, generator=torch.Generator().manual_seed(0))
    bad = latents.clone()
    bad[:, :, 25] = float("nan")
    out = tmp_path / name
    torch.save(bad, tmp_path / "bad.pt")
    torch.save(latents, tmp_path / "good.pt")
    argv = ["--server", tiny_server.target, "-o", str(out), "--quiet", *flags]
    assert dc.run_decode(_parse(dc.add_decode_arguments, [str(tmp_path / "bad.pt"), *argv])) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert not out.exists() if name != "png" else not any(out.glob("*.png"))
    assert dc.run_decode(_parse(dc.add_decode_arguments, [str(tmp_path / "good.pt"), *argv])) == 0
    frames = _mp4_frames(out) if name != "png" else sorted(out.glob("*.png"))
    assert len(frames) == 117  # 1 + 4 x 29 frames


# -- outputs: suffixes, lossless ----------------------------------------------
def test_unknown_output_suffix_is_an_error_listing_supported(tmp_path: pathlib.Path) -> None:
    from vaed_client.export import ExportError

    with pytest.raises(ExportError) as info:
        export.make_writer(tmp_path / "x.gif", fps=16)
    for supported in (".mp4", ".mkv", "PNG"):
        assert supported in str(info.value)
    assert not (tmp_path / "x.gif").exists()  # no directory named x.gif any more
    assert isinstance(export.make_writer(str(tmp_path / "frames.d") + "/", fps=16), export.PngWriter)  # explicit folder


def test_decode_command_unknown_suffix_exits_2(
    fake_target: tuple[FakeDecoder, str], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, target = fake_target
    np.save(tmp_path / "lat.npy", np.zeros((1, 16, 2, 2, 2), np.float32))
    args = _parse(dc.add_decode_arguments, [str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / "x.gif")])
    assert dc.run_decode(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".mkv" in err and not (tmp_path / "x.gif").exists()


@pytest.mark.parametrize("name, flags", [("v.mkv", []), ("v.mp4", ["--lossless"])])
def test_decode_command_lossless_video(
    fake_target: tuple[FakeDecoder, str], tmp_path: pathlib.Path, name: str, flags: list[str]
) -> None:
    _, target = fake_target
    np.save(tmp_path / "lat.npy", np.zeros((2, 16, 3, 4, 6), np.float32))
    args = _parse(dc.add_decode_arguments, [str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / name),
                                     "--quiet", *flags])
    assert dc.run_decode(args) == 0
    want = expected_video(2, 3, 4, 6)
    stem, suffix = name.split(".")
    for b in range(2):
        frames = _mp4_frames(tmp_path / f"{stem}_b{b}.{suffix}")
        assert len(frames) == 9
        assert all(np.array_equal(f, want[b, i]) for i, f in enumerate(frames))  # bit-exact RGB


def test_lossy_mp4_is_not_claimed_lossless(tmp_path: pathlib.Path) -> None:
    video = fake_video(1, 5, 32, 48)
    writer = export.make_writer(tmp_path / "v.mp4", fps=16)
    writer.write(0, video)
    writer.close()
    frames = _mp4_frames(tmp_path / "v.mp4")
    assert not all(np.array_equal(f, video[0, i]) for i, f in enumerate(frames))  # yuv420p CRF 18 rounds


# -- the same input rule in the library and the command ------------------------
def test_library_and_command_accept_the_same_latents(fake_target: tuple[FakeDecoder, str], tmp_path: pathlib.Path) -> None:
    from vaed_client import LocalInputError, VaeClient

    _, target = fake_target
    four_d = np.random.default_rng(0).standard_normal((16, 2, 3, 3))  # float64, no batch axis
    np.save(tmp_path / "a.npy", four_d)
    from_file = dc.load_latents(tmp_path / "a.npy")
    with VaeClient(target) as client:
        assert np.array_equal(client.decode(four_d), client.decode(from_file))
        assert np.array_equal(client.decode(four_d), expected_video(1, 2, 3, 3))
        with pytest.raises(LocalInputError) as library_error:
            client.decode(np.zeros((4, 4), np.float32))
    np.save(tmp_path / "flat.npy", np.zeros((4, 4), np.float32))
    with pytest.raises(dc.CommandError) as command_error:
        dc.load_latents(tmp_path / "flat.npy")
    assert str(library_error.value) in str(command_error.value)  # the same message


# -- the client-only entry point --------------------------------------------------
def test_vaed_client_main(fake_target: tuple[FakeDecoder, str], tmp_path: pathlib.Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from vaed_client import cli

    _, target = fake_target
    assert cli.main(["info", "--server", target]) == 0
    assert "z_dim:" in capsys.readouterr().out
    np.save(tmp_path / "lat.npy", np.zeros((1, 16, 2, 2, 2), np.float32))
    assert cli.main(["decode", str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / "png"), "--quiet"]) == 0
    assert len(list((tmp_path / "png").glob("*.png"))) == 5
    assert "5 frames, batch 1, 16x16 (H x W)" in capsys.readouterr().out
    assert cli.main(["health", "--server", "127.0.0.1:1", "--timeout", "1"]) == 1
    assert capsys.readouterr().out.startswith("UNAVAILABLE")
    assert cli.main(["info", "--server", target, "--tls-server-name", "x"]) == 2  # needs --tls
