"""The one test harness: an in-process vaed server on port 0 (on its own event
loop thread, reached through the real client and the real wire), diffusers
reference computations, TLS material, a fake VaeDecoder for client tests, and
the repository's scripts as modules."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import grpc
import launcher
import numpy as np
import torch

from vaed.config import ServerConfig
from vaed.models import load_model
from vaed.server import VaedServer
from vaed_client import channel as vchannel
from vaed_client import tensors
from vaed_client._proto import vaed_pb2, vaed_pb2_grpc
from vaed_client.video import output_frames

CUDA = torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, name: str | None = None) -> ModuleType:
    """A script of the repository (benchmarks/ and scripts/ are no packages) loaded as a module,
    afresh, and registered under `name` (the file's stem by default): dataclasses look their
    module up while a class is built, and a script importing another by name gets this one."""
    path = REPO / relative_path
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class RunningServer:
    server: VaedServer
    loop: asyncio.AbstractEventLoop
    config: ServerConfig

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def vae(self) -> Any:
        """The served module (after the installer ran on it)."""
        assert self.server.pool.engine is not None
        return self.server.pool.engine.vae

    def reference_vae(self) -> Any:
        """A separate copy of the same weights for diffusers reference decodes."""
        engine = self.server.pool.engine
        assert engine is not None
        return load_model(self.config.model, self.config.device, engine.dtype).vae

    @property
    def active_sessions(self) -> int:
        return self.server.pool.active_sessions


@contextlib.contextmanager
def serve_in_thread(
    config: ServerConfig, ready_timeout: float = 300, build_engine: Any = None
) -> Iterator[RunningServer]:
    """A VaedServer on its own event loop thread, SERVING; `build_engine(device)` replaces the real engine factory."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server-loop", daemon=True)
    thread.start()
    server = VaedServer(config, build_engine)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
        asyncio.run_coroutine_threadsafe(server.wait_ready(ready_timeout), loop).result(ready_timeout + 5)
        yield RunningServer(server=server, loop=loop, config=config)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=1), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def make_config(model: str = "random:wan2.1-tiny", **overrides: Any) -> ServerConfig:
    base: dict[str, Any] = dict(model=model, devices=("cpu",), host="127.0.0.1", port=0, max_sessions=16, grace=1.0)
    if "device" in overrides:  # one device, the common case
        overrides["devices"] = (overrides.pop("device"),)
    base.update(overrides)
    return ServerConfig(**base)



def start_cli_server(*extra: str) -> tuple[subprocess.Popen, str]:
    """`vaed serve` in a subprocess on the CPU (tiny model, port 0); returns (process, target) once SERVING."""
    proc, target, _ = start_serve(*extra)
    return proc, target


def serve_argv(*extra: str, device: tuple[str, ...] = ("--device", "cpu")) -> list[str]:
    """The command line of a test's `vaed serve` (random:wan2.1-tiny unless `extra` names another, port 0)."""
    return [sys.executable, "-m", "vaed.cli", "serve", *device, "--host", "127.0.0.1", "--port", "0",
            "--model", "random:wan2.1-tiny", *extra]


