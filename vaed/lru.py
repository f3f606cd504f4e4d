"""The one bounded cache type: a mapping that keeps its ``limit`` most recently used entries.

Where vaed keeps things bounded:

* pure functions of small hashable arguments (stride and layout rules per
  shape in ``kernels/`` and ``patches/ops.py``) use ``functools.lru_cache``:
  the standard library's memo is the bounded cache for a function;
* state a caller decides to keep (captured CUDA graphs per call signature,
  signatures seen once or kept eager in ``graphs.py``) uses ``LruCache``:
  the caller puts and drops entries, reads count as use.

``patches/derived.py`` is neither: its values live as long as their module
(a ``WeakKeyDictionary``) and are rebuilt when a source tensor changes, so
their number is bounded by the model's modules, not by a limit.

Not thread-safe: each user is confined to one thread (a device's worker).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most ``limit`` entries; storing past it drops the least recently used.

    ``get`` and storing count as use; ``in``, ``len`` and iteration do not.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"an LruCache holds at least 1 entry, got limit={limit}")
        self.limit = limit
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recently used."""
        return iter(self._entries)

    def get(self, key: K) -> V | None:
        """The value under ``key`` (now the most recently used), else None."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def __setitem__(self, key: K, value: V) -> None:
        """Store ``value`` as the most recently used entry; drop the oldest past ``limit``."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, or None when it was absent."""
        return self._entries.pop(key, None)
