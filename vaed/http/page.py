"""The page at `GET /` of the HTTP front: the served model, its live load, and a player that decodes
latents through the streaming fMP4 route and plays the video while it decodes.

Routes (on the front's listener, beside the protocol's `POST /` and `POST /decode`):

    GET  /                  the page (static HTML, `vaed/http/static/`)
    GET  /page.js, /page.css  its script and style: plain files, no build step, nothing fetched
                            from elsewhere (the server may have no network, and neither may its users)
    GET  /v1/status         JSON: serving or not, the device load, the model's facts (polled by the page)
    POST /v1/convert/pt     a `torch.save`d tensor in, its raw bytes out (`shape` / `dtype` headers,
                            as a `pt` answer): the page's upload of a .pt file

The player reads .npy and .safetensors files itself (both are a small header and raw C-order bytes),
generates random latents itself, and POSTs the bytes to the protocol's own streaming route
(`output_type=mp4&stream=true`); it appends each chunk to a Media Source Extensions buffer as it
arrives, with the codec string (`avc1.PPCCLL`) read from the init segment's `avcC` box. The video is
the route's, byte for byte: the page adds no decode path of its own.

Why .pt goes through the server: a .pt file is a zip holding a pickle, and only torch's own loader
reads it faithfully (tensor subclasses, storages shared between tensors, byte orders); a pickle
interpreter in JavaScript would be a second, partial copy of it. `torch.load(weights_only=True)`
refuses anything but tensors and plain containers, so a hostile file cannot run code. The route
has the decode route's guards: the bearer token and Content-Length (<= the message limit) from
the head, the body read only then, and one conversion at a time (another gets 429), so its memory
is one body at most.

Auth: the page and its files are static and need no token (they hold no data). `/v1/status` follows
the server's two open doors: the load (sessions, pending latent frames, device health, GPU memory) is
what `/metrics` serves, and, like `/metrics` and `/health`, needs no token; the model's facts are
what gRPC's GetModelInfo answers, which needs the token, so with a token configured they are in the
answer only when the request carries it (`"authorised": false` otherwise). The page asks for the token
and sends it with every request.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import io
import zipfile
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import hdrs, web

from ..calls import CallCore
from ..errors import InvalidInput, NotReady
from ..metrics import cuda_memory
from .front import HfFront, defer_continue, encoded_body
from .hf_protocol import LATENT_DTYPE_NAMES, tensor_bytes, tensor_headers
from .server import json_error

PAGE_PATH = "/"
STATUS_PATH = "/v1/status"
CONVERT_PT_PATH = "/v1/convert/pt"
# A .pt file's pickle (its objects' structure; the tensors' bytes are records of their own): a
# tensor's is ~180 bytes, a dict of a dozen tensors' ~330, so 64 KiB is room for any latents file
# and bounds what unpickling it builds (each opcode may make an object).
MAX_PICKLE_BYTES = 64 << 10

# The page's files: served path -> (file in vaed/http/static, content type).
_FILES = {
    PAGE_PATH: ("index.html", "text/html"),
    "/page.js": ("page.js", "text/javascript"),
    "/page.css": ("page.css", "text/css"),
}

# Everything the page needs comes from this server; the video is a MediaSource's blob: URL.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; media-src 'self' blob:; img-src 'self' data:; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    hdrs.CACHE_CONTROL: "no-cache",  # a restarted (upgraded) server serves its own page
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    content_type: str


def load_files() -> dict[str, StaticFile]:
    """The page's files, read once (they are package data; a few tens of KB)."""
    static = importlib.resources.files("vaed.http") / "static"
    return {path: StaticFile((static / name).read_bytes(), kind) for path, (name, kind) in _FILES.items()}


