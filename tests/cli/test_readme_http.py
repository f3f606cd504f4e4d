"""The README's curl block for the HTTP front, run as written against a server of the tiny model:
the bash block after "With curl" is read from README.md, its Wan2.1 latent shape (16 channels,
60 x 104) replaced by the tiny model's (4 channels, 4 x 6) and its port by the server's, and run
by bash in an empty folder; the test then checks every file it wrote against the gRPC decode of
the latents the block made."""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import av
import numpy as np
import pytest
import torch

from harness import RunningServer, make_config, serve_in_thread
from vaed_client import VaeClient

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# the README's Wan2.1 latents -> the tiny model's, in the two spellings the block uses
SHAPES = {"1,16,3,60,104": "1,4,3,4,6", "shape=1&shape=16&shape=3&shape=60&shape=104": "shape=1&shape=4&shape=3&shape=4&shape=6"}


def curl_block() -> str:
    text = README.read_text()
    match = re.search(r"^With curl \(the body is the tensor's bytes.*?^```bash\n(.*?)^```", text, re.S | re.M)
    assert match, "README has no bash block after 'With curl'"
    return match.group(1)


def test_the_curl_block_says_what_it_does() -> None:
    block = curl_block()
    for needed in (*SHAPES, "output_type=mp4", "stream=true", "output_type=pt", "partial_postprocess=true",
                   "-D headers.txt", "/health", "localhost:8000"):
        assert needed in block, needed


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(make_config("random:wan2.1-tiny", http_port=0)) as running:
        yield running


def _mp4_frames(path: pathlib.Path) -> np.ndarray:
    with av.open(io.BytesIO(path.read_bytes())) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.mark.skipif(shutil.which("curl") is None, reason="the block runs curl")
def test_the_readme_curl_block_runs(server: RunningServer, tmp_path: pathlib.Path) -> None:
    script = curl_block().replace("localhost:8000", f"127.0.0.1:{server.server.http_port}")
    for readme_shape, tiny in SHAPES.items():
        script = script.replace(readme_shape, tiny)
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python").symlink_to(sys.executable)  # `python -c ...` in the block: this interpreter
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PATH=os.pathsep.join([str(shims), os.environ.get("PATH", "")]), VAED_TOKEN="")
    done = subprocess.run(["bash", "-e", "-c", script], cwd=work, env=env, capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert '{"status": "SERVING"}' in done.stdout

    latents = torch.from_numpy(np.fromfile(work / "latents.f32", dtype=np.float32).reshape(1, 4, 3, 4, 6))
    with VaeClient(server.target, timeout=120) as client:
        rgb8 = torch.as_tensor(client.decode(latents))[0].numpy()           # [9, 32, 48, 3]
        raw = torch.as_tensor(client.decode(latents, output_type="raw"))    # [1, 3, 9, 32, 48]
    headers = dict(line.split(": ", 1) for line in (work / "headers.txt").read_text().splitlines()[1:] if ": " in line)
    headers = {k.lower(): v for k, v in headers.items()}
    assert json.loads(headers["shape"]) == list(raw.shape) and headers["dtype"] == "float32"
    assert torch.equal(torch.from_numpy(np.fromfile(work / "video.bin", dtype=np.float32)).reshape(raw.shape), raw)
    assert np.array_equal(np.fromfile(work / "frames.u8", dtype=np.uint8).reshape(rgb8.shape), rgb8)
    whole, streamed = _mp4_frames(work / "out.mp4"), _mp4_frames(work / "stream.mp4")
    assert whole.shape == rgb8.shape and np.array_equal(whole, streamed)  # one encoder, both routes
