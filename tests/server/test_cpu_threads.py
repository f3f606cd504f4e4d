"""`--cpu-threads`: a GPU server runs torch's CPU ops on one thread unless told otherwise;
a CPU server keeps torch's default (its decode is CPU work)."""

from __future__ import annotations

import pytest
import torch

from vaed.cli import build_parser, config_from_args
from vaed.config import GPU_SERVER_CPU_THREADS, ServerConfig
from vaed.server import set_cpu_threads


def test_gpu_servers_default_to_one_thread_and_cpu_servers_to_torchs_default() -> None:
    assert GPU_SERVER_CPU_THREADS == 1
    assert ServerConfig(devices=("cuda:0",)).intra_op_threads == 1
    assert ServerConfig(devices=("cuda:0", "cuda:1")).intra_op_threads == 1
    assert ServerConfig(devices=("cpu",)).intra_op_threads is None


@pytest.mark.parametrize("devices", [("cpu",), ("cuda:0",)])
def test_an_explicit_count_wins(devices: tuple[str, ...]) -> None:
    assert ServerConfig(devices=devices, cpu_threads=3).intra_op_threads == 3


@pytest.mark.parametrize(("config", "expected"), [
    (ServerConfig(devices=("cuda:0",)), [1]),
    (ServerConfig(devices=("cpu",), cpu_threads=2), [2]),
    (ServerConfig(devices=("cpu",)), []),
])
def test_serve_sets_the_threads_it_resolves(monkeypatch: pytest.MonkeyPatch, config: ServerConfig,
                                            expected: list[int]) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert set_cpu_threads(config) == (expected[0] if expected else None)
    assert calls == expected


def test_cli_flag() -> None:
    args = build_parser("serve").parse_args(["serve", "--device", "cpu", "--cpu-threads", "4"])
    assert config_from_args(args).cpu_threads == 4
    args = build_parser("serve").parse_args(["serve", "--device", "cpu"])
    assert config_from_args(args).cpu_threads is None


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_cli_refuses_a_count_below_one(bad: str) -> None:
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--device", "cpu", "--cpu-threads", bad])