def status_body(core: CallCore, authorised: bool, auth_required: bool) -> dict[str, Any]:
    """What `/v1/status` answers (see the module docstring for which part needs the token)."""
    try:
        core.check_serving()
        state, error = "SERVING", None
    except NotReady as exc:
        state, error = "NOT_SERVING", str(exc)
    loads = []
    for load in core.pool.device_loads():
        allocated, peak = cuda_memory(load.device) if load.device.startswith("cuda") else (0.0, 0.0)
        loads.append({
            "device": load.device, "healthy": load.healthy, "active_sessions": load.active_sessions,
            "pending_latent_frames": load.pending_latent_frames,
            "gpu_memory_allocated_bytes": int(allocated), "gpu_memory_peak_bytes": int(peak),
        })
    body: dict[str, Any] = {
        "status": state, "auth_required": auth_required, "authorised": authorised,
        "max_sessions": core.pool.max_sessions, "devices": loads,
    }
    if error is not None:
        body["error"] = error
    if authorised and state == "SERVING":
        try:
            facts = core.model_facts()
        except NotReady:  # the last device failed between the two reads
            return body
        body["model"] = {
            "name": facts.model, "random_weights": facts.random_weights, "device": facts.device,
            "devices": facts.devices, "parallel": facts.parallel,
            "compute_dtype": str(facts.compute_dtype).removeprefix("torch."), "kernels": facts.kernels,
            "precisions": [str(p) for p in facts.precisions], "z_dim": facts.z_dim,
            "scale_factor_temporal": facts.scale_factor_temporal,
            "scale_factor_spatial": facts.scale_factor_spatial,
            "default_fps": core.default_fps(),
            "max_latent_frames": facts.max_latent_frames, "max_pixels": facts.max_pixels,
            "max_message_bytes": facts.max_message_bytes, "encodes": facts.encodes,
        }
    return body


class TooLarge(InvalidInput):
    """Latents over the server's message limit (413)."""


def latents_of(loaded: Any, limit: int) -> torch.Tensor:
    """The latents in what `torch.load` returned: a tensor, or a dict / list / tuple holding one
    (a dict's "latents" entry when it has several), as a contiguous tensor of at most `limit` bytes
    (checked before it is made: an expanded tensor's file is small and its copy need not be)."""
    if isinstance(loaded, torch.Tensor):
        tensor = loaded
    else:
        values = list(loaded.values()) if isinstance(loaded, dict) else \
            list(loaded) if isinstance(loaded, (list, tuple)) else []
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if isinstance(loaded, dict) and isinstance(loaded.get("latents"), torch.Tensor):
            tensor = loaded["latents"]
        elif len(tensors) == 1:
            tensor = tensors[0]
        else:
            raise InvalidInput(f"the file holds {len(tensors)} tensors in a {type(loaded).__name__}; save one "
                               "tensor, or a dict with a 'latents' entry")
    if tensor.layout != torch.strided:
        raise InvalidInput(f"the tensor is {tensor.layout}; save a dense tensor (.to_dense())")
    # float64 is numpy's default; the protocol's latent dtypes stop at float32
    dtype = torch.float32 if tensor.dtype == torch.float64 else tensor.dtype
    if str(dtype).removeprefix("torch.") not in LATENT_DTYPE_NAMES:
        raise InvalidInput(f"the tensor is {tensor.dtype}; latents are {', '.join(LATENT_DTYPE_NAMES)}")
    if tensor.dim() == 4:  # [z, T, h, w]: one video
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 5:
        raise InvalidInput(f"the tensor has shape {list(tensor.shape)}; latents are [B, z, T, h, w]")
    size = tensor.numel() * torch.empty((), dtype=dtype).element_size()
    if size > limit:
        raise TooLarge(f"the latents {list(tensor.shape)} in {str(dtype).removeprefix('torch.')} are {size} bytes, "
                       f"over the server's message limit of {limit} bytes")
    return tensor.to(dtype).contiguous()


def _check_unpacked_size(body: memoryview, limit: int) -> None:
    """Refuse a file whose records unpack to more than `limit` bytes, or whose pickle is over
    MAX_PICKLE_BYTES, from its zip directory and before anything is unpacked: torch.load inflates
    each record into a buffer of its declared size (a 2 MB file of deflated zeros took 2 GiB of
    the server's memory before the latents' own size check), and every opcode of the pickle may
    build an object (20 MB of one-byte "empty dict" opcodes, deflated to a 20 KB body, took
    1.6 GB and 29 s of CPU). Only torch.save's zip format (its default since torch 1.6): the
    legacy one sizes its storages from numbers in the file, not from what the file holds."""
    try:
        records = zipfile.ZipFile(io.BytesIO(body)).infolist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise InvalidInput(f"not a torch.save file in its zip format, which torch.load(weights_only=True) reads "
                           f"here (save it again with torch.save's defaults): {exc}") from None
    unpacked = sum(record.file_size for record in records)
    if unpacked > limit:
        raise TooLarge(f"the file unpacks to {unpacked} bytes, over the server's message limit of {limit} bytes")
    pickled = sum(record.file_size for record in records if record.filename.endswith(".pkl"))
    if pickled > MAX_PICKLE_BYTES:
        raise TooLarge(f"the file's pickle is {pickled} bytes; a latents file's is a few hundred (this server "
                       f"reads at most {MAX_PICKLE_BYTES}: a tensor, or a list or dict of tensors)")


