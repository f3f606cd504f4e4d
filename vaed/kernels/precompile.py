"""vaed's Triton kernels compiled ahead of their first launch, in parallel and without a GPU.

A server's start-up checks and warm-up launch every kernel variant it serves with, and each
first launch compiled one on the device thread, one after another: fresh H200 machines took
42-81 s to SERVING against 14-21 s with a warm kernel cache. Triton describes each compile by a
record (`jit_post_compile_hook`'s `specialization_data`: the kernel's name, signature, constexpr
values, argument alignments and launch options), and its compiler needs the GPU's architecture,
not the GPU.

- `recording()` collects the records of the vaed kernels compiled in this process;
- `manifests/sm<arch>.json` beside this module holds the records of a server's start-ups
  (Wan2.1 and Wan2.2, each with and without the encoder; both tiers, the default warm-up
  sizes) on that GPU architecture, written on such a GPU by `scripts/record_kernels.py`, and
  names each kind of start's (`start_name`: sm_90's Wan2.1 decode start launches 190 of the
  302 variants, Wan2.2's 154), so a server compiles only its own;
- `launch_of` turns a record back into the launch it describes (arguments of the recorded
  types, alignments and constexpr values; the recorded launch options), and a worker compiles
  that launch (`JITFunction.warmup`), so the installed Triton specializes it itself. A record is
  written in its recording Triton's own format: Triton 3.7 and 3.8 cannot preload 3.6's (no
  target in it), and key a variant's argument attributes otherwise, so a preloaded record of
  another Triton would compile under a key no launch looks up;
- `compile_ahead` compiles records for one architecture into Triton's cache, in worker processes
  that never touch a GPU (processes, because Triton's compiler holds the GIL for most of a
  compile), with each kernel's launcher where the host can build it (it links against the CUDA
  driver library). `vaed precompile` runs it on every record at image build; `vaed serve` on
  its start's records while the model loads, when the cache lacks them
  (`start_ensure_compiled`: the kernels' first fetch waits for it).

The cache entries are Triton's own, under the keys the launches look up (source, signature,
target, options, Triton's version and environment); a variant not in the manifest compiles at
its first launch as before, and a record that describes no launch of a vaed kernel is reported
and skipped.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import pathlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vaed.kernels import _runtime as rt

log = logging.getLogger("vaed.kernels.precompile")

MANIFESTS = pathlib.Path(__file__).with_name("manifests")
MARKER_PREFIX = "vaed-precompiled"  # one empty file per (record set, Triton, kernels' source, arch)
KERNEL_PREFIX = "vaed.kernels."    # records of other Triton users in the process are not ours


@dataclass
class CompileReport:
    arch: int
    kernels: int = 0          # variants compiled (or found in the cache)
    launchers: int = 0        # their launchers built (0 where the host has no CUDA driver library)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        text = (f"{self.kernels} Triton kernels for sm_{self.arch} ({self.launchers} launchers) "
                f"in {self.seconds:.1f} s")
        return text + (f"; {len(self.failures)} records skipped" if self.failures else "")


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect the records of the vaed kernels compiled in this process inside the block (in
    compile order, each once); Triton's hook is restored after it."""
    from triton import knobs

    records: list[str] = []
    seen: set[str] = set()
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*, compile: dict[str, Any], **rest: Any) -> Any:
        record = portable(compile["specialization_data"])
        if json.loads(record)["name"].startswith(KERNEL_PREFIX) and record not in seen:
            seen.add(record)
            records.append(record)
        return previous(compile=compile, **rest) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield records
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def portable(record: str) -> str:
    """A record without what names the recording host's install: the libdevice path in its
    options. A launch never passes one (Triton's backend fills in its own install's), so the
    compile from the record takes the compiling host's path, and the key its launches look up."""
    obj = json.loads(record)
    obj["options"].pop("extern_libs", None)
    return json.dumps(obj)


# Element types of the pointer and scalar arguments, as a record names them.
_TORCH_DTYPES = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
    "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8,
}
# An integer argument of each width: divisible by 16 or not (Triton specializes on that; 1 is a
# constexpr in the record), 2^32 up for the 64-bit ones.
_INT_BASES = {"i32": 0, "i64": 2**32}
_FLOAT_SCALARS = ("fp16", "bf16", "fp32", "fp64")  # never specialized on their value
# Launch options Triton adds to every record's key itself, not the launch's.
_TRITON_SET_OPTIONS = ("debug", "instrumentation_mode")


