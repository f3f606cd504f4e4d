"""Shared fixtures: an in-process vaed server on port 0, run on its own event
loop thread, reached through the real client and the real wire."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch

from vaed.config import ServerConfig
from vaed.models import load_model
from vaed.server import VaedServer

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA (runs on the H200)")
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(skip)


@dataclass
class RunningServer:
    server: VaedServer
    loop: asyncio.AbstractEventLoop
    config: ServerConfig

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def vae(self) -> Any:
        """The served module (after the installer ran on it)."""
        assert self.server.worker.engine is not None
        return self.server.worker.engine.vae

    def reference_vae(self) -> Any:
        """A separate copy of the same weights for diffusers reference decodes."""
        engine = self.server.worker.engine
        assert engine is not None
        return load_model(self.config.model, self.config.device, engine.dtype).vae

    @property
    def active_sessions(self) -> int:
        return self.server.worker.active_sessions


@contextlib.contextmanager
def serve_in_thread(config: ServerConfig, ready_timeout: float = 300) -> Iterator[RunningServer]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server-loop", daemon=True)
    thread.start()
    server = VaedServer(config)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
        asyncio.run_coroutine_threadsafe(server.wait_ready(ready_timeout), loop).result(ready_timeout + 5)
        yield RunningServer(server=server, loop=loop, config=config)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=1), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def make_config(model: str = "random:wan2.1-tiny", **overrides: Any) -> ServerConfig:
    base = dict(model=model, device="cpu", host="127.0.0.1", port=0, max_sessions=16, grace=1.0)
    base.update(overrides)
    return ServerConfig(**base)


@pytest.fixture(scope="session")
def tiny_server() -> Iterator[RunningServer]:
    """Tiny random Wan2.1-style VAE on the CPU, float32."""
    with serve_in_thread(make_config("random:wan2.1-tiny")) as running:
        yield running


@pytest.fixture(scope="session")
def tiny22_server() -> Iterator[RunningServer]:
    """Tiny random Wan2.2-style VAE (residual up-blocks, 2x2 patches) on the CPU, float32."""
    with serve_in_thread(make_config("random:wan2.2-tiny")) as running:
        yield running
