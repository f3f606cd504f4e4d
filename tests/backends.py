"""The two backends every kernel test runs on, and how the interpreter one runs.

A kernel test takes a ``backend`` parameter (``kernel_cases`` builds its cases):

- ``cuda``: the GPU, where every fused op must give the reference's bits.
  These cases carry the ``cuda`` marker and skip without a GPU.
- ``interpreter``: Triton's interpreter (``TRITON_INTERPRET=1``) on the CPU,
  so CPU CI runs the same test functions. Triton picks the interpreter when a
  kernel is first decorated, so it must be set before triton is imported and
  must not leak into the process that runs the CUDA and server tests: the
  main pytest process runs no interpreter case itself. Before its test loop
  it runs all selected interpreter cases in one child pytest with
  ``TRITON_INTERPRET=1`` set from the start (one torch import, one
  interpreter), and each case then reports the child's outcome (pass, skip
  reason, or the child's failure text) under its own id. These cases carry
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
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

_RESULTS = pytest.StashKey[dict[str, dict[str, str]]]()
_CHILD_LOG = pytest.StashKey[str]()


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


def run_interpreter_child(session: pytest.Session) -> None:
    """Run the session's interpreter cases in one child pytest under TRITON_INTERPRET=1."""
    if IN_CHILD or session.config.option.collectonly:
        return
    items = [item for item in session.items if runs_under_interpreter(item)]
    if not items:
        return
    results: dict[str, dict[str, str]] = {}
    session.config.stash[_RESULTS] = results
    if importlib.util.find_spec("triton") is None:
        for item in items:
            results[item.nodeid] = {"outcome": "skipped", "text": "triton is not installed"}
        return
    root = Path(session.config.rootpath)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.jsonl"
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **{RESULTS_ENV: str(out)})
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(item.nodeid for item in items)]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            log = proc.stdout[-6000:] + proc.stderr[-3000:]
        except subprocess.TimeoutExpired as e:
            log = f"the interpreter run exceeded {CHILD_TIMEOUT_S} s\n{e.stdout!s:.3000}"
        elapsed = time.monotonic() - started
        if out.exists():
            for line in out.read_text().splitlines():
                _merge(results, json.loads(line))
    session.config.stash[_CHILD_LOG] = log
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"interpreter: {len(items)} kernel cases in a TRITON_INTERPRET=1 child pytest, "
                            f"{elapsed:.0f} s")


def report_child_outcome(item: pytest.Function) -> bool | None:
    """In the main process an interpreter case reports what the child's run of it gave."""
    if IN_CHILD or not runs_under_interpreter(item):
        return None
    results = item.config.stash.get(_RESULTS, {})
    outcome = results.get(item.nodeid)
    if outcome is None:
        pytest.fail(f"the interpreter run gave no result for this case:\n{item.config.stash.get(_CHILD_LOG, '')}",
                    pytrace=False)
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
