"""Fill a model folder with the VAE of a Wan diffusers repository, and only that.

vaed loads `<model>/vae/` (config.json + diffusion_pytorch_model.safetensors)
and nothing else, so this fetches `vae/*` and `model_index.json` instead of
the whole repository: ~0.51 GB for Wan2.1 (126.9 M fp32 parameters) and
~2.82 GB for Wan2.2 TI2V-5B (704.7 M), against tens of GB for the text
encoder and transformer that the same repository carries.

    # from the hub (what the Kubernetes Job in k8s/weights runs)
    python scripts/fetch_weights.py --repo Wan-AI/Wan2.1-T2V-1.3B-Diffusers \
        --dest /models/Wan2.1-T2V-1.3B-Diffusers
    # offline: copy from a folder (a weights image, a mounted bucket, a USB disk)
    python scripts/fetch_weights.py --from-dir /weights/Wan2.1-T2V-1.3B-Diffusers \
        --dest /models/Wan2.1-T2V-1.3B-Diffusers
    # is the folder complete? (the decoder pods' init container; --wait polls)
    python scripts/fetch_weights.py --check --dest /models/Wan2.1-T2V-1.3B-Diffusers --wait 1800

Design choices:
- "Complete" is decided from the files themselves, not from a marker: a
  config.json naming AutoencoderKLWan and every *.safetensors file as long as
  its own header says. A folder filled by hand (rsync, `hf download`) passes
  the same check, and a download cut off half way never does.
- A complete folder is left alone (no network) unless --force, so the Job can
  run again on every `kubectl apply` at no cost.
- Copies go to a temporary sibling folder and are renamed into place, so a
  reader never sees a half-copied `vae/`.
- The hub token, when a repository needs one, comes from huggingface_hub's
  own `HF_TOKEN`; nothing here reads it.

Exit codes: 0 done / complete, 1 incomplete or failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("fetch_weights")

ALLOW_PATTERNS = ["vae/*", "model_index.json"]
VAE_CLASS = "AutoencoderKLWan"
PROVENANCE = ".vaed-weights.json"  # what filled the folder, for operators; never required


class WeightsError(Exception):
    """The folder is not a complete Wan VAE (the message says what is missing)."""


# ------------------------------------------------------------ verification


def safetensors_complete(path: Path) -> None:
    """Raise WeightsError unless the file is as long as its header declares.

    safetensors layout: u64 little-endian header length n, n bytes of JSON
    mapping tensor names to data_offsets [begin, end) into the data section.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path}: truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:  # headers are KB; 100 MiB means garbage
            raise WeightsError(f"{path}: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise WeightsError(f"{path}: unreadable header ({exc})") from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if not ends:
        raise WeightsError(f"{path}: holds no tensors")
    if 8 + n + max(ends) != size:
        raise WeightsError(f"{path}: {size} bytes on disk, header declares {8 + n + max(ends)} (partial copy?)")


def verify(dest: Path) -> dict[str, object]:
    """Check `dest` (a pipeline folder holding vae/, or the vae folder itself);
    return a summary {vae_dir, z_dim, files: {name: bytes}}."""
    # A pipeline folder holds vae/; the vae folder itself holds config.json.
    vae = dest if (dest / "config.json").is_file() and not (dest / "vae").exists() else dest / "vae"
    config_path = vae / "config.json"
    if not config_path.is_file():
        raise WeightsError(f"{config_path} is missing")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise WeightsError(f"{config_path}: not JSON ({exc})") from None
    if config.get("_class_name") != VAE_CLASS:
        raise WeightsError(f"{config_path}: _class_name is {config.get('_class_name')!r}, not {VAE_CLASS!r}")
    weights = sorted(vae.glob("*.safetensors"))
    if not weights:
        raise WeightsError(f"{vae} holds no *.safetensors weights")
    for w in weights:
        safetensors_complete(w)
    files = {str(p.relative_to(dest)): p.stat().st_size for p in [config_path, *weights]}
    return {"vae_dir": str(vae), "z_dim": config.get("z_dim", 16), "files": files}


def is_complete(dest: Path) -> bool:
    try:
        verify(dest)
    except (WeightsError, OSError):
        return False
    return True


# ------------------------------------------------------------ filling


def fetch_from_hub(repo: str, dest: Path, revision: str | None) -> None:
    """Download vae/* and model_index.json of `repo` into `dest` (resumable)."""
    from huggingface_hub import snapshot_download  # imported here: --check needs no hub client

    log.info("downloading %s (revision %s) %s -> %s", repo, revision or "main", ALLOW_PATTERNS, dest)
    dest.mkdir(parents=True, exist_ok=True)
    snapshot_download(repo_id=repo, revision=revision, local_dir=str(dest), allow_patterns=ALLOW_PATTERNS)


def copy_from_dir(src: Path, dest: Path) -> None:
    """Copy `src/vae` (or `src` when it is the vae folder) and model_index.json into `dest`."""
    src_vae = src / "vae" if (src / "vae").is_dir() else src
    verify(src)  # refuse to copy an incomplete source instead of failing later in the pod
    dest.mkdir(parents=True, exist_ok=True)
    staging = dest / ".vae.partial"
    shutil.rmtree(staging, ignore_errors=True)
    log.info("copying %s -> %s", src_vae, dest / "vae")
    shutil.copytree(src_vae, staging)
    old = dest / ".vae.old"
    shutil.rmtree(old, ignore_errors=True)
    if (dest / "vae").exists():
        (dest / "vae").rename(old)
    staging.rename(dest / "vae")
    shutil.rmtree(old, ignore_errors=True)
    index = src / "model_index.json"
    if index.is_file():
        shutil.copy2(index, dest / "model_index.json")


def write_provenance(dest: Path, source: str, revision: str | None, summary: dict[str, object]) -> None:
    record = {"source": source, "revision": revision, "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **summary}
    tmp = dest / (PROVENANCE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(dest / PROVENANCE)


def fill(dest: Path, *, repo: str | None, src: Path | None, revision: str | None, force: bool) -> dict[str, object]:
    if not force and is_complete(dest):
        summary = verify(dest)
        log.info("%s is complete (z_dim %s); nothing to do (--force fetches again)", dest, summary["z_dim"])
        return summary
    if src is not None:
        copy_from_dir(src, dest)
        source = f"dir:{src}"
    else:
        assert repo is not None
        fetch_from_hub(repo, dest, revision)
        source = f"hub:{repo}"
    summary = verify(dest)
    write_provenance(dest, source, revision, summary)
    total = sum(summary["files"].values())  # type: ignore[union-attr]
    log.info("%s complete: z_dim %s, %.2f GB in %d files", dest, summary["z_dim"], total / 1e9, len(summary["files"]))  # type: ignore[arg-type]
    return summary


def wait_complete(dest: Path, wait_s: float, poll_s: float) -> bool:
    """Poll until `dest` verifies or `wait_s` passes; log why it is not ready now and then."""
    deadline = time.monotonic() + wait_s
    last_log = -1e9
    while True:
        try:
            summary = verify(dest)
            log.info("%s is complete (z_dim %s)", dest, summary["z_dim"])
            return True
        except (WeightsError, OSError) as exc:
            reason = str(exc)
        now = time.monotonic()
        if now >= deadline:
            log.error("not complete after %.0f s: %s", wait_s, reason)
            return False
        if now - last_log >= 60:  # one line a minute while the weights Job runs
            log.info("waiting for weights: %s", reason)
            last_log = now
        time.sleep(min(poll_s, max(0.0, deadline - now)))


# ------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--dest", type=Path, required=True, help="model folder to fill (the path vaed serve --model names)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--repo", help="hub repository, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    src.add_argument("--from-dir", type=Path, help="copy from this folder instead of the hub (offline)")
    src.add_argument("--check", action="store_true", help="only verify --dest; exit 0 when complete")
    p.add_argument("--revision", help="hub revision (branch, tag or commit; default main)")
    p.add_argument("--force", action="store_true", help="fetch even when --dest is already complete")
    p.add_argument("--wait", type=float, default=0.0, metavar="S", help="with --check: poll up to S seconds")
    p.add_argument("--poll", type=float, default=5.0, metavar="S", help="with --wait: seconds between checks")
    p.add_argument("--expect-z-dim", type=int, choices=[16, 48], help="fail unless the VAE has this z_dim")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if not (args.repo or args.from_dir or args.check):
        build_parser().error("one of --repo, --from-dir or --check is required")
    try:
        if args.check:
            if not wait_complete(args.dest, args.wait, args.poll):
                return 1
            summary = verify(args.dest)
        else:
            summary = fill(args.dest, repo=args.repo, src=args.from_dir, revision=args.revision, force=args.force)
    except WeightsError as exc:
        log.error("%s", exc)
        return 1
    except Exception as exc:  # hub or filesystem failure: one clear line, exit 1 so the Job retries
        log.error("fetch failed: %s: %s", type(exc).__name__, exc)
        return 1
    if args.expect_z_dim is not None and summary["z_dim"] != args.expect_z_dim:
        log.error("%s has z_dim %s, expected %d (wrong repository for this Deployment?)",
                  args.dest, summary["z_dim"], args.expect_z_dim)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
