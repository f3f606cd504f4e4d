"""The README's CPU quickstart, run as written: the bash block under
"## Quickstart" is read from README.md and run by bash in an empty folder,
with only its port (50051) replaced by a free one. It serves the tiny model in
the background, waits for SERVING, prints the model info, makes latents,
decodes them to an mp4 and to PNG frames, reads a PNG back and stops the
server; the test then checks what it wrote and printed."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys

import av
import numpy as np
import pytest
from PIL import Image

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BIN = pathlib.Path(sys.executable).parent


def quickstart_block() -> str:
    text = README.read_text()
    match = re.search(r"^## Quickstart\b.*?^```bash\n(.*?)^```", text, re.S | re.M)
    assert match, "README has no bash block under '## Quickstart'"
    return match.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_quickstart_block_says_what_it_does() -> None:
    block = quickstart_block()
    assert "vaed serve --device cpu --model random:wan2.1-tiny" in block
    assert "np.random.randn(1, 4, 5, 8, 8)" in block  # the tiny model's z_dim is 4
    for needed in ("-o video.mp4", "-o frames/", "frame_00016.png", "kill %1"):
        assert needed in block


@pytest.mark.slow
def test_the_readme_quickstart_runs(tmp_path: pathlib.Path) -> None:
    if shutil.which("vaed", path=str(BIN)) is None or shutil.which("vaed-client", path=str(BIN)) is None:
        pytest.skip(f"the vaed / vaed-client commands are not installed next to {sys.executable} (pip install -e .)")
    port = free_port()
    script = quickstart_block().replace("50051", str(port))
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python").symlink_to(sys.executable)  # `python -c ...` in the block: this interpreter
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PATH=os.pathsep.join([str(shims), str(BIN), os.environ.get("PATH", "")]),
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the background server too, whatever happened
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            out += proc.communicate()[0]
    assert proc.returncode == 0, out[-4000:]

    assert "SERVING on cpu" in out and "Traceback" not in out, out[-4000:]
    assert re.search(r"^z_dim:\s+4$", out, re.M) and re.search(r"^precisions:\s+\[lossless\]$", out, re.M)
    assert out.count("video:       17 frames, batch 1, 64x64 (H x W)") == 2
    assert "(64, 64) RGB" in out  # the PNG read back
    with av.open(str(work / "video.mp4")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 17 and frames[0].shape == (64, 64, 3)
    pngs = sorted((work / "frames").glob("*.png"))
    assert [p.name for p in pngs] == [f"frame_{i:05d}.png" for i in range(17)]
    assert np.asarray(Image.open(pngs[-1])).std() > 0  # a decoded frame, not a blank one
    assert np.load(work / "latents.npy").shape == (1, 4, 5, 8, 8)
