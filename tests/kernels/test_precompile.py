"""Kernels compiled ahead without a GPU (`vaed.kernels.precompile`, `vaed precompile`).

A record is made the way a server makes one: Triton compiles a vaed kernel for a launch (here
a `warmup` under the compile-only driver for sm_90, in a child process, since the driver is
process-wide) and `recording()` keeps its specialization. Compiled ahead in spawned workers,
it must land in the cache entry that compile made: the key a launch on an H100/H200 looks up.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from vaed.kernels import precompile

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]

# In a child: record the residual kernel's compile for a [1, 96, 2, 8, 8] bf16 channels-last
# launch (what `bias_residual_add` passes), compiled for sm_90 under the compile-only driver.
RECORD = """
import json, sys, torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from vaed.kernels import precompile, residual
from vaed.kernels import _runtime as rt

driver.set_active(precompile._OfflineDriver(GPUTarget("cuda", 90, 32)))
x = torch.empty(1, 96, 2, 8, 8, dtype=torch.bfloat16).to(memory_format=torch.channels_last_3d)
block_p, block_c, warps = rt.channel_tile(96)
with precompile.recording() as records:
    for _ in range(2):  # a second launch of the same variant compiles nothing and records nothing
        residual._kernel().warmup(x, x, x, x, 128, 96, HAS_BIAS=True, ROUND_BIAS=True, IDX64=False,
                                  BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps, grid=(1,))
from triton import knobs
assert knobs.runtime.jit_post_compile_hook is None, "the hook outlived recording()"
json.dump(records, sys.stdout)
"""


def _child_env(cache: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return dict(env, TRITON_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client"), env.get("PYTHONPATH", "")]))


def _entries(cache: pathlib.Path) -> set[str]:
    return {entry.name for entry in cache.iterdir() if entry.is_dir()} if cache.exists() else set()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], set[str]]:
    """(the records, the cache entries their in-process compile made)."""
    cache = tmp_path_factory.mktemp("compiled-in-process")
    out = subprocess.run([sys.executable, "-c", RECORD], env=_child_env(cache), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), _entries(cache)


def test_a_recorded_kernel_compiles_ahead_into_the_entry_its_launch_made(
        recorded: tuple[list[str], set[str]], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records, made = recorded
    assert len(records) == 1 and json.loads(records[0])["name"] == "vaed.kernels.residual._bias_residual_add_kernel"
    assert "extern_libs" not in json.loads(records[0])["options"]  # no path of this install in it
    assert made, "the in-process compile wrote no cache entry"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    report = precompile.compile_ahead(records, arch=90, workers=2)
    assert (report.kernels, report.failures) == (1, [])
    assert made <= _entries(tmp_path)  # the same key: source, signature, sm_90, options
    assert list(tmp_path.glob("*/*.cubin")), "no sm_90 binary was written"


def test_ensure_compiled_compiles_once_per_cache_and_skips_bad_records(
        recorded: tuple[list[str], set[str]], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    records, _ = recorded
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    other = json.loads(records[0])
    other["name"] = "vaed.kernels.residual._no_such_kernel"
    with_stale = [*records, json.dumps(other)]
    first = precompile.ensure_compiled(90, str(tmp_path), 1, with_stale)
    assert first is not None and first.kernels == 1
    assert len(first.failures) == 1 and "no vaed kernel is named" in first.failures[0]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].startswith("1 of 2 kernel records skipped")  # one line for all
    assert precompile.ensure_compiled(90, str(tmp_path), 1, with_stale) is None  # its marker is there
    assert precompile.ensure_compiled(90, str(tmp_path / "other"), 1, []) is None  # nothing to compile
    assert not (tmp_path / "other").exists()


def test_a_manifest_names_each_starts_records_and_a_rewrite_replaces_only_its_own(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "sm90.json"
    assert precompile.save_manifest({"wan2.1": ["b", "a"], "wan2.2": ["b", "c"]}, path) == 3
    assert precompile.load_manifest(path) == ["a", "b", "c"]
    assert precompile.load_manifest(path, "wan2.2") == ["b", "c"]
    assert precompile.load_manifest(path, "wan2.1-tiny") == ["a", "b", "c"]  # a start it lacks: all of them
    assert precompile.save_manifest({"wan2.1": ["d"]}, path) == 3  # "a" was only wan2.1's
    assert (precompile.load_manifest(path, "wan2.1"), precompile.load_manifest(path)) == (["d"], ["b", "c", "d"])
    assert precompile.start_name("wan2.2", encode=True) == "wan2.2+encode"
    assert precompile.start_name(None, encode=False) is None


def test_a_server_compiles_its_starts_records_unless_the_cache_holds_them_all(
        recorded: tuple[list[str], set[str]], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vaed serve` compiles only its model's start (`start`); a cache that `vaed precompile`
    filled with every packaged record (its marker) needs nothing more."""
    records, made = recorded
    stale = json.dumps({**json.loads(records[0]), "name": "vaed.kernels.residual._no_such_kernel"})
    manifest = tmp_path / "sm90.json"
    precompile.save_manifest({"wan2.1": records, "wan2.2": [*records, stale]}, manifest)
    monkeypatch.setattr(precompile, "manifest_path", lambda arch: manifest)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    served = tmp_path / "served"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(served))
    report = precompile.ensure_compiled(90, str(served), 1, start="wan2.1")
    assert report is not None and (report.kernels, report.failures) == (1, []) and made <= _entries(served)
    assert precompile.ensure_compiled(90, str(served), 1, start="wan2.1") is None
    other = precompile.ensure_compiled(90, str(served), 1, start="wan2.2")  # another set: its own marker
    assert other is not None and (other.kernels, len(other.failures)) == (1, 1)
    filled = tmp_path / "filled"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(filled))
    assert precompile.ensure_compiled(90, str(filled), 1, precompile.load_manifest(manifest)) is not None
    assert precompile.ensure_compiled(90, str(filled), 1, start="wan2.1") is None


