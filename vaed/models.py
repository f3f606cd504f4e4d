"""Model specs: what `--model` accepts and how each becomes an AutoencoderKLWan.

- a local diffusers folder: a pipeline root holding `vae/`, or the `vae` folder itself
- a hub id such as `Wan-AI/Wan2.1-T2V-1.3B-Diffusers` (subfolder `vae`)
- `random:<arch>[?seed=N]`: the real architecture with the weights of
  `torch.manual_seed(seed); AutoencoderKLWan(**config)` (seed 0 by default).
  Compute is identical to real weights, so tests and benchmarks use these
  where weights cannot be downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import threading
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ModelLoadError

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"

# Wan2.2 TI2V-5B VAE: its published per-channel latent statistics.
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip

WAN22_CONFIG: dict[str, Any] = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    latents_mean=WAN22_LATENTS_MEAN,
    latents_std=WAN22_LATENTS_STD,
)

# Random architectures. The "-tiny" ones keep every structural feature of
# their family (causal caches, temporal upsampling, Wan2.2's residual
# up-blocks and 2x2 patches) at a few channels, so CPU tests decode in
# milliseconds.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "wan2.1": {},
    "wan2.2": WAN22_CONFIG,
    "wan2.1-tiny": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                        latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 0.8]),
    "wan2.2-tiny": dict(base_dim=8, decoder_base_dim=8, z_dim=6, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                        out_channels=12, patch_size=2, scale_factor_spatial=16,
                        latents_mean=WAN22_LATENTS_MEAN[:6], latents_std=WAN22_LATENTS_STD[:6]),
}  # fmt: skip

# The config fields that set an AutoencoderKLWan's layer shapes, with diffusers' defaults: two
# models alike in these launch the same kernel variants (`kernel_family`).
SHAPE_FIELDS: dict[str, Any] = dict(
    base_dim=96, decoder_base_dim=None, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], is_residual=False, in_channels=3, out_channels=3, patch_size=None,
)


# diffusers imports its model classes lazily, and two device threads importing at
# once made one of them fail ("cannot import name 'AutoencoderKLWan'", GPU pool
# on two H200s): the first import happens under this lock.
_IMPORT_LOCK = threading.Lock()


def autoencoder_class() -> Any:
    """diffusers' AutoencoderKLWan, imported safely from any thread."""
    with _IMPORT_LOCK:
        from diffusers import AutoencoderKLWan

    return AutoencoderKLWan


@dataclass
class LoadedModel:
    vae: Any  # diffusers AutoencoderKLWan, eval mode, on its device and dtype
    spec: str
    random_weights: bool
    # encoder-only copies in other dtypes (decoder and post_quant_conv None), from the loaded
    # weights before their cast: an fp32 encode beside a bf16 decode (load_model's encoder_dtypes)
    encoder_copies: dict[torch.dtype, Any] = dataclasses.field(default_factory=dict)
    # `weights_digest` of each half loaded ("decoder", "encoder"), of the weights before the cast
    # and the move to the device, done beside the rest of the start-up (`_digests`; a model built
    # elsewhere, e.g. by a benchmark, has none: see vaed.engine.DecodeEngine.identity)
    digests: dict[str, Future[str]] = dataclasses.field(default_factory=dict)


# The modules of each half of an AutoencoderKLWan: a decode runs the first, an encode the second.
HALVES: dict[str, tuple[str, ...]] = {"decoder": ("post_quant_conv", "decoder"), "encoder": ("encoder", "quant_conv")}


def weights_digest(vae: Any, half: str) -> str:
    """sha256 (hex) of what a half of the model computes with: the model config's public fields
    (layer shapes, latents_mean/std, ...) and the half's tensors, each as name, dtype, shape and
    bytes, in name order. Equal for the same files or seed wherever they are served; taken on the
    weights as loaded, so dtype and device are not in it (the identity names them apart).

    Cost: sha256 runs at ~2 GB/s on a CPU with SHA extensions. Measured in fp32 on a 2-core CI
    machine / the H200 machine's CPU: random:wan2.1 0.14 / 0.25 s for the decoder half (293 MB),
    0.10 / 0.18 s for the encoder's (214 MB); random:wan2.2 1.07 / 1.74 s (2.2 GB) and
    0.29 / 0.47 s (0.6 GB). `load_model` runs it beside the move to the GPU (`_digests`)."""
    return _digest(*_digest_inputs(vae, half))


