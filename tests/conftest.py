"""Fixtures shared by every test directory; the helpers they use live in
`harness.py` (test modules import from there, never from each other), and the
kernel tests' two backends in `backends.py` (its hooks are registered here)."""

from __future__ import annotations

from collections.abc import Iterator

import backends
import pytest
from harness import CUDA, RunningServer, make_config, serve_in_thread


def pytest_configure(config: pytest.Config) -> None:
    backends.make_shared_dir(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    backends.remove_shared_dir(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA (runs on the H200)")
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(skip)
    backends.put_interpreter_cases_last(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    backends.start_interpreter_child(session)  # returns None: the normal test loop follows


def pytest_terminal_summary(config: pytest.Config) -> None:
    backends.report_child_time(config)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    return backends.report_child_outcome(pyfuncitem)


def pytest_runtest_setup(item: pytest.Item) -> None:
    backends.check_interpreter_active(item)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    backends.record_child_report(report)


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
