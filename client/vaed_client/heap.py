"""Keep freed memory in the process instead of handing it back to the kernel (glibc only).

Frames travel in messages of 1.2 MB (one 480x832 RGB8 frame) to 11 MB (four 720x1280 ones),
and each is copied several times on its way: into the protobuf message, into its serialized
bytes, and on the receiving side into gRPC's bytes and the parsed message. glibc serves blocks
this large with fresh mmap()s, or trims them off its heap when they are freed, so every copy
lands on pages the kernel must fault in and zero again. On a 2-core development machine,
building, serializing and parsing one 480x832 frame's FrameChunk took 1066 page faults and
2.5 ms; with freed memory kept, 7 faults and 0.5 ms. A 720x1280 four-frame group: 9471 faults
and 24 ms against 61 and 5.8 ms.

`keep_freed_memory` sets two of glibc's malloc parameters (`mallopt`): blocks under 32 MiB
(glibc's largest mmap threshold on 64-bit) come from the heap, and up to 64 MiB of free heap
top stays mapped. That covers every message vaed sends (16 MiB at most, `FRAME_MESSAGE_BYTES`)
and one being serialized beside it. The cost is memory the process has already used, kept
for its next message: at most 64 MiB of free heap per malloc arena (a busy thread's).

`vaed serve` calls it at start-up; a worker process that receives frames can call it too
(the client never changes its host process's allocator by itself). Where the environment
already sets glibc's malloc tunables (`MALLOC_*_` or `GLIBC_TUNABLES`), those are left as
they are.

`video_buffer` allocates a whole video's frames (97 MB at 480x832x81) from an anonymous mapping
without numpy's huge-page advice: numpy asks for transparent huge pages on arrays of 4 MiB and
more, and where the kernel's THP defrag setting is "madvise" (a common default) a fault on such
an array may compact memory first. On the development machine one 4.8 MB group's copy into a
fresh video then took 18-28 ms of system time instead of 2-3 ms, at random, the last group's
too; with plain 4 KiB pages every copy took 3-4 ms (1170 faults each) and none stalled.

Those faults are still on the receiving thread, the last group's included, after the server's
last send. So the video's assembler has the whole mapping faulted in on a thread of its own once
the first frames are in (`prefault`: Linux's MADV_POPULATE_WRITE, which maps the pages writable
without touching their bytes, so the frames copied in meanwhile stay as written), so that it
never competes with the first frames' copy.
Against a paced server (`benchmarks/client_tail.py`), `decode()`'s return came a median 4.5-5.9 ms
after the last group's send instead of 6.8-7.3 ms (`stream()`: 3.5-4.9 ms) on that machine, its
first frames 5.5-5.6 ms after the first group's instead of 5.2-5.4 (within the runs' spread;
`stream()`: 4.1-4.4 ms); freeing the video afterwards took 11-13 ms instead of 9-10.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import platform
import threading

import numpy as np

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MADV_POPULATE_WRITE = 23  # Linux 5.14+ (asm-generic/mman-common.h); older kernels answer EINVAL
HEAP_BLOCKS_UNDER = 32 << 20  # M_MMAP_THRESHOLD: glibc's largest on 64-bit
KEPT_FREE_TOP = 64 << 20      # M_TRIM_THRESHOLD
_MALLOC_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> str:
    """Set glibc's malloc to keep freed memory (module doc); returns what was done, for a log line."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the allocator is left as it is (not glibc)"
    chosen = [name for name in _MALLOC_ENVIRONMENT if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"the allocator is left to the environment ({', '.join(chosen)})"
    libc = _libc()
    if not (libc.mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UNDER) and libc.mallopt(M_TRIM_THRESHOLD, KEPT_FREE_TOP)):
        return "the allocator is left as it is (glibc refused mallopt)"
    return (f"freed memory stays in the process: blocks under {HEAP_BLOCKS_UNDER >> 20} MiB from the heap, "
            f"up to {KEPT_FREE_TOP >> 20} MiB of free heap kept (no page faults on each frame message)")


def video_buffer(shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised writable array on pages the kernel faults in without huge-page
    compaction (module doc); it owns its mapping, unmapped when the array is collected."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


def prefault(array: np.ndarray) -> threading.Thread | None:
    """Fault `array`'s pages in, writable, on a daemon thread (module doc), which holds the array
    until it is done; the array may be written meanwhile. Returns the thread, or None where the
    platform has no MADV_POPULATE_WRITE (not Linux): the writes then fault the pages in."""
    if platform.system() != "Linux":
        return None
    thread = threading.Thread(target=_populate, args=(array,), name="vaed-prefault", daemon=True)
    thread.start()
    return thread


def _populate(array: np.ndarray) -> None:
    # ctypes releases the GIL for the call: ~40-70 ms for a 97 MB video on the development machine
    _libc().madvise(array.ctypes.data, array.nbytes, MADV_POPULATE_WRITE)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
