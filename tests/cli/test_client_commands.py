"""The client commands (`vaed-client info|health|decode`, and the server
package's `vaed info|health|decode`, which delegate to them) against the real
in-process server: the fake server sends empty `precisions`/`devices` lists,
which hid `info` crashing on every real server. Also the first-hour details:
the default port, refusing to overwrite outputs, the latents dtype message,
`.safetensors` without torch, and defaults in `--help`."""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
from typing import Any

import av
import numpy as np
import pytest
import torch
from harness import FakeDecoder, start_fake_server
from safetensors.torch import save_file

from vaed_client import LocalInputError, VaeClient, channel
from vaed_client import cli as dc

CLIENT_DIR = pathlib.Path(__file__).resolve().parents[2] / "client"


def _entry_points() -> list[Any]:
    import vaed.cli

    return [dc.main, vaed.cli.main]  # `vaed-client ...` and `vaed ...`


def _rows(out: str) -> dict[str, str]:
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in out.splitlines())}


@pytest.mark.parametrize("entry", ["vaed-client", "vaed"])
def test_info_health_decode_against_the_real_server(
    tiny_server: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], entry: str
) -> None:
    main = _entry_points()[0 if entry == "vaed-client" else 1]
    target = tiny_server.target

    assert main(["info", "--server", target]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["server"] == target and rows["model"] == "random:wan2.1-tiny" and rows["z_dim"] == "4"
    assert rows["precisions"] == "[lossless]" and rows["devices"] == "[cpu]"  # lists of names, as they are
    assert rows["compute_dtype"] == "float32" and rows["random_weights"] == "True"
    mean = tiny_server.vae.config.latents_mean
    assert rows["latents_mean"] == "[" + ", ".join(f"{v:.4f}" for v in mean) + "]"  # floats to 4 decimals

    assert main(["health", "--server", target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main(["health", "--server", target, "--service", "vaed.v1.VaeDecoder"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main(["health", "--server", target, "--service", "nope"]) == 1
    assert capsys.readouterr().out.strip() == "SERVICE_UNKNOWN"

    latents = np.random.default_rng(0).standard_normal((1, 4, 3, 4, 6)).astype(np.float32)
    np.save(tmp_path / "lat.npy", latents)
    assert main(["decode", str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / "v.mkv"), "--quiet"]) == 0
    assert "9 frames, batch 1, 32x48 (H x W)" in capsys.readouterr().out
    with VaeClient(target) as client:
        want = client.decode(latents)
    with av.open(str(tmp_path / "v.mkv")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and all(np.array_equal(f, want[0, i]) for i, f in enumerate(frames))  # FFV1: exact


def test_info_as_a_subprocess(tiny_server: Any) -> None:
    """The installed command's path (console script -> main), as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "vaed_client.cli", "info", "--server", tiny_server.target],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert _rows(out.stdout)["precisions"] == "[lossless]"


# -- --server without a port -----------------------------------------------------
@pytest.mark.parametrize("target, expected", [
    ("127.0.0.1", "127.0.0.1:50051"),
    ("localhost:1234", "localhost:1234"),
    ("vaed", "vaed:50051"),
    ("[::1]", "[::1]:50051"),
    ("[::1]:7", "[::1]:7"),
    ("::1", "[::1]:50051"),
    ("dns:///vaed-headless.ns.svc", "dns:///vaed-headless.ns.svc:50051"),
    ("dns:///vaed-headless.ns.svc:9000", "dns:///vaed-headless.ns.svc:9000"),
    ("dns://8.8.8.8/vaed", "dns://8.8.8.8/vaed:50051"),
    ("unix:/run/vaed.sock", "unix:/run/vaed.sock"),
    ("ipv4:10.0.0.1:80,10.0.0.2:80", "ipv4:10.0.0.1:80,10.0.0.2:80"),
])
def test_targets_without_a_port_get_50051(target: str, expected: str) -> None:
    assert channel.with_default_port(target) == expected
    parser = argparse.ArgumentParser()
    dc.add_info_arguments(parser)
    assert parser.parse_args(["--server", target]).server == expected


def test_a_bare_host_dials_50051_not_443(capsys: pytest.CaptureFixture[str]) -> None:
    assert VaeClient("127.0.0.1").target == "127.0.0.1:50051"
    assert dc.build_parser().parse_args(["info"]).server == "localhost:50051"
    # Nothing (or a vaed) on 50051: either way the command names the port it dialled.
    code = dc.main(["info", "--server", "127.0.0.1", "--timeout", "2"])
    captured = capsys.readouterr()
    text = captured.out if code == 0 else captured.err
    assert "127.0.0.1:50051" in text and ":443" not in text


def test_the_default_port_reaches_a_server_there() -> None:
    """A fake server on a free port: a target without a port dials `with_default_port`'s port."""
    servicer = FakeDecoder()
    server, port = start_fake_server(servicer)
    try:
        assert channel.with_default_port("127.0.0.1", port) == f"127.0.0.1:{port}"
        with VaeClient(channel.with_default_port("127.0.0.1", port)) as client:
            assert client.model_info().model == "fake"
    finally:
        server.stop(0)


# -- outputs are not overwritten silently -------------------------------------------
@pytest.fixture()
def fake_target() -> Any:
    servicer = FakeDecoder()
    server, port = start_fake_server(servicer)
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_existing_outputs_are_refused_without_force(
    fake_target: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "long.npy", np.zeros((1, 16, 3, 2, 2), np.float32))  # 9 frames
    np.save(tmp_path / "short.npy", np.zeros((1, 16, 2, 2, 2), np.float32))  # 5 frames
    video = tmp_path / "v.mp4"

    def decode(latents: str, out: pathlib.Path | str, *flags: str) -> int:
        return dc.main(["decode", str(tmp_path / latents), "--server", fake_target, "-o", str(out), "--quiet", *flags])

    assert decode("long.npy", video) == 0
    before = video.read_bytes()
    capsys.readouterr()
    assert decode("short.npy", video) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(video) in err and "--force" in err
    assert video.read_bytes() == before  # untouched
    assert decode("short.npy", video, "--force") == 0 and video.read_bytes() != before

    frames = tmp_path / "frames"
    assert decode("long.npy", str(frames) + "/") == 0 and len(list(frames.glob("*.png"))) == 9
    (frames / "notes.txt").write_text("mine")
    assert decode("short.npy", frames) == 2 and "--force" in capsys.readouterr().err
    assert decode("short.npy", frames, "--force") == 0
    # --force clears the old frames: no stale frame_00005..8 from the longer video
    assert sorted(p.name for p in frames.glob("*.png")) == [f"frame_{i:05d}.png" for i in range(5)]
    assert (frames / "notes.txt").read_text() == "mine"  # nothing else is removed
    empty = tmp_path / "empty"
    empty.mkdir()
    assert decode("short.npy", empty) == 0  # an empty folder is not an output to protect

    # a batch: the per-item names are what is checked
    np.save(tmp_path / "batch.npy", np.zeros((2, 16, 2, 2, 2), np.float32))
    (tmp_path / "b_b1.mkv").write_bytes(b"x")
    assert decode("batch.npy", tmp_path / "b.mkv") == 2
    assert "b_b1.mkv" in capsys.readouterr().err and not (tmp_path / "b_b0.mkv").exists()


# -- latents dtypes ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64, np.bool_])
def test_unaccepted_latents_dtypes_name_the_file_and_the_accepted_ones(
    fake_target: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], dtype: Any
) -> None:
    path = tmp_path / "lat.npy"
    latents = np.zeros((1, 16, 2, 2, 2), dtype)
    np.save(path, latents)
    assert dc.main(["decode", str(path), "--server", fake_target, "-o", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err
    name = np.dtype(dtype).name
    assert err.count("\n") == 1 and str(path) in err and f"latents dtype {name} is not accepted" in err
    for accepted in ("float32", "float16", "bfloat16", "float64 is cast to float32"):
        assert accepted in err
    with VaeClient(fake_target) as client:  # the library says the same, before sending
        with pytest.raises(LocalInputError) as library:
            client.decode(latents)
        with pytest.raises(LocalInputError) as from_torch:
            client.decode(torch.from_numpy(latents))
    assert str(library.value) in err and str(from_torch.value) == str(library.value)
    assert library.value.code is None


def test_accepted_latents_dtypes_pass(fake_target: str, tmp_path: pathlib.Path) -> None:
    with VaeClient(fake_target) as client:
        for dtype in (np.float32, np.float16, np.float64):
            assert client.decode(np.zeros((1, 16, 2, 2, 2), dtype)).shape == (1, 5, 16, 16, 3)
        assert client.decode(torch.zeros(1, 16, 2, 2, 2, dtype=torch.bfloat16)).shape == (1, 5, 16, 16, 3)


# -- .safetensors with numpy alone ---------------------------------------------------------
def test_safetensors_without_torch_widens_bf16_exactly(tmp_path: pathlib.Path) -> None:
    latents = torch.randn(1, 16, 3, 4, 5).to(torch.bfloat16)
    save_file({"latents": latents, "other": torch.zeros(2, 3)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.randn(16, 2, 2, 2)}, str(tmp_path / "b.safetensors"))
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from vaed_client import cli\n"
        f"a = cli.load_latents({str(tmp_path / 'a.safetensors')!r})\n"
        f"b = cli.load_latents({str(tmp_path / 'b.safetensors')!r})\n"
        f"np.save({str(tmp_path / 'a.npy')!r}, a); np.save({str(tmp_path / 'b.npy')!r}, b)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=CLIENT_DIR)
    assert out.returncode == 0, out.stderr
    a = np.load(tmp_path / "a.npy")
    assert a.dtype == np.float32 and np.array_equal(a, latents.float().numpy())  # bf16 -> fp32 is exact
    assert np.load(tmp_path / "b.npy").shape == (1, 16, 2, 2, 2)


def test_safetensors_is_a_client_dependency() -> None:
    import tomllib

    project = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("safetensors") for dep in project["dependencies"])  # not an extra: numpy reads it


# -- --help shows the defaults ------------------------------------------------------------------
def test_help_shows_every_default() -> None:
    parser = dc.build_parser()
    assert "localhost:50051" in parser.format_help() and "COMMAND --help" in parser.format_help()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"decode", "encode", "info", "health"}
    for name, command in sub.choices.items():
        for action in command._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.required:
                continue
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert "default" in (action.help or ""), f"{name} {action.option_strings[0]}: no default in its help"
        text = command.format_help()
        assert "localhost:50051" in text and "50051" in text



def test_encode_command_writes_the_served_moments(tmp_path) -> None:
    """`vaed-client encode` on a PNG folder, an .mp4 and .npy frames: the file holds what
    VaeClient.encode returns for the same uint8 frames (the .mp4's as PyAV decodes them)."""
    import av
    import numpy as np
    import torch
    from harness import make_config, serve_in_thread
    from PIL import Image
    from safetensors.torch import load_file

    from vaed_client import VaeClient
    from vaed_client.cli import main

    frames = np.random.default_rng(1).integers(0, 256, size=(5, 64, 96, 3), dtype=np.uint8)
    (tmp_path / "png").mkdir()
    for i, f in enumerate(frames):
        Image.fromarray(f).save(tmp_path / "png" / f"{i:03d}.png")
    np.save(tmp_path / "frames.npy", frames)
    with av.open(str(tmp_path / "v.mp4"), "w") as container:
        stream = container.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    from vaed_client.encode_cli import read_frames

    decoded = read_frames(tmp_path / "v.mp4")
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    with serve_in_thread(make_config("random:wan2.1-tiny", encode=True)) as running:
        with VaeClient(running.target) as client:
            want = client.encode(frames)
            want_latents = client.encode(torch.from_numpy(frames), output_type="latents")
            want_mp4 = client.encode(decoded)
        server = ["--server", running.target]
        assert main(["encode", str(tmp_path / "png"), "-o", str(tmp_path / "a.safetensors"), *server]) == 0
        assert main(["encode", str(tmp_path / "frames.npy"), "-o", str(tmp_path / "b.npy"), "--output-type",
                     "latents", *server]) == 0
        assert main(["encode", str(tmp_path / "frames.npy"), "-o", str(tmp_path / "b.npy"), *server]) == 2  # exists
        assert main(["encode", str(tmp_path / "none.txt"), "-o", str(tmp_path / "c.npy"), *server]) == 2
        assert main(["encode", str(tmp_path / "v.mp4"), "-o", str(tmp_path / "d.npy"), *server]) == 0
    assert np.array_equal(load_file(str(tmp_path / "a.safetensors"))["moments"].numpy(), want)
    assert torch.equal(torch.from_numpy(np.load(tmp_path / "b.npy")), want_latents)
    assert np.array_equal(np.load(tmp_path / "d.npy"), want_mp4)


def test_encode_command_refuses_unreadable_inputs_and_unwritable_outputs_before_the_call(
        tmp_path, capsys, caplog) -> None:
    """Each a one-line error, exit 2, no traceback, and no Encode on the server (the output's
    suffix and folder are checked before the frames are sent); suffixes in any case."""
    import logging

    import numpy as np
    from harness import make_config, serve_in_thread

    from vaed_client.cli import main

    frames = np.random.default_rng(2).integers(0, 256, size=(5, 64, 96, 3), dtype=np.uint8)
    with open(tmp_path / "FRAMES.NPY", "wb") as f:  # np.save on a path would add ".npy"
        np.save(f, frames)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object))
    (tmp_path / "damaged.mp4").write_bytes(b"\0" * 4096)
    with serve_in_thread(make_config("random:wan2.1-tiny", encode=True)) as running, \
            caplog.at_level(logging.INFO, logger="vaed.service"):
        server = ["--server", running.target]
        for argv, pattern in [
            (["missing.mp4", "-o", "a.npy"], "missing.mp4: no such file"),
            (["missing.npy", "-o", "a.npy"], "missing.npy: no such file"),
            (["objects.npy", "-o", "a.npy"], "objects.npy: cannot read it"),
            (["damaged.mp4", "-o", "a.npy"], "damaged.mp4: cannot read it"),
            (["FRAMES.NPY", "-o", "nodir/a.npy"], "no folder"),
            (["FRAMES.NPY", "-o", "a.pt"], "write .safetensors or .npy"),
        ]:
            args = [str(tmp_path / argv[0]), argv[1], str(tmp_path / argv[2]), *server]
            assert main(["encode", *args]) == 2, argv
            err = capsys.readouterr().err
            assert pattern in err and "Traceback" not in err and err.count("\n") == 1, err
        assert "Encode id=" not in caplog.text  # the server never saw these
        assert main(["encode", str(tmp_path / "FRAMES.NPY"), "-o", str(tmp_path / "B.NPY"), *server]) == 0
        assert np.load(tmp_path / "B.NPY").ndim == 5
