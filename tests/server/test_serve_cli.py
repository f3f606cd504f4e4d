"""What `vaed serve --help` and `vaed bench` tell a new user, and the CPU thread default."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from vaed import bench
from vaed.cli import add_serve_arguments
from vaed.config import ServerConfig
from vaed.server import TINY_MODEL_CPU_THREADS, cpu_threads, set_cpu_threads


def _serve_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_serve_help_shows_every_default() -> None:
    """Flags with a default say it (--kernels and --log-level did not); flags without
    one (None, store_true/false, append) describe their absence in words."""
    for action in _serve_actions():
        if action.default in (None, False, [], ()) or isinstance(action, argparse._StoreFalseAction):
            continue
        assert "(default" in (action.help or ""), f"{action.option_strings[0]}: no default in --help"
    helps = {a.option_strings[0]: a.help % vars(a) for a in _serve_actions()}
    assert "(default auto)" in helps["--kernels"] and "(default INFO)" in helps["--log-level"]


@pytest.mark.parametrize(("model", "devices", "flag", "expected"), [
    ("random:wan2.1-tiny", ("cpu",), None, TINY_MODEL_CPU_THREADS),
    ("random:wan2.2-tiny?seed=3", ("cpu",), None, TINY_MODEL_CPU_THREADS),
    ("random:wan2.1", ("cpu",), None, None),  # compute-bound: torch's default, one thread per core
    ("/models/Wan2.1-T2V-1.3B-Diffusers", ("cpu",), None, None),
    ("random:wan2.1-tiny", ("cpu",), 2, 2),   # --cpu-threads wins
    ("random:wan2.1", ("cuda:0",), None, 1),
])
def test_cpu_thread_default(model: str, devices: tuple[str, ...], flag: int | None, expected: int | None) -> None:
    assert cpu_threads(ServerConfig(model=model, devices=devices, cpu_threads=flag)) == expected


def test_serve_sets_one_thread_for_a_tiny_cpu_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert set_cpu_threads(ServerConfig(model="random:wan2.1-tiny", devices=("cpu",))) == 1
    assert calls == [1]


def test_bench_without_cuda_suggests_the_cpu(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with caplog.at_level(logging.ERROR, logger="vaed.bench"):
        assert bench.run(parser.parse_args([])) == 2
    assert f"vaed bench {bench.CPU_EXAMPLE}" in caplog.text
    # the suggestion is a command that parses (and runs: tests/cli/test_bench.py runs a tiny CPU case)
    args = parser.parse_args(bench.CPU_EXAMPLE.split())
    assert args.device == "cpu" and args.cases[0].arch == "wan2.1-tiny"
