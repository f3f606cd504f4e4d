"""The two backends every kernel test runs on, and how the interpreter one runs.

A kernel test takes a ``backend`` parameter (``kernel_cases`` builds its cases):

- ``cuda``: the GPU, where every fused op must give the reference's bits.
  These cases carry the ``cuda`` marker and skip without a GPU.
- ``interpreter``: Triton's interpreter (``TRITON_INTERPRET=1``) on the CPU,
  so CPU CI runs the same test functions. Triton picks the interpreter when a
  kernel is first decorated, so it must be set before triton is imported and
  must not leak into the process that runs the CUDA and server tests: the
  main pytest process runs no interpreter case itself. At the start of its
  test loop it starts the selected interpreter cases in two child pytests
  (every other case each) with ``TRITON_INTERPRET=1`` set from the start (one
  torch import, one interpreter each), in the background: the other tests run
  meanwhile, and the interpreter cases, sorted last, each wait for the
  children and report their outcome (pass, skip reason, or the child's failure
  text) under their own ids. With pytest-xdist the first worker starts the
  children and every worker reads their results from a folder the main
  process made. These cases carry
  ``slow``.

The interpreter copies bytes exactly, so data movement is held bit-exact on
both backends; its fp32->bf16 cast truncates and its ``exp`` is numpy's, so
what depends on those (``Backend.exact``) is held to a tolerance there. Its
grids are smaller than the GPU's: it runs every program instance in numpy.

Lead's command for the GPU cases (an H200):
``python -m pytest -q tests/kernels tests/parallel -m cuda``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import torch

# Set in the child pytest: the file it appends one JSON line per test phase to.
RESULTS_ENV = "VAED_INTERPRETER_RESULTS"
IN_CHILD = RESULTS_ENV in os.environ
CHILD_TIMEOUT_S = 1800  # the whole interpreter run; each case is also under pytest-timeout's limit


@dataclass(frozen=True)
class Backend:
    name: str  # "cuda" or "interpreter"

    @property
    def interpreter(self) -> bool:
        return self.name == "interpreter"

    @property
    def device(self) -> str:
        return "cpu" if self.interpreter else "cuda"

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def exact(self, dtype: torch.dtype | None = None, *, exp: bool = False, bf16_cast: bool = False) -> bool:
        """Whether this backend reproduces the reference's bits for a result that uses ``exp``
        (norm+SiLU) or rounds fp32 to bf16 (``bf16_cast`` with a bf16 ``dtype``): always on the
        GPU; under the interpreter only pure data movement and fp32/fp16 roundings."""
        if not self.interpreter:
            return True
        return not exp and not (bf16_cast and dtype == torch.bfloat16)

    def __str__(self) -> str:
        return self.name


CUDA_BACKEND = Backend("cuda")
INTERPRETER = Backend("interpreter")


def grid(*axes: Iterable[Any]) -> list[tuple[Any, ...]]:
    """Every combination of the axes, as rows for ``kernel_cases``."""
    return list(itertools.product(*axes))


_DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _case_id(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return _DTYPE_IDS.get(value, str(value).removeprefix("torch."))
    if isinstance(value, tuple):
        return "(" + ",".join(map(_case_id, value)) + ")"
    return str(value)


def kernel_cases(argnames: str, *, cuda: Iterable[tuple[Any, ...]] = (),
                 interpreter: Iterable[tuple[Any, ...]] = ()) -> pytest.MarkDecorator:
    """``parametrize("backend," + argnames)`` over each backend's own grid of rows, with ids
    ``<backend>-<value>-...`` (dtypes as bf16/fp16/fp32, tuples in parentheses)."""
    names = ["backend", *(name.strip() for name in argnames.split(",") if name.strip())]
    params = []
    for backend, rows, mark in ((CUDA_BACKEND, cuda, pytest.mark.cuda), (INTERPRETER, interpreter, pytest.mark.slow)):
        for row in rows:
            params.append(pytest.param(backend, *row, marks=mark, id="-".join([backend.name, *map(_case_id, row)])))
    return pytest.mark.parametrize(names, params)


def runs_under_interpreter(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("backend") == INTERPRETER


# --- the child run (hooks; tests/conftest.py exposes them) -------------------------------------

_RESULTS = pytest.StashKey[tuple[dict[str, dict[str, str]], str]]()
_OWNED_DIR = pytest.StashKey[str]()
# Set by the main pytest for itself and its xdist workers: where the child's files go.
SHARED_DIR_ENV = "VAED_INTERPRETER_DIR"
_DONE_FILE = "done.json"
CHILDREN = 2  # interpreter child pytests, each with every CHILDREN-th case


def _merge(results: dict[str, dict[str, str]], report: dict[str, str]) -> None:
    """One outcome per test from its setup/call/teardown reports: a failure anywhere wins,
    then a skip, else the call's pass."""
    seen = results.setdefault(report["nodeid"], {"outcome": "passed", "text": ""})
    if report["outcome"] == "failed" and seen["outcome"] != "failed":
        seen.update(outcome="failed", text=f"[{report['when']}] {report['text']}")
    elif report["outcome"] == "skipped" and seen["outcome"] == "passed":
        seen.update(outcome="skipped", text=report["text"])


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _interpreter_items(items: Iterable[pytest.Item]) -> list[pytest.Item]:
    return [item for item in items if runs_under_interpreter(item)]


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _launches_child(config: pytest.Config) -> bool:
    """One process starts the child: the main pytest, or with pytest-xdist its first worker
    (every worker collects the same items, so the child's run is the same whoever starts it)."""
    if not _is_xdist_worker(config):
        return True
    return config.workerinput["workerid"] == "gw0"  # type: ignore[attr-defined]


