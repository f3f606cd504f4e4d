"""What the client commands do when things go wrong around the call: signals (SIGTERM, SIGHUP,
Ctrl-C) that must leave no part of a video behind, output folders, a progress bar for the
server's .mp4, one-line errors from `encode`, bad --server / --timeout / tokens, and a stdout
whose reader went away. Each against a real server (in-process, or the command in a subprocess
where a signal or a terminal is involved); waits are on conditions, bounded, never on time."""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import av
import grpc
import numpy as np
import pytest
import torch
from harness import FakeDecoder, engine_calling_at, make_config, serve_in_thread, start_fake_server
from PIL import Image

from vaed_client import VaeClient, channel
from vaed_client.cli import main

Z = 4  # random:wan2.1-tiny's z_dim
HELD_AT = 25  # the latent frame after which the server holds a long decode (`Gate`)
WAIT_S = 120.0  # the bound of every wait on a condition (a slow machine only waits longer)


class Gate:
    """Holds the server's worker after latent frame HELD_AT until `release`: a decode stays in
    flight, with its earlier frames (97 of them) already sent, for as long as a test needs."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> None:
        self.reached.set()
        self.release.wait(WAIT_S)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, list[Gate]]]:
    """A real server (tiny model, encoder on) whose decodes of more than HELD_AT latent frames
    wait at the current gate; the list holds the gate a test sets."""
    gates = [Gate()]
    config = make_config("random:wan2.1-tiny", encode=True)
    with serve_in_thread(config, build_engine=engine_calling_at(config, HELD_AT, lambda: gates[0]())) as running:
        try:
            yield running, gates
        finally:
            gates[0].release.set()


def _wait_for(condition: Callable[[], bool], what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command ended ({proc.returncode}) before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        time.sleep(0.02)


def _command(*argv: str, stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE) -> subprocess.Popen:
    """`vaed-client ARGV` as its console script runs it, with the signals at their defaults (a
    test runner may ignore some, and a child inherits that)."""
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
            "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
            f"sys.argv = ['vaed-client', *{list(argv)!r}]\n"
            "from vaed_client.cli import main\n"
            "sys.exit(main())\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=stderr, text=True)


def _latents(tmp_path: pathlib.Path, frames: int, name: str = "lat.npy") -> pathlib.Path:
    path = tmp_path / name
    np.save(path, torch.randn(1, Z, frames, 4, 6, generator=torch.Generator().manual_seed(frames)).numpy())
    return path


def _one_error_line(err: str, *says: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in says:
        assert text in err, err


# -- 1: SIGTERM / SIGHUP as Ctrl-C ------------------------------------------------------------
@pytest.mark.parametrize("output, flags, signum", [
    ("v.mp4", [], signal.SIGTERM),                   # the server's MP4 (the default), written as it arrives
    ("v.mkv", [], signal.SIGTERM),                   # frames encoded here
    ("v.mp4", ["--client-side"], signal.SIGHUP),     # a closed terminal
    ("frames/", [], signal.SIGTERM),                 # PNG frames
])
def test_a_terminated_decode_leaves_no_part_of_its_video(
    server: Any, tmp_path: pathlib.Path, output: str, flags: list[str], signum: int
) -> None:
    """SIGTERM (a timeout, kill, a CI cancel) killed the command with a partial video that plays
    (249 of 321 frames); now it is handled as Ctrl-C: the part is removed, one line, 128 + signal."""
    running, gates = server
    gates[0] = gate = Gate()
    out = tmp_path / output
    proc = _command("decode", str(_latents(tmp_path, 30)), "--server", running.target, "-o", str(out), *flags)
    try:
        if output.endswith("/"):
            _wait_for(lambda: any(out.glob("frame_*.png")), "frames written", proc)
        else:
            _wait_for(out.exists, "output file", proc)
        _wait_for(gate.reached.is_set, "held decode", proc)  # the call cannot have ended: it is held
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        gate.release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    suffix = f" ({signal.Signals(signum).name})"
    _one_error_line(err, f"vaed-client decode: error: interrupted{suffix}")
    assert not any(out.glob("frame_*.png")) if output.endswith("/") else not out.exists()


def test_the_previous_handlers_come_back_after_a_command(server: Any, tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    running, _ = server
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    assert main(["decode", str(_latents(tmp_path, 2)), "--server", running.target, "-o", str(tmp_path / "v.mkv"),
                 "--quiet"]) == 0
    assert {s: signal.getsignal(s) for s in before} == before


class HeldEncoder(FakeDecoder):
    """A server whose Encode calls wait until released (an encode in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoding = threading.Event()
        self.release = threading.Event()

    def Encode(self, request_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.encoding.set()
        self.release.wait(WAIT_S)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")
        yield from ()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_encode_says_so_in_one_line(tmp_path: pathlib.Path, signum: int) -> None:
    """Ctrl-C printed a KeyboardInterrupt traceback (decode says "interrupted", exit 130), and
    SIGTERM killed the command without a word."""
    servicer = HeldEncoder()
    grpc_server, port = start_fake_server(servicer)
    np.save(tmp_path / "frames.npy", np.zeros((5, 16, 16, 3), np.uint8))
    out = tmp_path / "m.npy"
    proc = _command("encode", str(tmp_path / "frames.npy"), "-o", str(out), "--server", f"127.0.0.1:{port}")
    try:
        _wait_for(servicer.encoding.is_set, "Encode call", proc)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        servicer.release.set()
        if proc.poll() is None:
            proc.kill()
        grpc_server.stop(0)
    assert proc.returncode == 128 + signum, err
    _one_error_line(err, "vaed-client encode: error: interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames.npy"]  # no output, no temporary file


# -- 2: output folders ----------------------------------------------------------------------------
def test_the_servers_mp4_makes_missing_folders_like_the_other_outputs(
    server: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """-o nd/x.mp4 failed after the call with "[Errno 2] No such file or directory" while
    --client-side, .mkv and PNG outputs made the folder; a file in the way is refused before."""
    running, _ = server
    latents = _latents(tmp_path, 3)
    for out, flags in ((tmp_path / "nd" / "deeper" / "x.mp4", []), (tmp_path / "nd2" / "x.mp4", ["--client-side"]),
                       (tmp_path / "nd3" / "x.mkv", [])):
        assert main(["decode", str(latents), "--server", running.target, "-o", str(out), "--quiet", *flags]) == 0
        with av.open(str(out)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 9
    capsys.readouterr()
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.INFO, logger="vaed.service"):
        for output in ("x.mp4", "x.mkv", "frames/"):
            out = tmp_path / "file" / "nd" / output
            assert main(["decode", str(latents), "--server", running.target, "-o", str(out), "--quiet"]) == 2
            _one_error_line(capsys.readouterr().err, "is a file, not a folder")
    assert not re.search(r"Decode\w* id=", caplog.text)  # refused before the call
    with VaeClient(running.target) as client:  # the library makes the folder too
        path = client.decode(np.load(latents), output_type="mp4", mp4_path=tmp_path / "lib" / "x.mp4")
    assert path == tmp_path / "lib" / "x.mp4" and path.stat().st_size > 0


# -- 4: a progress bar for the server's .mp4 ----------------------------------------------------------
@pytest.mark.parametrize("flags", [[], ["--client-side"]])
def test_the_servers_mp4_shows_a_progress_bar_on_a_terminal(server: Any, tmp_path: pathlib.Path,
                                                            flags: list[str]) -> None:
    """--help promises a bar on a terminal; -o x.mkv had one, the default (server-encoded) .mp4 none."""
    running, _ = server
    main_fd, terminal_fd = pty.openpty()
    # a terminal 120 columns wide: a new pty says 0, where tqdm draws an empty bar
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        proc = _command("decode", str(_latents(tmp_path, 4)), "--server", running.target,
                        "-o", str(tmp_path / "v.mp4"), *flags, stderr=terminal_fd)
    finally:
        os.close(terminal_fd)  # the child holds its own copy: reads end when it exits
    shown = b""
    try:
        while True:
            try:
                data = os.read(main_fd, 65536)
            except OSError:  # EIO: the terminal's last writer closed it
                break
            if not data:
                break
            shown += data
    finally:
        os.close(main_fd)
        out, _ = proc.communicate(timeout=WAIT_S)
    text = shown.decode(errors="replace")
    assert proc.returncode == 0, text
    assert re.search(r"decode: +100%.*13/13", text), text
    assert ("on the server" if not flags else "here") in out


# -- 3, 5: encode: numpy-only .safetensors, one-line errors ---------------------------------------------
def test_encode_writes_safetensors_without_torch(server: Any, tmp_path: pathlib.Path) -> None:
    """A client-only install (no torch) crashed writing .safetensors after the server's work
    (safetensors.torch); safetensors.numpy writes the same tensor."""
    from safetensors.torch import load_file

    running, _ = server
    frames = np.random.default_rng(3).integers(0, 256, size=(5, 32, 48, 3), dtype=np.uint8)
    np.save(tmp_path / "frames.npy", frames)
    out = tmp_path / "m.safetensors"
    code = ("import sys; sys.modules['torch'] = None\n"
            f"sys.argv = ['vaed-client', 'encode', {str(tmp_path / 'frames.npy')!r}, '-o', {str(out)!r}, "
            f"'--server', {running.target!r}]\n"
            "from vaed_client.cli import main\n"
            "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    with VaeClient(running.target) as client:
        want = client.encode(frames)
    got = load_file(str(out))["moments"]
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames.npy", "m.safetensors"]  # no temporary left


def test_encode_errors_are_one_line_like_decodes(
    server: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connection flags, PNG frames of two sizes, an audio-only video and an output that is a
    folder printed tracebacks (or failed after the server's work); each is one line, exit 2."""
    running, _ = server
    frames = np.zeros((5, 16, 16, 3), np.uint8)
    np.save(tmp_path / "frames.npy", frames)
    (tmp_path / "png").mkdir()
    for i in range(5):
        Image.fromarray(np.zeros((16, 16 if i != 3 else 24, 3), np.uint8)).save(tmp_path / "png" / f"{i:03d}.png")
    with av.open(str(tmp_path / "audio.mp4"), "w") as container:
        stream = container.add_stream("aac", rate=48000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 48000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    (tmp_path / "empty-token").write_text("\n")
    (tmp_path / "m.safetensors").mkdir()
    server_flags = ["--server", running.target]
    cases = [
        (["frames.npy", "--tls-server-name", "vaed"], "--tls-server-name needs --tls or --ca-cert"),
        (["frames.npy", "--token-file", str(tmp_path / "empty-token")], "is empty"),
        (["frames.npy", "--ca-cert", str(tmp_path / "none.pem")], "no such file"),
        (["frames.npy", "--tls", "--tls-client-cert", str(tmp_path / "frames.npy")], "both --tls-client-cert"),
        (["png"], "the frames differ in size: 000.png is 16x16 (H x W), 003.png 16x24"),
        (["audio.mp4"], "audio.mp4 holds no video stream"),
    ]
    with caplog.at_level(logging.INFO, logger="vaed.service"):
        for argv, says in cases:
            args = [str(tmp_path / argv[0]), *argv[1:], "-o", str(tmp_path / "m.npy"), *server_flags]
            assert main(["encode", *args]) == 2, argv
            _one_error_line(capsys.readouterr().err, "encode: error:", says)
        monkeypatch.setenv("VAED_AUTH_TOKEN", "")
        assert main(["encode", str(tmp_path / "frames.npy"), "-o", str(tmp_path / "m.npy"), *server_flags]) == 2
        _one_error_line(capsys.readouterr().err, "VAED_AUTH_TOKEN is set but empty")
        monkeypatch.delenv("VAED_AUTH_TOKEN")
        assert main(["encode", str(tmp_path / "frames.npy"), "-o", str(tmp_path / "m.safetensors"), "--force",
                     *server_flags]) == 2
        _one_error_line(capsys.readouterr().err, "m.safetensors is a folder")
    assert "Encode id=" not in caplog.text  # all refused before the call
    assert not (tmp_path / "m.npy").exists()


# -- 7, 8: --server and --timeout --------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["info", "decode", "encode", "health"])
@pytest.mark.parametrize("flags, says", [
    (["--server", ""], "target '' names no host"),
    (["--server", "localhost:"], "target 'localhost:' has an empty port"),
    (["--server", "dns:///vaed:"], "has an empty port"),
    (["--timeout", "0"], "must be a number of seconds > 0, got '0'"),
    (["--timeout", "-1"], "must be a number of seconds > 0"),
    (["--timeout", "nan"], "must be a number of seconds > 0"),
    (["--timeout", "soon"], "not a number of seconds"),
])
def test_bad_server_and_timeout_flags_are_usage_errors(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], command: str, flags: list[str], says: str
) -> None:
    """--server "" gave a ValueError traceback, "localhost:" dialled port 443, and --timeout 0
    ran out at once, reported as "timeout ran out while resuming it"."""
    np.save(tmp_path / "lat.npy", np.zeros((1, Z, 2, 4, 6), np.float32))
    np.save(tmp_path / "frames.npy", np.zeros((5, 16, 16, 3), np.uint8))
    operands = {"decode": [str(tmp_path / "lat.npy"), "-o", str(tmp_path / "v.mkv")],
                "encode": [str(tmp_path / "frames.npy"), "-o", str(tmp_path / "m.npy")]}.get(command, [])
    with pytest.raises(SystemExit) as exited:
        main([command, *operands, *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"vaed-client {command}: error: argument {flags[0]}: " in err and says in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "v.mkv").exists()


def test_the_library_refuses_an_empty_port_too() -> None:
    for target in ("localhost:", "[::1]:", "dns:///vaed:", "", ":50051", "dns:///:50051"):
        with pytest.raises(ValueError, match="empty port|names no host"):
            channel.with_default_port(target)
    with pytest.raises(ValueError, match="empty port"):
        VaeClient("localhost:")
    assert channel.with_default_port("localhost:7") == "localhost:7"


# -- 9: tokens gRPC cannot send ---------------------------------------------------------------------------
@pytest.mark.parametrize("content, says", [
    (b"abc\ndef\n", "holds a line break at character 4"),
    (b"abc\tdef", "holds a control character at character 4"),
    ("t\u00f6ken".encode(), "holds the non-ASCII character '\u00f6' at character 2"),
    (b"tok\xffen", "is not text (byte 3 is not UTF-8)"),
])
def test_a_token_grpc_cannot_send_is_refused_naming_its_file(
    server: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], content: bytes, says: str
) -> None:
    """A token with a line break or non-ASCII text failed as UNAVAILABLE "Illegal metadata"
    (retried as a server failure); a non-UTF-8 file gave a decode error without the file name."""
    running, _ = server
    token = tmp_path / "token"
    token.write_bytes(content)
    np.save(tmp_path / "lat.npy", np.zeros((1, Z, 2, 4, 6), np.float32))
    for argv in (["info"], ["decode", str(tmp_path / "lat.npy"), "-o", str(tmp_path / "v.mkv")]):
        assert main([*argv, "--server", running.target, "--token-file", str(token)]) == 2
        _one_error_line(capsys.readouterr().err, f"auth token file {str(token)!r} {says}")


def test_a_token_grpc_cannot_send_is_refused_naming_its_variable(
    server: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    running, _ = server
    monkeypatch.setenv("VAED_AUTH_TOKEN", "t\u00f6ken")
    assert main(["info", "--server", running.target]) == 2
    _one_error_line(capsys.readouterr().err, "environment variable VAED_AUTH_TOKEN holds the non-ASCII")
    with pytest.raises(ValueError, match="line break"):  # the library, before any call
        VaeClient(running.target, token="a\nb")
    monkeypatch.setenv("VAED_AUTH_TOKEN", " ok-token \n")  # surrounding whitespace is still stripped
    assert channel.read_token(None, "VAED_AUTH_TOKEN") == "ok-token"


# -- 10: a reader that went away ----------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["info", "health"])
def test_a_closed_stdout_ends_the_command_quietly(server: Any, command: str) -> None:
    """`vaed-client info | head -3` printed a BrokenPipeError traceback; a closed pipe now ends it
    as Unix tools end (128 + SIGPIPE, nothing on stderr). The pipe's reader is closed before the
    command starts, so every run meets it."""
    running, _ = server
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = _command(command, "--server", running.target, stdout=write_end)
    finally:
        os.close(write_end)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGPIPE and err == "", err
