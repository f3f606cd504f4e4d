"""Compile the causal-input kernels to sm_90 PTX without a GPU, to prove a refactor changes no code.

Compiles the 1-D kernel (``causal_input``) and the channels-last tile kernel
(``causal_input_cl``) for every combination of their mode constexprs (norm
off / exact / fast, bf16 or fp32 rounding, layouts, the deferred bias, the
unfolded taps) with Triton's own compiler and ptx backend, and writes one
.ptx per combination, stripped of debug lines (source locations, inline
markers, debug sections) so that two trees compare instruction by
instruction:

    python scripts/dump_kernel_ptx.py /tmp/before     # on the old tree
    python scripts/dump_kernel_ptx.py /tmp/after      # on the new tree
    diff -r /tmp/before /tmp/after

Identical files mean identical kernels (for this Triton); a lossless kernel
refactored this way keeps its bits without a GPU run. Moving the exact
RMS-norm+SiLU arithmetic into a shared device helper (``rms_silu_exact_tile``)
changed 12 of the 32 files, each only in where gamma's 64-bit address adds
sit: same instructions (``diff <(sort a) <(sort b)`` is empty), same
registers, every float instruction in its place (Triton 3.8).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import re
from pathlib import Path
from typing import Any

from vaed.kernels import causal_input, causal_input_cl

_FLOATS = {"scale", "bias", "eps"}
_UNIT_STRIDES = {"sxc", "scc", "snc"}  # channels_last_3d: Triton specialises a stride of 1


def compile_ptx(module: Any, constexprs: dict[str, Any]) -> str:
    """PTX of ``module``'s kernel for sm_90 with the given constexprs (pointers 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = module._kernel()  # rt.jit_lazy: fills the module's globals and jits its helpers
    params = list(inspect.signature(fn.fn).parameters)
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    values = dict(constexprs)
    for i, p in enumerate(params):
        if p in constexprs:
            sig[p] = "constexpr"
        elif p.endswith("_ptr"):
            sig[p] = "*fp32" if p == "d_ptr" else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p in _FLOATS:
            sig[p] = "fp32"
        elif p in _UNIT_STRIDES:
            sig[p] = "constexpr"
            values[p] = 1
        else:
            sig[p] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in values.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
    return kernel.asm["ptx"]


def strip_debug(ptx: str) -> str:
    """The PTX's code: no comments, source locations, inline markers or debug sections."""
    lines = []
    for line in ptx.splitlines():
        if re.match(r"\s*\.section\s+\.debug", line):
            break
        line = line.split("//")[0].rstrip()
        if not line or re.match(r"\s*\.(loc|file)\b", line) or re.match(r"\$L__tmp\d+:", line):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def variants() -> list[tuple[str, Any, dict[str, Any]]]:
    out: list[tuple[str, Any, dict[str, Any]]] = []
    for norm, lowp, cl, idx64 in itertools.product((0, 1), (True, False), (True, False), (False, True)):
        consts = {"NORM": norm, "LOWP": lowp, "CL": cl, "IDX64": idx64, "BLOCK": 1024, "DIV": 96}
        out.append((f"1d_norm{norm}_lowp{int(lowp)}_cl{int(cl)}_idx64{int(idx64)}", causal_input, consts))
    for norm, lowp, xbias, kt in itertools.product((0, 1, 2), (True, False), (False, True), (0, 3)):
        if xbias and norm != 2:
            continue
        consts = {"NORM": norm, "XBIAS": xbias, "LOWP": lowp, "EMIT": True, "IDX64": False, "KT": kt,
                  "BLOCK_W": 16, "BLOCK_C": 128}
        out.append((f"tile_norm{norm}_lowp{int(lowp)}_xbias{int(xbias)}_kt{kt}", causal_input_cl, consts))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the .ptx files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, module, consts in variants():
        (args.out / f"{name}.ptx").write_text(strip_debug(compile_ptx(module, consts)))
    print(f"wrote {len(variants())} kernels to {args.out}")


if __name__ == "__main__":
    main()