def make_shared_dir(config: pytest.Config) -> None:
    """In the main pytest (before any xdist worker starts, so they inherit it): the folder the
    child writes its results to, which every worker reads."""
    if IN_CHILD or _is_xdist_worker(config) or SHARED_DIR_ENV in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="vaed-interpreter-")
    os.environ[SHARED_DIR_ENV] = folder
    config.stash[_OWNED_DIR] = folder


def remove_shared_dir(config: pytest.Config) -> None:
    folder = config.stash.get(_OWNED_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(SHARED_DIR_ENV, None)


def put_interpreter_cases_last(items: list[pytest.Item]) -> None:
    """The child runs from the start of the session beside the other tests; its cases wait for
    it, so they come last (a stable sort: the other tests keep their order)."""
    if IN_CHILD:
        return
    items.sort(key=runs_under_interpreter)
    for item in _interpreter_items(items):
        # Here a case only waits for the child and reports its outcome (each case is under
        # pytest-timeout's own limit inside the child).
        item.add_marker(pytest.mark.timeout(CHILD_TIMEOUT_S))


def start_interpreter_child(session: pytest.Session) -> None:
    """Start the session's interpreter cases in CHILDREN child pytests under TRITON_INTERPRET=1,
    in the background, each with every CHILDREN-th case: the children take ~3 minutes of one
    core on CI, which the rest of the suite (mostly waiting on servers it started) overlaps
    instead of following. One child alone was the suite's last to finish (it ran 481 s of a
    526 s run beside four xdist workers); two finish in about half that, for one more import."""
    if IN_CHILD or session.config.option.collectonly or not _launches_child(session.config):
        return
    items = _interpreter_items(session.items)
    if not items:
        return
    folder = Path(os.environ[SHARED_DIR_ENV])
    if importlib.util.find_spec("triton") is None:
        with open(folder / _results_file(0), "w") as f:
            for item in items:
                f.write(json.dumps({"nodeid": item.nodeid, "when": "setup", "outcome": "skipped",
                                    "text": "triton is not installed"}) + "\n")
        (folder / _DONE_FILE).write_text(json.dumps({"elapsed": 0.0, "log": ""}))
        return
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)
    children = []
    for k in range(min(CHILDREN, len(items))):
        # -p no:xdist: a child runs its cases itself, one torch import and one interpreter.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               *(item.nodeid for item in items[k::CHILDREN])]
        log = open(folder / f"child.{k}.log", "w")  # closed by the watcher when the child ends
        child_env = {**env, RESULTS_ENV: str(folder / _results_file(k))}
        proc = subprocess.Popen(cmd, cwd=session.config.rootpath, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        children.append((proc, log))
    # A watcher thread marks the run done the moment the children end, so a case waiting in any
    # xdist worker goes on without this process's help.
    threading.Thread(target=_watch_children, args=(children, folder), daemon=True, name="interpreter-child").start()


def _results_file(child: int) -> str:
    return f"results.{child}.jsonl"


_RESULTS_GLOB = "results.*.jsonl"  # every child's _results_file


def _watch_children(children: list[tuple[subprocess.Popen[str], IO[str]]], folder: Path) -> None:
    started = time.monotonic()
    texts = []
    for proc, log in children:
        try:
            proc.wait(timeout=max(1.0, CHILD_TIMEOUT_S - (time.monotonic() - started)))
            note = ""
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            note = f"the interpreter run exceeded {CHILD_TIMEOUT_S} s\n"
        log.close()
        texts.append(note + Path(log.name).read_text()[-9000 // len(children):])
    text = "\n".join(texts)
    (folder / (_DONE_FILE + ".tmp")).write_text(json.dumps({"elapsed": time.monotonic() - started, "log": text}))
    (folder / (_DONE_FILE + ".tmp")).rename(folder / _DONE_FILE)  # whole, or not there


def report_child_time(config: pytest.Config) -> None:
    """At the end of the main pytest: how long the child ran."""
    folder = os.environ.get(SHARED_DIR_ENV)
    if folder is None or _is_xdist_worker(config) or not (Path(folder) / _DONE_FILE).exists():
        return
    elapsed = json.loads((Path(folder) / _DONE_FILE).read_text())["elapsed"]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"interpreter: the kernel cases' TRITON_INTERPRET=1 child pytests ran {elapsed:.0f} s "
                            "beside the other tests")


def _child_results(config: pytest.Config) -> tuple[dict[str, dict[str, str]], str]:
    """The child's outcomes by node id, once it is done (read once per process)."""
    cached = config.stash.get(_RESULTS, None)
    if cached is not None:
        return cached
    folder = Path(os.environ[SHARED_DIR_ENV])
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not (folder / _DONE_FILE).exists():  # another xdist worker runs the child
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    done = json.loads((folder / _DONE_FILE).read_text()) if (folder / _DONE_FILE).exists() else {"log": ""}
    results: dict[str, dict[str, str]] = {}
    for results_file in sorted(folder.glob(_RESULTS_GLOB)):
        for line in results_file.read_text().splitlines():
            _merge(results, json.loads(line))
    config.stash[_RESULTS] = (results, done["log"])
    return results, done["log"]


def report_child_outcome(item: pytest.Function) -> bool | None:
    """In the main process an interpreter case reports what the child's run of it gave."""
    if IN_CHILD or not runs_under_interpreter(item):
        return None
    results, log = _child_results(item.config)
    outcome = results.get(item.nodeid)
    if outcome is None:
        pytest.fail(f"the interpreter run gave no result for this case:\n{log}", pytrace=False)
    if outcome["outcome"] == "skipped":
        pytest.skip(outcome["text"])
    if outcome["outcome"] == "failed":
        pytest.fail(f"under TRITON_INTERPRET=1:\n{outcome['text']}", pytrace=False)
    return True


def check_interpreter_active(item: pytest.Item) -> None:
    """In the child: an interpreter case must really run under the interpreter."""
    if IN_CHILD and runs_under_interpreter(item):
        from vaed import kernels

        assert kernels.interpreter_active(), "TRITON_INTERPRET=1 was not in effect when triton was imported"


def record_child_report(report: pytest.TestReport) -> None:
    """In the child: append each phase's outcome for the main process to read."""
    if not IN_CHILD:
        return
    text = ""
    if report.failed:
        text = str(report.longrepr)[-8000:]
    elif report.skipped:
        text = _skip_reason(report.longrepr)
    line = json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": text})
    with open(os.environ[RESULTS_ENV], "a") as f:
        f.write(line + "\n")