def launch_of(record: str) -> tuple[str, list[Any], dict[str, Any]]:
    """The kernel's name, arguments and launch options of a launch that Triton specializes as
    `record` describes: a CPU tensor of the recorded element type for each pointer, 16-byte
    aligned where the record says so and off by one element where not; an integer divisible by
    16 or not, of the recorded width; the recorded constexpr values; the options the recorded
    launch passed (the key's tail). Raises ValueError for what no vaed launch passes."""
    obj = json.loads(record)
    constants = {key[0]: value for key, value in zip(obj["constant_keys"], obj["constant_vals"], strict=True)}
    attrs = {key[0]: value for key, value in zip(obj["attrs_keys"], obj["attrs_vals"], strict=True)}
    args: list[Any] = []
    for i, kind in enumerate(obj["signature"].values()):
        aligned = ["tt.divisibility", 16] in attrs.get(i, [])
        if kind == "constexpr":
            value = constants[i]
            value = value["constexpr"] if isinstance(value, dict) and "constexpr" in value else value
            if value is not None and not isinstance(value, (bool, int, float)):
                raise ValueError(f"a constexpr argument {value!r}")
            args.append(value)
        elif kind.startswith("*") and kind[1:] in _TORCH_DTYPES:
            storage = torch.empty(64, dtype=_TORCH_DTYPES[kind[1:]])
            args.append(storage if aligned else storage[1:])
        elif kind in _INT_BASES:
            args.append(_INT_BASES[kind] + (16 if aligned else 17))
        elif kind in _FLOAT_SCALARS:
            args.append(0.5)
        else:
            raise ValueError(f"an argument of type {kind}")
    _, brace, tail = obj["key"].rpartition("]{")  # str(specialization) + str(launch options)
    if not brace:
        raise ValueError("a key without its launch options")
    options = ast.literal_eval("{" + tail)
    return obj["name"], args, {k: v for k, v in options.items() if k not in _TRITON_SET_OPTIONS}


def manifest_path(arch: int) -> pathlib.Path:
    """The packaged records of one GPU architecture."""
    return MANIFESTS / f"sm{arch}.json"


def start_name(family: str | None, encode: bool) -> str | None:
    """The name a manifest gives the records of one kind of server start: its model's kernel
    family (`vaed.models.kernel_family`), with `+encode` when it serves Encode too."""
    return None if family is None else family + ("+encode" if encode else "")


def load_manifest(path: pathlib.Path, start: str | None = None) -> list[str]:
    """The records in a manifest file ([] when there is none): the named start's where the file
    lists that start, else all of them."""
    return _of_start(*_read_manifest(path), start)


def save_manifest(starts: Mapping[str, Iterable[str]], path: pathlib.Path) -> int:
    """Write each named start's records into the file, replacing that start's earlier ones and
    keeping the file's other starts; its records are their union, sorted (a stable diff), and
    each start lists its own by index. Returns the number of records."""
    import triton

    old_records, old_starts = _read_manifest(path)
    kept = {name: [old_records[i] for i in indices] for name, indices in old_starts.items()}
    merged = {**kept, **{name: sorted(set(records)) for name, records in starts.items()}}
    records = sorted(set().union(*merged.values()))
    index = {record: i for i, record in enumerate(records)}
    manifest = {"triton": triton.__version__, "kernels": records,
                "starts": {name: sorted(index[r] for r in merged[name]) for name in sorted(merged)}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=0) + "\n")
    return len(records)


def _read_manifest(path: pathlib.Path) -> tuple[list[str], dict[str, list[int]]]:
    """(every record, each start's record indices) of a manifest file; nothing when there is none."""
    if not path.exists():
        return [], {}
    manifest = json.loads(path.read_text())
    return list(manifest["kernels"]), dict(manifest.get("starts", {}))


def _of_start(records: list[str], starts: dict[str, list[int]], start: str | None) -> list[str]:
    indices = starts.get(start) if start is not None else None
    return records if indices is None else [records[i] for i in indices]


def arch_of(device: str) -> int:
    """The compute capability of a CUDA device as Triton's target names it (H100/H200: 90)."""
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return major * 10 + minor


def compile_ahead(records: list[str], arch: int, workers: int) -> CompileReport:
    """Compile `records` for sm_`arch` into Triton's cache ($TRITON_CACHE_DIR, inherited by the
    workers) in `workers` spawned processes."""
    report = CompileReport(arch)
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    with concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=context,
                                                initializer=_start_worker, initargs=(arch,)) as pool:
        for compiled, launcher, failure in pool.map(_compile_one, records):
            report.kernels += compiled
            report.launchers += launcher
            if failure:
                report.failures.append(failure)
    report.seconds = time.perf_counter() - started
    return report


