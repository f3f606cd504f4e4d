"""``vaed health``: the client package's health command, re-exported.

Prints SERVING, NOT_SERVING, SERVICE_UNKNOWN or the gRPC error and exits 0
only for SERVING (a Docker HEALTHCHECK or exec probe). The code lives in
`vaed_client.cli` (`add_health_arguments`, `run_health`, `check_health`).
"""

from __future__ import annotations

import argparse
import sys

from vaed_client.cli import DEFAULT_HEALTH_TIMEOUT_S as DEFAULT_TIMEOUT_S  # noqa: F401
from vaed_client.cli import DEFAULT_SERVER  # noqa: F401
from vaed_client.cli import add_health_arguments as add_arguments
from vaed_client.cli import check_health as check  # noqa: F401
from vaed_client.cli import run_health as run


__all__ = ["DEFAULT_SERVER", "DEFAULT_TIMEOUT_S", "add_arguments", "check", "run", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vaed health", description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
