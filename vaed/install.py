"""Deprecated import path: the fast paths moved to :mod:`vaed.patches`.

Kept only until vaed/engine.py, vaed/bench.py, scripts/gpu_check_pqc.py and
tests/server/test_gpu_e2e.py import from ``vaed.patches``; then delete it.
"""

from vaed.patches import FastPathError, FastPathReport, prepare_decoder, remove_fast_paths, to_decoder_layout

__all__ = ["FastPathError", "FastPathReport", "prepare_decoder", "remove_fast_paths", "to_decoder_layout"]
