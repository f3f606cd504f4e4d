"""Write vaed/kernels/manifests/sm<arch>.json: the Triton kernels each kind of server start compiles.

    python scripts/record_kernels.py [--models random:wan2.1,random:wan2.2] [--gpu 0]

For each model, a decode server's start and an encode server's (`--encode`) each run in a
process of their own: a device worker's whole start-up (model load, the start-up checks of
every fused op, warm-up of both tiers at the default sizes), recording each vaed kernel variant
Triton compiles or loads (`vaed.kernels.precompile`; a process compiles a variant once, so one
start per process sees all of its own). The manifest names each start's records
(`wan2.1`, `wan2.1+encode`, ...), which `vaed serve` compiles ahead for its model, and
`vaed precompile` all of them. Run it after a kernel's launch parameters change; the records
do not depend on the GPU model, only on its architecture (the file is that architecture's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from vaed.config import ServerConfig
from vaed.kernels import precompile
from vaed.models import kernel_family


def record_start(model: str, device: str, encode: bool) -> list[str]:
    """The records of one server start, in this process."""
    from vaed.server import engine_factory
    from vaed.worker import DeviceWorker

    with precompile.recording() as records:
        worker = DeviceWorker(device, engine_factory(ServerConfig(model=model, devices=(device,), encode=encode)))
        worker.start()
        worker.wait_ready()
        worker.stop()
    if worker.startup_error is not None:
        raise SystemExit(f"{model}: start-up failed: {worker.startup_error}")
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="random:wan2.1,random:wan2.2")
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)  # a child: one start, JSON out
    parser.add_argument("--encode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = f"cuda:{args.gpu}"
    if args.one:
        json.dump(record_start(args.one, device, args.encode), sys.stdout)
        return 0
    starts: dict[str, list[str]] = {}
    for model in args.models.split(","):
        for encode in (False, True):
            name = precompile.start_name(kernel_family(model), encode)
            if name is None:
                raise SystemExit(f"{model}: not a model of a known kernel family")
            started = time.perf_counter()
            child = [sys.executable, __file__, "--one", model, "--gpu", args.gpu] + (["--encode"] if encode else [])
            out = subprocess.run(child, stdout=subprocess.PIPE, check=True, text=True)
            starts[name] = json.loads(out.stdout)
            print(f"{name}: {len(starts[name])} records ({time.perf_counter() - started:.1f} s)", flush=True)
    path = precompile.manifest_path(precompile.arch_of(device))
    total = precompile.save_manifest(starts, path)
    print(f"{path}: {total} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
