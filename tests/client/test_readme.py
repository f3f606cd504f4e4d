"""The README's client text runs as pasted: the first Python block under
"## Client" is executed against the real in-process server (only its
`localhost:50051` is pointed at the test server's port), and the client install
lines keep the CPU-torch line before the torch extra. The blocks are read from
README.md itself, so the test fails when the README drifts."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def section(title: str) -> str:
    """The README text from the `## {title}` heading to the next `## ` heading."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\b.*?$(.*?)(?=^## )", text, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def test_the_first_client_block_runs_as_pasted(tiny_server: Any, tmp_path: pathlib.Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    code = blocks(section("Client"), "python")[0]
    # One `with` block for every call, against the quickstart's address.
    assert code.count("with VaeClient(") == 1 and 'VaeClient("localhost:50051")' in code
    assert code.startswith("import") and "from vaed_client import" in code  # imports included
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(code.replace("localhost:50051", tiny_server.target), str(README), "exec"), namespace)
    vae, video, frames, streamed = (namespace[k] for k in ("vae", "video", "frames", "streamed"))
    z_dim = tiny_server.vae.config.z_dim
    assert namespace["latents"].shape[1] == z_dim  # the latents the block makes fit the served model
    assert video.dtype == np.uint8 and video.shape == (1, 17, 64, 64, 3)
    assert frames.dtype == np.float32 and frames.shape == video.shape
    assert np.array_equal(streamed, video)  # the session's result, as the comment says
    assert (tmp_path / "out.mp4").stat().st_size > 0 and (tmp_path / "out.mkv").stat().st_size > 0
    assert vae.closed  # the block closed it, and the export lines after it did not need it


def test_the_pipeline_block_uses_dtype_and_the_quickstart_address() -> None:
    client = section("Client")
    pipeline = next(b for b in blocks(client, "python") if "RemoteAutoencoderKLWan" in b)
    assert "from_pretrained(repo, vae=RemoteAutoencoderKLWan(" in pipeline
    assert "dtype=torch.bfloat16" in pipeline and "torch_dtype" not in client  # diffusers 0.42 deprecates torch_dtype
    for name in ("import torch", "from diffusers import WanPipeline", "repo = "):
        assert name in pipeline  # defined in the block, not left to the reader


def test_client_install_lines_take_cpu_torch_first() -> None:
    setup = section("Setup")
    client_block = next(b for b in blocks(setup, "bash") if "./client" in b)
    lines = [line for line in client_block.splitlines() if line and not line.startswith("#")]
    cpu = next(i for i, line in enumerate(lines) if "download.pytorch.org/whl/cpu" in line)
    torch_extra = next(i for i, line in enumerate(lines) if "torch]" in line and line.startswith("pip install"))
    assert cpu < torch_extra and lines[cpu].startswith("command -v nvidia-smi >/dev/null ||")
    assert "safetensors" in client_block  # the base install reads .safetensors latents