def _load_pt(body: memoryview, limit: int) -> torch.Tensor:
    _check_unpacked_size(body, limit)
    try:
        loaded = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # a bad zip, a refused pickle global, a truncated file: all the caller's
        raise InvalidInput(f"not a torch.save file torch.load(weights_only=True) reads: {exc}") from None
    return latents_of(loaded, limit)


class PageRoutes:
    """The page, its status and its .pt conversion, over the front's core and auth.

    The token check, the body read and the deferred `100 Continue` are the front's own
    (`HfFront.unauthorised`, `HfFront.read_body`, `defer_continue`), used here rather than
    copied: one way to check a request, whichever route it is for."""

    def __init__(self, core: CallCore, front: HfFront, auth_required: bool) -> None:
        self.core = core
        self.front = front
        self.auth_required = auth_required
        self.files = load_files()
        self._converting = asyncio.Lock()  # one .pt body in memory at a time

    def add_routes(self, app: web.Application) -> None:
        for path in self.files:
            app.router.add_get(path, self.static)
        app.router.add_get(STATUS_PATH, self.status, allow_head=False)
        app.router.add_post(CONVERT_PT_PATH, self.convert_pt, expect_handler=defer_continue)

    async def static(self, request: web.Request) -> web.Response:
        file = self.files[request.path]
        return web.Response(body=file.body, content_type=file.content_type, charset="utf-8", headers=_PAGE_HEADERS)

    async def status(self, request: web.Request) -> web.Response:
        authorised = self.front.unauthorised(request) is None
        return web.json_response(status_body(self.core, authorised, self.auth_required),
                                 headers={hdrs.CACHE_CONTROL: "no-store"})

    async def convert_pt(self, request: web.Request) -> web.Response:
        if (problem := self.front.unauthorised(request)) is not None:
            return json_error(401, problem, {hdrs.WWW_AUTHENTICATE: "Bearer"})
        if (problem := encoded_body(request)) is not None:
            return json_error(415, problem)
        length = request.content_length
        limit = self.core.config.max_message_bytes
        if length is None:
            return json_error(411, "Content-Length is required: send the .pt file as one body of known size")
        if length > limit:
            return json_error(413, f"the file is {length} bytes and this server takes at most {limit} bytes "
                               "(its message limit)")
        if self._converting.locked():
            return json_error(429, "another .pt file is being read; retry shortly", {hdrs.RETRY_AFTER: "1"})
        async with self._converting:
            try:
                # within the timeout a decode's body has: a client that stalls mid-body would
                # otherwise hold the one converter from every other user until it closed its socket
                timeout = self.core.config.session_first_message_timeout or None
                try:
                    body = await asyncio.wait_for(self.front.read_body(request, length), timeout)
                except TimeoutError:
                    return json_error(504, f"the file did not arrive within {timeout:g} s (the server's "
                                           "--session-first-message-timeout)")
                # torch.load unzips and copies: off the loop, which serves every other call
                loading = asyncio.get_running_loop().run_in_executor(None, _load_pt, body, limit)
                try:
                    tensor = await asyncio.shield(loading)
                except asyncio.CancelledError:
                    # the client left, and a load cannot be stopped: the lock stays held until it
                    # ends, or a client that keeps leaving would have several files in memory at once
                    await asyncio.wait([loading])
                    if not loading.cancelled():
                        loading.exception()  # read, as nobody answers it
                    raise
            except TooLarge as exc:
                return json_error(413, str(exc))
            except InvalidInput as exc:
                return json_error(400, str(exc))
            del body
            return web.Response(body=tensor_bytes(tensor), headers=tensor_headers(tensor))