def test_vaed_precompile_fills_the_named_cache_without_a_gpu(
        recorded: tuple[list[str], set[str]], tmp_path: pathlib.Path) -> None:
    records, made = recorded
    manifest = tmp_path / "records.json"
    manifest.write_text(json.dumps({"kernels": records}))
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "vaed.cli", "precompile", "--kernel-cache", str(cache), "--workers", "1"]
    env = _child_env(tmp_path / "unused")
    missing_arch = subprocess.run([*command, "--manifest", str(manifest)], env=env, capture_output=True, text=True,
                                  timeout=300)
    assert missing_arch.returncode != 0 and "name the architecture (--arch 90" in missing_arch.stderr
    first = subprocess.run([*command, "--manifest", str(manifest), "--arch", "90"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "1 Triton kernels for sm_90" in first.stdout and made <= _entries(cache)
    second = subprocess.run([*command, "--manifest", str(manifest), "--arch", "90"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0 and "already holds the kernels for sm_90" in second.stdout
    missing = subprocess.run([*command, "--manifest", str(tmp_path / "none.json"), "--arch", "90"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and f"--manifest {tmp_path / 'none.json'}: no such file" in missing.stderr
    (tmp_path / "empty.json").write_text(json.dumps({"kernels": []}))
    empty = subprocess.run([*command, "--manifest", str(tmp_path / "empty.json"), "--arch", "90"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert empty.returncode != 0 and "no kernel records for sm_90" in empty.stderr
    (tmp_path / "junk.json").write_text("not json")
    junk = subprocess.run([*command, "--manifest", str(tmp_path / "junk.json"), "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert junk.returncode != 0 and "is no kernel manifest (JSONDecodeError" in junk.stderr
    assert "Traceback" not in junk.stderr
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"kernels": [*records, json.dumps(
        {**json.loads(records[0]), "name": "vaed.kernels.residual._no_such_kernel"})]}))
    partly = subprocess.run([*command, "--manifest", str(stale), "--arch", "90"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert partly.returncode == 1 and "1 of 2 kernel records for sm_90 were not compiled" in partly.stderr


def test_the_packaged_sm90_records_name_vaed_kernels_with_their_parameters() -> None:
    """Every packaged record (a server's start-ups, recorded on an H200) names a registered
    kernel and that kernel's parameters, in order (a kernel whose parameters changed needs its
    records made again: `scripts/record_kernels.py`), and no path of the recording host; the
    manifest names the records of each kind of start."""
    import vaed.kernels  # noqa: F401  (registers the kernels)
    from vaed.kernels import _runtime as rt

    path = precompile.manifest_path(90)
    records = [json.loads(record) for record in precompile.load_manifest(path)]
    assert records, f"{path} holds no records"
    for record in records:
        assert "extern_libs" not in record["options"], "a record names its recording host's libdevice path"
        function = rt._KERNELS[record["name"]][0]
        assert list(record["signature"]) == list(inspect.signature(function).parameters), record["name"]
    starts = json.loads(path.read_text())["starts"]
    assert set(starts) == {"wan2.1", "wan2.1+encode", "wan2.2", "wan2.2+encode"}  # what `vaed serve` asks for
    assert sorted(set().union(*starts.values())) == list(range(len(records)))  # every record is some start's
    for family in ("wan2.1", "wan2.2"):  # an encode server's start launches its decode start's kernels too
        decode, encode = (set(precompile.load_manifest(path, name)) for name in (family, f"{family}+encode"))
        assert decode and decode < encode


# In a child with a compiling worker's driver (sm_90, no GPU): each record of the JSON list in
# argv[1] compiled from the launch it describes, and the record this Triton writes for it.
RELAUNCH = """
import json, sys
from vaed.kernels import _runtime as rt
from vaed.kernels import precompile
precompile._start_worker(90)
made = []
for record in json.load(open(sys.argv[1])):
    name, args, options = precompile.launch_of(record)
    with precompile.recording() as records:
        rt.kernel_named(name).warmup(*args, grid=(1,), **options)
    assert len(records) == 1, (name, records)
    made += records
json.dump(made, sys.stdout)
"""


def _packaged_sample() -> list[str]:
    """One packaged record of each kernel, and one whose cache pointer is not 16-byte aligned
    (the 1-D conv-input kernel's cache slices): every kind of argument the records hold."""
    first: dict[str, str] = {}
    unaligned = []
    for record in precompile.load_manifest(precompile.manifest_path(90)):
        obj = json.loads(record)
        first.setdefault(obj["name"], record)
        attrs = {key[0]: value for key, value in zip(obj["attrs_keys"], obj["attrs_vals"], strict=True)}
        if any(kind.startswith("*") and not attrs.get(i) for i, kind in enumerate(obj["signature"].values())):
            unaligned.append(record)
    assert unaligned, "no packaged record has an unaligned pointer any more: pick another sample"
    return [*first.values(), unaligned[0]]


def _relaunch(records: list[str], cache: pathlib.Path, tmp: pathlib.Path) -> list[str]:
    listing = tmp / f"records-{len(list(tmp.iterdir()))}.json"
    listing.write_text(json.dumps(records))
    out = subprocess.run([sys.executable, "-c", RELAUNCH, str(listing)], env=_child_env(cache),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _described(launch: tuple[str, list[Any], dict[str, Any]]) -> tuple[Any, ...]:
    """What Triton specializes a launch on: tensors by element type and 16-byte alignment."""
    import torch

    name, args, options = launch
    kinds = [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (type(a), a) for a in args]
    return name, kinds, options


def test_the_packaged_records_compile_ahead_under_this_triton_where_its_launches_compile(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged records were written by the Triton of the recording H200 (the manifest names
    it); another Triton in the range vaed admits reads them as launches (`launch_of`) and
    compiles each into the cache entry its own launch of that variant makes. A launch made from
    the record this Triton writes for it is the record's launch again (same arguments as Triton
    specializes them, same options), and compiles to the same record: nothing of the
    specialization is lost on the way."""
    sample = _packaged_sample()
    launched = tmp_path / "launched"
    made = _relaunch(sample, launched, tmp_path)
    assert [json.loads(r)["name"] for r in made] == [json.loads(r)["name"] for r in sample]
    for packaged, own in zip(sample, made, strict=True):
        assert _described(precompile.launch_of(own)) == _described(precompile.launch_of(packaged))
    again = _relaunch(made, tmp_path / "relaunched", tmp_path)
    assert [json.loads(r) for r in again] == [json.loads(r) for r in made]

    ahead = tmp_path / "ahead"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(ahead))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    report = precompile.compile_ahead(sample, arch=90, workers=2)
    assert (report.kernels, report.failures) == (len(sample), [])
    assert _entries(launched) <= _entries(ahead)


def _gate_probe(x_ptr):  # pragma: no cover - jitted, never launched
    pass


def test_a_kernels_first_fetch_waits_for_the_compile_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """While kernels are being compiled ahead (`start_ensure_compiled` in a server's start), a
    kernel's first fetch blocks on it: the device thread's first launch then finds its variant in
    the cache. Seen by the waiter the fetch puts on the future, then by the fetch's return only
    after the future is done."""
    import concurrent.futures
    import threading
    import time

    from vaed.kernels import _runtime as rt

    monkeypatch.setattr(rt, "_ahead", None)
    get = rt.jit_lazy(_gate_probe, globals())
    ahead: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
    rt.compile_ahead_in_flight(ahead)
    events: list[str] = []
    fetch = threading.Thread(target=lambda: (get(), events.append("fetched")))
    fetch.start()
    deadline = time.monotonic() + 60  # bounds a failure only; a waiting fetch is seen at once
    while not ahead._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    assert ahead._waiters, "the first fetch did not wait for the compile ahead"  # type: ignore[attr-defined]
    assert events == [] and fetch.is_alive()
    events.append("compiled ahead")
    ahead.set_result([])
    fetch.join(60)
    assert events == ["compiled ahead", "fetched"]
    assert get() is get()  # later fetches return the one jitted kernel


@pytest.mark.parametrize(("model", "encode", "start"), [
    ("random:wan2.1", False, "wan2.1"), ("random:wan2.2?seed=2", True, "wan2.2+encode")])
def test_serve_compiles_ahead_the_records_of_its_models_start(
        monkeypatch: pytest.MonkeyPatch, model: str, encode: bool, start: str) -> None:
    import concurrent.futures

    from vaed.config import ServerConfig
    from vaed.server import compile_kernels_ahead

    asked: list[tuple[set[int], str, str | None]] = []

    def start_ensure_compiled(archs: Any, cache_dir: str, workers: int, start: str | None = None) -> Any:
        asked.append((set(archs), cache_dir, start))
        done: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        done.set_result([])
        return done

    monkeypatch.setattr(precompile, "arch_of", lambda device: 90)  # an H200's, on this CPU
    monkeypatch.setattr(precompile, "start_ensure_compiled", start_ensure_compiled)
    compile_kernels_ahead(ServerConfig(model=model, devices=("cuda:0",), encode=encode), "/cache")
    assert asked == [({90}, "/cache", start)]


def _niceness() -> int:
    return os.nice(0)


def test_the_compiling_processes_run_below_the_model_load() -> None:
    """The workers `compile_ahead` starts yield the CPU to the server's model load beside them."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=precompile._start_worker,
                                                initargs=(90,)) as pool:
        worker = pool.submit(_niceness).result(timeout=300)
    assert worker == min(19, os.nice(0) + precompile.WORKER_NICENESS)
