"""The Session's own state machine, driven as the worker and the call drive it (no server).

Every state change is a Session method; these tests walk the moves the device worker and
the call make and check what the channel and the cache see.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from vaed.engine import OutputSpec
from vaed.errors import InvalidInput
from vaed.session import CallRecord, HostGroup, Limits, Placement, Session, SessionState

Z = 16


class Recorder:
    """The worker's side of a placement: jobs queued for delivery, caches freed."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []
        self.freed: list[Any] = []
        self.placement = Placement("cpu", threading.Condition(), self.jobs.append, self.freed.append)

    def run_jobs(self) -> None:
        jobs, self.jobs[:] = list(self.jobs), []
        for job in jobs:
            job()


def new_session(loop: asyncio.AbstractEventLoop, credits: int = 4) -> Session:
    limits = Limits(z_dim=Z, scale_spatial=8, scale_temporal=4, max_batch=2, max_latent_frames=0, max_pixels=0)
    spec = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False, precision="lossless")
    return Session(CallRecord("DecodeStream", "t"), spec, limits, loop=loop, credits=credits, max_backlog_frames=8)


def group(index: int) -> HostGroup:
    return HostGroup(chunk_index=index, first_frame=0, frames=torch.zeros(1, 1), device_seconds=0.0, step_started=0.0)


def run(coro_fn: Any) -> Any:
    return asyncio.run(coro_fn())


def test_steps_frame_zero_first_then_ends_after_the_input() -> None:
    async def main() -> None:
        worker = Recorder()
        session = new_session(asyncio.get_running_loop())
        session.accept(torch.zeros(1, Z, 2, 2, 2))
        session.attach(worker.placement)
        assert session.lock is worker.placement.lock and session.device == "cpu"
        with session.lock:
            assert session.runnable()
        session.begin_step()
        assert session.busy and session.take_frame() is not None
        state = session.decoder_state(lambda: "cache")
        assert session.decoder_state(lambda: "another") is state == "cache"
        session.end_step()
        with session.lock:
            assert not session.runnable()  # frame 1 waits for frame 0's hand-over
        session.deliver_group(group(0))
        with session.lock:
            assert session.runnable()
        session.begin_step()
        assert session.take_frame() is not None
        session.end_step()
        session.deliver_group(group(1))
        with session.lock:
            assert not session.runnable()  # the input is still open: nothing to do
        session.finish_input()
        with session.lock:
            assert session.runnable()  # the end is left
        session.begin_step()
        assert session.take_frame() is None
        session.finish()
        session.end_step()
        assert session.state is SessionState.ENDED and worker.freed == []  # an ended session keeps it until close
        worker.run_jobs()
        assert (await session.next_group()).chunk_index == 0
        assert (await session.next_group()).chunk_index == 1
        assert await session.next_group() is None
        session.close()
        assert worker.freed == ["cache"] and session.state is SessionState.CLOSED

    run(main)


def test_the_last_step_of_an_ended_input_delivers_the_end_behind_its_group() -> None:
    """The worker's `finish_if_drained` after each step: while frames are left, or while the
    input is open, it does nothing; after the last frame of an ended input it queues the end
    behind that step's group, so the session needs no step of its own (and no turn) to end."""
    async def main() -> None:
        worker = Recorder()
        session = new_session(asyncio.get_running_loop())
        session.accept(torch.zeros(1, Z, 2, 2, 2))
        session.attach(worker.placement)
        session.begin_step()
        assert session.take_frame() is not None
        session.finish_if_drained()  # the input is open
        session.end_step()
        session.deliver_group(group(0))
        session.finish_input()
        session.begin_step()
        assert session.take_frame() is not None
        session.deliver_group(group(1))  # queued here as the worker queues it: behind the step
        session.finish_if_drained()
        session.end_step()
        with session.lock:
            assert session.state is SessionState.ENDED and not session.runnable()  # no step left to run
        assert (await session.next_group()).chunk_index == 0
        worker.run_jobs()
        assert (await session.next_group()).chunk_index == 1
        assert await session.next_group() is None

    run(main)


def test_a_failed_step_fails_the_session_once_and_frees_its_cache_after_the_step() -> None:
    async def main() -> None:
        worker = Recorder()
        session = new_session(asyncio.get_running_loop())
        session.accept(torch.zeros(1, Z, 3, 2, 2))
        session.attach(worker.placement)
        session.begin_step()
        session.take_frame()
        session.decoder_state(lambda: "cache")
        session.fail(InvalidInput("bad chunk"))  # the call fails it while the step runs
        assert session.state is SessionState.FAILED and session.backlog_frames == 0
        assert worker.freed == []  # the running step still uses the cache
        session.end_step(RuntimeError("the step failed too"))
        assert worker.freed == ["cache"]
        worker.run_jobs()
        with pytest.raises(InvalidInput, match="bad chunk"):  # the first failure is the call's
            await session.next_group()
        with session.lock:
            assert not session.runnable()
        session.close()
        assert worker.freed == ["cache"]  # freed once

    run(main)


def test_a_session_closed_during_its_step_frees_the_cache_when_the_step_ends() -> None:
    async def main() -> None:
        worker = Recorder()
        session = new_session(asyncio.get_running_loop())
        session.accept(torch.zeros(1, Z, 1, 2, 2))
        session.finish_input()
        session.attach(worker.placement)
        session.begin_step()
        session.take_frame()
        session.decoder_state(lambda: "cache")
        session.close()
        assert worker.freed == []
        session.finish()  # a closed session does not come back to ENDED
        session.end_step()
        assert session.state is SessionState.CLOSED and worker.freed == ["cache"] and worker.jobs == []

    run(main)
