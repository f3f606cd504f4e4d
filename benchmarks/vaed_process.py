"""`vaed serve` as a subprocess on a loopback port, for the benchmark scripts beside this file.

One place reads the server's start-up log, so a change to its wording breaks
every script at once instead of one silently (bench_service.py once waited
forever for a line ending in "SERVING" after it became "SERVING on <device>").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys


def start_vaed(model: str, gpu: str | None, extra: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `vaed serve --model model [--gpu gpu] extra...` on 127.0.0.1, port 0; return once it
    logs SERVING: (process, "127.0.0.1:<port>", the log lines so far, each also echoed here).
    The process's stdout stays a pipe: read the rest with communicate() after stopping it."""
    cmd = [sys.executable, "-m", "vaed.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--model", model,
           *(["--gpu", gpu] if gpu is not None else []), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    port = None
    lines: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        lines.append(line)
        print("server |", line, flush=True)
        if m := re.search(r"\(port (\d+),", line):
            port = m.group(1)
        if "SERVING" in line and port:
            return proc, f"127.0.0.1:{port}", lines
    proc.kill()
    raise SystemExit("server exited before SERVING")


def print_call_lines(log_text: str, method: str | None = None) -> None:
    """Echo the server's one log line per call (`<Method> id=... status=...`, with its device_ms,
    first_frame_ms and the first frame's wait/step/gpu/launch ms) from its log after it stopped;
    only `method`'s calls when given."""
    for line in log_text.splitlines():
        m = re.search(r"\b(\w+) id=\S* status=", line)
        if m and (method is None or m.group(1) == method):
            print("server |", line.strip(), flush=True)


def find(pattern: str, lines: list[str]) -> list[re.Match[str]]:
    """Every match of `pattern` in the start-up log lines."""
    return [m for line in lines if (m := re.search(pattern, line))]
