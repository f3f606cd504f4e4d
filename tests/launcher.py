"""`vaed serve` processes forked from an interpreter that has already imported what a server
imports, so a test's server costs its own start-up and not torch's and diffusers' again.

A tiny CPU server spends ~6 s of CPU before SERVING, ~5.5 s of it importing: torch, grpc and
vaed (~2 s), then diffusers' AutoencoderKLWan, whose package pulls in every diffusers model and
torch._dynamo (~4 s on the 2-core CI machine). The suite starts dozens of servers, so that import
was a third of its CPU. Here each test process keeps one `multiprocessing` fork server, started
with those modules imported; every server is a fork of it that runs the real `vaed.cli.main`
(argument parsing, model build, warm-up, signal handling and exit codes are the command's own):
0.54-0.64 s of CPU to SERVING, measured from /proc on the loaded 2-core machine.
A server's stdout and stderr go to a pipe, as with `subprocess.Popen(..., stdout=PIPE,
stderr=STDOUT, text=True)`, and `ServeProcess` has the Popen methods the tests use.

`forked_followers()` does the same for a CPU sharded group's follower ranks, which
`vaed.parallel.launch` otherwise spawns (the spawn context a CUDA group needs: ~6 s of CPU per
rank, 9 ranks in tests/parallel/test_sharded_decode.py); tests/parallel/test_launch.py keeps
the spawn context, so the launch a server makes stays tested as it runs.

What a fork cannot show, tests keep to a fresh interpreter (`subprocess.Popen`): the start-up
phase times (a fork's "import" phase is its own few ms) and settings read when a module is first
imported (`--kernel-cache` sets TRITON_CACHE_DIR before triton is imported), and the console
commands themselves (tests/cli).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from multiprocessing import reduction
from typing import IO, Any

# what a CPU `vaed serve` has imported by SERVING (python -X importtime), minus the cheap rest
PRELOAD = ["vaed.cli", "vaed.server", "vaed.patches", "vaed.parallel.launch",
           "diffusers.models.autoencoders.autoencoder_kl_wan"]

_context: Any = None
_context_lock = threading.Lock()


def _fork_context() -> Any:
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _context = context
        return _context


class _InheritedFd:
    """A file descriptor the child receives as its own (duplicated while the process object is
    pickled for the fork server, the way multiprocessing passes sockets)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return int(dup.detach())


def _serve(argv: list[str], env: dict[str, str], cwd: str, output_fd: int) -> None:
    """The child: the command's environment, directory and output, then `vaed.cli.main`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(output_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as PYTHONUNBUFFERED runs it
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["vaed", *argv]
    from vaed.cli import main

    sys.exit(main(argv))


class ServeProcess:
    """The parts of `subprocess.Popen` the tests use, for a forked `vaed serve`."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        read_fd, write_fd = os.pipe()
        self.args = argv
        self._process = _fork_context().Process(
            target=_serve, args=(argv, env, os.getcwd(), _InheritedFd(write_fd)), name="vaed serve")
        try:
            self._process.start()
        finally:
            os.close(write_fd)
        self.pid: int = self._process.pid
        self.stdout: IO[str] = open(read_fd, encoding="utf-8", errors="replace")
        self.stderr = None

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return int(code)

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:  # not yet reaped: the pid is still this process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        out = self.stdout.read()
        self.wait(timeout)
        return out, None


@contextlib.contextmanager
def forked_followers() -> Iterator[None]:
    """While open, `vaed.parallel.launch.start_sharded_engine` starts its followers from this
    module's fork server (open it around the call: the followers are started there)."""
    from vaed.parallel import launch

    real = launch.mp
    launch.mp = types.SimpleNamespace(get_context=lambda method: _fork_context())  # type: ignore[assignment]
    try:
        yield
    finally:
        launch.mp = real


def vaed_argv(command_line: list[str]) -> list[str]:
    """`[sys.executable, "-m", "vaed.cli", *argv]` -> argv."""
    if command_line[:3] != [sys.executable, "-m", "vaed.cli"]:
        raise ValueError(f"not a `python -m vaed.cli` command line: {command_line[:3]}")
    return command_line[3:]