def _digest_inputs(vae: Any, half: str) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """What `weights_digest` hashes: the config's JSON and the half's tensors (references to the
    model's own storage: they must not change until the digest is made)."""
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}  # `_name_or_path`: not compute
    tensors = [(f"{module_name}.{name}", tensor.detach())
               for module_name in HALVES[half]
               for name, tensor in sorted(getattr(vae, module_name).state_dict().items())]
    return json.dumps(config, sort_keys=True, default=str).encode(), tensors


def _digest(config: bytes, tensors: list[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256(config)
    for name, tensor in tensors:
        data = tensor.to("cpu").contiguous().reshape(-1)
        digest.update(f"\n{name} {data.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(data.view(torch.uint8).numpy().data)  # every dtype as its bytes (numpy has no bf16)
    return digest.hexdigest()


# sha256 releases the GIL on large buffers, so a digest thread runs beside the start-up's own work.
_DIGESTS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weights-digest")


def _digests(vae: Any, halves: list[str], device: torch.device) -> dict[str, Future[str]]:
    """`weights_digest` of each of `halves`, in a thread when the model is about to be copied to a
    GPU: the move leaves the CPU tensors as they are, and Wan2.2's 1.7 s (above) then runs beside
    the move and the start-up's compiles (its effect on a GPU start not measured yet). On the CPU
    the model keeps those tensors, which the fast paths may change in place, so the digest is made
    at once."""
    inputs = {half: _digest_inputs(vae, half) for half in halves}
    if device.type == "cpu":
        return {half: _done(_digest(*args)) for half, args in inputs.items()}
    return {half: _DIGESTS.submit(_digest, *args) for half, args in inputs.items()}


def _done(value: str) -> Future[str]:
    future: Future[str] = Future()
    future.set_result(value)
    return future


def parse_random_spec(spec: str) -> tuple[str, int]:
    """`random:wan2.1?seed=3` -> ("wan2.1", 3)."""
    body = spec[len(RANDOM_PREFIX):]
    arch, _, query = body.partition("?")
    if arch not in RANDOM_CONFIGS:
        raise ModelLoadError(f"unknown random architecture {arch!r}; choose one of {sorted(RANDOM_CONFIGS)}")
    params = urllib.parse.parse_qs(query, strict_parsing=bool(query)) if query else {}
    unknown = set(params) - {"seed"}
    if unknown:
        raise ModelLoadError(f"unknown option(s) {sorted(unknown)} in {spec!r}; only ?seed=N is accepted")
    try:
        seed = int(params.get("seed", ["0"])[-1])
    except ValueError as exc:
        raise ModelLoadError(f"seed must be an integer in {spec!r}") from exc
    return arch, seed


def is_tiny_model(spec: str) -> bool:
    """`random:wan2.1-tiny` and `random:wan2.2-tiny` (with or without ?seed=N)."""
    return spec.startswith(RANDOM_PREFIX) and spec[len(RANDOM_PREFIX):].partition("?")[0].endswith("-tiny")


# The seeded build draws from torch's one global generator: device threads of a pool building at
# once interleaved their draws, and each device served other weights than the seed's (their
# weights digests told them apart). One build at a time.
_BUILD_LOCK = threading.Lock()


def build_random_vae(arch: str, seed: int = 0) -> Any:
    AutoencoderKLWan = autoencoder_class()
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        return AutoencoderKLWan(**RANDOM_CONFIGS[arch])


def kernel_family(spec: str) -> str | None:
    """The random architecture (`wan2.1`, `wan2.2`, ...) with the layer shapes of a spec's model,
    found without loading it (so before diffusers' import): its own for a random spec, else the
    one whose shapes the config.json of the folder, or of the hub id in the local hub cache,
    gives. None where no config is at hand or none matches."""
    if spec.startswith(RANDOM_PREFIX):
        try:
            return parse_random_spec(spec)[0]
        except ModelLoadError:
            return None
    config = _cached_config(spec)
    if config is None:
        return None
    shape = _shape_of(config)
    return next((arch for arch, overrides in RANDOM_CONFIGS.items() if _shape_of(overrides) == shape), None)


def _shape_of(config: dict[str, Any]) -> dict[str, Any]:
    # through JSON, as config.json holds them: tuples become lists
    return {name: json.loads(json.dumps(config.get(name, default))) for name, default in SHAPE_FIELDS.items()}


def _cached_config(spec: str) -> dict[str, Any] | None:
    """The VAE config.json of a local folder or of a hub id already in the local hub cache."""
    path = pathlib.Path(spec).expanduser()
    file: pathlib.Path | None = None
    if path.exists():
        folder = _local_vae_folder(path)
        file = folder / "config.json" if folder is not None else None
    elif not looks_like_path(spec):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec, "vae/config.json")
        file = pathlib.Path(cached) if isinstance(cached, str) else None
    if file is None:
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _local_vae_folder(path: pathlib.Path) -> pathlib.Path | None:
    if (path / "vae" / "config.json").is_file():
        return path / "vae"
    if (path / "config.json").is_file():
        return path
    return None


# What to try when --model names nothing loadable.
_WAYS_OUT = (
    "Pass a local diffusers folder (`--model /path/to/Wan2.1-T2V-1.3B-Diffusers` or its vae/ folder), "
    "or serve seeded random weights with the same architecture (`--model random:wan2.1` or `random:wan2.2`; "
    "`random:wan2.1-tiny` decodes fast on a CPU). With HF_HUB_OFFLINE=1 a hub id loads from the local "
    "hub cache only."
)


def looks_like_path(spec: str) -> bool:
    """A spec that can only be a folder: a hub id is `name` or `namespace/name`, never
    absolute, relative to `.`/`~`, with two slashes or a backslash."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec or spec.endswith("/")


def _check_class(spec: str, config_file: pathlib.Path) -> None:
    """A folder's config.json that names another model class (an image VAE's `AutoencoderKL`)
    is refused by name: loaded as a Wan VAE it failed with a state-dict error whose first line
    named no cause."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # diffusers' load reports it, naming the folder
    name = config.get("_class_name") if isinstance(config, dict) else None
    if name is not None and name != "AutoencoderKLWan":
        raise ModelLoadError(f"{spec}: {config_file} describes a {name}, not a Wan video VAE (AutoencoderKLWan)")


def under_a_local_folder(spec: str) -> bool:
    """`namespace/name` whose namespace is a folder here (`mymodels/wan21` run beside
    `mymodels/`): a path with a typo in its last part, not a hub id -- taken for one, it cost
    ~26 s of hub retries before the error."""
    return "/" in spec and pathlib.Path(spec.split("/", 1)[0]).expanduser().is_dir()


def _load_pretrained(spec: str) -> Any:
    # low_cpu_mem_usage=False: without `accelerate` diffusers would warn on every
    # load that it cannot use the low-memory path; the VAE is 0.5-2.8 GB, so the
    # plain path costs nothing that matters.
    options = dict(low_cpu_mem_usage=False, output_loading_info=True)
    path = pathlib.Path(spec).expanduser()
    # the folder checks come before diffusers' import (~4 s of CPU): a typo fails at once
    if path.exists():
        folder = _local_vae_folder(path)
        if folder is None:
            raise ModelLoadError(
                f"{spec} holds no diffusers VAE: expected {path}/vae/config.json or {path}/config.json"
            )
        _check_class(spec, folder / "config.json")
        try:
            loaded = autoencoder_class().from_pretrained(str(folder), **options)
        except Exception as exc:  # diffusers', safetensors' and json's errors come in many types
            first_line = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ModelLoadError(f"{spec}: diffusers could not load the VAE in {folder} "
                                 f"({type(exc).__name__}: {first_line})") from None
        return _complete(spec, *loaded)
    if looks_like_path(spec) or under_a_local_folder(spec):  # not the hub's: say so now, without its retries
        raise ModelLoadError(f"--model {spec}: no such folder ({path.absolute()}). {_WAYS_OUT}")
    AutoencoderKLWan = autoencoder_class()
    try:  # the local hub cache first: no network round trips when the weights are there
        loaded = AutoencoderKLWan.from_pretrained(spec, subfolder="vae", local_files_only=True, **options)
    except Exception as exc:  # not cached (hub errors come in many types)
        cached_error = exc
    else:
        return _complete(spec, *loaded)
    from huggingface_hub import constants as hub_constants

    try:
        if hub_constants.HF_HUB_OFFLINE:  # honoured: no download attempts and their retries
            raise cached_error
        loaded = AutoencoderKLWan.from_pretrained(spec, subfolder="vae", **options)
    except Exception as exc:
        raise ModelLoadError(
            f"could not load VAE weights for {spec!r}: no such folder here, and the hub failed "
            f"({type(exc).__name__}: {exc}). {_WAYS_OUT}"
        ) from None
    return _complete(spec, *loaded)


def _complete(spec: str, vae: Any, info: dict[str, Any]) -> Any:
    """The loaded VAE when its weights file held every tensor the model has. diffusers fills a
    missing one with whatever memory it got and only prints a line, so a damaged file would serve
    noise, with another weights digest on every replica."""
    missing = list(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(f"{spec}: its weights lack {len(missing)} of the model's tensors ({shown}); "
                             "the file is damaged or of another model")
    unexpected = list(info.get("unexpected_keys") or [])
    if unexpected:
        log.warning("%s: its weights hold %d tensors the model does not use (%s), left out",
                    spec, len(unexpected), ", ".join(unexpected[:3]))
    return vae


def _encoder_copy(vae: Any) -> Any:
    """A deep copy of `vae` without its decoder half (decoder, post_quant_conv set to None)."""
    import copy

    decoder, post_quant_conv = vae.decoder, vae.post_quant_conv
    vae.decoder = vae.post_quant_conv = None
    try:
        return copy.deepcopy(vae)
    finally:
        vae.decoder, vae.post_quant_conv = decoder, post_quant_conv


def load_model(
    spec: str, device: str | torch.device, dtype: torch.dtype, *, decoder_only: bool = False,
    encoder_dtypes: tuple[torch.dtype, ...] = (),
) -> LoadedModel:
    """Load, move to device/dtype, eval mode, no grad. `decoder_only` drops the
    encoder before the move: a decode server never runs it (0.1 GiB of bf16
    weights for Wan2.1). `encoder_dtypes` other than `dtype` each get an
    encoder-only copy made from the loaded weights before their cast (an fp32
    copy of Wan2.1's encoder and quant_conv: 0.2 GiB)."""
    if spec.startswith(RANDOM_PREFIX):
        arch, seed = parse_random_spec(spec)
        vae = build_random_vae(arch, seed)
        random_weights = True
    else:
        vae = _load_pretrained(spec)
        random_weights = False
    # of the CPU copy, before the cast and the move: what was loaded, with no device round trip
    digests = _digests(vae, ["decoder"] if decoder_only else list(HALVES), torch.device(device))
    if decoder_only:
        vae.encoder = None
        vae.quant_conv = None
    copies = {} if decoder_only else {d: _encoder_copy(vae) for d in encoder_dtypes if d != dtype}
    from diffusers.utils import logging as diffusers_logging

    # diffusers warns on every .to(dtype) of a model without fp32-pinned
    # modules (the Wan VAE has none); keep that noise out of server logs.
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        vae = vae.to(device=device, dtype=dtype).eval().requires_grad_(False)
        copies = {d: c.to(device=device, dtype=d).eval().requires_grad_(False) for d, c in copies.items()}
    finally:
        diffusers_logging.set_verbosity(level)
    log.info("loaded %s (%s weights) on %s as %s", spec, "random" if random_weights else "pretrained", device, dtype)
    return LoadedModel(vae=vae, spec=spec, random_weights=random_weights, encoder_copies=copies,
                       digests=digests)
