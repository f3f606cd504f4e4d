"""Channel construction shared by the sync and asyncio clients and the CLI.

- Message limits: gRPC's default receive limit is 4 MiB, and one 480x832 RGB8
  group of 4 frames is already 4.8 MiB, so both directions get
  `wire.MAX_MESSAGE_BYTES` (256 MiB).
- Service config: round_robin across every address a `dns:///` target
  resolves to (one per replica behind a headless Service), and retries of
  GetModelInfo and Decode on UNAVAILABLE (server warming up or draining) with
  exponential backoff, before their first response (`RETRIED_METHODS`).
  DecodeStream and Encode, whose request streams stay open, are retried and
  resumed by `vaed_client.resume` alone (with `skip_frames` past the first
  frames; each client target gets its own channel).
- Keepalive: the channel pings every 60 s (20 s to answer) and only while a
  call is open (`keepalive_permit_without_calls=0`), with no cap on pings
  between data frames (`http2.max_pings_without_data=0`, so a long decode
  that sends nothing for minutes keeps its connection). The vaed server
  permits client pings every >= 30 s, so 60 s never trips its
  too_many_pings GOAWAY; a dead peer behind a NAT or load balancer is found
  within ~80 s instead of at the next write. gRPC core times an unanswered
  ping out after `http2.ping_timeout_ms` (60 s by default), whatever
  `keepalive_timeout_ms` says, so the channel sets that one to the keepalive
  timeout too (also when `options=` changes the keepalive timeout): without
  it a stalled peer took 60 s to be found with a 1 s keepalive timeout.
- Auth: `token=` sends `authorization: Bearer <token>` on every call — as call
  credentials over TLS, or as plain per-call metadata on an insecure channel
  (gRPC refuses call credentials there; loopback tests still need tokens).
- TLS: `tls=` (see `channel_credentials`) and `tls_server_name=`, the name
  expected in the server certificate when it differs from the target's host
  (e.g. reaching a pod by IP with a cert for `vaed.<ns>.svc`).
- Mutual TLS: `tls_client_cert=` / `tls_client_key=` (PEM paths or bytes, both
  or neither) present a client certificate, for a server run with
  `--tls-client-ca`; they need `tls=` (the server is verified as ever).
- Port: a target without one (`127.0.0.1`, `vaed`, `dns:///vaed-headless`)
  gets vaed's `wire.DEFAULT_PORT`, 50051, where gRPC would silently dial 443
  (`with_default_port`); other schemes (`unix:`, `ipv4:`, ...) are left as given.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any, Union

import grpc
import grpc.aio

from .wire import DEFAULT_PORT, MAX_MESSAGE_BYTES, METHODS, SERVICE_NAME  # MAX_MESSAGE_BYTES re-exported

RETRY_POLICY: dict[str, Any] = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

# The methods whose whole request is sent when the call starts. DecodeStream and Encode keep
# their request stream open (the client sends the rest after the first reply): under a retry
# policy, a server killed before its first reply left such a call with its status set and its
# read pending forever (grpc 1.85, sync client: 2 of 3 calls hung, their deadline too), so they
# have none, and `vaed_client.resume` retries them before the first reply as after it.
RETRIED_METHODS: tuple[str, ...] = ("GetModelInfo", "Decode")
assert set(RETRIED_METHODS) <= set(METHODS)

SERVICE_CONFIG: dict[str, Any] = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [{"service": SERVICE_NAME, "method": method} for method in RETRIED_METHODS],
            "retryPolicy": RETRY_POLICY,
        }
    ],
}
SERVICE_CONFIG_JSON = json.dumps(SERVICE_CONFIG)

# Requests stay buffered for a possible retry until the call commits (first
# response). gRPC's default 256 KiB buffer would silently disable retries for
# any real request (480x832x81 bf16 latents are 4.2 MB); 64 MiB covers them.
RETRY_BUFFER_BYTES = 64 * 1024 * 1024

# Client keepalive (see module doc): 2x the server's 30 s minimum ping interval.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
# The ack deadline of every ping gRPC core sends, keepalive pings included (module doc).
PING_TIMEOUT_OPTION = "grpc.http2.ping_timeout_ms"

TlsSpec = Union[bool, bytes, str, "os.PathLike[str]", grpc.ChannelCredentials, None]
PemSpec = Union[bytes, str, "os.PathLike[str]", None]  # PEM contents, or the path of a PEM file
Metadata = tuple[tuple[str, str], ...]


# Target schemes gRPC resolves itself, left as given (`dns:` gets the default port).
_OTHER_SCHEMES = ("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:", "xds:", "google-c2p:")


def with_default_port(target: str, port: int = DEFAULT_PORT) -> str:
    """`target` with vaed's port when it names none: `127.0.0.1` -> `127.0.0.1:50051`,
    `[::1]` or `::1` -> `[::1]:50051`, `dns:///vaed-headless` -> `dns:///vaed-headless:50051`.
    Targets with a port, and the schemes `unix:`, `ipv4:`, `ipv6:`, `xds:`, ..., are
    returned unchanged. ValueError for an empty target, host or port (`""`, `"localhost:"`):
    gRPC would dial its 443 for an empty port, or fail on no host with an unclear error."""
    if target.startswith(_OTHER_SCHEMES):
        return target
    prefix, host = "", target
    if target.startswith("dns:"):
        prefix, host = "dns:", target[len("dns:"):]
        if host.startswith("//"):  # dns://authority/host[:port]
            slash = host.find("/", 2)
            if slash < 0:
                return target
            prefix, host = prefix + host[: slash + 1], host[slash + 1 :]
    if not host:
        raise ValueError(f"target {target!r} names no host")
    if host.startswith("["):  # [v6] or [v6]:port
        if "]:" not in host:
            return f"{prefix}{host}:{port}"
        _check_port(target, host.rpartition("]:")[2])
        return target
    colons = host.count(":")
    if colons == 0:
        return f"{prefix}{host}:{port}"
    if colons == 1:  # host:port
        if not host.partition(":")[0]:  # ":50051": gRPC fails to resolve it ("host must not be empty")
            raise ValueError(f"target {target!r} names no host")
        _check_port(target, host.partition(":")[2])
        return target
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return target
    return f"{prefix}[{host}]:{port}"


def _check_port(target: str, port: str) -> None:
    # "host:" parses in gRPC as the default port 443: a typo that silently reaches another service
    if not port:
        raise ValueError(f"target {target!r} has an empty port; name one (host:port) or leave out "
                         f"the ':' for vaed's {DEFAULT_PORT}")


def channel_options(
    extra: list[tuple[str, Any]] | None = None, *, tls_server_name: str | None = None
) -> list[tuple[str, Any]]:
    """gRPC channel arguments: message limits, service config, retries,
    keepalive, and the TLS name override; `extra` entries replace defaults."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.service_config", SERVICE_CONFIG_JSON),
        ("grpc.enable_retries", 1),
        ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    if extra:
        overridden = {key for key, _ in extra}
        options = [(k, v) for k, v in options if k not in overridden] + list(extra)
    if not any(key == PING_TIMEOUT_OPTION for key, _ in options):
        keepalive_timeout = dict(options)["grpc.keepalive_timeout_ms"]
        options.append((PING_TIMEOUT_OPTION, keepalive_timeout))
    return options


