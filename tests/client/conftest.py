"""Fixtures of the client tests: the fake VaeDecoder from harness on port 0."""

from __future__ import annotations

from typing import Iterator

import pytest

from harness import FakeDecoder, start_fake_server


@pytest.fixture()
def fake() -> Iterator[tuple[FakeDecoder, str]]:
    """A fresh fake server per test and its target (the servicer records requests and metadata)."""
    servicer = FakeDecoder()
    server, port = start_fake_server(servicer)
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)
