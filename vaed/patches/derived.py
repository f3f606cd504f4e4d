"""Values derived from a module's tensors, built once and kept until a source changes.

The fast tier reads a few tensors that depend only on weights: a conv3d weight
with its time taps unfolded into channels, and the sums of conv biases that a
residual add takes in one vector. Rebuilding them every chunk would put small
kernels on the decode's hot path for values that do not change; keeping them
per module, checked against the identity and in-place version of every source
tensor, gives the same values without that work.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

Entry = tuple[tuple[torch.Tensor, ...], tuple[int, ...], torch.Tensor]  # sources, their versions, value
# module -> name -> entry
_DERIVED: weakref.WeakKeyDictionary[nn.Module, dict[str, Entry]] = weakref.WeakKeyDictionary()


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version  # inference tensors keep no version counter


def derived(
    owner: nn.Module, name: str, sources: tuple[torch.Tensor, ...], build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``build()``, kept on ``owner`` under ``name`` and rebuilt when a source tensor is replaced
    or changed in place. Not kept when built inside a CUDA graph capture (its kernels would
    only run in replays, so the tensor would hold nothing outside them)."""
    versions = tuple(_version(t) for t in sources)
    entry = _DERIVED.get(owner, {}).get(name)
    if entry is not None and versions == entry[1] and all(a is b for a, b in zip(entry[0], sources, strict=True)):
        return entry[2]
    value = build()
    if not (value.is_cuda and torch.cuda.is_current_stream_capturing()):
        _DERIVED.setdefault(owner, {})[name] = (sources, versions, value)
    return value