def _pem(spec: bytes | bytearray | str | os.PathLike[Any] | None, what: str) -> bytes | None:
    if spec is None:
        return None
    if isinstance(spec, (bytes, bytearray)):
        return bytes(spec)
    if isinstance(spec, (str, os.PathLike)):
        with open(spec, "rb") as f:
            return f.read()
    raise TypeError(f"{what} must be PEM bytes or a PEM file path, not {type(spec).__name__}")


def channel_credentials(
    tls: TlsSpec, *, client_cert: PemSpec = None, client_key: PemSpec = None
) -> grpc.ChannelCredentials | None:
    """None/False: insecure. True: system roots. bytes: CA PEM contents.
    str/PathLike: path of a CA PEM file. ChannelCredentials: used as is.
    `client_cert` and `client_key` (both or neither) add a client certificate (mutual TLS)."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("mutual TLS needs both tls_client_cert and tls_client_key")
    if tls is None or tls is False:
        if client_cert is not None:
            raise ValueError("tls_client_cert needs a TLS channel: pass tls=True or a CA certificate")
        return None
    if isinstance(tls, grpc.ChannelCredentials):
        if client_cert is not None:
            raise ValueError("tls_client_cert cannot be added to ready-made grpc.ChannelCredentials; "
                             "build them with the certificate")
        return tls
    if tls is True:
        roots = None
    elif isinstance(tls, (bytes, bytearray, str, os.PathLike)):
        roots = _pem(tls, "tls")
    else:
        raise TypeError(
            f"tls must be None, bool, CA PEM bytes, a CA file path or grpc.ChannelCredentials, not {type(tls).__name__}"
        )
    return grpc.ssl_channel_credentials(
        root_certificates=roots,
        private_key=_pem(client_key, "tls_client_key"),
        certificate_chain=_pem(client_cert, "tls_client_cert"),
    )


def read_token(path: str | None, env_var: str | None = None) -> str | None:
    """The bearer token from the file `path` or, without a path, from the
    environment variable `env_var` (e.g. `wire.AUTH_TOKEN_ENV`); None when
    neither is configured. Surrounding whitespace (echo's newline, a Secret
    file's) is stripped; an empty file or an empty-but-set variable raises
    ValueError: whoever asked for auth must not silently get none. So does a
    token gRPC cannot send (`check_token`), naming the file or variable.
    Read when called, never at import."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read auth token file {path!r}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:  # a ValueError that named no file
            raise ValueError(f"auth token file {path!r} is not text (byte {exc.start} is not UTF-8)") from None
        if not token:
            raise ValueError(f"auth token file {path!r} is empty")
        check_token(token, f"auth token file {path!r}")
        return token
    if env_var:
        raw = os.environ.get(env_var)
        if raw is None:
            return None
        token = raw.strip()
        if not token:
            raise ValueError(f"environment variable {env_var} is set but empty")
        check_token(token, f"environment variable {env_var}")
        return token
    return None


def check_token(token: str, source: str = "token") -> None:
    """ValueError, naming `source`, for a token that cannot travel in an `authorization` header:
    gRPC metadata values are printable ASCII, and it refused others only at the call, as
    UNAVAILABLE "Illegal metadata" (which the client retried as a server failure)."""
    for i, char in enumerate(token):
        if not " " <= char <= "~":
            what = "a line break" if char in "\r\n" else "a control character" if char.isascii() else \
                f"the non-ASCII character {char!r}"
            raise ValueError(f"{source} holds {what} at character {i + 1}; a bearer token is one line of "
                             "printable ASCII")


def bearer_metadata(token: str | None) -> Metadata:
    if not token:
        return ()
    return (("authorization", f"Bearer {token}"),)


def _secure_credentials(credentials: grpc.ChannelCredentials, token: str | None) -> grpc.ChannelCredentials:
    if not token:
        return credentials
    return grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))