def start_serve(*extra: str, device: tuple[str, ...] = ("--device", "cpu"), until: str = "SERVING",
                timeout: float = 120, fresh_interpreter: bool = False,
                environ: dict[str, str] | None = None) -> tuple[Any, str, list[str]]:
    """`vaed serve` in its own process (random:wan2.1-tiny unless `extra` names another --model,
    port 0); returns (process, target, its log lines so far) once a line holds `until` and the
    port is known. A process that ends or takes longer than `timeout` s fails the test. The
    process is forked from a pre-imported interpreter (tests/launcher.py), or with
    `fresh_interpreter` a `subprocess.Popen` of the command line. `environ` is added to the
    process's environment (what the C runtime reads at its start needs `fresh_interpreter`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(environ or {}))
    argv = serve_argv(*extra, device=device)
    proc: Any
    if fresh_interpreter:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    else:
        proc = launcher.ServeProcess(launcher.vaed_argv(argv), env)
    assert proc.stdout is not None
    port = None
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"\(port (\d+),", line)
        if match:
            port = match.group(1)
        if until in line and port:
            return proc, f"127.0.0.1:{port}", lines
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines))


def decode_rpc(target: str, latents: Any, timeout: float = 60) -> int:
    """One whole-video `Decode` RPC of `latents` (numpy or torch) with default options, as an
    independent client sends it (`VaeClient.decode` sends a DecodeStream); the frames received.
    A failed call raises its grpc.RpcError."""
    with grpc.insecure_channel(target, options=vchannel.channel_options()) as channel:
        request = vaed_pb2.DecodeRequest(latents=tensors.to_message(latents))
        replies = list(vaed_pb2_grpc.VaeDecoderStub(channel).Decode(request, timeout=timeout))
    return sum(int(r.frames.shape[1]) for r in replies if r.HasField("frames") and len(r.frames.shape))


def proc_rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def proc_fd_count(pid: int) -> int:
    """Open file descriptors of a process (Linux /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class PeakRss:
    """Samples a process's VmRSS every 5 ms in a thread; `.peak` after `with`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self.peak = proc_rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_rss_bytes(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # whatever the calls left behind shows up too
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_rss_bytes(self.pid))


# -- tensors for the kernel tests -----------------------------------------------

def lay(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in a memory layout: "cl3d" (channels_last_3d), "ntchw" (frames outermost) or contiguous."""
    if layout == "cl3d":
        return t.contiguous(memory_format=torch.channels_last_3d)
    if layout == "ntchw":
        return t.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    return t.contiguous()


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-exact with the same shape, dtype and strides."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.stride() == b.stride(), (a.stride(), b.stride())
    assert torch.equal(a, b)


def chunked_decode(vae: Any, z: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The engine's loop: session cache, one decoder call per latent frame; returns (decoder
    output, cache)."""
    n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
    cache: list = [None] * n
    x = vae.post_quant_conv(z)
    outs = [vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
            for i in range(x.shape[2])]
    return torch.cat(outs, 2), cache


def assert_same_cache(got: list, want: list) -> None:
    """Two decoder caches entry for entry: tensors bit-exact with their strides, markers equal."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert_same(a, b)
        else:
            assert a == b


def every_value(dtype: torch.dtype, device: str = "cuda") -> torch.Tensor:
    """A channels-last [1, 4, 1, n, 16] activation holding every finite bf16/fp16 bit
    pattern (fp32: 2^20 normal samples), for exhaustive rounding tests."""
    if dtype == torch.float32:
        v = torch.randn(1 << 20, device=device) * 8
    else:
        v = torch.arange(-(1 << 15), 1 << 15, device=device, dtype=torch.int32).to(torch.int16).view(dtype)
        v = v[torch.isfinite(v)]
    n = v.numel() - v.numel() % 64
    return v[:n].reshape(1, 4, 1, -1, 16).contiguous(memory_format=torch.channels_last_3d)


def rgb8(decoded: torch.Tensor) -> torch.Tensor:
    """The RGB8 postprocess (as vaed.engine_protocol.postprocess) of a clamped decoder output [B, 3, T, H, W] -> [B, T, H, W, 3]."""
    return ((decoded.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)


def denormalize(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """What WanPipeline does to output_type='latent' latents before vae.decode."""
    z = vae.config.z_dim
    latents = latents.to(vae.device, vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)).to(latents.device, latents.dtype)
    return latents / inv_std + mean


@torch.no_grad()
def diffusers_decode(vae: Any, latents: torch.Tensor, *, raw_latents: bool) -> torch.Tensor:
    z = latents.to(vae.device, vae.dtype) if raw_latents else denormalize(vae, latents)
    return vae.decode(z, return_dict=False)[0].cpu()


def self_signed_pem(host: str = "localhost") -> tuple[bytes, bytes]:
    """A self-signed EC cert valid for `host` and 127.0.0.1, as (cert PEM, key PEM)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_self_signed(directory: Any, host: str = "localhost") -> tuple[Any, Any]:
    """`self_signed_pem` written to directory/tls.crt and tls.key (0600); returns the two paths."""
    import os

    cert_pem, key_pem = self_signed_pem(host)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert_pem)
    key_path.write_bytes(key_pem)
    os.chmod(key_path, 0o600)
    return cert_path, key_path


@dataclass(frozen=True)
class Pki:
    """A CA and certificates it signed, written as PEM files (keys 0600) for a mutual TLS test."""

    ca: Any  # the CA certificate: --tls-client-ca, and the client's tls= to verify the server
    server_cert: Any
    server_key: Any
    client_cert: Any
    client_key: Any


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def write_pki(directory: Any, name: str = "test", host: str = "localhost") -> Pki:
    """A fresh CA `name` and, signed by it, a server certificate for `host` and 127.0.0.1
    (serverAuth) and a client certificate (clientAuth), under directory/name-*.pem."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key: Any, issuer: x509.Name, signer: Any, *, ca: bool,
             usage: Any = None, san: Any = None) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca_cert = cert(f"{name} CA", ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = cert(host, server_key, ca_name, ca_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                  san=[x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = cert(f"{name} client", client_key, ca_name, ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)

    paths = Pki(*(directory / f"{name}-{part}.pem" for part in ("ca", "server", "server-key", "client", "client-key")))
    for path, c in ((paths.ca, ca_cert), (paths.server_cert, server), (paths.client_cert, client)):
        path.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    for path, k in ((paths.server_key, server_key), (paths.client_key, client_key)):
        path.write_bytes(_key_pem(k))
        os.chmod(path, 0o600)
    return paths


# -- a fake VaeDecoder for client tests (no model, no torch math) -------------

SPATIAL = 8
TEMPORAL = 4


# -- the fake server ---------------------------------------------------------
def fake_video(b: int, t: int, h: int, w: int, first: int = 0) -> np.ndarray:
    """[B, t, H, W, 3] uint8 frames first..first+t-1 of the synthetic video."""
    bi = np.arange(b).reshape(b, 1, 1, 1, 1)
    fi = np.arange(first, first + t).reshape(1, t, 1, 1, 1)
    yi = np.arange(h).reshape(1, 1, h, 1, 1)
    xi = np.arange(w).reshape(1, 1, 1, w, 1)
    ci = np.arange(3).reshape(1, 1, 1, 1, 3)
    return ((bi * 50 + fi * 7 + yi * 3 + xi + ci * 11) % 256).astype(np.uint8)


def fake_raw(video: np.ndarray) -> np.ndarray:
    """RGB8 video -> RAW layout [B, 3, t, H, W] float32 in [-1, 1]."""
    return (video.astype(np.float32) / 127.5 - 1.0).transpose(0, 4, 1, 2, 3).copy()


def raw_message(raw: np.ndarray, wire_dtype: int) -> vaed_pb2.Tensor:
    t = torch.from_numpy(raw)
    return tensors.to_message(t.to(tensors.torch_dtype(wire_dtype)))


class FakeDecoder(vaed_pb2_grpc.VaeDecoderServicer):
    def __init__(self) -> None:
        self.max_frames_per_message = 3  # forces split groups
        self.final_empty = True  # False: final flag rides on the last frames message
        self.delay_s = 0.0
        self.unavailable_left = 0
        self.attempts = 0
        self.metadata: list[dict[str, str]] = []
        self.requests: list[Any] = []  # every message received, in order
        self.call_options: list[Any] = []  # each call's DecodeOptions (a stream's from its first message)
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.compute_dtype = vaed_pb2.FLOAT32  # ModelInfo's: the client sends float32 latents as bf16 to BFLOAT16

    def _enter(self, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.metadata.append(dict(context.invocation_metadata()))
            self.attempts += 1
            if self.unavailable_left > 0:
                self.unavailable_left -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")

    def _track(self, context: grpc.ServicerContext, messages: Iterator[Any]) -> Iterator[Any]:
        """Sets `cancelled` when the call terminates before its last message."""
        ended: list[bool] = []
        context.add_callback(lambda: ended or self.cancelled.set())
        try:
            yield from messages
        except Exception:  # context.abort() raises: an error, not a cancel
            ended.append(True)
            raise
        ended.append(True)

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> vaed_pb2.ModelInfo:
        self._enter(context)
        return vaed_pb2.ModelInfo(
            model="fake",
            z_dim=16,
            scale_factor_temporal=TEMPORAL,
            scale_factor_spatial=SPATIAL,
            latents_mean=[0.5] * 16,
            latents_std=[2.0] * 16,
            compute_dtype=self.compute_dtype,
            device="cpu",
            random_weights=True,
            max_message_bytes=vchannel.MAX_MESSAGE_BYTES,
        )

    def _check(self, options: vaed_pb2.DecodeOptions, latents: vaed_pb2.Tensor, context: Any) -> None:
        if options.request_id.startswith("abort:"):
            context.abort(grpc.StatusCode[options.request_id.split(":")[1]], "fake failure")
        if len(latents.shape) != 5:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"latents must be 5-D, got {list(latents.shape)}")

    def _groups(
        self, latents: vaed_pb2.Tensor, options: vaed_pb2.DecodeOptions, start: int, chunk_index: int, rid: str
    ) -> Iterator[vaed_pb2.FrameChunk]:
        b, _, t, h, w = latents.shape
        for g in range(start, start + t):
            first = 0 if g == 0 else 1 + TEMPORAL * (g - 1)
            count = 1 if g == 0 else TEMPORAL
            for f in range(first, first + count, self.max_frames_per_message):
                n = min(self.max_frames_per_message, first + count - f)
                video = fake_video(b, n, h * SPATIAL, w * SPATIAL, first=f)
                if options.format == vaed_pb2.RAW:
                    frames = raw_message(fake_raw(video), options.raw_dtype or vaed_pb2.FLOAT32)
                else:
                    frames = tensors.to_message(video)
                if self.delay_s:
                    time.sleep(self.delay_s)
                yield vaed_pb2.FrameChunk(request_id=rid, chunk_index=chunk_index, first_frame=f, frames=frames)
            chunk_index += 1

    def _finish(self, messages: Iterator[vaed_pb2.FrameChunk], rid: str) -> Iterator[vaed_pb2.FrameChunk]:
        last = None
        for message in messages:
            rid = message.request_id
            if last is not None:
                yield last
            last = message
        if self.final_empty or last is None:
            if last is not None:
                yield last
            yield vaed_pb2.FrameChunk(request_id=rid, final=True)
        else:
            last.final = True
            yield last

    def Decode(self, request: Any, context: grpc.ServicerContext) -> Iterator[vaed_pb2.FrameChunk]:
        self._enter(context)
        self.requests.append(request)
        self.call_options.append(request.options)
        self._check(request.options, request.latents, context)
        rid = request.options.request_id or "fake-id"
        yield from self._track(context, self._finish(self._groups(request.latents, request.options, 0, 0, rid), rid))

    def DecodeStream(self, request_iterator: Any, context: grpc.ServicerContext) -> Iterator[vaed_pb2.FrameChunk]:
        self._enter(context)

        def all_groups() -> Iterator[vaed_pb2.FrameChunk]:
            options = None
            done = 0
            for i, chunk in enumerate(request_iterator):
                self.requests.append(chunk)
                if i == 0:
                    options = chunk.options
                    self.call_options.append(options)
                elif chunk.HasField("options"):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "options on a non-first message")
                self._check(options, chunk.latents, context)
                # chunk_index is the latent frame's index in the session, as on the real server
                yield from self._groups(chunk.latents, options, done, done, options.request_id or "fake-id")
                done += chunk.latents.shape[2]

        yield from self._track(context, self._finish(all_groups(), "fake-id"))


def start_fake_server(servicer: FakeDecoder, credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=vchannel.channel_options())
    vaed_pb2_grpc.add_VaeDecoderServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def latents_np(b: int = 1, t: int = 3, h: int = 2, w: int = 3, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((b, 16, t, h, w)).astype(dtype)


def expected_video(b: int, t: int, h: int, w: int) -> np.ndarray:
    return fake_video(b, output_frames(t, TEMPORAL), h * SPATIAL, w * SPATIAL)


def engine_calling_at(config: ServerConfig, chunk_index: int, hook: Any) -> Any:
    """A `build_engine` for `serve_in_thread`: the real engine, which calls `hook()` on its worker
    thread once it has decoded latent frame `chunk_index`, to hold or fail a call at a known point
    (by events, never by time)."""
    from vaed.server import engine_factory

    def build(device: str) -> Any:
        engine = engine_factory(config)(device)
        decode_frame = engine.decode_frame

        def decode_then_hook(state: Any, latent_frame: torch.Tensor, output: Any) -> Any:
            group = decode_frame(state, latent_frame, output)
            if group.chunk_index == chunk_index:
                hook()
            return group

        engine.decode_frame = decode_then_hook
        return engine

    return build


def count_launches(monkeypatch: Any, module: Any, getter: str) -> list[int]:
    """Counts the calls of a kernel module's lazily-compiled kernel getter (`rt.jit_lazy`'s
    result, e.g. `dupup._cl_kernel`): each launch fetches the kernel once. Returns a one-item
    list the test reads after its calls."""
    count = [0]
    real = getattr(module, getter)

    def counted() -> Any:
        count[0] += 1
        return real()

    monkeypatch.setattr(module, getter, counted)
    return count
