"""The client stands alone: `pip install ./client` into a fresh, plain venv
(no system site-packages, `--no-index` from locally gathered wheels) gives
`vaed-client decode|info|health` that work against a running server without
torch, diffusers or triton (.npy and .safetensors latents, bf16 included). A second, quick check runs the same commands in a
subprocess of this interpreter with torch, diffusers and triton made
unimportable, for machines where the wheels cannot be gathered offline."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import venv
from concurrent import futures
from typing import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
import torch
from PIL import Image
from safetensors.torch import save_file

from harness import FakeDecoder, expected_video
from vaed_client import channel as vchannel
from vaed_client import wire

CLIENT_DIR = pathlib.Path(__file__).resolve().parents[2] / "client"
BLOCKED = ("torch", "diffusers", "triton")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The fake decoder plus grpc.health.v1 reporting SERVING."""
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=vchannel.channel_options())
    wire.pb_grpc.add_VaeDecoderServicer_to_server(FakeDecoder(), grpc_server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}"
    grpc_server.stop(0)


def _check_commands(run: list[str], target: str, tmp_path: pathlib.Path, env: dict[str, str] | None = None) -> None:
    def call(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*run, *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)

    out = call("info", "--server", target)
    assert out.returncode == 0, out.stderr
    assert "z_dim:" in out.stdout and "fake" in out.stdout
    out = call("health", "--server", target)
    assert (out.returncode, out.stdout.strip()) == (0, "SERVING"), out.stderr
    np.save(tmp_path / "lat.npy", np.zeros((16, 3, 2, 2), np.float64))  # 4-D float64: the shared input rule
    out = call("decode", str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / "png"), "--quiet")
    assert out.returncode == 0, out.stderr
    assert "9 frames, batch 1, 16x16 (H x W)" in out.stdout
    files = sorted((tmp_path / "png").glob("*.png"))
    want = expected_video(1, 3, 2, 2)
    assert len(files) == 9 and np.array_equal(np.asarray(Image.open(files[-1])), want[0, -1])
    out = call("decode", str(tmp_path / "lat.npy"), "--server", target, "-o", str(tmp_path / "x.gif"))
    assert out.returncode == 2 and ".mkv" in out.stderr
    # .safetensors is a base dependency, and bf16 (what a bf16 pipeline's latents are) needs no torch
    save_file({"latents": torch.zeros(1, 16, 3, 2, 2, dtype=torch.bfloat16)}, str(tmp_path / "lat.safetensors"))
    out = call("decode", str(tmp_path / "lat.safetensors"), "--server", target, "-o", str(tmp_path / "st"), "--quiet")
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "st").glob("*.png"))) == 9


def test_commands_without_torch_diffusers_triton(server: str, tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "block"
    blocker.mkdir()
    # sitecustomize runs at start-up: a None entry in sys.modules makes `import x` raise ImportError.
    (blocker / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in BLOCKED)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(CLIENT_DIR)]))
    probe = subprocess.run([sys.executable, "-c", "import vaed_client.cli, vaed_client.wire\nimport torch"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert probe.returncode != 0 and "import of torch halted" in probe.stderr, probe.stderr  # the block works
    _check_commands([sys.executable, "-m", "vaed_client.cli"], server, tmp_path, env)


@pytest.mark.slow
def test_pip_install_client_into_a_fresh_venv(server: str, tmp_path: pathlib.Path) -> None:
    wheels = tmp_path / "wheels"
    # Gather the client's wheels and its dependencies' with this interpreter's
    # pip (a local index or cache on CI machines); the venv then installs offline.
    gather = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels), str(CLIENT_DIR), "pillow"],
        capture_output=True, text=True, timeout=600,
    )
    if gather.returncode != 0:
        pytest.skip(f"cannot gather wheels offline: {gather.stderr.strip().splitlines()[-1:]}")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # Nothing from this checkout may leak in: no PYTHONPATH, and not run from the repository.
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "vaed-client", "pillow"],
        capture_output=True, text=True, timeout=600, env=clean, cwd=tmp_path,
    )
    assert install.returncode == 0, install.stderr
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u, vaed_client; "
         "print(vaed_client.__file__, [n for n in %r if u.find_spec(n)])" % (BLOCKED,)],
        capture_output=True, text=True, timeout=60, env=clean, cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    location, heavy = probe.stdout.strip().split(" ", 1)
    assert location.startswith(str(env_dir)) and heavy == "[]", probe.stdout  # installed there; nothing heavy came along
    _check_commands([str(env_dir / "bin" / "vaed-client")], server, tmp_path, clean)