def ensure_compiled(arch: int, cache_dir: str, workers: int, records: list[str] | None = None,
                    start: str | None = None) -> CompileReport | None:
    """Compile the packaged records of sm_`arch` (those of `start` where the manifest names it),
    or `records`, unless `cache_dir` already holds them: their marker file, or that of all the
    packaged records. None when nothing needed compiling or no records exist for it."""
    packaged, starts = _read_manifest(manifest_path(arch))  # read once: ~1 MB of JSON for sm_90
    records = _of_start(packaged, starts, start) if records is None else records
    if not records or not rt.triton_available() or rt.interpreter_active():
        return None
    marker = _marker(cache_dir, records, arch)
    if marker.exists() or (packaged and _marker(cache_dir, packaged, arch).exists()):
        return None
    report = compile_ahead(records, arch, workers)
    if report.failures:  # e.g. all of them under another Triton: one line, not one a record
        shown = "; ".join(report.failures[:3]) + ("; ..." if len(report.failures) > 3 else "")
        log.warning("%d of %d kernel records skipped (those variants compile at their first launch): %s",
                    len(report.failures), len(records), shown)
    marker.touch()
    return report


def start_ensure_compiled(archs: Iterable[int], cache_dir: str, workers: int, start: str | None = None
                          ) -> concurrent.futures.Future[list[CompileReport]]:
    """`ensure_compiled` of `start`'s records for each architecture on a thread of its own (the
    compiling is in the worker processes), returned at once; every vaed kernel's first fetch
    waits for it, so a server loads its model meanwhile and its checks find the kernels in the
    cache."""
    future: concurrent.futures.Future[list[CompileReport]] = concurrent.futures.Future()

    def run() -> None:
        try:
            reports = [ensure_compiled(arch, cache_dir, workers, start=start) for arch in sorted(set(archs))]
            future.set_result([report for report in reports if report is not None])
        except BaseException as exc:  # reported by the caller; the launches then compile as before
            future.set_exception(exc)

    rt.compile_ahead_in_flight(future)
    threading.Thread(target=run, name="vaed-precompile", daemon=True).start()
    return future


def default_workers() -> int:
    """Processes for `compile_ahead`: the cores this process may run on but one (the model
    loads meanwhile), at most 16 (each imports torch, ~0.4 GB while it lives)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores - 1))


def _marker(cache_dir: str, records: list[str], arch: int) -> pathlib.Path:
    return pathlib.Path(cache_dir, f"{MARKER_PREFIX}-sm{arch}-{_digest(records, arch)}")


def _digest(records: list[str], arch: int) -> str:
    """What the cache entries depend on besides the records: Triton's version and the kernels'
    source (a changed kernel has other keys, so it is compiled again)."""
    import triton

    h = hashlib.sha256(f"{triton.__version__}\n{arch}\n".encode())
    for record in records:
        h.update(record.encode())
    for source in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


# -- worker processes ----------------------------------------------------------------------------


class _OfflineDriver:
    """The part of Triton's active driver that compiling needs: a device index, its target and
    a stream handle (a `warmup` asks for one and launches nothing). Anything else (a launch,
    device properties) is a mistake here and raises."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self._target

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"compiling without a GPU: the driver has no {name}")


# Compiling is background work beside a server's model load, whose diffusers import (7-16 s on
# an H200 host) is the start's critical path: the kernels are needed only after it, and the
# load ran 2-3 s longer beside 15 compiling processes at the same priority.
WORKER_NICENESS = 10


def _start_worker(arch: int) -> None:
    os.nice(WORKER_NICENESS)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # this process compiles; it never needs a device
    os.environ.pop("TRITON_INTERPRET", None)  # nor does it interpret: the records are for GPUs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(_OfflineDriver(GPUTarget("cuda", arch, 32)))
    import vaed.kernels  # noqa: F401  (registers every kernel under its name)


def _compile_one(record: str) -> tuple[int, int, str | None]:
    """(kernels compiled, launchers built, the failure) of one record, in a worker process."""
    name = json.loads(record)["name"]
    try:
        name, args, options = launch_of(record)
        kernel = rt.kernel_named(name).warmup(*args, grid=(1,), **options)
    except Exception as exc:  # a record of other source (a changed or renamed kernel)
        return 0, 0, f"{name}: {type(exc).__name__}: {exc}"
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)  # built once per signature into the cache
    except Exception:  # no CUDA driver library to link against (an image build): built at first launch
        return 1, 0, None
    return 1, 1, None
