"""``vaed health``: ask a server's grpc.health.v1 service whether it serves.

Prints the status name (SERVING, NOT_SERVING, SERVICE_UNKNOWN, UNKNOWN) or
the gRPC error, and exits 0 only for SERVING, 1 otherwise, so it works as a
Docker HEALTHCHECK, an exec probe, or in a shell script.
"""

from __future__ import annotations

import argparse
import logging
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_SERVER = "localhost:50051"
# The server answers health from the event loop even while the GPU is busy;
# 5 s covers a loaded node without hanging a probe.
DEFAULT_TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server", default=DEFAULT_SERVER, metavar="HOST:PORT",
        help=f"server address (default {DEFAULT_SERVER})",
    )
    parser.add_argument(
        "--service", default="",
        help='service name to check; "" (default) is the whole server, '
             '"vaed.v1.VaeDecoder" the decoder service',
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help=f"deadline for the check (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument(
        "--ca-cert", default=None, metavar="PATH",
        help="PEM CA bundle to verify the server (implies --tls; default: system roots)",
    )
    parser.add_argument(
        "--tls-server-name", default=None, metavar="NAME",
        help="expected name in the server certificate when it differs from HOST "
             "(e.g. checking localhost against a cert for vaed.<ns>.svc)",
    )


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not (args.tls or args.ca_cert):
        return grpc.insecure_channel(args.server)
    root = None
    if args.ca_cert:
        with open(args.ca_cert, "rb") as f:
            root = f.read()
    options = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return grpc.secure_channel(
        args.server, grpc.ssl_channel_credentials(root_certificates=root), options=options
    )


def check(args: argparse.Namespace) -> tuple[bool, str]:
    """(serving, text to print) for the server and service in ``args``."""
    try:
        channel = _channel(args)
    except OSError as exc:
        return False, f"ERROR: cannot read CA certificate: {exc}"
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            code = exc.code()
            name = code.name if code is not None else "UNKNOWN"
            if code == grpc.StatusCode.NOT_FOUND:
                # The health servicer answers NOT_FOUND for a service it does not know.
                return False, "SERVICE_UNKNOWN"
            return False, f"{name}: {exc.details() or ''}".rstrip(": ")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def run(args: argparse.Namespace) -> int:
    serving, text = check(args)
    print(text)
    return 0 if serving else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vaed health", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
