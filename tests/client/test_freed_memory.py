"""`keep_freed_memory`: frame messages stop faulting in fresh pages (counted, never timed).

Each case runs in a fresh interpreter: the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")

# Builds, serializes and parses a 480x832 RGB8 frame's FrameChunk 40 times, as a server and a
# client do with every frame, and prints the minor page faults per round after 5 warm rounds.
_ROUNDS = """
import resource, sys
import numpy as np
import vaed_client
from vaed_client import wire
if sys.argv[1] == "keep":
    print(vaed_client.keep_freed_memory())
frame = np.random.default_rng(0).integers(0, 255, (1, 1, 480, 832, 3), dtype=np.uint8)
def one_round():
    chunk = wire.pb.FrameChunk(request_id="r", chunk_index=0, first_frame=0)
    wire.to_message(frame, out=chunk.frames)
    assert len(wire.pb.FrameChunk.FromString(chunk.SerializeToString()).frames.data) == frame.size
for _ in range(5):
    one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    one_round()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40)
"""


def _faults_per_round(mode: str, **env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    return "\n".join(out[:-1]), float(out[-1])


def test_kept_memory_spares_the_page_faults_of_every_frame_message() -> None:
    """A round copies the 1.2 MB frame four times (its bytes, the message, the serialized
    bytes, the parsed message): ~1200 pages that glibc's defaults fault in anew each round. Kept,
    the round reuses the same memory: under 50 faults (~7 on the development machine)."""
    said, kept = _faults_per_round("keep")
    assert said.startswith("freed memory stays in the process")
    assert kept < 50, kept


@pytest.mark.parametrize("env", [{"MALLOC_TOP_PAD_": "1"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}])
def test_malloc_tunables_of_the_environment_are_left_alone(env: dict[str, str]) -> None:
    said, _ = _faults_per_round("keep", **env)
    assert said == f"the allocator is left to the environment ({next(iter(env))})"