def prepare_channel(
    tls: TlsSpec,
    token: str | None,
    options: list[tuple[str, Any]] | None,
    tls_server_name: str | None,
    tls_client_cert: PemSpec = None,
    tls_client_key: PemSpec = None,
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    if token:
        check_token(token)  # here, not as a retried UNAVAILABLE at the first call
    credentials = channel_credentials(tls, client_cert=tls_client_cert, client_key=tls_client_key)
    if tls_server_name and credentials is None:
        raise ValueError("tls_server_name needs a TLS channel: pass tls=True or a CA certificate")
    return credentials, channel_options(options, tls_server_name=tls_server_name)


def create_channel(
    target: str,
    *,
    tls: TlsSpec = None,
    token: str | None = None,
    options: list[tuple[str, Any]] | None = None,
    tls_server_name: str | None = None,
    tls_client_cert: PemSpec = None,
    tls_client_key: PemSpec = None,
) -> tuple[grpc.Channel, Metadata]:
    """A sync channel and the metadata every call on it must send (`target`
    without a port: vaed's 50051, see `with_default_port`)."""
    target = with_default_port(target)
    credentials, opts = prepare_channel(tls, token, options, tls_server_name, tls_client_cert, tls_client_key)
    if credentials is None:
        return grpc.insecure_channel(target, options=opts), bearer_metadata(token)
    return grpc.secure_channel(target, _secure_credentials(credentials, token), options=opts), ()


def create_aio_channel(
    target: str,
    *,
    tls: TlsSpec = None,
    token: str | None = None,
    options: list[tuple[str, Any]] | None = None,
    tls_server_name: str | None = None,
    tls_client_cert: PemSpec = None,
    tls_client_key: PemSpec = None,
) -> tuple[grpc.aio.Channel, Metadata]:
    """A grpc.aio channel (bound to the running loop) and the metadata every call must send."""
    target = with_default_port(target)
    credentials, opts = prepare_channel(tls, token, options, tls_server_name, tls_client_cert, tls_client_key)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=opts), bearer_metadata(token)
    return grpc.aio.secure_channel(target, _secure_credentials(credentials, token), options=opts), ()
