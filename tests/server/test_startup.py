"""`vaed serve`'s start-up report and its kernel cache, on real `vaed serve` processes.

Every phase (import, model load, fast paths, warm-up per shape, gc freeze) is
logged as it ends, listed in one summary line at SERVING and exported as
metrics. `--kernel-cache DIR` becomes the process's TRITON_CACHE_DIR. On the
CPU Triton compiles nothing, so what is checked here is that the directory
reaches the process and is found again by the next start; that a second start
compiles nothing is checked on CUDA (`cuda` marker), where the first start
fills the directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from harness import serve_argv, start_serve
from prometheus_client.parser import text_string_to_metric_families

from vaed.startup import (
    CONV_PLAN_FILE,
    TRITON_CACHE_ENV,
    Phase,
    StartupTimes,
    conv_plan_file,
    phase,
    recording,
    use_kernel_cache,
)
from vaed.worker import CPU_WARMUP_LATENT_HW

SUMMARY = re.compile(r"start-up took (?P<total>\d+\.\d\d) s to SERVING: (?P<phases>.+)$")
DEVICE_GROUP = re.compile(r"(?P<device>[a-z]+(?::\d+)?) \[(?P<inner>[^\]]*)\]")
PHASE = re.compile(r"(?P<name>[a-z][a-z0-9 x-]*?) (?P<seconds>\d+\.\d\d) s")
KERNELS_AT_SERVING = "compiled kernels at start"

# random:wan2.1-tiny's spatial factor: the CPU warm-up decodes 8x8 latents into 64x64 frames
CPU_WARMUP = f"warm-up {CPU_WARMUP_LATENT_HW[0] * 8}x{CPU_WARMUP_LATENT_HW[1] * 8}"


def _phases(text: str) -> list[tuple[str, str, float]]:
    """(device, phase, seconds) of a summary line's phase list, in order ("" = the process's)."""
    out: list[tuple[str, str, float]] = []
    rest = text
    while rest:
        group = DEVICE_GROUP.match(rest)
        if group is not None:
            out += [(group["device"], p["name"], float(p["seconds"])) for p in PHASE.finditer(group["inner"])]
            rest = rest[group.end():]
        else:
            phase = PHASE.match(rest)
            assert phase is not None, f"cannot read the phases at {rest!r}"
            out.append(("", phase["name"], float(phase["seconds"])))
            rest = rest[phase.end():]
        rest = rest.removeprefix(", ")
    return out


def _summary(lines: list[str]) -> tuple[float, list[tuple[str, str, float]]]:
    (match,) = [m for line in lines if (m := SUMMARY.search(line.rstrip()))]
    return float(match["total"]), _phases(match["phases"])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _metrics(port: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
        if s.name.startswith("vaed_startup")
    }


def test_every_start_up_phase_is_logged_summed_up_at_serving_and_exported(tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    proc, _, lines = start_serve("--kernel-cache", str(cache), "--metrics-port", "0", until=KERNELS_AT_SERVING,
                                 fresh_interpreter=True)
    try:
        log = "".join(lines)
        total, phases = _summary(lines)
        assert [(d, name) for d, name, _ in phases] == [
            ("", "import"), ("cpu", "model load"), ("cpu", "fast paths"), ("cpu", CPU_WARMUP), ("", "gc freeze"),
        ]
        # the phases run one after the other on the one device, inside the total (each rounded to 0.01 s)
        assert all(s >= 0 for _, _, s in phases)
        assert sum(s for _, _, s in phases) <= total + 0.005 * (len(phases) + 1)
        # each phase has its own line as it ends (the warm-up's is the worker's own), before the summary
        ends = [log.index(text) for text in (
            "start-up: import took", "start-up: model load on cpu took", "start-up: fast paths on cpu took",
            f"warm-up on cpu at {CPU_WARMUP.removeprefix('warm-up ')}", "start-up: gc freeze took", "start-up took",
        )]
        assert ends == sorted(ends)
        assert "malloc: freed memory stays in the process" in log  # vaed_client.heap, set before the model loads
        # the metrics hold the same numbers
        (metrics_port,) = re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log)
        exported = _metrics(metrics_port)
        assert abs(exported[("vaed_startup_seconds", ())] - total) <= 0.005
        by_phase = {(name, d): s for d, name, s in phases}
        assert {labels for name, labels in exported if name == "vaed_startup_phase_seconds"} == {
            (("device", d), ("phase", name)) for name, d in by_phase}
        for (name, d), seconds in by_phase.items():
            assert abs(exported[("vaed_startup_phase_seconds", (("device", d), ("phase", name)))] - seconds) <= 0.005
    finally:
        _stop(proc)


def test_the_kernel_cache_flag_reaches_the_process_and_the_next_start_finds_it(tmp_path: Path) -> None:
    cache = (tmp_path / "kernels").resolve()
    counts = []
    for _ in range(2):
        proc, _, lines = start_serve("--kernel-cache", str(cache), until=KERNELS_AT_SERVING, fresh_interpreter=True)
        _stop(proc)
        log = "".join(lines)
        # the flag became the process's TRITON_CACHE_DIR, the variable Triton reads its cache directory from
        found = re.search(rf"Triton kernel cache: {re.escape(str(cache))} \((\d+) compiled kernels found\)", log)
        now = re.search(rf"Triton kernel cache {re.escape(str(cache))}: (\d+) compiled kernels at start, (\d+) now",
                        log)
        assert found is not None and now is not None, log
        assert int(now[1]) == int(found[1])
        counts.append((int(found[1]), int(now[2])))
        assert cache.is_dir()  # made by the flag, kept for the next start
    # the second start finds what the first one left (the CPU compiles nothing: both are 0 here)
    assert counts[1][0] == counts[0][1]


def test_an_unusable_kernel_cache_refuses_to_start(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    proc = subprocess.run(
        serve_argv("--kernel-cache", str(not_a_dir / "kernels")),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--kernel-cache {not_a_dir / 'kernels'}: cannot create it" in proc.stderr


def test_phases_go_to_the_recorder_of_their_thread_and_repeated_ones_add_up() -> None:
    times = StartupTimes(started=0.0)
    times.add("import", 1.5)
    with phase("model load"):  # no recorder on this thread (bench, tests): nothing is recorded
        pass
    with recording(times, "cuda:0"):
        with phase("fast paths"):
            pass
        times.add("fast paths", 2.0, "cuda:0")  # an encoder copy's checks join the decoder's
    times.add("gc freeze", 0.25)
    names = [(p.device, p.name) for p in times.phases]
    assert names == [("", "import"), ("cuda:0", "fast paths"), ("", "gc freeze")]
    fast = times.phases[1]
    assert fast.seconds >= 2.0
    assert times.summary(9.0) == (f"start-up took 9.00 s to SERVING: import 1.50 s, cuda:0 [fast paths "
                                  f"{fast.seconds:.2f} s], gc freeze 0.25 s")
    assert times.phases[0] == Phase("import", 1.5)


def test_the_kernel_cache_flag_is_where_triton_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRITON_CACHE_ENV, raising=False)
    use_kernel_cache(None)  # no flag: the environment stays as it was
    assert TRITON_CACHE_ENV not in os.environ
    cache = tmp_path / "a" / "b"
    monkeypatch.setenv(TRITON_CACHE_ENV, "")  # restored after the test; the flag overwrites it
    use_kernel_cache(str(cache))
    assert cache.is_dir() and os.environ[TRITON_CACHE_ENV] == str(cache)
    knobs = pytest.importorskip("triton.knobs", reason="without Triton only the variable can be checked")
    assert knobs.cache.dir == str(cache)


def test_the_conv_plan_file_lies_in_the_kernel_cache_of_a_gpu_server(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier's plan file is beside the compiled kernels (one volume to mount); a CPU
    server has none."""
    from vaed.server import conv_plan_file_for

    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path))  # what --kernel-cache sets
    assert conv_plan_file() == str(tmp_path / CONV_PLAN_FILE)
    assert conv_plan_file_for("cuda:1") == str(tmp_path / CONV_PLAN_FILE)
    assert conv_plan_file_for("cpu") is None


