"""Resume decisions against real in-process servers, sync and asyncio clients: a full replica's
RESOURCE_EXHAUSTED moves the call to another target, an INVALID_ARGUMENT is never retried.
(Servers dying mid-call: tests/chaos.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from vaed_client import AsyncVaeClient, CallReport, VaeClient
from vaed_client.errors import InvalidArgumentError

from harness import make_config, serve_in_thread

Z = 4


def _latents(t: int = 2) -> torch.Tensor:
    return torch.randn(1, Z, t, 5, 7, generator=torch.Generator().manual_seed(t))


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def full_and_free():
    """A replica whose one session slot is taken, and one with room."""
    with serve_in_thread(make_config(max_sessions=1)) as full, serve_in_thread(make_config()) as free:
        with VaeClient(full.target) as holder:
            session = holder.session()
            session.push(_latents(1))
            _wait_for(lambda: full.active_sessions == 1)
            try:
                yield full, free
            finally:
                session.cancel()


def _check_one_moved(reports: list[CallReport], full, free) -> None:
    """Two calls of one client start on its two targets in turn (whatever its first call was):
    the one that started on the full replica moved to the free one, once, saying why."""
    moved = [r for r in reports if r.targets[0] == full.target]
    stayed = [r for r in reports if r.targets[0] == free.target]
    assert len(moved) == len(stayed) == 1
    assert moved[0].resumes == 1 and moved[0].targets == [full.target, free.target]
    assert moved[0].reasons[0].startswith("RESOURCE_EXHAUSTED:") and "sessions" in moved[0].reasons[0]
    assert stayed[0].resumes == 0


def test_resource_exhausted_moves_to_another_replica(full_and_free, caplog):
    full, free = full_and_free
    with VaeClient(free.target) as client:
        want = client.decode(_latents())
    reports = [CallReport(), CallReport()]
    with caplog.at_level("WARNING", logger="vaed_client.resume"), VaeClient([full.target, free.target]) as client:
        for report in reports:
            assert torch.equal(client.decode(_latents(), report=report), want)
    _check_one_moved(reports, full, free)
    assert f"{full.target} failed after 0 frames (RESOURCE_EXHAUSTED" in caplog.text


def test_resource_exhausted_moves_an_async_session(full_and_free):
    full, free = full_and_free
    with VaeClient(free.target) as client:
        want = client.decode(_latents(3))

    async def run():
        results = []
        async with AsyncVaeClient([full.target, free.target]) as client:
            for _ in range(2):
                session = client.session()
                async with session:
                    for t in range(3):
                        await session.push(_latents(3)[:, :, t : t + 1])
                results.append((await session.collect(), session.report))
        return results

    results = asyncio.run(run())
    assert all(torch.equal(got, want) for got, _ in results)
    _check_one_moved([report for _, report in results], full, free)


@pytest.mark.parametrize("front", ["sync", "async"])
def test_invalid_argument_is_never_retried(full_and_free, front):
    _, free = full_and_free
    bad = torch.randn(1, Z + 1, 2, 5, 7)  # the server's z_dim is 4
    report = CallReport()
    targets = [free.target, free.target]  # a second target is there, and unused
    with pytest.raises(InvalidArgumentError):
        if front == "sync":
            with VaeClient(targets) as client:
                client.decode(bad, report=report)
        else:
            async def run():
                async with AsyncVaeClient(targets) as client:
                    await client.decode(bad, report=report)
            asyncio.run(run())
    assert report.resumes == 0 and report.targets == [free.target]
