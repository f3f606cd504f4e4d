"""Write vaed/kernels/manifests/sm<arch>.json: the Triton kernels a server's start-up compiles.

    python scripts/record_kernels.py [--models random:wan2.1,random:wan2.2] [--gpu 0]

Runs a device worker's whole start-up (model load, the start-up checks of every fused op,
warm-up of both tiers at the default sizes, encoder included) for each model on one GPU,
and records each vaed kernel variant Triton compiles or loads (`vaed.kernels.precompile`).
The records are merged into the packaged manifest, which `vaed serve` and `vaed precompile`
compile ahead. Run it after a kernel's launch parameters change; the records do not depend
on the GPU model, only on its architecture (the file is that architecture's).
"""

from __future__ import annotations

import argparse
import sys
import time

from vaed.config import ServerConfig
from vaed.kernels import precompile
from vaed.server import engine_factory
from vaed.worker import DeviceWorker


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="random:wan2.1,random:wan2.2")
    parser.add_argument("--gpu", default="0")
    args = parser.parse_args()
    device = f"cuda:{args.gpu}"
    with precompile.recording() as records:
        for model in args.models.split(","):
            started = time.perf_counter()
            config = ServerConfig(model=model, devices=(device,), encode=True)
            worker = DeviceWorker(device, engine_factory(config))
            worker.start()
            worker.wait_ready()
            worker.stop()
            if worker.startup_error is not None:
                print(f"{model}: start-up failed: {worker.startup_error}", file=sys.stderr)
                return 1
            print(f"{model}: {len(records)} records so far ({time.perf_counter() - started:.1f} s)", flush=True)
    path = precompile.manifest_path(precompile.arch_of(device))
    total = precompile.save_manifest(records, path)
    print(f"{path}: {total} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