@pytest.mark.cuda
def test_a_second_start_on_cuda_compiles_nothing(tmp_path: Path) -> None:
    """The first start fills the cache with Triton's kernels (the fused ops' checks and the
    warm-up); the second finds them all: its cache holds as many kernels at SERVING as at start."""
    cache = (tmp_path / "kernels").resolve()
    seen = []
    for _ in range(2):
        proc, _, lines = start_serve("--kernel-cache", str(cache), "--warmup-shapes", "64x64",
                                     device=("--gpu", "0"), until=KERNELS_AT_SERVING, timeout=600,
                                     fresh_interpreter=True)
        _stop(proc)
        log = "".join(lines)
        now = re.search(rf"Triton kernel cache {re.escape(str(cache))}: (\d+) compiled kernels at start, (\d+) now",
                        log)
        assert now is not None, log
        seen.append((int(now[1]), int(now[2])))
        total, phases = _summary(lines)
        assert [name for d, name, _ in phases if d == "cuda:0"] == [
            "cuda init", "model load", "fast paths", "warm-up 64x64"], phases
    (first_at_start, first_now), (second_at_start, second_now) = seen
    assert first_at_start == 0 and first_now > 0  # the kernels were compiled into the flag's directory
    assert second_at_start == first_now == second_now  # and the second start compiled none
